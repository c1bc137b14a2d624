"""Segments: memfd and named shared memory, their checks, their lifetime, running out."""
import fcntl
import gc
import mmap
import multiprocessing
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import time

import numpy as np
import pytest

import sharedmp as mp
from sharedmp.arrays import mapping_of
from sharedmp.errors import OutOfSharedMemory, SegmentError
from sharedmp.memory import named, recycle, segment

import _workers as w
from conftest import eventually, fds_on, memfd_maps

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def _mapped(key):
    return bool(memfd_maps(key))


# -- memfd ----------------------------------------------------------------------------

def test_memfd_segment_is_sealed_sized_and_anonymous():
    seg, mm = segment.create(65536)
    assert seg.kind == "file_descriptor" and seg.size == len(mm) == 65536
    seals = fcntl.fcntl(seg.fd, fcntl.F_GET_SEALS)
    assert seals & SEALS == SEALS
    assert os.readlink(f"/proc/self/fd/{seg.fd}").startswith("/memfd:sharedmp")
    assert os.fstat(seg.fd).st_size == 65536
    assert os.get_inheritable(seg.fd) is False                 # CLOEXEC
    with pytest.raises(PermissionError):
        os.ftruncate(seg.fd, 4096)                             # no one can shrink it
    with pytest.raises(PermissionError):
        os.ftruncate(seg.fd, 1 << 20)                          # nor grow it
    mm[:5] = np.frombuffer(b"hello", np.uint8)          # a lease: a uint8 array over the mmap
    assert os.pread(seg.fd, 5, 0) == b"hello"
    assert segment.segment_of(mm) is seg and seg in segment.live_segments()


def test_last_view_releases_fd_and_mapping(pool_stays):
    seg, mm = segment.create(2 << 20)
    key = seg.key
    view = np.frombuffer(mm, np.uint8)[::3]
    view2 = view[10:]
    del mm
    gc.collect()
    assert fds_on(key) and _mapped(key)                   # views keep it alive
    del view
    gc.collect()
    assert fds_on(key) and _mapped(key)
    del view2
    gc.collect()
    assert seg.fd == -1 and seg not in segment.live_segments()
    assert recycle.kept()[0] >= 1 and _mapped(key)        # kept, mapped, for reuse by this process
    recycle.clear()
    assert not fds_on(key), "fd of the segment still open after it was let go"
    assert not _mapped(key), "segment still mapped after it was let go"


def test_attach_fd_of_own_segment_is_the_same_mapping():
    seg, mm = segment.create(8192)
    dup = os.dup(seg.fd)
    try:
        assert segment.attach_fd(dup) is mm
        assert segment.attach_fd(seg.fd) is mm
    finally:
        os.close(dup)


def _foreign_memfd(size, seals):
    fd = os.memfd_create("peer", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    if size:
        os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def test_attach_fd_maps_a_sealed_memfd_once_and_releases_it():
    fd = _foreign_memfd(16384, SEALS)
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino)
    try:
        mm = segment.attach_fd(fd)
        assert len(mm) == 16384
        assert segment.attach_fd(fd) is mm                     # once per process
        seg = segment.segment_of(mm)
        assert seg.owner_pid is None and seg.fd not in (-1, fd)
    finally:
        os.close(fd)                                           # borrowed: ours to close
    a = np.ndarray((10,), np.int64, buffer=mm)
    a[:] = 3
    del mm
    gc.collect()
    assert fds_on(key)
    del a
    gc.collect()
    assert fds_on(key), "a small received segment stays among the recent ones"
    segment.forget_recent()
    gc.collect()
    assert not fds_on(key) and not _mapped(key)


def test_a_mapping_holds_the_fds_that_doctor_counts():
    """A received segment holds its own fd, and before 3.13 the dup Python's mmap keeps; from
    3.13 the mapping is made without that dup (trackfd=False). ``held_by`` (doctor's and the
    caches' fd figures) says the same."""
    fd = _foreign_memfd(16384, SEALS)
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino)
    try:
        mm = segment.attach_fd(fd)
    finally:
        os.close(fd)
    seg = segment.segment_of(mm)
    per_mapping = 2 if sys.version_info < (3, 13) else 1
    assert len(fds_on(key)) == per_mapping == segment.held_by([seg])[1]
    mm[:4] = b"abcd"                                           # (still mapped, read and write)
    assert os.pread(seg.fd, 4, 0) == b"abcd"
    del mm
    segment.forget_recent()
    gc.collect()
    assert not fds_on(key) and not _mapped(key)


@pytest.mark.parametrize("size,seals", [
    (4096, 0),                                                 # not sealed at all
    (4096, fcntl.F_SEAL_SHRINK),                               # could still grow
    (4096, fcntl.F_SEAL_GROW),                                 # could be truncated: SIGBUS
    (0, SEALS),                                                # empty
], ids=["unsealed", "shrink-only", "grow-only", "empty"])
def test_attach_fd_refuses_unsealed_memfd(size, seals):
    fd = _foreign_memfd(size, seals)
    try:
        with pytest.raises(SegmentError):
            segment.attach_fd(fd)
    finally:
        os.close(fd)


def test_attach_fd_refuses_what_is_not_a_segment(tmp_path):
    r, wfd = os.pipe()
    s1, s2 = socket.socketpair()
    path = tmp_path / "file"
    path.write_bytes(b"x" * 4096)
    ffd = os.open(path, os.O_RDWR)
    try:
        for fd in (r, wfd, s1.fileno(), ffd):                  # pipe, socket, a disk file
            with pytest.raises(SegmentError):
                segment.attach_fd(fd)
    finally:
        for fd in (r, wfd, ffd):
            os.close(fd)
        s1.close()
        s2.close()
    closed = os.dup(0)
    os.close(closed)
    with pytest.raises(SegmentError):
        segment.attach_fd(closed)                              # not even an fd


# -- named segments -------------------------------------------------------------------

def test_named_segment_in_shm_dir_mode_0600_unlinked_when_last_view_dies(tmp_path, monkeypatch):
    monkeypatch.setenv(named.SHM_DIR_ENV, str(tmp_path))
    seg, mm = named.create(8192)
    assert re.fullmatch(r"sharedmp_[0-9a-f]{20}", seg.name)    # 80 random bits
    path = tmp_path / seg.name
    assert seg.path == str(path) and path.exists()
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 8192
    assert seg.owner_pid == os.getpid() and seg.fd == -1
    view = np.frombuffer(mm, np.uint8)[100:]
    del mm
    gc.collect()
    time.sleep(0.05)                          # the daemon would have unlinked it by now
    assert path.exists()
    del view
    assert eventually(lambda: not path.exists()), "the creator's last view died but the name stays"


def test_named_segment_unlinked_where_it_was_made_even_if_dir_changes(tmp_path, monkeypatch):
    monkeypatch.setenv(named.SHM_DIR_ENV, str(tmp_path))
    seg, mm = named.create(4096)
    path = tmp_path / seg.name
    monkeypatch.setenv(named.SHM_DIR_ENV, str(tmp_path / "elsewhere"))
    del mm
    assert eventually(lambda: not path.exists())


def test_names_are_unique():
    segs = [named.create(4096) for _ in range(20)]
    assert len({s.name for s, _ in segs}) == 20
    del segs


def test_attach_name_is_the_same_mapping_in_the_creator():
    seg, mm = named.create(4096)
    assert named.attach_name(seg.name) is mm


@pytest.mark.parametrize("name", [
    "../etc/passwd", "/etc/passwd", "sharedmp_../../etc/passwd", "sharedmp_" + "0" * 19,
    "sharedmp_" + "0" * 21, "sharedmp_" + "A" * 20, "sharedmp_" + "0" * 19 + "/",
    "torch_" + "0" * 20, "", None, 42, b"sharedmp_" + b"0" * 20,
])
def test_attach_name_refuses_bad_names(name):
    with pytest.raises(SegmentError):
        named.attach_name(name)


def test_attach_name_refuses_missing_and_foreign_files(tmp_path, monkeypatch):
    monkeypatch.setenv(named.SHM_DIR_ENV, str(tmp_path))
    with pytest.raises(SegmentError, match="no longer exists"):
        named.attach_name("sharedmp_" + "0" * 20)
    target = tmp_path / "target"
    target.write_bytes(b"x" * 4096)
    (tmp_path / ("sharedmp_" + "1" * 20)).symlink_to(target)   # a symlink is not followed
    (tmp_path / ("sharedmp_" + "2" * 20)).mkdir()              # a directory
    (tmp_path / ("sharedmp_" + "3" * 20)).write_bytes(b"")     # empty
    for k in "123":
        with pytest.raises(SegmentError):
            named.attach_name("sharedmp_" + k * 20)


def test_attaching_process_never_unlinks(tmp_path, monkeypatch):
    monkeypatch.setenv(named.SHM_DIR_ENV, str(tmp_path))
    mp.set_sharing_strategy("file_system")
    a = mp.zeros(1 << 18)                                      # 2 MiB: a named segment of its own
    seg = mapping_of(a)[1]
    path = tmp_path / seg.name
    ctx = multiprocessing.get_context("spawn")
    r = w.run(ctx, w.attach_and_exit, a[::2], 4.0)            # attaches by name, exits normally
    assert r == {"name": seg.name, "owner": None}
    assert path.exists(), "a process that only attached unlinked the segment"
    assert (a[::2] == 4.0).all() and (a[1::2] == 0).all()
    r = w.run(ctx, w.attach_and_exit, a, 5.0)                  # and again: the name still works
    assert (a == 5.0).all() and path.exists()
    del a
    assert eventually(lambda: not path.exists())


def test_fork_child_unlinks_what_it_created(tmp_path, monkeypatch):
    from conftest import join_or_kill
    monkeypatch.setenv(named.SHM_DIR_ENV, str(tmp_path))
    mp.set_sharing_strategy("file_system")
    keep = mp.zeros(10)                                        # the parent's arena, inherited
    ctx = multiprocessing.get_context("fork")
    # the child exits through os._exit; it must still remove the segments it made itself
    p = ctx.Process(target=_alloc_in_child, daemon=True)
    p.start()
    assert join_or_kill(p) == 0

    def only_the_parents():
        names = {n for n in os.listdir(tmp_path) if n.startswith(named.PREFIX)}
        return names == {mapping_of(keep)[1].name}
    assert eventually(only_the_parents), "a fork child left its segments behind"
    del keep


def _alloc_in_child():
    a = mp.zeros(100)                                          # a fresh arena of the child's
    b = mp.zeros(1 << 18)                                      # and a segment of its own
    a[:] = b[:100] = 1


# -- running out --------------------------------------------------------------------------

@pytest.fixture
def small_tmpfs(tmp_path):
    where = tmp_path / "tmpfs"
    where.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(where)],
                       capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield str(where)
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True, timeout=30).returncode:
            subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def test_full_tmpfs_raises_out_of_shared_memory_not_sigbus(small_tmpfs, monkeypatch):
    monkeypatch.setenv(named.SHM_DIR_ENV, small_tmpfs)
    mp.set_sharing_strategy("file_system")
    ctx = multiprocessing.get_context("spawn")                 # inherits both variables
    r = w.run(ctx, w.exhaust, "tmpfs")                         # exit code 0, not -SIGBUS
    one_big, many_small = r["texts"]
    for text in (one_big, many_small):
        assert text is not None, "allocating more than the tmpfs holds did not raise"
        assert "cannot reserve" in text and small_tmpfs in text          # what ran out, where
        assert "SHAREDMP_SHM_DIR" in text and "file_descriptor" in text  # what to do
    assert "16.0 MiB" in one_big
    assert 0 < r["held"] <= 1024 and r["touched_ok"]           # what was handed out is real
    assert not [n for n in os.listdir(small_tmpfs) if n.startswith(named.PREFIX)]


def test_beyond_machine_memory_raises_out_of_shared_memory():
    mp.set_sharing_strategy("file_descriptor")
    ctx = multiprocessing.get_context("spawn")
    r = w.run(ctx, w.exhaust, "memfd")
    (text,) = r["texts"]
    assert text is not None and "10.0 TiB" in text and "available" in text
    assert "smaller arrays" in text                            # what to do
    assert r["touched_ok"]


def test_out_of_shared_memory_is_a_memory_error():
    assert issubclass(OutOfSharedMemory, MemoryError)
    with pytest.raises(OutOfSharedMemory):
        segment.create(1 << 60)             # refused before any syscall


def test_missing_shm_dir_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv(named.SHM_DIR_ENV, str(tmp_path / "missing"))
    with pytest.raises(OutOfSharedMemory, match="SHAREDMP_SHM_DIR"):
        named.create(4096)


@pytest.mark.parametrize("size", [0, -1])
@pytest.mark.parametrize("maker", [segment, named], ids=["memfd", "named"])
def test_create_refuses_empty_sizes(size, maker, tmp_path, monkeypatch):
    monkeypatch.setenv(named.SHM_DIR_ENV, str(tmp_path))
    with pytest.raises(ValueError, match="> 0"):
        maker.create(size)


def test_segment_of_foreign_objects_is_none():
    anon = mmap.mmap(-1, 4096)
    assert segment.segment_of(anon) is None
    assert segment.segment_of(bytearray(10)) is None
    assert mapping_of(np.zeros(3)) == (None, None)
    anon.close()


def _sealed_memfd(size):
    fd = os.memfd_create("sharedmp", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.posix_fallocate(fd, 0, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, segment.SEALS)
    st = os.fstat(fd)
    return fd, (st.st_dev, st.st_ino)


def test_receiver_keeps_only_its_few_most_recent_small_segments():
    segment.forget_recent()
    made = [_sealed_memfd(4096) for _ in range(segment.KEEP_RECENT + 2)]
    big_fd, big_key = _sealed_memfd(segment.KEEP_RECENT_MAX_SIZE + 4096)
    try:
        for fd, _ in made:
            segment.attach_fd(fd)             # each view dropped at once
        segment.attach_fd(big_fd)
        gc.collect()
        kept = [key for _, key in made if _mapped(key)]
        assert kept == [key for _, key in made[-segment.KEEP_RECENT:]]
        assert not _mapped(big_key), "a big segment must go with its last view"
        segment.forget_recent()
        gc.collect()
        assert not any(_mapped(key) for _, key in made)
    finally:
        for fd, _ in made + [(big_fd, big_key)]:
            os.close(fd)

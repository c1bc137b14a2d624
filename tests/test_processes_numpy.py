"""NumPy arrays between real processes on the standard multiprocessing channels.

The reducers are registered on ForkingPickler by ``import sharedmp``, so standard
``Process`` arguments (spawn, forkserver) and standard ``Pipe`` connections carry
shared arrays through shared memory; under fork the memory is simply inherited.
"""
import gc
import multiprocessing
import os

import numpy as np
import pytest

import sharedmp as mp
from sharedmp.arrays import mapping_of
from sharedmp.memory import arena, named, recycle, segment

import _workers as w
from conftest import TIMEOUT, data_ptr, join_or_kill, segment_memfds


def test_child_writes_into_parent_array(ctx):
    small = mp.zeros(100)
    big = mp.zeros((512, 512))            # 2 MiB: a segment of its own
    view = small[10:20]                   # a view travels as a view of the same memory
    p = ctx.Process(target=w.fill, args=([small[:5], view, big[::2]], 3.5), daemon=True)
    p.start()
    assert join_or_kill(p) == 0
    assert (small[:5] == 3.5).all() and (small[10:20] == 3.5).all()
    assert (small[5:10] == 0).all() and (small[20:] == 0).all()
    assert (big[::2] == 3.5).all() and (big[1::2] == 0).all()


def test_parent_sees_child_allocation_and_later_writes(ctx):
    received, written = ctx.Event(), ctx.Event()
    p, conn = w.start(ctx, w.alloc_and_send, received, written, (64, 3), "int32")
    try:
        a = w.recv(p, conn)
        received.set()
        assert isinstance(a, np.ndarray) and a.shape == (64, 3) and a.dtype == np.int32
        assert mp.is_shared(a)
        assert written.wait(TIMEOUT)
        assert (a == 2).all()             # written by the child after we received it
        assert w.result(p, conn) == "file_descriptor"
        a[...] = 5                        # still ours after the child is gone
        assert (a == 5).all()
    finally:
        conn.close()


def test_plain_array_to_spawned_child_arrives_shared():
    ctx = multiprocessing.get_context("spawn")
    plain = np.arange(60_000, dtype=np.float32).reshape(500, 120)   # over the by-value size
    shared, desc = w.run(ctx, w.report_shared, plain)
    assert shared is True
    assert desc == w.describe(plain)      # values, shape, strides, dtype, flags
    assert not mp.is_shared(plain)        # the sender's original stays what it was


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_big_plain_array_sent_before_its_copy_is_gone(strategy):
    # A plain array >= 1 MiB is copied into a segment of its own that nothing but the
    # message references: the copy must live until its fd or name is on its way (spawn
    # arguments, sharedmp Pipe).
    mp.set_sharing_strategy(strategy)
    ctx = mp.get_context("spawn")
    plain = np.arange(300000, dtype=np.float64)
    shared, desc = w.run(ctx, w.report_shared, plain)
    assert shared is True and desc == w.describe(plain)
    a, b = ctx.Pipe()
    a.send(plain + 1)
    got = b.recv()
    assert mp.is_shared(got) and (got == plain + 1).all()
    a.close()
    b.close()


def test_same_array_twice_same_pointer_and_back_home_same_memory():
    ctx = multiprocessing.get_context("spawn")
    done = ctx.Event()
    a = mp.zeros(1000)
    big = mp.zeros(1 << 18)               # own segment
    sent = [a, a, a[100:200], big, big[::-1]]
    p, conn = w.start(ctx, w.echo, done, len(sent), duplex=True)
    try:
        for x in sent:                    # separate messages
            conn.send(x)
        kind, ptrs = w.recv(p, conn)
        assert kind == "ptrs"
        assert ptrs[0] == ptrs[1]                              # same memory, same pointer
        assert ptrs[2] - ptrs[0] == data_ptr(a[100:200]) - data_ptr(a)  # and views relative to it
        assert ptrs[4] - ptrs[3] == data_ptr(big[::-1]) - data_ptr(big)
        back = [w.recv(p, conn) for _ in sent]
        done.set()
        assert w.result(p, conn) is None
        for x, y in zip(sent, back):      # received back here: the very same memory
            assert data_ptr(x) == data_ptr(y) and x.strides == y.strides
            assert mapping_of(x)[0] is mapping_of(y)[0]
        back[0][0] = 42
        assert a[0] == 42
    finally:
        conn.close()


def _shm_entries():
    """sharedmp's names in the shared-memory directory (multiprocessing's sem.mp-* are not
    ours)."""
    return {n for n in os.listdir(named.shm_dir()) if n.startswith(named.PREFIX)}


def _memfd_fds():
    """The inodes of this process's fds on sharedmp memfds."""
    return set(segment_memfds().values())


def _memfd_maps():
    with open("/proc/self/maps") as f:
        return {int(line.split()[4]) for line in f if "memfd:sharedmp" in line}


def _arena_inodes():
    return {segment.segment_of(a.mapping).key[1] for a in arena._current.values()
            if segment.segment_of(a.mapping).kind == "file_descriptor"}


def test_file_descriptor_leaves_nothing_behind(ctx):
    mp.set_sharing_strategy("file_descriptor")
    shm_before = _shm_entries()
    fds_before, maps_before = _memfd_fds(), _memfd_maps()

    arrays = [mp.zeros(10), mp.zeros(1 << 18), mp.share(np.ones(7))]
    p = ctx.Process(target=w.fill, args=(arrays, 1.0), daemon=True)
    p.start()
    assert join_or_kill(p) == 0
    received, written = ctx.Event(), ctx.Event()
    p, conn = w.start(ctx, w.alloc_and_send, received, written, 1 << 18, "uint8")
    try:
        got = w.recv(p, conn)
        received.set()
        assert written.wait(TIMEOUT) and (got == 2).all()
        w.result(p, conn)
    finally:
        conn.close()
    assert all((x == 1).all() for x in arrays)
    assert _shm_entries() == shm_before       # nothing named, ever
    assert _memfd_fds() - fds_before                       # while held: they are here
    del arrays, got
    segment.forget_recent()        # a receiver keeps its last few arenas mapped on purpose
    gc.collect()
    recycle.clear()                # and a creator the segments it may reuse
    keep = _arena_inodes()
    assert _memfd_fds() - fds_before <= keep, "segment fds left after the arrays died"
    assert _memfd_maps() - maps_before <= keep, "segment mappings left after the arrays died"
    assert _shm_entries() == shm_before


def test_child_with_low_fd_limit_keeps_10000_arrays():
    ctx = multiprocessing.get_context("spawn")
    arrays = [mp.zeros(16) for _ in range(10_000)]
    for i, a in enumerate(arrays):
        a[0] = i
    nsegs = len({id(mapping_of(a)[0]) for a in arrays})
    assert nsegs <= 3
    p, conn = w.start(ctx, w.keep_many, 256, 10, duplex=True)
    try:
        assert w.recv(p, conn) == ("ready", None)
        for k in range(10):                 # ten messages of 1,000 arrays each
            conn.send(arrays[k * 1000:(k + 1) * 1000])
        r = w.result(p, conn)
    finally:
        conn.close()
    assert r["limit"] == 256
    assert r["count"] == 10_000 and r["values_ok"]
    assert r["segments"] <= nsegs + 1
    # stdin/out/err, the pipe, a few of the interpreter's own, two per segment
    assert r["fds"] <= 12 + 2 * r["segments"], f"child holds {r['fds']} fds for 10,000 arrays"
    print(f"child fd count with 10,000 arrays kept: {r['fds']} ({r['segments']} segments)")


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_the_copy_of_a_plain_argument_goes_once_the_child_has_it(sharing_strategy, method):
    """A plain array over the by-value size, passed to a spawn or forkserver Process, is
    copied into shared memory for the launch; once start() has returned the child has its
    fd or name, so the copy is not kept with the Process object (the standard library's
    start() drops the arguments themselves)."""
    ctx = mp.get_context(method)
    before = segment_memfds()
    plain = np.arange(1 << 18, dtype=np.float64)         # 2 MiB: a segment of its own
    p = ctx.Process(target=w.fill, args=([plain], 1.0), daemon=True)
    p.start()
    assert join_or_kill(p) == 0
    del plain
    gc.collect()
    mp.empty_cache()
    assert segment.live_segments() == [] and segment_memfds() == before
    assert p.exitcode == 0             # (the Process object is alive, and holds no copy)

"""Recycling memfd segments: reused only once no other process (nor a message) holds them."""
import gc
import os
import subprocess
import sys

import numpy as np
import pytest

import sharedmp as mp
from sharedmp.arrays import mapping_of
from sharedmp.memory import arena, recycle, segment

from conftest import TIMEOUT, eventually, join_or_kill

BIG = 2 << 20          # its own segment (arena.SMALL_LIMIT is 1 MiB)


@pytest.fixture(autouse=True)
def fd_strategy(pool_stays):
    mp.set_sharing_strategy("file_descriptor")
    recycle.clear()
    yield
    recycle.clear()


def inode(a):
    return mapping_of(a)[1].key


def _hold(inbox, outbox, done):
    a = inbox.get(timeout=TIMEOUT)
    outbox.put(("got", int(a[0])))
    done.wait(TIMEOUT)
    outbox.put(("still", int(a.sum())))     # what it sees after the parent allocated again


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_not_reused_while_another_process_holds_it(method):
    ctx = mp.get_context(method)
    inbox, outbox, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_hold, args=(inbox, outbox, done))
    p.start()
    try:
        a = mp.full(BIG, 1, np.uint8)
        key = inode(a)
        inbox.put(a)
        assert outbox.get(timeout=TIMEOUT) == ("got", 1)
        del a
        gc.collect()
        assert recycle.kept()[0] == 1
        b = mp.full(BIG, 2, np.uint8)                   # the child still maps the first one
        assert inode(b) != key
        done.set()
        assert outbox.get(timeout=TIMEOUT) == ("still", BIG)  # its ones were not overwritten
    finally:
        join_or_kill(p)
    assert p.exitcode == 0
    c = mp.zeros(BIG, np.uint8)                          # the child is gone: reused, and zeroed
    assert inode(c) == key and not c.any()


def test_not_reused_while_a_message_carries_it():
    q = mp.SimpleQueue()
    a = mp.full(BIG, 7, np.uint8)
    key = inode(a)
    q.put(a)                                             # in the socket, not received yet
    del a
    gc.collect()
    b = mp.full(BIG, 9, np.uint8)
    assert inode(b) != key
    got = q.get()
    assert inode(got) == key and (got == 7).all()
    del got
    segment.forget_recent()                              # a receiver keeps recent small segments mapped
    gc.collect()
    assert inode(mp.empty(BIG, np.uint8)) == key         # received and dropped: reused
    q.close()


def _sum_later(a, go, out):
    go.wait(TIMEOUT)
    out.put(int(a.sum()))


def test_not_reused_while_a_fork_child_inherits_it():
    ctx = mp.get_context("fork")
    a = mp.full(BIG, 3, np.uint8)
    key = inode(a)
    go, out = ctx.Event(), ctx.SimpleQueue()
    p = ctx.Process(target=_sum_later, args=(a, go, out))
    p.start()
    try:
        del a
        gc.collect()
        b = mp.full(BIG, 5, np.uint8)
        assert inode(b) != key
        go.set()
        assert out.get() == 3 * BIG
    finally:
        join_or_kill(p)
    assert eventually(lambda: inode(mp.empty(BIG, np.uint8)) == key)


def test_reused_memory_is_zeroed_unless_overwritten():
    a = mp.full(BIG, 255, np.uint8)
    key = inode(a)
    del a
    z = mp.empty(BIG // 8, np.float64)                  # same size, another dtype
    assert inode(z) == key and not z.any()
    z[:] = 1.5
    del z
    f = mp.full(BIG, 4, np.uint8)
    assert inode(f) == key and (f == 4).all()
    del f
    src = np.arange(BIG // 4, dtype=np.int32)
    s = mp.share(src)
    assert inode(s) == key and (s == src).all()


def test_arenas_are_reused_and_zeroed():
    arena._current.clear()                               # start a fresh arena
    first = [mp.full(1000, 7, np.uint8) for _ in range(10)]
    key = inode(first[0])
    del first
    arena._current.clear()                               # the allocator lets go of it too
    gc.collect()
    again = mp.zeros(1000, np.uint8)
    assert inode(again) == key and not again.any()


def test_a_reused_arena_is_zeroed_only_once_zeros_are_needed():
    arena._current.clear()
    first = [mp.full(1000, 7, np.uint8) for _ in range(10)]
    key = inode(first[0])
    del first
    arena._current.clear()
    gc.collect()
    f = mp.full(1000, 3, np.uint8)                       # overwritten anyway: nothing zeroed
    current = arena._current["file_descriptor"]
    assert inode(f) == key and current.dirty and (current.mapping[1024:2024] == 7).all()
    z = mp.zeros(5000, np.uint8)                         # the first region that must be zero:
    assert inode(z) == key and not z.any() and not current.dirty     # the rest is zeroed at once
    assert not current.mapping[1024:].any() and (f == 3).all()
    assert not mp.zeros(100, np.uint8).any()


def test_kept_memory_and_fds_are_bounded():
    arrays = [mp.empty(BIG + 4096 * i, np.uint8) for i in range(40)]   # 40 different sizes
    del arrays
    gc.collect()
    count, nbytes = recycle.kept()
    assert count <= recycle.MAX_ENTRIES and nbytes <= recycle.limit()
    huge = mp.empty(recycle.limit() // 4 + 4096, np.uint8)             # too big to keep
    del huge
    gc.collect()
    assert recycle.kept()[1] <= recycle.limit()


def _run(code, **env):
    e = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True,
                          timeout=TIMEOUT)


def test_the_setting_turns_it_off_and_a_bad_value_is_named():
    code = ("import gc, numpy as np, sharedmp as mp; from sharedmp.arrays import mapping_of\n"
            "a = mp.empty(1 << 21, np.uint8); k = mapping_of(a)[1].key; del a; gc.collect()\n"
            "print(mapping_of(mp.empty(1 << 21, np.uint8))[1].key == k)")
    assert _run(code, SHAREDMP_RECYCLE_BYTES="0").stdout.strip() == "False"
    assert _run(code).stdout.strip() == "True"
    r = _run(code, SHAREDMP_RECYCLE_BYTES="lots")
    assert r.returncode != 0 and "SHAREDMP_RECYCLE_BYTES" in r.stderr and "'lots'" in r.stderr


def test_containing_finds_the_segment_recycled_at_the_same_address():
    """containing() remembers the segment it found last; a recycled segment is a new Segment
    over the same mapping (same address), which it must find, not the released one."""
    a = mp.full(BIG, 1, np.uint8)
    address = a.ctypes.data
    first = segment.containing(address, BIG)[0]
    assert first is mapping_of(a)[1]
    del a
    gc.collect()
    assert segment.containing(address, BIG) == (None, None)   # released: nothing lives there
    b = mp.full(BIG, 2, np.uint8)
    assert b.ctypes.data == address                             # the same memory, recycled
    again, mm = segment.containing(address, BIG)
    assert again is mapping_of(b)[1] and again is not first and mm is not None

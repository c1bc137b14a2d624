"""Packing small arrays into arenas: few segments, no overlap, few fds per message, fork
safety."""
import gc
import multiprocessing

import numpy as np
import pytest
from multiprocessing.reduction import ForkingPickler

import sharedmp as mp
from sharedmp.arrays import mapping_of
from sharedmp.channels import fdpass
from sharedmp.memory import arena, recycle, segment

import _workers as w
from conftest import data_ptr, segment_memfds


def _segment_fd_count():
    return len(segment_memfds())


def _assert_disjoint(arrays):
    spans = sorted((data_ptr(a), data_ptr(a) + a.nbytes) for a in arrays)
    for (s0, e0), (s1, e1) in zip(spans, spans[1:]):
        assert e0 <= s1, f"regions [{s0:#x}, {e0:#x}) and [{s1:#x}, {e1:#x}) overlap"


def test_10000_small_arrays_use_few_segments_and_fds():
    gc.collect()
    segs_before, fds_before = len(segment.live_segments()), _segment_fd_count()
    arrays = [mp.zeros(16) for _ in range(10_000)]
    used = {id(mapping_of(a)[0]) for a in arrays}
    assert len(used) <= 2                                   # 1.25 MiB in 4 MiB arenas
    assert len(segment.live_segments()) - segs_before <= 2
    assert _segment_fd_count() - fds_before <= 6     # sent, private and the mapping's, per arena
    assert all(mp.is_shared(a) and a.dtype == np.float64 and not a.any() for a in arrays)
    _assert_disjoint(arrays)
    for i, a in enumerate(arrays):                          # no two arrays share memory
        a[:] = i
    assert all((a == i).all() for i, a in enumerate(arrays))


def test_regions_are_aligned_and_never_handed_out_twice():
    sizes = [1, 3, 64, 65, 100, 1000, 0, 4096, 7, (1 << 20) - 1]
    arrays = [mp.empty(n, np.uint8) for n in sizes * 5]
    for a in arrays:
        if a.size:
            assert data_ptr(a) % arena.ALIGN == 0
    _assert_disjoint(arrays)
    for i, a in enumerate(arrays):
        a[...] = i % 256
    assert all((a == i % 256).all() for i, a in enumerate(arrays))


def test_big_arrays_get_a_segment_of_their_own():
    a = mp.empty(arena.SMALL_LIMIT, np.uint8)
    mm, seg = mapping_of(a)
    assert seg.size == len(mm) == arena.SMALL_LIMIT
    assert all(mm is not x.mapping for x in arena._current.values())
    small = mp.empty(arena.SMALL_LIMIT - 1, np.uint8)
    assert mapping_of(small)[1].size == arena.ARENA_SIZE


def test_full_arena_is_replaced_and_freed_when_its_arrays_die(pool_stays):
    gc.collect()
    first = mp.zeros(8)
    seg = mapping_of(first)[1]
    inode = seg.key[1]
    filler = [mp.empty(arena.SMALL_LIMIT - 64, np.uint8)
              for _ in range(arena.ARENA_SIZE // arena.SMALL_LIMIT + 1)]
    assert any(mapping_of(x)[1] is not seg for x in filler)
    assert arena._current["file_descriptor"].mapping is not mapping_of(first)[0]
    assert seg in segment.live_segments()                   # still alive through its arrays
    del first, filler
    gc.collect()
    assert seg not in segment.live_segments() and seg.fd == -1

    def mapped():
        with open("/proc/self/maps") as f:
            return any("memfd:sharedmp" in line and int(line.split()[4]) == inode for line in f)
    assert mapped() and recycle.kept()[0] >= 1              # kept for reuse, still mapped
    recycle.clear()
    assert not mapped()


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_message_of_1000_small_arrays_carries_one_fd_per_arena(strategy):
    mp.set_sharing_strategy(strategy)
    arrays = [mp.zeros(10, np.float32) for _ in range(1000)]
    arenas = {id(mapping_of(a)[0]) for a in arrays}
    assert len(arenas) <= 2
    oob = fdpass.OutOfBand()
    prev = fdpass.swap(oob)
    try:
        data = ForkingPickler.dumps(arrays)
    finally:
        fdpass.swap(prev)
    assert len(oob.fds) == (len(arenas) if strategy == "file_descriptor" else 0)
    assert len(data) < 1000 * 200                           # a small header per array
    prev = fdpass.swap(fdpass.OutOfBand(list(oob.fds)))
    try:
        got = ForkingPickler.loads(data)
    finally:
        fdpass.swap(prev)
    assert [data_ptr(g) for g in got] == [data_ptr(a) for a in arrays]


def test_message_with_arrays_from_several_arenas_and_big_segments():
    arrays = [mp.zeros(100) for _ in range(1000)]
    arrays += [mp.empty(arena.SMALL_LIMIT // 2, np.uint8) for _ in range(12)]  # spans 2+ arenas
    big = [mp.zeros(1 << 17) for _ in range(3)]                                 # 3 own segments
    segs = {id(mapping_of(a)[0]) for a in arrays + big}
    oob = fdpass.OutOfBand()
    prev = fdpass.swap(oob)
    try:
        ForkingPickler.dumps(arrays + big + arrays[:10])
    finally:
        fdpass.swap(prev)
    assert len(oob.fds) == len(segs) <= 8


def test_fork_child_allocates_from_a_fresh_arena():
    mp.set_sharing_strategy("file_descriptor")
    ctx = multiprocessing.get_context("fork")
    mine = mp.zeros(16)                                     # the parent's current arena
    parent_key = mapping_of(mine)[1].key
    received, checked = ctx.Event(), ctx.Event()
    p, conn = w.start(ctx, w.fork_alloc, received, checked, parent_key)
    try:
        child_key, c = w.recv(p, conn)
        received.set()
        assert child_key != parent_key
        later = [mp.zeros(16) for _ in range(1000)]         # the parent keeps carving its arena
        for x in later:
            x[:] = 3
        checked.set()
        r = w.result(p, conn)
    finally:
        conn.close()
    assert r["differs"] and r["still_7"]
    assert (c == 7).all()
    assert not any(np.shares_memory(c, x) for x in later + [mine])
    assert all(mapping_of(x)[1].key != child_key for x in later)


def test_fork_child_arena_starts_empty_in_the_child():
    """The arena bookkeeping is per process: a fork child begins with none."""
    ctx = multiprocessing.get_context("fork")
    mp.zeros(1)
    assert arena._current
    r = w.run(ctx, _current_arenas)
    assert r == 0


def _current_arenas(conn):
    w._guard(conn, lambda: len(arena._current))

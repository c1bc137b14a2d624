"""A forked child keeps reading its own bytes: no segment it maps is recycled under it.

A child forked while its parent maps segments holds them too. Under file_system it says so
to the manager daemon on a connection of its own, after the fork; the parent, going on at
once, could park and reuse a segment before the daemon heard of the child (issue 40: both
children of a fork context read the second array's bytes). The parent now holds them for
the child across the fork (daemon.py, "Fork"). Under file_descriptor the kernel tells
(recycle.py: the child's copy of the shared fd keeps the flock).

Each test here gives the parent every chance to reuse the memory (it drops its arrays,
waits for the daemon to pool them, and allocates as many again) before the child reads.
"""
import gc
import os
import sys

import numpy as np
import pytest

import sharedmp as mp
from sharedmp.memory import manager, recycle

from conftest import TIMEOUT, eventually, fork_and_wait, join_or_kill, run_bounded
from test_fs_recycle import fs, listed, pooled  # noqa: F401 (fs: a fixture)

# (name, elements of float64, how many): by value, carved from arenas (more than one
# arena's worth, so that a full arena is let go and parked too), a segment of its own each
SIZES = [("by value", 64, 4), ("arena", 2048, 300), ("own segment", 1 << 19, 4)]
POOL_WAIT = 0.5         # how long the parent waits for the daemon to pool what it dropped


@pytest.fixture(params=["file_descriptor", "file_system"])
def strategy(request):
    """The strategy, and under file_system the shm directory of this test's own
    (test_fs_recycle's ``fs``: checked empty once everything is let go)."""
    if request.param == "file_system":
        return request.param, request.getfixturevalue("fs")
    mp.set_sharing_strategy(request.param)
    recycle.clear()
    return request.param, None


def _fill(tag0):
    """Arrays of every size class, each filled with its own tag; {tag: array}."""
    out, tag = {}, tag0
    for _, n, count in SIZES:
        for _ in range(count):
            a = np.full(n, float(tag)) if n == 64 else mp.zeros(n)
            a[:] = tag
            out[tag] = a
            tag += 1
    return out


def _wrong(arrays):
    """The tags whose array no longer holds only its tag."""
    return [t for t, a in arrays.items() if not (a.min() == a.max() == t)]


def _drop_and_reuse(d, held, new):
    """(parent) Drop the inherited arrays, let the daemon pool them, allocate as many again
    (filled with other tags) into ``new``."""
    held.clear()
    gc.collect()
    if d is not None:           # (the old bug: pooled while the child still mapped them)
        eventually(lambda: len(pooled(d)) >= 4, timeout=POOL_WAIT)
    new.update(_fill(-100000))


def test_a_raw_fork_child_keeps_its_bytes_when_the_parent_reuses(strategy):
    _, d = strategy
    held, new = _fill(1), {}
    r, w = os.pipe()

    def child():
        os.close(w)
        os.read(r, 1)                         # the parent has dropped and reallocated
        return not _wrong(held)

    def meanwhile():
        os.close(r)
        _drop_and_reuse(d, held, new)
        os.write(w, b"x")
        os.close(w)

    assert fork_and_wait(child, meanwhile=meanwhile) == 0
    assert not _wrong(new)


def _report(arrays, go, q):
    go.wait(TIMEOUT)
    q.put(_wrong(arrays))


def test_a_fork_context_child_keeps_its_bytes(strategy):
    """The issue's program: each child gets its array by fork, the parent drops it at once."""
    ctx = mp.get_context("fork")
    q, go, procs, new = ctx.Queue(), ctx.Event(), [], {}
    try:
        for tag in (1, 2):
            arrays = _fill(tag * 1000)
            p = ctx.Process(target=_report, args=(arrays, go, q))
            p.start()
            procs.append(p)
            del arrays
        _drop_and_reuse(strategy[1], {}, new)
        go.set()
        assert [q.get(timeout=TIMEOUT) for _ in procs] == [[], []]
    finally:
        for p in procs:
            join_or_kill(p)
    assert not _wrong(new)


# (not forkserver: the fork server keeps the environment it started with, so its children
# would look for this test's segments in another directory)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_empty_cache_gives_every_segment_back_before_it_returns(strategy, method):
    """A child held the arrays and exited; once the parent drops them, ``empty_cache()``
    returns with every segment gone (under file_system: the daemon has unlinked them)."""
    _, d = strategy
    ctx = mp.get_context(method)
    # (segments the daemon counts for other tests of this pytest worker: a warm joblib pool,
    # a module's dataset; not this test's, which are all gone at the end)
    before = manager.stats()["segments"] if d is not None else 0
    for _ in range(2):
        arrays = _fill(1)
        q, go = ctx.Queue(), ctx.Event()
        go.set()
        p = ctx.Process(target=_report, args=(arrays, go, q))
        p.start()
        assert q.get(timeout=TIMEOUT) == []
        join_or_kill(p)
        del arrays
        gc.collect()
        mp.empty_cache()
        if d is not None:
            assert listed(d) == [] and pooled(d) == [], (manager.stats(), listed(d), pooled(d))
            assert manager.stats()["segments"] <= before


DRIVER = os.path.join(os.path.dirname(__file__), "_fork_thread_driver.py")


@pytest.mark.parametrize("mode", ["raw", "context"])
def test_a_fork_beside_a_thread_that_allocates_keeps_the_childs_bytes(mode, tmp_path):
    """Issue 46: a thread of the parent makes and drops arrays while the main thread forks.
    The moment between the parent's hold and the fork is widened (the driver's docstring):
    before the fork hold shut registration out, nearly every child read another array's
    bytes there (the segments a thread made in that moment were not held for it)."""
    env = {k: v for k, v in os.environ.items() if k != "SHAREDMP_MANAGER"}  # (its own daemon)
    code, out, err = run_bounded([sys.executable, DRIVER, mode, "40", str(tmp_path), "3"],
                                 timeout=120, env=env)
    assert code == 0, err[-3000:]
    assert out.strip() == "wrong 0 of 40", (out, err[-3000:])
    # (the daemon removes its pool directory as it exits, a moment after the program)
    assert eventually(lambda: os.listdir(tmp_path) == [], timeout=10), os.listdir(tmp_path)

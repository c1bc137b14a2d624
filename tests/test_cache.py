"""Memory goes back: caches are released when idle or on demand, and under file_system a
message that can no longer be received stops keeping its segments.

The whole-program cases run ``_cache_drivers.py`` in subprocesses (fresh caches, their own
daemon) and check what the issue asks: after a program drops every array, within 2 s of
waiting in a channel (or at its next allocation after the idle time), no ``sharedmp_*``
file, memfd fds back to the baseline, system Shmem back within 8 MiB. And that no thread
of sharedmp's does it: a process that holds arrays, datasets and channels runs none
(issue 47), so a fork warns where the standard library's would.
"""
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time

import numpy as np
import pytest

import sharedmp as mp
from sharedmp.memory import arena, cache, named, recycle, segment

from conftest import TIMEOUT, run_bounded

HERE = os.path.dirname(os.path.abspath(__file__))
DRIVERS = os.path.join(HERE, "_cache_drivers.py")
STRATEGIES = ["file_descriptor", "file_system"]
SLACK = 8 << 20
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="needs /proc and memfd")


@pytest.fixture
def shm(tmp_path):
    """A directory of its own on tmpfs (so that named segments count in Shmem)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else str(shm)
    directory = tempfile.mkdtemp(prefix="sharedmp-cache-test-", dir=base)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def drive(directory, *args, timeout=180):
    env = {k: v for k, v in os.environ.items()
           if k not in ("SHAREDMP_MANAGER", mp.strategy.ENV, cache.ENV)}
    env[named.SHM_DIR_ENV] = directory
    for blas in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[blas] = "1"         # (NumPy's BLAS starts threads of its own otherwise)
    rc, out, err = run_bounded([sys.executable, DRIVERS, *map(str, args)], timeout=timeout,
                               env=env)
    assert rc == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@linux_only
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_everything_goes_back_within_two_seconds_of_the_last_drop(shm, strategy):
    # 8 x 64 MiB and 200 x 512 KiB arrays made here, 2,000 small ones, 50 messages from a
    # child and 40 results of Pool workers (which stay alive): all dropped; then the program
    # waits in a channel (a Pipe's poll, as a consumer waits for its next message).
    r = drive(shm, "drop_all", strategy, "wait")
    assert r["peak"]["mapped"] > r["base"]["mapped"] + (512 << 20)     # it did hold the memory
    # Alone: 1 s idle, then the next pass in the wait, within 0.25 s. The bound is for a busy
    # machine (CI runs two suites at once: 1 GB of segments unlinked by a daemon that gets
    # little CPU took over 5 s once); what it catches is memory never given back.
    assert r["took"] is not None and r["took"] <= 15.0, r
    assert r["last"]["files"] == [] and r["last"]["fds"] <= r["base"]["fds"]


@linux_only
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_allocation_after_idle_gives_the_old_cache_back(shm, strategy):
    # The same program, then idle without a sharedmp call (time.sleep) for longer than the
    # idle time: no thread gives anything back meanwhile; its next allocation (one small
    # array) does, before it returns.
    r = drive(shm, "drop_all", strategy, "allocate")
    base, idle, at_once = r["base"], r["idle"], r["at_once"]
    cached = {k: v for k, v in idle["held"].items() if k != "mapped" and v != [0, 0]}
    assert cached and idle["mapped"] > base["mapped"], r                # still cached, idle
    assert all(v == [0, 0] for k, v in at_once["held"].items() if k != "mapped"), r
    assert at_once["threads"] == ["MainThread"], r
    # what it maps now: the new array's arena (4 MiB), nothing else
    assert at_once["mapped"] <= base["mapped"] + arena.ARENA_SIZE, r
    assert at_once["fds"] <= base["fds"] + 3, r      # (the arena's: fd, recycle fd, mmap's dup)
    assert r["took"] is not None and r["took"] <= 15.0, r               # files: the daemon's


@linux_only
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_parent_waiting_in_join_gives_its_cache_back(shm, strategy):
    # The same program, then join() a child that sleeps past the idle time: what the caches
    # kept is let go while the parent waits, by no thread.
    r = drive(shm, "drop_all", strategy, "join")
    at_once = r["at_once"]
    assert at_once["exitcode"] == 0, r
    assert all(v == [0, 0] for k, v in at_once["held"].items() if k != "mapped"), r
    assert at_once["threads"] == ["MainThread"], r


@linux_only
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_empty_cache_gives_everything_back_at_once(shm, strategy):
    r = drive(shm, "drop_all", strategy, "empty_cache")
    at_once, base = r["at_once"], r["base"]
    assert at_once["fds"] <= base["fds"]
    if strategy == "file_descriptor":       # closed and unmapped by the call itself
        # (this process's mappings: the machine's Shmem also moves with a suite run beside it)
        assert at_once["mapped"] <= base["mapped"], r
    else:                                   # the daemon has unlinked them when it returns
        assert at_once["files"] == [], r
    # (and the machine's Shmem back too, within the driver's 30 s: how soon is not asserted,
    # it moves with whatever else the machine runs; seen 8.6 s with CI's two suites at once)
    assert r["took"] is not None, r


@linux_only
@pytest.mark.slow    # (.ci/run: 3.11 only)
def test_segments_of_killed_senders_go_while_the_program_runs(shm):
    # 20 rounds: a file_system sender SIGKILLed in the middle of a stream of put()s; what
    # it sent is received; then none of its segments is left within 5 s.
    r = drive(shm, "killed_senders", 20, timeout=400)
    assert "error" not in r["rounds"], r
    assert all(t is not None and t <= 5 for t in r["rounds"]), r
    assert r["daemon"]["in_flight"] == 0 and r["daemon"]["segments"] == 0, r
    assert r["daemon"]["tokens"] == 0, r                             # the daemon forgot them too


@linux_only
def test_a_queue_dropped_with_unread_messages_lets_their_segments_go(shm):
    r = drive(shm, "dropped_queue", 100)
    assert r["unread_files"] >= 200 and r["in_flight"] >= 200, r    # they were there, in flight
    assert r["took"] is not None and r["took"] <= 2.0, r
    assert r["daemon"]["in_flight"] == 0 and r["daemon"]["tokens"] == 0, r


@linux_only
def test_a_stream_reuses_its_segments_instead_of_releasing_them(shm):
    # 100 fresh 1 MiB arrays 20 ms apart (2 s in all, longer than the idle time): the
    # producer's recycled segments are reused all along.
    r = drive(shm, "stream_reuse", "file_descriptor")
    assert r["segments"] <= 8, r


# -- in this process ----------------------------------------------------------------------

def test_an_idle_current_arena_is_let_go_and_one_in_use_is_carved_further():
    mp.set_sharing_strategy("file_descriptor")
    keep = mp.zeros(10)
    mapping = mp.arrays.mapping_of(keep)[0]
    cache.expire(None)                                   # as if idle: let go of the arena
    assert not arena.is_current(mapping)
    again = mp.zeros(10)                                 # `keep` still uses it: carved further
    assert mp.arrays.mapping_of(again)[0] is mapping and arena.is_current(mapping)
    del keep, again, mapping
    cache.expire(None)
    assert "file_descriptor" not in arena._current


@linux_only
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_sharedmp_thread_while_a_process_holds_arrays_datasets_and_channels(shm, strategy):
    # After each step (arrays made, an array through a Queue to itself, arrays received from
    # a child, a SharedList, a Pipe's traffic both ways, all dropped, idle, a wait in get())
    # the program has its main thread only, one OS task, and a fork records no warning (on
    # 3.12+ CPython warns at the fork of a process with threads; on 3.11 the counts tell).
    r = drive(shm, "no_thread", strategy)
    steps = [k for k in r if k != "held after the wait"]
    assert len(steps) == 10, r
    for step in steps:
        assert r[step] == {"names": ["MainThread"], "tasks": 1, "fork_warnings": [],
                           "cache_thread": False}, (step, r[step])
    # and the wait in get() gave every cache back
    assert all(v == [0, 0] for v in r["held after the wait"].values()), r


@linux_only
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_consumer_waiting_in_get_gives_its_cache_back_without_a_thread(shm, strategy):
    # A burst received from a child and arrays of its own, all dropped: cached. Then a
    # get(timeout) longer than the idle time, with nothing to get: the passes run in it.
    r = drive(shm, "waiting_consumer", strategy)
    assert sum(v[0] for v in r["before"].values()) > SLACK, r           # it did keep some
    assert r["published_before"] == r["before"], r                      # (as doctor saw it)
    assert all(v == [0, 0] for v in r["after"].values()), r
    assert all(v == [0, 0] for v in r["published_after"].values()), r   # doctor sees it too
    assert r["mapped"] == 0 and r["files"] == [], r
    assert r["threads_before"] == r["threads"] == ["MainThread"] and r["tasks"] == 1, r
    assert r["waited"] >= 1.0, r                                        # (it did wait)


def test_a_lazy_pass_never_waits_for_one_under_way(monkeypatch):
    # A pass under way (another thread's, empty()): tick() skips, at once, and a wait in a
    # channel goes on waiting (not spinning) until its timeout.
    monkeypatch.setattr(cache, "_due", 0.0)                # due
    ran = []
    monkeypatch.setattr(cache, "_pass", lambda threaded: ran.append(threaded))
    assert cache._pass_lock.acquire(timeout=TIMEOUT)
    try:
        done = threading.Event()
        t = threading.Thread(target=lambda: (cache.tick(), done.set()), daemon=True)
        t.start()
        assert done.wait(TIMEOUT) and ran == []
        reader, writer = mp.Pipe(duplex=False)
        t0 = time.monotonic()
        assert not reader.poll(0.6)
        assert 0.55 <= time.monotonic() - t0 < 5 and ran == []
        reader.close()
        writer.close()
    finally:
        cache._pass_lock.release()
    cache.tick()                                           # free: it runs
    assert ran == [False]


def test_a_pass_is_due_only_while_a_cache_keeps_something():
    mp.set_sharing_strategy("file_descriptor")
    mp.empty_cache()
    cache._due = 0.0
    cache.tick()                    # a pass: whatever other tests left, nothing is kept now
    if cache.due() != math.inf:
        pytest.skip("another test's arrays keep something cached in this process")
    a = mp.zeros(1 << 21)           # a segment of its own: mapped, a pass soon
    assert time.monotonic() < cache.due() <= time.monotonic() + cache.TICK
    del a                           # into the pool
    assert recycle.kept()[0] == 1
    mp.empty_cache()
    cache._due = 0.0
    cache.tick()                    # nothing is kept any more: no pass until one is
    assert cache.due() == math.inf


def test_stats_show_what_is_cached():
    mp.set_sharing_strategy("file_descriptor")
    mp.empty_cache()
    a = mp.zeros(1 << 21)                                # 16 MiB, its own segment
    del a
    s = cache.stats()
    assert s["pid"] == os.getpid()
    assert s["cache"]["pool"][0] >= 16 << 20 and s["cache"]["pool"][1] >= 1
    mp.empty_cache()
    assert cache.stats()["cache"]["pool"] == [0, 0]
    cache._publish()
    published = cache.read_stats(os.getpid())
    assert published is not None and published["pid"] == os.getpid()


def test_the_pool_stays_below_a_quarter_of_the_memory_that_is_left():
    mp.set_sharing_strategy("file_descriptor")
    real = segment.available_memory_cached
    try:
        for left, kept in ((48 << 20, (0, 0)), (4 << 30, (1, 16 << 20))):
            mp.empty_cache()
            a = mp.zeros(1 << 21)                            # 16 MiB, a segment of its own
            segment.available_memory_cached = lambda: left
            del a
            segment.available_memory_cached = real
            assert recycle.kept() == kept, left              # 48 MiB left: the pool may hold 16
    finally:
        segment.available_memory_cached = real
        mp.empty_cache()


def test_cache_idle_setting_is_checked():
    env = {**os.environ, cache.ENV: "soon"}
    rc, out, err = run_bounded([sys.executable, "-c", "import sharedmp as mp; mp.zeros(10)"],
                               env=env)
    assert rc != 0 and "SHAREDMP_CACHE_IDLE must be a number of seconds" in err


def test_thread_name_helpers_are_torchs():
    pytest.importorskip("torch")
    mp._set_thread_name("sharedmp-test")
    assert mp._get_thread_name() == "sharedmp-test"

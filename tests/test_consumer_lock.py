"""A queue's consumers' lock (``_rlock``) given back by a consumer killed while it holds it:
real processes SIGKILLed holding it, named or in the instant before naming themselves; a live
holder never taken over; exclusion among processes and threads; the queue and Pool.terminate()
after such a kill. Every wait bounded; children killed by the leak fixture if a test fails."""
import os
import random
import signal
import threading
import time
from queue import Empty

import pytest

import sharedmp as mp
from sharedmp.channels import consumer_lock
from sharedmp.channels.consumer_lock import ConsumerLock

from conftest import TIMEOUT, join_or_kill, start_process

ctx = mp.get_context("fork")


def _hold(lock, ready, raw):
    """Take ``lock`` (through the lock, or its bare semaphore: the instant before a holder
    names itself), say so, and wait to be killed."""
    (lock._sem.acquire if raw else lock.acquire)()
    ready.set()
    time.sleep(TIMEOUT)


def _killed_holding(lock, raw=False):
    ready = ctx.Event()
    p = start_process(ctx, _hold, lock, ready, raw)
    assert ready.wait(TIMEOUT)
    os.kill(p.pid, signal.SIGKILL)
    p.join(TIMEOUT)
    return p


def test_a_holder_killed_gives_the_lock_back():
    lock = ConsumerLock(ctx)
    p = _killed_holding(lock)
    assert f"held by pid {p.pid}" in repr(lock)
    t0 = time.monotonic()
    assert lock.acquire(timeout=TIMEOUT)
    assert time.monotonic() - t0 < TIMEOUT / 2
    assert lock.is_mine() and f"held by pid {os.getpid()}" in repr(lock)
    assert not lock.acquire(False)
    lock.release()
    assert lock.acquire(False)              # given back for good: plain turns again
    lock.release()


def test_a_zombie_holder_gives_it_back_too():
    """Killed but not yet reaped by its parent: its pid is there, as a zombie."""
    lock = ConsumerLock(ctx)
    ready = ctx.Event()
    pid = os.fork()
    if pid == 0:                            # (a bare fork: nothing reaps it but this test)
        try:
            lock.acquire()
            ready.set()
            time.sleep(TIMEOUT)
        finally:
            os._exit(0)
    try:
        assert ready.wait(TIMEOUT)
        os.kill(pid, signal.SIGKILL)
        assert lock.acquire(timeout=TIMEOUT)
        lock.release()
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_a_holder_killed_before_it_named_itself(monkeypatch):
    """Killed between taking the semaphore and writing its name: nothing names it; once the
    lock stays so for _STUCK seconds it is taken over (not before)."""
    monkeypatch.setattr(consumer_lock, "_STUCK", 1.0)
    lock = ConsumerLock(ctx)
    _killed_holding(lock, raw=True)
    assert not lock.acquire(timeout=0.5)
    assert lock.acquire(timeout=TIMEOUT)
    lock.release()


def test_a_live_holder_is_never_taken_over():
    lock = ConsumerLock(ctx)
    ready = ctx.Event()
    p = start_process(ctx, _hold, lock, ready, False)
    try:
        assert ready.wait(TIMEOUT)
        assert not lock.acquire(timeout=1.0)
        assert not lock.acquire(False)
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.join(TIMEOUT)
    assert lock.acquire(timeout=TIMEOUT)
    lock.release()


def _count(lock, shared, n):
    for _ in range(n):
        with lock:
            v = shared[0]
            time.sleep(0)                   # (a race would lose increments here)
            shared[0] = v + 1


def _count_threads(lock, shared, n):
    threads = [threading.Thread(target=_count, args=(lock, shared, n)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)


def test_it_excludes_processes_and_threads():
    lock, shared, n = ConsumerLock(ctx), ctx.RawArray("q", 1), 300
    procs = [ctx.Process(target=_count_threads, args=(lock, shared, n)) for _ in range(3)]
    for p in procs:
        p.start()
    _count_threads(lock, shared, n)
    assert all(join_or_kill(p) == 0 for p in procs)
    assert shared[0] == 4 * 2 * n


def _consume(q):
    while True:
        try:
            q.get(timeout=0.0005)
        except Empty:
            pass


@pytest.mark.parametrize("rings", ["1", "0"])
def test_a_queue_outlives_consumers_killed_at_any_moment(monkeypatch, rings):
    """A consumer cycling through get()'s lock is SIGKILLed at random moments, again and
    again: each time the queue still carries a message to another consumer."""
    monkeypatch.setenv("SHAREDMP_QUEUE_RINGS", rings)
    monkeypatch.setattr(consumer_lock, "_STUCK", 1.0)
    q = ctx.Queue()
    rng = random.Random(7)
    for i in range(60):
        p = start_process(ctx, _consume, q)
        time.sleep(rng.uniform(0.005, 0.03))
        os.kill(p.pid, signal.SIGKILL)
        p.join(TIMEOUT)
        q.put(i)
        assert q.get(timeout=TIMEOUT) == i
    q.close()
    q.join_thread()


def test_pool_terminate_after_a_holder_of_its_task_queue_was_killed():
    """Pool.terminate() takes its task queue's lock (the standard library's
    _help_stuff_finish, a plain acquire()): a process killed holding it does not hang it."""
    pool = ctx.Pool(2)
    try:
        assert pool.map(abs, [-1, -2]) == [1, 2]
        _killed_holding(pool._inqueue._rlock)
    finally:
        done = threading.Event()
        t = threading.Thread(target=lambda: (pool.terminate(), done.set()), daemon=True)
        t.start()
        assert done.wait(TIMEOUT), "Pool.terminate() hung on its task queue's lock"

"""Programs for the memory-goes-back tests, each run as ``python _cache_drivers.py NAME
STRATEGY``.

Each is a whole program (fresh caches, its own manager daemon) that measures what it holds
before and after, and reports one JSON line on stdout. Everything is bounded by timeouts.
"""
import gc
import os
import queue
import signal
import sys
import time

import numpy as np

import sharedmp as mp
from sharedmp.memory import manager, named

from _helpers import eventually, say, segment_memfds

TIMEOUT = 30
SLACK = 8 << 20


def shmem():
    """The machine's shared memory in use (Shmem of /proc/meminfo), bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no Shmem in /proc/meminfo")


def files():
    return sorted(n for n in os.listdir(named.shm_dir()) if n.startswith(named.PREFIX))


def mapped():
    """Bytes of sharedmp segments this process maps (/proc/self/maps: memfds, and files of
    the shm directory): unlike Shmem, not moved by the other processes of the machine (a
    second test suite beside this one)."""
    prefix = os.path.join(named.shm_dir(), named.PREFIX)
    total = 0
    with open("/proc/self/maps") as f:
        for line in f:
            if "/memfd:sharedmp" in line or f" {prefix}" in line:
                lo, hi = line.split()[0].split("-")
                total += int(hi, 16) - int(lo, 16)
    return total


def state():
    return {"files": files(), "fds": len(segment_memfds()), "shmem": shmem(), "mapped": mapped()}


def back_to(base, limit):
    """Seconds until this process is back to ``base`` (None if not within ``limit`` s), and
    the last state seen. Once its children have ended, what it maps, the segment fds it
    holds and the files of its shm directory are all the shared memory the program holds;
    the machine's Shmem (reported) moves with the suite run beside this one."""
    t0 = time.monotonic()
    while True:
        gc.collect()
        now = state()
        if (not now["files"] and now["fds"] <= base["fds"]
                and now["mapped"] <= base["mapped"] + SLACK):
            return time.monotonic() - t0, now
        if time.monotonic() - t0 > limit:
            return None, now
        time.sleep(0.02)


def _send_back(q, n):
    for i in range(n):
        q.put((mp.full(100, i), mp.full(300_000, i)))      # arena-carved, and a segment of its own


def _make(i):
    return mp.full(1 << 18, i), mp.full(10, i)


def _workload(ctx):
    """Big and small arrays made here, arrays received from a child, and from Pool workers."""
    held = [mp.zeros(64 << 20, np.uint8) for _ in range(8)]
    held += [mp.zeros(512 << 10, np.uint8) for _ in range(200)]
    held += [mp.zeros(100) for _ in range(2000)]
    for a in held[:8]:
        a[::4096] = 1                                       # touch every page
    q = ctx.Queue()
    p = ctx.Process(target=_send_back, args=(q, 50))
    p.start()
    held += [q.get(timeout=TIMEOUT) for _ in range(50)]
    p.join(TIMEOUT)
    with ctx.Pool(2) as pool:
        held += pool.map(_make, range(40))
    return held


def drop_all(strategy, how):
    """After the program drops every array (and ``how`` is "empty_cache": calls it)."""
    mp.set_sharing_strategy(strategy)
    ctx = mp.get_context("spawn")
    if strategy == "file_system":
        manager.ensure()                                    # its daemon is part of the baseline
    base = state()
    held = _workload(ctx)
    peak = state()
    del held
    gc.collect()
    if how == "empty_cache":
        mp.empty_cache()
        at_once = state()
    else:
        at_once = None
    took, last = back_to(base, 30)
    say(base=base, peak=peak, at_once=at_once, took=took, last=last)


def _stream_forever(q):
    i = 0
    while True:
        q.put((i, mp.full(1000, i), mp.full(200_000, i)))
        i += 1


def killed_senders(rounds):
    """Rounds of a file_system sender SIGKILLed in the middle of a stream of put()s."""
    mp.set_sharing_strategy("file_system")
    ctx = mp.get_context("fork")
    manager.ensure()
    out = []
    q = ctx.Queue(maxsize=16)
    for r in range(rounds):
        before = set(files())
        p = ctx.Process(target=_stream_forever, args=(q,))
        p.start()
        for _ in range(20 + 7 * r % 30):                    # kill it at different moments
            q.get(timeout=TIMEOUT)
        os.kill(p.pid, signal.SIGKILL)
        p.join(TIMEOUT)
        while True:                                         # what it did send is still received
            try:
                q.get(timeout=0.3)
            except queue.Empty:
                break
            except (mp.SegmentError, mp.ProtocolError):     # (a name unlinked: must not happen)
                out.append("error")
        gc.collect()
        t0 = time.monotonic()
        while (left := set(files()) - before) and time.monotonic() - t0 < 5:
            time.sleep(0.02)
            gc.collect()
        out.append(None if left else round(time.monotonic() - t0, 3))
    say(rounds=out, daemon=manager.stats())


def _put_n(q, n):
    for i in range(n):
        q.put((mp.full(10, i), mp.full(1 << 18, i)))


def dropped_queue(n):
    """A queue dropped with ``n`` unread messages from a child and ``n`` from this process."""
    mp.set_sharing_strategy("file_system")
    ctx = mp.get_context("spawn")
    manager.ensure()
    q = ctx.Queue()
    p = ctx.Process(target=_put_n, args=(q, n))
    p.start()
    p.join(TIMEOUT)
    _put_n(q, n)
    # until the daemon counts both batches in flight (this process's feeder sends its own)
    eventually(lambda: manager.stats()["in_flight"] >= 2 * n, 5, collect=False)
    unread = len(files())
    in_flight = manager.stats()["in_flight"]
    del q
    gc.collect()
    t0 = time.monotonic()
    while files() and time.monotonic() - t0 < 5:
        time.sleep(0.02)
    say(unread_files=unread, in_flight=in_flight, took=None if files() else time.monotonic() - t0,
        daemon=manager.stats())


def _paced(q, n, pause):
    for i in range(n):
        q.put(mp.full(1 << 20, i, dtype=np.uint8))          # a fresh 1 MiB segment each time
        time.sleep(pause)


def stream_reuse(strategy):
    """A stream of fresh 1 MiB arrays 20 ms apart, each dropped by the receiver: how many
    distinct segments it took (reuse keeps it to a few)."""
    mp.set_sharing_strategy(strategy)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_paced, args=(q, 100, 0.02))
    p.start()
    keys = set()
    for _ in range(100):
        a = q.get(timeout=TIMEOUT)
        keys.add(mp.arrays.mapping_of(a)[1].key)
        del a
    p.join(TIMEOUT)
    say(segments=len(keys))


if __name__ == "__main__":
    name, *args = sys.argv[1:]
    fn = globals()[name]
    fn(*[int(a) if a.isdigit() else a for a in args])

"""Programs for the memory-goes-back tests, each run as ``python _cache_drivers.py NAME
STRATEGY``.

Each is a whole program (fresh caches, its own manager daemon) that measures what it holds
before and after, and reports one JSON line on stdout. Everything is bounded by timeouts.

No thread gives a process's caches back (memory/cache.py): its next sharedmp operation does,
or a wait in sharedmp's channels (``get``, ``recv``, ``poll``). So these programs wait as a
consumer waits for its next message, on a channel of their own (``waiter``), not in
``time.sleep``.
"""
import gc
import os
import queue
import signal
import sys
import threading
import time
import warnings

import numpy as np

import sharedmp as mp
from sharedmp.memory import cache, manager, named

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


def waiter():
    """A wait of 20 ms in a sharedmp channel (a consumer waiting for a message that does not
    come): the caches' passes run in it."""
    reader, writer = mp.Pipe(duplex=False)

    def wait():
        assert not reader.poll(0.02)
    wait.keep = (reader, writer)
    return wait


def back_to(base, limit, wait=None):
    """Seconds until this process is back to ``base`` (None if not within ``limit`` s), and
    the last state seen, waiting in ``wait()`` (a sharedmp wait: ``waiter``) between looks.
    Once its children have ended, what it maps, the segment fds it holds and the files of its
    shm directory are all the shared memory the program holds; the machine's Shmem
    (reported) moves with the suite run beside this one."""
    wait = wait or waiter()
    t0 = time.monotonic()
    while True:
        gc.collect()
        now = state()
        if (not now["files"] and now["fds"] <= base["fds"]
                and now["mapped"] <= base["mapped"] + SLACK):
            return time.monotonic() - t0, now
        if time.monotonic() - t0 > limit:
            return None, now
        wait()


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
    """After the program drops every array, and ``how``: "empty_cache" (calls it),
    "allocate" (idle, then allocates), "join" (joins a child that outlives the idle time),
    or "wait" (waits on a channel)."""
    mp.set_sharing_strategy(strategy)
    ctx = mp.get_context("spawn")
    if strategy == "file_system":
        manager.ensure()                                    # its daemon is part of the baseline
    base = state()
    wait = waiter()
    held = _workload(ctx)
    peak = state()
    del held
    gc.collect()
    at_once = idle = None
    if how == "empty_cache":
        mp.empty_cache()
        at_once = state()
    elif how == "allocate":
        # Idle without a sharedmp call: nothing goes; the next allocation gives it back.
        time.sleep(cache.idle() + 2 * cache.TICK)
        gc.collect()
        idle = state()
        idle["held"] = cache.held()
        small = mp.zeros(10)                                # (an arena of its own: 4 MiB)
        at_once = state()
        at_once["threads"] = [t.name for t in threading.enumerate()]
        at_once["held"] = cache.held()
        del small
    elif how == "join":
        # Waiting in join() for a child that outlives the idle time: the caches go meanwhile.
        child = ctx.Process(target=time.sleep, args=(cache.idle() + 4 * cache.TICK,))
        child.start()
        child.join(TIMEOUT)
        at_once = state()
        at_once["threads"] = [t.name for t in threading.enumerate()]
        at_once["held"] = cache.held()
        at_once["exitcode"] = child.exitcode
    took, last = back_to(base, 30, wait)
    say(base=base, peak=peak, idle=idle, at_once=at_once, took=took, last=last)


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
            try:                                            # waiting for more, as a consumer
                q.get(timeout=0.02)                         # (the caches' passes run in it)
                out.append("unexpected")
            except queue.Empty:
                pass
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
    wait = waiter()           # (this process's own arena of the burst: let go by a pass)
    t0 = time.monotonic()
    while files() and time.monotonic() - t0 < 5:
        wait()
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


# -- no thread of sharedmp's in a process that holds arrays, datasets and channels ----------

def threads_now():
    """The threads of this process: names (Python's), OS tasks, and what a fork warns of
    (Python 3.12+: "This process ... is multi-threaded, use of fork() may lead to deadlocks";
    on 3.11 nothing is warned: the counts are what tell)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        pid = os.fork()
        if pid == 0:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return {"names": sorted(t.name for t in threading.enumerate()),
            "tasks": len(os.listdir("/proc/self/task")),
            "fork_warnings": [str(w.message) for w in seen
                              if issubclass(w.category, DeprecationWarning)
                              and "fork" in str(w.message)],
            "cache_thread": cache._thread is not None}


def _from_a_child(ctx, q, n):
    """What a spawned child sends through ``q`` (``_send_arrays``, n messages), once it ended."""
    p = ctx.Process(target=_send_arrays, args=(q, n))
    p.start()
    got = []
    while (m := q.get(timeout=TIMEOUT)) is not None:
        got.append(m)
    p.join(TIMEOUT)
    return got


def _send_arrays(q, n):
    for i in range(n):
        q.put((mp.full(100, i), mp.full(300_000, i), np.full(200_000, i)))
    q.put(None)


def no_thread(strategy):
    """Threads and a fork after each step of a program that holds arrays, a dataset and
    channels, then drops them, idles, and waits in get(); and after the same with the
    standard library's shared memory (the reference)."""
    mp.set_sharing_strategy(strategy)
    ctx = mp.get_context("spawn")
    out = {"import": threads_now()}
    a = mp.empty(1000)
    b = mp.zeros(1 << 21)                                   # a segment of its own
    out["empty"] = threads_now()
    q = ctx.Queue()
    q.put(np.arange(200_000))                               # copied into shared memory
    c = q.get(timeout=TIMEOUT)
    out["queue to itself"] = threads_now()
    received = _from_a_child(ctx, q, 20)
    out["received from a child"] = threads_now()
    d = mp.SharedList([{"x": i, "name": str(i) * 10} for i in range(2000)])
    assert d[1999]["x"] == 1999
    out["dataset"] = threads_now()
    r, w = mp.Pipe()
    for i in range(50):
        w.send((i, mp.full(10, i), np.full(300_000, i)))
        r.recv()
        r.send(mp.full(1 << 18, i))
        w.recv()
    out["pipe after traffic"] = threads_now()
    del a, b, c, received, d
    gc.collect()
    out["dropped"] = threads_now()
    time.sleep(cache.idle() + 2 * cache.TICK)
    out["idle"] = threads_now()
    try:
        q.get(timeout=2 * (cache.idle() + cache.TICK))
    except queue.Empty:
        pass
    out["waited in get"] = threads_now()
    out["held after the wait"] = {k: v for k, v in cache.held().items() if k != "mapped"}
    from multiprocessing import shared_memory               # the standard library's
    ref = shared_memory.SharedMemory(create=True, size=1 << 20)
    out["stdlib shared_memory"] = threads_now()
    ref.close()
    ref.unlink()
    say(**out)


def waiting_consumer(strategy):
    """A consumer receives a burst from a child, makes arrays of its own, drops all, then
    waits in Queue.get(timeout) for longer than the idle time, with no thread."""
    mp.set_sharing_strategy(strategy)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    held = _from_a_child(ctx, q, 30)
    held += [mp.zeros(1 << 18) for _ in range(4)] + [mp.zeros(100) for _ in range(100)]
    del held
    gc.collect()
    cache._publish()
    before = {k: v for k, v in cache.held().items() if k != "mapped"}
    published_before = cache.read_stats(os.getpid())
    threads_before = sorted(t.name for t in threading.enumerate())
    t0 = time.monotonic()
    try:
        q.get(timeout=cache.idle() + 4 * cache.TICK)        # nothing comes
    except queue.Empty:
        pass
    waited = time.monotonic() - t0
    say(before=before, after={k: v for k, v in cache.held().items() if k != "mapped"},
        published_before=published_before["cache"],
        published_after=cache.read_stats(os.getpid())["cache"], waited=waited,
        mapped=mapped(), threads_before=threads_before,
        threads=sorted(t.name for t in threading.enumerate()),
        tasks=len(os.listdir("/proc/self/task")), files=files())


if __name__ == "__main__":
    name, *args = sys.argv[1:]
    fn = globals()[name]
    fn(*[int(a) if a.isdigit() else a for a in args])

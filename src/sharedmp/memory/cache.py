"""Caches give memory back: what this process keeps after its last use goes when idle.

sharedmp keeps four caches of shared memory, each a loan from the user:

    arena.py     the current arena of each strategy, which the allocator keeps carving
    segment.py   the few small segments received last, kept mapped (``_recent``)
    named.py     the named arenas whose last array went during a burst ("pending", parked
                 at the next pass)
    recycle.py   segments this process made, kept mapped for reuse (the pool): memfds, and
                 named segments parked with the manager daemon (out of the shm directory's
                 listing once free)

(and the current token of each channel end that sent named segments, manager.py), and two
that belong to something that runs threads of its own: the joblib backend's warm pool of
workers ("joblib-pool", kept between ``Parallel`` calls for its own idle timeout) and what
a CUDA receiver keeps open ("cuda", ``cuda/ipc.py``).

A stream of messages reuses them milliseconds apart. Once an entry has not been used for
``idle()`` seconds ($SHAREDMP_CACHE_IDLE, default 1), a *pass* lets it go: closed, unmapped,
and under file_system unlinked by the daemon once no other process holds it.

No thread runs the passes of the memory caches: a process that holds arrays, datasets and
channels runs no thread of sharedmp's, so that it forks as a process of the standard
library's would (Python 3.12 warns at a fork of a process with threads). Passes run lazily:

- at sharedmp's own operations (``tick``): an allocation (``arena.allocate``, after it: what
  the pool keeps is reused first; a dataset's block, ``segment.create_sealed``), the mapping
  of a received segment, a send or a receive on a channel (Pipe, Queue, SimpleQueue), a
  ``poll()`` that finds nothing. When no pass is due, ``tick`` is one ``time.monotonic()``
  compared with ``_due``;
- inside sharedmp's blocking waits: a Connection's ``recv``/``poll``, ``Queue.get`` and
  ``SimpleQueue.get`` waiting for a message, and a sharedmp Process's ``join()``, wait until
  the next pass is due, run it, and wait on (``waiting``): a consumer that waits for its
  next batch gives back what the last one left, a parent that joins its workers what it
  kept for them;
- in ``empty()`` (``mp.empty_cache()``), which lets every cache go at once.

A pass is due ``TICK`` seconds after something landed in a cache (``start``: a segment
mapped, a segment released into a cache, an arena held for a burst, a token opened) and
every ``TICK`` seconds after while some cache still keeps something; ``_due`` is infinite
when none does (then ``tick`` never runs one, and a wait is one ``poll``). So an entry is
let go at the first operation or wait ``idle()`` to ``idle() + TICK`` seconds after its
last use (the caches record when they were used, not when a pass saw it); a process that
does nothing of sharedmp's meanwhile (computes, sleeps) keeps it until then,
within the pool's bounds (``recycle.py``), or until ``mp.empty_cache()``. A pass never
waits for another: when one is under way (another thread's, ``empty()``), a lazy pass is
skipped. ``tick`` is called only where the caller holds no lock of sharedmp's (segment
tables, arenas, the fork gate, a token's): a pass takes them. A release into a cache
happens in a finalizer, which may run anywhere (inside those locks too): it only sets
``_due`` (``start``), never runs a pass.

The caches with threads of their own (``register(..., thread=True)``: joblib-pool, cuda)
are let go by a timer thread, ``sharedmp-cache``, instead (a pass could terminate a Pool
from its own handler thread, or call CUDA from any thread): it runs only while such an
entry exists (``start(thread=True)``), wakes every ``TICK`` seconds (its passes cover every
cache) and ends when none is left. A plain CPU array, dataset, Queue or Pipe never starts it.

Each cache registers itself here (``register``), in the order in which the caches are
expired and emptied: an arena let go may end its last view and land in the pool, which
comes after it, so one pass releases both.

What the process holds is published in a small memfd named ``stats.sharedmp`` (a line of
JSON, rewritten when it changes, at each pass, and when a dataset's block is made or
attached: ``publish``) that ``python -m sharedmp doctor`` reads through ``/proc/<pid>/fd``:
it dies with the process, so nothing is ever left behind. It describes the process as of
then.
"""
from __future__ import annotations

import math
import os
import threading
import time
from typing import Any, Callable, Optional

from .. import forks, host, settings

ENV = settings.CACHE_IDLE
TICK = 0.25
STATS_NAME = "stats.sharedmp"     # (not "sharedmp...": leak checks look for those)
STATS_SIZE = 4096

# expire(cutoff) -> whether it still keeps something (a later pass is needed);
# held() -> (bytes, fds); processes() -> {"pids": [...], "idle_s": seconds} of the processes a
# cache keeps alive, or None
Expire = Callable[[Optional[float]], bool]
Held = Callable[[], tuple[int, int]]
Processes = Callable[[], Optional[dict[str, Any]]]
# [(order, name, expire, held, processes, thread)], sorted by order; ``thread``: let go by the
# timer thread only (see the module docstring)
_caches: list[tuple[int, str, Expire, Held, Optional[Processes], bool]] = []
# {key: describe()}: more of what a process holds, published under ``key`` for doctor
# (the shared datasets: ``datasets.live``)
_described: dict[str, Callable[[], Any]] = {}
_lock = threading.Lock()          # starting and ending the timer thread
_pass_lock = threading.Lock()     # one pass at a time: a lazy pass skips, empty() waits
_monotonic = time.monotonic
_due = math.inf                   # monotonic time of the next lazy pass; inf: nothing kept
_wanted = False                   # start() was called since the current pass began
_thread: threading.Thread | None = None
_thread_wanted = False            # start(thread=True) was called since the thread last looked
_idle: float | None = None
_stats_fd = -1
_stats_last: bytes | None = None


def idle() -> float:
    """Seconds an unused cache entry is kept ($SHAREDMP_CACHE_IDLE, read once)."""
    global _idle
    if _idle is None:
        _idle = float(settings.get(ENV))
    return _idle


def register(order: int, name: str, expire: Expire, held: Held,
             processes: Processes | None = None, thread: bool = False) -> None:
    """Add a cache. ``expire(cutoff)`` lets go of what was last used before the monotonic
    time ``cutoff`` (everything when ``cutoff`` is None) and returns whether it still keeps
    something; ``held()`` is (bytes, fds) of what the cache keeps now; ``processes()``, for a
    cache of processes, what it keeps alive (published for doctor). ``thread``: a cache of
    something that runs threads of its own, let go by the timer thread (``start(thread=True)``)
    and never by a lazy pass."""
    _caches.append((order, name, expire, held, processes, thread))
    _caches.sort(key=lambda c: c[0])


def describe(key: str, fn: Callable[[], Any]) -> None:
    """Publish ``fn()`` (JSON-able, small) under ``key`` in this process's stats."""
    _described[key] = fn


def start(thread: bool = False) -> None:
    """Something may have landed in a cache: make sure a pass comes (``TICK`` s from now, at
    the next operation or wait after). Called whenever a segment is mapped or released into a
    cache, from finalizers too: it takes no lock and runs nothing. ``thread``: an entry of a
    cache registered with ``thread=True``: make sure the timer thread runs."""
    global _wanted, _due
    if thread:
        _start_thread()
        return
    _wanted = True                # (before _due is read: see _pass)
    if _due == math.inf:
        idle()                    # a bad $SHAREDMP_CACHE_IDLE raises here, in the caller
        _due = _monotonic() + TICK


def due() -> float:
    """Monotonic time of the next lazy pass (inf: none)."""
    return _due


def waiting(wait: Callable[[Optional[float]], bool], timeout: float | None) -> bool:
    """``wait(seconds)`` (None: forever; whether what it waits for came) until it comes or
    ``timeout`` (None: forever) has passed, woken when a pass is due to run it (``tick``) and
    wait on: a process that waits (``recv``, ``get``, ``join``) gives back what it keeps
    cached, with no thread. One ``wait`` when nothing is cached."""
    due = _due
    if due == math.inf:
        return wait(timeout)
    deadline = math.inf if timeout is None else _monotonic() + timeout
    while True:
        now = _monotonic()
        if now >= due:
            tick()
            due = _due
            if due <= now:            # (skipped: another thread's pass is under way)
                due = now + TICK
        end = min(due, deadline)
        if wait(None if end == math.inf else max(0.0, end - now)):
            return True
        if _monotonic() >= deadline:
            return False
        due = _due


def tick() -> None:
    """Run a pass if one is due (at sharedmp's operations; the caller holds no lock of
    sharedmp's). One ``time.monotonic()`` when none is; never waits for a pass under way."""
    if _monotonic() >= _due:
        _lazy_pass()


def _lazy_pass() -> None:
    if not _pass_lock.acquire(False):
        return                    # another thread's pass, or empty(): it does the work
    try:
        if _monotonic() >= _due:  # (not one that ran just now)
            _pass(False)
    finally:
        _pass_lock.release()


def _pass(threaded: bool) -> bool:
    """(pass lock held) One pass over the caches (the timer thread's too if ``threaded``) at
    the cutoff ``now - idle()``; publish the stats; set ``_due``. Whether the thread's caches
    still keep something."""
    global _due, _wanted
    now = _monotonic()
    _due = now + TICK             # (provisional; a start() meanwhile only sets _wanted)
    _wanted = False
    cutoff = now - idle()
    kept = kept_by_thread = False
    for _, _, fn, _, _, own in list(_caches):
        if own and not threaded:
            continue
        try:
            left = fn(cutoff)
        except Exception:         # never fail the caller (or the thread): the next pass retries
            left = True
        if own:
            kept_by_thread = kept_by_thread or left
        else:
            kept = kept or left
    if not kept:
        # Nothing kept: no pass until start() is called again. A start() since the pass
        # began (it set _wanted first, then read _due) is not lost: either it is seen here,
        # or it read _due after this and found it infinite.
        _due = math.inf
        if _wanted:
            _due = _monotonic() + TICK
    _publish()
    return kept_by_thread


def _start_thread() -> None:
    global _thread, _thread_wanted
    if _thread_wanted and _thread is not None:
        return                    # (it has not looked since: it sees the new entry)
    idle()                        # a bad $SHAREDMP_CACHE_IDLE raises here, in the caller
    with _lock:
        _thread_wanted = True
        if _thread is None:
            _thread = threading.Thread(target=_run, name="sharedmp-cache", daemon=True)
            _thread.start()


def _run() -> None:
    global _thread, _thread_wanted
    while True:
        time.sleep(TICK)
        with _lock:
            _thread_wanted = False
        with _pass_lock:
            needed = _pass(True)
        if not needed:
            with _lock:
                if not _thread_wanted:
                    _thread = None
                    return


def expire(cutoff: float | None) -> bool:
    """One pass over every cache, the timer thread's too, at ``cutoff`` (None: let go of
    everything), waiting for a pass under way; whether any cache still keeps something."""
    needed = False
    with _pass_lock:
        for _, _, fn, _, _, _ in list(_caches):
            try:
                needed = fn(cutoff) or needed
            except Exception:         # the next pass retries
                needed = True
    return needed


# Run by ``empty`` once every cache has let go (manager.py's: wait for the daemon to act)
_on_empty: list[Callable[[], None]] = []


def on_empty(fn: Callable[[], None]) -> None:
    """Run ``fn`` at the end of every ``empty()``."""
    _on_empty.append(fn)


def empty() -> None:
    """Let every cached segment of this process go now (``mp.empty_cache()``): under
    file_system, the daemon has unlinked those no other process holds when it returns."""
    expire(None)
    for fn in _on_empty:
        fn()
    _publish()


def held() -> dict[str, tuple[int, int]]:
    """{name: (bytes, fds)} of each cache (and of "mapped": everything this process maps)."""
    return {name: fn() for _, name, _, fn, _, _ in list(_caches)}


def processes() -> dict[str, dict[str, Any]]:
    """{name: {"pids": [...], "idle_s": seconds}} of each cache that keeps processes now."""
    kept = ((name, fn()) for _, name, _, _, fn, _ in list(_caches) if fn is not None)
    return {name: d for name, d in kept if d}


def stats() -> dict[str, Any]:
    """What this process holds, as published for doctor."""
    parts = held()
    mapped = parts.pop("mapped", (0, 0))
    return {"pid": os.getpid(), "mapped_bytes": mapped[0], "mapped_fds": mapped[1],
            "cache": {name: list(v) for name, v in parts.items()}, "idle_s": idle(),
            "processes": processes(), **{k: fn() for k, fn in list(_described.items())}}


def publish() -> None:
    """Publish the stats now, not at the next pass: something doctor lists was made (a shared
    dataset) and the process may do nothing of sharedmp's for a while. Takes the segment
    tables' and the pool's locks: not from a finalizer, nor where one is held."""
    _publish()


def _publish() -> None:
    global _stats_fd, _stats_last
    try:
        import json                   # (deferred: only processes that map segments publish)
        data = json.dumps(stats(), separators=(",", ":")).encode()
        if data == _stats_last or len(data) >= STATS_SIZE:
            return
        if _stats_fd < 0:
            if not host.HAVE_MEMFD:
                return
            _stats_fd = os.memfd_create(STATS_NAME, os.MFD_CLOEXEC)
        os.pwrite(_stats_fd, data.ljust(STATS_SIZE, b" "), 0)
        _stats_last = data
    except Exception:                 # diagnostics only: never fail the process for them
        pass


def read_stats(pid: int) -> Any:
    """The stats another process (of this user) published, or None (for doctor)."""
    try:
        fds = list(host.fd_targets(pid))
    except OSError:
        return None
    for path, target in fds:
        if target != f"/memfd:{STATS_NAME} (deleted)":
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            import json
            return json.loads(os.pread(fd, STATS_SIZE, 0).strip() or b"null")
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)
    return None


@forks.in_child
def _after_fork_in_child() -> None:
    # The thread stays in the parent; the stats memfd describes the parent. (``_due`` stays:
    # the child maps what the parent mapped.)
    global _thread, _thread_wanted, _stats_fd, _stats_last
    _thread, _thread_wanted, _stats_last = None, False, None
    if _stats_fd >= 0:
        try:
            os.close(_stats_fd)
        except OSError:
            pass
        _stats_fd = -1


forks.renew_locks(globals(), "_lock", "_pass_lock")

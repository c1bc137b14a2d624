"""Caches give memory back: what this process keeps after its last use goes when idle.

sharedmp keeps three caches of shared memory, each a loan from the user:

    arena.py     the current arena of each strategy, which the allocator keeps carving
    segment.py   the few small segments received last, kept mapped (``_recent``)
    named.py     the named arenas whose last array went during a burst ("pending", parked
                 at the next tick)
    recycle.py   segments this process made, kept mapped for reuse (the pool): memfds, and
                 named segments parked with the manager daemon (out of the shm directory's
                 listing once free)

and one of processes, when ``sharedmp.joblib`` is used: the joblib backend's warm pool of
workers ("joblib-pool"), kept between ``Parallel`` calls for its own idle timeout.

A stream of messages reuses them milliseconds apart. Once an entry has not been used for
``idle()`` seconds ($SHAREDMP_CACHE_IDLE, default 1), one background thread,
``sharedmp-cache``, lets it go: closed, unmapped, and under file_system unlinked by the
daemon once no other process holds it. The thread runs while this process maps some
sharedmp segment or caches one, wakes every ``TICK`` seconds, and ends when there is
neither. ``empty()`` (``mp.empty_cache()``) lets every cache go at once.

Each cache registers itself here (``register``), in the order in which the caches are
expired and emptied: an arena let go may end its last view and land in the pool, which
comes after it, so one pass releases both.

What the process holds is published in a small memfd named ``stats.sharedmp`` (a line of
JSON, rewritten when it changes) that ``python -m sharedmp doctor`` reads through
``/proc/<pid>/fd``: it dies with the process, so nothing is ever left behind.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Optional

from .. import forks, host, settings

ENV = settings.CACHE_IDLE
TICK = 0.25
STATS_NAME = "stats.sharedmp"     # (not "sharedmp...": leak checks look for those)
STATS_SIZE = 4096

# expire(cutoff) -> whether the thread is still needed; held() -> (bytes, fds);
# processes() -> {"pids": [...], "idle_s": seconds} of the processes a cache keeps alive, or None
Expire = Callable[[Optional[float]], bool]
Held = Callable[[], tuple[int, int]]
Processes = Callable[[], Optional[dict[str, Any]]]
# [(order, name, expire, held, processes)], sorted by order
_caches: list[tuple[int, str, Expire, Held, Optional[Processes]]] = []
# {key: describe()}: more of what a process holds, published under ``key`` for doctor
# (the shared datasets: ``datasets.live``)
_described: dict[str, Callable[[], Any]] = {}
_lock = threading.Lock()
_pass_lock = threading.Lock()     # one pass at a time: empty() waits for the thread's to end
_thread: threading.Thread | None = None
_wanted = False               # start() was called since the thread last looked
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
             processes: Processes | None = None) -> None:
    """Add a cache. ``expire(cutoff)`` lets go of what was last used before the monotonic
    time ``cutoff`` (everything when ``cutoff`` is None) and returns whether the thread is
    still needed; ``held()`` is (bytes, fds) of what the cache keeps now; ``processes()``,
    for a cache of processes, what it keeps alive (published for doctor)."""
    _caches.append((order, name, expire, held, processes))
    _caches.sort(key=lambda c: c[0])


def describe(key: str, fn: Callable[[], Any]) -> None:
    """Publish ``fn()`` (JSON-able, small) under ``key`` in this process's stats."""
    _described[key] = fn


def start() -> None:
    """Make sure the thread runs (called whenever a segment is mapped: cheap when it does)."""
    global _thread, _wanted
    if _wanted and _thread is not None:
        return
    idle()                            # a bad $SHAREDMP_CACHE_IDLE raises here, in the caller
    with _lock:
        _wanted = True
        if _thread is None:
            _thread = threading.Thread(target=_run, name="sharedmp-cache", daemon=True)
            _thread.start()


def _run() -> None:
    global _thread, _wanted
    while True:
        time.sleep(TICK)
        with _lock:
            _wanted = False
        needed = expire(time.monotonic() - idle())
        _publish()
        if not needed:
            with _lock:
                if not _wanted:
                    _thread = None
                    return


def expire(cutoff: float | None) -> bool:
    """One pass over the caches; whether any still needs the thread."""
    needed = False
    with _pass_lock:
        for _, _, fn, _, _ in list(_caches):
            try:
                needed = fn(cutoff) or needed
            except Exception:         # never let the thread die: the next pass retries
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
    return {name: fn() for _, name, _, fn, _ in list(_caches)}


def processes() -> dict[str, dict[str, Any]]:
    """{name: {"pids": [...], "idle_s": seconds}} of each cache that keeps processes now."""
    kept = ((name, fn()) for _, name, _, _, fn in list(_caches) if fn is not None)
    return {name: d for name, d in kept if d}


def stats() -> dict[str, Any]:
    """What this process holds, as published for doctor."""
    parts = held()
    mapped = parts.pop("mapped", (0, 0))
    return {"pid": os.getpid(), "mapped_bytes": mapped[0], "mapped_fds": mapped[1],
            "cache": {name: list(v) for name, v in parts.items()}, "idle_s": idle(),
            "processes": processes(), **{k: fn() for k, fn in list(_described.items())}}


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
    # The thread stays in the parent; the stats memfd describes the parent.
    global _thread, _wanted, _stats_fd, _stats_last
    _thread, _wanted, _stats_last = None, False, None
    if _stats_fd >= 0:
        try:
            os.close(_stats_fd)
        except OSError:
            pass
        _stats_fd = -1


forks.renew_locks(globals(), "_lock", "_pass_lock")

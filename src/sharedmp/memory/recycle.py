"""Recycling: a process reuses the segments it made once no other process holds them.

Fresh shared memory is slow: the kernel allocates and zeroes every 4 KiB page, then
faults it into each mapping (about 1.4 GB/s on the development machine, against about
24 GB/s for writing pages that are already mapped). A producer that sends a fresh array
per message pays that for every message. So the creator of a memfd segment keeps it,
mapped, once its last view is gone, and hands it out again as soon as no other process
can see it any more.

"No other process can see it" is told by the kernel through flock(2). A flock belongs to
an open file description (OFD) and lasts until the OFD's last reference is gone: an fd
in any process (dup, fork and SCM_RIGHTS share the OFD), a message in flight in a
socket, or a mapping. So a creator opens its memfd twice:

- ``private``: the OFD it maps the segment through; it is never sent;
- ``shared``: a second OFD of the same memfd (opened through /proc/self/fd) holding
  LOCK_SH. This is the fd that travels; every fd, mapping and message in flight in
  other processes refers to it.

When the creator's last view goes it closes its own fd of ``shared`` and gives the
segment here. ``flock(private, LOCK_EX | LOCK_NB)`` then succeeds exactly when no
reference to ``shared`` is left anywhere, and only then is the segment handed out again,
with a new ``shared`` OFD. Reused memory keeps its old contents; ``segment.create``
zeroes it unless the caller overwrites it anyway.

Named segments (the file_system strategy) cannot be told apart this way: a receiver
opens one by its name, a new OFD each time. The manager daemon counts who holds each name
and which messages in flight carry it (``daemon.py``), so it is the daemon that tells:

- When the creator's last view goes (``named.py``), it keeps the mapping here and tells
  the daemon that it *parks* the segment (``manager.parked``, one record, no answer
  awaited), naming the fresh name ``next`` the segment will have when reused.
- Once no other process holds it and no message in flight names it, the daemon renames
  the file to ``next``'s name in its pool directory, ``<shm dir>/.sharedmp-pool-<daemon
  pid>/`` (0700, a dot directory on the same tmpfs): the segment leaves the directory's
  listing at once, so a pooled segment never looks like a leak (torch's own tests wait for
  /dev/shm to empty after each round).
- ``take_named`` reuses it by renaming it back to ``next`` in the shm directory: the
  rename succeeds exactly when the daemon has found it free, and the new name means that
  no name a stale message could carry leads to the reused memory. No round trip, no
  record: the daemon already counts the creator as the holder of ``next``.

Why a rename and not an unlink: an unlinked tmpfs file can never be linked again
(``linkat`` of /proc/self/fd/N works only for an ``O_TMPFILE`` never linked yet), and a
receiver can only open a name. The daemon, not the creator, moves the file, so the name
leaves as soon as the daemon knows it is free, even while the creator is busy (a
``gc.collect()`` holds the GIL for tens of milliseconds). If the creator is killed, the
daemon unlinks the segment under whichever name it has; if the daemon is killed, ``doctor
--clean`` removes what the pool directories hold that no live process maps.

Bounds: ``$SHAREDMP_RECYCLE_BYTES`` (default 256 MiB, 0 turns recycling off) for all the
segments kept (memfd and named together), and a quarter of the memory this machine (or
its cgroup) could still make available, whichever is smaller; a quarter of that for one
segment; at most ``MAX_ENTRIES`` segments; a few fds (two per memfd segment kept, one per
named one before Python 3.13: mmap's own). A segment not reused for ``cache.idle()``
seconds is let go at the next pass after (``cache.py``: the next allocation, send, receive
or wait on a channel; named: the daemon unlinks it once no one else holds it).
"""
import collections
import fcntl
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from .. import fds, forks, host, settings
from . import cache, manager

if TYPE_CHECKING:
    import mmap

ENV = settings.RECYCLE_BYTES
MAX_ENTRIES = 16
# take_named tries this many named segments of the size asked for, oldest first, before it
# gives up: each try is a rename that fails (ENOENT) until the daemon has found it free.
MAX_TRIES = 4

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_lock = threading.RLock()       # an RLock: give() runs in finalizers, which may run inside take()
# [size, mapping, private fd (fds.Fd), unused since, path, next path, directory, daemon
# generation, pool path, address], oldest first; a memfd segment has no path (None), a named
# one no private fd (None)
_entries: "collections.deque[list[Any]]" = collections.deque()
_total = 0
_limit = None


def limit():
    """Bytes of segments kept for reuse at most ($SHAREDMP_RECYCLE_BYTES, read once)."""
    global _limit
    if _limit is None:
        _limit = settings.get(ENV)
    return _limit


def shared_fd(private):
    """A second OFD of the memfd ``private``, holding LOCK_SH: the fd that is sent.

    Without /proc (or with recycling off) a plain dup: the segment is then never reused.
    Returns (fd, recyclable).
    """
    if limit():
        try:
            fd = host.reopen(private, os.O_RDWR | _O_CLOEXEC)
        except OSError:
            pass
        else:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return fd, True
            except OSError:
                os.close(fd)
    return os.dup(private), False


def give(size, mapping, private, since=None, available=None):
    """The creator has no view of this segment left (and closed its ``shared`` fd): keep it.

    ``since``: when it was last used (default now); ``available``: bytes of memory this
    machine could still make resident, if known (the pool stays below a quarter of that,
    counting itself)."""
    global _total
    with _lock:
        bound = _bound_now(size, available)
        if size > bound // 4:
            os.close(private)
            return
        since = time.monotonic() if since is None else since
        _entries.append([size, mapping, fds.Fd(private), since,   # the pool owns the fd now
                         None, None, None, None, None, None])
        _total += size
        _bound(bound)
    cache.start()                 # (from a finalizer: no pass here, one soon; see cache.py)


def _bound_now(size, available):
    """(lock held) The most the pool may hold with ``size`` more: the limit, and a quarter of
    the memory available (``available``, if known) counting the pool itself."""
    bound = limit()
    if available is not None:
        bound = min(bound, (available + _total + size) // 4)
    return bound


def _bound(bound):
    while _total > bound or len(_entries) > MAX_ENTRIES:
        _drop(_entries.popleft())


def give_named(size, mapping, path, nxt, directory, address, since=None, available=None):
    """The creator has no view of the named segment ``path`` left: keep it (mapped) to be
    reused as ``nxt`` once the daemon has found it free (the caller parks it there, if this
    says True; if False, the caller lets it go)."""
    global _total
    with _lock:
        bound = _bound_now(size, available)
        if size > bound // 4:
            return False
        _entries.append([size, mapping, None, time.monotonic() if since is None else since,
                         path, nxt, directory, manager.generation(), manager.pool_path(nxt),
                         address])
        _total += size
        _bound(bound)
    cache.start()                 # (from a finalizer: no pass here, one soon; see cache.py)
    return True


def take_named(size, directory, making):
    """(mapping, path, address) of a kept named segment of ``size`` bytes in ``directory``
    that the daemon found free, now at its new path (added to ``making``: see
    ``named._making``); or None."""
    with _lock:
        if not _entries:
            return None
        tries = 0
        generation = manager.generation()
        for entry in list(_entries):
            if entry[4] is None or entry[0] != size or entry[6] != directory:
                continue
            if entry[7] != generation:        # parked with a daemon this process left
                _entries.remove(entry)
                _drop(entry)
                continue
            making.add(entry[5])
            try:
                os.rename(entry[8], entry[5])
            except FileNotFoundError:         # not free yet (or given up: let go when idle)
                making.discard(entry[5])
                tries += 1
                if tries >= MAX_TRIES:
                    break
                continue
            except OSError:
                making.discard(entry[5])
                _entries.remove(entry)
                _drop(entry)
                continue
            _entries.remove(entry)
            _forget(entry)
            return entry[1], entry[5], entry[9]
    return None


def take_back(path):
    """The mapping of the named segment kept as ``path``, out of the pool (not reusable: this
    process maps it again, e.g. it receives a message of its own that names it); or None."""
    with _lock:
        for entry in _entries:
            if entry[4] == path and entry[7] == manager.generation():
                _entries.remove(entry)
                _forget(entry)
                manager.dropped(entry[5])     # (the caller holds ``path`` again: H or R)
                return entry[1]
    return None


def take(size: int) -> "tuple[mmap.mmap, int] | None":
    """(mapping, private fd) of a kept segment of ``size`` bytes that no other process holds, or
    None."""
    with _lock:
        for entry in _entries:
            if entry[0] != size or entry[4] is not None:
                continue
            try:
                fcntl.flock(entry[2].fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:       # another process (or a message in flight) still holds it
                continue
            fcntl.flock(entry[2].fd, fcntl.LOCK_UN)
            _entries.remove(entry)
            _forget(entry)
            return entry[1], entry[2].take()
    return None


def kept():
    """(segments, bytes) kept for reuse now."""
    with _lock:
        return len(_entries), _total


def clear():
    """Let every kept segment go (before a big allocation fails, in tests, on demand)."""
    expire(None)


def expire(cutoff):
    """(cache) Let go of the segments unused since ``cutoff`` (all if None); whether any is
    left."""
    with _lock:
        for entry in [e for e in _entries if cutoff is None or e[3] < cutoff]:
            _entries.remove(entry)
            _drop(entry)
        return bool(_entries)


def _held():
    with _lock:       # (+ mmap's own dup of the fd before 3.13)
        return _total, sum((e[2] is not None) + (sys.version_info < (3, 13)) for e in _entries)


cache.register(2, "pool", expire, _held)


def _forget(entry):
    global _total
    _total -= entry[0]


def _drop(entry):
    _forget(entry)
    if entry[4] is None:
        entry[2].close()
    else:
        _unpark(entry)
    entry[1] = None               # the mapping goes with its last reference


def _unpark(entry):
    """A named segment leaves the pool: the daemon unlinks it once no one holds it, under
    either name (it may have moved it to the pool already, or not)."""
    if entry[7] == manager.generation():
        manager.dropped(entry[4])
        manager.dropped(entry[5])


@forks.in_child
def _after_fork_in_child() -> None:
    # The parent reuses these segments; a child must not write into them (nor hold their fds,
    # nor their names: the fork's token held them for it).
    global _total
    for entry in _entries:
        if entry[2] is not None:
            entry[2].close_inherited()
        else:
            manager.unheld_in_child([entry[4], entry[5]])
    _entries.clear()
    _total = 0


forks.renew_locks(globals(), "_lock")

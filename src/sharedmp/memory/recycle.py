"""Recycling: a process reuses the memfd segments it made once no other process holds them.

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

Bounds: ``$SHAREDMP_RECYCLE_BYTES`` (default 256 MiB, 0 turns recycling off) for all the
segments kept, and a quarter of the memory this machine (or its cgroup) could still make
available, whichever is smaller; a quarter of that for one segment; a few fds (two per
segment kept). A segment not reused for ``cache.idle()`` seconds is let go.
"""
import collections
import fcntl
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from .. import forks
from . import cache

if TYPE_CHECKING:
    import mmap

ENV = "SHAREDMP_RECYCLE_BYTES"
DEFAULT_LIMIT = 256 << 20
MAX_ENTRIES = 16

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_lock = threading.RLock()       # an RLock: give() runs in finalizers, which may run inside take()
# [size, mapping, private fd, unused since], oldest first
_entries: "collections.deque[list[Any]]" = collections.deque()
_total = 0
_limit = None


def limit():
    """Bytes of segments kept for reuse at most ($SHAREDMP_RECYCLE_BYTES, read once)."""
    global _limit
    if _limit is None:
        try:
            _limit = max(0, int(os.environ.get(ENV, DEFAULT_LIMIT)))
        except ValueError:
            raise ValueError(f"${ENV} must be a number of bytes (0 turns recycling off), "
                             f"not {os.environ[ENV]!r}") from None
    return _limit


def shared_fd(private):
    """A second OFD of the memfd ``private``, holding LOCK_SH: the fd that is sent.

    Without /proc (or with recycling off) a plain dup: the segment is then never reused.
    Returns (fd, recyclable).
    """
    if limit():
        try:
            fd = os.open(f"/proc/self/fd/{private}", os.O_RDWR | _O_CLOEXEC)
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
    bound = limit()
    with _lock:
        if available is not None:
            bound = min(bound, (available + _total + size) // 4)
        if size > bound // 4:
            os.close(private)
            return
        _entries.append([size, mapping, private, time.monotonic() if since is None else since])
        _total += size
        while _total > bound or len(_entries) > MAX_ENTRIES:
            _drop(_entries.popleft())


def take(size: int) -> "tuple[mmap.mmap, int] | None":
    """(mapping, private fd) of a kept segment of ``size`` bytes that no other process holds, or
    None."""
    with _lock:
        for entry in _entries:
            if entry[0] != size:
                continue
            try:
                fcntl.flock(entry[2], fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:       # another process (or a message in flight) still holds it
                continue
            fcntl.flock(entry[2], fcntl.LOCK_UN)
            _entries.remove(entry)
            _forget(entry)
            return entry[1], entry[2]
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
    with _lock:
        return _total, len(_entries) * (2 if sys.version_info < (3, 13) else 1)   # + mmap's dup


cache.register(2, "pool", expire, _held)


def _forget(entry):
    global _total
    _total -= entry[0]


def _drop(entry):
    _forget(entry)
    os.close(entry[2])
    entry[1] = None               # the mapping goes with its last reference


@forks.in_child
def _after_fork_in_child() -> None:
    # The parent reuses these segments; a child must not write into them (nor hold their fds).
    global _total
    for entry in _entries:
        try:
            os.close(entry[2])
        except OSError:
            pass
    _entries.clear()
    _total = 0


forks.renew_locks(globals(), "_lock")

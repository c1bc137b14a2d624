"""The file_system strategy: named segments, files in the shm directory that others open by
name, their life told to the manager daemon (``manager.py``, ``daemon.py``).

    create(size)                      open(O_CREAT|O_EXCL, 0600) in shm_dir() -> fallocate
                                      -> mmap (or one this process parked and the daemon
                                      found free: ``recycle.take_named``)
    attach_name(name)                 open(name) -> fstat -> mmap -> close, once per process

What a segment is, its mapping and the tables of what this process maps: ``segment.py``.
Names are unlinked by the daemon once no process holds them and no message carries them,
never by a process that merely attached (the mistake of CPython 3.11's shared_memory,
gh-82300).

A named segment this process created is viewed through a lease (a uint8 ndarray over its
mmap). When the lease goes, the segment is *parked* (``recycle.give_named``; the daemon
moves it out of the directory's listing once no one else holds it, and it is reused under
a new name). An arena (``create(revivable=True)``) is not parked at once if it was carved
from within the last ``PARK_DEFER`` seconds: a stream that drops each array after sending
it would otherwise park its arena, and move to another, for every message. It stays
*pending* (registered, its name unchanged, no record sent): the allocator's next carve
revives it (``revive``: a new lease), or the next pass of the caches parks it (``cache.py``:
at the process's next sharedmp operation or wait ``cache.TICK`` s or more later). A
segment carved from once and dropped later (a tensor sent, received and dropped, as
torch's own tests do) is parked at once, and gone from the listing a few milliseconds
later.

Fork. A child maps what its parent mapped, and holds it at the daemon once it has said so on
a connection of its own; until then the parent holds it for the child (manager.py, "Fork").
A segment is registered here only after its hold was told to the daemon (``C``, ``R``,
``H``), and never between the parent's hold and the fork (``_fork_gate``, held across it):
so whatever the child inherits mapped, the parent held when it made its hold. Names told
and not yet registered (made or attached by another thread at the fork) are in ``_making``:
the child does not map them, and says so.
"""
from __future__ import annotations

import errno
import os
import re
import stat
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING

from .. import forks, settings
from ..errors import OutOfSharedMemory, SegmentError
from ..host import available_memory_cached
from . import cache, manager, recycle, segment
from .segment import Segment

if TYPE_CHECKING:
    from .segment import SegmentMapping

SHM_DIR_ENV = settings.SHM_DIR
PREFIX = "sharedmp_"
# A segment's name: PREFIX and 80 random bits in hex, short enough for macOS's 31-character
# shm names. The one pattern of sharedmp's names (daemon.py, a stdlib-only script, keeps a
# copy that tests/test_doctor.py holds equal to this one).
NAME_RE = re.compile(re.escape(PREFIX) + r"[0-9a-f]{20}\Z")
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
# Of named segments only arenas (their size: arena.ARENA_SIZE) are kept mapped by a receiver
# (``segment.keep_recent``): a named segment is parked by its creator for reuse, which must
# wait for every holder, this cache included, and a segment of its own (1 MiB or more) is
# seldom sent twice.
KEEP_RECENT_NAMED_SIZE = 4 << 20

_fork_gate = threading.Lock()   # held by a fork's hold until the fork returns (see above)
_making: set[str] = set()       # names told to the daemon, not registered yet (see above)


def shm_dir() -> str:
    """Where named segments live: $SHAREDMP_SHM_DIR, else /dev/shm."""
    return settings.get(SHM_DIR_ENV)  # type: ignore[no-any-return]


def create(size: int, zero: bool = True,
           revivable: bool = False) -> tuple[Segment, SegmentMapping]:
    """A named segment of ``size`` bytes, mapped here; returns (segment, mapping).

    Its memory is zero unless ``zero`` is false and it is recycled. ``revivable``: an arena
    (see ``revive``)."""
    segment.check_size(size)
    if recycle.kept()[0]:
        manager.check()             # (a segment reused tells the daemon nothing: is it there?)
        named = recycle.take_named(size, shm_dir(), _making)
        if named is not None:
            mm, path, address = named
            return _adopt_named(size, mm, path, reused=True, zero=zero, revivable=revivable,
                                address=address)
    # (named ones kept for reuse: gone once the daemon has unlinked them)
    return segment.made(size, lambda size: _create_named(size, revivable),  # type: ignore[no-any-return]
                        settle=manager.sync)


segment.without_memfd = create


def _register(seg, mm):
    """Register the segment, its hold told to the daemon already (see above)."""
    with _fork_gate:
        segment.register(seg, mm)
        _making.discard(seg.path)


def _release(seg, mapping_id):
    """The last view of a named segment this process attached is gone."""
    segment.release(seg, mapping_id)
    manager.dropped(seg.path)       # the daemon unlinks once no one holds it


def _create_named(size, revivable=False):
    directory = shm_dir()
    if not os.path.isdir(directory):
        raise OutOfSharedMemory(
            f"the shared-memory directory {directory!r} does not exist; "
            f"point ${SHM_DIR_ENV} at a tmpfs directory or use the 'file_descriptor' strategy")
    import secrets                  # (here: it costs 3 ms to import, file_system only)
    while True:
        name = PREFIX + secrets.token_hex(10)
        path = os.path.join(directory, name)
        # The daemon hears of the name before the file exists: if this process is killed
        # at any point from here on, the daemon unlinks what it made.
        _making.add(path)
        try:
            manager.created(path)
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | _O_CLOEXEC | _O_NOFOLLOW,
                         0o600)
            break
        except FileExistsError:
            _making.discard(path)
            manager.forget(path)       # someone else's file: not ours to unlink
        except BaseException:
            _making.discard(path)
            manager.forget(path)       # nothing was made
            raise
    try:
        try:
            segment.reserve(fd, size, directory,
                     f"{directory} is full: make it larger (mount -o remount,size=...), point "
                     f"${SHM_DIR_ENV} at a bigger tmpfs, or use the 'file_descriptor' strategy.")
            mm = segment.map_fd(fd, size)
        finally:
            os.close(fd)  # the mapping keeps the memory; the name is how others find it
    except BaseException:
        _making.discard(path)
        os.unlink(path)
        manager.dropped(path)
        raise
    return _adopt_named(size, mm, path, reused=False, zero=False, revivable=revivable)


def _adopt_named(size, mm, path, reused, zero, revivable, address=None):
    """Register a named segment made (or reused from the pool) here, mapped as ``mm``: viewed
    through a lease, so that it goes to the pool (``recycle``) when its last view goes."""
    import numpy as np             # (here: `import sharedmp` does not import NumPy)
    lease = np.frombuffer(mm, np.uint8)
    name = os.path.basename(path)
    seg = Segment("file_system", name, size, -1, name, lease, owner=True, path=path,
                  recycle=(mm, -1) if recycle.limit() else None, address=address)
    if zero and reused:
        lease.fill(0)
    seg.dirty = reused and not zero
    seg.revivable = revivable
    seg.carved = time.monotonic()
    _register(seg, lease)
    if seg.recycle is not None:
        seg.mapping = _Lease(lease, _lease_gone)     # (a lighter finalizer: see ``revive``)
        seg.mapping.seg, seg.mapping.mid = seg, id(lease)
    else:
        weakref.finalize(lease, _release, seg, id(lease))
    return seg, lease


class _Lease(weakref.ref):  # type: ignore[type-arg]
    """The weak reference to the lease of a named segment made here; its callback parks it."""
    __slots__ = ("seg", "mid")
    seg: Segment
    mid: int


# A revivable segment carved from within this many seconds before its lease went is kept
# pending (see the module docstring), not parked at once.
PARK_DEFER = 0.005


def _lease_gone(ref):
    """The last view of a named segment made here is gone: park it (or keep it pending)."""
    if sys.is_finalizing():
        return                          # (the daemon drops what this process held at its exit)
    seg = ref.seg
    with segment.lock():
        if seg.mapping is not ref:
            return                      # (revived meanwhile: a new lease)
        segment.forget_view(seg, ref.mid)
        pending = (seg.revivable and seg.owner_pid == os.getpid() and seg.recycle is not None
                   and time.monotonic() - seg.carved < PARK_DEFER)
        if pending:
            seg.pending = True
            _pending.add(seg)
        else:
            segment.unregister(seg, ref.mid)
    if pending:
        cache.start()                   # (parked by the next pass, unless revived first)
        return
    _park(seg)


def _park(seg):
    """(unregistered) Give the named segment made here to the pool, or let it go."""
    mm = None
    if seg.recycle is not None:
        (mm, _), seg.recycle = seg.recycle, None
    if mm is not None and seg.owner_pid == os.getpid():
        directory = seg.path[:-len(seg.name) - 1]
        nxt = f"{directory}/{PREFIX}{os.urandom(10).hex()}"
        if recycle.give_named(seg.size, mm, seg.path, nxt, directory, seg.address,
                              seg.idle_since, available_memory_cached()):
            if manager.parked(seg.path, nxt):
                manager.let_go(seg.path)
                return
            recycle.take_back(seg.path)         # (no daemon: nothing to park with)
    manager.dropped(seg.path)           # the daemon unlinks once no one holds it


# Revivable segments whose lease went, not parked yet
_pending: set[Segment] = set()


def revive(seg: Segment) -> SegmentMapping | None:
    """A new lease of a pending segment (see the module docstring), or None if it was parked
    (or is still viewed: then its lease)."""
    with segment.lock():
        mm = seg.mapping()
        if mm is not None or not seg.pending:
            return mm
        import numpy as np
        lease = np.frombuffer(seg.recycle[0], np.uint8)  # type: ignore[index]  # (pending)
        seg.pending = False
        _pending.discard(seg)
        seg.mapping = _Lease(lease, _lease_gone)
        seg.mapping.seg, seg.mapping.mid = seg, id(lease)
        segment.add_view(seg, lease)
        return lease


def abandon(seg: Segment) -> None:
    """The allocator moves on from this arena: park it once no array uses it (now, if none
    does)."""
    with segment.lock():
        seg.revivable = False
        if not seg.pending:
            return
        seg.pending = False
        _pending.discard(seg)
        segment.unregister(seg, None)
    _park(seg)


def park_pending(cutoff: float | None) -> bool:
    """(cache) Park the pending segments; whether some are left (none: all were parked)."""
    with segment.lock():
        parked = [seg for seg in _pending if seg.pending]
        _pending.clear()
        for seg in parked:
            seg.pending = False
            segment.unregister(seg, None)
    for seg in parked:
        _park(seg)
    return False


def _held_pending():
    with segment.lock():
        return segment.held_by(list(_pending))


cache.register(1, "pending", park_pending, _held_pending)


def attach_name(name: str, consume: bool = True, token: int = -1) -> SegmentMapping:
    """The mapping of the named segment ``name``, mapped once per process.

    ``consume``: a reference in flight counted at the daemon ends here (a message of a
    sharedmp channel: false, its token holds the reference; ``token``: that token's fd, if
    known: mapped anew here, the message's reference ends, see daemon.py ``H``)."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise SegmentError(f"{name!r} is not a sharedmp segment name")
    seg = segment.by_key(name)
    mm = seg.mapping() if seg is not None else None
    if mm is None and seg is not None and seg.pending:
        mm = revive(seg)              # one this process made and dropped: not parked yet
    if mm is not None:
        seg.hot = time.monotonic()  # type: ignore[union-attr]  # (mm is not None: so is seg)
        if consume:
            # this message's reference in flight is consumed
            manager.received(seg.path)  # type: ignore[union-attr, arg-type]
        return mm
    manager.ensure()
    path = os.path.join(shm_dir(), name)
    mm = _attach_parked(path, consume, token) if recycle.kept()[0] else None
    if mm is not None:
        return mm
    try:
        fd = os.open(path, os.O_RDWR | _O_CLOEXEC | _O_NOFOLLOW)
    except FileNotFoundError:
        raise SegmentError(
            f"shared-memory segment {name} no longer exists in {shm_dir()}: every process that "
            "held it let go before this one attached (the same message unpickled twice, a sender "
            "killed in the middle of put(), or a sender with another $SHAREDMP_SHM_DIR). Use the "
            "'file_descriptor' strategy if it persists.") from None
    except OSError as e:   # a symlink (O_NOFOLLOW), a directory, not ours (EACCES), ...
        if e.errno == errno.EMFILE:
            raise segment.too_many_files("open") from None
        raise SegmentError(f"{path} cannot be attached as a shared-memory segment: "
                           f"{e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size == 0:
            raise SegmentError(f"{path} is not a segment of this user")
        try:
            mm = segment.map_fd(fd, st.st_size)
        except OSError as e:
            raise (segment.too_many_files("map") if e.errno == errno.EMFILE else e) from None
    finally:
        os.close(fd)
    seg = Segment("file_system", name, st.st_size, -1, name, mm, owner=False, path=path)
    _hold(path, consume, token)
    _register(seg, mm)
    weakref.finalize(mm, _release, seg, id(mm))
    if st.st_size == KEEP_RECENT_NAMED_SIZE:
        segment.keep_recent(mm, seg)
    cache.tick()                    # (a segment mapped anew: a pass, if one is due)
    return mm


def _attach_parked(path, consume, token):
    """The mapping of a segment this process made and parked (it holds it again: out of the
    pool), or None."""
    _making.add(path)
    kept = recycle.take_back(path)
    if kept is None:
        _making.discard(path)
        return None
    _hold(path, consume, token)
    return _adopt_named(len(kept), kept, path, reused=False, zero=False, revivable=False)[1]


def _hold(path, consume, token):
    """Tell the daemon this process holds ``path`` now (before it is registered: a fork from
    then on holds it for the child): received (``consume``), or held before the message's
    token is closed."""
    _making.add(path)
    try:
        if consume:
            manager.received(path)     # the reference in flight is consumed
        else:
            manager.holds(path, token)
    except BaseException:
        _making.discard(path)
        raise


forks.renew_locks(globals(), "_fork_gate")


@forks.before
def _before_fork() -> None:
    # The parent holds what it holds for the child until the child holds it itself
    # (manager.py, "Fork"); no segment is registered from here until the fork has returned.
    # (The gate is not taken by finalizers: one run by this thread meanwhile cannot wait on it.)
    _fork_gate.acquire()
    manager.before_fork()


@forks.in_parent
def _after_fork_in_parent() -> None:
    _fork_gate.release()


@forks.in_child
def _after_fork_in_child() -> None:
    unheld = list(_making)          # another thread's, under way: gone with it
    _making.clear()
    for seg in list(_pending):      # the parent's, unviewed: the child does not map them
        segment.unregister(seg, None)
        seg.recycle, seg.pending = None, False
        unheld.append(seg.path)  # type: ignore[arg-type]  # (named: it has one)
    _pending.clear()
    # The child maps what the parent mapped: it holds those names too, on its own connection.
    manager.after_fork_in_child(unheld, [s.path for s in segment.live_segments()
                                         if s.path is not None])

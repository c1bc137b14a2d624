"""Segments: blocks of shared memory, one owner object per fd and per mapping.

A segment is created by one process and attached by others::

    create(size, "file_descriptor")   memfd_create -> posix_fallocate -> seal -> mmap
                                      (or one this process made before and no one holds:
                                      recycle.py)
    create(size, "file_system")       open(O_CREAT|O_EXCL, 0600) in SHM_DIR -> fallocate -> mmap
    attach_fd(fd)                     fstat (identity, size, seals) -> mmap, once per process
    attach_name(name)                 open(name) -> fstat -> mmap -> close, once per process

The mapping is a ``mmap.mmap``; NumPy arrays view it (``ndarray(buffer=mm)``), so the
mapping lives exactly as long as some view does. A ``weakref.finalize`` on the mapping
then releases what the segment still owns: its fd, and for a named segment, this
process's hold on the name. A memfd segment this process created is viewed through a
uint8 ndarray over its mmap instead (the "lease"): when the lease goes, the mmap stays,
and the segment goes to ``recycle`` to be handed out again once no other process holds
it. Names are unlinked by the manager daemon (``manager.py``, ``daemon.py``) once no
process holds them and no message carries them, never by a process that merely
attached (the mistake of CPython 3.11's shared_memory, gh-82300).

A named segment this process created is viewed through a lease too. When the lease goes,
the segment is *parked* (``recycle.give_named``; the daemon moves it out of the directory's
listing once no one else holds it, and it is reused under a new name). An arena
(``create(revivable=True)``) is not parked at once if it was carved from within the last
``PARK_DEFER`` seconds: a stream that drops each array after sending it would otherwise
park its arena, and move to another, for every message. It stays *pending* (registered,
its name unchanged, no record sent): the allocator's next carve revives it (``revive``: a
new lease), or the cache thread parks it at its next tick. A segment carved from once and
dropped later (a tensor sent, received and dropped, as torch's own tests do) is parked at
once, and gone from the listing a few milliseconds later.

Memory is reserved when the segment is made (``posix_fallocate``): running out raises
``OutOfSharedMemory`` here, instead of SIGBUS at the first touch of a page. memfd
segments are sealed against shrinking and growing, so no peer can truncate one under
a reader; a receiver checks the seals and the size before it builds a view.

What the platform offers (memfd, fallocate, the memory available) is found out in
``host.py``; what sharedmp's memory does with it (memfd or named, seals, reserve) is here.
"""
from __future__ import annotations

import bisect
import collections
import errno
import fcntl
import mmap
import os
import re
import stat
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Union

from .. import forks, settings
# (the platform's facts: host.py; named here too, as segment.HAVE_MEMFD, ... for callers)
from ..host import HAVE_FALLOCATE, HAVE_MEMFD, available_memory, available_memory_cached
from ..errors import OutOfSharedMemory, SegmentError
from . import cache, manager, recycle

SEALS = (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL) if HAVE_MEMFD else 0
SHM_DIR_ENV = settings.SHM_DIR
PREFIX = "sharedmp_"
# A segment's name: PREFIX and 80 random bits in hex, short enough for macOS's 31-character
# shm names. The one pattern of sharedmp's names (daemon.py, a stdlib-only script, keeps a
# copy that tests/test_doctor.py holds equal to this one).
NAME_RE = re.compile(re.escape(PREFIX) + r"[0-9a-f]{20}\Z")
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

if TYPE_CHECKING:
    from typing import TypeAlias

    import numpy as np
    from numpy.typing import NDArray

    # What arrays view: the mmap of a segment, or the uint8 lease over one this process made.
    SegmentMapping: TypeAlias = Union[mmap.mmap, NDArray[np.uint8]]


def shm_dir() -> str:
    """Where named segments live: $SHAREDMP_SHM_DIR, else /dev/shm."""
    return settings.get(SHM_DIR_ENV)  # type: ignore[no-any-return]


class Segment:
    """What this process knows of one segment; the mapping itself is held by the arrays."""

    __slots__ = ("kind", "key", "size", "fd", "name", "path", "address", "owner_pid", "mapping",
                 "recycle", "dirty", "hot", "idle_since", "revivable", "carved", "pending",
                 "__weakref__")

    def __init__(self, kind: str, key: Any, size: int, fd: int, name: str | None,
                 mm: SegmentMapping, owner: bool, path: str | None = None,
                 recycle: tuple[mmap.mmap, int] | None = None,
                 address: int | None = None) -> None:
        self.kind = kind          # "file_descriptor" | "file_system"
        self.key = key            # (st_dev, st_ino) for memfd, the name for named segments
        self.size = size
        # kept (memfd) so that this process can send it on; -1 if none. Closed with the
        # mapping (``_release``), in each process that has it, a forked child too: not fds.Fd
        self.fd = fd
        self.name = name
        # where a named segment was made or found (the directory may change)
        self.path = path
        self.owner_pid = os.getpid() if owner else None
        self.mapping = weakref.ref(mm)
        self.address = _address(mm) if address is None else address
        # (mmap, private fd) of a memfd segment this process made; (mmap, -1) of a named one
        self.recycle = recycle
        self.dirty = False        # recycled and not zeroed (create(zero=False)): old bytes in it
        self.hot = False          # attached again since the cache last looked (``_recent``)
        self.idle_since = None    # unused since then (a cached arena let go): the pool's clock
        self.revivable = False    # named, made here: an arena, revived after its lease went
        self.carved = 0.0         # (revivable) monotonic time of the last carve
        self.pending = False      # (revivable) its lease went, not parked yet: ``revive``

    def __repr__(self) -> str:
        return f"<Segment {self.kind} {self.name or self.key} {self.size} bytes>"


# id(mapping) -> Segment, and key -> Segment, for the live mappings of this process.
_by_mapping: dict[int, Segment] = {}
_by_key: dict[Any, Segment] = {}
_lock = threading.Lock()
# Start address -> Segment, and the sorted start addresses: which mapping holds an address
# (torch storages know only their data pointer). An address freed by munmap may be mapped
# again before the old mapping's finalizer runs: an entry is removed only by its own segment.
_by_address: dict[int, Segment] = {}
_addresses: list[int] = []
# A fork holds for the child what this process holds at the daemon (``_before_fork``): a
# segment is registered here only after its hold was told, and never between that hold and
# the fork (``_fork_gate``, held across it); names being made or attached, told and not yet
# registered, are in ``_making``: a child does not map them.
_fork_gate = threading.Lock()
_making: set[str] = set()

# A receiver keeps the few small segments (arenas) it attached last mapped, even with no
# view left: a stream of small arrays, each dropped after use, would otherwise map and
# unmap its arena for every message. Bigger segments go with their last view; these go
# once no message has used them for ``cache.idle()`` seconds.
KEEP_RECENT = 4
KEEP_RECENT_MAX_SIZE = 4 << 20
# Of named segments only arenas (their size: arena.ARENA_SIZE) are kept: a named segment is
# parked by its creator for reuse, which must wait for every holder, this cache included,
# and a segment of its own (1 MiB or more) is seldom sent twice.
KEEP_RECENT_NAMED_SIZE = 4 << 20
# [mapping, Segment, monotonic time]
_recent: collections.deque[list[Any]] = collections.deque(maxlen=KEEP_RECENT)


def _keep_recent(mm, seg):
    if len(mm) <= KEEP_RECENT_MAX_SIZE:
        _recent.append([mm, seg, time.monotonic()])


def forget_recent():
    """Drop the mappings kept by ``_keep_recent`` (they go once no view uses them)."""
    _recent.clear()


def _expire_recent(cutoff):
    """(cache) Let go of the recent mappings unused since ``cutoff`` (all if None). Whether the
    cache thread is still needed: while this process maps a segment, it may land in a cache."""
    now, drop = time.monotonic(), []
    for entry in list(_recent):
        seg = entry[1]
        if cutoff is None or (not seg.hot and entry[2] < cutoff):
            drop.append(entry)
        elif seg.hot:
            seg.hot, entry[2] = False, now
    for entry in drop:
        try:
            _recent.remove(entry)
        except ValueError:            # pushed out by a newer one meanwhile
            pass
    return bool(_by_key) or bool(_recent)   # (unmapped as ``drop`` goes: outside any lock)


def _held_recent():
    """(bytes, fds) of the recent mappings that nothing but this cache uses."""
    return held_by([e[1] for e in list(_recent) if sys.getrefcount(e[0]) <= 2])  # (entry, call)


def _held_mapped():
    with _lock:
        return held_by(list(_by_key.values()))


# Python's mmap keeps a dup of the fd it maps until 3.13 (trackfd): one more fd per mapping.
_FDS_PER_MAPPING = 1 if sys.version_info < (3, 13) else 0


def held_by(segments: list[Segment]) -> tuple[int, int]:
    """(bytes, fds) that these mapped segments hold in this process."""
    return (sum(s.size for s in segments),
            sum((s.fd >= 0) + (s.recycle is not None and s.recycle[1] >= 0) + _FDS_PER_MAPPING
                for s in segments))


cache.register(1, "recent", _expire_recent, _held_recent)
cache.register(3, "mapped", lambda cutoff: False, _held_mapped)


def _address(mm):
    import ctypes  # deferred: only needed once per mapping
    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


def _register(seg, mm):
    with _fork_gate, _lock:
        _by_mapping[id(mm)] = seg
        _by_key[seg.key] = seg
        if seg.address not in _by_address:
            bisect.insort(_addresses, seg.address)
        _by_address[seg.address] = seg
        if seg.path is not None:
            _making.discard(seg.path)
    if seg.kind == "file_system" and seg.recycle is not None:
        seg.mapping = _Lease(mm, _lease_gone)        # (a lighter finalizer: see ``revive``)
        seg.mapping.seg, seg.mapping.mid = seg, id(mm)
    else:
        weakref.finalize(mm, _release, seg, id(mm))
    cache.start()                   # gives back what stays cached once this is unused


def _unregister(seg, mapping_id):
    """(lock held) Forget the segment's entries."""
    if _by_mapping.get(mapping_id) is seg:
        del _by_mapping[mapping_id]
    if _by_key.get(seg.key) is seg:
        del _by_key[seg.key]
    if _by_address.get(seg.address) is seg:
        del _by_address[seg.address]
        i = bisect.bisect_left(_addresses, seg.address)
        if i < len(_addresses) and _addresses[i] == seg.address:
            del _addresses[i]


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
    with _lock:
        if seg.mapping is not ref:
            return                      # (revived meanwhile: a new lease)
        if _by_mapping.get(ref.mid) is seg:
            del _by_mapping[ref.mid]
        if (seg.revivable and seg.owner_pid == os.getpid() and seg.recycle is not None
                and time.monotonic() - seg.carved < PARK_DEFER):
            seg.pending = True
            _pending.add(seg)
            return
        _unregister(seg, ref.mid)
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
    with _lock:
        mm = seg.mapping()
        if mm is not None or not seg.pending:
            return mm
        import numpy as np
        lease = np.frombuffer(seg.recycle[0], np.uint8)  # type: ignore[index]  # (pending)
        seg.pending = False
        _pending.discard(seg)
        seg.mapping = _Lease(lease, _lease_gone)
        seg.mapping.seg, seg.mapping.mid = seg, id(lease)
        _by_mapping[id(lease)] = seg
        return lease


def abandon(seg: Segment) -> None:
    """The allocator moves on from this arena: park it once no array uses it (now, if none
    does)."""
    with _lock:
        seg.revivable = False
        if not seg.pending:
            return
        seg.pending = False
        _pending.discard(seg)
        _unregister(seg, None)
    _park(seg)


def registered(seg: Segment) -> bool:
    """Whether the segment is mapped here (viewed, or pending), not parked nor released."""
    return _by_key.get(seg.key) is seg


def park_pending(cutoff: float | None) -> bool:
    """(cache) Park the pending segments; whether the thread is still needed for them."""
    with _lock:
        parked = [seg for seg in _pending if seg.pending]
        _pending.clear()
        for seg in parked:
            seg.pending = False
            _unregister(seg, None)
    for seg in parked:
        _park(seg)
    return False


def _held_pending():
    with _lock:
        return held_by(list(_pending))


cache.register(1, "pending", park_pending, _held_pending)


def _release(seg, mapping_id):
    """The last view of the mapping is gone: forget it, close its fd, unlink if ours."""
    with _lock:
        _unregister(seg, mapping_id)
    if seg.fd >= 0:
        fd, seg.fd = seg.fd, -1
        os.close(fd)
    if seg.recycle is not None:
        (mm, private), seg.recycle = seg.recycle, None
        if seg.owner_pid == os.getpid():
            recycle.give(seg.size, mm, private, seg.idle_since, available_memory_cached())
        else:                       # inherited by fork: the parent reuses it, not this child
            os.close(private)
    if seg.path is not None:
        manager.dropped(seg.path)     # the daemon unlinks once no one holds it


def segment_of(mm: object) -> Segment | None:
    """The Segment behind a mapping object, or None if it is not one of ours."""
    seg = _by_mapping.get(id(mm))
    return seg if seg is not None and seg.mapping() is mm else None


_last_found = None                # the Segment containing() found last (a hint: checked each time)


def containing(address: int,
               nbytes: int = 1) -> tuple[Segment, SegmentMapping] | tuple[None, None]:
    """(Segment, mapping) of the live mapping of this process that holds the ``nbytes``
    bytes at ``address``, or (None, None). For memory known only by its address (a torch
    storage's data pointer); the offset within the segment is ``address - seg.address``."""
    global _last_found
    seg = _last_found             # most calls ask about the segment of the call before (an arena)
    if seg is not None and seg.address <= address and address + nbytes <= seg.address + seg.size:
        mm = seg.mapping()        # (dead once released: its range may be a new segment's now)
        if mm is not None:
            return seg, mm
    with _lock:
        i = bisect.bisect_right(_addresses, address) - 1
        if i < 0:
            return None, None
        seg = _by_address[_addresses[i]]
    if address + nbytes > seg.address + seg.size:
        return None, None
    mm = seg.mapping()
    if mm is None:
        return None, None
    _last_found = seg
    return seg, mm


def live_segments() -> list[Segment]:
    """The segments this process maps now (for diagnostics and tests)."""
    with _lock:
        return list(_by_key.values())


def _map(fd, size, private=False):
    # Python's mmap keeps a dup of the fd for as long as the mapping lives (3.13 adds
    # trackfd=False to avoid it); the segment's own fd stays with the Segment. ``private``:
    # copy-on-write (a sealed segment: ``create_sealed``).
    return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE if private else mmap.MAP_SHARED,
                     prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _reserve(fd, size, what, hint):
    """Reserve the pages now so that a shortage is an exception, not SIGBUS at first touch."""
    try:
        if HAVE_FALLOCATE:
            os.posix_fallocate(fd, 0, size)
        else:  # macOS: no fallocate for shm objects; ftruncate is what there is.
            os.ftruncate(fd, size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG, errno.EDQUOT):
            raise OutOfSharedMemory(
                f"cannot reserve {format_size(size)} of shared memory in {what}: "
                f"{os.strerror(e.errno)}. {hint}") from None
        raise


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def create(size: int, kind: str, zero: bool = True,
           revivable: bool = False) -> tuple[Segment, SegmentMapping]:
    """A segment of ``size`` bytes, mapped here; returns (segment, mapping).

    Its memory is zero unless ``zero`` is false and it is recycled. ``revivable``: an arena
    (named: see ``revive``)."""
    if size <= 0:
        raise ValueError(f"segment size must be > 0, not {size}")
    if kind not in ("file_descriptor", "file_system"):
        raise ValueError(f"unknown segment kind {kind!r}")
    if kind == "file_descriptor":
        reused = recycle.take(size)
        if reused is not None:
            return _adopt_memfd(size, *reused, reused=True, zero=zero)
    elif recycle.kept()[0]:
        manager.check()             # (a segment reused tells the daemon nothing: is it there?)
        named = recycle.take_named(size, shm_dir(), _making)
        if named is not None:
            mm, path, address = named
            return _adopt_named(size, mm, path, reused=True, zero=zero, revivable=revivable,
                                address=address)
    try:
        try:
            return _create(size, kind, revivable)
        except (OutOfSharedMemory, OSError) as e:
            if not recycle.kept()[0] \
                    or not (isinstance(e, OutOfSharedMemory) or e.errno == errno.EMFILE):
                raise
        recycle.clear()             # the segments kept for reuse hold memory and fds: without them
        manager.sync()              # (named ones: gone once the daemon has unlinked them)
        return _create(size, kind, revivable)
    except OSError as e:            # limits of this process, said with the setting to change
        if e.errno == errno.EMFILE:
            raise _too_many_files("create") from None
        if e.errno == errno.ENOMEM and not isinstance(e, OutOfSharedMemory):
            raise OutOfSharedMemory(f"cannot map {format_size(size)} of shared memory: this "
                                    "process's address space is exhausted (`ulimit -v`, "
                                    "RLIMIT_AS) or it has too many mappings "
                                    "(vm.max_map_count)") from None
        raise


def _create(size, kind, revivable=False):
    _check_available(size)
    return _create_memfd(size) if kind == "file_descriptor" else _create_named(size, revivable)


def _check_available(size):
    # Checked before fallocate: a memfd bigger than memory would wake the OOM killer
    # instead of failing. A fresh reading for big requests, a recent one for small.
    avail = available_memory() if size >= 16 << 20 else available_memory_cached()
    if avail is not None and size > avail:
        raise OutOfSharedMemory(
            f"cannot reserve {format_size(size)} of shared memory: this machine has only "
            f"{format_size(avail)} available (MemAvailable + SwapFree, within the cgroup limit). "
            "Use smaller arrays, free memory, or allocate in chunks.")


def _too_many_files(what):
    return OSError(errno.EMFILE, f"too many open files to {what} a shared-memory segment: raise "
                   "the limit (`ulimit -n`, RLIMIT_NOFILE), or keep fewer big arrays alive "
                   "(arrays below 1 MiB share a few segments)")


def _new_memfd(name, size):
    """A memfd of ``size`` bytes, reserved (``OutOfSharedMemory``), its seals still to add."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        _reserve(fd, size, "an anonymous memfd segment",
                 "Free memory or use smaller arrays; memfd memory counts against RAM and the "
                 "cgroup limit.")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _create_memfd(size):
    if not HAVE_MEMFD:
        raise OSError("the file_descriptor strategy needs memfd_create (Linux); use 'file_system'")
    fd = _new_memfd("sharedmp", size)
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        mm = _map(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return _adopt_memfd(size, mm, fd, reused=False, zero=False)


_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
# A sealed segment can be written by no one once made: its memfd carries F_SEAL_WRITE.
SEALED = SEALS | (fcntl.F_SEAL_WRITE if HAVE_MEMFD else 0)


def create_sealed(size: int, fill: Any) -> SegmentMapping:
    """A segment of ``size`` bytes that ``fill(view)`` writes once (``view``: a writable
    memoryview, to be let go before it returns) and that no process can write after; returns
    this process's mapping.

    What shared datasets are made of (``datasets/``): a memfd sealed against writes once
    filled, so that no process, of this program or any other of the user (through
    ``/proc/<pid>/fd``), can change what readers unpickle. Every process maps it
    copy-on-write (``MAP_PRIVATE``), this one too: the pages are shared until a process
    writes one, and what it writes stays its own, as with data each process had a copy of.
    Without memfd (macOS) it is an ordinary segment of the current strategy, written in place
    and writable by any process of the user (SECURITY.md)."""
    if not HAVE_MEMFD:
        from ..strategy import get_sharing_strategy
        mm = create(size, get_sharing_strategy(), zero=False)[1]
        with memoryview(mm).cast("B") as view:  # type: ignore[arg-type]  # (a uint8 lease)
            fill(view)
        return mm
    _check_available(size)
    try:
        fd = _new_memfd("sharedmp-sealed", size)
    except OSError as e:
        raise (_too_many_files("create") if e.errno == errno.EMFILE else e) from None
    try:
        with _map(fd, size) as writable:
            with memoryview(writable) as view:
                fill(view)
        # (F_SEAL_WRITE needs no writable shared mapping left: the one above is unmapped)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALED)
        mm = _map(fd, size, private=True)
        # Map the pages written here, without copying them (MADV_POPULATE_READ, Linux 5.14):
        # this process holds them as it did through the writable mapping, and they count in
        # its Pss, shared with its readers, rather than in the first reader's alone.
        try:
            mm.madvise(_MADV_POPULATE_READ)
        except OSError:
            pass
    except BaseException:
        os.close(fd)
        raise
    st = os.fstat(fd)
    seg = Segment("file_descriptor", (st.st_dev, st.st_ino), size, fd, None, mm, owner=True)
    _register(seg, mm)
    return mm


def _adopt_memfd(size, mm, private, reused, zero):
    """Register a memfd segment made (or recycled) here, mapped as ``mm`` through ``private``.

    Arrays view it through a lease (see the module docstring); the fd it sends is a second
    open file description that tells ``recycle`` whether other processes still hold it.
    """
    try:
        shared, recyclable = recycle.shared_fd(private)
    except BaseException:
        os.close(private)
        raise
    st = os.fstat(private)
    import numpy as np             # (here: `import sharedmp` does not import NumPy)
    lease = np.frombuffer(mm, np.uint8)
    seg = Segment("file_descriptor", (st.st_dev, st.st_ino), size, shared, None, lease, owner=True,
                  recycle=(mm, private) if recyclable else None)
    if not recyclable:
        os.close(private)
    if zero and reused:
        lease.fill(0)
    seg.dirty = reused and not zero
    _register(seg, lease)
    return seg, lease


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
            _reserve(fd, size, directory,
                     f"{directory} is full: make it larger (mount -o remount,size=...), point "
                     f"${SHM_DIR_ENV} at a bigger tmpfs, or use the 'file_descriptor' strategy.")
            mm = _map(fd, size)
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
    return seg, lease


def sealed(fd, seals):
    """Whether the file ``fd`` carries all of ``seals`` (F_SEAL_*): a memfd whose size a peer
    cannot change under this process. False for anything that is not a memfd."""
    return _seals(fd) & seals == seals


def _seals(fd):
    """The seals of ``fd`` (0 for anything that is not a memfd)."""
    try:
        return fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return 0


_SIZE_SEALS = (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) if HAVE_MEMFD else 0


def attach_fd(fd: int) -> SegmentMapping:
    """The mapping of the memfd ``fd`` (borrowed: the caller still closes it), mapped once per
    process."""
    try:
        st = os.fstat(fd)
    except OSError as e:
        raise SegmentError(f"received fd {fd} is not usable: {e}") from None
    key = (st.st_dev, st.st_ino)
    # (one dict read needs no lock: this runs for every array received)
    # one dict read, no lock: this runs for every array received
    seg = _by_key.get(key)
    mm = seg.mapping() if seg is not None else None
    if mm is not None:
        seg.hot = True  # type: ignore[union-attr]  # (mm is not None: so is seg)
        return mm
    if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
        raise SegmentError("received fd is not a shared-memory segment (not a non-empty regular "
                           "file)")
    seals = _seals(fd) if HAVE_MEMFD else 0
    if HAVE_MEMFD and seals & _SIZE_SEALS != _SIZE_SEALS:
        raise SegmentError("received fd is not a sealed sharedmp segment: a peer could truncate "
                           "it under this process (SIGBUS), so it is refused")
    # sealed against writes (``create_sealed``): mapped copy-on-write, as its maker maps it
    private = bool(seals & fcntl.F_SEAL_WRITE)
    try:
        own = os.dup(fd)
    except OSError as e:
        raise (_too_many_files("map") if e.errno == errno.EMFILE else e) from None
    try:
        mm = _map(own, st.st_size, private)
    except OSError as e:          # opened read-only, sealed against future writes: not ours
        os.close(own)
        if e.errno == errno.EMFILE:
            raise _too_many_files("map") from None
        raise SegmentError(f"received fd cannot be mapped for reading and writing ({e.strerror}): "
                           "not a sharedmp segment, or one opened read-only") from None
    except BaseException:
        os.close(own)
        raise
    seg = Segment("file_descriptor", key, st.st_size, own, None, mm, owner=False)
    _register(seg, mm)
    _keep_recent(mm, seg)
    return mm


def attach_name(name: str, consume: bool = True, token: int = -1) -> SegmentMapping:
    """The mapping of the named segment ``name``, mapped once per process.

    ``consume``: a reference in flight counted at the daemon ends here (a message of a
    sharedmp channel: false, its token holds the reference; ``token``: that token's fd, if
    known: mapped anew here, the message's reference ends, see daemon.py ``H``)."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise SegmentError(f"{name!r} is not a sharedmp segment name")
    with _lock:
        seg = _by_key.get(name)
        mm = seg.mapping() if seg is not None else None
    if mm is None and seg is not None and seg.pending:
        mm = revive(seg)              # one this process made and dropped: not parked yet
    if mm is not None:
        seg.hot = True  # type: ignore[union-attr]  # (mm is not None: so is seg)
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
            raise _too_many_files("open") from None
        raise SegmentError(f"{path} cannot be attached as a shared-memory segment: "
                           f"{e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size == 0:
            raise SegmentError(f"{path} is not a segment of this user")
        try:
            mm = _map(fd, st.st_size)
        except OSError as e:
            raise (_too_many_files("map") if e.errno == errno.EMFILE else e) from None
    finally:
        os.close(fd)
    seg = Segment("file_system", name, st.st_size, -1, name, mm, owner=False, path=path)
    _hold(path, consume, token)
    _register(seg, mm)
    if st.st_size == KEEP_RECENT_NAMED_SIZE:
        _keep_recent(mm, seg)
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


# (before the hook below: a finalizer run by it takes ``_lock``, which another thread of the
# parent may have held at the fork; ``_fork_gate``, which the forking thread held)
forks.renew_locks(globals(), "_lock", "_fork_gate")


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
    _recent.clear()                 # the parent's cache; the child keeps what it uses itself
    unheld = list(_making)          # another thread's, under way: gone with it
    _making.clear()
    for seg in list(_pending):      # the parent's, unviewed: the child does not map them
        _unregister(seg, None)
        seg.recycle, seg.pending = None, False
        if seg.path is not None:
            unheld.append(seg.path)
    _pending.clear()
    # The child maps what the parent mapped: it holds those names too, on its own connection.
    manager.after_fork_in_child(unheld, [s.path for s in _by_key.values() if s.path is not None])

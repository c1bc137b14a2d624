"""Segments: blocks of shared memory, one owner object per fd and per mapping, and the
tables of what this process maps (by mapping, by key, by address).

A segment is created by one process and attached by others::

    create(size)                      memfd_create -> posix_fallocate -> seal -> mmap
                                      (or one this process made before and no one holds:
                                      recycle.py)
    attach_fd(fd)                     fstat (identity, size, seals) -> mmap, once per process

That is the file_descriptor strategy; the file_system strategy's named segments
(``named.py``) are Segments too, registered here. Callers choose the strategy (``arena.py``).

The mapping is a ``mmap.mmap``; NumPy arrays view it (``ndarray(buffer=mm)``), so the
mapping lives exactly as long as some view does. A ``weakref.finalize`` on the mapping
then releases what the segment still owns: its fd (and, named, this process's hold on
the name). A memfd segment this process created is viewed through a uint8 ndarray over its
mmap instead (the "lease"): when the lease goes, the mmap stays, and the segment goes to
``recycle`` to be handed out again once no other process holds it.

Memory is reserved when the segment is made (``posix_fallocate``): running out raises
``OutOfSharedMemory`` here, instead of SIGBUS at the first touch of a page. memfd
segments are sealed against shrinking and growing, so no peer can truncate one under
a reader; a receiver checks the seals and the size before it builds a view.

What the platform offers (memfd, fallocate, the memory available) is found out in
``host.py``; what sharedmp's memory does with it (memfd, seals, reserve) is here.
"""
from __future__ import annotations

import bisect
import collections
import errno
import fcntl
import mmap
import os
import stat
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Union

from .. import forks
# (the platform's facts: host.py; named here too, as segment.HAVE_MEMFD, ... for callers)
from ..host import HAVE_FALLOCATE, HAVE_MEMFD, available_memory, available_memory_cached
from ..errors import OutOfSharedMemory, SegmentError
from . import cache, recycle

_monotonic = time.monotonic

SEALS = (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL) if HAVE_MEMFD else 0
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)

if TYPE_CHECKING:
    from typing import TypeAlias

    import numpy as np
    from numpy.typing import NDArray

    # What arrays view: the mmap of a segment, or the uint8 lease over one this process made.
    SegmentMapping: TypeAlias = Union[mmap.mmap, NDArray[np.uint8]]



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
        self.hot = 0.0            # monotonic time it was last attached again (``_recent``)
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

# A receiver keeps the few small segments (arenas) it attached last mapped, even with no
# view left: a stream of small arrays, each dropped after use, would otherwise map and
# unmap its arena for every message. Bigger segments go with their last view; these go
# once no message has used them for ``cache.idle()`` seconds.
KEEP_RECENT = 4
KEEP_RECENT_MAX_SIZE = 4 << 20
# [mapping, Segment, monotonic time]
_recent: collections.deque[list[Any]] = collections.deque(maxlen=KEEP_RECENT)


def keep_recent(mm: Any, seg: Segment) -> None:
    """(a receiver) Keep the mapping of this small segment a while (see ``_recent``)."""
    if len(mm) <= KEEP_RECENT_MAX_SIZE:
        _recent.append([mm, seg, time.monotonic()])
        cache.start()               # (after: a pass under way sees it, or start() is seen)


def forget_recent():
    """Drop the mappings kept by ``_keep_recent`` (they go once no view uses them)."""
    _recent.clear()


def _expire_recent(cutoff):
    """(cache) Let go of the recent mappings unused since ``cutoff`` (all if None); whether
    some are left."""
    drop = []
    for entry in list(_recent):
        last = max(entry[2], entry[1].hot)      # (its last use: kept, or attached again)
        if cutoff is None or last < cutoff:
            drop.append(entry)
        else:
            entry[2] = last
    for entry in drop:
        try:
            _recent.remove(entry)
        except ValueError:            # pushed out by a newer one meanwhile
            pass
    return bool(_recent)            # (unmapped as ``drop`` goes: outside any lock)


def _held_recent():
    """(bytes, fds) of the recent mappings that nothing but this cache uses."""
    return held_by([e[1] for e in list(_recent) if sys.getrefcount(e[0]) <= 2])  # (entry, call)


def _held_mapped():
    with _lock:
        return held_by(list(_by_key.values()))


# Python's mmap keeps a dup of the fd it maps, one more fd per mapping, unless (3.13 and
# later) told not to: ``trackfd=False`` (map_fd), since nothing here asks a mapping for its
# size or resizes it (the two things that need the fd).
_TRACKFD: dict[str, bool] = {} if sys.version_info < (3, 13) else {"trackfd": False}
_FDS_PER_MAPPING = 0 if _TRACKFD else 1


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


def register(seg: Segment, mm: object) -> None:
    """Enter the segment, mapped as ``mm``, in the tables; the caller attaches what releases
    it (``_register`` below: a finalizer, ``release``)."""
    with _lock:
        _by_mapping[id(mm)] = seg
        _by_key[seg.key] = seg
        if seg.address not in _by_address:
            bisect.insort(_addresses, seg.address)
        _by_address[seg.address] = seg
    cache.start()                   # (a pass soon: what stays cached of it goes once unused)


def _register(seg, mm):
    register(seg, mm)
    # Not at interpreter exit (``atexit=True`` is weakref.finalize's default; its hook runs
    # before multiprocessing's, which flushes the queues' feeder threads): a feeder still
    # sending would find the current arena released under it, its Segment unregistered and
    # handed to the pool while the allocator carves it. The process's end closes and unmaps.
    weakref.finalize(mm, release, seg, id(mm)).atexit = False


# For named.py, whose leases change the tables under their lock
def lock() -> threading.Lock:
    return _lock


def forget_view(seg: Segment, mapping_id: int) -> None:
    """(lock held) The mapping object ``mapping_id`` no longer views the segment."""
    if _by_mapping.get(mapping_id) is seg:
        del _by_mapping[mapping_id]


def add_view(seg: Segment, mm: object) -> None:
    """(lock held) ``mm`` views the segment from now on."""
    _by_mapping[id(mm)] = seg


def by_key(key: Any) -> Segment | None:
    with _lock:
        return _by_key.get(key)


def unregister(seg: Segment, mapping_id: int | None) -> None:
    """(lock held) Forget the segment's entries."""
    _unregister(seg, mapping_id)


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



def registered(seg: Segment) -> bool:
    """Whether the segment is mapped here (viewed, or pending), not parked nor released."""
    return _by_key.get(seg.key) is seg


def release(seg: Segment, mapping_id: int) -> None:
    """The last view of the mapping is gone: forget it, close its fd, recycle it if ours."""
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


def map_fd(fd: int, size: int, private: bool = False) -> mmap.mmap:
    # The segment's own fd stays with the Segment; before 3.13 the mapping holds a dup of it
    # too (``_TRACKFD``). ``private``: copy-on-write (a sealed segment: ``create_sealed``).
    return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE if private else mmap.MAP_SHARED,
                     prot=mmap.PROT_READ | mmap.PROT_WRITE, **_TRACKFD)


def reserve(fd: int, size: int, what: str, hint: str) -> None:
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


def create(size: int, zero: bool = True) -> tuple[Segment, SegmentMapping]:
    """A memfd segment of ``size`` bytes, mapped here; returns (segment, mapping). Its memory
    is zero unless ``zero`` is false and it is recycled."""
    check_size(size)
    reused = recycle.take(size)
    if reused is not None:
        return _adopt_memfd(size, *reused, reused=True, zero=zero)
    return made(size, _create_memfd)  # type: ignore[no-any-return]


def check_size(size: int) -> None:
    if size <= 0:
        raise ValueError(f"segment size must be > 0, not {size}")


def made(size: int, make: Any, settle: Any = None) -> Any:
    """``make(size)``; if memory or fds ran out while segments are kept for reuse, once more
    without them (``settle()``: until they are gone). The process's own limits raise an error
    that names the setting to change."""
    try:
        _check_available(size)
        try:
            return make(size)
        except (OutOfSharedMemory, OSError) as e:
            if not recycle.kept()[0] \
                    or not (isinstance(e, OutOfSharedMemory) or e.errno == errno.EMFILE):
                raise
        recycle.clear()             # the segments kept for reuse hold memory and fds: without them
        if settle is not None:
            settle()
        return make(size)
    except OSError as e:
        if e.errno == errno.EMFILE:
            raise too_many_files("create") from None
        if e.errno == errno.ENOMEM and not isinstance(e, OutOfSharedMemory):
            raise OutOfSharedMemory(f"cannot map {format_size(size)} of shared memory: this "
                                    "process's address space is exhausted (`ulimit -v`, "
                                    "RLIMIT_AS) or it has too many mappings "
                                    "(vm.max_map_count)") from None
        raise


def _check_available(size):
    # Checked before fallocate: a memfd bigger than memory would wake the OOM killer
    # instead of failing. A fresh reading for big requests, a recent one for small.
    avail = available_memory() if size >= 16 << 20 else available_memory_cached()
    if avail is not None and size > avail:
        raise OutOfSharedMemory(
            f"cannot reserve {format_size(size)} of shared memory: this machine has only "
            f"{format_size(avail)} available (MemAvailable + SwapFree, within the cgroup limit). "
            "Use smaller arrays, free memory, or allocate in chunks.")


def too_many_files(what: str) -> OSError:
    return OSError(errno.EMFILE, f"too many open files to {what} a shared-memory segment: raise "
                   "the limit (`ulimit -n`, RLIMIT_NOFILE), or keep fewer big arrays alive "
                   "(arrays below 1 MiB share a few segments)")


def new_memfd(name, size):
    """A memfd of ``size`` bytes, reserved (``OutOfSharedMemory``), its seals still to add."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        reserve(fd, size, "an anonymous memfd segment",
                 "Free memory or use smaller arrays; memfd memory counts against RAM and the "
                 "cgroup limit.")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _create_memfd(size):
    if not HAVE_MEMFD:
        raise OSError("the file_descriptor strategy needs memfd_create (Linux); use 'file_system'")
    fd = new_memfd("sharedmp", size)
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        mm = map_fd(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return _adopt_memfd(size, mm, fd, reused=False, zero=False)


_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
# A sealed segment can be written by no one once made: its memfd carries F_SEAL_WRITE.
SEALED = SEALS | (fcntl.F_SEAL_WRITE if HAVE_MEMFD else 0)


# Where segments are made without memfd (macOS): named.create, which sets this as it loads.
without_memfd: Any = None


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
        mm = without_memfd(size, zero=False)[1]
        with memoryview(mm).cast("B") as view:  # type: ignore[arg-type]  # (a uint8 lease)
            fill(view)
        cache.tick()
        return mm
    _check_available(size)
    try:
        fd = new_memfd("sharedmp-sealed", size)
    except OSError as e:
        raise (too_many_files("create") if e.errno == errno.EMFILE else e) from None
    try:
        with map_fd(fd, size) as writable:
            with memoryview(writable) as view:
                fill(view)
        # (F_SEAL_WRITE needs no writable shared mapping left: the one above is unmapped)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALED)
        mm = map_fd(fd, size, private=True)
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
    cache.tick()                    # (a pass of the caches, if one is due)
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
        seg.hot = _monotonic()  # type: ignore[union-attr]  # (mm is not None: so is seg)
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
        raise (too_many_files("map") if e.errno == errno.EMFILE else e) from None
    try:
        mm = map_fd(own, st.st_size, private)
    except OSError as e:          # opened read-only, sealed against future writes: not ours
        os.close(own)
        if e.errno == errno.EMFILE:
            raise too_many_files("map") from None
        raise SegmentError(f"received fd cannot be mapped for reading and writing ({e.strerror}): "
                           "not a sharedmp segment, or one opened read-only") from None
    except BaseException:
        os.close(own)
        raise
    seg = Segment("file_descriptor", key, st.st_size, own, None, mm, owner=False)
    _register(seg, mm)
    keep_recent(mm, seg)
    cache.tick()                    # (a segment mapped anew: a pass, if one is due)
    return mm



# (before any hook that takes ``_lock``: a finalizer it runs does, which another thread of
# the parent may have held at the fork)
forks.renew_locks(globals(), "_lock")


@forks.in_child
def _after_fork_in_child() -> None:
    _recent.clear()                 # the parent's cache; the child keeps what it uses itself

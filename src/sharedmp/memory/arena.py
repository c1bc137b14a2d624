"""Packing: small arrays are carved from shared arenas, big ones get a segment each.

One segment per small array is what makes torch hold one fd per tensor. Here a
process carves arrays below ``SMALL_LIMIT`` out of the current ``ARENA_SIZE`` arena of
its strategy with a 64-byte aligned bump pointer, so 10,000 small arrays cost a handful
of segments, and a message that references many of them carries one fd per arena.

A region is never handed out twice while its arena lives: other processes may still see
it and there is no cheap cross-process free. The price: one live small array keeps its
whole arena (at most ``ARENA_SIZE`` bytes) alive. A whole arena is reused (``recycle.py``)
once no process holds it any more; what is carved from it is zero (unless the caller
overwrites it), so ``zeros`` needs no fill.

The current arena is a cache too: once nothing has been carved from it for
``cache.idle()`` seconds the allocator keeps only a weak reference to it (at the next pass
of the caches after: ``cache.py``, run lazily at sharedmp's operations and waits), so it
goes with its last array (and is carved further if one still lives when the next array is
made).

Under file_system the allocator holds its arena only while it carves from it in a burst
(its previous carve less than ``named.PARK_DEFER`` before), and until the next pass of the
caches after; otherwise weakly. A named arena is a file in the shm directory, and one
that no array uses must leave the listing promptly (tests, torch's own among them, wait
for /dev/shm to empty): its last array gone, the arena is parked (``named.py``,
``recycle.py``: the daemon moves it to the pool once no other process holds it), unless it
was carved from just before (a burst starting): then it stays pending, and the next carve
revives it (``named.revive``). A burst pays nothing per array for this.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from .. import forks, host
from . import cache, named, segment

if TYPE_CHECKING:
    from .segment import SegmentMapping

ARENA_SIZE = 4 << 20
SMALL_LIMIT = 1 << 20      # arrays below this go to an arena
ALIGN = 64


class _Arena:
    __slots__ = ("mapping", "ref", "used", "where", "dirty", "since", "seg")

    def __init__(self, kind, where, seg, mapping):
        if kind == "file_system":   # held in bursts only (see the module docstring)
            self.seg, self.mapping = seg, None
            self.ref = lambda: seg.mapping()
        else:
            self.seg, self.mapping = None, mapping
            self.ref = weakref.ref(mapping)
        self.used = 0
        self.where = where        # file_system: the directory it lives in
        # A recycled arena keeps its old bytes until the first region that must be zero is
        # carved: then the rest is zeroed at once. A producer whose regions are all copied
        # over (torch tensors moved into shared memory) never pays for zeroing.
        self.dirty = seg.dirty
        self.since = time.monotonic()       # (memfd) when it was last carved from


_current: dict[str, _Arena] = {}              # strategy -> its current _Arena
_last_named_carve = 0.0                       # (file_system) monotonic time of the last carve
# strategy -> its last _Arena let go by the cache (mapping None)
_idle: dict[str, _Arena] = {}
_lock = threading.Lock()


def _maker(kind):
    """The module that makes segments of the strategy ``kind``."""
    return named if kind == "file_system" else segment


def allocate(nbytes: int, kind: str, zero: bool = True) -> tuple[SegmentMapping, int]:
    """Shared memory no one else uses: (mapping, offset) with ``nbytes`` bytes at offset.

    Zeroed, unless ``zero`` is false (the caller overwrites every byte): then recycled
    memory may keep its old contents. Then a pass of the caches, if one is due
    (``cache.tick``: after, so that what the pool keeps is reused first)."""
    if nbytes >= SMALL_LIMIT:
        out = _maker(kind).create(nbytes, zero)[1], 0
    else:
        out = _carve(nbytes, kind, zero)
    cache.tick()
    return out


def _carve(nbytes, kind, zero):
    """(allocate) A region of the current arena of ``kind``."""
    global _last_named_carve
    where = named.shm_dir() if kind == "file_system" else None
    with _lock:
        arena = _current.get(kind)
        if arena is None:
            arena = _revive(kind)
        mapping: Any = None
        if arena is not None:
            mapping = arena.mapping
            if mapping is None and arena.seg is not None:   # named: its lease, if any array
                mapping = arena.seg.mapping()               # views it, or a new one if it
                if mapping is None:                         # is pending
                    mapping = named.revive(arena.seg)
        if mapping is None or arena.used + nbytes > ARENA_SIZE or arena.where != where:
            # The old arena stays alive as long as arrays carved from it do. A new
            # $SHAREDMP_SHM_DIR takes effect for small arrays too, not only for big ones.
            if arena is not None and arena.seg is not None:
                named.abandon(arena.seg)            # parked once no array uses it
            seg, mapping = (named.create(ARENA_SIZE, zero=False, revivable=True)
                            if kind == "file_system" else segment.create(ARENA_SIZE, zero=False))
            arena = _current[kind] = _Arena(kind, where, seg, mapping)
        offset = arena.used
        arena.used = (offset + max(nbytes, 1) + ALIGN - 1) & ~(ALIGN - 1)
        now = time.monotonic()
        if arena.seg is None:
            arena.since = now
        else:
            # held in a burst; weakly otherwise (parked as soon as no array uses it)
            if now - _last_named_carve < named.PARK_DEFER:
                arena.mapping = mapping
                cache.start()               # (let go by the next pass once the burst is over)
            else:
                arena.mapping = None
            arena.seg.carved = _last_named_carve = now
        if zero and arena.dirty:
            mapping[offset:] = 0
            arena.dirty = False
        return mapping, offset


def _revive(kind):
    """(lock held) The arena the cache let go, current again if some array still keeps it."""
    arena = _idle.pop(kind, None)
    if arena is None or (mapping := arena.ref()) is None:
        return None
    arena.mapping = mapping
    _current[kind] = arena
    cache.start()                   # (let go again by a pass once idle)
    seg = segment.segment_of(mapping)
    if seg is not None:
        seg.idle_since = None
    return arena


def _expire(cutoff):
    """(cache) Let go of the current arenas nothing was carved from since ``cutoff`` (all if
    None): whether one is left."""
    now, gone = time.monotonic(), []
    with _lock:
        for kind, arena in list(_current.items()):
            if arena.seg is not None:       # named: held in a burst; forgotten once parked
                if not segment.registered(arena.seg):
                    del _current[kind]
                elif arena.mapping is not None and (
                        cutoff is None or now - arena.seg.carved > named.PARK_DEFER):
                    gone.append(arena.mapping)      # the burst is over
                    arena.mapping = None
                continue
            if cutoff is None or arena.since < cutoff:
                seg = segment.segment_of(arena.mapping)
                if seg is not None:
                    seg.idle_since = arena.since        # if it goes to the pool now: unused since
                gone.append(arena.mapping)
                arena.mapping = None
                del _current[kind]
                _idle[kind] = arena
        left = any(a.mapping is not None for a in _current.values())
    del gone[:]                   # the last reference of an arena no array uses: released here
    return left


def _held():
    """(bytes, fds) of the current arenas that no array uses (only the allocator holds them)."""
    # (<= 2: a's own reference and the call's)
    idle = [a.mapping for a in list(_current.values())
            if a.mapping is not None and sys.getrefcount(a.mapping) <= 2]
    return segment.held_by([s for s in map(segment.segment_of, idle) if s is not None])


cache.register(0, "arenas", _expire, _held)


def stray_segment_fds():
    """This process's fds on sharedmp segments (memfd or named), but for the current arenas'
    (kept on purpose) and for the last ones the cache let go while arrays still use them:
    what a leak check counts."""
    keep = set()
    for a in list(_current.values()) + list(_idle.values()):
        seg = a.seg if a.seg is not None and segment.registered(a.seg) else \
            segment.segment_of(a.ref())
        try:
            if seg is not None and seg.fd >= 0:
                st = os.fstat(seg.fd)
            elif seg is not None and seg.path:    # named: no fd of its own (mmap's, <3.13)
                st = os.stat(seg.path)
            else:
                continue
        except OSError:
            continue
        keep.add((st.st_dev, st.st_ino))
    out = set()
    for path, target in host.fd_targets("self"):
        try:
            st = os.stat(path)
        except OSError:
            continue
        if (target == "/memfd:sharedmp (deleted)" or named.PREFIX in target) \
                and (st.st_dev, st.st_ino) not in keep:
            out.add(int(path.rsplit("/", 1)[1]))
    return out


def is_current(mapping):
    """Whether ``mapping`` is the current arena of some strategy (kept alive by the allocator)."""
    return any(a.mapping is mapping or (a.seg is not None and a.ref() is mapping)
               for a in list(_current.values()))


@forks.in_child
def _after_fork_in_child() -> None:
    # The parent keeps carving its arenas; a child carving the same ones would hand
    # out regions twice. Children start arenas of their own.
    _current.clear()
    _idle.clear()


forks.renew_locks(globals(), "_lock")

"""A single-producer/single-consumer byte ring in shared memory: one process puts records
(bytes), another gets them, in order, with no syscall while the stream is busy.

A queue's producers each write one (board.py: a queue's rings, read by its consumers in
turn through ``_cring.board_first``/``board_pop``, which read this layout in place).
Two implementations of one protocol, interchangeable across processes (a compiled writer
and a pure-Python reader share a ring, and the reverse): ``sharedmp._cring`` (C,
``_c/cring.c``) and ``PyRing`` here, the reference. ``Ring`` is the compiled one unless
``SHAREDMP_NO_EXTENSIONS=1`` or it was not built (``native.py``).

API (both)::

    w = Ring.create(capacity)           # this process writes; a new memfd + 2 eventfds
    memfd, efd_data, efd_space = w.fds()   # send them to the peer (SCM_RIGHTS), borrowed
    r = Ring.attach(memfd, efd_data, efd_space)  # the peer reads (fds dup'd: close yours)
    w.put(b"...", timeout=None) -> bool   # False: no room within timeout
    w.try_put(b"...") -> bool             # False: no room now
    r.get(timeout=None) -> bytes | None   # None: nothing within timeout
    r.poll(timeout=0.0) -> bool           # whether get() returns at once (a record, or EOF)
    r.close(); w.close()                  # the peer sees it: EOFError / BrokenPipeError
    r.fileno(), r.arm(), r.watch(fd)      # waiting elsewhere: below

``create(capacity, side="reader")`` makes the reading end instead (``attach`` then defaults to
the writer). One thread at a time on each end (a second one raises RuntimeError: a queue
locks around it); ``close()`` may come from any thread, and wakes one that waits.

Errors: a record of more than ``capacity // 4`` bytes -> ValueError (send it another way);
``get`` on a drained ring whose writer closed -> EOFError; ``put`` once the reader closed ->
BrokenPipeError; anything impossible read from the mapping or its fds -> ProtocolError (a
hostile or corrupt peer: nothing is read or written outside the mapping); use after
``close`` -> OSError; use in a forked child of the ring's process -> RuntimeError.

A dead peer: the ring cannot see one (a SIGKILLed writer publishes nothing more and never
closes). A channel has a socket to its peer, which does see it; two ways to wait on both:
- ``watch(fd)``: every wait of this end also polls ``fd`` (the channel's socket, a pidfd)
  and returns as a timeout does (``None`` / ``False``) as soon as it is readable or hung
  up: the caller then looks at it. One ``poll`` syscall waits on both.
- ``arm()`` then ``fileno()`` in ``multiprocessing.connection.wait``/``select``: ``arm()``
  says whether a record (or EOF) is there now; if not, it has announced this reader as
  waiting, so the writer's next ``put`` makes ``fileno()`` (an eventfd) readable.
Otherwise ``get(timeout)`` in slices, looking at the socket between them.

Layout of the mapping (a sealed memfd: ``HEADER + capacity`` bytes; little-endian)::

    0    u32 MAGIC, u32 VERSION, u64 capacity (a power of two)
    16   u32 writer closed, u32 reader closed
    128  u64 head    (the reader's: bytes consumed since the start)   own cache lines
    256  u64 tail    (the writer's: bytes published)
    384  u32 reader waiting (asleep on efd_data, or about to be)
    448  u32 writer waiting (asleep on efd_space)
    512  records: [u32 length][payload], padded to 8 bytes; a length of MARKER sends the
         reader to the start of the next lap (a record never wraps)

A record is published by the store of ``tail`` after its bytes (C: a release store; the
reader's load of ``tail`` is an acquire): a writer killed mid-write publishes nothing. A
side about to sleep stores its *waiting* flag, a full fence, then looks once more; the
other publishes, a full fence, then reads the flag and (clearing it) writes the eventfd:
one of the two sees the other, so no wake is lost, and a busy stream makes no syscall.
A side that finds nothing to do spins ``$SHAREDMP_SPIN_US`` (default 50) before it sleeps,
once per call: the compiled core a few microseconds of loads, then ``sched_yield`` between
looks; the twin ``sched_yield`` between looks. Waking a process that sleeps on another CPU
costs 50-70 us here (connection.py); measured (scripts/ring_bench.py, ends pinned to the
two CPUs), a 64-byte ping-pong takes 0.5 us compiled, and 8 us with the twin, 91 us without
its spin (SHAREDMP_SPIN_US=0).

The twin's memory model (stated, checked by the tests only on this machine): it reads and
writes the counters and flags as aligned 8- and 4-byte items of a memoryview, which CPython
copies with one load or store (atomic on x86-64 and arm64); it relies on x86-64's ordering
(TSO: stores seen in order, loads in order) for the publish, and on a lock's atomic
read-modify-write (a full barrier on x86-64) for the store-then-load of the waiting flag.
Elsewhere (arm64) neither holds for plain Python: there the twin bounds each sleep by
``_SLICE`` s so that a missed wake costs that much time, never a hang; use the compiled core.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import select
import stat
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from .. import forks, host, native, settings
from ..errors import ProtocolError
from ..fds import Fd
from ..memory import segment

MAGIC = 0x52504D53                 # b"SMPR" little-endian
VERSION = 1
HEADER = 512
O_MAGIC, O_VERSION, O_CAPACITY, O_WCLOSED, O_RCLOSED = 0, 4, 8, 16, 20
O_HEAD, O_TAIL, O_RWAIT, O_WWAIT = 128, 256, 384, 448
MARKER = 0xFFFFFFFF
MIN_CAPACITY = 1 << 10
MAX_CAPACITY = 1 << 30
DEFAULT_CAPACITY = 1 << 20
_SLICE = None if host.TOTAL_STORE_ORDER else 0.01
_EFD_FLAGS = os.EFD_CLOEXEC | os.EFD_NONBLOCK
_SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW

_fence_lock = threading.Lock()


def _fence() -> None:
    """A full memory barrier on x86-64 (the lock's ``lock cmpxchg``): see the docstring."""
    _fence_lock.acquire()
    _fence_lock.release()


forks.renew_locks(globals(), "_fence_lock")   # (a thread may hold it at a fork)


def _drain(fd: int) -> None:
    if fd < 0:
        return
    try:
        os.eventfd_read(fd)
    except BlockingIOError:
        pass


def _wake(fd: int) -> None:
    if fd < 0:
        return
    try:
        os.eventfd_write(fd, 1)
    except BlockingIOError:         # (the counter full: already woken)
        pass


class PyRing:
    """The pure-Python core (the reference): the protocol of the module docstring. The
    public methods are those of ``_cring.Ring``; ``_Ends`` adds the rest."""

    def __init__(self, mapping: Any, writer: bool, capacity: int, efd_data: int,
                 efd_space: int, spin_us: float) -> None:
        mv = memoryview(mapping).cast("B")
        if mv.readonly or len(mv) < HEADER + capacity or capacity & (capacity - 1) or \
                min(efd_data, efd_space) < -1 or (efd_data < 0) != (efd_space < 0):
            raise ValueError("Ring: bad mapping or capacity")
        self._mv = mv
        self._q = mv[:HEADER].cast("Q")
        self._i = mv[:HEADER].cast("I")
        self._data = mv[HEADER:HEADER + capacity]
        self._di = self._data.cast("I")
        self._cap = capacity
        self._limit = capacity // 4
        self._writer = bool(writer)
        self._released = False
        head, tail = self._q[O_HEAD // 8], self._q[O_TAIL // 8]
        if head & 7 or tail & 7 or (tail - head) % 2**64 > capacity or head >> 63:
            self._release_views()
            raise ProtocolError("ring: the peer wrote impossible counters")
        self._pos, self._seen = (tail, head) if writer else (head, tail)
        self._efd_data, self._efd_space = efd_data, efd_space
        self._watch = -1
        self._spin = spin_us / 1e6
        self._closed = self._forked_ = self._inflight = False
        self._lock = threading.Lock()

    # -- counters, checked --
    def _protocol(self, what: str) -> ProtocolError:
        return ProtocolError(f"ring: the peer wrote an impossible {what} into the shared header "
                             "or records (a hostile or corrupt peer); the ring is unusable")

    def _load_tail(self) -> bool:
        t = self._q[O_TAIL // 8]
        if t & 7 or (t - self._pos) % 2**64 > self._cap:
            raise self._protocol("tail")
        self._seen = t
        return t != self._pos

    def _load_head(self) -> None:
        h = self._q[O_HEAD // 8]
        if h & 7 or (h - self._seen) % 2**64 > (self._pos - self._seen) % 2**64:
            raise self._protocol("head")
        self._seen = h

    def _needed(self, n: int) -> int:
        p, rec = self._pos & (self._cap - 1), (4 + n + 7) & ~7
        return rec if p + rec <= self._cap else self._cap - p + rec

    def _ready(self, need: int) -> bool:
        if self._writer:
            if self._i[O_RCLOSED // 4]:
                return True
            if self._cap - (self._pos - self._seen) >= need:
                return True
            self._load_head()
            return self._cap - (self._pos - self._seen) >= need
        if self._load_tail():
            return True
        if self._i[O_WCLOSED // 4]:
            self._load_tail()
            return True
        return False

    def _await(self, need: int, deadline: float | None) -> bool:
        """Until ready (True), or the deadline or the watched fd (False)."""
        fd = self._efd_space if self._writer else self._efd_data
        flag = (O_WWAIT if self._writer else O_RWAIT) // 4
        spin = self._spin
        while True:
            if self._ready(need):
                return True
            if self._closed:
                return False
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return False
            if spin:
                end, spin = now + spin if deadline is None else min(now + spin, deadline), 0
                while time.monotonic() < end:
                    os.sched_yield()
                    if self._ready(need):
                        return True
                continue
            if fd < 0:              # (no eventfds: a ring that never sleeps, board.py)
                return False
            _drain(fd)
            self._i[flag] = 1
            _fence()
            if self._ready(need):
                self._i[flag] = 0
                return True
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            if self._watch >= 0:
                poller.register(self._watch, select.POLLIN)
            left = None if deadline is None else deadline - now
            if _SLICE is not None:
                left = _SLICE if left is None else min(left, _SLICE)
            try:
                events = poller.poll(None if left is None else max(0, -int(-left * 1000 // 1)))
            finally:
                self._i[flag] = 0
            if self._watch >= 0 and any(f == self._watch for f, _ in events):
                return self._ready(need)

    # -- one thread at a time --
    def _enter(self, writer: bool | None) -> None:
        if self._forked_:
            raise RuntimeError("this ring was inherited by fork: a forked child cannot use its "
                               "parent's ring (give the child a ring of its own)")
        if self._closed:
            raise OSError("ring is closed")
        if writer is not None and self._writer != writer:
            raise OSError("this end of the ring is the reader's" if writer
                          else "this end of the ring is the writer's")
        with self._lock:
            if self._inflight:
                raise RuntimeError("ring: another thread is using this end (one thread at a "
                                   "time on each side: lock around it)")
            self._inflight = True

    def _leave(self) -> None:
        with self._lock:
            self._inflight = False
            if self._closed:
                self._release()

    def _release_views(self) -> None:
        self._released = True
        for v in (self._di, self._data, self._i, self._q, self._mv):
            v.release()

    def _release(self) -> None:
        """(lock held) Let go of the mapping and close the eventfds, once."""
        if not self._released:
            self._release_views()
            for fd in (self._efd_data, self._efd_space):
                if fd >= 0:
                    os.close(fd)
            self._efd_data = self._efd_space = -1

    # -- the writer --
    def _put(self, data: Any, deadline: float | None, nowait: bool) -> bool:
        with memoryview(data) as m:
            src = m.cast("B") if m.ndim != 1 or m.format != "B" else m
            n = src.nbytes
            if n > self._limit:
                raise ValueError(f"ring: a record of {n} bytes is larger than this ring takes "
                                 f"({self._limit} bytes: a quarter of its capacity); send it "
                                 f"another way")
            self._enter(True)
            try:
                need = self._needed(n)
                ok = self._ready(need) if nowait else self._await(need, deadline)
                if self._closed:
                    raise OSError("ring is closed")
                if not ok:
                    return False
                if self._i[O_RCLOSED // 4]:
                    raise BrokenPipeError("ring: the reader closed its end")
                self._publish(src, n)
                return True
            finally:
                self._leave()

    def _publish(self, src: memoryview, n: int) -> None:
        cap = self._cap
        t = self._pos
        p, rec = t & (cap - 1), (4 + n + 7) & ~7
        if p + rec > cap:
            self._di[p >> 2] = MARKER
            t += cap - p
            p = 0
        self._di[p >> 2] = n
        self._data[p + 4:p + 4 + n] = src
        self._pos = t + rec
        self._q[O_TAIL // 8] = self._pos           # (TSO: after the bytes)
        _fence()
        if self._i[O_RWAIT // 4]:
            self._i[O_RWAIT // 4] = 0
            _wake(self._efd_data)

    def put(self, data: Any, timeout: float | None = None) -> bool:
        """Put ``data`` (bytes-like) as one record; False if no room came within ``timeout``
        s (None: wait as long as it takes)."""
        return self._put(data, _deadline(timeout), False)

    def try_put(self, data: Any) -> bool:
        """Put ``data`` if there is room now; False, with nothing put, otherwise."""
        return self._put(data, None, True)

    # -- the reader --
    def _take(self) -> bytes:
        while True:
            if self._pos == self._seen:
                wclosed = self._i[O_WCLOSED // 4]
                if self._load_tail():
                    continue
                if wclosed:
                    raise EOFError("ring: the writer closed its end")
                raise self._protocol("record (a wrap marker with nothing after it)")
            cap = self._cap
            p = self._pos & (cap - 1)
            n = self._di[p >> 2]
            if n == MARKER:
                if p == 0 or self._seen - self._pos < cap - p:
                    raise self._protocol("wrap marker")
                self._pos += cap - p
                continue
            rec = (4 + n + 7) & ~7
            if n > self._limit or p + rec > cap or self._seen - self._pos < rec:
                raise self._protocol("record length")
            out = bytes(self._data[p + 4:p + 4 + n])
            self._pos += rec
            self._q[O_HEAD // 8] = self._pos
            _fence()
            if self._i[O_WWAIT // 4]:
                self._i[O_WWAIT // 4] = 0
                _wake(self._efd_space)
            return out

    def get(self, timeout: float | None = None) -> bytes | None:
        """The next record; None if none came within ``timeout`` s (None: wait as long as it
        takes). EOFError once the ring is drained and its writer closed."""
        deadline = _deadline(timeout)
        self._enter(False)
        try:
            if self._pos != self._seen or self._await(0, deadline):
                return self._take()
            if self._closed:
                raise OSError("ring is closed")
            return None
        finally:
            self._leave()

    def poll(self, timeout: float | None = 0.0) -> bool:
        """Whether ``get()`` returns at once (a record, or EOF), waiting up to ``timeout`` s
        (None: as long as it takes)."""
        deadline = _deadline(timeout)
        self._enter(False)
        try:
            ok = self._pos != self._seen or self._await(0, deadline)
            if not ok and self._closed:
                raise OSError("ring is closed")
            return ok
        finally:
            self._leave()

    def arm(self) -> bool:
        """True if ``get()`` returns at once; else announces this reader as waiting, so that
        ``fileno()`` turns readable at the writer's next put (for ``select`` and
        ``multiprocessing.connection.wait``). Call it before each such wait."""
        self._enter(False)
        try:
            if self._pos != self._seen or self._ready(0):
                return True
            _drain(self._efd_data)
            self._i[O_RWAIT // 4] = 1
            _fence()
            if self._ready(0):
                self._i[O_RWAIT // 4] = 0
                return True
            return False
        finally:
            self._leave()

    def watch(self, fd: Any) -> None:
        """Make every wait of this end also return (as a timeout does) once ``fd`` (an int or
        an object with ``fileno()``; None: none) is readable or hung up."""
        self._watch = -1 if fd is None else (fd if isinstance(fd, int) else fd.fileno())

    def fileno(self) -> int:
        """The eventfd this end sleeps on (efd_data for the reader, efd_space for the writer)."""
        if self._closed or self._forked_:
            self._enter(None)       # (raises)
        return self._efd_space if self._writer else self._efd_data

    def _eventfds(self) -> tuple[int, int]:
        if self._closed or self._forked_:
            raise OSError("ring is closed")
        return self._efd_data, self._efd_space

    def _counters(self) -> tuple[int, int]:
        return self._pos, self._seen

    def _close(self) -> None:
        with self._lock:
            if self._closed or self._forked_:
                return
            self._closed = True
            self._i[(O_WCLOSED if self._writer else O_RCLOSED) // 4] = 1
            _fence()
            _wake(self._efd_data if self._writer else self._efd_space)
            if self._inflight:
                _wake(self._efd_space if self._writer else self._efd_data)
            else:
                self._release()

    def _forked(self) -> None:
        self._forked_ = self._closed = True
        self._inflight = False
        self._release()


def _deadline(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if timeout != timeout:
        raise ValueError("timeout must not be NaN")
    return time.monotonic() + max(0.0, min(float(timeout), 1e9))


# -- making and attaching, the same for both cores ------------------------------------------
_rings: weakref.WeakSet[Any] = weakref.WeakSet()
_SIDES = ("reader", "writer")


def _check_side(side: str) -> None:
    if side not in _SIDES:
        raise ValueError(f"side must be 'reader' or 'writer', not {side!r}")


def _close_half(memfd: Fd, efds: list[int]) -> None:
    """(an end that failed half-made) close what it had opened."""
    memfd.close()
    for fd in efds:
        os.close(fd)


class _Ends:
    """``create``/``attach``/``fds``/``close`` over either core (the mapping, the memfd)."""

    _mm: mmap.mmap | None
    _memfd: Fd
    _side: str

    if TYPE_CHECKING:               # (the core's: PyRing or _cring.Ring, after this in the MRO)
        def __init__(self, mapping: Any, writer: bool, capacity: int, efd_data: int,
                     efd_space: int, spin_us: float) -> None: ...
        def _close(self) -> None: ...
        def _forked(self) -> None: ...
        def _eventfds(self) -> tuple[int, int]: ...

    @classmethod
    def create(cls, capacity: int = DEFAULT_CAPACITY, side: str = "writer",
               spin_us: float | None = None) -> Any:
        """A new ring of ``capacity`` bytes (a power of two, 1 KiB to 1 GiB), this process's
        end being ``side``; ``fds()`` is what the peer attaches."""
        if not isinstance(capacity, int) or capacity & (capacity - 1) or \
                not MIN_CAPACITY <= capacity <= MAX_CAPACITY:
            raise ValueError(f"ring capacity must be a power of two from {MIN_CAPACITY} to "
                             f"{MAX_CAPACITY}, not {capacity!r}")
        _check_side(side)
        size = HEADER + capacity
        memfd = Fd(segment.made(size, lambda n: segment.new_memfd("sharedmp-ring", n)))
        efds: list[int] = []
        try:
            fcntl.fcntl(memfd.fd, fcntl.F_ADD_SEALS, segment.SEALS)
            mm = segment.map_fd(memfd.fd, size)
            q = memoryview(mm).cast("B")[:HEADER]
            with q, q.cast("I") as i, q.cast("Q") as u:
                i[O_MAGIC // 4], i[O_VERSION // 4], u[O_CAPACITY // 8] = MAGIC, VERSION, capacity
            efds = [os.eventfd(0, _EFD_FLAGS), os.eventfd(0, _EFD_FLAGS)]
        except BaseException:
            _close_half(memfd, efds)
            raise
        return cls._make(memfd, mm, side == "writer", capacity, efds, spin_us)

    @classmethod
    def attach(cls, memfd: int, efd_data: int, efd_space: int, side: str = "reader",
               spin_us: float | None = None) -> Any:
        """The other end of a ring made by ``create`` in a peer, from its ``fds()`` (borrowed:
        they are dup'd; the caller closes its own). Everything is checked: ProtocolError."""
        _check_side(side)
        try:
            st = os.fstat(memfd)
        except OSError as e:
            raise ProtocolError(f"ring: the memfd received is not usable: {e}") from None
        size = st.st_size
        if not stat.S_ISREG(st.st_mode) or \
                not HEADER + MIN_CAPACITY <= size <= HEADER + MAX_CAPACITY:
            raise ProtocolError(f"ring: the memfd received is not a ring (a regular file of "
                                f"{HEADER + MIN_CAPACITY} to {HEADER + MAX_CAPACITY} bytes)")
        if not segment.sealed(memfd, _SIZE_SEALS):
            raise ProtocolError("ring: the memfd received is not sealed against shrinking: a "
                                "peer could truncate it under this process (SIGBUS)")
        for fd in (efd_data, efd_space):
            kind = host.fd_target(fd)
            if kind != "anon_inode:[eventfd]":
                raise ProtocolError(f"ring: fd {fd} received is not an eventfd ({kind})")
        own = Fd(os.dup(memfd))
        efds: list[int] = []
        try:
            try:
                mm = segment.map_fd(own.fd, size)
            except OSError as e:
                raise ProtocolError(f"ring: the memfd received cannot be mapped for reading and "
                                    f"writing ({e.strerror})") from None
            with memoryview(mm)[:HEADER] as h, h.cast("I") as i, h.cast("Q") as u:
                magic, version, capacity = i[O_MAGIC // 4], i[O_VERSION // 4], u[O_CAPACITY // 8]
                head, tail = u[O_HEAD // 8], u[O_TAIL // 8]
            if magic != MAGIC or version != VERSION:
                raise ProtocolError(f"ring: not a sharedmp ring of version {VERSION} (magic "
                                    f"{magic:#x}, version {version})")
            if capacity & (capacity - 1) or capacity + HEADER != size:
                raise ProtocolError(f"ring: capacity {capacity} in the header does not fit the "
                                    f"memfd of {size} bytes")
            # (and far from 2**64: 2**63 bytes take 29 years at 10 GB/s; no wrap to handle)
            if head & 7 or tail & 7 or (tail - head) % 2**64 > capacity or head >> 63:
                raise ProtocolError(f"ring: impossible counters in the header (head {head}, "
                                    f"tail {tail})")
            efds = [os.dup(efd_data), os.dup(efd_space)]
            for fd in efds:
                os.set_blocking(fd, False)
        except BaseException:
            _close_half(own, efds)
            raise
        return cls._make(own, mm, side == "writer", capacity, efds, spin_us)

    @classmethod
    def _make(cls, memfd: Fd, mm: mmap.mmap, writer: bool, capacity: int, efds: list[int],
              spin_us: float | None) -> Any:
        spin = settings.get(settings.SPIN_US) if spin_us is None else spin_us
        try:
            self = cls(mm, writer, capacity, efds[0], efds[1], float(spin))  # (owns efds now)
        except BaseException:
            _close_half(memfd, efds)
            mm.close()
            raise
        self._memfd, self._mm, self._side = memfd, mm, "writer" if writer else "reader"
        _rings.add(self)
        return self

    @property
    def side(self) -> str:
        """'writer' or 'reader': this end."""
        return self._side

    @property
    def capacity(self) -> int:
        return (len(self._mm) - HEADER) if self._mm is not None else 0

    @property
    def max_record(self) -> int:
        """The largest record (bytes) ``put`` takes: a quarter of the capacity."""
        return self.capacity // 4

    def fds(self) -> tuple[int, int, int]:
        """(memfd, efd_data, efd_space): what the peer passes to ``attach`` (still this end's:
        send them, do not close them)."""
        efd_data, efd_space = self._eventfds()
        return self._memfd.fd, efd_data, efd_space

    def close(self) -> None:
        """Mark this end closed and wake the peer (and a thread of this process waiting on
        this end); the fds and the mapping go now, or when that thread leaves."""
        self._close()
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:     # (a thread still waits in it: unmapped when it lets go)
                pass
        self._memfd.close()

    def _forked_child(self) -> None:
        self._forked()
        self._memfd.close_inherited()
        self._mm = None

    def __repr__(self) -> str:
        state = "closed" if self._mm is None else f"{self.capacity} bytes"
        return f"<sharedmp ring {type(self).__name__} {self._side} {state}>"

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> Any:
        raise TypeError("a ring is not pickled: send its fds() and attach() them")


class Twin(_Ends, PyRing):
    """The pure-Python ring (the reference)."""


def _compiled() -> Any:
    module = native.load("_cring")
    if module is None:
        return None

    class Compiled(_Ends, module.Ring):     # type: ignore[name-defined,misc]
        """The compiled ring (sharedmp._cring)."""

    Compiled.__module__, Compiled.__qualname__ = __name__, "Compiled"
    return Compiled


Compiled = _compiled()
Ring: Any = Compiled if Compiled is not None else Twin


def implementations() -> list[Any]:
    """The ring classes available here: the compiled one (if built and not disabled), the
    twin."""
    return [c for c in (Compiled, Twin) if c is not None]


@forks.in_child
def _after_fork_in_child() -> None:
    for ring in list(_rings):
        ring._forked_child()

"""A queue's rings: its producers' small messages through shared memory, not its socket.

A Queue (SimpleQueue, JoinableQueue) is a socket whose every message costs a ``sendmsg``
and a ``recvmsg``. Its *board* is one sealed memfd, made with the queue and travelling
with it, that holds ``SLOTS`` single-producer rings (ring.py; compiled or twin, one
protocol) and an eventfd. A producer process claims a slot on its first message: an OFD
lock on the slot's byte of the memfd (``F_OFD_SETLK``, on an open file description of its
own), which the kernel lets go when the process dies, so a SIGKILLed producer frees its
slot; the claim reserves the slot's ring (``posix_fallocate``: a shortage sends by the
socket, never SIGBUS), so a queue's memory is its header page and a ring per producer.
A message without fds that fits (a record of up to a quarter of a ring, and room for it
now) goes into the producer's ring as ``[kind u8][stamp u64][payload]``; any other (fds,
flight to count, large, or the ring full: the consumers are behind) goes through the socket
as before, *tagged* (``fdpass.TAGGED``: its payload starts with ``(slot + 1, stamp)``) and
counted in the board before it is sent (per slot, or under the table's lock for a producer
without a slot); consumers count the tagged frames they take.

Order. A stamp is ``time.monotonic_ns()`` taken before the message is published. Consumers
take turns under the queue's ``_rlock`` (held by ``get`` for one non-blocking take, and
taken here by a raw ``recv``/``poll`` that does not hold it) and take the oldest message
they can see: the ring record of smallest stamp (``board_first`` looks until a look finds
nothing older: a record published before the one it found is seen), or the socket's head
frame if its stamp (``MSG_PEEK``: the frame stays in the socket until it is known to go
first) is not larger (a tie goes to the frame); the rings are looked at again after the
peek (``board_take`` does it all in one call). So each producer's messages arrive in the
order it put them, and a message put after another's ``put()`` returned arrives after it,
whichever path each took. EOF comes once the socket ended and the rings are empty. A
producer killed anywhere leaves nothing half-sent: a record is published whole or not at
all (ring.py), a frame is one ``sendmsg``.

Sleeping. Consumers that find nothing announce themselves in ``sleepers`` (under
``_rlock``), look once more, and sleep on the board's eventfd and the socket; a producer
writes the eventfd after a record when ``sleepers`` is not zero (after the ring's full
fence: one of the two sees the other). Whoever drains the eventfd (a woken consumer, under
``_rlock``) writes it again if a record is there and others sleep, so no wake-up is lost
with several consumers. ``fileno()`` of the reader (``multiprocessing.connection.wait``,
``select``) is an epoll fd over the eventfd and the socket, and arms: it counts its
process as a sleeper until its next take, and makes itself readable if a message is
there. A consumer killed while counted leaves the count high: producers then write the
eventfd for nothing (a system call per message), never miss one.
"""
from __future__ import annotations

import errno
import fcntl
import mmap
import os
import select
import socket
import stat
import struct
import threading
import time
import weakref
from multiprocessing.reduction import DupFd
from typing import TYPE_CHECKING, Any

from .. import forks, host, native, wire
from ..errors import ProtocolError
from ..fds import Fd
from ..memory import cache, segment
from . import fdpass, ring

if TYPE_CHECKING:
    from .flow import Window

MAGIC = 0x42504D53                 # b"SMPB" little-endian
VERSION = 1
SLOTS = 8
CAPACITY = 1 << 16                 # of each ring: records of up to 16 KiB
MAX_SLOTS = 64
RINGS = 4096                       # where slot 0's ring starts
O_MAGIC, O_VERSION, O_SLOTS, O_CAPACITY, O_USED, O_SLEEPERS = 0, 4, 8, 12, 64, 128
O_TAKEN, O_XSENT = 72, 76          # u32: tagged frames taken; sent by producers without a slot
O_TABLE = 256                      # per slot 16 bytes: u32 tagged frames its owners sent
TABLE_LOCK = MAX_SLOTS             # the byte locked to update the table (claims, O_XSENT)
_TAG = struct.Struct("<QQ")        # a frame's slot + 1 (0: none) and stamp
_REC = struct.Struct("<BQ")        # a record's kind and stamp
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_FLOCK = struct.Struct("hhqqi4x")  # struct flock (x86-64, arm64)
_PEEK = fdpass.HEADER.size + _TAG.size
_MSG_PEEK = int(socket.MSG_PEEK | socket.MSG_DONTWAIT)
_stamp = time.monotonic_ns
_IN_MEMFD = 2                      # (board_take: the head frame's stamp lies in its memfd)
_ROOM_WAIT = 0.005                 # a producer whose ring is full waits for room this long
_NO_SLOT_RETRY = 1.0               # a producer that found no free slot looks again after


def _ofd_lock(fd: int, byte: int, wait: bool) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK,
                    _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0))
        return True
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


def _ofd_unlock(fd: int, byte: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, byte, 1, 0))


def _drain(fd: int) -> None:
    try:
        os.eventfd_read(fd)
    except BlockingIOError:
        pass


def _wake(fd: int) -> None:
    try:
        os.eventfd_write(fd, 1)
    except BlockingIOError:         # (the counter full: already woken)
        pass


def _size(slots: int, capacity: int) -> int:
    return RINGS + slots * (ring.HEADER + capacity)


class _Locked:
    """The consumers' lock (the queue's ``_rlock``) for one step, unless this thread holds
    it already (``Pool`` drains its task queue holding it, with raw ``poll``/``recv``)."""

    __slots__ = ("_lock", "_took")

    def __init__(self, lock: Any) -> None:
        self._lock = lock

    def __enter__(self) -> None:
        lock = self._lock
        self._took = not lock.is_mine()
        if self._took:
            lock.acquire()

    def __exit__(self, *exc: object) -> None:
        if self._took:
            self._lock.release()


class Board:
    """One queue's rings in one process (shared by its two ends there); see the module's
    docstring."""

    def __init__(self, memfd: Fd, efd: Fd, mm: mmap.mmap, slots: int, capacity: int) -> None:
        self._memfd, self._efd, self._mm = memfd, efd, mm
        self._slots, self._cap = slots, capacity
        self._limit = capacity // 4 - _REC.size
        self._mv = memoryview(mm)
        self._u32 = self._mv.cast("I")
        self._u64 = self._mv.cast("Q")
        bases = [RINGS + s * (ring.HEADER + capacity) for s in range(slots)]
        self._head = [(b + ring.O_HEAD) // 8 for b in bases]
        self._tail = [(b + ring.O_TAIL) // 8 for b in bases]
        self._bases = bases
        self._view: memoryview | None = None        # (the writer ring's)
        self._armed = False
        self._epoll: select.epoll | None = None
        self._users = 0
        self._closed = False
        self._reset_writer()
        _boards.add(self)

    def _reset_writer(self) -> None:
        self._wlock = threading.Lock()
        self._writer: Any = None
        self._lockfd: Fd | None = None
        self._slot = -1
        self._retry = 0.0
        self._stuck = -1

    # -- making, attaching, handing on ---------------------------------------------------
    @classmethod
    def create(cls, slots: int = SLOTS, capacity: int = CAPACITY) -> Board:
        """A new board: its header page reserved now, each ring by the producer that
        claims it (``_claim``), so that a queue pays for the producers it has."""
        size = _size(slots, capacity)
        memfd = Fd(segment.made(size, lambda n: segment.new_memfd("smp-queue-board", RINGS)))
        try:
            os.ftruncate(memfd.fd, size)
            fcntl.fcntl(memfd.fd, fcntl.F_ADD_SEALS, segment.SEALS)
            mm = segment.map_fd(memfd.fd, size)
            with memoryview(mm)[:RINGS] as mv, mv.cast("I") as u32:
                u32[O_MAGIC // 4], u32[O_VERSION // 4] = MAGIC, VERSION
                u32[O_SLOTS // 4], u32[O_CAPACITY // 4] = slots, capacity
            efd = Fd(os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK))
        except BaseException:
            memfd.close()
            raise
        return cls(memfd, efd, mm, slots, capacity)

    @classmethod
    def attach(cls, memfd: int, efd: int) -> Board:
        """The board of a queue received from another process (``fds()`` there): the one
        this process has already if it has it, else mapped now; ``memfd`` and ``efd`` are
        this call's to close. Everything is checked: ProtocolError."""
        try:
            try:
                st = os.fstat(memfd)
            except OSError as e:
                raise ProtocolError(f"a queue's board: the memfd received is not usable: {e}") \
                    from None
            known = _by_file.get((st.st_dev, st.st_ino))
            if known is not None and not known._closed:
                return known
            if host.fd_target(efd) != "anon_inode:[eventfd]":
                raise ProtocolError("a queue's board: the fd received for its eventfd is not one")
            if not stat.S_ISREG(st.st_mode) or \
                    not RINGS < st.st_size <= _size(MAX_SLOTS, 1 << 20) or \
                    not segment.sealed(memfd, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW):
                raise ProtocolError("a queue's board: the memfd received is not a sealed board")
            mm = segment.map_fd(memfd, st.st_size)
            with memoryview(mm)[:RINGS] as h, h.cast("I") as u32:
                magic, version, slots, cap = (u32[O_MAGIC // 4], u32[O_VERSION // 4],
                                              u32[O_SLOTS // 4], u32[O_CAPACITY // 4])
            if magic != MAGIC or version != VERSION or not 0 < slots <= MAX_SLOTS or \
                    cap & (cap - 1) or not ring.MIN_CAPACITY <= cap or \
                    _size(slots, cap) != st.st_size:
                mm.close()
                raise ProtocolError(f"a queue's board: not a board of version {VERSION} (magic "
                                    f"{magic:#x}, version {version}, {slots} slots of {cap})")
            board = cls(Fd(memfd), Fd(efd), mm, slots, cap)
            memfd = efd = -1
            _by_file[(st.st_dev, st.st_ino)] = board
            return board
        finally:
            for fd in (memfd, efd):
                if fd >= 0:
                    os.close(fd)

    def __reduce__(self) -> tuple[Any, tuple[Any, Any]]:
        memfd, efd = self.fds()
        oob = wire.current()
        if oob is not None:
            return _attach_in_band, (oob.add(memfd), oob.add(efd))
        return _attach, (DupFd(memfd), DupFd(efd))

    def fds(self) -> tuple[int, int]:
        """(memfd, eventfd): what another process attaches (still this board's)."""
        if self._closed:
            raise OSError("a closed queue's board")
        return self._memfd.fd, self._efd.fd

    def use(self) -> Board:
        """One more end of this process uses it (``release`` when it closes)."""
        self._users += 1
        if self._users == 1:
            st = os.fstat(self._memfd.fd)
            _by_file[(st.st_dev, st.st_ino)] = self
        return self

    def release(self) -> None:
        self._users -= 1
        if self._users <= 0:
            self.close()

    def close(self) -> None:
        """Let go of everything this process holds of the board (its slot with it)."""
        if self._closed:
            return
        self._closed = True
        self._drop(inherited=False)    # (a thread in a put sees the ring closed: OSError)
        if self._epoll is not None:
            self._epoll.close()
        self._memfd.close()
        self._efd.close()

    def _drop(self, inherited: bool) -> None:
        if self._writer is not None:
            self._writer._forked()      # (lets go of its view; writes nothing shared)
            self._writer = None
        if self._view is not None:
            self._view.release()
            self._view = None
        if self._lockfd is not None:
            if inherited:
                self._lockfd.close_inherited()   # (the parent's slot stays the parent's)
            else:
                self._lockfd.close()             # (the slot is free)
        if not inherited:
            for v in (self._u32, self._u64, self._mv):
                v.release()
            try:
                self._mm.close()
            except BufferError:          # (a thread still reads through it)
                pass

    def _forked_child(self) -> None:
        self._drop(inherited=True)
        self._reset_writer()
        self._armed = False
        if self._epoll is not None:
            self._epoll.close()             # (the child's copy: the parent's stays)
            self._epoll = None

    def _writer_ring(self, s: int) -> Any:
        """Slot ``s``'s ring, this process writing (a ring that never sleeps: no eventfds)."""
        self._view = self._mv[self._bases[s]:self._bases[s] + ring.HEADER + self._cap]
        return ring.Ring(self._view, True, self._cap, -1, -1, 0.0)

    # -- a producer ----------------------------------------------------------------------
    def _claim(self) -> Any:
        """(``_wlock`` held) This process's ring, claimed on its first message; None while
        every slot is taken (then looked for again every ``_NO_SLOT_RETRY`` s)."""
        if self._slot == -2 and time.monotonic() < self._retry:
            return None
        if self._closed:
            raise OSError("handle is closed")
        if self._lockfd is None:
            try:
                self._lockfd = Fd(host.reopen(self._memfd.fd, os.O_RDWR | os.O_CLOEXEC))
            except OSError:               # (no /proc: this process sends by the socket alone)
                self._slot, self._retry = -2, float("inf")
                return None
        fd = self._lockfd.fd
        for s in range(self._slots):
            if _ofd_lock(fd, s, wait=False):
                break
        else:
            self._slot, self._retry = -2, time.monotonic() + _NO_SLOT_RETRY
            return None
        if not self._prepare(s):
            _ofd_unlock(fd, s)
            self._slot, self._retry = -2, time.monotonic() + _NO_SLOT_RETRY
            return None
        _ofd_lock(fd, TABLE_LOCK, wait=True)
        try:
            if self._u32[O_USED // 4] <= s:
                self._u32[O_USED // 4] = s + 1
        finally:
            _ofd_unlock(fd, TABLE_LOCK)
        self._writer = self._writer_ring(s)
        self._slot, self._sent_at = s, (O_TABLE + 16 * s) // 4
        return self._writer

    def _prepare(self, s: int) -> bool:
        """(slot ``s`` locked) Its ring's memory reserved (a shortage: False, and this
        process sends by the socket: never SIGBUS at a write) and its header written once."""
        b = self._bases[s]
        try:
            os.posix_fallocate(self._memfd.fd, b, ring.HEADER + self._cap)
        except OSError:
            return False
        u32 = self._u32
        if u32[(b + ring.O_MAGIC) // 4] != ring.MAGIC:
            u32[(b + ring.O_VERSION) // 4] = ring.VERSION
            self._u64[(b + ring.O_CAPACITY) // 8] = self._cap
            u32[(b + ring.O_MAGIC) // 4] = ring.MAGIC
        return True

    def send(self, sock: socket.socket, window: Window, payload: Any, fds: Any, flags: int,
             flight: int | None, block: bool) -> bool:
        """Send one packed message (connection.py's ``send_packed``/``try_send_packed``):
        stamped, through this process's ring when it can go there, else tagged through
        ``sock``. ``block`` false: False, nothing sent, where it would wait."""
        if not self._wlock.acquire(block):
            return False
        try:
            w = self._writer
            if w is None:
                w = self._claim()
            if w is not None and not fds and flags < fdpass.TAGGED and \
                    len(payload) <= self._limit and not (flight or getattr(fds, "flight", 0)) \
                    and (self._fits(len(payload)) or block and self._room_soon(len(payload))) \
                    and w.try_put(_REC.pack(flags, _stamp()) + payload):
                if self._u32[O_SLEEPERS // 4]:
                    _wake(self._efd.fd)
                return True
            if self._lockfd is None:      # (no /proc: untagged, uncounted)
                if block:
                    fdpass.send_frame(sock, payload, fds, flags, window, flight)
                    return True
                return fdpass.try_send_frame(sock, payload, fds, flags, window)
            # (also a message the ring has no room for: its consumers are stuck, or it is one
            # of theirs that puts more than it holds before it gets; it waits in the socket as
            # it would without a board)
            body = _TAG.pack(self._slot + 1 if w is not None else 0, _stamp()) + payload
            # Counted before it is sent: a consumer that finds as many taken as sent knows
            # that none waits in the socket (a send that fails, or a producer killed in
            # between, leaves the count high: consumers then look at the socket each time,
            # which costs, and is right).
            self._count(1)
            if block:
                fdpass.send_frame(sock, body, fds, flags | fdpass.TAGGED, window, flight)
                return True
            if fdpass.try_send_frame(sock, body, fds, flags | fdpass.TAGGED, window):
                return True
            self._count(-1)                    # (nothing was sent)
            return False
        finally:
            self._wlock.release()

    def _count(self, n: int) -> None:
        """(``_wlock`` held) Count ``n`` more tagged frames sent by this process."""
        if self._writer is not None:
            u32, i = self._u32, self._sent_at
            u32[i] = (u32[i] + n) & 0xFFFFFFFF
            return
        fd = self._lockfd.fd  # type: ignore[union-attr]
        _ofd_lock(fd, TABLE_LOCK, wait=True)
        try:
            self._u32[O_XSENT // 4] = (self._u32[O_XSENT // 4] + n) & 0xFFFFFFFF
        finally:
            _ofd_unlock(fd, TABLE_LOCK)

    def _room_soon(self, n: int) -> bool:
        """Whether the ring has room for a record of ``n`` bytes within ``_ROOM_WAIT`` s, the
        consumers taking records meanwhile; at once False while they have taken none since
        the last time they did not make room in time."""
        head = self._u64[self._head[self._slot]]
        if head == self._stuck:
            return False
        delay, end = 20e-6, time.monotonic() + _ROOM_WAIT
        while time.monotonic() < end:
            if self._u32[O_SLEEPERS // 4]:
                _wake(self._efd.fd)
            time.sleep(delay)
            delay = min(2 * delay, 0.001)
            if self._fits(n):
                return True
        self._stuck = self._u64[self._head[self._slot]]
        return False

    def _fits(self, n: int) -> bool:
        """Whether a record of ``n`` payload bytes fits in this process's ring now."""
        s, cap = self._slot, self._cap
        tail = self._u64[self._tail[s]]
        p, rec = tail & (cap - 1), (4 + _REC.size + n + 7) & ~7
        need = rec if p + rec <= cap else cap - p + rec
        return cap - (tail - self._u64[self._head[s]]) >= need

    # -- the consumers (``_rlock`` held for take) --------------------------------------------
    def take(self, sock: socket.socket) -> tuple[Any, list[int], int] | None:
        """(the consumers' lock held) The next message, (payload, fds, kind), or None if
        there is none. EOFError once the socket ended and the rings are empty."""
        if self._armed:
            self._armed = False
            self._u32[O_SLEEPERS // 4] -= 1
        mm, slots, cap = self._mm, self._slots, self._cap
        got = _take(mm, slots, cap, sock, fdpass.recv_frame)
        if got.__class__ is int:          # (the head frame's stamp lies in its memfd)
            got = _take_py(mm, slots, cap, sock, fdpass.recv_frame, _head_in_memfd, _first,
                           _pop)
        return got  # type: ignore[no-any-return]

    def ready(self, sock_ready: Any) -> bool:
        """Whether a take may find something (no lock: a hint): a record in a ring, or the
        socket readable."""
        u64, head, tail = self._u64, self._head, self._tail
        for s in range(min(self._u32[O_USED // 4], self._slots)):
            if u64[head[s]] != u64[tail[s]]:
                return True
        return bool(sock_ready())

    def wait(self, sock: socket.socket, lock: Any, timeout: float | None,
             sock_ready: Any, spin: float) -> bool:
        """Until a take may find something (True) or ``timeout`` s passed (False): a spin,
        then asleep as a counted sleeper (the module's docstring)."""
        if self.ready(sock_ready):
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        if spin and timeout != 0:
            end = time.perf_counter() + (spin if timeout is None else min(spin, timeout))
            while time.perf_counter() < end:
                os.sched_yield()
                if self.ready(sock_ready):
                    return True
        if timeout == 0:
            return False
        u32, efd = self._u32, self._efd.fd
        poller = select.poll()
        poller.register(efd, select.POLLIN)
        poller.register(sock, select.POLLIN)
        while True:
            with _Locked(lock):
                u32[O_SLEEPERS // 4] += 1
                ring._fence()
                if self.ready(sock_ready):
                    u32[O_SLEEPERS // 4] -= 1
                    return True
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                cache.waiting(lambda t: bool(poller.poll(
                    None if t is None else max(0, -int(-t * 1000 // 1)))), left)
            finally:
                with _Locked(lock):
                    u32[O_SLEEPERS // 4] -= 1
                    _drain(efd)
                    got = self.ready(sock_ready)
                    if got and u32[O_SLEEPERS // 4]:
                        _wake(efd)        # (the baton: others sleep, and it is there)
            if got:
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def arm(self, sock: socket.socket, lock: Any, sock_ready: Any) -> int:
        """(``fileno()`` of the reader) An epoll fd over the eventfd and the socket, readable
        once a take may find something: this process counts as a sleeper until its next
        take."""
        efd = self._efd.fd
        with _Locked(lock):
            if not self._armed:
                self._armed = True
                self._u32[O_SLEEPERS // 4] += 1
                ring._fence()
            _drain(efd)
            if self.ready(sock_ready):
                _wake(efd)
        if self._epoll is None:
            self._epoll = select.epoll()
            self._epoll.register(efd, select.EPOLLIN)
            self._epoll.register(sock, select.EPOLLIN)
        return self._epoll.fileno()


def _first_py(mapping: Any, slots: int, capacity: int) -> tuple[int, int, bool]:
    """(slot, stamp, frames waiting): the ring record with the smallest stamp (slot -1:
    none), looked for until a look finds no smaller one, and whether tagged frames wait in
    the socket. The twin of ``_cring.board_first``."""
    with memoryview(mapping) as mv:
        used = _used(mv, slots)
        best, best_stamp = -1, 0
        while True:
            was = best, best_stamp
            best = -1
            for s in range(used):
                at = _front_py(mv, s, capacity)
                if at is None:
                    continue
                stamp = _U64.unpack_from(mv, at[1] + 1)[0]
                if best < 0 or stamp < best_stamp:
                    best, best_stamp = s, stamp
            if (best, best_stamp) == was:
                break
        sent = _U32.unpack_from(mv, O_XSENT)[0]
        for s in range(used):
            sent += _U32.unpack_from(mv, O_TABLE + 16 * s)[0]
        waiting = sent & 0xFFFFFFFF != _U32.unpack_from(mv, O_TAKEN)[0]
    return best, best_stamp, waiting


def _pop_py(mapping: Any, slots: int, capacity: int, s: int) -> tuple[int, bytes]:
    """(kind, payload) of slot ``s``'s front record, taken. The twin of
    ``_cring.board_pop``."""
    with memoryview(mapping) as mv:
        if s >= _used(mv, slots):
            raise ValueError("board_pop: no such slot")
        at = _front_py(mv, s, capacity)
        if at is None:
            raise RuntimeError("board_pop: the ring is empty")
        head, q, length, skip = at
        payload = bytes(mv[q + _REC.size:q + length])
        kind = mv[q]
        _U64.pack_into(mv, RINGS + s * (ring.HEADER + capacity) + ring.O_HEAD,
                       head + skip + ((4 + length + 7) & ~7))
        ring._fence()
    return kind, payload


def _head_py(sock: socket.socket) -> tuple[int, int]:
    """(what, stamp) of the socket's head frame, looked at (``MSG_PEEK``), not taken: what
    is 0 (none), 1 (a frame stamped ``stamp``), 2 (one that goes before any record:
    untagged, or what ``recv_frame`` refuses), 3 (the socket's end: after every record) or
    4 (a tagged frame whose tag lies in its memfd). The twin of ``_cring``'s ``head``."""
    try:
        head = sock.recv(_PEEK, _MSG_PEEK)
    except BlockingIOError:
        return 0, 0
    if not head:
        return 3, 0
    if len(head) < fdpass.HEADER.size or not head[3] & fdpass.TAGGED:
        return 2, 0
    if head[3] & fdpass.PAYLOAD_IN_MEMFD:
        return 4, 0
    if len(head) < _PEEK:
        return 2, 0
    return 1, int(_TAG.unpack_from(head, fdpass.HEADER.size)[1])


def _head_in_memfd(sock: socket.socket) -> tuple[int, int]:
    """``_head_py``, the stamp of a frame whose payload (and tag) lie in its memfd read
    there (peeked with its fds, closed after)."""
    what, stamp = _head_py(sock)
    if what != 4:
        return what, stamp
    data, anc, _, _ = sock.recvmsg(_PEEK, socket.CMSG_SPACE(4 * fdpass.MAX_FDS_PER_MSG),
                                   _MSG_PEEK | fdpass._CLOEXEC)
    fds: list[int] = []
    try:
        fdpass._take_fds(anc, 0, fds)
        if not fds or len(data) < fdpass.HEADER.size + 8:
            return 2, 0
        offset = _U64.unpack_from(data, fdpass.HEADER.size)[0]
        raw = os.pread(fds[-1], _TAG.size, offset)
        return (2, 0) if len(raw) != _TAG.size else (1, int(_TAG.unpack(raw)[1]))
    finally:
        fdpass.close_all(fds)


def _take_py(mapping: Any, slots: int, capacity: int, sock: socket.socket, recv: Any,
             head: Any = _head_py, first: Any = _first_py, pop: Any = _pop_py) -> Any:
    """The next message, the consumers' lock held: (payload, fds, kind) (a ring record or
    the socket's head frame, taken: ``recv(sock, False)``), None (nothing now) or
    ``_IN_MEMFD`` (the head frame's stamp lies in its memfd: ``head`` was not told to look
    there). The oldest goes first; the socket's head is looked at, not taken, until it is
    known to go first (a frame read before would be this consumer's alone to deliver), and
    the rings looked at again after it (a record published before the frame was sent is
    then seen; a tie goes to the frame: a record stamped in the same tick by its producer
    was put after it). The twin of ``_cring.board_take``."""
    s, stamp, waiting = first(mapping, slots, capacity)
    if waiting or s < 0:
        what, frame_stamp = head(sock)
        if what == 4:
            return _IN_MEMFD
        goes = what == 2 or (what == 3 and s < 0) or \
            (what == 1 and (s < 0 or frame_stamp <= stamp))
        if goes and what != 2:
            s, stamp, _ = first(mapping, slots, capacity)
            goes = s < 0 or (what == 1 and frame_stamp <= stamp)
        if goes:
            return _frame_py(mapping, sock, recv)
    if s < 0:
        return None
    kind, payload = pop(mapping, slots, capacity, s)
    return payload, [], kind


def _frame_py(mapping: Any, sock: socket.socket, recv: Any) -> Any:
    """The socket's head frame, ``recv(sock, False)``: (payload without its tag, fds,
    kind), counted as taken if tagged; None if none is there."""
    try:
        payload, fds, kind = recv(sock, False)
    except BlockingIOError:
        return None
    if not kind & fdpass.TAGGED:
        return payload, fds, kind         # (a producer that could not lock: no /proc)
    if len(payload) < _TAG.size:
        fdpass.close_all(fds)
        raise ProtocolError("a queue's tagged frame is shorter than its tag")
    if type(payload) is bytearray:        # (read from a memfd: large; no copy)
        del payload[:_TAG.size]
    else:
        payload = payload[_TAG.size:]
    with memoryview(mapping) as mv:
        _U32.pack_into(mv, O_TAKEN, (_U32.unpack_from(mv, O_TAKEN)[0] + 1) & 0xFFFFFFFF)
    return payload, fds, kind & ~fdpass.TAGGED


def _used(mv: memoryview, slots: int) -> int:
    used = _U32.unpack_from(mv, O_USED)[0]
    if used > slots:
        raise ProtocolError(f"a queue's board says {used} of its {slots} slots are used")
    return int(used)


def _front_py(mv: memoryview, s: int, cap: int) -> tuple[int, int, int, int] | None:
    """(head, where its record's bytes start, their length, the wrap's bytes before it) of
    slot ``s``'s front record; None if its ring is empty."""
    r = RINGS + s * (ring.HEADER + cap)
    data = r + ring.HEADER
    h, t = _U64.unpack_from(mv, r + ring.O_HEAD)[0], _U64.unpack_from(mv, r + ring.O_TAIL)[0]
    if h == t:
        return None
    if h & 7 or t & 7 or (t - h) % 2**64 > cap:
        raise _lie()
    p, skip = h & (cap - 1), 0
    length = _U32.unpack_from(mv, data + p)[0]
    if length == ring.MARKER:
        skip = cap - p
        if p == 0 or t - h <= skip:
            raise _lie()
        p = 0
        length = _U32.unpack_from(mv, data)[0]
    rec = (4 + length + 7) & ~7
    if length < _REC.size or length > cap // 4 or p + rec > cap or t - h - skip < rec or \
            mv[data + p + 4] >= fdpass.TAGGED:
        raise _lie()
    return h, data + p + 4, length, skip


def _lie() -> ProtocolError:
    return ProtocolError("a queue's board: a ring's counters or records are impossible (a "
                         "hostile or corrupt peer); the queue is unusable")


def _compiled() -> tuple[Any, Any, Any] | None:
    module = native.load("_cring")
    return None if module is None else (module.board_first, module.board_pop, module.board_take)


_first, _pop, _take = _compiled() or (_first_py, _pop_py, _take_py)


# (dupfd: what DupFd() made)
def _attach(memfd: Any, efd: Any) -> Board:
    return Board.attach(memfd.detach(), efd.detach())


def _attach_in_band(memfd: int, efd: int) -> Board:
    oob = wire.current()
    return Board.attach(os.dup(oob.get(memfd)), os.dup(oob.get(efd)))  # type: ignore[union-attr]


_boards: weakref.WeakSet[Board] = weakref.WeakSet()
_by_file: weakref.WeakValueDictionary[tuple[int, int], Board] = weakref.WeakValueDictionary()


@forks.in_child
def _after_fork_in_child() -> None:
    for board in list(_boards):
        if not board._closed:
            board._forked_child()

"""Connections over AF_UNIX seqpacket sockets that carry the fds of what they send.

The path of one array (compare multiprocessing.connection, changed: frames carry fds)::

    send(obj) -- wire.dumps: ForkingPickler with an OutOfBand current; the segment reducers
                 put each segment's fd into it once and pickle its index
              -- fdpass.send_frame: header + payload + fds (SCM_RIGHTS), one record of the
                 socket sent by one sendmsg (the kernel now holds the fds: the sender may exit)
    recv()    -- fdpass.recv_frame: that record, by one recvmsg
              -- wire.loads: unpickle with OutOfBand(fds) current; each segment is mapped once per
                 process (cached by inode), then every received fd is closed
              -- the array is a view of that mapping; the mapping lives as long as a view does

No connection back to the sender, ever (torch's file_descriptor strategy opens one per
tensor through multiprocessing's resource sharer).
"""
from __future__ import annotations

import math
import os
import select
import socket
import time
from multiprocessing.reduction import DupFd
from typing import TYPE_CHECKING, Any, Callable, Sequence

from .. import settings, wire
from ..memory import cache, manager
from ..wire import dumps, loads
from . import fdpass, flow
from .board import _Locked as board_lock

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

SOCKET_BUFFER = 1 << 20   # asked of the kernel; it caps this at net.core.{w,r}mem_max

# A receiver that finds nothing to read looks again for up to SPIN seconds, yielding the CPU
# between looks, before it sleeps in the kernel. Waking a process that sleeps on another CPU
# costs 50-70 us on a virtual machine (an interrupt to an idle CPU; measured: a ping-pong
# of an int over a socketpair, 4 us on one CPU, 57-67 us across two), more than a round trip
# of a small message takes when its peer answers at once (16 us): without this a request
# and its answer take 4-5x as long as they need whenever the scheduler puts the two
# processes on different CPUs. A wait that lasts longer costs SPIN of CPU once.
SPIN_ENV = settings.SPIN_US
_spin: float | None = None


def spin_seconds() -> float:
    """$SHAREDMP_SPIN_US (microseconds; 0 turns spinning off; default 50), read once."""
    global _spin
    if _spin is None:
        _spin = settings.get(SPIN_ENV) / 1e6
    return _spin


def socketpair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair(socket.AF_UNIX, fdpass.SOCK_TYPE)
    for s in (a, b):
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                s.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
            except OSError:
                pass
    # A record larger than the send buffer cannot be sent at all (EMSGSIZE): say so now,
    # not on the first large message.
    granted = min(s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) for s in (a, b))
    if granted < 2 * fdpass.RECORD:
        a.close()
        b.close()
        raise OSError(f"the kernel grants socket buffers of {granted} bytes, and sharedmp's "
                      f"channels need {2 * fdpass.RECORD}: raise net.core.wmem_max (sysctl)")
    return a, b


class Connection:
    """One end of a sharedmp Pipe; the API of multiprocessing.connection.Connection."""

    def __init__(self, sock: socket.socket, readable: bool = True, writable: bool = True) -> None:
        if not readable and not writable:
            raise ValueError("at least one of `readable` and `writable` must be True")
        # Blocking, whatever socket.setdefaulttimeout() says: the standard library's
        # connections are raw fds, which no default timeout reaches.
        sock.settimeout(None)
        self._sock: socket.socket | None = sock
        self._poller: select.poll | None = None
        self._tokens = manager.Tokens()     # of the named segments its messages carry
        self._window: flow.Window | None = None
        self._readable = readable
        self._writable = writable
        self._board: Any = None             # a queue's rings (board.py), and its _rlock
        self._rlock: Any = None

    def _use_board(self, board: Any, rlock: Any) -> None:
        """(queues.py) This end's messages go through ``board`` too; its consumers take
        turns under ``rlock``."""
        self._board, self._rlock = board.use(), rlock
        _exact_wait_installed()

    def __repr__(self) -> str:
        state = "closed" if self._sock is None else f"fd={self._sock.fileno()}"
        return f"<sharedmp.Connection {state}>"

    @property
    def closed(self) -> bool:
        return self._sock is None

    @property
    def readable(self) -> bool:
        return self._readable

    @property
    def writable(self) -> bool:
        return self._writable

    def _check(self, read: bool = False, write: bool = False) -> socket.socket:
        if self._sock is None:
            raise OSError("handle is closed")
        if read and not self._readable:
            raise OSError("connection is write-only")
        if write and not self._writable:
            raise OSError("connection is read-only")
        return self._sock

    def fileno(self) -> int:
        sock = self._check()
        if self._board is not None and self._readable:
            # (what multiprocessing.connection.wait and select wait on: board.arm)
            return self._board.arm(sock, self._rlock, self._sock_ready)  # type: ignore[no-any-return]
        return sock.fileno()

    def close(self) -> None:
        if self._sock is not None:
            sock, self._sock, self._poller = self._sock, None, None
            sock.close()
            if self._window is not None:
                self._window.close()
            if self._board is not None:
                board, self._board = self._board, None
                board.release()

    def __del__(self) -> None:
        # Dropped without close(): closed silently, as the standard library's Connection
        # (the socket object alone would warn: ResourceWarning, an error under -W error).
        try:
            self.close()
        except Exception:           # (at interpreter exit, modules may be gone)
            pass

    # -- what the queues use (queues.py): a message pickled in one step and sent in another,
    #    by the caller or by a feeder thread; read without waiting, under the queue's lock --
    def window(self) -> flow.Window:
        """This end's window (channels/flow.py), made on the first send: made first, a bad
        setting raises before anything is pickled."""
        if self._window is None:
            self._window = flow.Window()
        return self._window

    def pack(self, obj: Any) -> tuple[ReadableBuffer, fdpass.Fds, int]:
        """``obj`` pickled for this end: (payload, fds, flags), its named segments counted
        with this connection's tokens (memory/manager.py)."""
        return dumps(obj, self._tokens)

    def send_packed(self, payload: ReadableBuffer, fds: Sequence[int] = (), flags: int = 0,
                    flight: int | None = None) -> None:
        """Send a packed message, waiting while the socket is full or the window passed."""
        sock = self._check(write=True)
        if self._board is not None:
            self._board.send(sock, self.window(), payload, fds, flags, flight, True)
        else:
            fdpass.send_frame(sock, payload, fds, flags, self.window(), flight)
        cache.tick()                            # (a pass of the caches, if one is due)

    def try_send_packed(self, payload: ReadableBuffer, fds: fdpass.Fds, flags: int) -> bool:
        """Send it now if that needs no wait; False, with nothing sent, otherwise."""
        sock = self._check(write=True)
        if self._board is not None:
            return self._board.send(sock, self.window(), payload, fds, flags, None,  # type: ignore[no-any-return]
                                    False)
        return fdpass.try_send_frame(sock, payload, fds, flags, self.window())

    def recv_packed_nowait(self) -> tuple[bytes | bytearray, list[int], int]:
        """The next frame if one is there; BlockingIOError if none is (or another reader took
        it first)."""
        sock = self._check(read=True)
        if self._board is not None:     # (the caller holds the queue's _rlock)
            frame = self._board.take(sock)
            if frame is None:
                raise BlockingIOError
            return frame  # type: ignore[no-any-return]
        return fdpass.recv_frame(sock, block=False)

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, obj: Any) -> None:
        """Send a picklable object; the fds of the arrays in it travel in the same message."""
        sock = self._check(write=True)          # (send_packed's steps inline: the hot path)
        payload, fds, flags = dumps(obj, self._tokens)
        if self._board is not None:
            self._board.send(sock, self.window(), payload, fds, flags, None, True)
        else:
            fdpass.send_frame(sock, payload, fds, flags, self.window())
        cache.tick()                            # (a pass of the caches, if one is due)

    def recv(self) -> Any:
        """Receive an object sent with send()."""
        obj = loads(*self._recv_frame(self._check(read=True)))
        cache.tick()
        return obj

    def _recv_frame(self, sock: socket.socket) -> tuple[bytes | bytearray, list[int], int]:
        """The next frame: read at once if there, else after a spin (see SPIN), else waited
        for."""
        board = self._board
        if board is not None:
            while True:
                with board_lock(self._rlock):
                    frame = board.take(sock)
                if frame is not None:
                    return frame  # type: ignore[no-any-return]
                board.wait(sock, self._rlock, None, self._sock_ready, spin_seconds())
        try:
            return fdpass.recv_frame(sock, block=False)
        except BlockingIOError:
            self.poll(None)
        return fdpass.recv_frame(sock)

    def send_bytes(self, buf: ReadableBuffer, offset: int = 0, size: int | None = None) -> None:
        """Send a bytes-like object (or the part of it at ``offset`` of ``size`` bytes)."""
        sock = self._check(write=True)
        m = memoryview(buf).cast("B")
        if offset < 0 or offset > len(m):
            raise ValueError("offset is out of bounds")
        if size is None:
            size = len(m) - offset
        elif size < 0 or offset + size > len(m):
            raise ValueError("size is out of bounds" if size >= 0 else "size is negative")
        if self._board is not None:
            self._board.send(sock, self.window(), bytes(m[offset:offset + size]), (), 0, None,
                             True)
        else:
            fdpass.send_frame(sock, m[offset:offset + size], window=self.window())
        cache.tick()

    def _recv_bytes(self, maxlength: int | None = None) -> bytes | bytearray:
        payload, fds, _ = self._recv_frame(self._check(read=True))
        fdpass.close_all(fds)          # raw bytes carry no fds; any that came are dropped
        cache.tick()
        if maxlength is not None and len(payload) > maxlength:
            self.close()
            raise OSError(f"bad message length: {len(payload)} > maxlength {maxlength}")
        return payload

    def recv_bytes(self, maxlength: int | None = None) -> bytes:
        """Receive a message sent with send_bytes() as bytes."""
        if maxlength is not None and maxlength < 0:
            raise ValueError("negative maxlength")
        return bytes(self._recv_bytes(maxlength))

    def recv_bytes_into(self, buf: WriteableBuffer, offset: int = 0) -> int:
        """Receive a message into a writable buffer; returns its size."""
        m = memoryview(buf).cast("B")
        if offset < 0 or offset > len(m):
            raise ValueError("negative offset" if offset < 0 else "offset too large")
        payload = self._recv_bytes()
        if len(payload) > len(m) - offset:
            from multiprocessing import BufferTooShort
            raise BufferTooShort(bytes(payload))
        m[offset:offset + len(payload)] = payload
        return len(payload)

    def poll(self, timeout: float | None = 0.0) -> bool:
        """Whether there is anything to read (waiting up to ``timeout`` s; None: forever).
        While it waits, the passes of the caches that fall due run (memory/cache.py)."""
        sock = self._check(read=True)
        if self._poller is None:
            self._poller = select.poll()
            self._poller.register(sock, select.POLLIN)
        if self._board is not None:
            got = self._board.wait(sock, self._rlock, timeout, self._sock_ready, spin_seconds())
            if not got and timeout == 0:
                cache.tick()
            return got  # type: ignore[no-any-return]
        ms = None if timeout is None else max(0, math.ceil(timeout * 1000))
        try:
            if self._poller.poll(0):
                return True
            if ms == 0:
                cache.tick()
                return False
            if self._spin(self._poller):
                return True
            return self._wait(self._poller, timeout)
        except RuntimeError:      # "concurrent poll() invocation": another thread waits with it
            own = select.poll()
            own.register(sock, select.POLLIN)
            return self._wait(own, timeout)

    def _sock_ready(self) -> bool:
        """Whether the socket has a frame (or its end) now."""
        poller = self._poller
        if poller is None:
            poller = self._poller = select.poll()
            poller.register(self._check(), select.POLLIN)
        try:
            return bool(poller.poll(0))
        except RuntimeError:      # (another thread waits with it)
            return bool(select.select([self._check()], [], [], 0)[0])

    @staticmethod
    def _wait(poller: select.poll, timeout: float | None) -> bool:
        """``poller.poll`` for up to ``timeout`` s (None: forever), woken when a pass of the
        caches is due to run it (``cache.tick``) and wait on: a consumer that waits gives
        back what it keeps cached, with no thread (memory/cache.py). One poll when nothing
        is cached."""
        return cache.waiting(
            lambda t: bool(poller.poll(None if t is None else max(0, math.ceil(t * 1000)))),
            timeout)

    @staticmethod
    def _spin(poller: select.poll) -> bool:
        """Look again for up to spin_seconds(), yielding the CPU between looks (see SPIN);
        whether there is something to read now. (A ``poll(timeout)`` that spun waits its
        whole timeout after it: a few tens of microseconds more at most.)"""
        spin = _spin if _spin is not None else spin_seconds()
        if not spin:
            return False
        end = time.perf_counter() + spin
        while time.perf_counter() < end:
            os.sched_yield()
            if poller.poll(0):
                return True
        return False


# -- multiprocessing.connection.wait, exact for a queue's reader ----------------------------
# A reader's fileno() (board.arm) is readable once the board's eventfd is written, and a
# producer writes it after its record: one delayed between the two (descheduled) can write
# it after the consumer took that record and armed again. multiprocessing.connection.wait
# would then return the reader with nothing to read, and a recv() after it (concurrent.
# futures' manager thread does that) would wait for a message that may never come. So once
# a queue with a board exists, multiprocessing.connection.wait is this one: a reader it
# found ready counts only if a take would find something; else the wait goes on (its arm
# drains the stale wake). select() on fileno() stays a hint.
_std_wait: Callable[..., list[Any]] | None = None


def _exact_wait(object_list: Any, timeout: float | None = None) -> list[Any]:
    assert _std_wait is not None
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = _std_wait(object_list, left)
        real = [o for o in ready if not (isinstance(o, Connection) and o._board is not None
                                         and o._readable and not o._board.ready(o._sock_ready))]
        if real or not ready or (deadline is not None and time.monotonic() >= deadline):
            return real


def _exact_wait_installed() -> None:
    global _std_wait
    if _std_wait is None:
        import multiprocessing.connection as mpc
        _std_wait, mpc.wait = mpc.wait, _exact_wait


def Pipe(duplex: bool = True) -> tuple[Connection, Connection]:
    """A pair of connected Connections over one AF_UNIX socketpair (fds can travel both ways)."""
    a, b = socketpair()
    if duplex:
        return Connection(a), Connection(b)
    return Connection(a, writable=False), Connection(b, readable=False)


# A Connection pickles as its socket: in band on a sharedmp channel, else as a DupFd
# (while spawning it goes along with the child's fds, as multiprocessing's does).
# A queue's end goes with its board (board.py: pickled once for both ends) and the queue's
# _rlock (queues pickle only while spawning, as multiprocessing's: so does the lock).
def reduce_connection(
        conn: Connection) -> tuple[Callable[..., Connection], tuple[Any, ...]]:
    oob = wire.current()
    fd = conn._check().fileno()
    board = None if conn._board is None else (conn._board, conn._rlock)
    if oob is not None:
        return rebuild_connection_in_band, (oob.add(fd), conn.readable, conn.writable, board)
    return rebuild_connection, (DupFd(fd), conn.readable, conn.writable, board)


# (dupfd: what DupFd() made)
def rebuild_connection(dupfd: Any, readable: bool, writable: bool,
                       board: tuple[Any, Any] | None = None) -> Connection:
    conn = Connection(socket.socket(fileno=dupfd.detach()), readable, writable)
    if board is not None:
        conn._use_board(*board)
    return conn


def rebuild_connection_in_band(index: int, readable: bool, writable: bool,
                               board: tuple[Any, Any] | None = None) -> Connection:
    # (a sharedmp channel unpickles)
    fd = os.dup(wire.current().get(index))  # type: ignore[union-attr]
    conn = Connection(socket.socket(fileno=fd), readable, writable)
    if board is not None:
        conn._use_board(*board)
    return conn

"""Queue, JoinableQueue and SimpleQueue over an fd-carrying socket.

Adapted from CPython's multiprocessing/queues.py; changed:
- the pipe is an AF_UNIX socketpair, so each message carries the fds of its arrays;
- a message is one record of that socket, written and read whole by one system call, so
  producers take no lock: a process killed in the middle of put() leaves the queue working
  for the others (multiprocessing's would keep its lock);
- get() takes ``_rlock`` as multiprocessing's does (``Pool._help_stuff_finish`` holds it to
  drain the task queue and counts on no worker reading between its poll() and its recv()),
  but only around a non-blocking read: a consumer waits for a record without the lock, so
  one killed while it waits leaves the queue working for the others (see ``_get_frame``);
  and one killed while it holds the lock gives it back (``ConsumerLock``, consumer_lock.py);
- ``put()`` pickles in the calling thread: an unpicklable object raises there and the
  queue stays usable, and the value sent is the value at the time of ``put()``;
- in every process but the one that created the queue, ``put()`` returns only once the
  message is in the kernel, so a producer may exit (even by ``os._exit``) right after.
  In the creating process put() never waits for the socket either: a record goes straight
  in when the socket has room and nothing waits before it, else a feeder thread sends it,
  as in multiprocessing, so that one process can put many items before it gets any; the
  fds of those are dup'ed until sent (one dup per open file for all the messages waiting).
"""
from __future__ import annotations

import collections
import os
import threading
import time
import weakref
from multiprocessing import context as _mpcontext
from multiprocessing.util import Finalize, debug
from queue import Empty, Full
from typing import TYPE_CHECKING, Any

try:
    from _multiprocessing import SemLock as _SemLock
    SEM_VALUE_MAX = _SemLock.SEM_VALUE_MAX
except ImportError:  # pragma: no cover
    SEM_VALUE_MAX = 2 ** 31 - 1

from .. import _compat, forks, settings
from .. import fds as _fds
from ..memory import cache
from ..wire import loads
from . import fdpass
from .board import Board
from .consumer_lock import ConsumerLock
from .connection import Pipe

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer
    from multiprocessing.context import BaseContext
    from multiprocessing.synchronize import BoundedSemaphore

    from .connection import Connection

_SENTINEL = object()

# The Queues created here. A forked child resets them -- after os.fork() too, not only in
# multiprocessing's children: the feeder thread, its lock and the fds it holds for unsent
# messages belong to the parent.
_queues: weakref.WeakSet[Queue] = weakref.WeakSet()
_pid = os.getpid()            # (os.getpid() is a system call: put() asks for every message)


@forks.in_child
def _after_fork_in_child() -> None:
    global _pid
    _pid = os.getpid()
    for q in list(_queues):
        q._after_fork()


class _Held:
    """The fds of the messages waiting for the feeder: one dup per open file, shared.

    The messages of 1,000 arrays carved from one arena all carry the arena's fd; a dup per
    message would hold 1,000 fds until the feeder has sent them (EMFILE under the usual
    ``ulimit -n`` of 1024). Files are told apart by (st_dev, st_ino), which a dup shares.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (st_dev, st_ino) -> [the dup (fds.Fd), messages holding it, key]
        self._held: dict[tuple[int, int], list[Any]] = {}

    def take(self, fds: list[int]) -> list[list[Any]]:
        """Entries that keep ``fds`` open until released; their fds are ``entry[0].fd``."""
        if not fds:
            return []
        taken: list[list[Any]] = []
        with self._lock:
            try:
                for fd in fds:
                    st = os.fstat(fd)
                    key = (st.st_dev, st.st_ino)
                    entry = self._held.get(key)
                    if entry is None:
                        entry = self._held[key] = [_fds.Fd(os.dup(fd)), 0, key]
                    entry[1] += 1
                    taken.append(entry)
            except BaseException:
                self._drop(taken)
                raise
        return taken

    def release(self, taken: list[list[Any]]) -> None:
        with self._lock:
            self._drop(taken)

    def _drop(self, taken: list[list[Any]]) -> None:
        for entry in taken:
            entry[1] -= 1
            if entry[1] == 0:
                del self._held[entry[2]]
                entry[0].close()

    def close_all(self) -> None:
        """(after fork, in the child: no other thread) close every dup inherited."""
        for entry in self._held.values():
            entry[0].close_inherited()
        self._held.clear()


def _get_frame(reader: Connection, rlock: ConsumerLock, block: bool = True,
               timeout: float | None = None) -> tuple[bytes | bytearray, list[int], int]:
    """One frame from ``reader``, read while holding ``rlock``; Empty if none came in time.

    As multiprocessing's queues, whose users rely on it: whoever holds ``rlock`` knows that
    no other consumer takes a record meanwhile. Unlike them, the lock is held only for one
    non-blocking read, never while waiting (poll() waits, outside it): a consumer killed
    while it waits does not keep the lock. Another consumer may take the record between the
    poll() and the read: the read then finds nothing and the wait goes on.
    """
    deadline = None if timeout is None or not block else time.monotonic() + timeout
    while True:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not rlock.acquire(block, left):
            raise Empty
        try:
            return reader.recv_packed_nowait()
        except BlockingIOError:          # nothing there, or another consumer took it first
            pass
        finally:
            rlock.release()
        if not block:
            cache.tick()                 # (a consumer polling with get_nowait(): a pass too)
            raise Empty
        left = None if deadline is None else deadline - time.monotonic()
        if (left is not None and left <= 0.0) or not reader.poll(left):
            raise Empty


def _pipe(rlock: ConsumerLock) -> tuple[Connection, Connection]:
    """A queue's two ends, with a board (board.py) unless $SHAREDMP_QUEUE_RINGS is 0."""
    reader, writer = Pipe(duplex=False)
    if settings.get(settings.QUEUE_RINGS):
        try:
            board = Board.create()
        except BaseException:
            reader.close()
            writer.close()
            raise
        reader._use_board(board, rlock)
        writer._use_board(board, rlock)
    return reader, writer


class SimpleQueue:
    """A queue with put/get/empty/close and no buffering thread: put() is synchronous."""

    def __init__(self, *, ctx: BaseContext) -> None:
        self._rlock = ConsumerLock(ctx)  # taken by get() (see _get_frame) and by Pool
        self._reader, self._writer = _pipe(self._rlock)

    def __getstate__(self) -> tuple[Connection, Connection, ConsumerLock]:
        _mpcontext.assert_spawning(self)
        return self._reader, self._writer, self._rlock

    def __setstate__(self, state: tuple[Connection, Connection, ConsumerLock]) -> None:
        self._reader, self._writer, self._rlock = state

    def close(self) -> None:
        self._reader.close()
        self._writer.close()

    def empty(self) -> bool:
        return not self._reader.poll()

    def get(self) -> Any:
        obj = loads(*_get_frame(self._reader, self._rlock))      # (unpickled without the lock)
        cache.tick()                               # (a pass of the caches, if one is due)
        return obj

    def put(self, obj: Any) -> None:
        self._writer.window()                  # (first: a bad setting raises before pickling)
        self._writer.send_packed(*self._writer.pack(obj))


class Queue:
    """multiprocessing.Queue's semantics; arrays travel as shared memory with their fds."""

    def __init__(self, maxsize: int = 0, *, ctx: BaseContext) -> None:
        if maxsize <= 0:
            maxsize = SEM_VALUE_MAX
        self._maxsize = maxsize
        self._rlock = ConsumerLock(ctx)  # taken by get() (see _get_frame)
        self._reader, self._writer = _pipe(self._rlock)
        self._sem = ctx.BoundedSemaphore(maxsize)
        self._creator = os.getpid()
        self._ignore_epipe = False
        self._reset()
        _queues.add(self)

    def __getstate__(self) -> tuple[Any, ...]:
        _mpcontext.assert_spawning(self)
        return (self._ignore_epipe, self._maxsize, self._reader, self._writer,
                self._rlock, self._sem, self._creator)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        (self._ignore_epipe, self._maxsize, self._reader, self._writer,
         self._rlock, self._sem, self._creator) = state
        self._reset()

    def _after_fork(self) -> None:
        debug("Queue._after_fork()")
        held = getattr(self, "_held", None)
        self._reset()
        if held is not None:               # the parent's unsent messages are not ours to send
            held.close_all()

    def _reset(self) -> None:
        self._notempty = threading.Condition(threading.Lock())
        self._buffer: collections.deque[Any] = collections.deque()
        self._held = _Held()
        self._thread: threading.Thread | None = None
        self._jointhread: Finalize[Any] | None = None
        self._joincancelled = False
        self._closed = False
        self._close: Finalize[Any] | None = None
        self._used = False               # put() was called in this process (see close())

    # -- put -------------------------------------------------------------------------
    def put(self, obj: Any, block: bool = True, timeout: float | None = None) -> None:
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        # First: the first put() makes the window, which reads its setting; a bad value
        # raises here, before anything is counted or queued (never in the feeder thread).
        self._writer.window()
        if not self._sem.acquire(block, timeout):
            raise Full
        try:
            payload, fds, flags = self._writer.pack(obj)
        except BaseException:
            self._sem.release()
            raise
        self._count_task()
        self._send(payload, fds, flags)
        if _pid == self._creator:                  # (elsewhere send_packed has looked)
            cache.tick()                           # (a pass of the caches, if one is due)

    def _count_task(self) -> None:
        pass

    def _send(self, payload: ReadableBuffer, fds: fdpass.Fds, flags: int) -> None:
        self._used = True
        if _pid != self._creator:
            self._writer.send_packed(payload, fds, flags)
            return
        # In the creating process put() never waits for the socket. Straight into it when
        # the feeder holds nothing (the buffer keeps each item until it is sent: this
        # thread's earlier items are all out) and the socket takes the record at once;
        # otherwise through the feeder, in order. Saves a thread hand-off per message.
        if not self._buffer and self._writer.try_send_packed(payload, fds, flags):
            return
        held = self._held.take(fds)             # the arrays may die before the feeder sends
        with self._notempty:
            if self._thread is None:
                self._start_thread()
            # ``fds.keep`` too: the token of a file_system message, which the messages waiting
            # here share (one fd for all of them), lives as long as one of them waits.
            self._buffer.append((payload, held, flags, fds.keep, fds.flight))
            self._notempty.notify()

    def put_nowait(self, obj: Any) -> None:
        return self.put(obj, False)

    # -- get -------------------------------------------------------------------------
    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        frame = _get_frame(self._reader, self._rlock, block, timeout)
        self._sem.release()
        obj = loads(*frame)                                       # (unpickled without the lock)
        cache.tick()                               # (a pass of the caches, if one is due)
        return obj

    def get_nowait(self) -> Any:
        return self.get(False)

    def qsize(self) -> int:
        # Raises NotImplementedError on macOS, as multiprocessing's does (no sem_getvalue).
        return self._maxsize - _compat.semaphore_value(self._sem)

    def empty(self) -> bool:
        return not self._reader.poll()

    def full(self) -> bool:
        return _compat.semaphore_is_zero(self._sem)

    # -- closing ---------------------------------------------------------------------
    def close(self) -> None:
        self._closed = True
        close = self._close
        if close:
            self._close = None
            close()                # the feeder closes both ends once it has sent what it holds
        elif self._thread is None and self._used:
            # Sent directly, without the feeder: closed here, as the feeder would have. A
            # queue this process never put to is left open, as multiprocessing's close() is a
            # no-op before the first put() (3.10-3.13 alike; 3.13's test_closed_queue_empty_
            # exceptions checks both: empty() is True then, and OSError "is closed" after a put).
            self._reader.close()

    def join_thread(self) -> None:
        debug("Queue.join_thread()")
        assert self._closed, f"Queue {self!r} not closed"
        if self._jointhread:
            self._jointhread()

    def cancel_join_thread(self) -> None:
        debug("Queue.cancel_join_thread()")
        self._joincancelled = True
        try:
            self._jointhread.cancel()  # type: ignore[union-attr]  # (None: AttributeError)
        except AttributeError:
            pass

    def _start_thread(self) -> None:
        self._thread = threading.Thread(
            target=Queue._feed, name="QueueFeederThread", daemon=True,
            args=(self._buffer, self._notempty, self._reader, self._writer,
                  self._ignore_epipe, self._sem, self._held))
        self._thread.start()
        if not self._joincancelled:
            self._jointhread = Finalize(self._thread, Queue._finalize_join,
                                        [weakref.ref(self._thread)], exitpriority=-5)
        self._close = Finalize(self, Queue._finalize_close,
                               [self._buffer, self._notempty], exitpriority=10)

    @staticmethod
    def _finalize_join(twr: weakref.ref[threading.Thread]) -> None:
        thread = twr()
        if thread is not None:
            thread.join()

    @staticmethod
    def _finalize_close(buffer: collections.deque[Any], notempty: threading.Condition) -> None:
        with notempty:
            buffer.append(_SENTINEL)
            notempty.notify()

    @staticmethod
    def _feed(buffer: collections.deque[Any], notempty: threading.Condition, reader: Connection,
              writer: Connection, ignore_epipe: bool, sem: BoundedSemaphore, held: _Held) -> None:
        while True:
            with notempty:
                while not buffer:
                    notempty.wait()
                item = buffer[0]            # left in the buffer until sent (see _send)
            if item is _SENTINEL:
                # Closed only now, as multiprocessing does: closed earlier, the reader would
                # turn the sends above into EPIPE when no other process holds it.
                reader.close()
                writer.close()
                return
            payload, taken, flags, _, flight = item
            fds = [entry[0].fd for entry in taken]
            try:
                # (waits here, not in put(), while the window is full: as multiprocessing's
                # feeder waits on a full pipe)
                writer.send_packed(payload, fds, flags, flight)
            except Exception as e:
                if ignore_epipe and getattr(e, "errno", 0) == 32:
                    return
                sem.release()
                _report_dropped(e, fds, writer)
            finally:
                held.release(taken)
                with notempty:
                    buffer.popleft()


def _report_dropped(e: Exception, fds: list[int], writer: Connection) -> None:
    """A message put() accepted could not be sent: said on stderr, with the traceback, as
    multiprocessing's feeder reports what it could not pickle; put() has returned, so no
    caller is left to raise in. Pickling and the settings raise in put() itself: what
    reaches here is the system's refusal (shared memory full, every reader closed, a
    message of too many segments), which no retry would mend."""
    import sys
    import traceback
    def state(fd: int) -> str:
        try:
            os.fstat(fd)
            return f"{fd} open"
        except OSError as err:
            return f"{fd} {err.strerror}"
    sock = writer._sock
    # (which fd a refusal such as EBADF was about: a clue where one was closed too early)
    where = (f"its fds: {[state(fd) for fd in fds]}, the socket: "
             f"{'closed' if sock is None else state(sock.fileno())}")
    print(f"sharedmp: a Queue's feeder thread could not send a message and dropped it: "
          f"{type(e).__name__}: {e} ({where})", file=sys.stderr)
    traceback.print_exc()


class JoinableQueue(Queue):
    """A Queue with task_done() and join()."""

    def __init__(self, maxsize: int = 0, *, ctx: BaseContext) -> None:
        super().__init__(maxsize, ctx=ctx)
        self._unfinished_tasks = ctx.Semaphore(0)
        self._cond = ctx.Condition()

    def __getstate__(self) -> tuple[Any, ...]:
        return super().__getstate__() + (self._cond, self._unfinished_tasks)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        super().__setstate__(state[:-2])
        self._cond, self._unfinished_tasks = state[-2:]

    def _count_task(self) -> None:
        with self._cond:        # counted before any consumer can see it
            self._unfinished_tasks.release()

    def task_done(self) -> None:
        with self._cond:
            if not self._unfinished_tasks.acquire(False):
                raise ValueError("task_done() called too many times")
            if _compat.semaphore_is_zero(self._unfinished_tasks):
                self._cond.notify_all()

    def join(self) -> None:
        with self._cond:
            if not _compat.semaphore_is_zero(self._unfinished_tasks):
                self._cond.wait()

"""Owned fds, closed one way; and the token pipes that tell a sender a message was taken.

``Fd`` is an fd this process owns: ``close()`` closes it once (``fd`` is -1 after; a
second close does nothing), and a ``weakref.finalize`` closes it when the holder goes.
A finalizer, not ``__del__``: CPython runs ``__del__`` before it clears weak references,
so a thread could take a dying holder back with its fd already closed (and later use
whatever file reused the number). Finalizers close only in the process that opened the
fd: a forked child's copy of a holder stands for the parent's fd, which the child may have
closed already (``forks.in_child`` hooks do), its number reused. Holders: CUDA's exported
and kept fds (``cuda/ipc.py``), the dups a queue holds for messages its feeder has not sent
(``channels/queues.py``), the private fds of recycling's pool (``memory/recycle.py``); their
``in_child`` hooks close the child's copies with ``close_inherited`` (CUDA's imported ones
stay with the child's copies of their tensors: CUDA is not usable after fork). A mapped segment's
fds are not held this way: they go with the mapping (``segment.release``, its finalizer),
in whichever process holds the mapping, a forked child's copy included.

Not at interpreter exit: ``weakref.finalize`` calls every live finalizer from its atexit
hook (``atexit=True``, its default), which runs before multiprocessing's (atexit runs the
hooks registered last first, and the first finalizer is made after multiprocessing is
imported): before its exit handler joins the queues' feeder threads. A feeder still sending
the messages put() buffered (a process puts, then exits: multiprocessing flushes them) would
find their fds closed under it (EBADF: the messages dropped), and a window would close its
token pipes twice. The kernel closes them when the process ends.

A *token pipe* tells a sender when a message was taken: the message carries a copy of the
write end, the sender keeps the read end, and the read end sees EOF once every copy of the
write end is closed (every message that carried it received, or lost with its channel or
its receiver). The manager's tokens (``memory/manager.py``: named segments in flight) and
flow control's flight tokens (``channels/flow.py``: the window) are such pipes; ``ended``
polls a set of read ends for both.
"""
from __future__ import annotations

import os
import select
import weakref
from typing import Iterable


def close_unless_forked(fds: Iterable[int], pid: int) -> None:
    """Close ``fds`` if this is process ``pid`` (the finalizer of what owns them)."""
    if os.getpid() == pid:
        for fd in list(fds):
            os.close(fd)


def own(holder: object, fds: Iterable[int]) -> weakref.finalize:
    """Close ``fds`` (a container the holder may keep changing) once ``holder`` goes, in
    this process only, and never at interpreter exit (see the module docstring)."""
    finalizer = weakref.finalize(holder, close_unless_forked, fds, os.getpid())
    finalizer.atexit = False
    return finalizer


class Fd:
    """An fd this process owns, closed by ``close()`` or once nothing holds this object."""

    __slots__ = ("fd", "_finalizer", "__weakref__")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._finalizer = own(self, (fd,))

    def close(self) -> None:
        """Close the fd now (harmless if done before); ``fd`` becomes -1."""
        info = self._finalizer.detach()
        self.fd = -1
        if info is not None:
            _, func, args, _ = info
            func(*args)

    def take(self) -> int:
        """Hand the fd to a new owner (this holder no longer closes it); -1 if closed."""
        self._finalizer.detach()
        fd, self.fd = self.fd, -1
        return fd

    def close_inherited(self) -> None:
        """(a forked child, from its ``forks.in_child`` hook, before anything could reuse the
        number) Close the child's own copy of the fd; the parent's stays open."""
        fd = self.take()
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass

    def __repr__(self) -> str:
        return f"<Fd {self.fd}>"


def pipe() -> tuple[int, int]:
    """A new token pipe: (read end, write end), close-on-exec."""
    return os.pipe2(os.O_CLOEXEC)


def ended(read_ends: Iterable[int], wait: bool = False) -> list[int]:
    """The token pipes among ``read_ends`` that have ended (every copy of the write end
    closed): now, or (``wait``) once at least one has."""
    poller = select.poll()
    for r in read_ends:
        poller.register(r, select.POLLIN)
    # (PEP 475: a signal interrupts the wait only if its handler raises, as it interrupts
    # the standard library's blocking send)
    return [r for r, _ in poller.poll(None if wait else 0)]

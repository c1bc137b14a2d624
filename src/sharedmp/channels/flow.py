"""Flow control: a sender is never further ahead of its receivers than its window.

The standard library's ``send`` blocks once the kernel's pipe buffer is full, which bounds
what a fast producer holds in flight. sharedmp's records are small (the memory travels as
fds), so the socket buffer bounds nothing: a connection counts instead the memory its
messages made for the flight (a payload over one record, written into shared memory; a
plain array copied into shared memory at send) and a send blocks, after its message went
out, while that passes the window. Shared arrays the sender keeps are its own memory, not
flight.

How a sender learns that a message was taken: the message carries a *flight token*, the
write end of a pipe whose read end the sender keeps; the receiver closes it as it reads
the record. The read end sees EOF once every copy is closed, which also happens when the
message can no longer be received (the channel destroyed unread, the receiver killed with
it in hand), so a lost message never holds the window for good. Receipt is what counts,
not what the receiver keeps afterwards: kept arrays are the receiver's memory.

A pipe per message would cost a few microseconds on small ones, so the flight of small
messages is summed and the token goes with the message that brings the sum to
``STEP`` (an eighth of the window): at most a step is ever uncounted. Records before a
token are taken before it (one socket, one sender process, in order).

The window: ``$SHAREDMP_WINDOW_BYTES``, else ``DEFAULT`` or a ``_FRACTION_OF_AVAILABLE``-th
of the memory the machine (or its cgroup) has available, whichever is smaller, and at least
``_MIN`` (docs/reference.md, ``mp.Pipe``, states them). A send returns once the
flight, its own message included, is within the window, so a message larger than the
window returns once it has been received, as the standard library's larger than its pipe
buffer do. A send that finds the window full waits until half of it is free, so that a
steady stream wakes once per half-window and not once per message. The bench's streams
(W2, W3) run as fast with the default as with 64 MiB or none. Windows are per connection end
and per process.
"""
from __future__ import annotations

import os
import threading
import weakref

from .. import fds, forks, host, settings

ENV = settings.WINDOW_BYTES
DEFAULT = 8 << 20
_MIN = 1 << 20
_FRACTION_OF_AVAILABLE = 64


def window_bytes() -> int:
    """The window of a connection made now: $SHAREDMP_WINDOW_BYTES, else the default."""
    n = settings.get(ENV)
    return _default_window() if n is None else n  # type: ignore[no-any-return]


def _default_window() -> int:
    """Without the setting: a part of the memory available, within _MIN-DEFAULT."""
    # (read at most once a second: a Pool starts several connections at once)
    avail = host.available_memory_cached(1.0)
    if avail is None:                 # (no /proc/meminfo)
        return DEFAULT
    return max(_MIN, min(DEFAULT, avail // _FRACTION_OF_AVAILABLE))


class Window:
    """The flight of one connection end in this process: tokens of messages not yet taken."""

    def __init__(self) -> None:
        # The setting is read here, in the thread of the connection's first send or put():
        # a bad value raises there, naming the variable, not in a queue's feeder thread
        # after put() returned (the message dropped). Sized by the first message that makes
        # flight (``_size``): reading the memory available costs about 0.5 ms, which a
        # channel of small messages by value, that never needs it, would pay on its first send.
        self._setting: int | None = settings.get(ENV)
        self.limit = self.step = 0
        self._uncounted = 0                   # flight of recent messages, below a step
        self._tokens: dict[int, int] = {}     # read end -> bytes it stands for
        self.flight = 0                       # the sum of _tokens' bytes
        self._lock = threading.Lock()
        fds.own(self, self._tokens)           # the read ends left when the window goes
        _windows.add(self)

    def token(self, nbytes: int) -> int | None:
        """The write end of a token for a message of ``nbytes`` of flight, or None when the
        message goes without one (its bytes are counted with a later one). The caller
        sends it with the message and closes it."""
        pair = self.open(nbytes)
        return None if pair is None else pair[1]

    def open(self, nbytes: int) -> tuple[int, int] | None:
        """token(), as (read end, write end): ``cancel(read end, nbytes)`` undoes it."""
        if nbytes <= 0:
            return None
        with self._lock:
            if not self.limit:
                self._size()
            self._uncounted += nbytes
            if self._uncounted < self.step:
                return None
            r, w = fds.pipe()
            self._tokens[r] = self._uncounted
            self.flight += self._uncounted
            self._uncounted = 0
            return r, w

    def cancel(self, r: int | None, nbytes: int) -> None:
        """The message of ``open(nbytes)`` was not sent: as if it had never been counted."""
        with self._lock:
            if r is None:
                self._uncounted -= nbytes
                return
            counted = self._tokens.pop(r)
            self.flight -= counted
            self._uncounted += counted - nbytes
            os.close(r)

    def room(self, nbytes: int) -> bool:
        """Whether a message of ``nbytes`` of flight would be sent without waiting: it and
        everything not yet taken fit in the window (tokens of messages taken are let go
        first, without waiting)."""
        if self.flight + self._uncounted + nbytes <= self.limit:
            return True
        if not self.limit:
            self._size()
            return self.room(nbytes)
        self.reap()
        return self.flight + self._uncounted + nbytes <= self.limit

    def _size(self) -> None:
        # (the setting as read at creation: never read again here, in a queue's feeder thread)
        self.limit = _default_window() if self._setting is None else self._setting
        self.step = max(1, self.limit // 8)

    def wait(self) -> None:
        """Once the window is full: block until receivers have taken half of it."""
        if self.flight <= self.limit:
            return
        with self._lock:
            while self.flight > self.limit // 2:
                for r in fds.ended(self._tokens, wait=True):
                    self._taken(r)

    def reap(self) -> None:
        """Let go of the tokens of messages already taken, without waiting."""
        if not self._tokens:
            return
        with self._lock:
            for r in fds.ended(self._tokens):
                self._taken(r)

    def _taken(self, r: int) -> None:
        self.flight -= self._tokens.pop(r)
        os.close(r)

    def close(self) -> None:
        with self._lock:
            for r in list(self._tokens):
                self._taken(r)
            self._uncounted = 0



# A forked child's copies of the parent's windows stand for the parent's messages.
_windows: weakref.WeakSet[Window] = weakref.WeakSet()


@forks.in_child
def _after_fork_in_child() -> None:
    for w in list(_windows):
        w._lock = threading.Lock()
        w.close()

"""Flow control: a sender is never further ahead of its receivers than its window.

The standard library's ``send`` blocks once the kernel's pipe buffer is full, which bounds
what a fast producer holds in flight. sharedmp's records are small (the memory travels as
fds), so the socket buffer bounds nothing: a connection counts instead the memory its
messages made for the flight (a payload over one record, written into shared memory; a
plain array copied into shared memory at send) and a send blocks, after its message went
out, while that passes the window. Shared arrays the sender keeps are its own memory, not
flight; once it drops one that a message not yet taken carries (a fresh ``mp.full`` put
and let go), the message alone keeps that segment alive, and its size counts from then
until that message is taken (``held``, ``Window.register``: a weak reference to the
sender's mapping, whose end counts it). A segment is counted whole: an arena carved for
small arrays counts once its last array here is gone.

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

import collections
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any

from .. import fds, forks, host, settings
from ..memory import segment

if TYPE_CHECKING:
    from ..memory.segment import Segment
    from ..wire import Fds

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


class Carried:
    """What keeps a message's manager token open until sent (its ``Fds.keep``), with the names
    of the segments the message carries (``connection._Tokens``): held() reads them."""

    __slots__ = ("token", "fd", "paths")

    def __init__(self, token: object, fd: int, paths: list[str]) -> None:
        self.token, self.fd, self.paths = token, fd, paths


def held(fds: Fds) -> list[Segment]:
    """The segments a message carries that this process maps (the sender's memory while it
    keeps them), less copies made for the message (counted as flight already) and arenas
    (shared by many small arrays, of a few messages or of thousands: counted whole with each
    message that let one go, a stream of small arrays with no reader yet would stop after two
    arenas, where the standard library's queue takes thousands). Called
    where the message was pickled: in a queue's feeder, its fds are dups and the arrays
    may be gone."""
    keep = fds.keep
    if len(keep) == 1 and len(fds) == 1:     # an array or a tensor alone (or a copy of one)
        seg = segment.segment_of(keep[0])
        if seg is not None and seg.fd == fds[0]:
            return [] if fds.flight or seg.arena else [seg]
    found: list[Segment] = []
    skip = set()
    for owner in keep:
        if type(owner) is Carried:
            skip.add(owner.fd)
            for path in owner.paths:
                seg = _lookup(_by_path, "path", path)
                if seg is not None:
                    found.append(seg)
            continue
        seg = segment.segment_of(owner)
        if seg is not None:
            skip.add(seg.fd)                 # a copy, counted as flight
        else:
            skip.add(getattr(owner, "fd", -1))   # (its fd is the owner's: a token, a CUDA fd)
    for fd in fds:
        if fd not in skip:
            seg = _lookup(_by_fd, "fd", fd)
            if seg is not None:
                found.append(seg)
    return [s for s in found if not s.arena]


# fd or path -> the live Segment of this process that it is; refreshed from
# segment.live_segments() when a key is not found (a new segment)
_by_fd: dict[int, Segment] = {}
_by_path: dict[str, Segment] = {}


def _lookup(index: dict[Any, Segment], attr: str, key: Any) -> Segment | None:
    seg = index.get(key)
    if seg is None or getattr(seg, attr) != key or seg.mapping() is None:
        _by_fd.clear()
        _by_path.clear()
        for s in segment.live_segments():
            if s.fd >= 0:
                _by_fd[s.fd] = s
            if s.path is not None:
                _by_path[s.path] = s
        seg = index.get(key)
        if seg is None or getattr(seg, attr) != key or seg.mapping() is None:
            return None
    return seg


class _Sent(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to the sender's mapping of a segment its messages carry; it ends when
    the sender drops the segment. ``cover``: the id of the token whose receipt says the last
    message that carried it was taken (tokens go with messages, in order)."""

    __slots__ = ("seg", "size", "cover", "paths")
    seg: Segment
    size: int
    cover: int
    paths: list[str]                  # [its name], for a named segment (see Window.carried)


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
        self._tokens: dict[int, list[int]] = {}   # read end -> [bytes it stands for, its id]
        self._ids: dict[int, int] = {}        # token id -> read end, for those not yet taken
        self._opened = 0                      # tokens opened (the last one's id)
        self.flight = 0                       # the sum of _tokens' bytes
        self._sent: dict[Segment, _Sent] = {}     # segments sent while held here
        self._last: _Sent | None = None       # of the last message of one segment
        self._arena: list[str] | None = None  # names of the last message, if it counted none
        self._dropped: collections.deque[_Sent] = collections.deque()  # their ends, to count
        self._lock = threading.Lock()
        fds.own(self, self._tokens)           # the read ends left when the window goes
        _windows.add(self)

    def token(self, nbytes: int) -> int | None:
        """The write end of a token for a message of ``nbytes`` of flight, or None when the
        message goes without one (its bytes are counted with a later one). The caller
        sends it with the message and closes it."""
        pair = self.open(nbytes)
        return None if pair is None else pair[1]

    def carried(self, fds: Fds) -> int:
        """``register(held(fds))``, in the thread that pickled the message. A message of one
        segment that the last such message carried too (a stream of arrays carved from one
        arena) costs only a look."""
        keep = fds.keep
        if len(keep) != 1 or len(fds) != 1:
            return self.register(held(fds))
        ref, owner = self._last, keep[0]
        if ref is not None and (ref() is owner or type(owner) is Carried
                                and owner.paths == ref.paths and ref() is not None):
            ref.cover = self._opened + 1
            return 0
        if type(owner) is Carried and owner.paths == self._arena:
            return 0                          # (the arena of the message before)
        segs = held(fds)
        gone = self.register(segs)
        if len(segs) == 1:
            self._last = self._sent.get(segs[0])
        self._arena = owner.paths if not segs and type(owner) is Carried else None
        return gone

    def register(self, segs: list[Segment]) -> int:
        """Before a message that carries ``segs`` (``held``) is sent: watch those the sender
        still maps; returns the bytes of those it dropped already (the message's flight)."""
        gone = 0
        cover = self._opened + 1              # the token that goes with this message or after
        sent = self._sent
        for seg in segs:
            ref = sent.get(seg)
            if ref is not None:
                ref.cover = cover
                continue
            mm = seg.mapping()
            if mm is None:
                gone += seg.size
                continue
            ref = _Sent(mm, self._dropped.append)
            ref.seg, ref.size, ref.cover = seg, seg.size, cover
            ref.paths = [seg.path] if seg.path is not None else []
            with self._lock:
                sent[seg] = ref
        return gone

    def _count_dropped(self) -> None:
        """(lock held) Count the segments the sender dropped while messages carried them:
        with the token that covers their last message if it is out and not yet taken, with
        the next token if none went since."""
        while self._dropped:
            ref = self._dropped.popleft()
            if self._sent.get(ref.seg) is ref:
                del self._sent[ref.seg]
            if ref.cover > self._opened:
                self._uncounted += ref.size
            else:
                r = self._ids.get(ref.cover)
                if r is not None:
                    self._tokens[r][0] += ref.size
                    self.flight += ref.size

    def open(self, nbytes: int) -> tuple[int, int] | None:
        """token(), as (read end, write end): ``cancel(read end, nbytes)`` undoes it."""
        if nbytes <= 0 and not self._dropped:
            return None
        with self._lock:
            if not self.limit:
                self._size()
            self._count_dropped()
            self._uncounted += nbytes
            if self._uncounted < self.step:
                return None
            r, w = fds.pipe()
            self._opened += 1
            self._tokens[r] = [self._uncounted, self._opened]
            self._ids[self._opened] = r
            self.flight += self._uncounted
            self._uncounted = 0
            return r, w

    def cancel(self, r: int | None, nbytes: int) -> None:
        """The message of ``open(nbytes)`` was not sent: as if it had never been counted."""
        with self._lock:
            if r is None:
                self._uncounted -= nbytes
                return
            counted, ident = self._tokens.pop(r)
            del self._ids[ident]
            self.flight -= counted
            self._uncounted += counted - nbytes
            os.close(r)

    def room(self, nbytes: int) -> bool:
        """Whether a message of ``nbytes`` of flight would be sent without waiting: it and
        everything not yet taken fit in the window (tokens of messages taken are let go
        first, without waiting)."""
        if self._dropped:
            with self._lock:
                self._count_dropped()
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
        if self._dropped:
            with self._lock:
                self._count_dropped()
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
        counted, ident = self._tokens.pop(r)
        del self._ids[ident]
        self.flight -= counted
        os.close(r)

    def close(self) -> None:
        with self._lock:
            for r in list(self._tokens):
                self._taken(r)
            self._uncounted = 0
            self._sent.clear()
            self._dropped.clear()
            self._last = None



# A forked child's copies of the parent's windows stand for the parent's messages.
_windows: weakref.WeakSet[Window] = weakref.WeakSet()


@forks.in_child
def _after_fork_in_child() -> None:
    for w in list(_windows):
        w._lock = threading.Lock()
        w.close()

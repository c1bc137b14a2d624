"""ConsumerLock: a queue's ``_rlock`` that a consumer killed while holding it gives back.

A queue's consumers take turns under its ``_rlock`` (queues.py's ``_get_frame``, board.py),
and ``Pool``'s ``terminate()`` takes it with a plain ``acquire()``. A ``multiprocessing.Lock``
held by a process that was then SIGKILLed stays held for ever: every other consumer, and the
pool's ``terminate()``, would wait for ever.

This lock is a ``multiprocessing.Lock`` (a semaphore: fast, uncontended in user space) and a
shared word naming its holder (pid and start time, one 8-byte store). A waiter that has not got
it within ``_SLICE`` looks at the holder: if that process is gone (or a zombie, or its pid was
reused), the waiter takes the hold over, under a second lock, as if the dead one had handed it
on. A holder killed in the instant between taking the semaphore and naming itself (or between
unnaming itself and giving it back: a few bytecodes) names no one: when the lock has stayed
taken, named by no one and with no hold counted, for ``_STUCK`` seconds, a waiter takes it
over too (a live holder stopped for that long inside those bytecodes would then share it).
Holders are looked up in /proc: the processes that share a queue share one pid namespace.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any

from .. import forks, host

_ident = threading.get_ident
_SLICE = 0.05           # s a waiter waits before it looks at the holder
_STUCK = 5.0            # s held, no holder named, nothing moving: its holder died unnamed
_PID_BITS = 22          # Linux's pid_max is at most 2**22


def _start_time(pid: int) -> int | None:
    """The start time of ``pid`` (clock ticks after boot), or None if it is gone or a zombie."""
    stat = host.proc_stat(pid)
    return stat.start if stat is not None and stat.alive else None


def _word(pid: int, start: int) -> int:
    return pid | (start << _PID_BITS) & ((1 << 63) - 1)


_me = [0]               # this process's word; 0 until asked (a forked child asks again)


def _my_word() -> int:
    if not _me[0]:              # (no /proc: start 0, a holder no waiter will judge gone)
        pid = os.getpid()
        _me[0] = _word(pid, _start_time(pid) or 0)
    return _me[0]


@forks.in_child
def _forget_me() -> None:
    _me[0] = 0


def _gone(word: int) -> bool:
    pid = word & ((1 << _PID_BITS) - 1)
    if word == pid:
        return False
    start = _start_time(pid)
    return start is None or _word(pid, start) != word


class ConsumerLock:
    """``multiprocessing.Lock``'s ``acquire``/``release``, and a hold that outlives no holder."""

    def __init__(self, ctx: Any) -> None:
        self._sem = ctx.Lock()
        self._takeover = ctx.Lock()
        self._shared = ctx.RawArray("q", 2)       # [holder's word, holds so far]
        self._setup()

    def _setup(self) -> None:
        self._words = memoryview(self._shared).cast("B").cast("q")
        self._try = self._sem.acquire
        self._mine = 0                  # the thread holding it, if this process does

    def __getstate__(self) -> tuple[Any, Any, Any]:
        return self._sem, self._takeover, self._shared

    def __setstate__(self, state: tuple[Any, Any, Any]) -> None:
        self._sem, self._takeover, self._shared = state
        self._setup()

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        word = _me[0] or _my_word()
        if not (self._try(False) or self._wait(block, timeout)):
            return False
        words = self._words
        words[1] += 1
        words[0] = word
        self._mine = _ident()
        return True

    def _wait(self, block: bool, timeout: float | None) -> bool:
        if not block:
            return False
        deadline = None if timeout is None else time.monotonic() + timeout
        seen, since = (-1, -1), 0.0
        while True:
            left = _SLICE if deadline is None else min(_SLICE, deadline - time.monotonic())
            if left <= 0:
                return False
            if self._sem.acquire(True, left):
                return True
            now = (self._words[0], self._words[1])
            if now != seen:
                seen, since = now, time.monotonic()
            if self._take_over(seen, time.monotonic() - since):
                return True

    def _take_over(self, seen: tuple[int, int], still_for: float) -> bool:
        """The hold of a holder that is gone (the semaphore stays taken: ours now). Gone: the
        process it names no longer runs, or none is named and nothing has moved for
        ``_STUCK`` s (one killed in the instant between taking and naming)."""
        word = seen[0]
        if not (_gone(word) if word else still_for >= _STUCK):
            return False
        if not self._takeover.acquire(True, 1.0):
            return False
        try:
            if (self._words[0], self._words[1]) != seen:    # (another took it over first)
                return False
            self._words[0] = _my_word()
            return True
        finally:
            self._takeover.release()

    def release(self) -> None:
        self._mine = 0
        self._words[0] = 0
        self._sem.release()

    def is_mine(self) -> bool:
        """Whether this thread of this process holds it."""
        return self._mine == _ident() and self._words[0] == _my_word()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        word = self._words[0]
        holder = f"held by pid {word & ((1 << _PID_BITS) - 1)}" if word else "not named"
        return f"<ConsumerLock {holder}, {self._words[1]} holds>"

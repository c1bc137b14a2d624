"""Per-process state after ``os.fork``: one helper instead of a hook per module.

A forked child has one thread, but inherits every lock in whatever state another thread
of the parent left it: a lock held at the fork would never be released in the child.
Modules keep their module-level locks plain (``threading.Lock``, no wrapper on the hot
paths) and name them here; the child gets new ones. ``in_child`` runs a module's own
reset of per-process state (tables of what this process holds, threads it started).

The child runs every renewal first, then every reset in the order registered, with the
garbage collector off from just before the fork until they are done: a collection in
between (any allocation may start one) would run the ``__del__`` of the parent's garbage
(a ``Connection`` of a queue gone, its window) against locks not yet renewed, or
half-reset state, and a child waiting for a lock no thread of its holds never starts.
"""
from __future__ import annotations

import gc
import os
import sys
import threading
from typing import Any, Callable, MutableMapping

_Hook = Callable[[], None]


_renewals: list[_Hook] = []
_resets: list[_Hook] = []
# Forks under way in this process, and whether the collector ran before the first of them
# (two threads may fork at once: their ``before`` hooks are not serialized).
_forking = [0, False]
_forking_lock = threading.Lock()


def renew_locks(namespace: MutableMapping[str, Any], *names: str) -> None:
    """In a forked child, replace each ``namespace[name]`` (a module's ``globals()``) by a
    new lock of the same kind (``threading.Lock`` or ``threading.RLock``)."""
    kinds = {name: type(namespace[name]) for name in names}
    rlock = type(threading.RLock())

    def renew() -> None:
        for name, kind in kinds.items():
            namespace[name] = threading.RLock() if kind is rlock else threading.Lock()

    _renewals.append(renew)


def in_child(hook: _Hook) -> _Hook:
    """Run ``hook`` in every forked child (usable as a decorator); returns ``hook``."""
    _resets.append(hook)
    return hook


def before(hook: _Hook) -> _Hook:
    """Run ``hook`` in the parent just before every fork (usable as a decorator)."""
    os.register_at_fork(before=hook)
    return hook


def in_parent(hook: _Hook) -> _Hook:
    """Run ``hook`` in the parent just after every fork (usable as a decorator)."""
    os.register_at_fork(after_in_parent=hook)
    return hook


def _collector_off() -> None:
    with _forking_lock:
        if not _forking[0]:
            _forking[1] = gc.isenabled()
            gc.disable()
        _forking[0] += 1


def _collector_back() -> None:
    with _forking_lock:
        _forking[0] -= 1
        if not _forking[0] and _forking[1]:
            gc.enable()


def _child() -> None:
    global _forking_lock
    _forking_lock = threading.Lock()    # (another thread's fork may hold it: not ours)
    _forking[0] = 1                     # (this fork alone)
    for hook in (*_renewals, *_resets):
        try:
            hook()
        except BaseException:          # (as os.register_at_fork's hooks: said, the rest run)
            import traceback
            print(f"Exception ignored in a fork hook {hook!r}:", file=sys.stderr)
            traceback.print_exc()
    _collector_back()


# (the collector is off from this ``before`` to the end of this ``after``, whatever hooks
# run between)
os.register_at_fork(before=_collector_off, after_in_parent=_collector_back,
                    after_in_child=_child)

"""Per-process state after ``os.fork``: one helper instead of a hook per module.

A forked child has one thread, but inherits every lock in whatever state another thread
of the parent left it: a lock held at the fork would never be released in the child.
Modules keep their module-level locks plain (``threading.Lock``, no wrapper on the hot
paths) and name them here; the child gets new ones. ``in_child`` runs a module's own
reset of per-process state (tables of what this process holds, threads it started).
"""
from __future__ import annotations

import os
import threading
from typing import Any, Callable, MutableMapping

_Hook = Callable[[], None]


def renew_locks(namespace: MutableMapping[str, Any], *names: str) -> None:
    """In a forked child, replace each ``namespace[name]`` (a module's ``globals()``) by a
    new lock of the same kind (``threading.Lock`` or ``threading.RLock``)."""
    kinds = {name: type(namespace[name]) for name in names}
    rlock = type(threading.RLock())

    def renew() -> None:
        for name, kind in kinds.items():
            namespace[name] = threading.RLock() if kind is rlock else threading.Lock()

    os.register_at_fork(after_in_child=renew)


def in_child(hook: _Hook) -> _Hook:
    """Run ``hook`` in every forked child (usable as a decorator); returns ``hook``."""
    os.register_at_fork(after_in_child=hook)
    return hook


def before(hook: _Hook) -> _Hook:
    """Run ``hook`` in the parent just before every fork (usable as a decorator)."""
    os.register_at_fork(before=hook)
    return hook


def in_parent(hook: _Hook) -> _Hook:
    """Run ``hook`` in the parent just after every fork (usable as a decorator)."""
    os.register_at_fork(after_in_parent=hook)
    return hook

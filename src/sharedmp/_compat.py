"""The private parts of CPython's multiprocessing that sharedmp uses, each in one place.

Every private name of ``multiprocessing`` that sharedmp reads, calls or overrides is used
here and nowhere else (``tests/test_compat.py`` fails otherwise), each with the versions it
was checked on: the source of each on 3.11.7, 3.12.1, 3.13.0, 3.14.10 and 3.15.2, and the
suite run on each of those. A new CPython that changes one breaks
one function here, which the tests name.

The reverse also holds: CPython's ``Pool`` reaches into its queues' ``_reader``,
``_writer`` and ``_rlock`` (``_quick_put``, ``_quick_get``, ``_help_stuff_finish``), so
sharedmp's queues have them (``POOL_QUEUE_ATTRIBUTES``, checked against ``pool.py``).
"""
from __future__ import annotations

import os
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any

CHECKED = ("3.11", "3.12", "3.13", "3.14", "3.15")

# What multiprocessing.pool.Pool uses of the queues it is given (3.11-3.15)
POOL_QUEUE_ATTRIBUTES = ("_reader", "_writer", "_rlock")

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess as _ProcessBase
else:
    _ProcessBase = object


class ChildStart(_ProcessBase):
    """Process mixin: ``_child_starts()`` runs in the child before anything of the process's
    own (its target, its run()), before the standard library's bootstrap.

    ``BaseProcess._bootstrap(self, parent_sentinel=None)`` (3.11-3.15: the first method the
    child runs, under every start method) is overridden here only. Mixins extend
    ``_child_starts`` and call ``super()._child_starts()``."""

    def _child_starts(self) -> None:
        pass

    def _bootstrap(self, *args: Any, **kwargs: Any) -> int:
        self._child_starts()
        return super()._bootstrap(*args, **kwargs)  # type: ignore[misc, no-any-return]


def start_method_of(process: Any) -> str | None:
    """The start method a Process class is bound to (None: the default context's).
    ``_start_method``, a class attribute of the context's Process classes (3.11-3.15)."""
    return getattr(process, "_start_method", None)


# A copy made while a Process's arguments are pickled (spawn, forkserver) must live until
# the launch has handed its fd or name to the child: the Popen keeps it (``keep_until_launched``,
# reductions/ndarray.py). Once ``start()`` has returned the child has them: sharedmp's
# Process classes let go then (``launched``); a standard Process keeps it with its Popen.
_LAUNCH_KEEP = "_sharedmp_keep"


def keep_until_launched(popen: Any, obj: object) -> None:
    """Keep ``obj`` alive with the Popen being launched."""
    popen.__dict__.setdefault(_LAUNCH_KEEP, []).append(obj)


def launched(process: Any) -> None:
    """(after ``start()``) Let go of what ``keep_until_launched`` kept for ``process``:
    ``BaseProcess._popen`` (3.11-3.15), the Popen ``start()`` made."""
    popen = getattr(process, "_popen", None)
    if popen is not None:
        popen.__dict__.pop(_LAUNCH_KEEP, None)


def target_of(process: Any) -> Any:
    """The target a Process was made with (None if none): ``BaseProcess._target``, set by
    ``__init__`` (3.11-3.15)."""
    return getattr(process, "_target", None)


# ``ForkingPickler._extra_reducers``: what ``ForkingPickler.register`` added, a dict of the
# class (3.11-3.15), filled and never replaced, merged into each pickler's dispatch table.
# The dict itself, not a function returning it: wire.py reads it twice per message.
EXTRA_REDUCERS: dict[type, Any] = ForkingPickler._extra_reducers  # type: ignore[attr-defined]


def semaphore_value(sem: Any) -> int:
    """The value of a ``multiprocessing.Semaphore`` (``_semlock._get_value()``, 3.11-3.15;
    NotImplementedError on macOS, as multiprocessing's ``qsize``)."""
    return sem._semlock._get_value()  # type: ignore[no-any-return]


def semaphore_is_zero(sem: Any) -> bool:
    """Whether a ``multiprocessing.Semaphore`` is at zero (``_semlock._is_zero()``)."""
    return sem._semlock._is_zero()  # type: ignore[no-any-return]


def fork_server() -> Any:
    """The process's ``multiprocessing.forkserver.ForkServer`` (the module's singleton
    ``_forkserver``, 3.11-3.15)."""
    from multiprocessing import forkserver
    return forkserver._forkserver  # type: ignore[attr-defined]


def forkserver_preload() -> list[str] | None:
    """The modules the fork server will preload when it next starts (``_preload_modules``,
    3.8-3.15), None if that is not a list there."""
    modules = getattr(fork_server(), "_preload_modules", None)
    return modules if isinstance(modules, list) else None


def set_forkserver_preload(modules: list[str]) -> None:
    """``multiprocessing.set_forkserver_preload(modules)``, keeping the ``on_error`` the
    program chose (3.15: a keyword kept as ``_preload_on_error``; the call alone would put
    it back to "ignore")."""
    import multiprocessing
    on_error = getattr(fork_server(), "_preload_on_error", None)
    if on_error is None:
        multiprocessing.set_forkserver_preload(modules)
    else:
        multiprocessing.set_forkserver_preload(modules, on_error=on_error)  # type: ignore[call-arg]


def close_forkserver_alive_fd() -> None:
    """(in a forkserver child) Close the fd by which a fork server knows its parent lives,
    inherited from the server (``_forkserver_alive_fd``, set where ``_forkserver_pid`` is
    None: the child is not the server's own client, 3.11-3.13)."""
    server = fork_server()
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None and getattr(server, "_forkserver_pid", 0) is None:
        server._forkserver_alive_fd = None
        os.close(fd)


def pool_workers(pool: Any) -> list[Any]:
    """The worker Process objects of a ``multiprocessing.pool.Pool`` (``_pool``, 3.11-3.15)."""
    return list(pool._pool)


def pool_running(pool: Any) -> bool:
    """Whether a Pool still takes tasks (``_state == RUN``, 3.11-3.15)."""
    from multiprocessing.pool import RUN
    return bool(pool._state == RUN)


def resource_tracker_pid() -> int | None:
    """The pid of this process's multiprocessing resource tracker, if it started one
    (``resource_tracker._resource_tracker._pid``, 3.11-3.15)."""
    from multiprocessing import resource_tracker
    return getattr(resource_tracker._resource_tracker, "_pid", None)

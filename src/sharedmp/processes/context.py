"""Contexts for fork, spawn and forkserver whose channels, pools and processes are sharedmp's.

Each is the standard context of its start method with Queue, JoinableQueue,
SimpleQueue, Pipe, Pool and Process replaced (a child starts with the parent's
sharing strategy and, on Linux, dies with its parent: ``pdeath.py``), so it
works wherever a ``multiprocessing`` context does (``ProcessPoolExecutor(mp_context=...)``,
``DataLoader(multiprocessing_context=...)``).
"""
from __future__ import annotations

import gc
import multiprocessing
import multiprocessing.context as _std
import sys
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable

from .. import _compat, settings, strategy
from ..errors import ManagerError
from ..memory import manager
from .pdeath import DieWithParent

if TYPE_CHECKING:
    import multiprocessing.pool

    from ..channels import queues
    from ..channels.connection import Connection

    _ContextBase = _std.BaseContext     # _Channels is mixed into the standard contexts
else:
    _ContextBase = object


class _CarryStrategy(_compat.ChildStart):
    """Process mixin: the child starts with the parent's sharing strategy and manager daemon.

    The environment already carries both to spawn and fork children; a forkserver started
    before ``set_sharing_strategy`` would not, so the Process object carries them too.
    Under file_system the parent connects to the daemon first: the segments its children
    send it then outlive the children (a daemon with no client left would unlink them).
    """

    def start(self) -> None:
        self._sharedmp_strategy = strategy.get_sharing_strategy()
        self._sharedmp_manager: str | None = None
        if self._sharedmp_strategy == "file_system":
            try:
                self._sharedmp_manager = manager.address()
            except ManagerError:
                pass                  # the child says so if it ever needs the daemon
        super().start()
        _compat.launched(self)        # (the copies made for its arguments: the child has them)

    def __getstate__(self) -> dict[str, Any]:
        # (spawn, forkserver) The daemon first: the arguments may name segments, which the
        # child attaches while it unpickles them, before _bootstrap (a forkserver child's
        # environment is the fork server's, which may predate the daemon or name another).
        state = dict(self.__dict__)
        path = state.get("_sharedmp_manager")
        return {"_sharedmp_adopted": _Adopt(path), **state} if path else state

    def _child_starts(self) -> None:
        name = getattr(self, "_sharedmp_strategy", None)   # None: start() was overridden
        if name is not None:
            strategy.set_sharing_strategy(name)
            manager.adopt(self._sharedmp_manager)
        super()._child_starts()


class _Adopt:
    """Unpickled as ``manager.adopt(path)``, before what follows it in the same pickle."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Callable[[str | None], None], tuple[str]]:
        return manager.adopt, (self.path,)


# What a child of the fork server imports to run a sharedmp Process or Pool worker: preloaded
# in the server, each child has them already (27 ms a child otherwise, on 2 cores). CPython
# before 3.14 never preloads ``__main__`` there (its preparation data has no "main_path"),
# so the user's own ``import sharedmp`` at the top of the script does not do it either.
FORKSERVER_PRELOAD = ("sharedmp", "sharedmp.channels.queues")


def _preload_in_fork_server() -> None:
    """Add FORKSERVER_PRELOAD to the fork server's preload list, for the next server start
    (the running one, if any, keeps its modules). The standard library's own forkserver
    children share the server: they start with sharedmp imported, which changes nothing
    for them."""
    modules = _compat.forkserver_preload()
    if modules is not None and not set(FORKSERVER_PRELOAD) <= set(modules):
        missing = [m for m in FORKSERVER_PRELOAD if m not in modules]
        _compat.set_forkserver_preload(modules + missing)


class _FreezeInherited(_compat.ChildStart):
    """Process mixin: a forked child may freeze the objects it inherits (``gc.freeze()``) as
    it starts, before any collection runs in it; by default only a torch DataLoader worker.

    A collection traverses every tracked object and writes its GC header: in a forked child
    that copies every page of the parent's Python heap that holds a container (copy-on-write),
    once per child that runs a full collection. Measured with torch's DataLoader over a
    shared dataset (``share_dataset``, 1M records, 3 epochs, 1 worker): the processes' Pss
    137-141 MiB, frozen 90-95 (4 workers ran no full collection: the same either way,
    85-95 MiB; docs/reference.md). The price: frozen objects are never
    collected in the child, so an inherited cycle the child drops stays, its ``__del__``
    never run, and ``gc.get_objects()`` no longer lists them. A drop-in keeps the standard
    library's collector, so a child freezes only where asked (``_freezes``).
    """

    _sharedmp_forks = False      # whether start() forks (mp.Process: decided at start())
    _sharedmp_freeze = False

    def start(self) -> None:
        # Decided here, in the caller of start(): a bad setting raises there, not in the child.
        self._sharedmp_freeze = self._sharedmp_forks and _freezes(self)
        super().start()

    def _child_starts(self) -> None:
        if self._sharedmp_freeze:
            gc.freeze()
        super()._child_starts()


# torch's DataLoader starts each worker as ``ctx.Process(target=_worker_loop, ...)`` (1.x-2.x)
_TORCH_WORKER_MODULE = "torch.utils.data._utils.worker"


def _freezes(process: Any) -> bool:
    """Whether a fork child of ``process`` freezes what it inherits: as $SHAREDMP_FREEZE_FORKED
    says; unset, if it is a torch DataLoader worker. Such a worker runs torch's loop over the
    dataset the parent made (passed to a sharedmp context so that the workers share it): its
    inherited objects are that dataset and the parent's heap, which it reads and never drops,
    while what it makes itself (samples, batches) is collected as ever. There the freeze is
    what keeps the workers' memory constant; user code the worker runs drops nothing
    inherited in the cases DataLoader is built for."""
    setting = settings.get(settings.FREEZE_FORKED)
    if setting is not None:
        return bool(setting)
    # (torch is never imported here: a program that has no worker module loaded has no worker)
    module = sys.modules.get(_TORCH_WORKER_MODULE)
    target = _compat.target_of(process)
    return target is not None and target is getattr(module, "_worker_loop", None)


class _JoinGivesBack(_compat._ProcessBase):
    """Process mixin: a parent waiting in ``join()`` lets its caches go when idle, as one
    waiting in ``get()`` does (no thread does it: memory/cache.py)."""

    def join(self, timeout: float | None = None) -> None:
        from ..memory import cache
        join = super().join

        def joined(seconds: float | None) -> bool:
            join(seconds)
            return self.exitcode is not None
        cache.waiting(joined, timeout)


class ForkProcess(DieWithParent, _JoinGivesBack, _CarryStrategy, _FreezeInherited,
                  _std.ForkProcess):
    _sharedmp_forks = True


class SpawnProcess(DieWithParent, _JoinGivesBack, _CarryStrategy, _std.SpawnProcess):
    pass


class ForkServerProcess(DieWithParent, _JoinGivesBack, _CarryStrategy, _std.ForkServerProcess):
    def start(self) -> None:
        _preload_in_fork_server()
        super().start()


class Process(DieWithParent, _JoinGivesBack, _CarryStrategy, _FreezeInherited, _std.Process):
    """``mp.Process``: multiprocessing.Process of the default start method (resolved at
    ``start()``, as the standard one is), whose child starts with this process's sharing
    strategy and dies with it, as those of sharedmp's contexts do. Subclasses too."""

    def start(self) -> None:
        method = multiprocessing.get_start_method()
        if method == "forkserver":
            _preload_in_fork_server()
        self._sharedmp_forks = method == "fork"
        super().start()


class _Channels(_ContextBase):
    """The factories that differ from the standard context's."""

    Process: ClassVar[type[multiprocessing.process.BaseProcess]]    # (each context's own)

    def Queue(self, maxsize: int = 0) -> queues.Queue:  # type: ignore[override]
        """A queue whose messages carry the fds of their arrays."""
        from ..channels.queues import Queue
        return Queue(maxsize, ctx=self)

    def JoinableQueue(self, maxsize: int = 0) -> queues.JoinableQueue:  # type: ignore[override]
        """A Queue with task_done() and join()."""
        from ..channels.queues import JoinableQueue
        return JoinableQueue(maxsize, ctx=self)

    def SimpleQueue(self) -> queues.SimpleQueue:  # type: ignore[override]
        """A synchronous queue (put() returns once the message is in the kernel)."""
        from ..channels.queues import SimpleQueue
        return SimpleQueue(ctx=self)

    def Pipe(self, duplex: bool = True) -> tuple[Connection, Connection]:  # type: ignore[override]
        """Two Connections over an AF_UNIX socketpair."""
        from ..channels.connection import Pipe
        return Pipe(duplex)

    def Pool(self, processes: int | None = None, initializer: Callable[..., object] | None = None,
             initargs: Iterable[Any] = (),
             maxtasksperchild: int | None = None) -> multiprocessing.pool.Pool:
        """multiprocessing.pool.Pool whose task and result queues are sharedmp's."""
        from multiprocessing.pool import Pool      # (here: `import sharedmp` stays light)
        return Pool(processes, initializer, initargs, maxtasksperchild, context=self)

    def get_context(self, method: str | None = None) -> _Channels:  # type: ignore[override]
        return self if method is None else get_context(method)


class ForkContext(_Channels, _std.ForkContext):
    Process = ForkProcess


class SpawnContext(_Channels, _std.SpawnContext):
    Process = SpawnProcess


class ForkServerContext(_Channels, _std.ForkServerContext):
    Process = ForkServerProcess


_contexts = {"fork": ForkContext(), "spawn": SpawnContext(), "forkserver": ForkServerContext()}


def get_context(method: str | None = None) -> _Channels:
    """sharedmp's context for ``method`` (None: the start method multiprocessing uses now)."""
    if method is None:
        method = multiprocessing.get_start_method()
    try:
        return _contexts[method]
    except KeyError:
        raise ValueError(f"cannot find context for {method!r}; valid start methods: "
                         + ", ".join(sorted(_contexts))) from None


# Module-level factories of sharedmp: the default context's, resolved at each call, so
# that multiprocessing.set_start_method() applies to them as it does to the standard ones.
def Queue(maxsize: int = 0) -> queues.Queue:
    return get_context().Queue(maxsize)


def JoinableQueue(maxsize: int = 0) -> queues.JoinableQueue:
    return get_context().JoinableQueue(maxsize)


def SimpleQueue() -> queues.SimpleQueue:
    return get_context().SimpleQueue()


def Pipe(duplex: bool = True) -> tuple[Connection, Connection]:
    return get_context().Pipe(duplex)


def Pool(processes: int | None = None, initializer: Callable[..., object] | None = None,
         initargs: Iterable[Any] = (),
         maxtasksperchild: int | None = None) -> multiprocessing.pool.Pool:
    return get_context().Pool(processes, initializer, initargs, maxtasksperchild)


for _f in (Queue, JoinableQueue, SimpleQueue, Pipe, Pool):
    _f.__doc__ = getattr(_Channels, _f.__name__).__doc__

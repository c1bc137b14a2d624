"""Contexts for fork, spawn and forkserver whose channels, pools and processes are sharedmp's.

Each is the standard context of its start method with Queue, JoinableQueue,
SimpleQueue, Pipe, Pool and Process replaced (a child starts with the parent's
sharing strategy and, on Linux, dies with its parent: ``processes/pdeath.py``), so it
works wherever a ``multiprocessing`` context does (``ProcessPoolExecutor(mp_context=...)``,
``DataLoader(multiprocessing_context=...)``).
"""
import multiprocessing
import multiprocessing.context as _std
import multiprocessing.pool

from .. import cuda as _cuda
from .. import strategy
from ..errors import ManagerError
from ..memory import manager
from ..processes.pdeath import DieWithParent


class _CarryStrategy:
    """Process mixin: the child starts with the parent's sharing strategy and manager daemon.

    The environment already carries both to spawn and fork children; a forkserver started
    before ``set_sharing_strategy`` would not, so the Process object carries them too.
    Under file_system the parent connects to the daemon first: the segments its children
    send it then outlive the children (a daemon with no client left would unlink them).
    """

    def start(self):
        self._sharedmp_strategy = strategy.get_sharing_strategy()
        self._sharedmp_manager = None
        if self._sharedmp_strategy == "file_system":
            try:
                self._sharedmp_manager = manager.address()
            except ManagerError:
                pass                  # the child says so if it ever needs the daemon
        super().start()

    def __getstate__(self):
        # (spawn, forkserver) The daemon first: the arguments may name segments, which the
        # child attaches while it unpickles them, before _bootstrap (a forkserver child's
        # environment is the fork server's, which may predate the daemon or name another).
        state = dict(self.__dict__)
        path = state.get("_sharedmp_manager")
        return {"_sharedmp_adopted": _Adopt(path), **state} if path else state

    def _bootstrap(self, *args, **kwargs):
        name = getattr(self, "_sharedmp_strategy", None)   # None: start() was overridden
        if name is not None:
            strategy.set_sharing_strategy(name)
            manager.adopt(self._sharedmp_manager)
        return super()._bootstrap(*args, **kwargs)


class _Adopt:
    """Unpickled as ``manager.adopt(path)``, before what follows it in the same pickle."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return manager.adopt, (self.path,)


class ForkProcess(DieWithParent, _CarryStrategy, _std.ForkProcess):
    def start(self):
        _cuda.check_fork()            # a forked child of a CUDA process cannot use CUDA
        super().start()


class SpawnProcess(DieWithParent, _CarryStrategy, _std.SpawnProcess):
    pass


class ForkServerProcess(DieWithParent, _CarryStrategy, _std.ForkServerProcess):
    pass


class Process(DieWithParent, _CarryStrategy, _std.Process):
    """``mp.Process``: multiprocessing.Process of the default start method (resolved at
    ``start()``, as the standard one is), whose child starts with this process's sharing
    strategy and dies with it, as those of sharedmp's contexts do. Subclasses too."""

    def start(self):
        if multiprocessing.get_start_method() == "fork":
            _cuda.check_fork()
        super().start()


class _Channels:
    """The factories that differ from the standard context's."""

    def Queue(self, maxsize=0):
        """A queue whose messages carry the fds of their arrays."""
        from .queues import Queue
        return Queue(maxsize, ctx=self)

    def JoinableQueue(self, maxsize=0):
        """A Queue with task_done() and join()."""
        from .queues import JoinableQueue
        return JoinableQueue(maxsize, ctx=self)

    def SimpleQueue(self):
        """A synchronous queue (put() returns once the message is in the kernel)."""
        from .queues import SimpleQueue
        return SimpleQueue(ctx=self)

    def Pipe(self, duplex=True):
        """Two Connections over an AF_UNIX socketpair."""
        from .connection import Pipe
        return Pipe(duplex)

    def Pool(self, processes=None, initializer=None, initargs=(), maxtasksperchild=None):
        """multiprocessing.pool.Pool whose task and result queues are sharedmp's."""
        return multiprocessing.pool.Pool(processes, initializer, initargs, maxtasksperchild,
                                         context=self)

    def get_context(self, method=None):
        return self if method is None else get_context(method)


class ForkContext(_Channels, _std.ForkContext):
    Process = ForkProcess


class SpawnContext(_Channels, _std.SpawnContext):
    Process = SpawnProcess


class ForkServerContext(_Channels, _std.ForkServerContext):
    Process = ForkServerProcess


_contexts = {"fork": ForkContext(), "spawn": SpawnContext(), "forkserver": ForkServerContext()}


def get_context(method=None):
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
def Queue(maxsize=0):
    return get_context().Queue(maxsize)


def JoinableQueue(maxsize=0):
    return get_context().JoinableQueue(maxsize)


def SimpleQueue():
    return get_context().SimpleQueue()


def Pipe(duplex=True):
    return get_context().Pipe(duplex)


def Pool(processes=None, initializer=None, initargs=(), maxtasksperchild=None):
    return get_context().Pool(processes, initializer, initargs, maxtasksperchild)


for _f in (Queue, JoinableQueue, SimpleQueue, Pipe, Pool):
    _f.__doc__ = getattr(_Channels, _f.__name__).__doc__

"""joblib backend ``"sharedmp"``: ``Parallel`` moves arrays and tensors as shared memory.

``import sharedmp.joblib`` registers it; then ``with joblib.parallel_config(backend="sharedmp"):``
runs ``Parallel`` (and scikit-learn's ``n_jobs``) on a sharedmp Pool.

Why a backend of its own: joblib's default backend, loky, pickles tasks and results with
its own cloudpickle-based pickler, whose dispatch table is copyreg's plus loky's, so the
reducers sharedmp registers with ``ForkingPickler`` never run there. An array argument
arrives as a private copy, or, above ``max_nbytes``, as a read-only memmap of a file the
parent dumped; torch tensors go by value; results come back as bytes. Here the pool is a
``multiprocessing.pool.Pool`` on a sharedmp context: tasks and results are pickled by
``ForkingPickler`` on sharedmp channels, and each array travels as an fd in the same
socket message (``channels/fdpass.py``).

What a worker gets (docs/API.md, section 5), both ways:

- an array already shared (``mp.zeros``, ``mp.share``, received): the same memory, no
  copy; the worker's in-place writes are the parent's;
- a torch CPU tensor not yet shared: moved into shared memory in place in the parent when
  its task is sent (every view of its storage follows), then as above;
- a NumPy array not yet shared, passed as an argument (or an item of a list, tuple or dict
  argument) and larger than joblib's ``max_nbytes`` (1 MiB by default): copied once per
  ``Parallel`` call into shared memory, every task of the call gets that one copy,
  read-only unless ``mmap_mode`` is "r+" or "w+" (as joblib's memmaps of such arrays are);
  the parent's array is not shared and never sees the workers' writes. Like joblib, the
  copy is made once per array object: change the array during the call and later tasks
  may get the old values. Use ``mp.share(a)`` first to share it with the workers both ways;
- any other NumPy array (smaller, deeper in an argument, ``max_nbytes=None`` or
  ``mmap_mode="c"``): copied into shared memory per message that carries it (one writable
  copy per batch of tasks);
- a returned array: shared, in the parent, without a copy after the worker's own.

Behaviour otherwise as joblib's ``"multiprocessing"`` backend, of which this is a subclass:
``n_jobs`` (-1: every CPU joblib counts; 1: in-process), auto-batching, errors re-raised in
the parent with the worker's traceback, nested calls inside a worker run sequentially
(daemonic workers). Functions pickle by reference, as there (no lambdas: loky's cloudpickle
takes those), and the workers' BLAS/OpenMP threads are not capped as loky caps them. Tested
with joblib 1.3-1.6.

The pool stays warm, as loky's reusable executor does: when a call ends (or a ``with
Parallel(...) as parallel:`` block of several), only its copies of arrays go; its workers
wait for the next call, which reuses them if it asks for the same pool (number of workers,
start method, sharing strategy, ``initializer``, ``initargs``, ``maxtasksperchild``);
otherwise the old pool is terminated and a new one started. One pool is kept per process
(a forked child starts without it); a call that finds it lent to another call still running
(another thread) starts its own. The pool is terminated, its workers joined,

- once unused for ``idle_worker_timeout`` seconds (loky's keyword; default
  ``$SHAREDMP_JOBLIB_IDLE``, else 300, loky's default; 0: a pool per call, ended with it);
- by ``mp.empty_cache()`` or ``release_pool()``; at interpreter exit;
- when joblib aborts a call (a task raised, ``timeout`` expired, Ctrl-C): its workers may
  still run the call's other tasks; the next call (or the rest of the ``with`` block)
  gets a new pool;
- when one of its workers has died (killed, crashed) since the pool was started;
- under fork, when ``__main__`` (a script, a notebook) has changed since: a function or
  class defined or redefined there, or a global that one of its functions reads rebound
  (its workers know ``__main__`` as it was when they forked).

``python -m sharedmp doctor`` lists the warm pool of each process ("joblib-pool").
What else a forked worker keeps from its fork, a warm pool does not notice: an object
changed in place (``data[:] = ...``, ``config["k"] = v``), the state of other modules,
environment variables. (loky sends a ``__main__`` function's globals by value with each
call: it sees the first, not the others.) ``release_pool()`` makes the next call fork
afresh.

The start method is joblib's for that backend (``$JOBLIB_START_METHOD``, else
multiprocessing's default: fork on Linux before Python 3.14, forkserver from 3.14):
fork starts a pool in milliseconds and runs functions defined in ``__main__`` or a notebook.
``parallel_config(backend="sharedmp", start_method="spawn")`` chooses another, as workers
that use CUDA need (a forked child of a process that has initialised CUDA cannot use it).
"""
from __future__ import annotations

import atexit
import sys
import threading
import time
import types
import weakref
from typing import Any, Callable, Iterable

import numpy as np

try:
    import joblib
    from joblib._parallel_backends import FallbackToBackend, MultiprocessingBackend
    from joblib._parallel_backends import SequentialBackend
    from joblib.disk import memstr_to_bytes
except ImportError as e:
    raise ImportError("sharedmp.joblib needs joblib: pip install 'sharedmp[joblib]'") from e

from . import _compat, forks, settings
from . import strategy as _strategy
from .memory import cache as _cache
from .memory import views as _views
from .processes import context as _context

__all__ = ["BACKEND_NAME", "SharedmpBackend", "register", "release_pool"]

BACKEND_NAME = "sharedmp"
IDLE_ENV = settings.JOBLIB_IDLE    # default 300 s: loky's idle_worker_timeout
# sharedmp's context of a start method (None: multiprocessing's current one).
_get_context: Callable[[str | None], Any] = _context.get_context

# Parallel hands every backend joblib's memmapping options: max_nbytes and mmap_mode say
# which unshared arrays are copied once per call, and read-only (``_share``); no file is
# dumped, so temp_folder and prewarm mean nothing here, nor does verbose.
_MEMMAPPING_OPTIONS = frozenset({"max_nbytes", "temp_folder", "mmap_mode", "verbose", "prewarm"})
# What else goes on to multiprocessing.pool.Pool.
_POOL_OPTIONS = frozenset({"initializer", "initargs", "maxtasksperchild"})
_IDLE_OPTION = "idle_worker_timeout"


class SharedmpBackend(MultiprocessingBackend):  # type: ignore[misc]  # joblib has no types
    """joblib's multiprocessing backend on a sharedmp Pool (see the module's docstring).

    ``start_method``: "fork", "spawn" or "forkserver"; None: joblib's choice (the context
    ``Parallel`` passes). ``idle_worker_timeout``: seconds the pool is kept warm after a call
    (None: ``$SHAREDMP_JOBLIB_IDLE``, else 300; 0: a pool per call). ``initializer``,
    ``initargs``, ``maxtasksperchild``: as for ``multiprocessing.Pool``. Each may also be given
    as a ``Parallel(...)`` keyword.
    """

    def __init__(self, nesting_level: int | None = None, inner_max_num_threads: int | None = None,
                 start_method: str | None = None, idle_worker_timeout: float | None = None,
                 **pool_options: Any) -> None:
        if start_method is not None:
            _get_context(start_method)           # an unknown method fails here
        _check_options(pool_options)
        if idle_worker_timeout is not None:
            _idle_timeout(idle_worker_timeout)   # and a bad timeout here
        super().__init__(nesting_level=nesting_level, inner_max_num_threads=inner_max_num_threads)
        self.start_method = start_method
        self.idle_worker_timeout = idle_worker_timeout
        self.pool_options = pool_options
        self._lent: _Lent | None = None        # the pool this backend has, for its calls
        self._aborting = False
        self._max_nbytes: int | None = None
        self._readonly = True
        # id(array) -> (array, its shared copy), for the Parallel call under way.
        self._copies: dict[int, tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]] = {}
        self._copies_lock = threading.Lock()

    def configure(self, n_jobs: int = 1, parallel: Any = None, prefer: str | None = None,
                  require: str | None = None, context: Any = None, **options: Any) -> int:
        """Take the warm pool of ``effective_n_jobs(n_jobs)`` workers, or start one; the number
        of workers."""
        n_jobs = self.effective_n_jobs(n_jobs)
        if n_jobs == 1:
            raise FallbackToBackend(SequentialBackend(nesting_level=self.nesting_level))
        options = {**self.pool_options, **options}
        idle = _idle_timeout(options.pop(_IDLE_OPTION, self.idle_worker_timeout))
        _check_options(options)
        pool_options = {k: v for k, v in options.items() if k in _POOL_OPTIONS}
        max_nbytes = options.get("max_nbytes", "1M")          # joblib's default
        if isinstance(max_nbytes, str):
            max_nbytes = memstr_to_bytes(max_nbytes)
        mmap_mode = options.get("mmap_mode", "r")
        self._max_nbytes = None if max_nbytes is None or mmap_mode == "c" else int(max_nbytes)
        self._readonly = mmap_mode not in ("r+", "w+")
        ctx = self._context(context)
        key = (n_jobs, ctx.get_start_method(), _strategy.get_sharing_strategy(),
               pool_options.get("initializer"), tuple(pool_options.get("initargs", ())),
               pool_options.get("maxtasksperchild"))
        if self._lent is not None:            # configured again without terminate()
            _give_back(self._lent)
        # (joblib's multiprocessing backend runs gc.collect() here, "to free memory before
        # forking": a slow call once torch and scikit-learn are imported. Not done.)
        self._lent = _take(key) or _Lent(ctx.Pool(n_jobs, **pool_options), key)
        self._lent.idle = idle
        self._pool = self._lent.pool
        self.parallel = parallel
        return n_jobs

    def submit(self, func: Any, callback: Any = None) -> Any:
        """Schedule ``func`` (a batch of tasks), its large unshared arrays replaced first."""
        self._prepare(func)
        return super().submit(func, callback=callback)

    def apply_async(self, func: Any, callback: Any = None) -> Any:
        """``submit`` of joblib < 1.5 (which calls this instead)."""
        self._prepare(func)
        return super().apply_async(func, callback=callback)

    def _prepare(self, func: Any) -> None:
        items = getattr(func, "items", None)             # a joblib BatchedCalls
        if self._max_nbytes is not None and type(items) is list:
            func.items = [(f, self._share(args, 0), self._share(kwargs, 0))
                          for f, args, kwargs in items]

    def _share(self, obj: Any, depth: int) -> Any:
        """``obj`` with each plain NumPy array above max_nbytes (down to depth 2) replaced by
        its copy for this call; ``obj`` itself if there is none."""
        kind = type(obj)
        if kind is np.ndarray:
            limit = self._max_nbytes
            if (limit is None or obj.nbytes <= limit or obj.dtype.hasobject
                    or _views.mapping_of(obj)[1] is not None):
                return obj
            with self._copies_lock:
                held = self._copies.get(id(obj))
                if held is None or held[0] is not obj:
                    copy = _views.copy_to_shared(obj)
                    if self._readonly:
                        copy.flags.writeable = False
                    held = self._copies[id(obj)] = (obj, copy)
            return held[1]
        if depth < 2 and (kind is tuple or kind is list):
            new = [self._share(x, depth + 1) for x in obj]
            return obj if all(a is b for a, b in zip(new, obj)) else kind(new)
        if depth < 2 and kind is dict:
            pairs = {k: self._share(v, depth + 1) for k, v in obj.items()}
            return obj if all(pairs[k] is v for k, v in obj.items()) else pairs
        return obj

    def stop_call(self) -> None:
        """The call has ended: its copies of unshared arrays go (the workers have theirs)."""
        with self._copies_lock:
            self._copies.clear()
        super().stop_call()

    def terminate(self) -> None:
        """The end of a call, or of a ``with Parallel(...)`` block: the pool is kept warm for
        the next (unless aborted, or its idle timeout is 0); this call's copies of arrays go."""
        lent, self._lent, self._pool = self._lent, None, None
        if lent is not None:
            if self._aborting:
                _end(lent)
            else:
                _give_back(lent)
        self.reset_batch_stats()
        with self._copies_lock:
            self._copies.clear()

    def abort_everything(self, ensure_ready: bool = True) -> None:
        """joblib gives up on the call (a task raised, the timeout expired, Ctrl-C): its other
        tasks may still be running, so the pool is terminated, never kept; with ``ensure_ready``
        (a ``with Parallel`` block) joblib's code then configures a new one."""
        self._aborting = True
        try:
            super().abort_everything(ensure_ready=ensure_ready)
        finally:
            self._aborting = False

    def _context(self, given: Any) -> Any:
        """sharedmp's context: of ``start_method``, else of the start method of ``given``."""
        if self.start_method is not None:
            return _get_context(self.start_method)
        if isinstance(given, _context._Channels):
            return given
        method = given.get_start_method() if given is not None else None
        return _get_context(method)


def _check_options(options: Iterable[str]) -> None:
    unknown = sorted(set(options) - _MEMMAPPING_OPTIONS - _POOL_OPTIONS - {_IDLE_OPTION})
    if unknown:
        raise TypeError(f"the sharedmp joblib backend does not take {', '.join(unknown)} "
                        f"(it takes start_method, {_IDLE_OPTION}, "
                        f"{', '.join(sorted(_POOL_OPTIONS))})")


def _idle_timeout(value: Any) -> float:
    """Seconds a pool is kept warm: ``value``, else $SHAREDMP_JOBLIB_IDLE, else 300."""
    if value is None:
        return float(settings.get(IDLE_ENV))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{_IDLE_OPTION} must be a number of seconds >= 0 (0: no warm pool, "
                         f"a pool per Parallel call), not {value!r}")
    return float(value)


# -- the warm pool ---------------------------------------------------------------------------

class _Lent:
    """A pool, lent to one backend (for its calls) at a time, kept warm between them."""

    def __init__(self, pool: Any, key: tuple[Any, ...]) -> None:
        self.pool = pool
        self.key = key
        self.workers = _compat.pool_workers(pool)   # a dead one has an exit code
        self.idle = settings.VARIABLES[IDLE_ENV].default
        self.since = time.monotonic()       # when it was given back
        # Forked workers know __main__ as it was now: see _main_state.
        self.main = _main_state() if key[1] == "fork" else None

    def healthy(self) -> bool:
        """Running, none of its workers died other than by maxtasksperchild (exit 0), and
        (forked) what its workers know of ``__main__`` is still so."""
        return (_compat.pool_running(self.pool)
                and all(p.exitcode in (None, 0) for p in self.workers)
                and (self.main is None or _same_main(self.main)))

    def fits(self, key: tuple[Any, ...]) -> bool:
        try:
            return bool(self.key == key)
        except Exception:                    # initargs holding arrays: == is elementwise
            return False


def _main_objects() -> dict[str, Any]:
    """The functions and classes defined in ``__main__`` (a script, a notebook) and the
    globals those functions read: what a worker forked earlier may know out of date. (A
    function defined since is unknown there: its task would kill the worker and the call
    wait for ever; one redefined, or a global rebound, would run as it was.)"""
    space = getattr(sys.modules.get("__main__"), "__dict__", None) or {}
    found = {}
    for name, value in list(space.items()):
        if (isinstance(value, (types.FunctionType, type))
                and getattr(value, "__module__", None) == "__main__"):
            found[name] = value
            for used in getattr(getattr(value, "__code__", None), "co_names", ()):
                if used in space:
                    found[used] = space[used]
    return found


def _main_state() -> dict[str, Any]:
    """``_main_objects`` as weak references (type and id where there can be none), so that
    a warm pool keeps no global of the user's alive."""
    state: dict[str, Any] = {}
    for name, value in _main_objects().items():
        try:
            state[name] = weakref.ref(value)
        except TypeError:                    # ints, strings, lists, dicts...
            state[name] = (type(value), id(value))
    return state


def _same_main(state: dict[str, Any]) -> bool:
    now = _main_objects()
    return now.keys() == state.keys() and all(
        state[name]() is value if isinstance(state[name], weakref.ref)
        else state[name] == (type(value), id(value)) for name, value in now.items())


_lock = threading.Lock()
_warm: _Lent | None = None                  # the pool kept for the next call, unused now


def _take(key: tuple[Any, ...]) -> _Lent | None:
    """The warm pool, out of the slot, if it fits ``key`` and is healthy; else None (and
    the warm pool, if any, is terminated)."""
    global _warm
    with _lock:
        lent, _warm = _warm, None
    if lent is None:
        return None
    if lent.fits(key) and lent.healthy():
        return lent
    _end(lent)
    return None


def _give_back(lent: _Lent) -> None:
    """Keep ``lent`` warm for the next call (the pool kept before, if any, is terminated),
    or terminate it (idle timeout 0, or a worker died)."""
    global _warm
    old: _Lent | None = lent
    if lent.idle > 0 and lent.healthy():
        lent.workers = _compat.pool_workers(lent.pool)  # (maxtasksperchild replaces workers)
        lent.since = time.monotonic()
        with _lock:
            old, _warm = _warm, lent
        _cache.start(thread=True)            # its thread lets the pool go once idle
    if old is not None:
        _end(old)


def _end(lent: _Lent) -> None:
    # Pool.terminate: SIGTERM to the workers, joined, as are the pool's threads.
    lent.pool.terminate()


def release_pool() -> None:
    """Terminate the warm pool now, its workers joined (``mp.empty_cache()`` does it too; a
    later ``Parallel`` call starts a new pool). A pool lent to a call under way stays."""
    _expire(None)


def _expire(cutoff: float | None) -> bool:
    """(cache) Terminate the warm pool if ``cutoff`` is None or it has been idle for its
    timeout; whether one is still kept."""
    global _warm
    with _lock:
        lent = _warm
        if lent is None:
            return False
        if cutoff is not None and time.monotonic() - lent.since < lent.idle:
            return True
        _warm = None
    _end(lent)
    return False


def _held() -> tuple[int, int]:
    return 0, 0                              # processes, not memory


def _processes() -> dict[str, Any] | None:
    lent = _warm
    if lent is None:
        return None
    return {"pids": [p.pid for p in lent.workers], "idle_s": lent.idle}


# (a thread of its own: a lazy pass could run in the pool's own handler thread, which
# terminate() joins; the pool runs threads anyway)
_cache.register(4, "joblib-pool", _expire, _held, _processes, thread=True)
atexit.register(release_pool)               # before multiprocessing's own exit handler


@forks.in_child
def _after_fork_in_child() -> None:
    # The pool's workers and threads are the parent's: a forked child never uses them.
    global _warm
    _warm = None


forks.renew_locks(globals(), "_lock")


def register(name: str = BACKEND_NAME, make_default: bool = False) -> None:
    """Register the backend with joblib as ``name`` (done on import as "sharedmp")."""
    factory: Callable[..., SharedmpBackend] = SharedmpBackend
    joblib.register_parallel_backend(name, factory, make_default=make_default)


register()

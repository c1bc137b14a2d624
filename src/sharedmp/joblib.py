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
(daemonic workers), one pool per ``Parallel`` call, terminated (workers joined) when the
call ends, or when ``with Parallel(...) as parallel:`` ends for several calls. Functions
pickle by reference, as there (no lambdas: loky's cloudpickle takes those), and the
workers' BLAS/OpenMP threads are not capped as loky caps them. Tested with joblib 1.3-1.6.
The start method is joblib's for that backend (``$JOBLIB_START_METHOD``, else
multiprocessing's default: fork on Linux before Python 3.14, forkserver from 3.14):
fork starts a pool in milliseconds and runs functions defined in ``__main__`` or a notebook.
``parallel_config(backend="sharedmp", start_method="spawn")`` chooses another, as a process
that has initialised CUDA must (sharedmp refuses to fork it).
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Iterable

import numpy as np

try:
    import joblib
    from joblib._parallel_backends import FallbackToBackend, MultiprocessingBackend
    from joblib._parallel_backends import SequentialBackend
    from joblib.disk import memstr_to_bytes
except ImportError as e:
    raise ImportError("sharedmp.joblib needs joblib: pip install 'sharedmp[joblib]'") from e

from .memory import views as _views
from .channels import context as _context

__all__ = ["BACKEND_NAME", "SharedmpBackend", "register"]

BACKEND_NAME = "sharedmp"
# sharedmp's context of a start method (None: multiprocessing's current one).
_get_context: Callable[[str | None], Any] = _context.get_context

# Parallel hands every backend joblib's memmapping options: max_nbytes and mmap_mode say
# which unshared arrays are copied once per call, and read-only (``_share``); no file is
# dumped, so temp_folder and prewarm mean nothing here, nor does verbose.
_MEMMAPPING_OPTIONS = frozenset({"max_nbytes", "temp_folder", "mmap_mode", "verbose", "prewarm"})
# What else goes on to multiprocessing.pool.Pool.
_POOL_OPTIONS = frozenset({"initializer", "initargs", "maxtasksperchild"})


class SharedmpBackend(MultiprocessingBackend):  # type: ignore[misc]  # joblib has no types
    """joblib's multiprocessing backend on a sharedmp Pool (see the module's docstring).

    ``start_method``: "fork", "spawn" or "forkserver"; None: joblib's choice (the context
    ``Parallel`` passes). ``initializer``, ``initargs``, ``maxtasksperchild``: as for
    ``multiprocessing.Pool``, given here or as ``Parallel(...)`` keywords.
    """

    def __init__(self, nesting_level: int | None = None, inner_max_num_threads: int | None = None,
                 start_method: str | None = None, **pool_options: Any) -> None:
        if start_method is not None:
            _get_context(start_method)           # an unknown method fails here
        _check_options(pool_options)
        super().__init__(nesting_level=nesting_level, inner_max_num_threads=inner_max_num_threads)
        self.start_method = start_method
        self.pool_options = pool_options
        self._max_nbytes: int | None = None
        self._readonly = True
        # id(array) -> (array, its shared copy), for the Parallel call under way.
        self._copies: dict[int, tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]] = {}
        self._copies_lock = threading.Lock()

    def configure(self, n_jobs: int = 1, parallel: Any = None, prefer: str | None = None,
                  require: str | None = None, context: Any = None, **options: Any) -> int:
        """Start the pool of ``effective_n_jobs(n_jobs)`` workers; the number of workers."""
        n_jobs = self.effective_n_jobs(n_jobs)
        if n_jobs == 1:
            raise FallbackToBackend(SequentialBackend(nesting_level=self.nesting_level))
        options = {**self.pool_options, **options}
        _check_options(options)
        pool_options = {k: v for k, v in options.items() if k in _POOL_OPTIONS}
        max_nbytes = options.get("max_nbytes", "1M")          # joblib's default
        if isinstance(max_nbytes, str):
            max_nbytes = memstr_to_bytes(max_nbytes)
        mmap_mode = options.get("mmap_mode", "r")
        self._max_nbytes = None if max_nbytes is None or mmap_mode == "c" else int(max_nbytes)
        self._readonly = mmap_mode not in ("r+", "w+")
        ctx = self._context(context)
        # (joblib's multiprocessing backend runs gc.collect() here, "to free memory before
        # forking": a slow call once torch and scikit-learn are imported. Not done.)
        self._pool = ctx.Pool(n_jobs, **pool_options)
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
        super().terminate()
        with self._copies_lock:
            self._copies.clear()

    def _context(self, given: Any) -> Any:
        """sharedmp's context: of ``start_method``, else of the start method of ``given``."""
        if self.start_method is not None:
            return _get_context(self.start_method)
        if isinstance(given, _context._Channels):
            return given
        method = given.get_start_method() if given is not None else None
        return _get_context(method)


def _check_options(options: Iterable[str]) -> None:
    unknown = sorted(set(options) - _MEMMAPPING_OPTIONS - _POOL_OPTIONS)
    if unknown:
        raise TypeError(f"the sharedmp joblib backend does not take {', '.join(unknown)} "
                        f"(it takes start_method, {', '.join(sorted(_POOL_OPTIONS))})")


def register(name: str = BACKEND_NAME, make_default: bool = False) -> None:
    """Register the backend with joblib as ``name`` (done on import as "sharedmp")."""
    factory: Callable[..., SharedmpBackend] = SharedmpBackend
    joblib.register_parallel_backend(name, factory, make_default=make_default)


register()

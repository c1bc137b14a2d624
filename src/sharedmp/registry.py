"""Every reducer sharedmp installs is registered from here; ``install()`` runs once, on import.

Where each one is named:

- ``REDUCERS``: sharedmp's own classes (``Segment``, ``Connection``), registered at once;
- ``_install_numpy`` and ``_install_torch``: NumPy's ndarray and torch's tensors, storages
  and the rest (``reductions/torch/tensors.py``), each with its frame kind (``LAZY_FRAMES``)
  and, for torch, the patch of torch's own functions; each a function of its own, since their
  installation is more than a list of reducers (see below);
- ``_LIBRARIES``: the other libraries whose classes exist only once they are imported (CuPy,
  Polars, pyarrow, pandas), one entry each (module, its name in warnings, a function giving
  its ``(class, reducer)`` pairs), registered by ``_register`` once the module is imported.

A library whose reducers fail to register warns once and keeps its own pickling: sharedmp
never breaks its import.

Reducers go into ``multiprocessing.reduction.ForkingPickler``, which sharedmp's channels
use and so do the standard ones (Process arguments under spawn and forkserver, Manager
connections): arrays travel through shared memory on both. Frame kinds (``wire``) let a
message of one array or tensor alone skip pickle.

NumPy, torch and CuPy are never imported by ``import sharedmp``, yet their arrays must go
through sharedmp once they are there, before any of them is sent or received. torch
registers its own reducers while it is imported (``torch.multiprocessing`` calls
``init_reductions()``), so sharedmp's must come after, whichever of the two is imported
first:

- already imported: install now;
- otherwise a finder at the front of ``sys.meta_path`` waits for the import, finds the
  module's spec with the other finders and wraps its loader, so that the installation runs
  right after the module has executed; then it steps aside (the module gets its own loader
  back, the finder leaves ``sys.meta_path``). Finding the spec alone
  (``importlib.util.find_spec``) installs nothing and leaves the finder waiting.

The torch reducers live in ``reductions/torch/``, whose package imports torch before any of
its modules runs: a pickle that names one of them imports torch first, which installs them.
The NumPy reducers live in ``reductions/ndarray.py``, which imports NumPy as it starts: a
pickle (or a frame, ``wire.lazy_frame_kind``) that needs it imports it, and NumPy with it,
in a process that had neither; the installation then waits for that module to be whole (a
second finder, on the module itself: see ``_when_numpy_is_imported``). Another sharedmp module
that imports NumPy as it starts, imported first, is half-made when NumPy is in: the reducers,
which may import it, are then installed on the first array pickled (``_reduce_ndarray_first``).
"""
from __future__ import annotations

import functools
import importlib
import sys
import warnings
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

from . import wire
from ._compat import EXTRA_REDUCERS
from .channels.connection import Connection, reduce_connection
from .memory.segment import Segment
from .reductions.segment import reduce_segment

# (class, reducer), installed when sharedmp is imported.
REDUCERS: list[tuple[type, Callable[[Any], Any]]] = [
    (Segment, reduce_segment),
    (Connection, reduce_connection),
]
# Frame kinds that a module registers once imported: (kind, module, what it needs).
NDARRAY_REDUCERS = "sharedmp.reductions.ndarray"
TORCH_REDUCERS = "sharedmp.reductions.torch.tensors"
LAZY_FRAMES = [(wire.FLAG_ARRAY, NDARRAY_REDUCERS, "numpy"),
               (wire.FLAG_TENSOR, TORCH_REDUCERS, "torch")]

_done = False
_numpy_done = False


def install() -> None:
    global _done
    if _done:
        return
    _done = True
    for cls, reducer in REDUCERS:
        ForkingPickler.register(cls, reducer)
    for kind, module, needs in LAZY_FRAMES:
        wire.lazy_frame_kind(kind, module, needs)
    _when_numpy_is_imported()
    _when_torch_is_imported(_install_torch)
    for module, library, reducers in _LIBRARIES:
        _when_imported(module, functools.partial(_register, library, reducers))


def _install_numpy() -> None:
    """The ndarray reducer and frame kind (runs once; NumPy is imported by now)."""
    global _numpy_done
    if _numpy_done:
        return
    # Never break `import numpy`: say why arrays are pickled by value instead.
    try:
        import numpy as np
        try:
            ndarray = importlib.import_module(NDARRAY_REDUCERS)
        except ImportError:
            if not _half_made():
                raise
            # NumPy came in from a sharedmp module still executing that the reducers import
            # (``import sharedmp.memory.views`` before NumPy): install them on first use.
            ForkingPickler.register(np.ndarray, _reduce_ndarray_first)
            wire.reducers_changed()
            return
        _numpy_done = True
        ForkingPickler.register(np.ndarray, ndarray.reduce_ndarray)
        wire.reducers_changed()
        wire.frame_kind(wire.FLAG_ARRAY, ndarray.decode_array,
                        {np.ndarray: ndarray.reduce_ndarray}, ndarray.encode_array)
    except Exception as e:
        _numpy_done = True
        warnings.warn(f"sharedmp: NumPy support is off, its reducers failed to register: {e!r}",
                      RuntimeWarning, stacklevel=2)


def _reduce_ndarray_first(a: Any) -> Any:
    """The ndarray reducer until the real one is installed (``_install_numpy``), by now."""
    _install_numpy()
    reducer = EXTRA_REDUCERS.get(type(a))
    if reducer is None or reducer is _reduce_ndarray_first:
        return a.__reduce_ex__(4)            # (NumPy support off, and said so): by value
    return reducer(a)


def _half_made() -> bool:
    """Whether a sharedmp module is being executed (imported, not yet whole)."""
    return any(name.startswith("sharedmp.") and _initializing(m)
               for name, m in list(sys.modules.items()))


def _numpy_imported() -> None:
    # NumPy imported by reductions/ndarray.py itself, as it starts (a pickle or a frame that
    # needs it, NumPy not yet in): installed once that module is whole, by its own finder.
    module = sys.modules.get(NDARRAY_REDUCERS)
    if module is None or not _initializing(module):
        _install_numpy()


def _when_numpy_is_imported() -> None:
    numpy = sys.modules.get("numpy")
    if numpy is not None and not _initializing(numpy):
        _install_numpy()
        return
    _when_imported("numpy", _numpy_imported)
    if NDARRAY_REDUCERS not in sys.modules:
        sys.meta_path.insert(0, _AfterImport(NDARRAY_REDUCERS, _install_numpy))


def _install_torch() -> None:
    # Never break `import torch`: say why tensors are torch's instead.
    try:
        tensors = importlib.import_module(TORCH_REDUCERS)
        from .reductions.torch import patch
        for cls, reducer in tensors.reducers():
            ForkingPickler.register(cls, reducer)
        wire.reducers_changed()          # ours replace torch's: same count, new table
        wire.frame_kind(wire.FLAG_TENSOR, *tensors.FRAME)
        patch.install()
    except Exception as e:
        warnings.warn(f"sharedmp: torch support is off, its reducers failed to register: {e!r}",
                      RuntimeWarning, stacklevel=2)


def _register(library: str, reducers: Callable[[], list[tuple[type, Callable[[Any], Any]]]]
              ) -> None:
    """Register ``reducers()`` (a library's classes, which exist only once it is imported).
    Never break the library's import: say why its objects are pickled its own way instead."""
    try:
        for cls, reducer in reducers():
            ForkingPickler.register(cls, reducer)
        wire.reducers_changed()
    except Exception as e:
        warnings.warn(f"sharedmp: {library} support is off, its reducers failed to register: "
                      f"{e!r}", RuntimeWarning, stacklevel=3)


def _cupy_reducers() -> list[tuple[type, Callable[[Any], Any]]]:
    # CuPy arrays go by CUDA IPC.
    import cupy

    from .reductions.cuda import reduce_cupy_array
    return [(cupy.ndarray, reduce_cupy_array)]


def _polars_reducers() -> list[tuple[type, Callable[[Any], Any]]]:
    # Polars frames through Arrow, whose buffers travel out of band (reductions/polars.py).
    import polars as pl

    from .reductions import polars
    return [(pl.DataFrame, polars.reduce_polars_frame), (pl.Series, polars.reduce_polars_series)]


def _arrow_reducers() -> list[tuple[type, Callable[[Any], Any]]]:
    # Arrow buffers in sharedmp memory travel as its handle (reductions/arrow.py).
    import pyarrow as pa

    from .reductions import arrow
    return [(pa.Buffer, arrow.reduce_arrow_buffer)]


def _pandas_reducers() -> list[tuple[type, Callable[[Any], Any]]]:
    # pandas' Arrow columns over sharedmp memory travel as their chunks (reductions/arrow.py).
    import pandas as pd

    from .reductions import arrow
    return [(cls, arrow.reduce_pandas_arrow) for cls in arrow.pandas_arrow_classes(pd)]


# (module, its name in warnings, its reducers): registered once the module is imported
_LIBRARIES = [("cupy", "CuPy", _cupy_reducers), ("polars", "Polars", _polars_reducers),
              ("pyarrow", "pyarrow", _arrow_reducers), ("pandas", "pandas", _pandas_reducers)]


def _initializing(module: Any) -> bool:
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _when_imported(name: str, then: Callable[[], None]) -> None:
    module = sys.modules.get(name)
    if module is None:
        sys.meta_path.insert(0, _AfterImport(name, then))
    elif not _initializing(module):
        then()


def _when_torch_is_imported(then: Callable[[], None]) -> None:
    torch = sys.modules.get("torch")
    if torch is None or not _initializing(torch):
        _when_imported("torch", then)
        return
    # sharedmp imported from within torch's own import (a plugin of torch's):
    # torch.multiprocessing registers torch's reducers; wait for it if still to come.
    tmp = sys.modules.get("torch.multiprocessing")
    if tmp is None:
        sys.meta_path.insert(0, _AfterImport("torch.multiprocessing", then))
    elif not _initializing(tmp):
        then()


class _AfterImport:
    """A meta path finder that finds nothing itself: it wraps the loader of module ``name``.

    It stays on ``sys.meta_path`` until the module is executed, not merely found:
    ``importlib.util.find_spec("torch")`` (how libraries ask whether torch is installed)
    goes through this finder too, and its spec is thrown away."""

    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self.name = name
        self.then = then
        self.done = False

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        for finder in [f for f in sys.meta_path if f is not self]:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None                   # not installed (yet): keep waiting
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _RunAfter(spec.loader, self._imported)
        return spec

    def _imported(self) -> None:
        if self.done:
            return
        self.done = True
        if self in sys.meta_path:          # (not iterated now: the module has executed)
            sys.meta_path.remove(self)
        self.then()


class _RunAfter:
    """The module's own loader, then ``then``."""

    def __init__(self, loader: Any, then: Callable[[], None]) -> None:
        self.loader = loader
        self.then = then

    def __getattr__(self, name: str) -> Any:   # get_source, get_resource_reader, ...: the loader's
        return getattr(self.loader, name)

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        try:
            self.loader.exec_module(module)
        finally:
            if getattr(module, "__loader__", None) is self:
                module.__loader__ = self.loader
            spec = getattr(module, "__spec__", None)
            if spec is not None and spec.loader is self:
                spec.loader = self.loader
        self.then()


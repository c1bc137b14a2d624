"""What a value becomes on the wire. ``register()`` installs every reducer, once.

Reducers go into ``multiprocessing.reduction.ForkingPickler``, which sharedmp's
channels use and so do the standard ones (Process arguments under spawn and
forkserver, Manager connections): arrays travel through shared memory on both.

torch: ``import sharedmp`` never imports torch, yet tensors must go through sharedmp
once torch is there. torch registers its own reducers with ForkingPickler while it is
imported (``torch.multiprocessing`` calls ``init_reductions()``), so sharedmp's torch
reducers (``reductions/torch.py``) must be registered after that, whichever of the two
is imported first:

- torch already imported: register now;
- otherwise: a finder at the front of ``sys.meta_path`` waits for ``import torch``,
  finds torch's spec with the other finders, and wraps its loader so that the
  registration runs right after torch's module has executed; then it steps aside
  (torch gets its own loader back, the finder leaves ``sys.meta_path``).
"""
import sys
import warnings
from multiprocessing.reduction import ForkingPickler

import numpy as np

from ..memory.segment import Segment
from .ndarray import reduce_ndarray
from .segment import reduce_segment

_done = False


def register() -> None:
    global _done
    if _done:
        return
    ForkingPickler.register(Segment, reduce_segment)
    ForkingPickler.register(np.ndarray, reduce_ndarray)
    _register_torch_when_imported()
    _register_cupy_when_imported()
    _done = True


def _register_torch():
    # Importing reductions/torch.py registers its reducers (its last line). If that module
    # is what imports torch (a spawned child unpickling its first tensor), this runs while
    # it is half-imported: the import below then returns it as it is, and it registers
    # itself once torch is in.
    try:
        import importlib
        importlib.import_module(__name__ + ".torch")
    except Exception as e:  # never break `import torch`; say why tensors are torch's
        warnings.warn(f"sharedmp: torch support is off, its reducers failed to register: {e!r}",
                      RuntimeWarning, stacklevel=2)


def _register_torch_when_imported():
    torch = sys.modules.get("torch")
    if torch is None:
        sys.meta_path.insert(0, _AfterImport("torch"))
    elif not getattr(getattr(torch, "__spec__", None), "_initializing", False):
        _register_torch()
    else:
        # sharedmp imported from within torch's own import (a plugin of torch's):
        # torch.multiprocessing registers torch's reducers; wait for it if still to come.
        tmp = sys.modules.get("torch.multiprocessing")
        if tmp is not None and not getattr(getattr(tmp, "__spec__", None), "_initializing", False):
            _register_torch()
        elif tmp is None:
            sys.meta_path.insert(0, _AfterImport("torch.multiprocessing"))


def _register_cupy():
    # CuPy arrays go by CUDA IPC (reductions/cuda.py); cupy.ndarray exists only once CuPy is in.
    try:
        from .cuda import register_cupy
        register_cupy()
    except Exception as e:
        warnings.warn(f"sharedmp: CuPy support is off, its reducer failed to register: {e!r}",
                      RuntimeWarning, stacklevel=2)


def _register_cupy_when_imported():
    cupy = sys.modules.get("cupy")
    if cupy is None:
        sys.meta_path.insert(0, _AfterImport("cupy", _register_cupy))
    elif not getattr(getattr(cupy, "__spec__", None), "_initializing", False):
        _register_cupy()


class _AfterImport:
    """A meta path finder that finds nothing itself: it wraps the loader of module ``name``."""

    def __init__(self, name, then=None):
        self.name = name
        self.then = then or _register_torch

    def find_spec(self, fullname, path=None, target=None):
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
        # Leave only now: removing ourselves while the import system iterates sys.meta_path
        # is safe because we return a spec, which ends its iteration.
        sys.meta_path.remove(self)
        spec.loader = _RegisterAfter(spec.loader, self.then)
        return spec


class _RegisterAfter:
    """The module's own loader, then sharedmp's registration for it (``then``)."""

    def __init__(self, loader, then=None):
        self.loader = loader
        self.then = then or _register_torch

    def __getattr__(self, name):          # get_source, get_resource_reader, ... are the loader's
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        try:
            self.loader.exec_module(module)
        finally:
            if getattr(module, "__loader__", None) is self:
                module.__loader__ = self.loader
            spec = getattr(module, "__spec__", None)
            if spec is not None and spec.loader is self:
                spec.loader = self.loader
        self.then()

"""NumPy arrays in shared memory: allocation, ``share``, ``is_shared``, ``share_memory_``.

torch objects are handed to ``sharedmp.reductions.torch.sharing`` (imported only once torch
is: ``_torch_of`` never imports it). What a view's shared memory is, and the copy made of an
array that is not shared, are ``memory/views.py``'s.
"""
from __future__ import annotations

import math
import operator
import sys
from typing import (
    TYPE_CHECKING, Any, Literal, Protocol, Sequence, SupportsIndex, TypeVar, Union, overload)

import numpy as np

from .memory import arena
from .memory.views import copy_to_shared, mapping_of
from .strategy import get_sharing_strategy

if TYPE_CHECKING:
    import torch
    from numpy.typing import ArrayLike, DTypeLike, NDArray

    _TorchObject = Union[torch.Tensor, torch.UntypedStorage, torch.TypedStorage, torch.nn.Module,
                         torch.optim.Optimizer]

    class _TorchReductions(Protocol):
        """What arrays.py uses of ``sharedmp.reductions.torch.sharing`` (a module)."""
        def share_memory_(self, obj: _TorchT) -> _TorchT: ...
        def is_shared(self, obj: object) -> bool: ...

ShapeLike = Union[SupportsIndex, Sequence[SupportsIndex]]
_ArrayT = TypeVar("_ArrayT", bound="np.ndarray[Any, Any]")
_TorchT = TypeVar("_TorchT", bound="_TorchObject")


def _shape(shape: Any) -> tuple[int, ...]:
    # The common cases first, without generators: this runs for every array allocated.
    if type(shape) is int and shape >= 0:
        return (shape,)
    if type(shape) is tuple:
        for n in shape:
            if type(n) is not int or n < 0:
                break
        else:
            return shape
    if isinstance(shape, int):
        shape = (shape,)
    elif type(shape) is not tuple or not all(type(n) is int for n in shape):
        shape = (shape,) if np.ndim(shape) == 0 else tuple(shape)
        shape = tuple(operator.index(n) for n in shape)
    if any(n < 0 for n in shape):
        raise ValueError(f"negative dimensions are not allowed: {shape}")
    return shape  # type: ignore[no-any-return]  # (a tuple of ints by now)


# a dtype argument seen before (float, "f4", np.float32, ...) -> its np.dtype
_checked: dict[Any, np.dtype[Any]] = {}


def _plain_dtype(dtype: DTypeLike | None) -> np.dtype[Any]:
    try:
        return _checked[dtype]
    except (KeyError, TypeError):      # TypeError: unhashable, e.g. a list of fields
        pass
    checked = np.dtype(dtype)
    if checked.hasobject:
        raise TypeError(f"dtype {checked} holds Python objects, which cannot live in shared "
                        "memory; use a numeric, bool, string or structured dtype without objects")
    if len(_checked) < 256:
        try:
            _checked[dtype] = checked
        except TypeError:
            pass
    return checked


def empty(shape: ShapeLike, dtype: DTypeLike = float,
          order: Literal["C", "F"] = "C") -> NDArray[Any]:
    """A shared array of ``shape`` and ``dtype``; its contents are zero (as ``zeros``:
    fresh memory is zero, and recycled memory is zeroed at about memset speed)."""
    return _new(shape, dtype, order, True)


def _new(shape: ShapeLike, dtype: DTypeLike | None, order: Literal["C", "F"],
         zero: bool) -> NDArray[Any]:
    shape, dtype = _shape(shape), _plain_dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    mapping, offset = arena.allocate(nbytes, get_sharing_strategy(), zero)
    a: NDArray[Any]              # (typed here: numpy's stubs make ndarray() Any on Python 3.10)
    if order == "C":             # (the default, passed on, slows the call down)
        a = np.ndarray(shape, dtype, buffer=mapping, offset=offset)
        return a
    a = np.ndarray(shape, dtype, buffer=mapping, offset=offset, order=order)
    return a


def zeros(shape: ShapeLike, dtype: DTypeLike = float,
          order: Literal["C", "F"] = "C") -> NDArray[Any]:
    """A shared array of zeros."""
    return empty(shape, dtype, order)


def full(shape: ShapeLike, fill_value: Any, dtype: DTypeLike | None = None,
         order: Literal["C", "F"] = "C") -> NDArray[Any]:
    """A shared array filled with ``fill_value``."""
    a = _new(shape, np.array(fill_value).dtype if dtype is None else dtype, order, False)
    a[...] = fill_value
    return a


def _torch_of(obj: object) -> _TorchReductions | None:
    """sharedmp's torch module if ``obj`` is a torch tensor, storage, module or optimizer."""
    torch = sys.modules.get("torch")
    if torch is None or isinstance(obj, np.ndarray):
        return None
    if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage,
                        torch.nn.Module, torch.optim.Optimizer)):
        from .reductions.torch import sharing
        return sharing
    return None


@overload
def empty_like(a: torch.Tensor, dtype: torch.dtype | None = None,
               shape: Sequence[int] | None = None) -> torch.Tensor: ...
@overload
def empty_like(a: ArrayLike, dtype: DTypeLike | None = None,
               shape: ShapeLike | None = None) -> NDArray[Any]: ...
def empty_like(a: Any, dtype: Any = None, shape: Any = None) -> Any:
    """A shared array with the shape and dtype of ``a`` (a torch tensor: a shared CPU tensor)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(a, torch.Tensor):
        from .reductions.torch import sharing
        return sharing.empty_like(a, dtype, shape)
    a = np.asarray(a)
    return empty(a.shape if shape is None else shape, a.dtype if dtype is None else dtype)


@overload
def zeros_like(a: torch.Tensor, dtype: torch.dtype | None = None,
               shape: Sequence[int] | None = None) -> torch.Tensor: ...
@overload
def zeros_like(a: ArrayLike, dtype: DTypeLike | None = None,
               shape: ShapeLike | None = None) -> NDArray[Any]: ...
def zeros_like(a: Any, dtype: Any = None, shape: Any = None) -> Any:
    """A shared array of zeros with the shape and dtype of ``a``."""
    return empty_like(a, dtype, shape)


@overload
def share(obj: _ArrayT) -> _ArrayT: ...
@overload
def share(obj: _TorchT) -> _TorchT: ...
def share(obj: Any) -> Any:
    """``obj`` in shared memory: a NumPy array is copied once (or returned if already shared);
    a torch tensor (storage, module, optimizer) moves in place, as ``share_memory_``, and is
    returned."""
    if isinstance(obj, np.ndarray):
        return obj if mapping_of(obj)[1] is not None else copy_to_shared(obj)
    t = _torch_of(obj)
    if t is not None:
        return t.share_memory_(obj)
    raise TypeError(f"mp.share() takes a NumPy array or a torch tensor, not {type(obj).__name__}")


def share_memory_(obj: _TorchT) -> _TorchT:
    """Move ``obj`` into shared memory in place: torch tensors, storages, modules (parameters,
    their ``.grad``, buffers) and optimizers (parameters and state, initialised eagerly)."""
    if isinstance(obj, np.ndarray):
        raise TypeError("a NumPy array cannot move into shared memory in place (its buffer is "
                        "fixed); use `a = mp.share(a)`, which returns a shared copy")
    t = _torch_of(obj)
    if t is not None:
        return t.share_memory_(obj)
    raise TypeError("mp.share_memory_() takes a torch tensor, storage, module or optimizer, "
                    f"not {type(obj).__name__}")


def is_shared(obj: object) -> bool:
    """Whether ``obj``'s memory is shared (sharedmp's, or torch's for tensors)."""
    if isinstance(obj, np.ndarray):
        return mapping_of(obj)[1] is not None
    t = _torch_of(obj)
    if t is not None:
        return t.is_shared(obj)
    method = getattr(obj, "is_shared", None)
    return bool(method()) if callable(method) else False

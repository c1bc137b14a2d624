"""NumPy views of shared memory: which segment a view's bytes lie in, and the shared copy
of an array whose bytes do not (what a reducer sends in its place).

Below the public NumPy API (``arrays.py``) and the reducers (``reductions/ndarray.py``),
which both use these.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..strategy import get_sharing_strategy
from . import arena, segment

if TYPE_CHECKING:
    from numpy.typing import NDArray

    from .segment import Segment


def mapping_of(a: NDArray[Any]) -> tuple[Any, Segment | None]:
    """(mapping, Segment) of the shared memory under ndarray ``a``, or (None, None)."""
    if a.base is None:                    # owns its memory (NumPy's heap): never shared
        return None, None
    seg = segment.segment_of(a.base)      # the usual case: a view of a lease or of a mapping
    if seg is not None:
        return a.base, seg
    root: Any = a
    for _ in range(1000):          # base chains are short; the bound only guards odd objects
        if isinstance(root, np.ndarray):
            # (numpy's stubs say .base is an ndarray or None; it is whatever the buffer was)
            if (type(root.base) is memoryview  # type: ignore[comparison-overlap, unused-ignore]
                    and segment.segment_of(root) is not None):
                break                 # a lease: what a segment this process made is viewed through
            root = root.base
        elif isinstance(root, memoryview):
            root = root.obj
        elif hasattr(root, "__array_interface__") and hasattr(root, "base"):
            # numpy's DummyArray: what as_strided / sliding_window_view put under their views
            root = root.base
        else:
            break
    return root, (segment.segment_of(root) if root is not None else None)


def extent(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> tuple[int, int]:
    """(lowest, end) byte offsets touched by a view, relative to its data pointer."""
    if 0 in shape:
        return 0, 0
    lo = hi = 0
    for n, s in zip(shape, strides):      # a loop: this runs for every array received
        if s < 0:
            lo += (n - 1) * s
        else:
            hi += (n - 1) * s
    return lo, hi + itemsize


def mostly_gaps(span: int, nbytes: int) -> bool:
    """Whether a copy of the ``span`` bytes that views of ``nbytes`` bytes lie in would be
    mostly gaps (``a[::1000]``): then the elements are copied packed, not the span as it lies."""
    return span > 2 * nbytes + 4096


def copy_to_shared(a: NDArray[Any]) -> NDArray[Any]:
    """A shared copy of ``a`` with the same strides where that costs at most twice its bytes."""
    if a.dtype.hasobject:
        raise TypeError(f"dtype {a.dtype} holds Python objects, which cannot live in shared "
                        "memory; use a numeric, bool, string or structured dtype without objects")
    lo, end = extent(a.shape, a.strides, a.itemsize)
    strategy = get_sharing_strategy()
    out: NDArray[Any]
    if mostly_gaps(end - lo, a.nbytes):   # e.g. a[::1000]: copy the elements, not the gaps
        mapping, offset = arena.allocate(a.nbytes, strategy, zero=False)
        out = np.ndarray(a.shape, a.dtype, buffer=mapping, offset=offset)
    else:
        # gaps between the elements are zeroed, not left as they were
        mapping, offset = arena.allocate(end - lo, strategy, end - lo != a.nbytes)
        out = np.ndarray(a.shape, a.dtype, buffer=mapping, offset=offset - lo, strides=a.strides)
    np.copyto(out, a, casting="no")
    if not a.flags.writeable:
        out.flags.writeable = False
    return out

"""What ``share_dataset`` copies once into sealed shared memory (``segment.create_sealed``):
NumPy arrays, kept views of one another, and frames (pandas, pyarrow, Polars) rebuilt over
their buffers.

Every process maps such a copy copy-on-write, its maker too: the pages are shared until a
process writes one, and what it writes stays its own, as with the plain attribute each worker
had a copy of. sharedmp's reducers find the copy in shared memory and send its handle, at
every pickling after.
"""
from __future__ import annotations

import ctypes
import pickle
from typing import TYPE_CHECKING, Any

import numpy as np

from ..memory import segment
from ..memory.views import extent, mostly_gaps
from .block import Entries, place_buffers

if TYPE_CHECKING:
    from numpy.typing import NDArray

_ALIGN = 64


class _Left(Exception):
    """An attribute left as it is, and why."""


# ---------------------------------------------------------------------------- arrays

def _bounds(a: NDArray[Any]) -> tuple[int, int]:
    """The addresses [lo, hi) of the bytes ``a`` views."""
    address = a.__array_interface__["data"][0]
    lo, end = extent(a.shape, a.strides, a.itemsize)
    return address + lo, address + end


def groups(arrays: list[NDArray[Any]]) -> list[list[int]]:
    """The arrays (their indices) that view overlapping memory, together: each group is
    copied as one, so that views of one base stay views of one copy."""
    spans = sorted((*_bounds(a), i) for i, a in enumerate(arrays) if a.nbytes)
    out = [[i] for i, a in enumerate(arrays) if not a.nbytes]
    hi = None
    for lo, end, i in spans:
        if hi is not None and lo < hi:
            out[-1].append(i)
            hi = max(hi, end)
        else:
            out.append([i])
            hi = end
    return out


def copy_arrays(arrays: list[NDArray[Any]], together: list[list[int]]) -> list[NDArray[Any]]:
    """Copies of ``arrays`` in one sealed block, in the order given: the arrays of a group of
    ``together`` view one copy of the bytes they span, with their own offsets and strides.
    A group whose span is mostly gaps (``a[::1000]``) has each array copied packed instead
    (views of one another no more)."""
    bounds = [_bounds(a) if a.nbytes else (0, 0) for a in arrays]
    plan = []                      # (start, size, lo, [(index, packed)])
    size = 0

    def place(n: int, lo: int, members: list[tuple[int, bool]]) -> None:
        nonlocal size
        plan.append((size, n, lo, members))
        size = (size + n + _ALIGN - 1) & ~(_ALIGN - 1)

    for group in together:
        lo = min(bounds[i][0] for i in group)
        hi = max(bounds[i][1] for i in group)
        if not mostly_gaps(hi - lo, sum(arrays[i].nbytes for i in group)):
            place(hi - lo, lo, [(i, False) for i in group])
            continue
        for i in group:
            (a_lo, a_hi), nbytes = bounds[i], arrays[i].nbytes
            packed = mostly_gaps(a_hi - a_lo, nbytes)
            place(nbytes if packed else a_hi - a_lo, a_lo, [(i, packed)])

    def fill(dst: memoryview) -> None:
        for start, n, lo, members in plan:
            if not n:
                continue
            if members[0][1]:                       # packed: the elements, in C order
                a = arrays[members[0][0]]
                packed: Any = np.ndarray(a.shape, a.dtype, buffer=dst, offset=start)
                np.copyto(packed, a, casting="no")
                del packed
            else:                                   # the bytes spanned, as they lie
                dst[start:start + n] = memoryview((ctypes.c_char * n).from_address(lo)).cast("B")

    mapping = segment.create_sealed(max(size, 1), fill)   # OutOfSharedMemory: nothing copied
    out: list[Any] = [None] * len(arrays)
    for start, _, lo, members in plan:
        for i, packed in members:
            a = arrays[i]
            copy: Any
            if packed or not a.nbytes:
                copy = np.ndarray(a.shape, a.dtype, buffer=mapping, offset=start)
            else:
                at = start + a.__array_interface__["data"][0] - lo
                copy = np.ndarray(a.shape, a.dtype, buffer=mapping, offset=at, strides=a.strides)
            if not a.flags.writeable:
                copy.flags.writeable = False
            out[i] = copy
    return out


# ---------------------------------------------------------------------------- frames

def _in_shared_memory(raw: memoryview) -> bool:
    address = int(np.frombuffer(raw, np.uint8).__array_interface__["data"][0])
    return raw.nbytes == 0 or segment.containing(address, raw.nbytes)[0] is not None


def frame_copy(value: Any) -> tuple[Any, int, int]:
    """``value`` pickled (protocol 5) with its buffers out of band (NumPy arrays, Arrow
    buffers), those copied once into one sealed block, and unpickled over them: (the copy,
    bytes shared, bytes pickled in band). Its NumPy arrays are writable views of the block
    (as they were writable: copy-on-write), its Arrow buffers read-only."""
    p = Entries()
    try:
        p.pickler().dump(value)
    except Exception as e:
        raise _Left(f"cannot be pickled ({type(e).__name__}: {e})") from None
    if not p.buffers:
        raise _Left("holds no buffers (Python objects only): nothing to share")
    if all(_in_shared_memory(raw) for _, raw in p.buffers):
        raise _Left("shared already (its buffers lie in shared memory)")
    table, total = place_buffers(p.buffers)
    places = table.tolist()

    def fill(dst: memoryview) -> None:
        for (_, raw), (at, n) in zip(p.buffers, places):
            dst[at:at + n] = raw

    mapping: Any = segment.create_sealed(max(total, 1), fill)      # (OutOfSharedMemory)
    whole = memoryview(mapping)
    views = [whole[at:at + n].toreadonly() if raw.readonly else whole[at:at + n]
             for (_, raw), (at, n) in zip(p.buffers, places)]
    with p.out.getbuffer() as data:
        inband = len(data)
        copy = pickle.loads(data, buffers=views)
    return copy, total, inband


def polars_copy(value: Any) -> tuple[Any, int, int]:
    """A Polars frame or series through Arrow (Polars pickles itself in band): its Arrow
    export rebuilt over shared memory, and Polars' frame over that (``from_arrow`` keeps
    numbers and string views without a copy)."""
    import polars as pl

    from ..reductions import polars as polars_reduction
    series = isinstance(value, pl.Series)
    try:
        table = polars_reduction.to_arrow(value.to_frame() if series else value)
    except Exception as e:           # (an Object column)
        raise _Left(f"Polars cannot export it to Arrow ({type(e).__name__}: {e})") from None
    shared_table, nbytes, inband = frame_copy(table)
    shared: Any = pl.from_arrow(shared_table, rechunk=False)
    if series:
        shared = shared.to_series()
        same = shared.dtype == value.dtype and shared.name == value.name
    else:
        same = shared.schema == value.schema
    if not same:
        raise _Left("Polars rebuilds it from Arrow with other types: left as it was")
    return shared, nbytes, inband

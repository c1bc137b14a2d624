"""NumPy arrays on the wire: a segment handle plus offset, shape, strides, dtype, flags."""
import ctypes
from multiprocessing.context import get_spawning_popen

import numpy as np

from ..arrays import _extent, copy_to_shared, mapping_of
from ..channels import fdpass
from ..errors import SegmentError
from ..memory import arena
from .segment import reduce_segment


def _address(a):
    if a.flags.c_contiguous and a.flags.writeable and a.nbytes:
        try:
            return ctypes.addressof(ctypes.c_char.from_buffer(a))   # 3x faster than below
        except (ValueError, TypeError):     # dtypes the buffer protocol lacks (datetime)
            pass
    return a.__array_interface__["data"][0]


class _Reduced:
    """A segment handle made while its owner is alive; pickles as that handle."""

    __slots__ = ("rv",)

    def __init__(self, rv):
        self.rv = rv

    def __reduce__(self):
        return self.rv


def _reduced_now(seg, mapping):
    """On a standard channel: the fd is dup'ed (or the name sent) now, while the copy lives.

    While spawning, the fd is only passed at exec, after pickling: the Popen keeps the copy
    (as long as the Process keeps its arguments)."""
    rv = reduce_segment(seg)
    popen = get_spawning_popen()
    if popen is not None:
        popen.__dict__.setdefault("_sharedmp_keep", []).append(mapping)
    return _Reduced(rv)


def reduce_ndarray(a):
    if a.dtype.hasobject:
        return a.__reduce_ex__(4)            # Python objects: ordinary pickling
    mapping, seg = mapping_of(a)
    if seg is None:                          # not shared yet: copy once into shared memory
        a = copy_to_shared(a)
        mapping, seg = mapping_of(a)
        # Nothing else holds the copy: without this its mapping, and with it the fd the
        # message is about to carry, would be released before the message is sent.
        oob = fdpass.current()
        if oob is not None:
            oob.keep_alive(mapping)
        elif not arena.is_current(mapping):      # a copy carved from an arena lives with it
            offset = _address(a) - seg.address
            return _rebuild_args(a, _reduced_now(seg, mapping), offset)
    return _rebuild_args(a, seg, _address(a) - seg.address)


def _rebuild_args(a, seg, offset):
    dtype = a.dtype
    # A plain dtype travels as its string ('<f8'): pickling the dtype object costs more
    # than everything else in the message.
    dtype = dtype.str if dtype.fields is None and dtype.subdtype is None else dtype
    return rebuild_ndarray, (seg, offset, a.shape, a.strides, dtype, not a.flags.writeable)


def rebuild_ndarray(mapping, offset, shape, strides, dtype, readonly):
    # Every number here comes from another process: check types and bounds before NumPy sees them.
    if isinstance(dtype, str):
        try:
            dtype = np.dtype(dtype)
        except Exception:            # TypeError, ValueError, SyntaxError: whatever the string was
            raise SegmentError(f"malformed array header: dtype {dtype!r}") from None
    if not (isinstance(dtype, np.dtype) and not dtype.hasobject and type(offset) is int
            and type(shape) is tuple and type(strides) is tuple and len(shape) == len(strides)
            and all(type(n) is int and n >= 0 for n in shape) and all(type(s) is int for s in strides)):
        raise SegmentError(f"malformed array header: dtype={dtype!r} offset={offset!r} shape={shape!r} "
                           f"strides={strides!r}")
    lo, end = _extent(shape, strides, dtype.itemsize)
    fits = (0 <= offset + lo and offset + end <= len(mapping)) if end else 0 <= offset <= len(mapping)
    if not fits:
        raise SegmentError(f"array of shape {shape} at offset {offset} with strides {strides} does not "
                           f"fit in its segment of {len(mapping)} bytes: the message is corrupt or hostile")
    try:
        a = np.ndarray(shape, dtype, buffer=mapping, offset=offset, strides=strides)
    except (ValueError, TypeError, OverflowError) as e:    # too many dimensions, too big, ...
        raise SegmentError(f"malformed array header: shape={shape!r} strides={strides!r} dtype={dtype!r}: "
                           f"{e}") from None
    if readonly:
        a.flags.writeable = False
    return a

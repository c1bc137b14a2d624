"""NumPy arrays on the wire: a segment handle plus offset, shape, strides, dtype, flags."""
import ctypes

import numpy as np

from ..arrays import _extent, copy_to_shared, mapping_of
from ..errors import SegmentError


def _address(a):
    if a.flags.c_contiguous and a.flags.writeable and a.nbytes:
        try:
            return ctypes.addressof(ctypes.c_char.from_buffer(a))   # 3x faster than below
        except (ValueError, TypeError):     # dtypes the buffer protocol lacks (datetime)
            pass
    return a.__array_interface__["data"][0]


def reduce_ndarray(a):
    if a.dtype.hasobject:
        return a.__reduce_ex__(4)            # Python objects: ordinary pickling
    mapping, seg = mapping_of(a)
    if seg is None:                          # not shared yet: copy once into shared memory
        a = copy_to_shared(a)
        mapping, seg = mapping_of(a)
    offset = _address(a) - seg.address
    dtype = a.dtype
    # A plain dtype travels as its string ('<f8'): pickling the dtype object costs more
    # than everything else in the message.
    dtype = dtype.str if dtype.fields is None and dtype.subdtype is None else dtype
    return rebuild_ndarray, (seg, offset, a.shape, a.strides, dtype, not a.flags.writeable)


def rebuild_ndarray(mapping, offset, shape, strides, dtype, readonly):
    if isinstance(dtype, str):
        try:
            dtype = np.dtype(dtype)
        except TypeError:
            raise SegmentError(f"malformed array header: dtype {dtype!r}") from None
    if not isinstance(dtype, np.dtype) or dtype.hasobject or len(shape) != len(strides):
        raise SegmentError(f"malformed array header: dtype={dtype!r} shape={shape!r} strides={strides!r}")
    lo, end = _extent(shape, strides, dtype.itemsize)
    fits = (0 <= offset + lo and offset + end <= len(mapping)) if end else 0 <= offset <= len(mapping)
    if not fits:
        raise SegmentError(f"array of shape {shape} at offset {offset} with strides {strides} does not "
                           f"fit in its segment of {len(mapping)} bytes: the message is corrupt or hostile")
    a = np.ndarray(shape, dtype, buffer=mapping, offset=offset, strides=strides)
    if readonly:
        a.flags.writeable = False
    return a

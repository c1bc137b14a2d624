"""NumPy arrays on the wire: a segment handle plus offset, shape, strides, dtype, flags.

Two forms: pickled (``reduce_ndarray``/``rebuild_ndarray``), for arrays anywhere in a
message and on any channel; and, for a message of one array alone on a sharedmp channel,
a fixed binary header that skips pickle (``encode_array``/``decode_array``, frame flag
``FLAG_ARRAY`` in ``channels/connection.py``): a stream of small arrays would otherwise
spend most of its time in pickle.
"""
import ctypes
import struct
from multiprocessing.context import get_spawning_popen
from typing import Any

import numpy as np

from ..memory.views import copy_to_shared, extent, mapping_of
from .. import wire
from ..errors import ProtocolError, SegmentError
from ..memory import arena, segment
from ..strategy import get_sharing_strategy
from .segment import reduce_segment


def _address(a):
    if a.flags.c_contiguous and a.flags.writeable and a.nbytes:
        try:
            return ctypes.addressof(ctypes.c_char.from_buffer(a))   # cheaper than below
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
        oob = wire.current()
        if oob is not None:
            oob.keep_alive(mapping)
            oob.fds.flight += a.nbytes       # made for this message (channels/flow.py)
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


# offset in the segment, ndim, length of the dtype string, read-only; then the dtype
# string ('<f4'), then ndim shapes and ndim strides (int64). The fd is the frame's only one.
_HEAD = struct.Struct("<QBB?")
_DIMS = [struct.Struct(f"<{2 * n}q") for n in range(256)]     # shape + strides, by ndim


# dtype -> its string as bytes, or None where the dtype needs pickle
_codes: "dict[Any, bytes | None]" = {}


def _code(dtype):
    code = _codes.get(dtype, False)
    if code is False:
        plain = not dtype.hasobject and dtype.fields is None and dtype.subdtype is None
        code = dtype.str.encode("ascii") if plain else None
        if len(_codes) < 256:
            _codes[dtype] = code
    return code


def encode_array(a, fds):
    """The frame payload of ndarray ``a`` sent alone, its fd appended to ``fds``; None when
    it needs pickle (a structured or object dtype, a named segment)."""
    code = _code(a.dtype)
    if code is None:
        return None
    mapping, seg = mapping_of(a)
    if seg is None:                          # not shared yet: copy once into shared memory
        if get_sharing_strategy() != "file_descriptor":
            return None
        a = copy_to_shared(a)
        mapping, seg = mapping_of(a)
        fds.flight += a.nbytes               # made for this message (channels/flow.py)
    # named: the daemon must hear of the reference in flight
    if seg.kind != "file_descriptor":
        return None
    fds.keep.append(mapping)                 # alive until sent, even if ``a`` was a fresh copy
    fds.append(seg.fd)
    n = a.ndim
    return (_HEAD.pack(_address(a) - seg.address, n, len(code), not a.flags.writeable) + code
            + _DIMS[n].pack(*a.shape, *a.strides))


def decode_array(payload, fds):
    """The array of a frame made by ``encode_array`` (the caller closes ``fds``)."""
    try:
        offset, n, k, readonly = _HEAD.unpack_from(payload)
        code = payload[_HEAD.size:_HEAD.size + k]
        dims = _DIMS[n].unpack_from(payload, _HEAD.size + k)
    except struct.error:
        raise ProtocolError(f"malformed array frame ({len(payload)} bytes)") from None
    if len(payload) != _HEAD.size + k + 16 * n:
        raise ProtocolError(f"array frame of {len(payload)} bytes, its header says "
                            f"{_HEAD.size + k + 16 * n}")
    if len(fds) != 1:
        raise ProtocolError(f"array frame carries {len(fds)} fds instead of 1")
    shape, strides = dims[:n], dims[n:]
    dtype = _dtype(bytes(code))        # struct gave ints; only their signs and bounds are left
    if n and min(shape) < 0 or dtype.hasobject:
        raise SegmentError(f"malformed array header: dtype={dtype!r} shape={shape!r}")
    return _view(segment.attach_fd(fds[0]), offset, shape, strides, dtype, readonly)


# dtype string (str or ascii bytes) -> np.dtype, for those seen (parsing costs more than the
# rest)
_dtypes: "dict[str | bytes, np.dtype[Any]]" = {}


def _dtype(code):
    dtype = _dtypes.get(code)
    if dtype is None:
        try:
            dtype = np.dtype(code.decode("ascii") if type(code) is bytes else code)
        except Exception:            # TypeError, ValueError, SyntaxError: whatever the string was
            raise SegmentError(f"malformed array header: dtype {code!r}") from None
        if len(_dtypes) < 256:
            _dtypes[code] = dtype
    return dtype


def rebuild_ndarray(mapping, offset, shape, strides, dtype, readonly):
    # Every number here comes from another process: check types and bounds before NumPy sees them.
    if isinstance(dtype, str):
        dtype = _dtype(dtype)
    if not (isinstance(dtype, np.dtype) and not dtype.hasobject and type(offset) is int
            and type(shape) is tuple and type(strides) is tuple and len(shape) == len(strides)
            and all(type(n) is int and n >= 0 for n in shape)
            and all(type(s) is int for s in strides)):
        raise SegmentError(f"malformed array header: dtype={dtype!r} offset={offset!r} "
                           f"shape={shape!r} strides={strides!r}")
    return _view(mapping, offset, shape, strides, dtype, readonly)


def _view(mapping, offset, shape, strides, dtype, readonly):
    """The view, once its header is well typed: only if it lies inside ``mapping``."""
    contiguous = len(shape) == 1 and strides[0] == dtype.itemsize     # the common case, faster
    lo, end = (0, shape[0] * strides[0]) if contiguous else extent(shape, strides, dtype.itemsize)
    fits = ((0 <= offset + lo and offset + end <= len(mapping)) if end
            else 0 <= offset <= len(mapping))
    if not fits:
        raise SegmentError(f"array of shape {shape} at offset {offset} with strides {strides} "
                           f"does not fit in its segment of {len(mapping)} bytes: the message is "
                           "corrupt or hostile")
    try:
        a = (np.ndarray(shape, dtype, buffer=mapping, offset=offset) if contiguous else
             np.ndarray(shape, dtype, buffer=mapping, offset=offset, strides=strides))
    except (ValueError, TypeError, OverflowError) as e:    # too many dimensions, too big, ...
        raise SegmentError(f"malformed array header: shape={shape!r} strides={strides!r} "
                           f"dtype={dtype!r}: {e}") from None
    if readonly:
        a.flags.writeable = False
    return a

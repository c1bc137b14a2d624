"""NumPy arrays on the wire: a segment handle plus offset, shape, strides, dtype, flags.

Two forms: pickled (``reduce_ndarray``/``rebuild_ndarray``), for arrays anywhere in a
message and on any channel; and, for a message of one array alone on a sharedmp channel,
a fixed binary header that skips pickle (``encode_array``/``decode_array``, frame flag
``FLAG_ARRAY`` in ``wire.py``): a stream of small arrays would otherwise
spend most of its time in pickle. A small array not in shared memory travels by value
(``STD_BY_VALUE_MAX`` below says when): pickled as its bytes in the order NumPy's pickle
keeps (``rebuild_value``), or as that header followed by its bytes, with no fd. The
receiver's array is then a private copy that keeps the read-only flag: writable if the
sender's was, read-only if the sender's was (NumPy's own pickle would give a writable one).
"""
import ctypes
import struct
from multiprocessing.context import get_spawning_popen
from typing import Any

import numpy as np

from ..memory.views import copy_to_shared, extent, mapping_of
from .. import _compat, native, wire
from ..errors import ProtocolError, SegmentError
from ..memory import arena, segment
from ..strategy import get_sharing_strategy
from .segment import reduce_segment


# Small plain arrays travel by value. An array not in shared memory yet would be copied
# into it at send, and its fd carried; below these sizes its bytes in the message cost
# less (measured, docs/reference.md "Small arrays travel by value"):
# - on a sharedmp channel, while the message's bytes by value (its PickleBuffers too)
#   stay within ``wire.INBAND_MAX`` (one socket record);
# - on any other channel (a standard-library Queue, Pipe or spawn arguments), up to
#   ``STD_BY_VALUE_MAX``: there the fd would go through multiprocessing's resource sharer, a
#   connection back to the sender per array, which also fails once the sender has exited.
# An array already in shared memory always travels as its segment (it is shared).
STD_BY_VALUE_MAX = 128 << 10


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
    until the launch is done (sharedmp's Process classes; a standard one: with its Popen)."""
    rv = reduce_segment(seg)
    popen = get_spawning_popen()
    if popen is not None:
        _compat.keep_until_launched(popen, mapping)
    return _Reduced(rv)


def reduce_ndarray(a):
    if a.dtype.hasobject:
        return a.__reduce_ex__(4)            # Python objects: ordinary pickling
    mapping, seg = mapping_of(a)
    if seg is None:
        oob = wire.current()
        if (a.nbytes <= STD_BY_VALUE_MAX if oob is None else oob.inband_room(a.nbytes)):
            flags = a.flags
            if flags.fnc:                    # F-contiguous, not C: NumPy's pickle keeps F
                return rebuild_value, (a.T.tobytes(), _plain(a.dtype), a.shape,
                                       not flags.writeable, True)
            return rebuild_value, (a.tobytes(), _plain(a.dtype), a.shape, not flags.writeable)
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


def _plain(dtype):
    # A plain dtype travels as its string ('<f8'): pickling the dtype object costs more
    # than everything else in the message.
    return dtype.str if dtype.fields is None and dtype.subdtype is None else dtype


def _rebuild_args(a, seg, offset):
    return rebuild_ndarray, (seg, offset, a.shape, a.strides, _plain(a.dtype),
                             not a.flags.writeable)


# A small array by value: its bytes in C order, or in F order for an F-contiguous (not
# C-contiguous) one, the order NumPy's own pickle keeps; the receiver's array has that
# order, and is read-only where the sender's was (NumPy's pickle gives a writable copy).
# (NumPy's pickle of protocol 4 would do, but loses a non-native byte order: NumPy 2.4
# receives '>i8' as int64.)
def rebuild_value(data, dtype, shape, readonly, fortran=False):
    if isinstance(dtype, str):
        dtype = _dtype(dtype)
    if not (type(data) is bytes and isinstance(dtype, np.dtype) and type(shape) is tuple
            and all(type(n) is int for n in shape) and type(fortran) is bool):
        raise SegmentError(f"malformed array by value: dtype={dtype!r} shape={shape!r}")
    return _from_bytes(data, 0, dtype, shape, readonly, fortran=fortran)


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
    if seg is None and a.nbytes <= wire.INBAND_MAX:
        return _encode_value(a, code)        # small and not shared: by value
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


def _encode_value_py(a, code):
    """The frame of a small plain array sent by value: the header (offset 0, the strides of
    its C or F copy), then its bytes in that order; no fd. The twin of
    ``_cframe.encode_value``."""
    n, flags = a.ndim, a.flags
    fortran = flags.fnc                  # F-contiguous, not C: F, as NumPy's pickle keeps it
    return (_HEAD.pack(0, n, len(code), not flags.writeable) + code
            + _DIMS[n].pack(*a.shape, *_packed_strides(a.shape, a.itemsize, fortran))
            + (a.T.tobytes() if fortran else a.tobytes()))


def _packed_strides(shape, itemsize, fortran):
    """The strides NumPy gives the C (or F) array of ``shape`` made from packed bytes (a
    reshape: a dimension of 0 counts as 1), which the receiver checks."""
    if len(shape) == 1:
        return (itemsize,)
    strides, step = [0] * len(shape), itemsize
    for i in (range(len(shape)) if fortran else range(len(shape) - 1, -1, -1)):
        strides[i] = step
        step *= shape[i] or 1
    return strides


def decode_array(payload, fds):
    """The array of a frame made by ``encode_array`` (the caller closes ``fds``)."""
    if not fds:                        # by value: its bytes follow the header
        return _decode_value(payload)
    offset, n, k, readonly, code, dims = _header(payload)
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


def _decode_value_py(payload):
    """The array of a frame by value (``_encode_value``). The twin of
    ``_cframe.decode_value``."""
    offset, n, k, readonly, code, dims = _header(payload)
    if offset:
        raise ProtocolError("an array frame by value must say offset 0")
    return _from_bytes(payload, _HEAD.size + k + 16 * n, _dtype(bytes(code)), dims[:n],
                       readonly, dims[n:])


def _header(payload):
    """(offset, ndim, length of the dtype string, read-only, dtype string, shape + strides)
    of an array frame."""
    try:
        offset, n, k, readonly = _HEAD.unpack_from(payload)
        code = payload[_HEAD.size:_HEAD.size + k]
        return offset, n, k, readonly, code, _DIMS[n].unpack_from(payload, _HEAD.size + k)
    except struct.error:
        raise ProtocolError(f"malformed array frame ({len(payload)} bytes)") from None


def _from_bytes(data, start, dtype, shape, readonly, strides=None, fortran=False):
    """A copy of the array of ``shape`` whose bytes are ``data[start:]``, checked first; in F
    order where ``fortran`` says so or where ``strides`` (a frame's: exactly those of the C
    or the F array of ``shape``) are F strides, else in C order. The strides are NumPy's
    own for a reshape of packed bytes, as its pickle gives them (also for empty arrays)."""
    count = 1
    for d in shape:
        count *= d
    if dtype.hasobject or (shape and min(shape) < 0) \
            or len(data) - start != count * dtype.itemsize:
        raise ProtocolError(f"array by value of {len(data) - start} bytes does not hold an "
                            f"array of dtype {dtype} and shape {shape}")
    try:
        if count:
            a = flat = np.frombuffer(data, dtype, count, start)
        else:       # a bytearray of its own: writable, and the strides a reshape gives
            a = flat = np.frombuffer(bytearray(), dtype)  # (a copy would have 0 ones)
        if len(shape) != 1:                  # (1-d: ``flat`` is the array already)
            a = flat.reshape(shape, order="F") if fortran else flat.reshape(shape)
        if strides is not None and a.strides != strides:
            a = flat.reshape(shape, order="F")
            fortran = True
            if a.strides != strides:
                raise ProtocolError(f"array frame by value says strides {strides}, neither "
                                    f"the C nor the F strides of shape {shape} and "
                                    f"itemsize {dtype.itemsize}")
    except (ValueError, TypeError) as e:     # too many dimensions, a size of 0 bytes, ...
        raise ProtocolError(f"array frame by value of dtype {dtype} and shape {shape}: "
                            f"{e}") from None
    if count:
        a = a.copy(order="F") if fortran else a.copy()
    if readonly:
        a.flags.writeable = False
    return a


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


# The compiled twins (_c/cframe.c) where built, else these (sharedmp/native.py).
_encode_value, _decode_value = _encode_value_py, _decode_value_py
_c = native.load("_cframe")
if _c is not None:
    _c.setup_ndarray(_dtypes, _dtype, _encode_value_py, _decode_value_py, np.empty)
    _encode_value, _decode_value = _c.encode_value, _c.decode_value


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

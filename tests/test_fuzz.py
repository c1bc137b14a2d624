"""Fuzzing (hypothesis) of what a receiver decodes: frames, segment handles, array headers.

tests/test_hostile_frames.py holds hand-written cases; here hypothesis draws them. Every
case goes through a real ``sharedmp.Pipe()`` (real socket, real fds, real memfds) and an
oracle written from the protocol (``fdpass`` header ``<2sBBIQ``; the ndarray reducer's
``(segment, offset, shape, strides, dtype, readonly)``) says what must happen: the
honest cases arrive intact, every other one raises the exception that names its problem
(the message is matched). On success the array must lie inside the memory this process
mapped, and its bytes must be the ones at that place of the segment. No case may hang
(the writer always closes), allocate what a frame merely claims, leave an fd open, or
kill the process (SIGBUS would end the test run).

Payloads are pickles of simple objects or of sharedmp's own handles: a pickle that calls
arbitrary functions is trusted exactly as in ``multiprocessing`` (SECURITY.md) and is not
fuzzed here.
"""
import fcntl
import gc
import os
import pickle
import re
import secrets
import socket
import stat
import struct
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

import sharedmp as mp
from sharedmp.channels.fdpass import (FDS_ON_SOCKET, FLIGHT_TOKEN, HEADER, KIND, MAGIC, MAX_FDS, MAX_FDS_PER_MSG, MAX_PAYLOAD,
                                      PAYLOAD_IN_MEMFD, VERSION)
from sharedmp.memory import manager, named, segment
from sharedmp.reductions.ndarray import rebuild_ndarray

from test_hostile_frames import InBandSegment, _target      # the same helpers
from conftest import open_fds

# The suite's runs are derandomized (the same 300 cases each time: CI must not fail by the
# luck of the draw); SHAREDMP_FUZZ_EXAMPLES=N explores N fresh random cases.
SETTINGS = settings(max_examples=int(os.environ.get("SHAREDMP_FUZZ_EXAMPLES", "300")), deadline=None,
                    derandomize="SHAREDMP_FUZZ_EXAMPLES" not in os.environ,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large])
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
F_SEAL_FUTURE_WRITE = 0x0010        # Linux >= 5.1; not in Python 3.11's fcntl module


def extent(start, shape, strides, itemsize):
    """The lowest byte a view touches and one past its highest (strides in bytes)."""
    low = start + sum((n - 1) * s for n, s in zip(shape, strides) if s < 0)
    high = start + sum((n - 1) * s for n, s in zip(shape, strides) if s > 0) + itemsize
    return low, high


class Named:
    """Pickles as sharedmp's named segment reference (file_system)."""

    def __init__(self, name):
        self.name = name

    def __reduce__(self):
        return named.attach_name, (self.name,)


class Array:
    """Pickles as what the ndarray reducer writes, with any header at all."""

    def __init__(self, seg, offset, shape, strides, dtype, readonly=False):
        self.args = (seg, offset, shape, strides, dtype, readonly)

    def __reduce__(self):
        return rebuild_ndarray, self.args


MEMFD_SIZE = 4096                   # the size of the memfds that frames carry


def memfd_pattern(size):
    return bytes((i * 7 + 3) & 0xFF for i in range(size))


def sealed_memfd(size, pattern=True, seals=SEALS):
    fd = os.memfd_create("fuzz", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if pattern and size:
        os.pwrite(fd, memfd_pattern(size), 0)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def exchange(data_chunks, payload_obj_fds=()):
    """Write ``data_chunks`` [(bytes, fds)], a record each, on a fresh Pipe, close the writer, recv() once.

    Returns ("ok", value) or ("raised", exception); checks that no fd was left open.
    """
    before = open_fds()
    a, b = mp.Pipe()
    try:
        raw = a._sock
        for data, fds in data_chunks:
            if fds:
                socket.send_fds(raw, [data], fds)
            else:
                raw.sendall(data)
        a.close()                     # whatever was claimed, the reader meets EOF: no hang
        try:
            outcome = ("ok", b.recv())
        except Exception as e:        # noqa: BLE001 -- the oracle judges the exception
            outcome = ("raised", e.with_traceback(None))     # no frames kept: no cycles
    finally:
        a.close()
        b.close()
    return outcome, before


def assert_no_fd_left(before, *keep):
    keep = {str(fd) for fd in keep}
    left = open_fds() - before - keep
    if left:                          # a finalizer may wait for the cycle collector: fine
        left = open_fds(collect=True) - before - keep
    assert not left, f"fds left open: {[_target(fd) for fd in left]}"


def expect(outcome, kind, pattern=None, value=None):
    """The outcome must be ``kind`` ("ok" with ``value``, or an exception class) matching ``pattern``."""
    what, got = outcome
    if kind == "ok":
        assert what == "ok", f"expected success, got {got!r}"
        assert got == value
        return
    assert what == "raised", f"expected {kind.__name__} /{pattern}/, but it was accepted: {got!r}"
    assert isinstance(got, kind), f"expected {kind.__name__} /{pattern}/, got {type(got).__name__}: {got}"
    import re
    assert re.search(pattern, str(got)), f"{type(got).__name__} does not name the problem /{pattern}/: {got}"


# -- 1. the frame decoder ------------------------------------------------------------------------

simple = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20)
                      | st.binary(max_size=40) | st.floats(allow_nan=False),
                      lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner),
                      max_leaves=10)


def mostly(draw, usual, other, one_in=5):
    """Draw from ``usual``, or from ``other`` once in ``one_in`` draws: most frames are nearly
    honest, so that the decoder gets past its first checks and the later ones are reached."""
    return draw(other if draw(st.integers(0, one_in - 1)) == 0 else usual)


@st.composite
def frames(draw):
    """A frame as a hostile or honest peer would write it: one record and its fds."""
    obj = draw(simple)
    payload = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
    if draw(st.integers(0, 5)) == 0:
        payload = payload[:draw(st.integers(0, len(payload) - 1))]          # a truncated pickle
    honest_len = len(payload)
    with_record = mostly(draw, st.integers(0, 3), st.integers(0, MAX_FDS_PER_MSG))   # fds sent
    nfds = mostly(draw, st.just(with_record), st.one_of(
        st.integers(0, 6), st.integers(MAX_FDS_PER_MSG, MAX_FDS_PER_MSG + 6), st.integers(MAX_FDS - 1, 2 ** 32 - 1)))
    length = mostly(draw, st.just(honest_len), st.one_of(
        st.integers(0, honest_len + 64), st.integers(MAX_PAYLOAD - 2, MAX_PAYLOAD + 2),
        st.integers(2 ** 63, 2 ** 64 - 1)))
    magic = mostly(draw, st.just(MAGIC), st.binary(min_size=2, max_size=2), one_in=10)
    version = mostly(draw, st.just(VERSION), st.integers(0, 255), one_in=10)
    flags = mostly(draw, st.just(0), st.integers(1, 255), one_in=4)
    cut = mostly(draw, st.none(), st.integers(1, HEADER.size - 1), one_in=10)   # a record shorter than a header
    return obj, payload, with_record, nfds, length, magic, version, flags, cut


def frame_oracle(payload, with_record, nfds, length, magic, version, flags, cut):
    """(kind, pattern-or-value): what recv() must do, following the protocol step by step."""
    if cut is not None:
        return mp.ProtocolError, "shorter than a frame header"
    if magic != MAGIC or version != VERSION:
        return mp.ProtocolError, "not a sharedmp frame"
    if nfds > MAX_FDS or length > MAX_PAYLOAD:
        return mp.ProtocolError, "over the sane bounds"
    in_memfd, on_socket = flags & PAYLOAD_IN_MEMFD, flags & FDS_ON_SOCKET
    token = flags & FLIGHT_TOKEN      # a flight token (any fd: the receiver only closes it)
    if with_record != (1 if on_socket else nfds) + (1 if in_memfd else 0) + (1 if token else 0):
        return mp.ProtocolError, f"announces {nfds} fds.* but {with_record} arrived"
    if in_memfd:                      # the payload's offset in the last fd: one of the sealed memfds
        if len(payload) != 8:
            return mp.ProtocolError, "memfd carries"
        offset, = struct.unpack("<Q", payload)
        if offset + length > MEMFD_SIZE:
            return mp.ProtocolError, "memfd sealed against shrinking that holds them"
        payload = memfd_pattern(MEMFD_SIZE)[offset:offset + length]
    elif len(payload) != length:
        return mp.ProtocolError, f"carries {len(payload)} payload bytes, its header announces {length}"
    if on_socket:                     # ... and no memfd is a socket
        return mp.ProtocolError, "should wait on a socket"
    kind = flags & KIND
    if kind == 1:                     # an array frame (encode_array): a pickle is never a valid one
        return OSError, r"array (frame|header)|does not fit|segment"
    if kind == 2:                     # a tensor frame (encode_tensor): neither is it one
        return OSError, r"tensor (frame|header)|does not fit|segment|needs torch"
    if kind == 3:                     # out-of-band buffers: [length][places][pickle]
        return buffers_oracle(payload)
    if kind:
        return mp.ProtocolError, "unknown flags"
    if not payload:
        return mp.ProtocolError, "ends before its pickle does"
    try:
        return "ok", pickle.loads(payload)
    except EOFError:
        return mp.ProtocolError, "ends before its pickle does"
    except pickle.UnpicklingError:
        return pickle.UnpicklingError, "."     # pickle's own message (truncated, invalid load key)


def buffers_oracle(payload):
    """What a FLAG_BUFFERS frame of these bytes must do (an honest pickle is never one)."""
    if len(payload) < 4:
        return mp.ProtocolError, "shorter than its header"
    n = int.from_bytes(payload[:4], "little")
    if n > len(payload) - 4:
        return mp.ProtocolError, "bytes of places"
    try:
        places = pickle.loads(payload[4:4 + n])
    except Exception:
        return mp.ProtocolError, "places do not unpickle"
    if type(places) is not list:
        return mp.ProtocolError, "list of places"
    if places:                        # nothing here is one of this process's segments
        return mp.ProtocolError, "place must be"
    rest = payload[4 + n:]
    try:
        return "ok", pickle.loads(rest, buffers=[])
    except EOFError:
        return mp.ProtocolError, "ends before its pickle does"
    except Exception as e:            # whatever the pickle's bytes make of it
        return type(e), ""


@SETTINGS
@given(frames())
def test_frame_decoder(frame):
    obj, payload, with_record, nfds, length, magic, version, flags, cut = frame
    header = HEADER.pack(magic, version, flags, nfds, length)
    fd = sealed_memfd(MEMFD_SIZE)
    try:
        record = header[:cut] if cut is not None else header + payload
        outcome, before = exchange([(record, [fd] * with_record)])
        kind, expected = frame_oracle(payload, with_record, nfds, length, magic, version, flags, cut)
        event(kind if kind == "ok" else f"{kind.__name__}: {expected}")
        if kind == "ok":
            expect(outcome, "ok", value=expected)
        else:
            expect(outcome, kind, expected)
        assert_no_fd_left(before, fd)
    finally:
        os.close(fd)


# -- 2. array headers over a real segment ---------------------------------------------------------

DTYPES = ["<f8", ">i4", "|u1", "|b1", "<c16", "<f2", "|S3", "<U2", "|V4", "<M8[s]", ">u2",
          "(2,)<i2", "<i4,<f8", "|S0", "O", "|O", "garbage", "", "<f8 ", "(1000000000000000,)u1"]
huge = st.sampled_from([2 ** 31, 2 ** 62, 2 ** 63 - 1, 2 ** 63, 2 ** 64, 2 ** 70, -(2 ** 63), -(2 ** 64)])
dim = st.one_of(st.integers(0, 9), st.integers(-3, -1), huge)
stride = st.one_of(st.integers(-64, 64), st.sampled_from([0, 1, 8, -8, 4096, -4096]), huge)
odd = st.sampled_from([1.5, "8", None, True, np.int8(8), np.int64(2), [2]])


@st.composite
def array_headers(draw):
    """A segment size and an array header: mostly one an honest sender could write (C order,
    strides reversed or stretched, an offset inside the segment), with hostile numbers and
    types mixed in."""
    size = draw(st.integers(1, 3 * 4096 + 17))
    dtype = mostly(draw, st.sampled_from(DTYPES[:11]), st.sampled_from(DTYPES[11:]))
    try:
        itemsize = np.dtype(dtype).itemsize
    except Exception:
        itemsize = 1
    shape = draw(st.lists(st.integers(0, 6), max_size=4))
    strides, step = [], itemsize * draw(st.sampled_from([1, 1, 2, -1]))
    for n in reversed(shape):
        strides.insert(0, step)
        step *= max(n, 1)
    offset = draw(st.integers(0, size))
    if step < 0:                      # reversed: start at the end of the region
        offset = draw(st.integers(min(-step - itemsize, size), size))
    for _ in range(max(0, draw(st.integers(0, 4)) - 2)):     # hostile edits, in 2 of 5
        where = draw(st.integers(0, 3))
        if where == 0 and shape:
            shape[draw(st.integers(0, len(shape) - 1))] = draw(st.one_of(dim, odd))
        elif where == 1 and strides:
            strides[draw(st.integers(0, len(strides) - 1))] = draw(st.one_of(stride, odd))
        elif where == 2:
            offset = draw(st.one_of(st.integers(size - 64, size + 8), st.integers(-64, -1), huge, odd))
        else:
            strides = strides[:-1] if strides and draw(st.booleans()) else strides + [8]
    shape = list(shape) if draw(st.integers(0, 19)) == 0 else tuple(shape)
    return size, offset, shape, tuple(strides), dtype, draw(st.booleans())


def header_oracle(size, offset, shape, strides, dtype_str):
    """"ok", or the words of the SegmentError the receiver must raise."""
    try:
        dtype = np.dtype(dtype_str)
    except Exception:
        return "malformed array header"
    plain = lambda x: type(x) is int                                     # noqa: E731
    if (dtype.hasobject or not plain(offset) or type(shape) is not tuple or len(shape) != len(strides)
            or not all(plain(n) and n >= 0 for n in shape) or not all(plain(s) for s in strides)):
        return "malformed array header"
    if 0 in shape:
        fits = 0 <= offset <= size
    else:                             # the lowest and highest byte the view touches
        low, high = extent(offset, shape, strides, dtype.itemsize)
        fits = low >= 0 and high <= size if (high - low) > 0 else 0 <= offset <= size
    if not fits:
        return "does not fit"
    if (len(shape) > 64 or np.prod([n for n in shape if n], dtype=object) * max(dtype.itemsize, 1) >= 2 ** 63
            or not all(-2 ** 63 <= s < 2 ** 63 for s in strides)):     # what NumPy itself refuses
        return "malformed array header"
    return "ok"


@SETTINGS
@given(array_headers())
def test_array_header_over_a_real_segment(header):
    size, offset, shape, strides, dtype, readonly = header
    expected = header_oracle(size, offset, shape, strides, dtype)
    event(expected)
    fd = sealed_memfd(size)
    try:
        pickled = pickle.dumps(Array(InBandSegment(0), offset, shape, strides, dtype, readonly), pickle.HIGHEST_PROTOCOL)
        forms = [(0, pickled)]
        binary = array_frame(offset, shape, strides, dtype, readonly)
        if binary is not None:        # the same header as an array frame (a message of one array)
            forms.append((1, binary))
        for flags, payload in forms:
            outcome, before = exchange([(HEADER.pack(MAGIC, VERSION, flags, 1, len(payload)) + payload, [fd])])
            what, got = outcome
            if expected != "ok":
                expect(outcome, mp.SegmentError, expected)
            else:
                assert what == "ok", f"honest header {header} refused: {got!r}"
                check_view(got, fd, size, offset, shape, strides, dtype, readonly)
            del got, outcome
            assert_no_fd_left(before, fd)
    finally:
        os.close(fd)


def array_frame(offset, shape, strides, dtype, readonly):
    """The payload encode_array would write for this header, or None if it has no such form."""
    ints = [offset, *shape, *strides]
    if not (all(type(x) is int for x in ints) and type(shape) is tuple and len(shape) == len(strides) <= 255
            and 0 <= offset < 2 ** 64 and all(-2 ** 63 <= x < 2 ** 63 for x in ints[1:])
            and isinstance(dtype, str) and dtype.isascii() and len(dtype) <= 255):
        return None
    n = len(shape)
    return (struct.pack("<QBB?", offset, n, len(dtype), readonly) + dtype.encode()
            + struct.pack(f"<{2 * n}q", *shape, *strides))


@SETTINGS
@given(st.binary(max_size=80), st.integers(0, 2), st.integers(0, 3))
def test_array_frame_bytes(payload, nfds, mangle):
    """Arbitrary bytes (or an honest array frame with bytes flipped) under the array flag: an
    exception naming the problem, or an array inside the segment; never a crash or an fd left."""
    fd = sealed_memfd(4096)
    try:
        if mangle:                    # an honest frame, then the drawn bytes written over its start
            honest = array_frame(64, (4, 8), (64, 8), "<f8", False)
            payload = payload[:len(honest)] + honest[len(payload):] if mangle == 1 else honest + payload
        outcome, before = exchange([(HEADER.pack(MAGIC, VERSION, 1, nfds, len(payload)) + payload, [fd] * nfds)])
        what, got = outcome
        if what == "ok":
            assert nfds == 1
            seg = next(x for x in segment.live_segments() if x.key[1] == os.fstat(fd).st_ino)
            if got.size and got.itemsize:
                start = got.__array_interface__["data"][0]
                low, high = extent(start, got.shape, got.strides, got.itemsize)
                assert seg.address <= low and high <= seg.address + seg.size, "a view outside the mapping"
        else:
            assert isinstance(got, (mp.ProtocolError, mp.SegmentError)), repr(got)
            assert re.search(r"array (frame|header)|does not fit|segment", str(got)), str(got)
        del got, outcome
        assert_no_fd_left(before, fd)
    finally:
        os.close(fd)


def tensor_frame(offset, nbytes, storage_offset, code, flags, shape, strides):
    """The payload encode_tensor writes (reductions/torch.py: ``<QQqBBB`` + sizes + strides)."""
    n = len(shape)
    return struct.pack("<QQqBBB", offset, nbytes, storage_offset, code, flags, n) + struct.pack(f"<{2 * n}q", *shape, *strides)


@SETTINGS
@given(st.binary(max_size=96), st.integers(0, 2), st.integers(0, 3))
def test_tensor_frame_bytes(payload, nfds, mangle):
    """The same for the tensor flag: an exception naming the problem, or a tensor whose every
    element lies inside the segment; never a crash or an fd left."""
    torch = pytest.importorskip("torch")
    fd = sealed_memfd(4096)
    try:
        if mangle:                    # an honest frame (a 4 x 8 float64 view), then the drawn bytes
            honest = tensor_frame(64, 512, 8, 1, 0, (4, 8), (8, 1))
            payload = payload[:len(honest)] + honest[len(payload):] if mangle == 1 else honest + payload
        outcome, before = exchange([(HEADER.pack(MAGIC, VERSION, 2, nfds, len(payload)) + payload, [fd] * nfds)])
        what, got = outcome
        event("ok" if what == "ok" else f"{type(got).__name__}: {str(got)[:24]}")
        if what == "ok":
            assert nfds == 1 and isinstance(got, torch.Tensor)
            seg = next(x for x in segment.live_segments() if x.key[1] == os.fstat(fd).st_ino)
            if got.numel() and got.element_size():
                start = got.data_ptr()
                size = got.element_size()
                low, high = extent(start, got.shape, [s * size for s in got.stride()], size)
                assert seg.address <= low and high <= seg.address + seg.size, "a tensor outside the mapping"
                if got.numel() <= 1 << 16:
                    got.clone()           # every element read: no SIGBUS
        else:
            assert isinstance(got, (mp.ProtocolError, mp.SegmentError)), repr(got)
            assert re.search(r"tensor (frame|header)|does not fit|segment", str(got)), str(got)
        del got, outcome
        assert_no_fd_left(before, fd)
    finally:
        os.close(fd)


def wild_int(lo, hi):
    """Mostly small sane values, sometimes anything the field can hold."""
    return st.one_of(st.integers(0, 16), st.integers(-4, 600).filter(lambda x: lo <= x <= hi),
                     st.integers(lo, hi))


@st.composite
def tensor_headers(draw):
    n = draw(st.integers(0, 4))
    sane = st.sampled_from([0, 64, 512, 1024, 4032])
    return (draw(st.one_of(sane, wild_int(0, 2 ** 64 - 1))), draw(st.one_of(sane, wild_int(0, 2 ** 64 - 1))),
            draw(wild_int(-2 ** 63, 2 ** 63 - 1)), draw(st.one_of(st.integers(0, 11), st.integers(0, 255))),
            draw(st.one_of(st.just(0), st.integers(0, 15), st.integers(0, 255))),
            tuple(draw(st.lists(wild_int(-2 ** 63, 2 ** 63 - 1), min_size=n, max_size=n))),
            tuple(draw(st.lists(wild_int(-2 ** 63, 2 ** 63 - 1), min_size=n, max_size=n))))


@SETTINGS
@given(tensor_headers())
def test_tensor_header_fields(header):
    """Every field of a tensor frame drawn (mostly near the honest values): a tensor inside the
    segment showing its bytes, or SegmentError naming the header; never a crash or an fd left."""
    torch = pytest.importorskip("torch")
    from sharedmp.reductions.torch.codes import DTYPES as _DTYPES
    offset, nbytes, storage_offset, code, flags, shape, strides = header
    fd = sealed_memfd(4096)
    try:
        payload = tensor_frame(*header)
        outcome, before = exchange([(HEADER.pack(MAGIC, VERSION, 2, 1, len(payload)) + payload, [fd])])
        what, got = outcome
        event("ok" if what == "ok" else f"{type(got).__name__}: {str(got)[:30]}")
        if what == "ok":
            dtype = _DTYPES[code]
            assert (got.dtype, tuple(got.shape), got.storage_offset()) == (dtype, shape, storage_offset)
            assert got.stride() == strides or not got.numel()     # (an empty tensor's are torch's own)
            assert offset + nbytes <= 4096 and not flags & ~15 and offset % dtype.itemsize == 0
            storage, raw = got.untyped_storage(), None
            seg = next(x for x in segment.live_segments() if x.key[1] == os.fstat(fd).st_ino)
            assert storage.data_ptr() == seg.address + offset and storage.nbytes() == nbytes
            if got.numel():
                size = got.element_size()
                last = storage_offset + sum((n - 1) * s for n, s in zip(shape, strides))
                assert min(strides, default=0) >= 0 and (last + 1) * size <= nbytes
                if got.numel() <= 1 << 16:            # every byte of every element read: no SIGBUS
                    raw = torch.empty(0, dtype=torch.uint8).set_(storage, storage_offset * size, (*shape, size),
                                                                 (*(s * size for s in strides), 1))
                    assert raw.clone().numel() == got.numel() * size
                    try:
                        got.clone()           # and by torch's kernels: no crash
                    except NotImplementedError:           # (complex32 and float8 lack many)
                        assert dtype.itemsize == 1 or dtype is torch.complex32
            del storage, seg, raw
        else:
            assert isinstance(got, mp.SegmentError), repr(got)
            assert re.search(r"tensor header|does not fit|not aligned", str(got)), str(got)
        del got, outcome
        assert_no_fd_left(before, fd)
    finally:
        os.close(fd)


def test_honest_tensor_frame_shows_the_segments_bytes():
    torch = pytest.importorskip("torch")
    fd = sealed_memfd(4096)
    try:
        payload = tensor_frame(64, 512, 8, 1, 0, (4, 8), (8, 1))      # float64, from byte 64 + 8 * 8
        outcome, before = exchange([(HEADER.pack(MAGIC, VERSION, 2, 1, len(payload)) + payload, [fd])])
        what, got = outcome
        assert what == "ok", got
        expected = np.frombuffer(os.pread(fd, 256, 128), dtype=np.float64).reshape(4, 8)
        assert got.dtype == torch.float64 and got.shape == (4, 8)
        assert np.array_equal(got.numpy(), expected, equal_nan=True)
        del got, outcome
        assert_no_fd_left(before, fd)
    finally:
        os.close(fd)


def check_view(a, fd, size, offset, shape, strides, dtype, readonly):
    """``a`` lies inside this process's mapping of ``fd`` and shows the bytes at ``offset``."""
    assert isinstance(a, np.ndarray) and a.flags.writeable is not readonly
    st_ = os.fstat(fd)
    seg = next(s for s in segment.live_segments() if s.key == (st_.st_dev, st_.st_ino))
    assert seg.size == size
    expected = np.ndarray(shape, dtype, buffer=bytearray(os.pread(fd, size, 0)), offset=offset, strides=strides)
    assert (a.shape, a.strides, a.dtype) == (expected.shape, expected.strides, expected.dtype)
    if a.size and a.itemsize:
        start = a.__array_interface__["data"][0]
        low, high = extent(start, a.shape, a.strides, a.itemsize)
        assert seg.address <= low and high <= seg.address + seg.size, "a view outside the mapping"
        if a.nbytes <= 1 << 20:
            assert a.tobytes() == expected.tobytes()         # every element read: no SIGBUS


# -- 3. the fds a frame carries ------------------------------------------------------------------

FD_KINDS = {
    # kind: (make() -> fd, words of the SegmentError, or "ok")
    "sealed memfd": (lambda: sealed_memfd(4096), "ok"),
    "empty sealed memfd": (lambda: sealed_memfd(0), "not a shared-memory segment"),
    "unsealed memfd": (lambda: sealed_memfd(4096, seals=0), "not a sealed"),
    # (a shared dataset's block: mapped copy-on-write)
    "memfd sealed against writes": (lambda: sealed_memfd(4096, seals=SEALS | fcntl.F_SEAL_WRITE),
                                    "ok"),
    "memfd sealed against future writes": (lambda: sealed_memfd(4096, seals=SEALS | F_SEAL_FUTURE_WRITE),
                                           "cannot be mapped"),
    "read-only sealed memfd": (lambda: _reopen_readonly(sealed_memfd(4096)), "cannot be mapped"),
    "pipe": (lambda: _pipe_end(), "not a shared-memory segment"),
    "/dev/zero": (lambda: os.open("/dev/zero", os.O_RDWR | os.O_CLOEXEC), "not a shared-memory segment"),
    "directory": (lambda: os.open("/", os.O_RDONLY | os.O_CLOEXEC), "not a shared-memory segment"),
    "socket": (lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).detach(), "not a shared-memory segment"),
    "regular file": (lambda: _regular_file(), "not a sealed"),
}


def _reopen_readonly(fd):
    ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    os.close(fd)
    return ro


def _pipe_end():
    r, w = os.pipe()
    os.close(w)
    return r


def _regular_file():
    fd, path = tempfile.mkstemp(prefix="fuzz-")
    os.unlink(path)
    os.write(fd, b"x" * 4096)
    return fd


@SETTINGS
@given(st.sampled_from(sorted(FD_KINDS)),
       st.one_of(st.just(0), st.just(0), st.integers(-3, 4), st.sampled_from(["0", 0.0, None, (0,)])))
def test_fds_and_fd_references(kind, index):
    make, expected = FD_KINDS[kind]
    fd = make()
    try:
        payload = pickle.dumps(Array(InBandSegment(index), 8, (4,), (8,), "<f8"), pickle.HIGHEST_PROTOCOL)
        outcome, before = exchange([(HEADER.pack(MAGIC, VERSION, 0, 1, len(payload)) + payload, [fd])])
        if type(index) is not int or index != 0:        # an fd reference the message did not carry
            expect(outcome, mp.ProtocolError, r"refers to fd #.* but carried 1 fds")
        elif expected == "ok":
            what, got = outcome
            assert what == "ok" and got.shape == (4,), got
            assert got.tobytes() == os.pread(fd, 32, 8)
            del got
        else:
            expect(outcome, mp.SegmentError, expected)
        del outcome
        assert_no_fd_left(before, fd)
    finally:
        os.close(fd)


# -- 4. names of file_system segments -------------------------------------------------------------

NAME_KINDS = ["segment", "missing", "symlink", "directory", "fifo", "empty file", "another user's"]


@pytest.fixture(scope="module")
def shm_dir():
    d = tempfile.mkdtemp(prefix="sharedmp-fuzz-")
    old = os.environ.get(named.SHM_DIR_ENV)
    os.environ[named.SHM_DIR_ENV] = d
    manager.ensure()            # the daemon's connection is opened once, not counted as a leak
    yield d
    if old is None:
        os.environ.pop(named.SHM_DIR_ENV, None)
    else:
        os.environ[named.SHM_DIR_ENV] = old
    for n in os.listdir(d):
        os.unlink(os.path.join(d, n)) if not os.path.isdir(os.path.join(d, n)) else os.rmdir(os.path.join(d, n))
    os.rmdir(d)


def _make_named(directory, kind, name):
    path = os.path.join(directory, name)
    if kind == "segment":
        with open(path, "wb") as f:
            f.write(bytes(range(256)) * 16)
        os.chmod(path, 0o600)
    elif kind == "symlink":
        target = os.path.join(directory, "target")
        with open(target, "wb") as f:
            f.write(b"x" * 4096)
        os.symlink(target, path)
    elif kind == "directory":
        os.mkdir(path)
    elif kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "empty file":
        open(path, "wb").close()
    elif kind == "another user's":
        with open(path, "wb") as f:
            f.write(b"x" * 4096)
        if os.getuid() != 0:
            pytest.skip("needs root to give a file to another user")
        os.chown(path, 65534, 65534)
    return path


@SETTINGS
@given(st.one_of(st.sampled_from(NAME_KINDS),
                 st.text(max_size=40), st.sampled_from(["../etc/passwd", "sharedmp_", "sharedmp_" + "0" * 21,
                                                        "sharedmp_" + "G" * 20, "/dev/shm/sharedmp_" + "0" * 20,
                                                        "sharedmp_" + "0" * 20 + "\n"])))
def test_segment_names(shm_dir, name_or_kind):
    if name_or_kind in NAME_KINDS:
        # A fresh name each time: the daemon unlinks an attached name after its last view,
        # and may do so a moment later (it would remove a file made again under that name).
        kind, name = name_or_kind, "sharedmp_" + secrets.token_hex(10)
        if kind != "missing":
            _make_named(shm_dir, kind, name)
        expected = {"segment": "ok", "missing": "no longer exists", "symlink": "cannot be attached",
                    "directory": "not a segment of this user|cannot be attached", "fifo": "not a segment of this user",
                    "empty file": "not a segment of this user", "another user's": "not a segment of this user"}[kind]
    else:
        kind, name = "text", name_or_kind
        assume(not named.NAME_RE.match(name))
        expected = "is not a sharedmp segment name"
    try:
        payload = pickle.dumps(Array(Named(name), 0, (16,), (1,), "|u1"), pickle.HIGHEST_PROTOCOL)
        outcome, before = exchange([(HEADER.pack(MAGIC, VERSION, 0, 0, len(payload)) + payload, [])])
        if expected == "ok":
            what, got = outcome
            assert what == "ok" and got.tobytes() == bytes(range(16)), got
            del got
        else:
            expect(outcome, mp.SegmentError, expected)
        del outcome
        assert_no_fd_left(before)
    finally:
        for n in os.listdir(shm_dir):
            p = os.path.join(shm_dir, n)
            try:
                if os.path.isdir(p) and not os.path.islink(p):
                    os.rmdir(p)
                else:
                    os.unlink(p)
            except FileNotFoundError:     # the daemon unlinked it meanwhile (a moment later)
                pass

"""Hostile, truncated and corrupt input on a sharedmp channel's socket.

Raw bytes (and fds) are written to one end of a ``sharedmp.Pipe()`` through its
socket; the other end's recv() must raise a clear error (``sharedmp.ProtocolError``,
``EOFError`` for a clean end of stream, ``sharedmp.SegmentError`` for an unusable
segment) naming the problem, never allocate what a frame merely claims, never hang,
and close every fd that arrived. Frames are made with ``fdpass.HEADER`` (``<2sBBIQ``:
magic, version, flags, fd count, payload length).

What one frame (or record) alone must make recv() raise is the table ``HOSTILE``, run by
one test; sequences of frames on one channel have tests of their own below it. The
``pipe`` fixture checks that no fd leaks, conftest's ``no_leaks`` that no segment does.
"""
import contextlib
import fcntl
import os
import pickle
import random
import re
import socket
import struct
import tracemalloc
from typing import Callable, NamedTuple

import numpy as np
import pytest

import sharedmp as mp
from sharedmp.channels.fdpass import (FDS_ON_SOCKET, HEADER, MAGIC, MAX_FDS, MAX_PAYLOAD,
                                      PAYLOAD_IN_MEMFD, RECORD, VERSION)
from sharedmp.reductions.ndarray import rebuild_ndarray
from sharedmp.wire import FLAG_ARRAY
from sharedmp.reductions.segment import rebuild_fd_in_band

from conftest import TIMEOUT, open_fds


@pytest.fixture
def pipe():
    """(raw socket of the sending end, sending Connection, receiving Connection); no fd may
    leak."""
    a, b = mp.Pipe()
    before = open_fds(collect=True)
    yield a._sock, a, b
    after = open_fds(collect=True)
    a.close()
    b.close()
    leaked = {fd: _target(fd) for fd in after - before}
    assert not leaked, f"fds left open by the receiver: {leaked}"


def _target(fd):
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


def frame(payload=b"", nfds=0, length=None, magic=MAGIC, version=VERSION, flags=0):
    length = len(payload) if length is None else length
    return HEADER.pack(magic, version, flags, nfds, length) + payload


def recv_now(conn):
    """recv() that must not block: the data (or EOF) is there already."""
    assert conn.poll(TIMEOUT)
    return conn.recv()


def memfd(size=4096, sealed=True):
    fd = os.memfd_create("hostile-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if sealed:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


class InBandSegment:
    """Pickles as sharedmp's in-band segment reference to fd #index of the message."""

    def __init__(self, index):
        self.index = index

    def __reduce__(self):
        return rebuild_fd_in_band, (self.index,)


class InBandArray:
    """Pickles as an array over fd #index: what the ndarray reducer writes, with any header."""

    def __init__(self, index, offset, shape, strides, dtype="<f8"):
        self.args = (InBandSegment(index), offset, shape, strides, dtype, False)

    def __reduce__(self):
        return rebuild_ndarray, self.args


def payload_of(obj):
    return pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)


def _payload_memfd(data, seals=fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW, size=None):
    fd = os.memfd_create("hostile-payload", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    if size is not None:
        os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


# -- one hostile frame: the table ----------------------------------------------------------
# Each case's ``send(raw, a, keep)`` writes to the raw socket of the sending end ``a`` (and
# may close ``a``); ``keep(fd_or_socket)`` closes that on the sending side once recv() has
# raised. ``recv`` must then raise ``error`` whose message matches ``match``, allocating
# less than ``peak`` bytes; ``after(a, b)``, where given, checks the channel afterwards.

class Hostile(NamedTuple):
    id: str
    send: Callable
    error: type
    match: "str | None"
    after: "Callable | None" = None
    recv: Callable = recv_now
    peak: int = 64 << 20             # a frame that claims more than it carries gets none of it


def sends(data, then_close=False):
    """The peer writes ``data`` as one record (then closes its end)."""
    def send(raw, a, keep):
        raw.sendall(data)
        if then_close:
            a.close()
    return send


def sends_fds(data, make_fds):
    """The peer writes ``data`` with the fds that ``make_fds(keep)`` returns."""
    def send(raw, a, keep):
        socket.send_fds(raw, [data], make_fds(keep))
    return send


def closes(raw, a, keep):
    a.close()


JUNK = bytes(random.Random(1234).randrange(256) for _ in range(256))


def sends_junk(raw, a, keep):
    assert JUNK[:2] != MAGIC
    raw.sendall(JUNK)


def fds_on_a_side_socket(batches):
    """300 fds announced on a socket that holds ``batches`` [(marker, count of fds)]."""
    def send(raw, a, keep):
        fd = keep(memfd())
        side_r, side_w = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        keep(side_w)            # recv() must not wait for more: the peer still holds this end
        for marker, count in batches:
            socket.send_fds(side_w, [marker], [fd] * count)
        socket.send_fds(raw, [frame(payload_of(None), nfds=300, flags=FDS_ON_SOCKET)],
                        [side_r.fileno()])
        side_r.close()
    return send


AT_0 = struct.pack("<Q", 0)       # where the payload starts in its memfd


def payload_in_memfd(make):
    """A PAYLOAD_IN_MEMFD frame over (fd, length, offset) = ``make(data, keep)``."""
    def send(raw, a, keep):
        data = payload_of(list(range(1000)))
        fd, length, offset = make(data, keep)
        socket.send_fds(raw, [frame(offset, length=length, flags=PAYLOAD_IN_MEMFD)], [fd])
    return send


def read_end_of_a_closed_pipe():
    r, w = os.pipe()
    os.close(w)
    return r


def goes_on(a, b):
    """The frame was whole: the channel goes on."""
    a.send("next")
    assert recv_now(b) == "next"


def still_eof(a, b):
    with pytest.raises(EOFError):
        b.recv_bytes()


def with_fd(make_fd):
    return lambda keep: [keep(make_fd())]


def array_by_value(shape, strides, data, code=b"<f8"):
    """An array frame by value (no fd): encode_array's header (offset 0), then ``data``."""
    n = len(shape)
    return frame(struct.pack("<QBB?", 0, n, len(code), False) + code
                 + struct.pack(f"<{2 * n}q", *shape, *strides) + data, flags=FLAG_ARRAY)


NONE = payload_of(None)
BAD_HEADERS = [(b"XX", VERSION), (b"MS", VERSION), (MAGIC, VERSION + 1), (MAGIC, 0)]

HOSTILE = [
    # garbage, bad headers
    Hostile("random_bytes", sends_junk, mp.ProtocolError, "not a sharedmp frame"),
    Hostile("random_bytes_shorter_than_a_header_then_close",
            sends(b"\x07garbage", then_close=True),                  # 8 bytes
            mp.ProtocolError, "record of 8 bytes, shorter than a frame header"),
    *[Hostile(f"bad_magic_or_version-{magic.decode()}-{version}",
              sends(frame(b"\x80\x05N.", magic=magic, version=version)), mp.ProtocolError,
              # the header it saw is in the message
              r"not a sharedmp frame \(header b." + re.escape(repr(magic)[2:-1]))
      for magic, version in BAD_HEADERS],
    # lengths that lie
    Hostile("length_over_the_bound_is_refused_before_anything_is_read",
            sends(frame(b"tiny", length=MAX_PAYLOAD + 1)),                # 1 TiB + 1 claimed
            mp.ProtocolError, "over the sane bounds", peak=1 << 20),
    Hostile("fd_count_over_the_bound", sends(frame(b"", nfds=MAX_FDS + 1)),
            mp.ProtocolError, "over the sane bounds"),
    Hostile("huge_claimed_length_then_close_does_not_allocate_it",
            sends(frame(b"0123456789", length=MAX_PAYLOAD), then_close=True),  # 1 TiB claimed
            mp.ProtocolError, "carries 10 payload bytes, its header announces"),
    Hostile("claims_100_bytes_sends_10_then_closes",
            sends(frame(b"0123456789", length=100), then_close=True),
            mp.ProtocolError, "carries 10 payload bytes, its header announces 100"),
    Hostile("record_longer_than_any_sharedmp_sends",
            sends(frame(b"x" * RECORD)),              # 16 bytes more than the largest record
            mp.ProtocolError, f"record longer than {RECORD} bytes"),
    Hostile("short_payload_then_close_through_recv_bytes",
            sends(frame(b"abc", length=4), then_close=True),
            mp.ProtocolError, "carries 3 payload bytes, its header announces 4",
            recv=lambda b: b.recv_bytes()),
    Hostile("truncated_header", sends(frame(b"payload")[:7], then_close=True),  # mid-header
            mp.ProtocolError, "record of 7 bytes, shorter than a frame header"),
    # closed peer
    Hostile("closed_peer_is_eof", closes, EOFError, "closed", after=still_eof),
    # fds that do not match the header
    Hostile("announces_3_fds_sends_1", sends_fds(frame(NONE, nfds=3), with_fd(memfd)),
            mp.ProtocolError, "announces 3 fds but 1 arrived"),
    Hostile("announces_0_fds_sends_2_and_both_are_closed",      # (by the receiver: the fixture)
            sends_fds(frame(NONE, nfds=0), lambda keep: [keep(fd) for fd in os.pipe()]),
            mp.ProtocolError, "announces 0 fds but 2 arrived"),
    Hostile("announces_1_fd_sends_none", sends(frame(NONE, nfds=1)),
            mp.ProtocolError, "announces 1 fds but 0 arrived"),
    # more fds than one record carries must wait on a socket (FDS_ON_SOCKET); the 253 that
    # arrived are closed (the fixture)
    Hostile("254_fds_announced_253_in_the_record",
            sends_fds(frame(NONE, nfds=254), lambda keep: [keep(memfd())] * 253),
            mp.ProtocolError, "announces 254 fds but 253 arrived"),
    Hostile("fds_on_a_socket_that_is_not_one",
            sends_fds(frame(NONE, nfds=300, flags=FDS_ON_SOCKET), with_fd(memfd)),
            mp.ProtocolError, "should wait on a socket, and its fd is not one"),
    # on a socket that holds fewer (or wrong markers, or too many)
    *[Hostile(f"fds_on_a_socket_that_does_not_hold_them-{name}", fds_on_a_side_socket(batches),
              mp.ProtocolError, "does not hold them")
      for name, batches in [("none", []), ("10", [(b"+", 10)]),
                            ("wrong_marker", [(b"+", 253), (b"x", 47)]),
                            ("301", [(b"+", 253), (b"+", 48)])]],
    # a payload in a memfd that is not right
    *[Hostile(f"payload_in_a_memfd_that_is_not_right-{name}", payload_in_memfd(make),
              mp.ProtocolError, "memfd")
      for name, make in [
          ("unsealed", lambda d, keep: (keep(_payload_memfd(d, seals=0)), len(d), AT_0)),
          ("shorter", lambda d, keep: (keep(_payload_memfd(d)), len(d) + 1, AT_0)),
          ("past_the_end", lambda d, keep: (keep(_payload_memfd(d)), len(d),
                                            struct.pack("<Q", 2 ** 64 - 1))),
          # claims 1 GiB it never wrote: not allocated here
          ("sparse", lambda d, keep: (keep(_payload_memfd(d, size=1 << 30)), 1 << 30, AT_0)),
          ("a_pipe", lambda d, keep: (keep(read_end_of_a_closed_pipe()), len(d), AT_0)),
          ("no_offset", lambda d, keep: (keep(_payload_memfd(d)), len(d), b"x")),
      ]],
    # payloads that refer to fds or segments they should not
    Hostile("pickle_refers_to_fd_index_5_when_1_came",
            sends_fds(frame(payload_of(InBandSegment(5)), nfds=1), with_fd(memfd)),
            mp.ProtocolError, "fd #5 but carried 1 fds", after=goes_on),
    Hostile("in_band_reference_without_fds", sends(frame(payload_of(InBandSegment(0)))),
            mp.ProtocolError, "fd #0 but carried 0 fds"),
    Hostile("unsealed_memfd_is_refused",
            sends_fds(frame(payload_of(InBandSegment(0)), nfds=1),
                      with_fd(lambda: memfd(sealed=False))),
            mp.SegmentError, "not a sealed", after=goes_on),
    Hostile("fd_that_is_not_a_segment_is_refused",                 # a pipe's read end
            sends_fds(frame(payload_of(InBandSegment(0)), nfds=1),
                      lambda keep: [keep(fd) for fd in os.pipe()][:1]),
            mp.SegmentError, "not a shared-memory segment"),
    Hostile("garbage_pickle_in_a_valid_frame",
            sends_fds(frame(b"\x80\x05not a pickle", nfds=1), with_fd(memfd)),
            pickle.UnpicklingError, None, after=goes_on),
    # an array frame by value: its strides must be exactly the C or the F strides of its
    # shape (the receiver copies the bytes in that order), its shape must fit its bytes
    *[Hostile(f"array_by_value_strides_neither_c_nor_f-{name}",
              sends(array_by_value((3, 4), strides, bytes(96))),
              mp.ProtocolError, "neither the C nor the F strides", after=goes_on)
      for name, strides in [("overlapping", (8, 8)), ("negative", (-32, 8)),
                            ("zero", (0, 0)), ("of_a_view", (64, 16))]],
    Hostile("array_by_value_huge_shape_with_a_zero_dimension",         # 0 bytes, 2**124 claimed
            sends(array_by_value((0, 2 ** 62, 2 ** 62), (8, 8, 8), b"")),
            mp.ProtocolError, "array frame by value .* too big", after=goes_on, peak=1 << 20),
    Hostile("array_by_value_shape_larger_than_its_bytes",              # 1 TiB claimed, 8 sent
            sends(array_by_value((1 << 37,), (8,), bytes(8))),
            mp.ProtocolError, "does not hold an array", after=goes_on, peak=1 << 20),
]


@pytest.mark.parametrize("case", HOSTILE, ids=[c.id for c in HOSTILE])
def test_hostile_frame_is_refused(pipe, case):
    raw, a, b = pipe
    with contextlib.ExitStack() as later:
        def keep(x):
            if isinstance(x, int):
                later.callback(os.close, x)
            else:
                later.callback(x.close)
            return x
        case.send(raw, a, keep)
        tracemalloc.start()
        try:
            with pytest.raises(case.error, match=case.match):
                case.recv(b)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < case.peak, f"recv() allocated {peak} bytes for a frame that carried little"
    if case.after is not None:
        case.after(a, b)


def test_protocol_error_is_a_connection_error():
    assert issubclass(mp.ProtocolError, ConnectionError)


# -- frames in sequence on one channel ---------------------------------------------------------

def test_first_record_runs_past_its_frame(pipe):
    raw, a, b = pipe
    raw.sendall(frame(b"0123456789", length=4))      # one record: header + 10 bytes, 4 claimed
    raw.sendall(frame(payload_of("next")))
    with pytest.raises(mp.ProtocolError, match="carries 10 payload bytes, its header announces 4"):
        recv_now(b)
    assert recv_now(b) == "next"                  # records keep frames apart: the next is whole


def test_a_frame_never_continues_in_the_next_record(pipe):
    raw, a, b = pipe
    raw.sendall(frame(length=4))
    raw.sendall(b"0123")
    with pytest.raises(mp.ProtocolError, match="carries 0 payload bytes, its header announces 4"):
        recv_now(b)
    with pytest.raises(mp.ProtocolError, match="record of 4 bytes, shorter than a frame header"):
        recv_now(b)


def test_header_in_pieces_is_refused_and_the_channel_goes_on(pipe):
    """A frame is one record: a peer that writes a header in two pieces is not sharedmp."""
    raw, a, b = pipe
    data = frame(payload_of(("ok", 1)))
    raw.sendall(data[:8])
    raw.sendall(data[8:])
    raw.sendall(data)
    with pytest.raises(mp.ProtocolError, match="record of 8 bytes, shorter than a frame header"):
        recv_now(b)
    with pytest.raises(mp.ProtocolError, match="not a sharedmp frame"):
        recv_now(b)
    assert recv_now(b) == ("ok", 1)


def test_closed_peer_after_a_whole_frame(pipe):
    raw, a, b = pipe
    raw.sendall(frame(payload_of("whole")))
    a.close()
    assert recv_now(b) == "whole"
    with pytest.raises(EOFError):
        b.recv()


def test_payload_in_a_memfd_made_by_hand_is_read():
    """The honest form, written by hand: what send_frame does for a large payload."""
    a, b = mp.Pipe()
    with a, b:
        data = payload_of(list(range(50_000)))
        fd = _payload_memfd(b"junk" + data + b"more")
        try:
            socket.send_fds(a._sock, [frame(struct.pack("<Q", 4), length=len(data),
                                            flags=PAYLOAD_IN_MEMFD)], [fd])
        finally:
            os.close(fd)
        assert recv_now(b) == list(range(50_000))


def test_array_that_does_not_fit_its_segment_is_refused(pipe):
    raw, a, b = pipe
    fd = memfd(4096)
    try:
        for args in ((0, (1000,), (8,)),            # 8000 bytes in a 4096-byte segment
                     (4090, (2,), (8,)),            # runs off the end
                     (0, (10,), (-8,))):            # negative strides below the start
            socket.send_fds(raw, [frame(payload_of(InBandArray(0, *args)), nfds=1)], [fd])
            with pytest.raises(mp.SegmentError, match="does not fit"):
                recv_now(b)
        socket.send_fds(raw, [frame(payload_of(InBandArray(0, 8, (4,), (8,))), nfds=1)], [fd])
        ok = recv_now(b)                            # an honest header over the same fd is fine
        assert ok.shape == (4,) and (ok == 0).all()
        del ok
    finally:
        os.close(fd)


# -- the same on a Queue -----------------------------------------------------------------------

def test_queue_get_raises_protocol_error():
    q = mp.get_context("fork").Queue()
    before = open_fds(collect=True)
    fd = memfd()
    try:
        socket.send_fds(q._writer._sock, [frame(payload_of(None), nfds=2)], [fd])
        with pytest.raises(mp.ProtocolError, match="announces 2 fds but 1 arrived"):
            q.get(timeout=TIMEOUT)
    finally:
        os.close(fd)
    assert open_fds(collect=True) - before == set()
    q.close()
    q.join_thread()


def test_simplequeue_get_raises_protocol_error():
    q = mp.get_context("fork").SimpleQueue()
    q._writer._sock.sendall(b"definitely not a frame")
    assert q._reader.poll(TIMEOUT)
    with pytest.raises(mp.ProtocolError, match="not a sharedmp frame"):
        q.get()
    q.close()


def test_fds_dropped_by_the_kernel_msg_ctrunc(pipe):
    """The receiver's fd limit is reached: the kernel drops fds (MSG_CTRUNC); the error says
    so and the fds that did arrive are closed."""
    import resource
    raw, a, b = pipe
    fd = memfd()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        socket.send_fds(raw, [frame(payload_of(None), nfds=10)], [fd] * 10)
        assert b.poll(TIMEOUT)
        used = {int(n) for n in os.listdir("/proc/self/fd")}
        limit, free = 0, 0
        while free < 3:                      # room for 2 of the 10 (and none to spare)
            free += limit not in used
            limit += 1
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit - 1, hard))
        try:
            with pytest.raises(mp.ProtocolError, match="MSG_CTRUNC"):
                b.recv()
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    finally:
        os.close(fd)


@pytest.mark.parametrize("order", ["C", "F"])
def test_array_frame_by_value_in_either_order_made_by_hand(pipe, order):
    """The honest forms: C or F strides, the bytes in that order; the array keeps the order."""
    raw, a, b = pipe
    want = np.arange(12.0).reshape(3, 4, order=order)
    strides = (32, 8) if order == "C" else (8, 24)
    raw.sendall(array_by_value((3, 4), strides, want.tobytes(order=order)))
    got = recv_now(b)
    assert got.strides == strides and np.array_equal(got, want) and got.flags.writeable

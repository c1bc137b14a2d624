"""Hostile, truncated and corrupt input on a sharedmp channel's socket.

Raw bytes (and fds) are written to one end of a ``sharedmp.Pipe()`` through its
socket; the other end's recv() must raise a clear error (``sharedmp.ProtocolError``,
``EOFError`` for a clean end of stream, ``sharedmp.SegmentError`` for an unusable
segment) naming the problem, never allocate what a frame merely claims, never hang,
and close every fd that arrived. Frames are made with ``fdpass.HEADER`` (``<2sBBIQ``:
magic, version, flags, fd count, payload length).
"""
import fcntl
import gc
import os
import pickle
import random
import socket
import struct
import threading
import tracemalloc

import numpy as np
import pytest

import sharedmp as mp
from sharedmp.channels.fdpass import (FDS_ON_SOCKET, HEADER, MAGIC, MAX_FDS, MAX_PAYLOAD, PAYLOAD_IN_MEMFD,
                                      RECORD, VERSION)
from sharedmp.channels.connection import dumps
from sharedmp.memory import arena, segment
from sharedmp.reductions.ndarray import rebuild_ndarray
from sharedmp.reductions.segment import rebuild_fd_in_band

from conftest import TIMEOUT


def open_fds():
    segment.forget_recent()        # attached segments kept mapped on purpose are not leaks
    gc.collect()
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture
def pipe():
    """(raw socket of the sending end, sending Connection, receiving Connection); no fd may leak."""
    a, b = mp.Pipe()
    before = open_fds()
    yield a._sock, a, b
    after = open_fds()
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
    return HEADER.pack(magic, version, flags, nfds, len(payload) if length is None else length) + payload


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


# -- garbage, bad headers ----------------------------------------------------------------------

def test_random_bytes(pipe):
    raw, a, b = pipe
    rng = random.Random(1234)
    junk = bytes(rng.randrange(256) for _ in range(256))
    assert junk[:2] != MAGIC
    raw.sendall(junk)
    with pytest.raises(mp.ProtocolError, match="not a sharedmp frame"):
        recv_now(b)


def test_random_bytes_shorter_than_a_header_then_close(pipe):
    raw, a, b = pipe
    raw.sendall(b"\x07garbage")                    # 8 bytes, then the peer goes away
    a.close()
    with pytest.raises(mp.ProtocolError, match="record of 8 bytes, shorter than a frame header"):
        recv_now(b)


@pytest.mark.parametrize("magic,version", [(b"XX", VERSION), (b"MS", VERSION), (MAGIC, VERSION + 1),
                                           (MAGIC, 0)])
def test_bad_magic_or_version(pipe, magic, version):
    raw, a, b = pipe
    raw.sendall(frame(b"\x80\x05N.", magic=magic, version=version))
    with pytest.raises(mp.ProtocolError, match="not a sharedmp frame") as info:
        recv_now(b)
    assert repr(magic)[2:-1] in str(info.value)     # the header it saw is in the message


def test_protocol_error_is_a_connection_error():
    assert issubclass(mp.ProtocolError, ConnectionError)


# -- lengths that lie --------------------------------------------------------------------------

def test_length_over_the_bound_is_refused_before_anything_is_read(pipe):
    raw, a, b = pipe
    raw.sendall(frame(b"tiny", length=MAX_PAYLOAD + 1))          # claims 1 TiB + 1
    tracemalloc.start()
    try:
        with pytest.raises(mp.ProtocolError, match="over the sane bounds"):
            recv_now(b)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_fd_count_over_the_bound(pipe):
    raw, a, b = pipe
    raw.sendall(frame(b"", nfds=MAX_FDS + 1))
    with pytest.raises(mp.ProtocolError, match="over the sane bounds"):
        recv_now(b)


def test_huge_claimed_length_then_close_does_not_allocate_it(pipe):
    raw, a, b = pipe
    raw.sendall(frame(b"0123456789", length=MAX_PAYLOAD))          # 1 TiB claimed, 10 bytes sent
    a.close()
    tracemalloc.start()
    try:
        with pytest.raises(mp.ProtocolError, match="carries 10 payload bytes, its header announces"):
            recv_now(b)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"{peak} bytes allocated for a frame of 10 bytes"


def test_claims_100_bytes_sends_10_then_closes(pipe):
    raw, a, b = pipe
    raw.sendall(frame(b"0123456789", length=100))
    a.close()
    with pytest.raises(mp.ProtocolError, match="carries 10 payload bytes, its header announces 100"):
        recv_now(b)


def test_first_record_runs_past_its_frame(pipe):
    raw, a, b = pipe
    raw.sendall(frame(b"0123456789", length=4))          # one record: header + 10 bytes, 4 claimed
    raw.sendall(frame(payload_of("next")))
    with pytest.raises(mp.ProtocolError, match="carries 10 payload bytes, its header announces 4"):
        recv_now(b)
    assert recv_now(b) == "next"                      # records keep frames apart: the next is whole


def test_a_frame_never_continues_in_the_next_record(pipe):
    raw, a, b = pipe
    raw.sendall(frame(length=4))
    raw.sendall(b"0123")
    with pytest.raises(mp.ProtocolError, match="carries 0 payload bytes, its header announces 4"):
        recv_now(b)
    with pytest.raises(mp.ProtocolError, match="record of 4 bytes, shorter than a frame header"):
        recv_now(b)


def test_record_longer_than_any_sharedmp_sends(pipe):
    raw, a, b = pipe
    raw.sendall(frame(b"x" * RECORD))                 # 16 bytes more than the largest record
    with pytest.raises(mp.ProtocolError, match=f"record longer than {RECORD} bytes"):
        recv_now(b)


def test_short_payload_then_close_through_recv_bytes(pipe):
    raw, a, b = pipe
    raw.sendall(frame(b"abc", length=4))
    a.close()
    with pytest.raises(mp.ProtocolError, match="carries 3 payload bytes, its header announces 4"):
        b.recv_bytes()


def test_truncated_header(pipe):
    raw, a, b = pipe
    raw.sendall(frame(b"payload")[:7])                             # peer closes mid-header
    a.close()
    with pytest.raises(mp.ProtocolError, match="record of 7 bytes, shorter than a frame header"):
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


# -- closed peer -------------------------------------------------------------------------------

def test_closed_peer_is_eof(pipe):
    raw, a, b = pipe
    a.close()
    with pytest.raises(EOFError, match="closed"):
        recv_now(b)
    with pytest.raises(EOFError):
        b.recv_bytes()


def test_closed_peer_after_a_whole_frame(pipe):
    raw, a, b = pipe
    raw.sendall(frame(payload_of("whole")))
    a.close()
    assert recv_now(b) == "whole"
    with pytest.raises(EOFError):
        b.recv()


# -- fds that do not match the header ----------------------------------------------------------

def test_announces_3_fds_sends_1(pipe):
    raw, a, b = pipe
    fd = memfd()
    try:
        socket.send_fds(raw, [frame(payload_of(None), nfds=3)], [fd])
        with pytest.raises(mp.ProtocolError, match="announces 3 fds but 1 arrived"):
            recv_now(b)
    finally:
        os.close(fd)


def test_announces_0_fds_sends_2_and_both_are_closed(pipe):
    raw, a, b = pipe
    r, w = os.pipe()
    try:
        socket.send_fds(raw, [frame(payload_of(None), nfds=0)], [r, w])
        with pytest.raises(mp.ProtocolError, match="announces 0 fds but 2 arrived"):
            recv_now(b)
    finally:
        os.close(r)
        os.close(w)
    # the fixture checks that the two received fds were closed


def test_announces_1_fd_sends_none(pipe):
    raw, a, b = pipe
    raw.sendall(frame(payload_of(None), nfds=1))
    with pytest.raises(mp.ProtocolError, match="announces 1 fds but 0 arrived"):
        recv_now(b)


def test_254_fds_announced_253_in_the_record(pipe):
    """More fds than one record carries must wait on a socket (FDS_ON_SOCKET)."""
    raw, a, b = pipe
    fd = memfd()
    try:
        socket.send_fds(raw, [frame(payload_of(None), nfds=254)], [fd] * 253)
        with pytest.raises(mp.ProtocolError, match="announces 254 fds but 253 arrived"):
            recv_now(b)
    finally:
        os.close(fd)
    # the fixture checks that the 253 that arrived were closed


def test_fds_on_a_socket_that_is_not_one(pipe):
    raw, a, b = pipe
    fd = memfd()
    try:
        socket.send_fds(raw, [frame(payload_of(None), nfds=300, flags=FDS_ON_SOCKET)], [fd])
        with pytest.raises(mp.ProtocolError, match="should wait on a socket, and its fd is not one"):
            recv_now(b)
    finally:
        os.close(fd)


@pytest.mark.parametrize("batches", [[], [(b"+", 10)], [(b"+", 253), (b"x", 47)], [(b"+", 253), (b"+", 48)]])
def test_fds_on_a_socket_that_does_not_hold_them(pipe, batches):
    """300 fds announced on a socket that holds fewer (or wrong markers, or too many)."""
    raw, a, b = pipe
    fd = memfd()
    side_r, side_w = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        for marker, count in batches:
            socket.send_fds(side_w, [marker], [fd] * count)
        socket.send_fds(raw, [frame(payload_of(None), nfds=300, flags=FDS_ON_SOCKET)], [side_r.fileno()])
        side_r.close()
        with pytest.raises(mp.ProtocolError, match="does not hold them"):
            recv_now(b)     # without waiting for more: the peer still holds the socket's other end
    finally:
        side_w.close()
        os.close(fd)


def _payload_memfd(data, seals=fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW, size=None):
    fd = os.memfd_create("hostile-payload", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    if size is not None:
        os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def test_payload_in_a_memfd_made_by_hand_is_read():
    """The honest form, written by hand: what send_frame does for a large payload."""
    a, b = mp.Pipe()
    with a, b:
        data = payload_of(list(range(50_000)))
        fd = _payload_memfd(b"junk" + data + b"more")
        try:
            socket.send_fds(a._sock, [frame(struct.pack("<Q", 4), length=len(data), flags=PAYLOAD_IN_MEMFD)], [fd])
        finally:
            os.close(fd)
        assert recv_now(b) == list(range(50_000))


@pytest.mark.parametrize("case", ["unsealed", "shorter", "past the end", "sparse", "a pipe", "no offset"])
def test_payload_in_a_memfd_that_is_not_right(pipe, case):
    raw, a, b = pipe
    data = payload_of(list(range(1000)))
    length, offset = len(data), struct.pack("<Q", 0)
    if case == "unsealed":
        fd = _payload_memfd(data, seals=0)
    elif case == "shorter":
        fd, length = _payload_memfd(data), length + 1
    elif case == "past the end":
        fd, offset = _payload_memfd(data), struct.pack("<Q", 2 ** 64 - 1)
    elif case == "sparse":                      # claims 1 GiB it never wrote: not allocated here
        fd, length = _payload_memfd(data, size=1 << 30), 1 << 30
    elif case == "a pipe":
        r, w = os.pipe()
        os.close(w)
        fd = r
    else:
        fd, offset = _payload_memfd(data), b"x"
    try:
        socket.send_fds(raw, [frame(offset, length=length, flags=PAYLOAD_IN_MEMFD)], [fd])
        with pytest.raises(mp.ProtocolError, match="memfd"):
            recv_now(b)
    finally:
        os.close(fd)


# -- payloads that refer to fds or segments they should not ------------------------------------

def test_pickle_refers_to_fd_index_5_when_1_came(pipe):
    raw, a, b = pipe
    fd = memfd()
    try:
        socket.send_fds(raw, [frame(payload_of(InBandSegment(5)), nfds=1)], [fd])
        with pytest.raises(mp.ProtocolError, match="fd #5 but carried 1 fds"):
            recv_now(b)
    finally:
        os.close(fd)
    a.send("next")                                  # the frame was whole: the channel goes on
    assert recv_now(b) == "next"


def test_in_band_reference_without_fds(pipe):
    raw, a, b = pipe
    raw.sendall(frame(payload_of(InBandSegment(0))))
    with pytest.raises(mp.ProtocolError, match="fd #0 but carried 0 fds"):
        recv_now(b)


def test_unsealed_memfd_is_refused(pipe):
    raw, a, b = pipe
    fd = memfd(sealed=False)
    try:
        socket.send_fds(raw, [frame(payload_of(InBandSegment(0)), nfds=1)], [fd])
        with pytest.raises(mp.SegmentError, match="not a sealed"):
            recv_now(b)
    finally:
        os.close(fd)
    a.send("next")
    assert recv_now(b) == "next"


def test_fd_that_is_not_a_segment_is_refused(pipe):
    raw, a, b = pipe
    r, w = os.pipe()
    try:
        socket.send_fds(raw, [frame(payload_of(InBandSegment(0)), nfds=1)], [r])
        with pytest.raises(mp.SegmentError, match="not a shared-memory segment"):
            recv_now(b)
    finally:
        os.close(r)
        os.close(w)


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


def test_garbage_pickle_in_a_valid_frame(pipe):
    raw, a, b = pipe
    fd = memfd()
    try:
        socket.send_fds(raw, [frame(b"\x80\x05not a pickle", nfds=1)], [fd])
        with pytest.raises(pickle.UnpicklingError):
            recv_now(b)
    finally:
        os.close(fd)
    a.send("next")
    assert recv_now(b) == "next"


# -- the same on a Queue -----------------------------------------------------------------------

def test_queue_get_raises_protocol_error():
    q = mp.get_context("fork").Queue()
    before = open_fds()
    fd = memfd()
    try:
        socket.send_fds(q._writer._sock, [frame(payload_of(None), nfds=2)], [fd])
        with pytest.raises(mp.ProtocolError, match="announces 2 fds but 1 arrived"):
            q.get(timeout=TIMEOUT)
    finally:
        os.close(fd)
    assert open_fds() - before == set()
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

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
import threading
import tracemalloc

import numpy as np
import pytest

import sharedmp as mp
from sharedmp.channels.fdpass import HEADER, MAGIC, MAX_FDS, MAX_PAYLOAD, RECORD, VERSION
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
    with pytest.raises(mp.ProtocolError, match=r"middle of a frame \(header\)"):
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
        with pytest.raises(mp.ProtocolError, match=r"middle of a frame \(payload\)"):
            recv_now(b)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"{peak} bytes allocated for a frame of 10 bytes"


def test_claims_100_bytes_sends_10_then_closes(pipe):
    raw, a, b = pipe
    raw.sendall(frame(b"0123456789", length=100))
    a.close()
    with pytest.raises(mp.ProtocolError, match=r"peer closed the connection in the middle of a frame \(payload\)"):
        recv_now(b)


def test_first_record_runs_past_its_frame(pipe):
    raw, a, b = pipe
    raw.sendall(frame(b"0123456789", length=4))          # one record: header + 10 bytes, 4 claimed
    raw.sendall(frame(payload_of("next")))
    with pytest.raises(mp.ProtocolError, match="carries 10 payload bytes, its header announces 4"):
        recv_now(b)
    assert recv_now(b) == "next"                      # records keep frames apart: the next is whole


def test_payload_record_runs_past_its_frame(pipe):
    raw, a, b = pipe
    raw.sendall(frame(length=4))
    raw.sendall(b"0123456789")
    with pytest.raises(mp.ProtocolError, match=r"record of 10 bytes runs past the end of its frame \(4 bytes"):
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
    with pytest.raises(mp.ProtocolError, match="middle of a frame"):
        b.recv_bytes()


def test_truncated_header(pipe):
    raw, a, b = pipe
    raw.sendall(frame(b"payload")[:7])                             # peer closes mid-header
    a.close()
    with pytest.raises(mp.ProtocolError, match=r"middle of a frame \(header\)"):
        recv_now(b)


def test_header_in_pieces_is_fine(pipe):
    """A slow but honest peer: the header and payload arrive in several pieces."""
    raw, a, b = pipe
    data = frame(payload_of(("ok", 1)))

    def dribble():
        for i in range(len(data)):
            raw.sendall(data[i:i + 1])

    t = threading.Thread(target=dribble)
    t.start()
    try:
        assert recv_now(b) == ("ok", 1)
    finally:
        t.join(TIMEOUT)


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


def test_fd_batches_that_do_not_match(pipe):
    """254 fds announced: 253 come with the header, then the batch marker is wrong."""
    raw, a, b = pipe
    fd = memfd()
    try:
        socket.send_fds(raw, [frame(b"", nfds=254)], [fd] * 253)
        socket.send_fds(raw, [b"x"], [fd])
        with pytest.raises(mp.ProtocolError, match="fd batches"):
            recv_now(b)
    finally:
        os.close(fd)
    # 254 fds arrived in all: the fixture checks every one was closed


def test_more_fds_than_one_message_carries_honestly():
    """The honest counterpart: 300 distinct segments in one message (2 fd batches), with a
    payload of several records after them."""
    a, b = mp.Pipe()
    with a, b:
        big = [mp.zeros(arena.SMALL_LIMIT, dtype=np.uint8) for _ in range(300)]   # one segment each
        for i, x in enumerate(big):
            x[0] = i % 251
        tail = bytes(range(256)) * 1000                   # 256,000 bytes: 4 records
        assert len(dumps((big, tail))[1]) == 300
        a.send((big, tail))
        got, got_tail = recv_now(b)
        assert [int(x[0]) for x in got] == [i % 251 for i in range(300)]
        assert got_tail == tail
        del got, big


@pytest.mark.parametrize("size", [0, RECORD - HEADER.size - 1, RECORD - HEADER.size, RECORD - HEADER.size + 1,
                                  3 * RECORD + 5])
def test_payloads_around_the_record_size(size):
    a, b = mp.Pipe()
    with a, b:
        data = bytes(i % 253 for i in range(size))
        t = threading.Thread(target=a.send_bytes, args=(data,))   # may take more than the socket buffer
        t.start()
        try:
            assert b.poll(TIMEOUT)
            assert b.recv_bytes() == data
        finally:
            t.join(TIMEOUT)


def test_raw_bytes_with_fds_are_dropped_by_recv_bytes(pipe):
    raw, a, b = pipe
    fd = memfd()
    try:
        socket.send_fds(raw, [frame(b"abc", nfds=1)], [fd])
        assert b.recv_bytes() == b"abc"
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

"""sharedmp.Pipe / Connection: the multiprocessing.connection API over fd-carrying sockets.

Real processes and real sockets. Every wait is bounded (poll/get with a timeout,
join_or_kill), so a broken channel fails a test instead of hanging the suite.
"""
import gc
import multiprocessing
import multiprocessing.connection
import pickle
import threading

import numpy as np
import pytest

import sharedmp as mp
from sharedmp.channels.connection import Connection

import _channel_workers as cw
from conftest import TIMEOUT, data_ptr, join_or_kill, start_process

BIG = 50 << 20          # well beyond the socket buffer (1 MiB asked, often less granted)


def _recv(conn, timeout=TIMEOUT):
    assert conn.poll(timeout), "nothing arrived in time"
    return conn.recv()


# -- in one process ----------------------------------------------------------------------

def test_types():
    a, b = mp.Pipe()
    with a, b:
        assert type(a) is Connection and type(b) is Connection
        assert a.readable and a.writable and b.readable and b.writable
        assert "fd=" in repr(a)
    assert a.closed and b.closed and "closed" in repr(a)


@pytest.mark.parametrize("direction", ["a->b", "b->a"])
def test_poll_false_then_true(direction):
    a, b = mp.Pipe()
    with a, b:
        src, dst = (a, b) if direction == "a->b" else (b, a)
        assert dst.poll() is False
        assert dst.poll(0.05) is False
        src.send({"x": 1, "arr": np.arange(3)})
        assert dst.poll(TIMEOUT) is True
        assert dst.poll(None) is True                  # already readable: returns at once
        got = dst.recv()
        # (a small plain array travels by value: reductions/ndarray.py)
        assert got["x"] == 1 and got["arr"].tolist() == [0, 1, 2] and not mp.is_shared(got["arr"])
        assert dst.poll(0) is False


def test_poll_wakes_when_data_arrives_later():
    a, b = mp.Pipe()
    with a, b:
        t = threading.Timer(0.1, a.send, args=("late",))
        t.start()
        try:
            assert b.poll(TIMEOUT) is True
            assert b.recv() == "late"
        finally:
            t.join(TIMEOUT)


def test_one_way_pipe_ends():
    r, w = mp.Pipe(duplex=False)
    with r, w:
        assert r.readable and not r.writable
        assert w.writable and not w.readable
        with pytest.raises(OSError, match="read-only"):
            r.send(1)
        with pytest.raises(OSError, match="read-only"):
            r.send_bytes(b"x")
        with pytest.raises(OSError, match="write-only"):
            w.recv()
        with pytest.raises(OSError, match="write-only"):
            w.recv_bytes()
        with pytest.raises(OSError, match="write-only"):
            w.poll()
        with pytest.raises(OSError, match="write-only"):
            w.recv_bytes_into(bytearray(4))
        w.send(("ok", mp.full(2, 5)))
        tag, arr = _recv(r)
        assert tag == "ok" and arr.tolist() == [5, 5]


def test_constructor_needs_a_direction():
    a, b = mp.Pipe()
    with a, b:
        with pytest.raises(ValueError):
            Connection(a._sock, readable=False, writable=False)


def test_closed_connection_raises_oserror():
    a, b = mp.Pipe()
    a.close()
    a.close()                                           # idempotent
    for call in (lambda: a.send(1), a.recv, a.recv_bytes, a.poll, a.fileno,
                 lambda: a.send_bytes(b"x")):
        with pytest.raises(OSError, match="closed"):
            call()
    b.close()


def test_send_bytes_offset_and_size():
    a, b = mp.Pipe()
    with a, b:
        a.send_bytes(b"0123456789")
        a.send_bytes(b"0123456789", 3)
        a.send_bytes(b"0123456789", 3, 4)
        a.send_bytes(b"0123456789", 10)                 # empty message at the end
        a.send_bytes(bytearray(b"abc"))
        a.send_bytes(memoryview(b"xyz"))
        a.send_bytes(np.arange(3, dtype=np.int16))      # itemsize > 1: sent as its bytes
        assert b.recv_bytes() == b"0123456789"
        assert b.recv_bytes() == b"3456789"
        assert b.recv_bytes() == b"3456"
        assert b.recv_bytes() == b""
        assert b.recv_bytes() == b"abc"
        assert b.recv_bytes() == b"xyz"
        assert b.recv_bytes() == np.arange(3, dtype=np.int16).tobytes()
        for args in ((-1,), (11,), (0, -1), (5, 6)):
            with pytest.raises(ValueError):
                a.send_bytes(b"0123456789", *args)
        assert not b.poll(0.05)                         # nothing was sent by the bad calls


def test_recv_bytes_into_offset_and_buffer_too_short():
    a, b = mp.Pipe()
    with a, b:
        buf = bytearray(10)
        a.send_bytes(b"hello")
        assert b.recv_bytes_into(buf) == 5
        assert buf == b"hello\0\0\0\0\0"
        a.send_bytes(b"abc")
        assert b.recv_bytes_into(buf, 7) == 3
        assert buf == b"hello\0\0abc"
        arr = np.zeros(4, dtype=np.uint8)               # any writable buffer
        a.send_bytes(b"\x01\x02")
        assert b.recv_bytes_into(arr, 1) == 2 and arr.tolist() == [0, 1, 2, 0]
        a.send_bytes(b"0123456789A")
        with pytest.raises(multiprocessing.BufferTooShort) as info:
            b.recv_bytes_into(buf)
        assert info.value.args[0] == b"0123456789A"     # the whole message, as multiprocessing
        a.send_bytes(b"abcd")
        with pytest.raises(multiprocessing.BufferTooShort):
            b.recv_bytes_into(buf, 8)                    # fits the buffer, not after the offset
        with pytest.raises(ValueError):
            b.recv_bytes_into(buf, -1)
        with pytest.raises(ValueError):
            b.recv_bytes_into(buf, 11)
        a.send_bytes(b"still works")
        assert b.recv_bytes() == b"still works"


def test_recv_bytes_maxlength():
    a, b = mp.Pipe()
    with a, b:
        a.send_bytes(b"12345")
        assert b.recv_bytes(5) == b"12345"
        a.send_bytes(b"123456")
        with pytest.raises(OSError, match="bad message length"):
            b.recv_bytes(5)
        assert b.closed                                 # as multiprocessing: the stream is done
        with pytest.raises(ValueError):
            a.recv_bytes(-1)


def test_send_and_recv_bytes_mix_with_objects():
    a, b = mp.Pipe()
    with a, b:
        a.send(b"pickled")
        a.send_bytes(b"raw")
        assert b.recv() == b"pickled"
        assert b.recv_bytes() == b"raw"


def test_unpicklable_object_raises_in_the_caller_and_the_pipe_keeps_working():
    a, b = mp.Pipe()
    with a, b:
        for bad in (lambda: 1, threading.Lock()):
            with pytest.raises((TypeError, AttributeError, pickle.PicklingError)):
                a.send(["ok before", mp.zeros(3), bad])
        assert not b.poll(0.05)                         # nothing half-sent
        a.send("after")
        assert _recv(b) == "after"


def test_eof_when_peer_closed():
    a, b = mp.Pipe()
    a.send("last")
    a.close()
    assert b.poll(TIMEOUT)
    assert b.recv() == "last"
    assert b.poll(0) is True                            # EOF is readable
    with pytest.raises(EOFError):
        b.recv()
    with pytest.raises(EOFError):
        b.recv_bytes()
    with pytest.raises(EOFError):
        b.recv_bytes_into(bytearray(10))
    b.close()


def test_send_to_closed_peer_raises():
    a, b = mp.Pipe()
    b.close()
    with pytest.raises(OSError):                        # EPIPE (BrokenPipeError)
        for _ in range(10):
            a.send_bytes(b"x" * 100_000)
    a.close()


def test_usable_by_multiprocessing_connection_wait():
    (a, b), (c, d) = mp.Pipe(), mp.Pipe()
    with a, b, c, d:
        assert multiprocessing.connection.wait([b, d], timeout=0.05) == []
        c.send("to d")
        assert multiprocessing.connection.wait([b, d], timeout=TIMEOUT) == [d]
        a.send("to b")
        ready = multiprocessing.connection.wait([b, d], timeout=TIMEOUT)
        assert set(ready) == {b, d}
        assert b.recv() == "to b" and d.recv() == "to d"
        # mixed with a standard connection and a process sentinel
        sr, sw = multiprocessing.Pipe(duplex=False)
        with sr, sw:
            sw.send(1)
            assert multiprocessing.connection.wait([b, sr], timeout=TIMEOUT) == [sr]


def test_same_memory_twice_arrives_as_the_same_memory():
    a, b = mp.Pipe()
    with a, b:
        x = mp.zeros(10)
        a.send((x, x[2:5]))
        a.send(x)
        (y, view), z = _recv(b), _recv(b)
        assert data_ptr(y) == data_ptr(z) == data_ptr(x)  # received in its own process: same map
        assert data_ptr(view) == data_ptr(x) + 2 * x.itemsize
        y[3] = 7
        assert x[3] == 7 and view[1] == 7


# -- with a child on the other side ---------------------------------------------------------

def test_objects_and_arrays_both_ways(start_method):
    ctx = mp.get_context(start_method)
    a, b = ctx.Pipe()
    p = start_process(ctx, cw.echo, b)
    b.close()
    try:
        x = mp.zeros(6, dtype=np.int32)
        plain, small = np.arange(10_000.0), np.arange(5.0)   # 80 KB: over the by-value size
        a.send(("hi", x, plain, {"k": [1, 2]}, small))
        tag, y, q, d, s = _recv(a)
        assert tag == "hi" and d == {"k": [1, 2]}
        assert data_ptr(y) == data_ptr(x)                    # back home: the same memory
        assert mp.is_shared(q) and q.tolist() == plain.tolist() and not mp.is_shared(plain)
        assert not mp.is_shared(s) and s.tolist() == small.tolist() and s.flags.writeable
        a.send(None)
        assert join_or_kill(p) == 0
    finally:
        a.close()
        join_or_kill(p)


def test_producer_may_exit_right_after_send(start_method):
    ctx = mp.get_context(start_method)
    r, w = ctx.Pipe(duplex=False)
    p = start_process(ctx, cw.send_then_exit, w, 200)
    w.close()
    try:
        got = [_recv(r) for _ in range(200)]
        assert join_or_kill(p) == 0
        assert [i for i, _ in got] == list(range(200))
        assert all(mp.is_shared(a) and (a == i).all() for i, a in got)
        with pytest.raises(EOFError):
            r.recv()
    finally:
        r.close()
        join_or_kill(p)


def test_big_bytes_to_a_child_and_back():
    # 50 MiB each way: the size is the point, not how the child started, so one start method
    # each (spawn here, fork in the next test) instead of three.
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = start_process(ctx, cw.echo_bytes, b)
    b.close()
    try:
        data = cw.pattern(BIG)
        a.send_bytes(data)                    # blocks until the child has read most of it
        assert a.poll(TIMEOUT)
        back = a.recv_bytes()
        assert len(back) == BIG and back == data
        assert join_or_kill(p) == 0
    finally:
        a.close()
        join_or_kill(p)


def test_big_bytes_and_object_from_a_child():
    ctx = mp.get_context("fork")
    a, b = ctx.Pipe()
    p = start_process(ctx, cw.send_big, b, BIG)
    b.close()
    try:
        expected = cw.pattern(BIG)
        assert a.poll(TIMEOUT)
        buf = bytearray(BIG + 8)
        assert a.recv_bytes_into(buf, 8) == BIG
        assert buf[8:] == expected
        obj = _recv(a)
        assert obj == expected
        a.send("ack")
        assert join_or_kill(p) == 0
    finally:
        a.close()
        join_or_kill(p)


def test_eof_when_child_closes_its_end(start_method):
    ctx = mp.get_context(start_method)
    a, b = ctx.Pipe()
    p = start_process(ctx, cw.close_and_exit, b)
    b.close()
    try:
        assert join_or_kill(p) == 0
        assert a.poll(TIMEOUT)
        with pytest.raises(EOFError):
            a.recv()
    finally:
        a.close()


def test_connection_sent_through_a_pipe_to_another_process(start_method):
    """A Connection travels in band (its fd in the same message) and works over there."""
    ctx = mp.get_context(start_method)
    ctl_parent, ctl_child = ctx.Pipe()
    mine, theirs = mp.Pipe()
    p = start_process(ctx, cw.echo, ctl_child)
    ctl_child.close()
    try:
        ctl_parent.send(theirs)                          # to the child...
        back = _recv(ctl_parent)         # ...and back: a new Connection over the same socket
        assert isinstance(back, Connection) and back is not theirs
        theirs.close()
        back.send(("via", mp.full(2, 9)))
        tag, arr = _recv(mine)
        assert tag == "via" and arr.tolist() == [9, 9]
        ctl_parent.send(None)
        assert join_or_kill(p) == 0
        back.close()
    finally:
        ctl_parent.close()
        mine.close()
        join_or_kill(p)


def test_socket_buffer_too_small_for_a_record_is_refused_up_front(monkeypatch):
    """(A kernel whose net.core.wmem_max is below two records: here a record larger than any
    buffer.)"""
    from sharedmp.channels import fdpass
    monkeypatch.setattr(fdpass, "RECORD", 1 << 30)
    with pytest.raises(OSError, match="wmem_max"):
        mp.Pipe()


def test_a_default_socket_timeout_does_not_reach_a_connection():
    """CPython's TestTimeouts: after socket.setdefaulttimeout(), the standard library's
    connections still block (they are raw fds); so do sharedmp's, socket objects though
    they are. Before: recv() raised TimeoutError after the default timeout."""
    import socket
    socket.setdefaulttimeout(0.1)
    try:
        a, b = mp.Pipe()
        q = mp.Queue()
    finally:
        socket.setdefaulttimeout(None)
    timer = threading.Timer(0.4, lambda: (a.send("late"), q.put("late too")))
    timer.start()
    try:
        assert b.recv() == "late"
        assert q.get() == "late too"
    finally:
        timer.join(TIMEOUT)
        for c in (a, b):
            c.close()
        q.close()


def test_channels_dropped_without_close_close_silently():
    """The standard library's Pipe and Queue, dropped without close(), say nothing; a
    ResourceWarning (an error under -W error or pytest's filterwarnings = error) would."""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a, b = mp.Pipe()
        q, sq = mp.Queue(), mp.SimpleQueue()
        q.put(1)
        assert q.get(timeout=TIMEOUT) == 1
        sq.put(2)
        assert sq.get() == 2
        del a, b, q, sq
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []

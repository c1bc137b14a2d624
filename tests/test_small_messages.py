"""Small messages: plain arrays by value below the measured sizes, on sharedmp's channels
and on the standard library's; the receiver's spin before it sleeps.

docs/reference.md "Small arrays travel by value" and "A receiver waits by spinning a
moment" say what is checked here.
"""
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import sharedmp as mp
from sharedmp import wire
from sharedmp.channels import connection
from sharedmp.reductions import ndarray
from sharedmp.reductions.ndarray import STD_BY_VALUE_MAX, decode_array, encode_array

from conftest import TIMEOUT

import _channel_workers as cw

LAYOUTS = [
    ("c-contiguous", lambda: np.arange(24.0).reshape(4, 6)),
    ("fortran", lambda: np.asfortranarray(np.arange(24).reshape(4, 6))),
    ("negative strides", lambda: np.arange(24.0).reshape(4, 6)[::-1, ::-2]),
    ("0-d", lambda: np.array(3.25)),
    ("empty", lambda: np.zeros((0, 3), np.int16)),
    ("big-endian", lambda: np.arange(10, dtype=">i8")),
    ("bool", lambda: np.array([True, False, True])),
    ("structured", lambda: np.array([(1, 2.5)], dtype=[("x", "u1"), ("y", "<f4")])),
    ("datetime", lambda: np.array(["2024-01-01"], dtype="datetime64[D]")),
]


@pytest.mark.parametrize("make", [m for _, m in LAYOUTS], ids=[n for n, _ in LAYOUTS])
@pytest.mark.parametrize("alone", [True, False], ids=["alone", "in-a-tuple"])
def test_small_plain_array_arrives_by_value(make, alone):
    a = make()
    x, y = mp.Pipe()
    with x, y:
        x.send(a if alone else ("t", a))
        got = y.recv() if alone else y.recv()[1]
    assert got.dtype == a.dtype and got.shape == a.shape and np.array_equal(got, a)
    assert not mp.is_shared(got) and got.flags.writeable
    assert not np.shares_memory(got, a)


def test_lone_read_only_array_by_value_stays_read_only():
    a = np.arange(5.0)
    a.flags.writeable = False
    x, y = mp.Pipe()
    with x, y:
        x.send(a)
        got = y.recv()
    assert got.tolist() == a.tolist() and not got.flags.writeable and not mp.is_shared(got)


def test_by_value_stops_at_the_message_budget():
    # 10 plain arrays of 10 KiB in one message: 4 fit the 48 KiB budget, the rest go shared
    arrays = [np.full(1280, i, np.float64) for i in range(10)]
    x, y = mp.Pipe()
    with x, y:
        x.send(arrays)
        got = y.recv()
    assert [a.tolist() for a in got] == [a.tolist() for a in arrays]
    assert [mp.is_shared(a) for a in got] == [False] * 4 + [True] * 6
    big = np.zeros((wire.INBAND_MAX + 8) // 8)               # alone, over the budget
    assert mp.is_shared(wire.loads(*_dumped(big)))


def _dumped(obj):
    payload, fds, kind = wire.dumps(obj)
    return bytes(payload), [os.dup(fd) for fd in fds], kind


def _received_shared():
    x, y = mp.Pipe()
    with x, y:
        x.send(mp.full(3, 1.0))
        return y.recv()


# Every small shared array a program can hold: encode_array's shortcut (an array that owns its
# memory goes by value at once) must take none of them.
SHARED = [("zeros", lambda: mp.zeros(3)), ("full", lambda: mp.full(3, 2.0)),
          ("empty_like", lambda: mp.empty_like(np.ones(3))), ("share", lambda: mp.share(np.ones(3))),
          ("a view", lambda: mp.zeros(6)[::2]), ("received", _received_shared),
          ("a view of a view", lambda: mp.zeros((3, 4))[1][::2])]


@pytest.mark.parametrize("make", [m for _, m in SHARED], ids=[n for n, _ in SHARED])
def test_shared_arrays_never_travel_by_value(make):
    a = make()
    a[...] = 0
    x, y = mp.Pipe()
    with x, y:
        x.send(a)
        got = y.recv()
    assert mp.is_shared(got)
    got[0] = 7
    assert a[0] == 7                                          # the same memory


@pytest.mark.parametrize("bad", ["short", "long", "offset", "negative", "object"])
def test_hostile_array_frame_by_value_is_refused(bad):
    fds = wire.Fds()
    payload = bytearray(encode_array(np.arange(4.0), fds))
    assert not fds                                           # by value: no fd
    head = ndarray._HEAD.size + 3                             # the header and '<f8'
    if bad == "short":
        payload = payload[:-1]
    elif bad == "long":
        payload += b"\0" * 8
    elif bad == "offset":
        payload[0] = 1
    elif bad == "negative":
        payload[head:head + 8] = (-4).to_bytes(8, "little", signed=True)
    else:
        payload[ndarray._HEAD.size:head] = b"|O8"
    with pytest.raises((mp.ProtocolError, mp.SegmentError), match="array"):
        decode_array(bytes(payload), [])


STDQ_PROGRAM = """
import multiprocessing, sys
import numpy as np
import sharedmp as mp
from multiprocessing.reduction import ForkingPickler

def child(q, nbytes):
    q.put(np.full(nbytes // 8, 2.5))

if __name__ == "__main__":
    nbytes = int(sys.argv[1])
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q, nbytes))
    p.start()
    if not q._reader.poll(60):
        raise SystemExit("nothing came")
    raw = q._reader.recv_bytes()           # the message, not yet unpickled
    p.join(60)                             # the sender has exited before it is
    a = ForkingPickler.loads(raw)
    assert a.shape == (nbytes // 8,) and (a == 2.5).all(), a
    print("shared" if mp.is_shared(a) else "by-value", p.exitcode)
"""


def test_standard_queue_carries_small_arrays_by_value_after_the_sender_exits(tmp_path):
    # Through the resource sharer (a connection back to the sender) this failed with
    # ConnectionResetError once the sender had exited.
    script = tmp_path / "stdq.py"
    script.write_text(STDQ_PROGRAM)
    r = subprocess.run([sys.executable, str(script), str(STD_BY_VALUE_MAX)],
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["by-value", "0"]


def test_standard_pickler_shares_arrays_over_the_by_value_size():
    from multiprocessing.reduction import ForkingPickler
    small = np.zeros(STD_BY_VALUE_MAX // 8)
    big = np.zeros(STD_BY_VALUE_MAX // 8 + 1)
    assert not mp.is_shared(ForkingPickler.loads(ForkingPickler.dumps(small)))
    got = ForkingPickler.loads(ForkingPickler.dumps(big))    # a DupFd, served by this process
    assert mp.is_shared(got) and not got.any()


def test_executor_with_a_sharedmp_context_moves_small_arrays_by_value():
    import concurrent.futures
    ctx = mp.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as ex:
        arrays = [np.full(256, i, np.float32) for i in range(50)]
        got = list(ex.map(cw.double, arrays, timeout=TIMEOUT))
    assert [g.tolist() for g in got] == [(2 * a).tolist() for a in arrays]
    assert not any(mp.is_shared(g) for g in got)


# -- the spin ---------------------------------------------------------------------------

@pytest.fixture
def spin(monkeypatch):
    """Set the spin (seconds) for this test; spin_seconds() reads it once per process."""
    def set_to(seconds):
        monkeypatch.setattr(connection, "_spin", seconds)
    return set_to


@pytest.mark.parametrize("seconds", [0.0, 50e-6, 0.02])
def test_poll_keeps_its_timeout_and_wakes_for_data_whatever_the_spin(spin, seconds):
    spin(seconds)
    a, b = mp.Pipe()
    with a, b:
        t0 = time.monotonic()
        assert b.poll(0.05) is False
        assert 0.045 <= time.monotonic() - t0 < 0.05 + seconds + 1.0
        assert b.poll(0) is False
        t = threading.Timer(0.1, a.send, args=("late",))
        t.start()
        try:
            assert b.recv() == "late"                        # waits past the spin
        finally:
            t.join(TIMEOUT)


def test_spin_is_only_a_moment_of_cpu(spin):
    # A receiver that waits 0.3 s for its message spends about the spin in CPU, not 0.3 s.
    spin(50e-6)
    a, b = mp.Pipe()
    with a, b:
        t = threading.Timer(0.3, a.send, args=(1,))
        t.start()
        cpu = time.thread_time()
        assert b.recv() == 1
        used = time.thread_time() - cpu
        t.join(TIMEOUT)
    assert used < 0.05


@pytest.mark.parametrize("value", ["fast", "-1", "2e6"])
def test_bad_spin_setting_names_the_variable(monkeypatch, value):
    monkeypatch.setattr(connection, "_spin", None)
    monkeypatch.setenv("SHAREDMP_SPIN_US", value)
    with pytest.raises(ValueError, match="SHAREDMP_SPIN_US"):
        connection.spin_seconds()


def test_spin_setting_is_read(monkeypatch):
    monkeypatch.setattr(connection, "_spin", None)
    monkeypatch.setenv("SHAREDMP_SPIN_US", "0")
    assert connection.spin_seconds() == 0.0
    monkeypatch.setattr(connection, "_spin", None)
    monkeypatch.setenv("SHAREDMP_SPIN_US", "120")
    assert connection.spin_seconds() == pytest.approx(120e-6)


def test_window_is_sized_by_the_first_message_that_makes_flight(monkeypatch):
    # Reading the memory available costs about 0.5 ms: messages by value never need it.
    from sharedmp.channels import flow
    calls = []
    real = flow._default_window
    monkeypatch.setattr(flow, "_default_window", lambda: calls.append(1) or real())
    a, b = mp.Pipe()
    with a, b:
        for _ in range(3):
            a.send((1, np.zeros(10)))
            b.recv()
        assert calls == [] and a._window is not None and a._window.limit == 0
        a.send(np.zeros(100_000))                 # 800 KB copied into shared memory: flight
        assert mp.is_shared(b.recv())
        assert calls == [1] and a._window.limit > 0

"""The compiled small-message path (``sharedmp._cframe``, src/sharedmp/_c/cframe.c) against
its pure-Python twins (channels/fdpass.py, reductions/ndarray.py, wire.py), the reference.

Every test runs over both paths (the ``path`` fixture); the differential tests hold the two
to the same bytes on the wire, the same arrays, and the same exceptions (class and words)
for hostile input, on real sockets, never leaking an fd. ``SHAREDMP_NO_EXTENSIONS=1``
selects the twins (checked in a fresh interpreter); there the compiled parameter skips.
"""
import ctypes
import os
import socket
import struct
import subprocess
import sys
import textwrap
from typing import Any, Callable, NamedTuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import sharedmp as mp
from sharedmp import native, wire
from sharedmp.channels import connection, queues
from sharedmp.channels import fdpass
from sharedmp.channels.connection import Connection, socketpair
from sharedmp.channels.fdpass import (FDS_ON_SOCKET, FLIGHT_TOKEN, HEADER, MAGIC,
                                      MAX_FDS_PER_MSG, PAYLOAD_IN_MEMFD, RECORD, VERSION)
from sharedmp.reductions import ndarray
from sharedmp.wire import FLAG_ARRAY

from conftest import TIMEOUT, open_fds

C = native.load("_cframe")            # None where the twins run


class Path(NamedTuple):
    send_record: Callable[..., None]
    send_frame: Callable[..., None]
    recv_frame: Callable[..., Any]
    encode_value: Callable[..., bytes]
    decode_value: Callable[..., np.ndarray]
    dumps_plain: Callable[..., Any]
    loads: Callable[..., Any]


TWIN = Path(fdpass._send_record_py, fdpass._send_frame_py, fdpass._recv_frame_py,
            ndarray._encode_value_py, ndarray._decode_value_py, wire._dumps_plain_py,
            wire._loads_py)
COMPILED = None if C is None else Path(C.send_record, C.send_frame, C.recv_frame,
                                       C.encode_value, C.decode_value, C.dumps_plain, C.loads)
PATHS = {"compiled": COMPILED, "twin": TWIN}


def _path(name):
    if PATHS[name] is None:
        pytest.skip("sharedmp._cframe is not in use (SHAREDMP_NO_EXTENSIONS, or not built)")
    return PATHS[name]


@pytest.fixture(params=["compiled", "twin"])
def path(request):
    return _path(request.param)


@pytest.fixture
def both():
    """The compiled path and the twin, for differential tests."""
    return _path("compiled"), TWIN


def run_on(path, m):
    """Channels (Connection, Queue) running on ``path`` (``m``: a MonkeyPatch)."""
    m.setattr(fdpass, "_send_record", path.send_record)
    m.setattr(fdpass, "send_frame", path.send_frame)
    m.setattr(fdpass, "recv_frame", path.recv_frame)
    m.setattr(ndarray, "_encode_value", path.encode_value)
    m.setattr(ndarray, "_decode_value", path.decode_value)
    m.setattr(wire, "_dumps_plain", path.dumps_plain)
    for module in (wire, connection, queues):
        m.setattr(module, "loads", path.loads)


@pytest.fixture
def use_path(path, monkeypatch):
    run_on(path, monkeypatch)
    return path


@pytest.fixture
def pair():
    """A connected seqpacket socketpair as the channels make it; no fd may leak."""
    before = open_fds(collect=True)
    a, b = socketpair()
    yield a, b
    a.close()
    b.close()
    mp.empty_cache()                     # (the arena that large payloads went through)
    leaked = open_fds(collect=True) - before
    assert not leaked, f"fds left open: {leaked}"


def outcome(f, *args):
    """('ok', result) or (exception class, its message)."""
    try:
        return "ok", f(*args)
    except Exception as e:
        return type(e), str(e)


SETTINGS = settings(max_examples=int(os.environ.get("SHAREDMP_FUZZ_EXAMPLES", "200")),
                    deadline=None, derandomize="SHAREDMP_FUZZ_EXAMPLES" not in os.environ,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large])


# ---------------------------------------------------------------------------------------
# Which path runs
# ---------------------------------------------------------------------------------------

SELECTED = textwrap.dedent("""
    import sys
    import sharedmp
    from sharedmp import wire
    from sharedmp.channels import fdpass
    print('numpy' in sys.modules)
    from sharedmp.reductions import ndarray
    print(fdpass.recv_frame is fdpass._recv_frame_py, fdpass.send_frame is fdpass._send_frame_py,
          fdpass._send_record is fdpass._send_record_py,
          ndarray._encode_value is ndarray._encode_value_py,
          ndarray._decode_value is ndarray._decode_value_py,
          wire._dumps_plain is wire._dumps_plain_py, wire.loads is wire._loads_py)
""")


@pytest.mark.parametrize("disabled", [True, False])
def test_the_variable_selects_the_path_and_import_stays_light(disabled):
    env = {k: v for k, v in os.environ.items() if k != native.ENV}
    if disabled:
        env[native.ENV] = "1"
    elif C is None:
        pytest.skip("sharedmp._cframe is not in use here")
    out = subprocess.run([sys.executable, "-c", SELECTED], env=env, capture_output=True,
                         text=True, timeout=TIMEOUT, check=True).stdout.split("\n")
    assert out[0] == "False"                     # the C module imports no numpy
    assert out[1] == " ".join([str(disabled)] * 7)


def test_constants_are_fdpass_ones():
    c = _path("compiled") and C
    assert (c.VERSION, c.RECORD, c.MAX_FDS_PER_MSG) == (VERSION, RECORD, MAX_FDS_PER_MSG)
    assert HEADER.size == 16 and ndarray._HEAD.size == 11


# ---------------------------------------------------------------------------------------
# Arrays by value: the same bytes, the same arrays
# ---------------------------------------------------------------------------------------

DTYPES = [np.dtype(c) for c in
          ["?", "i1", "u1", "<i2", ">i2", "<i4", ">u4", "<i8", ">i8", "<f2", ">f2", "<f4",
           ">f4", "<f8", ">f8", "<c8", ">c8", "<c16", ">c16", "<M8[s]", ">M8[ns]", "<m8[us]",
           "S5", "<U3", ">U2", "V3"]]


@st.composite
def arrays(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5))
    size = int(np.prod(shape)) * dtype.itemsize
    a = np.frombuffer(draw(st.binary(min_size=size, max_size=size)), dtype).reshape(shape).copy()
    form = draw(st.sampled_from(["c", "f", "strided", "transposed", "reversed"]))
    if form == "f":
        a = np.asfortranarray(a)
    elif form == "strided" and a.ndim:
        a = np.repeat(a, 2, axis=-1)[..., ::2]
    elif form == "transposed":
        a = a.T
    elif form == "reversed" and a.ndim:
        a = a[::-1]
    if draw(st.booleans()):
        a.flags.writeable = False
    return a


def same_array(r, a):
    assert r.dtype == a.dtype and r.dtype.str == a.dtype.str
    assert r.shape == a.shape
    assert r.tobytes() == a.tobytes()         # the values, bit for bit (NaN, NaT included)
    assert r.flags.writeable == a.flags.writeable


@SETTINGS
@given(a=arrays())
def test_encode_and_decode_agree_with_the_twin(both, a):
    c, twin = both
    code = ndarray._code(a.dtype)
    payload = twin.encode_value(a, code)
    assert c.encode_value(a, code) == payload
    results = [decode(payload) for decode in (c.decode_value, twin.decode_value)]
    for r in results:
        same_array(r, a)
        assert r.base is None or not isinstance(r.base, bytes) or r.base is not payload
    rc, rt = results
    assert rc.strides == rt.strides
    assert (rc.flags.c_contiguous, rc.flags.f_contiguous, rc.flags.aligned) == \
        (rt.flags.c_contiguous, rt.flags.f_contiguous, rt.flags.aligned)
    if a.size:
        assert rc.flags.owndata and rt.flags.owndata
    # the receiver's copy is its own: writing it leaves the next decode alone
    if rc.size and rc.flags.writeable:
        ctypes.memset(rc.ctypes.data, 0xAB, 1)
        same_array(c.decode_value(payload), a)


def test_the_common_arrays_agree(both):
    c, twin = both
    for a in [np.arange(128.0), np.arange(12, dtype=">i4").reshape(3, 4, order="F"),
              np.array(3.5), np.zeros((0, 3)), np.ones((2, 3), "?")[:, ::2], np.zeros(0, "<U2")]:
        code = ndarray._code(a.dtype)
        assert c.encode_value(a, code) == twin.encode_value(a, code)


# Hostile payloads for decode: both decoders raise the same (class, words), or agree.

def _frame(shape=(3, 4), strides=None, code=b"<f8", offset=0, readonly=False, data=None,
           n=None):
    itemsize = np.dtype(code.decode()).itemsize if code in (b"<f8", b"|u1") else 8
    strides = strides if strides is not None else ndarray._packed_strides(shape, itemsize, False)
    data = data if data is not None else bytes(int(np.prod(shape)) * itemsize)
    n = len(shape) if n is None else n
    return (struct.pack("<QBB?", offset, n, len(code), readonly) + code
            + struct.pack(f"<{2 * len(shape)}q", *shape, *strides) + data)


HOSTILE_PAYLOADS = [
    b"", b"\0" * 10, _frame()[:20], _frame()[:-1], _frame() + b"x", _frame(offset=8),
    _frame(n=255), _frame(shape=(-1, 4), data=b""),
    _frame(shape=(1 << 62, 1 << 62), strides=(8, 8), data=b""),
    _frame(shape=(0, 1 << 62, 1 << 62), strides=(8, 8, 8), data=b""),
    _frame(shape=(1 << 37,), data=bytes(8)), _frame(code=b"<q9"), _frame(code=b"|O8"),
    _frame(code=b"\xff\xfe"), _frame(code=b""), _frame(strides=(8, 8)), _frame(strides=(-32, 8)),
    _frame(strides=(0, 0)), _frame(strides=(64, 16)), _frame(shape=(3, 4), strides=(8, 24)),
    _frame(shape=(1,) * 40, strides=(8,) * 40, data=bytes(8)),
    _frame(shape=(1,) * 70, strides=(8,) * 70, data=bytes(8)),
    _frame(code=b"|V0", shape=(5,), strides=(0,), data=b""),
    _frame(code=b"<M8[xx]"), _frame(readonly=True), _frame(code=b"|u1", shape=(2, 2)),
    # dimensions of 1: NumPy's reshape gives their strides; any other is refused
    *[_frame(shape=shape, strides=strides)
      for shape, strides in [((1, 4), (32, 8)), ((1, 4), (8, 8)), ((1, 4), (999, 8)),
                             ((4, 1), (8, 8)), ((4, 1), (8, 32)), ((4, 1), (8, 999)),
                             ((1, 1), (8, 8)), ((1, 1), (0, 0)), ((2, 1, 3), (24, 24, 8)),
                             ((2, 1, 3), (8, 16, 16)), ((2, 1, 3), (24, 8, 8))]],
]


@pytest.mark.parametrize("payload", HOSTILE_PAYLOADS, ids=range(len(HOSTILE_PAYLOADS)))
def test_hostile_payloads_raise_as_the_twin(both, payload):
    c, twin = both
    for kind in (bytes, bytearray):
        decodes_as_the_twin(c, twin, kind(payload))


def decodes_as_the_twin(c, twin, payload):
    """The compiled decoder gives what the twin gives: the same array, or the same error."""
    got, want = outcome(c.decode_value, payload), outcome(twin.decode_value, payload)
    if want[0] == "ok":
        assert got[0] == "ok"
        same_array(got[1], want[1])
        assert got[1].strides == want[1].strides
    else:
        assert want[0] in (mp.ProtocolError, mp.SegmentError), want
        assert got == want


@SETTINGS
@given(base=st.sampled_from([_frame(), _frame(shape=(2, 3), strides=(8, 16)),
                             _frame(shape=(), data=bytes(8)), _frame(code=b"|u1", shape=(4,))]),
       edits=st.lists(st.tuples(st.integers(0, 80), st.integers(0, 255)), max_size=4),
       cut=st.one_of(st.none(), st.integers(0, 120)), junk=st.binary(max_size=40))
def test_fuzzed_payloads_raise_as_the_twin(both, base, edits, cut, junk):
    c, twin = both
    p = bytearray(base)
    for i, v in edits:
        if i < len(p):
            p[i] = v
    decodes_as_the_twin(c, twin, bytes(p[:cut] if cut is not None else p + junk[:len(junk) % 3]))


# ---------------------------------------------------------------------------------------
# Records on a real socket: the same bytes both ways, the same errors
# ---------------------------------------------------------------------------------------

def _memfd(data=b""):
    fd = os.memfd_create("native-frame-test", os.MFD_CLOEXEC)
    os.write(fd, data)
    return fd


@pytest.mark.parametrize("sender", ["compiled", "twin"])
@pytest.mark.parametrize("receiver", ["compiled", "twin"])
def test_either_sender_with_either_receiver(pair, sender, receiver):
    s, r = _path(sender), _path(receiver)
    a, b = pair
    messages = [(b"", 0, 0), (b"x" * 1000, 0, 1), (bytes(RECORD - HEADER.size), 1, 0),
                (bytes(range(256)) * 300, 2, 3),      # larger than a record: a memfd carries it
                (b"abc", 250, 1), (b"many", 300, 0)]  # on a socket, past SCM_MAX_FD
    for payload, nfds, kind in messages:
        fds = [_memfd(b"%d" % i) for i in range(nfds)]
        try:
            s.send_frame(a, payload, fds, kind, None)
        finally:
            fdpass.close_all(fds)
        got, got_fds, got_kind = r.recv_frame(b, False)
        try:
            assert bytes(got) == payload and got_kind == kind and len(got_fds) == nfds
            assert [os.pread(fd, 8, 0) for fd in got_fds] == [b"%d" % i for i in range(nfds)]
        finally:
            fdpass.close_all(got_fds)
    for payload, nfds, kind in messages[:3]:     # one plain record, by send_record
        fds = [_memfd() for _ in range(nfds)]
        try:
            s.send_record(a, kind, nfds, len(payload), payload, fds, True)
        finally:
            fdpass.close_all(fds)
        got, got_fds, got_kind = r.recv_frame(b)
        fdpass.close_all(got_fds)
        assert (bytes(got), len(got_fds), got_kind) == (payload, nfds, kind)


def test_both_senders_write_the_same_record(both, pair):
    a, b = pair
    records = []
    for p in both:
        p.send_frame(a, b"payload", [], 5, None)
        p.send_record(a, 7, 0, 3, b"abc", [], False)
        records += [b.recv(RECORD), b.recv(RECORD)]
    assert records[:2] == records[2:]
    assert records[0] == HEADER.pack(MAGIC, VERSION, 5, 0, 7) + b"payload"


def test_flight_token_frames_and_the_window(use_path):
    """Arrays too large to go by value: copied to shared memory, their flight counted and
    tokens sent (the twin's part, reached through the compiled send_frame)."""
    a, b = mp.Pipe()
    try:
        for i in range(40):
            x = np.full(1 << 14, i, dtype=np.float64)        # 128 KiB: shared, with flight
            a.send(x)
            y = b.recv()
            assert mp.is_shared(y) and y[0] == i
        a.send_bytes(b"raw")
        assert b.recv_bytes() == b"raw"
    finally:
        a.close()
        b.close()


def test_the_objects_of_small_messages_round_trip(use_path):
    a, b = mp.Pipe()
    try:
        for obj in [12345, (7, 3.5, "abcdefghijklmnop", 9), np.arange(128.0), np.array(2.5),
                    np.arange(6, dtype=">i2").reshape(2, 3, order="F"), np.zeros((0, 4)),
                    np.arange(10)[::3], np.arange(4).astype("M8[s]")]:
            a.send(obj)
            got = b.recv()
            if isinstance(obj, np.ndarray):
                same_array(got, obj)
            else:
                assert got == obj
        ro = np.arange(5)
        ro.flags.writeable = False
        a.send(ro)
        got = b.recv()
        same_array(got, ro)
    finally:
        a.close()
        b.close()


@st.composite
def records(draw):
    magic = draw(st.sampled_from([MAGIC, MAGIC, MAGIC, b"SN", b"\0\0"]))
    version = draw(st.sampled_from([VERSION, VERSION, VERSION, VERSION + 1]))
    flags = draw(st.one_of(st.integers(0, 31), st.integers(0, 255),
                           st.sampled_from([PAYLOAD_IN_MEMFD, FDS_ON_SOCKET, FLIGHT_TOKEN])))
    nfds = draw(st.one_of(st.integers(0, 4), st.integers(0, (1 << 32) - 1)))
    body = draw(st.binary(max_size=64))
    length = draw(st.one_of(st.just(len(body)), st.integers(0, (1 << 64) - 1)))
    record = HEADER.pack(magic, version, flags, nfds, length) + body
    record = record[:draw(st.integers(0, len(record)))] if draw(st.booleans()) else record
    kinds = draw(st.lists(st.sampled_from(["memfd", "pipe", "socket", "sealed"]), max_size=4))
    return record, kinds


def _make_fd(kind):
    if kind == "memfd":
        return _memfd(bytes(64))
    if kind == "sealed":
        import fcntl
        fd = os.memfd_create("native-frame-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.write(fd, bytes(4096))
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        return fd
    if kind == "pipe":
        r, w = os.pipe()
        os.close(w)
        return r
    s1, s2 = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s2.close()
    return s1.detach()


@SETTINGS
@given(rec=records())
def test_hostile_records_raise_as_the_twin(both, rec):
    record, kinds = rec
    before = open_fds()
    a, b = socketpair()
    try:
        outcomes = []
        for p in both:
            fds = [_make_fd(k) for k in kinds]
            try:
                if record:
                    socket.send_fds(a, [record], fds)
                else:
                    a.sendmsg([b""], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                       struct.pack(f"{len(fds)}i", *fds))] if fds else [])
            finally:
                fdpass.close_all(fds)
            got = outcome(p.recv_frame, b, False)
            if got[0] == "ok":
                payload, fds, kind = got[1]
                fdpass.close_all(fds)
                got = ("ok", (bytes(payload), len(fds), kind))
            outcomes.append(got)
        c, twin = outcomes
        assert c == twin
        assert twin[0] in ("ok", mp.ProtocolError, EOFError, mp.SegmentError), twin
    finally:
        a.close()
        b.close()
    assert open_fds() == before


def test_special_records_raise_as_the_twin(both, pair):
    a, b = pair
    cases = [HEADER.pack(MAGIC, VERSION, 0, 0, RECORD) + bytes(RECORD),     # MSG_TRUNC
             b"short", b"", HEADER.pack(b"XX", VERSION, 0, 0, 0)]
    for record in cases:
        got = []
        for p in both:
            a.send(record)
            got.append(outcome(p.recv_frame, b, False))
        assert got[0] == got[1] and got[0][0] in (mp.ProtocolError, EOFError), got
    for p in both:                                  # nothing there
        assert outcome(p.recv_frame, b, False)[0] is BlockingIOError
    for p in both:                                  # a full socket, not blocking
        a.setblocking(False)
        try:
            with pytest.raises(BlockingIOError):
                while True:
                    p.send_record(a, 0, 0, 1000, bytes(1000), [], False)
        finally:
            a.setblocking(True)
        while True:
            try:
                p.recv_frame(b, False)
            except BlockingIOError:
                break
    a.shutdown(socket.SHUT_WR)
    got = [outcome(p.recv_frame, b, False) for p in both]
    assert got[0] == got[1] and got[0][0] is EOFError


# ---------------------------------------------------------------------------------------
# Processes, signals, threads: bounded, in fresh interpreters
# ---------------------------------------------------------------------------------------

PEER = textwrap.dedent("""
    import socket, sys
    import numpy as np
    from sharedmp.channels.connection import Connection
    conn = Connection(socket.socket(fileno=int(sys.argv[1])))
    objs = [np.arange(128.0), 12345, (7, 3.5, "abcdefghijklmnop", 9),
            np.arange(12, dtype=">i4").reshape(3, 4, order="F"), np.zeros((0, 2)),
            np.full(1 << 14, 7.0), b"x" * 100000]
    if sys.argv[2] == "send":
        for o in objs:
            conn.send(o)
        conn.recv()                          # until the other end has them all
    else:
        for o in objs:
            got = conn.recv()
            assert type(got) is type(o)
            if isinstance(o, np.ndarray):
                assert got.dtype.str == o.dtype.str and got.shape == o.shape
                assert got.tobytes() == o.tobytes()
                assert got.strides == o.strides or not o.size   # (NumPy's empty: 0 strides)
            else:
                assert got == o
        conn.send("done")
""")


@pytest.mark.parametrize("child", ["twin", "compiled"])
@pytest.mark.parametrize("direction", ["send", "recv"])
def test_across_processes_one_path_each(child, direction):
    """The child on one path, this process on the other: the wire is the same."""
    if C is None:
        pytest.skip("sharedmp._cframe is not in use here")
    env = {k: v for k, v in os.environ.items() if k != native.ENV}
    if child == "twin":
        env[native.ENV] = "1"
    ours, theirs = socketpair()
    proc = subprocess.Popen([sys.executable, "-c", PEER, str(theirs.fileno()), direction],
                            env=env, pass_fds=[theirs.fileno()])
    theirs.close()
    try:
        # this process runs the other path
        mine = COMPILED if child == "twin" else TWIN
        with pytest.MonkeyPatch.context() as m:
            for name, f in [("_send_record", mine.send_record), ("send_frame", mine.send_frame),
                            ("recv_frame", mine.recv_frame)]:
                m.setattr(fdpass, name, f)
            m.setattr(ndarray, "_encode_value", mine.encode_value)
            m.setattr(ndarray, "_decode_value", mine.decode_value)
            conn = Connection(ours)
            objs = [np.arange(128.0), 12345, (7, 3.5, "abcdefghijklmnop", 9),
                    np.arange(12, dtype=">i4").reshape(3, 4, order="F"), np.zeros((0, 2)),
                    np.full(1 << 14, 7.0), b"x" * 100000]
            if direction == "send":              # the child sends, this process receives
                for o in objs:
                    assert conn.poll(TIMEOUT)
                    got = conn.recv()
                    if isinstance(o, np.ndarray):
                        same_array(got, o)
                    else:
                        assert got == o
                conn.send("done")
            else:
                for o in objs:
                    conn.send(o)
                assert conn.poll(TIMEOUT) and conn.recv() == "done"
            conn.close()
        assert proc.wait(TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


BLOCKED = textwrap.dedent("""
    import signal, socket, sys, threading, time
    from sharedmp import native
    from sharedmp.channels import fdpass
    from sharedmp.channels.connection import socketpair
    twin = sys.argv[1] == "twin"
    recv_frame = fdpass._recv_frame_py if twin else native.load("_cframe").recv_frame
    a, b = socketpair()

    # 1. the GIL is let go while it waits: another thread sends meanwhile
    def later():
        time.sleep(0.2)
        fdpass.send_frame(a, b"late", [], 0, None)
    t = threading.Thread(target=later)
    t.start()
    assert bytes(recv_frame(b)[0]) == b"late"
    t.join()

    # 2. a signal whose handler raises ends the wait (EINTR, then the handler's error)
    class Stop(Exception):
        pass
    def handler(*_):
        raise Stop
    signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 0.2)
    try:
        recv_frame(b)
    except Stop:
        print("stopped")
    # 3. a handler that returns: the wait goes on, and the frame comes
    signal.signal(signal.SIGALRM, lambda *_: None)
    signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)
    threading.Timer(0.3, lambda: fdpass.send_frame(a, b"after", [], 0, None)).start()
    assert bytes(recv_frame(b)[0]) == b"after"
    signal.setitimer(signal.ITIMER_REAL, 0)
    print("ok")
""")


def test_blocking_receive_lets_go_of_the_gil_and_hears_signals(path):
    name = "twin" if path is TWIN else "compiled"
    out = subprocess.run([sys.executable, "-c", BLOCKED, name], capture_output=True,
                         text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["stopped", "ok"]


# ---------------------------------------------------------------------------------------
# Pickles: messages of builtin atoms, and unpickling with the OutOfBand current
# ---------------------------------------------------------------------------------------

ATOMS = st.one_of(st.integers(), st.floats(allow_nan=False), st.text(max_size=40),
                  st.binary(max_size=40), st.booleans(), st.none())


class _Int(int):
    pass


@SETTINGS
@given(obj=st.one_of(ATOMS, st.tuples(ATOMS, ATOMS, ATOMS, ATOMS), st.lists(ATOMS, max_size=3),
                     st.tuples(ATOMS, st.tuples(ATOMS)), st.builds(_Int, st.integers()),
                     st.builds(bytearray, st.binary(max_size=8)),
                     st.dictionaries(st.text(max_size=3), ATOMS, max_size=2)))
def test_plain_pickles_are_the_reused_picklers_bytes(both, obj):
    c, twin = both
    got, want = c.dumps_plain(obj), twin.dumps_plain(obj)
    assert got == want
    plain = type(obj) in wire._ATOMS or type(obj) is tuple and all(
        type(x) in wire._ATOMS for x in obj)
    assert (got is not None) == plain
    if plain:                 # what the full path (reused pickler, OutOfBand) writes
        assert got == bytes(wire._pickle(obj, wire.OutOfBand()))


def _current_fds():
    oob = wire.current()
    return type(oob).__name__, [os.fstat(fd).st_ino for fd in oob.fds]


class _SeesCurrent:
    def __reduce__(self):
        return _current_fds, ()


def test_loads_makes_the_fds_current_then_closes_them(path):
    for kind in (0,):
        fds = [_memfd(b"a"), _memfd(b"b")]
        inodes = [os.fstat(fd).st_ino for fd in fds]
        assert wire.current() is None
        assert path.loads(wire.pickle.dumps(_SeesCurrent(), 5), fds, kind) == \
            ("OutOfBand", inodes)
        assert wire.current() is None
        for fd in fds:
            with pytest.raises(OSError):
                os.fstat(fd)


LOADS_CASES = [
    (b"", 0), (b"\x80\x05K", 0), (b"\x80\x05K\x07.", 0), (b"garbage", 0), (b"\x80\x05N", 0),
    (wire.pickle.dumps((1, "a", 2.5), 5)[:-3], 0), (wire.pickle.dumps(12345, 5), 0),
    (wire.pickle.dumps([1, {"a": (2,)}], 5), 0), (b"\x80\x05N.", 0),
    (ndarray._encode_value_py(np.arange(4.0), b"<f8"), FLAG_ARRAY), (b"", FLAG_ARRAY),
    (b"junk", 0x1E), (b"\0\0\0\0", wire.FLAG_BUFFERS),
]


@pytest.mark.parametrize("payload,kind", LOADS_CASES, ids=range(len(LOADS_CASES)))
def test_loads_raises_and_returns_as_the_twin(both, payload, kind):
    outcomes = []
    for p in both:
        fds = [_memfd(), _memfd()]
        try:
            got = p.loads(payload, fds, kind)
            outcomes.append(("ok", got.tolist() if isinstance(got, np.ndarray) else got))
        except Exception as e:
            outcomes.append((type(e), str(e), type(e.__cause__), e.__suppress_context__))
        assert wire.current() is None
        for fd in fds:                        # closed whatever happened
            with pytest.raises(OSError):
                os.fstat(fd)
    assert outcomes[0] == outcomes[1]
    if payload == b"" and kind == 0:            # "Ran out of input"
        assert outcomes[0][0] is mp.ProtocolError and outcomes[0][2] is EOFError

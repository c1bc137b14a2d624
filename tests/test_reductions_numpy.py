"""What a NumPy array becomes on the wire, and what the receiver rebuilds.

Round trips go through ``ForkingPickler`` (the standard reduction, with the reducers
``import sharedmp`` registers): in this process -- by DupFd and by a sharedmp channel's
out-of-band fds -- and across a spawned process.
"""
import multiprocessing
import pickle

import numpy as np
import pytest
from multiprocessing.reduction import ForkingPickler
from numpy.lib.stride_tricks import as_strided, sliding_window_view

import sharedmp as mp
from sharedmp.arrays import mapping_of
from sharedmp.channels import fdpass
from sharedmp.errors import ProtocolError, SegmentError
from sharedmp.reductions import ndarray as red_ndarray
from sharedmp.reductions import segment as red_segment

import _workers as w
from conftest import data_ptr


def _make_bases(alloc):
    """Arrays of many dtypes with known contents, made by ``alloc(shape, dtype)``."""
    rec = np.dtype([("a", "<i4"), ("b", ">f8"), ("c", "S3")])
    bases = {
        "f8": alloc((6, 8), np.float64),
        "i4be": alloc((4, 5), ">i4"),
        "bool": alloc((3, 7), np.bool_),
        "c16": alloc((5, 4), np.complex128),
        "c8": alloc((9,), np.complex64),
        "f2": alloc((4, 6), np.float16),
        "i1": alloc((30,), np.int8),
        "u2be": alloc((2, 3, 4), ">u2"),
        "rec": alloc((5,), rec),
        "big": alloc((1 << 17,), np.float64),          # 1 MiB: a segment of its own
    }
    for k, b in bases.items():
        if k == "rec":
            b["a"] = np.arange(5)
            b["b"] = np.linspace(-1, 1, 5)
            b["c"] = [b"ab", b"cde", b"", b"x", b"yz"]
        elif k == "bool":
            b[...] = (np.arange(b.size).reshape(b.shape) % 3) == 0
        elif k.startswith("c"):
            b[...] = (np.arange(b.size) + 1j * np.arange(b.size)[::-1]).reshape(b.shape)
        else:
            b[...] = (np.arange(b.size) % 100 - 50).reshape(b.shape)
    return bases


def _readonly(v):
    v = v.view()
    v.flags.writeable = False
    return v


VIEWS = [
    ("f8", "whole", lambda b: b),
    ("f8", "slice", lambda b: b[1:4, 2:7]),
    ("f8", "transpose", lambda b: b.T),
    ("f8", "negative strides", lambda b: b[::-1, ::-2]),
    ("f8", "0-d", lambda b: b[2, 3, ...]),
    ("f8", "empty rows", lambda b: b[3:3]),
    ("f8", "empty cols", lambda b: b[:, 8:]),
    ("f8", "empty reversed", lambda b: b[::-1][6:]),
    ("f8", "read-only", lambda b: _readonly(b[1:3])),
    ("f8", "column", lambda b: b[:, 5]),
    ("f8", "as big-endian", lambda b: b.view(">f8")[2:]),
    ("f8", "as bytes", lambda b: b.view(np.uint8)[1, 3:17]),
    ("f8", "broadcast", lambda b: np.broadcast_to(b[0], (3, 8))),
    ("f8", "sliding window", lambda b: sliding_window_view(b[1], 3)),
    ("i1", "as_strided overlapping", lambda b: as_strided(b[2:], (5, 4), (3, 1))),
    ("i4be", "big-endian", lambda b: b[1:, ::2]),
    ("bool", "bool", lambda b: b[:, 1::3]),
    ("c16", "complex128", lambda b: b.T[::-1]),
    ("c8", "complex64", lambda b: b[::4]),
    ("c8", "complex real part", lambda b: b.real),
    ("f2", "float16", lambda b: b[1::2, ::-1]),
    ("i1", "int8", lambda b: b[3:27:3]),
    ("u2be", "3-d big-endian", lambda b: b.transpose(2, 0, 1)[1:]),
    ("rec", "structured", lambda b: b[::-2]),
    ("rec", "structured field", lambda b: b["b"]),
    ("rec", "structured read-only", lambda b: _readonly(b[1:4])),
    ("big", "big strided", lambda b: b[7::5]),
    ("big", "big reversed", lambda b: b[::-1]),
]
VIEW_IDS = [name for _, name, _ in VIEWS]


def _cases(bases):
    return [(key, make(bases[key])) for key, _, make in VIEWS]


def _assert_same(received, original, what=""):
    """Identical values, shape, strides, dtype (byte order included) and flags."""
    assert type(received) is np.ndarray, what
    assert w.describe(received) == w.describe(original), what


def _dumps_loads_dupfd(obj):
    return ForkingPickler.loads(ForkingPickler.dumps(obj))


def _dumps_loads_in_band(obj):
    oob = fdpass.OutOfBand()
    prev = fdpass.swap(oob)
    try:
        data = ForkingPickler.dumps(obj)
    finally:
        fdpass.swap(prev)
    # the fds stay the sender's segment fds: a channel would send (not close) them
    rx = fdpass.OutOfBand(list(oob.fds))
    prev = fdpass.swap(rx)
    try:
        return ForkingPickler.loads(data), len(oob.fds)
    finally:
        fdpass.swap(prev)


@pytest.mark.parametrize("transport", ["dupfd", "in-band"])
def test_views_round_trip_in_process(sharing_strategy, transport):
    bases = _make_bases(mp.zeros)
    cases = _cases(bases)
    views = [v for _, v in cases]
    if transport == "dupfd":
        got = _dumps_loads_dupfd(views)
    else:
        got, nfds = _dumps_loads_in_band(views)
        # one per segment (arena + big)
        assert nfds == (2 if sharing_strategy == "file_descriptor" else 0)
    for (key, v), r, name in zip(cases, got, VIEW_IDS):
        _assert_same(r, v, name)
        assert mp.is_shared(r), name
        # received in its own process: the same memory, at the same address
        assert data_ptr(r) == data_ptr(v), name
        assert mapping_of(r)[0] is mapping_of(v)[0], name
        if v.size:
            assert np.shares_memory(r, bases[key]), name
    got[0][0, 0] = 1234.5                      # writes go to the sender's memory
    assert bases["f8"][0, 0] == 1234.5


def test_views_round_trip_across_spawn(sharing_strategy):
    ctx = multiprocessing.get_context("spawn")
    bases = _make_bases(mp.zeros)
    cases = _cases(bases)
    before = {k: b.copy() for k, b in bases.items()}
    expected = [w.describe(v) for _, v in cases]
    reports = w.run(ctx, w.describe_views, bases, cases)
    for (key, v), rep, exp, name in zip(cases, reports, expected, VIEW_IDS):
        assert {k: rep[k] for k in exp} == exp, name
        assert rep["shared"], name
        assert rep["aliases_base"] == bool(v.size), name
        if v.size:                             # same layout relative to the base
            assert rep["offset_in_base"] == data_ptr(v) - data_ptr(bases[key]), name
    # the child wrote through every writable view: replay the writes on a copy
    ref = before
    w.poke_all([make(ref[key]) for key, _, make in VIEWS])
    for k in bases:
        assert bases[k].tobytes() == ref[k].tobytes(), f"child's writes through views of {k!r}"


def test_readonly_stays_readonly_across_spawn():
    ctx = multiprocessing.get_context("spawn")
    a = _readonly(mp.zeros(8))
    shared, desc = w.run(ctx, w.report_shared, a)
    assert shared and desc["flags"][2] is False


PLAIN_VIEWS = [
    ("c-contiguous", lambda: np.arange(24.0).reshape(4, 6)),
    ("fortran", lambda: np.asfortranarray(np.arange(24).reshape(4, 6))),
    ("transpose", lambda: np.arange(24.0).reshape(4, 6).T),
    ("negative strides", lambda: np.arange(24.0).reshape(4, 6)[::-1, ::-2]),
    ("0-d", lambda: np.array(3.25)),
    ("empty", lambda: np.zeros((0, 3), np.int16)),
    ("big-endian", lambda: np.arange(10, dtype=">i8")),
    ("read-only", lambda: _readonly(np.arange(5))),
    ("bool", lambda: np.array([True, False, True])),
    ("complex", lambda: np.array([1 + 2j, -3j], np.complex64)),
    ("float16", lambda: np.linspace(0, 1, 7).astype(np.float16)),
    ("int8", lambda: np.arange(-5, 5, dtype=np.int8)),
    ("structured", lambda: np.array([(1, 2.5), (3, -1.0)], dtype=[("x", "u1"), ("y", "<f4")])),
    ("strings", lambda: np.array(["ab", "cde"])),
    ("datetime", lambda: np.array(["2024-01-01", "2025-06-30"], dtype="datetime64[D]")),
]


@pytest.mark.parametrize("make", [m for _, m in PLAIN_VIEWS], ids=[n for n, _ in PLAIN_VIEWS])
def test_plain_array_round_trip_becomes_shared(make, never_by_value):
    a = make()
    r = _dumps_loads_dupfd(a)
    _assert_same(r, a)
    assert mp.is_shared(r) and not mp.is_shared(a)
    if a.size:
        assert not np.shares_memory(r, a)


def test_plain_sparse_view_is_copied_compactly(never_by_value):
    base = np.arange(100_000.0)
    a = base[::1000]                           # sending the gaps would cost 1000x
    r = _dumps_loads_dupfd(a)
    assert np.array_equal(r, a) and mp.is_shared(r)
    assert r.flags.c_contiguous


def test_plain_arrays_across_spawn_arrive_shared_and_equal(never_by_value):
    ctx = multiprocessing.get_context("spawn")
    for name, make in PLAIN_VIEWS[:4] + PLAIN_VIEWS[6:7]:
        a = make()
        shared, desc = w.run(ctx, w.report_shared, a)
        assert shared, name
        assert desc == w.describe(a), name


def test_object_dtype_falls_back_to_pickling():
    a = np.array([1, "two", None, [3]], dtype=object)
    r = _dumps_loads_dupfd(a)
    assert r.dtype == object and list(r) == list(a)
    assert not mp.is_shared(r)
    s = np.array([(1, "x")], dtype=[("n", "i4"), ("o", object)])   # objects inside a record
    rs = _dumps_loads_dupfd(s)
    assert rs.dtype == s.dtype and rs[0]["o"] == "x" and not mp.is_shared(rs)


def test_object_dtype_across_spawn_arrives_equal_not_shared():
    ctx = multiprocessing.get_context("spawn")
    a = np.array([{"k": 1}, "s", 2.5], dtype=object)
    shared, desc = w.run(ctx, w.report_shared, a)
    assert shared is False and desc["shape"] == (3,) and desc["dtype"] == object


def test_same_memory_in_one_message_is_one_segment_reference():
    a = mp.zeros(1000)
    msg = [a, a[:10], a[::-1], a]
    got, nfds = _dumps_loads_in_band(msg)
    assert nfds == 1
    assert got[0] is got[3]                    # pickle's memo: the same object twice
    assert data_ptr(got[2]) == data_ptr(a[::-1])


def test_same_array_sent_twice_arrives_at_same_pointer():
    a = mp.zeros((1 << 17) + 1)                # own segment
    r1 = _dumps_loads_dupfd(a)
    r2 = _dumps_loads_dupfd(a)
    assert data_ptr(r1) == data_ptr(r2) == data_ptr(a)
    assert mapping_of(r1)[0] is mapping_of(r2)[0]


def test_rebuild_refuses_views_that_do_not_fit():
    a = mp.zeros(16, np.uint8)
    mm = mapping_of(a)[0]
    n = len(mm)
    f8 = np.dtype(np.float64)
    bad = [
        (n, (1,), (8,), f8),                   # starts past the end
        (n - 4, (1,), (8,), f8),               # ends past the end
        (-8, (1,), (8,), f8),                  # starts before the mapping
        (0, (2,), (-8,), f8),                  # negative stride walks below the start
        (0, (3, 2), (n, 8), f8),               # a stride that jumps out of the mapping
        (n + 1, (0,), (8,), f8),               # even an empty view must point inside
        (0, (2, 2), (8,), f8),                 # strides do not match the shape
    ]
    for args in bad:
        with pytest.raises(SegmentError):
            red_ndarray.rebuild_ndarray(mm, *args, False)
    for dtype in (np.dtype(object), np.dtype([("o", object)]), "|O", 42, None):
        with pytest.raises(SegmentError):                  # objects, or not a dtype at all
            red_ndarray.rebuild_ndarray(mm, 0, (1,), (8,), dtype, False)
    ok = red_ndarray.rebuild_ndarray(mm, n - 8, (1,), (8,), f8, True)   # exactly fits
    assert ok.shape == (1,) and not ok.flags.writeable


def test_in_band_fd_needs_a_channel():
    with pytest.raises(RuntimeError, match="sharedmp channel"):
        red_segment.rebuild_fd_in_band(0)
    oob = fdpass.OutOfBand([])
    prev = fdpass.swap(oob)
    try:
        with pytest.raises(ProtocolError):
            red_segment.rebuild_fd_in_band(0)
    finally:
        fdpass.swap(prev)


def test_file_system_reduces_to_the_name():
    mp.set_sharing_strategy("file_system")
    a = mp.zeros(1 << 18)                      # own named segment
    seg = mapping_of(a)[1]
    data = ForkingPickler.dumps(a)
    assert seg.name.encode() in bytes(data)
    r = pickle.loads(data)                     # no fds involved: plain pickle rebuilds it
    assert data_ptr(r) == data_ptr(a)
    del r


def test_standard_pickle_is_not_affected():
    a = mp.zeros(4)
    r = pickle.loads(pickle.dumps(a))          # reducers live only on ForkingPickler
    assert np.array_equal(r, a) and not mp.is_shared(r)


# -- by value: the order NumPy's own pickle keeps (issue 40) -------------------------------

BY_VALUE_ORDERS = [
    ("fortran", lambda: np.asfortranarray(np.arange(12.0).reshape(3, 4))),
    ("fortran-3d-big-endian",
     lambda: np.asfortranarray(np.arange(24, dtype=">i8").reshape(2, 3, 4))),
    ("fortran-read-only",
     lambda: _readonly(np.asfortranarray(np.arange(6, dtype="u2").reshape(2, 3)))),
    ("c", lambda: np.arange(12.0).reshape(3, 4)),
    ("transposed-view", lambda: np.arange(24.0).reshape(4, 6)[::2].T),   # neither: C order
    ("f-and-c", lambda: np.asfortranarray(np.arange(4.0).reshape(1, 4))),
    ("empty", lambda: np.zeros((3, 0), order="F")),
    ("0-d", lambda: np.array(2.5)),
]


def _by_value_sharedmp_pipe(a):
    x, y = mp.Pipe()
    with x, y:
        x.send(a)                      # alone: the array frame
        x.send([a])                    # inside a pickle
        return [y.recv(), y.recv()[0]]


@pytest.mark.parametrize("make", [m for _, m in BY_VALUE_ORDERS],
                         ids=[n for n, _ in BY_VALUE_ORDERS])
def test_by_value_keeps_the_order_numpy_pickle_keeps(make):
    """An F-contiguous (not C-contiguous) array by value arrives F-contiguous, with the
    strides NumPy's pickle would give; anything else C-contiguous. Byte order and the
    read-only flag as sent."""
    a = make()
    want = pickle.loads(pickle.dumps(a, 5))                  # protocol 5 keeps byte order
    got = [ForkingPickler.loads(ForkingPickler.dumps(a))] + _by_value_sharedmp_pipe(a)
    for g in got:
        assert not mp.is_shared(g)
        assert (g.strides, g.flags.c_contiguous, g.flags.f_contiguous) == \
            (want.strides, want.flags.c_contiguous, want.flags.f_contiguous)
        assert g.dtype.str == a.dtype.str and np.array_equal(g, a)
        assert g.flags.writeable == a.flags.writeable

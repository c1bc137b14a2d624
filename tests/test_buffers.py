"""Out-of-band buffers (pickle protocol 5): Arrow, pandas, Polars and any object whose
reducer offers PickleBuffers travel through shared memory (``wire.py``).

Real processes and queues; the receiving test process checks where the buffers it got lie.
"""
import gc
import os

import numpy as np
import pytest

import sharedmp as mp
from sharedmp import wire
from sharedmp.memory import segment

import _buffer_workers as bw
import _workers as w
from conftest import TIMEOUT

pa = pytest.importorskip("pyarrow")

ROWS = 100_000


def receive(kind, rows=ROWS, method="spawn"):
    """What a child of ``method`` put (``make(kind, rows)``), got here after it exited."""
    ctx = mp.get_context(method)
    q = ctx.Queue()
    p, conn = w.start(ctx, bw.put_and_exit, q, kind, rows)
    try:
        got = q.get(timeout=TIMEOUT)
        w.result(p, conn)                       # the sender has exited by now
    finally:
        conn.close()
    return got


def arrow_buffers(obj):
    """Every non-null pyarrow Buffer under a Table, RecordBatch, Array or ChunkedArray."""
    if isinstance(obj, (pa.Table, pa.RecordBatch)):
        return [b for col in obj.columns for b in arrow_buffers(col)]
    if isinstance(obj, pa.ChunkedArray):
        return [b for chunk in obj.chunks for b in arrow_buffers(chunk)]
    return [b for b in obj.buffers() if b is not None]


def in_shared_memory(address, nbytes):
    return segment.containing(address, nbytes)[0] is not None


def equal(kind, got, want):
    if kind in ("table", "batch", "array", "chunked"):
        return got.equals(want)
    if kind == "pandas":
        import pandas as pd
        pd.testing.assert_frame_equal(got, want)
        return True
    if kind.startswith("polars"):
        return got.equals(want) and getattr(got, "name", None) == getattr(want, "name", None)
    if kind in ("blob", "writable-blob"):
        return bytes(got.data) == bytes(want.data)
    return type(got) is type(want) and np.array_equal(got, want)


KINDS = ["table", "batch", "array", "chunked", "pandas", "polars", "polars-series", "subclass",
         "object-array", "blob"]


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_round_trips_equal(kind):
    if kind == "pandas":
        pytest.importorskip("pandas")
    if kind.startswith("polars"):
        pytest.importorskip("polars")
    assert equal(kind, receive(kind), bw.make(kind, ROWS))


def test_arrow_buffers_arrive_in_shared_memory_without_a_copy(sharing_strategy):
    got = receive("table")
    want = bw.make("table", ROWS)
    assert got.equals(want)
    big = [b for b in arrow_buffers(got) if b.size > 4096]
    assert len(big) == len(arrow_buffers(want)) == 6     # 5 columns' data, the string offsets
    assert all(in_shared_memory(b.address, b.size) for b in big)
    assert not any(in_shared_memory(b.address, b.size) for b in arrow_buffers(want))


def test_pandas_numpy_and_arrow_columns_arrive_in_shared_memory():
    pytest.importorskip("pandas")
    got = receive("pandas")
    for name in ("f0", "f1", "f2", "i"):                 # NumPy blocks: sharedmp's reducer
        assert mp.is_shared(got[name].to_numpy())
    strings = got["s"].array.__arrow_array__()           # the Arrow column, without a copy
    assert all(in_shared_memory(b.address, b.size) for b in arrow_buffers(strings)
               if b.size > 4096)


def test_polars_frames_travel_as_arrow_in_shared_memory():
    pytest.importorskip("polars")
    got = receive("polars")
    for name in ("f0", "f1", "f2", "i", "s"):            # (s: its views, the strings inline)
        assert all(in_shared_memory(b.address, b.size)
                   for b in polars_buffers(got.get_column(name)) if b.size > wire.INBAND_MAX)


def polars_views():
    """polars, where it exports its string views as they are (CompatLevel, Polars >= 1.1)."""
    pl = pytest.importorskip("polars")
    if not hasattr(pl, "CompatLevel"):
        pytest.skip("Polars < 1.1: no CompatLevel")
    return pl


def polars_buffers(obj):
    """Every buffer of a Polars frame or series, as Polars holds it (its views as they are:
    Polars exports them at the newest level without a copy)."""
    from sharedmp.reductions.polars import to_arrow
    frame = obj.to_frame() if hasattr(obj, "to_frame") else obj
    return arrow_buffers(to_arrow(frame))


@pytest.mark.parametrize("kind", ["polars-strings", "polars-strings-series"])
def test_polars_string_views_arrive_in_shared_memory_as_they_are(kind):
    pl = polars_views()
    got, want = receive(kind), bw.make(kind, ROWS)
    assert equal(kind, got, want)
    frame = got.to_frame() if isinstance(got, pl.Series) else got
    assert frame.schema == (want.to_frame() if isinstance(want, pl.Series) else want).schema
    assert frame.n_chunks() == 2                          # the sender's chunks, kept
    from sharedmp.reductions.polars import to_arrow
    types = {f.name: str(f.type) for f in to_arrow(frame).schema}
    assert {t for n, t in types.items() if n != "i"} <= {"string_view", "binary_view"}
    # views and long strings' data buffers (many per column): every one over the message's
    # in-band budget received where the sender put it, in shared memory; none of the sender's
    big = [b for b in polars_buffers(got) if b.size > wire.INBAND_MAX]
    assert len(big) >= (10 if kind == "polars-strings" else 4)
    assert all(in_shared_memory(b.address, b.size) for b in big)
    assert not any(in_shared_memory(b.address, b.size) for b in polars_buffers(want))


def test_polars_reducers_export_string_views():
    pl = polars_views()
    from sharedmp.reductions import polars as reductions
    df = bw.make("polars-strings", 1000)
    rebuild, (table,) = reductions.reduce_polars_frame(df)
    assert [str(t) for t in table.schema.types] == ["string_view", "string_view",
                                                     "binary_view", "int64"]
    assert rebuild(table).equals(df)
    rebuild, (table,) = reductions.reduce_polars_series(df.get_column("bin"))
    assert str(table.schema.types[0]) == "binary_view"
    got = rebuild(table)
    assert isinstance(got, pl.Series) and got.name == "bin" and got.equals(df.get_column("bin"))


def test_polars_falls_back_to_the_default_level_then_to_polars_pickle(monkeypatch):
    pl = pytest.importorskip("polars")
    from sharedmp.reductions import polars as reductions
    df = bw.make("polars-strings", 20_000)
    # a newest level this Polars or pyarrow cannot export (an older one): Arrow's strings
    monkeypatch.setattr(reductions, "_newest", {"compat_level": "no such level"})
    assert "large_string" in str(reductions.reduce_polars_frame(df)[1][0].schema)
    payload, fds, kind = wire.dumps(df)
    assert kind == wire.FLAG_BUFFERS
    assert wire.loads(payload, [os.dup(fd) for fd in fds], kind).equals(df)
    # a column that Arrow cannot hold at any level (pyarrow has no 128-bit integers)
    if hasattr(pl, "Int128"):
        odd = df.with_columns(pl.col("i").cast(pl.Int128))
        try:
            odd.to_arrow()
        except Exception:
            payload, fds, kind = wire.dumps(odd)
            assert wire.loads(payload, [os.dup(fd) for fd in fds], kind).equals(odd)


def test_buffers_stay_in_band_up_to_the_messages_budget():
    # ten 8 KiB arrays: the first six (48 KiB, INBAND_MAX) in the pickle, the others shared
    assert wire.INBAND_MAX == 48 << 10
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    arrays = [pa.array(np.full(1024, i, dtype=np.float64)) for i in range(10)]
    q.put(arrays)
    got = q.get(timeout=TIMEOUT)
    assert [a.equals(b) for a, b in zip(got, arrays)] == [True] * 10
    shared = [in_shared_memory(a.buffers()[1].address, 8192) for a in got]
    assert shared == [False] * 6 + [True] * 4


def test_read_only_stays_read_only_and_writable_stays_writable():
    ro, rw = receive("blob"), receive("writable-blob")
    assert type(ro.data) is memoryview and ro.data.readonly
    assert in_shared_memory(*_address_and_size(ro.data))
    with pytest.raises(TypeError, match="read-only"):
        ro.data[0] = 1
    assert type(rw.data) is memoryview and not rw.data.readonly
    rw.data[0] = 42
    assert rw.data[0] == 42


def _address_and_size(view):
    a = np.frombuffer(view, dtype=np.uint8)
    return a.__array_interface__["data"][0], a.nbytes


def test_buffers_outlive_the_message_and_the_sender_then_go_back(sharing_strategy):
    gc.collect()
    before = {id(s) for s in segment.live_segments()}
    got = receive("table", method="fork")                # its sender has exited
    held = [s for s in segment.live_segments() if id(s) not in before]
    assert held and sum(s.size for s in held) >= got.nbytes
    assert got.column("i").to_numpy()[-1] == ROWS - 1    # still readable
    del got
    gc.collect()
    mp.empty_cache()
    assert {id(s) for s in segment.live_segments()} <= before   # every segment let go


def test_standard_library_channels_still_pickle_arrow_in_band():
    # (spawn arguments go through ForkingPickler.dumps, not a sharedmp channel: no fds)
    import pickle
    from multiprocessing.reduction import ForkingPickler
    t = bw.make("table", 1000)
    assert pickle.loads(ForkingPickler.dumps(t)).equals(t)


# -- hostile or broken frames --------------------------------------------------------------

def test_a_place_outside_its_segment_is_a_protocol_error():
    mapping, offset = segment.create(1 << 16)[1], 0
    with pytest.raises(mp.ProtocolError, match="does not fit"):
        wire._view((mapping, len(mapping) - 4, 100, True))
    with pytest.raises(mp.ProtocolError, match="place must be"):
        wire._view((bytearray(100), 0, 10, True))           # not a sharedmp segment
    with pytest.raises(mp.ProtocolError, match="place must be"):
        wire._view((mapping, offset, 10))
    assert bytes(wire._view((mapping, 8, 4, True))) == b"\0" * 4


def test_a_frame_whose_places_do_not_fit_closes_every_fd():
    payload, fds, kind = wire.dumps(bw.make("table", 20_000))
    assert kind == wire.FLAG_BUFFERS and fds
    received = [os.dup(fd) for fd in fds]                 # as a channel would have them
    bad = bytearray(payload)
    bad[:4] = (len(bad)).to_bytes(4, "little")            # places longer than the frame
    with pytest.raises(mp.ProtocolError, match="bytes of places"):
        wire.loads(bytes(bad), received, kind)
    for fd in received:
        with pytest.raises(OSError):
            os.fstat(fd)

"""Child-process side of test_buffers.py: objects whose buffers pickle hands out of band.

``make(kind, rows)`` builds the same object in any process, so that a test compares what
arrived with what it builds itself.
"""
import os
import pickle

import numpy as np

from _workers import _guard


class Sub(np.ndarray):
    """A NumPy subclass: NumPy pickles it by value (it offers PickleBuffers for plain arrays
    only, which sharedmp's own reducer takes first)."""


class Blob:
    """A type of one's own that offers its bytes out of band (docs/reference.md): bytes are
    read-only, a bytearray writable; the receiver gets a memoryview of the same kind."""

    def __init__(self, data):
        self.data = data

    def __reduce_ex__(self, protocol):
        if protocol >= 5:
            return Blob, (pickle.PickleBuffer(self.data),)
        return Blob, (self.data,)


def _table(rows):
    import pyarrow as pa
    rng = np.random.default_rng(0)
    cols = {f"f{i}": rng.standard_normal(rows) for i in range(3)}
    cols["i"] = np.arange(rows, dtype=np.int64)
    cols["s"] = pa.array([f"row-{i}" for i in range(rows)])
    return pa.table(cols)


def _polars_strings(rows):
    """A frame that Polars builds itself: string and binary views, short (inline) and long
    (in data buffers that Polars grows from 8 KiB: several per column), nulls, two chunks."""
    import polars as pl
    half = rows // 2
    long = [f"a value longer than twelve bytes, row {i}" for i in range(half)]
    first = pl.DataFrame({
        "short": [f"r{i}" if i % 7 else None for i in range(half)],
        "long": long,
        "bin": [s.encode() for s in long],
        "i": np.arange(half, dtype=np.int64),
    })
    second = first.with_columns(pl.col("long").str.to_uppercase(), pl.col("i") + half)
    return pl.concat([first, second], rechunk=False)


def make(kind, rows):
    if kind == "table":
        return _table(rows)
    if kind == "batch":
        return _table(rows).to_batches()[0]
    if kind == "array":
        return _table(rows).column("s").chunk(0)
    if kind == "chunked":
        import pyarrow as pa
        t = _table(rows)
        return pa.chunked_array([t.column("f0").chunk(0), t.column("f1").chunk(0)])
    if kind == "pandas":                    # NumPy columns and an Arrow string column
        import pandas as pd
        t = _table(rows)
        df = t.drop_columns(["s"]).to_pandas()
        df["s"] = pd.Series(t.column("s").to_pylist(), dtype=pd.ArrowDtype(t.column("s").type))
        return df
    if kind == "polars":
        import polars as pl
        return pl.from_arrow(_table(rows))
    if kind == "polars-series":
        import polars as pl
        return pl.from_arrow(_table(rows)).get_column("s")
    if kind == "polars-strings":
        return _polars_strings(rows)
    if kind == "polars-strings-series":
        return _polars_strings(rows).get_column("long")
    if kind == "subclass":
        return np.arange(rows, dtype=np.float64).view(Sub)
    if kind == "blob":
        return Blob(bytes(range(256)) * (rows // 256))
    if kind == "writable-blob":
        return Blob(bytearray(range(256)) * (rows // 256))
    if kind == "object-array":
        return np.array([f"o{i}" for i in range(min(rows, 1000))], dtype=object)
    raise ValueError(kind)


def put_and_exit(conn, q, kind, rows):
    """Put ``make(kind, rows)`` and return: the process exits while the message waits."""
    def run():
        q.put(make(kind, rows))
        return os.getpid()
    _guard(conn, run)

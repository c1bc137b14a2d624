"""Polars frames and series through Arrow, so that their buffers travel out of band.

Polars pickles a frame as its own IPC bytes, in band: every byte is copied into the pickle
and out again. Here a ``DataFrame`` or ``Series`` travels as the Arrow data it already is,
whose buffers pyarrow hands to pickle as ``PickleBuffer`` (view types included): on
sharedmp's channels they go through shared memory (``wire.py``), and ``polars.from_arrow``
rebuilds the frame over them, without a copy. A ``Series`` travels as a one-column frame.

Polars' strings and binaries are Arrow *views* (``Utf8View``/``BinaryView``: 16-byte views,
short values inline, long ones in data buffers) since early 2024 (Polars 0.20.6): in every
version this package allows (>= 1.0). What ``to_arrow`` exports depends on its compatibility
level:

- the default (``CompatLevel.oldest()``, or no argument) converts them to Arrow
  ``large_string``/``large_binary``: every string is copied on the sender, and
  ``from_arrow`` copies them back into views on the receiver;
- the newest level (``to_arrow(compat_level=polars.CompatLevel.newest())``, Polars >= 1.1;
  ``to_arrow(future=True)`` in Polars 1.0, whose ``CompatLevel`` does not exist) exports
  them as they are, ``string_view``/``binary_view`` (pyarrow >= 16 reads them), and
  ``from_arrow`` takes them as they are: no copy on either side. Measured with Polars 2.1
  and pyarrow 26: a 1,000,000-row frame of 8 float64 columns and a string column goes
  through a spawn Queue in about the time of the same pyarrow table.

This module uses the newest level the installed Polars has, and the default level if that
fails (pyarrow too old for views, a Polars whose newest level pyarrow cannot read). Both
sides are assumed to run the same Polars, as processes of one environment do; the level
is Polars' and may change between its versions. Still copied on both sides whatever the
level: categorical and enum columns (Polars re-maps their indices to its global categories
on import). A frame that Arrow cannot hold (an ``Object`` or ``Int128`` column) falls back
to Polars' own pickle, in band. Installed by the registry once polars is imported. (polars
is imported in the functions, not here: importing it installs these reducers, which must
find this module whole.)
"""
from __future__ import annotations

import warnings
from typing import Any

# The keyword arguments of ``to_arrow`` for the newest compatibility level (None: not yet
# known), worked out once per process.
_newest: dict[str, Any] | None = None


def _newest_level() -> dict[str, Any]:
    global _newest
    if _newest is None:
        import polars as pl
        compat = getattr(pl, "CompatLevel", None)
        if compat is None:                   # Polars 1.0: the newest level was `future`
            _newest = {"future": True}
        else:
            with warnings.catch_warnings():  # ("unstable" warning, POLARS_WARN_UNSTABLE=1)
                warnings.simplefilter("ignore")
                _newest = {"compat_level": compat.newest()}
    return _newest


def to_arrow(df: Any) -> Any:
    """``df`` (a polars DataFrame) as a pyarrow Table, its string and binary views kept as
    they are where this Polars and pyarrow can; raises what ``to_arrow()`` raises."""
    try:
        return df.to_arrow(**_newest_level())
    except Exception:                        # (pyarrow < 16, no such argument, ...)
        return df.to_arrow()


def reduce_polars_frame(df):
    try:
        table = to_arrow(df)
    except Exception:                 # (an Object column, ...): Polars' own pickle
        return df.__reduce__()
    return rebuild_polars_frame, (table,)


def rebuild_polars_frame(table):
    import polars as pl
    return pl.from_arrow(table, rechunk=False)


def reduce_polars_series(s):
    try:
        table = to_arrow(s.to_frame())
    except Exception:
        return s.__reduce__()
    return rebuild_polars_series, (table,)


def rebuild_polars_series(table):
    import polars as pl
    return pl.from_arrow(table, rechunk=False).to_series()

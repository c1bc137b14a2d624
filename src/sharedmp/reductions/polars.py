"""Polars frames and series through Arrow, so that their buffers travel out of band.

Polars pickles a frame as its own IPC bytes, in band: every byte is copied into the pickle
and out again. Here a ``DataFrame`` or ``Series`` travels as the Arrow data it already is
(``to_arrow()``, without a copy for most types), whose buffers pyarrow hands to pickle as
``PickleBuffer``: on sharedmp's channels they go through shared memory (``wire.py``), and
``polars.from_arrow`` rebuilds the frame over them. A frame that Arrow cannot hold (an
``Object`` column) falls back to Polars' own pickle. Installed by the registry once polars
is imported. (polars is imported in the rebuild functions, not here: importing it installs
these reducers, which must find this module whole.)
"""


def reduce_polars_frame(df):
    try:
        table = df.to_arrow()
    except Exception:                 # (an Object column, ...): Polars' own pickle
        return df.__reduce__()
    return rebuild_polars_frame, (table,)


def rebuild_polars_frame(table):
    import polars as pl
    return pl.from_arrow(table)


def reduce_polars_series(s):
    try:
        array = s.to_arrow()
    except Exception:
        return s.__reduce__()
    return rebuild_polars_series, (s.name, array)


def rebuild_polars_series(name, array):
    import polars as pl
    return pl.Series(name, array)

"""Both sides of test_differential.py: the corpus, built alike in every process, and what a
receiver reports of what it got.

This module imports neither sharedmp nor pytest: the reference run (``reference_main``) is a
fresh interpreter with the standard library alone, and checks that sharedmp never came in.
A receiver compares each object with the one it builds itself (``corpus()`` is seeded), so
only descriptions (plain data) travel back.
"""
import json
import multiprocessing
import sys

import numpy as np

TIMEOUT = 60
KIB, MIB = 1 << 10, 1 << 20


# -- the corpus ------------------------------------------------------------------------------

def _filled(code, shape, rng):
    """An array of dtype ``code`` and ``shape`` with awkward values (NaN, inf, -0.0, NaT,
    extremes, non-ASCII)."""
    wanted, n = np.dtype(code), int(np.prod(shape))
    dtype = wanted.newbyteorder("=")               # made native, then given the order asked
    kind = dtype.kind
    if kind == "b":
        flat = rng.random(n) > 0.5
    elif kind in "iu":
        info = np.iinfo(dtype)
        flat = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
        flat[:2] = info.min, info.max
    elif kind in "fc":
        flat = rng.standard_normal(n).astype(dtype)
        if kind == "c":
            flat = flat + 1j * rng.standard_normal(n).astype(dtype)
        flat[:4] = np.nan, np.inf, -np.inf, -0.0
    elif kind in "mM":
        flat = rng.integers(-10 ** 9, 10 ** 9, n).astype(dtype)
        flat[0] = np.array("NaT", dtype)
    elif kind == "S":
        flat = np.array([f"s{i}\x00x".encode()[:dtype.itemsize] for i in range(n)], dtype)
    elif kind == "U":
        flat = np.array([f"é{i}"[:dtype.itemsize // 4] for i in range(n)], dtype)
    else:                                          # void: raw bytes
        flat = np.frombuffer(rng.bytes(n * dtype.itemsize), dtype)
    return np.asarray(flat, dtype).astype(wanted).reshape(shape)


# every kind; ">" where a non-native byte order means something
CODES = ["?", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "g", "c8",
         "c16", "M8[s]", "m8[ms]", "S5", "U3", "V4"]
SWAPPED = ["i2", "i4", "i8", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16", "M8[s]",
           "m8[ms]", "U3"]
RECORD = np.dtype([("a", "<i4"), ("b", ">f8"), ("c", "S3"), ("d", "<f4", (2,))])


def _read_only(a):
    a = a.view()
    a.flags.writeable = False
    return a


def _arrays(rng):
    out = []
    for code in CODES + [">" + c for c in SWAPPED]:
        a = _filled(code, (4, 6), rng)
        out += [(code, a), (f"{code} F", np.asfortranarray(a))]
    rec = np.zeros(5, RECORD)
    rec["a"], rec["b"], rec["c"] = np.arange(5), [np.nan, 1.5, -0.0, np.inf, 2], b"xyz"
    rec["d"] = np.arange(10).reshape(5, 2)
    out += [("structured", rec), ("structured F", np.asfortranarray(np.stack([rec, rec], 1))),
            ("subarray dtype", np.zeros(3, ("<i2", (2,))) + 7)]      # NumPy makes it (3, 2)
    m = np.arange(60.0).reshape(6, 10)
    big_endian = m.astype(">i4")
    out += [("a[::-1]", m[::-1]), ("a[::3]", m[::3]), ("a[:, ::2]", m[:, ::2]), ("a.T", m.T),
            ("a[::-2, 1::3]", m[::-2, 1::3]), (">i4 a[:, ::-3]", big_endian[:, ::-3]),
            ("1-d [::-1]", np.arange(7.0)[::-1]), ("1-d [1::3]", np.arange(20)[1::3]),
            ("a[None]", np.arange(4.0)[None]), ("a[:, None]", np.arange(4.0)[:, None]),
            ("F[:, :3]", np.asfortranarray(m)[:, :3]), ("F[1:, :]", np.asfortranarray(m)[1:])]
    out += [("0-d", np.array(2.5)), ("0-d >i2", np.array(7, ">i2")),
            ("0-d U", np.array("é", "U3")), ("empty (0,)", np.zeros(0)),
            ("empty (3, 0)", np.zeros((3, 0))), ("empty (0, 3) F", np.zeros((0, 3), order="F")),
            ("empty >i4", np.zeros((2, 0), ">i4"))]
    out += [("read-only", _read_only(m)), ("read-only F", _read_only(np.asfortranarray(m))),
            ("read-only view", _read_only(m[::2, ::3]))]
    obj = np.array([1, "a", None, [1, 2], {"k": 3}, 2.5], dtype=object)
    out += [("object", obj), ("object F", np.asfortranarray(obj.reshape(2, 3)))]
    for size in [1 * KIB, 47 * KIB, 49 * KIB, 127 * KIB, 128 * KIB, 129 * KIB, 1 * MIB,
                 4 * MIB + 8 * KIB]:
        a = np.arange(size // 8, dtype="f8")
        out.append((f"{size // KIB} KiB", a))
        if size % (16 * 8) == 0:
            out.append((f"{size // KIB} KiB F", np.asfortranarray(a.reshape(16, -1))))
    out += [("1 MiB >i8", np.arange(MIB // 8, dtype=">i8")),
            ("1 MiB [::-1]", np.arange(MIB // 4, dtype="f4")[::-1]),
            ("1 MiB read-only", _read_only(np.arange(MIB // 8.0)))]
    return out


def _containers(rng):
    a = np.arange(12.0).reshape(3, 4)
    b = np.asfortranarray(np.arange(6, dtype=">i2").reshape(2, 3))
    big = np.arange(MIB // 8.0)
    return [("list", [a, b, a.T]), ("dict", {"a": a, "b": b, "n": 3}),
            ("tuple", (a, "x", None, b)), ("same array twice", [a, a, b]),
            ("same big array twice", [big, big]), ("nested", {"x": [a, (a, b)], "y": (b,)}),
            ("two views of one base", [a[0], a[1:]])]


def _tensors():
    try:
        import torch
    except ImportError:
        return []
    torch.manual_seed(40)
    m = torch.randn(6, 8)
    out = [(f"tensor {dt}", (torch.randn(4, 5) * 50).to(dt)) for dt in
           (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
            torch.int8, torch.uint8, torch.bool, torch.complex64)]
    out += [("tensor .t()", m.t()), ("tensor [::2]", m[::2]), ("tensor [:, 1:]", m[:, 1:]),
            ("tensor requires_grad", torch.randn(3, 4, requires_grad=True)),
            ("tensor 0-d", torch.tensor(3.5)), ("tensor empty", torch.zeros(0, 3)),
            ("tensor 1 MiB", torch.arange(MIB // 4, dtype=torch.float32)),
            ("same tensor twice", [m, m])]
    return out


def _frames(rng):
    out = []
    try:
        import pandas as pd
        df = pd.DataFrame({"f": [1.5, np.nan, -0.0], "i": [1, 2, 3], "s": ["a", "é", None],
                           "b": [True, False, True]})
        n = 100_000
        out += [("pandas small", df), ("pandas series", df["f"]),
                ("pandas big", pd.DataFrame({"f": rng.standard_normal(n), "i": np.arange(n),
                                             "s": [f"r{i}" for i in range(n)]}))]
    except ImportError:
        pass
    try:
        import pyarrow as pa
        out += [("arrow small", pa.table({"i": [1, 2, None], "s": ["a", None, "é"]})),
                ("arrow big", pa.table({"i": np.arange(100_000),
                                        "f": rng.standard_normal(100_000)}))]
    except ImportError:
        pass
    return out


def corpus():
    """[(name, object)]: the same in every process (seeded)."""
    rng = np.random.default_rng(40)
    return _arrays(rng) + _containers(rng) + _tensors() + _frames(rng)


# -- what a receiver got ---------------------------------------------------------------------

def _dtype_text(dtype):
    return str(dtype.descr) if dtype.fields is not None else dtype.str


def same_values(got, want):
    """Equal values, NaN (and NaT) equal to itself."""
    if not isinstance(got, np.ndarray) or got.shape != want.shape:
        return False
    if want.dtype.names:
        return all(same_values(got[n], want[n]) for n in want.dtype.names)
    kind = want.dtype.kind
    if kind in "fcmM":
        return bool(np.array_equal(got, want, equal_nan=True))
    if kind == "V":
        return got.tobytes() == want.tobytes()
    if kind == "O":
        return got.tolist() == want.tolist()
    return bool(np.array_equal(got, want))


def _shared(obj):
    mp = sys.modules.get("sharedmp")
    return bool(mp is not None and mp.is_shared(obj))


def _same_tensor(got, want):
    import torch
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        return False
    got, want = got.detach(), want.detach()
    if got.dtype.is_floating_point or got.dtype.is_complex:
        return bool(((got == want) | (got.isnan() & want.isnan())).all())
    return bool(torch.equal(got, want))


def describe(got, want):
    """What a receiver must agree on with the reference, as plain data."""
    if isinstance(got, np.ndarray):
        f = got.flags
        return {"type": type(got).__name__, "dtype": _dtype_text(got.dtype),
                "native": _dtype_text(got.dtype.newbyteorder("=")), "shape": got.shape,
                "strides": got.strides, "C": f.c_contiguous, "F": f.f_contiguous,
                "W": f.writeable, "shared": _shared(got), "values": same_values(got, want)}
    if isinstance(got, (list, tuple)):
        firsts = [next(j for j, o in enumerate(got) if o is g) for g in got]
        return {"type": type(got).__name__, "same": firsts,
                "items": [describe(g, w) for g, w in zip(got, want)], "n": len(got)}
    if isinstance(got, dict):
        return {"type": "dict", "keys": sorted(got),
                "items": {k: describe(got[k], want[k]) for k in sorted(got) if k in want}}
    name = type(got).__name__
    if name in ("Tensor", "Parameter"):
        return {"type": name, "dtype": str(got.dtype), "shape": list(got.shape),
                "stride": list(got.stride()), "requires_grad": got.requires_grad,
                "contiguous": got.is_contiguous(), "shared": got.is_shared(),
                "values": _same_tensor(got, want)}
    if name in ("DataFrame", "Series"):
        import pandas as pd
        dtypes = [str(d) for d in (got.dtypes if name == "DataFrame" else [got.dtype])]
        same = type(got) is type(want)
        if same:
            try:
                (pd.testing.assert_frame_equal if name == "DataFrame"
                 else pd.testing.assert_series_equal)(got, want)
            except AssertionError:
                same = False
        return {"type": name, "dtypes": dtypes, "values": same}
    if name in ("Table", "RecordBatch"):
        return {"type": name, "schema": str(got.schema), "values": got.equals(want)}
    return {"type": name, "values": got == want}


def plain(obj):
    """``obj`` as JSON would give it back (tuples as lists): the same for every side."""
    return json.loads(json.dumps(obj))


# -- receiving processes -----------------------------------------------------------------------

def _receive(channel):
    if hasattr(channel, "recv"):                        # a Pipe's end
        if not channel.poll(TIMEOUT):
            raise TimeoutError("nothing came")
        return channel.recv()
    if hasattr(channel, "empty") and not hasattr(channel, "qsize"):   # a SimpleQueue
        if not channel._reader.poll(TIMEOUT):
            raise TimeoutError("nothing came")
        return channel.get()
    return channel.get(timeout=TIMEOUT)


def receive_all(report, channels):
    """For each channel of ``channels`` [(label, receiving end)], in order: each corpus item
    alone, then in a 1-tuple; report {label: [(alone, wrapped) descriptions]} on ``report``,
    or ("error", traceback)."""
    import traceback
    try:
        items = corpus()
        out = {}
        for label, channel in channels:
            out[label] = [(describe(_receive(channel), want), describe(_receive(channel)[0], want))
                          for _, want in items]
        out["sharedmp imported"] = "sharedmp" in sys.modules
        report.send(("ok", plain(out)))
    except BaseException:
        report.send(("error", traceback.format_exc()))
        raise


def send_all(channels):
    """What ``receive_all`` expects, on the sending ends [(label, end)]."""
    items = corpus()
    for _, end in channels:
        put = end.send if hasattr(end, "send") else end.put
        for _, obj in items:
            put(obj)
            put((obj,))


def reference_main():
    """The standard library alone (no sharedmp): a spawn child receives the corpus on a
    Queue and a Pipe; prints the descriptions as one JSON line."""
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    r, w = ctx.Pipe(duplex=False)
    back, report = ctx.Pipe(duplex=False)
    p = ctx.Process(target=receive_all, args=(report, [("Queue", q), ("Pipe", r)]), daemon=True)
    p.start()
    try:
        send_all([("Queue", q), ("Pipe", w)])
        if not back.poll(TIMEOUT):
            raise TimeoutError("the reference child reported nothing")
        status, out = back.recv()
        if status != "ok":
            raise RuntimeError(out)
        p.join(TIMEOUT)
    finally:
        if p.is_alive():
            p.kill()
    out["parent imported sharedmp"] = "sharedmp" in sys.modules
    print(json.dumps(out))

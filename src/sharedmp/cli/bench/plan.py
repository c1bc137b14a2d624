"""What ``python -m sharedmp bench`` measures: the systems, the workloads, the targets, and the
plan of a run at a given scale (``make_plan``, ``counts``)."""
from .worker import F32, MiB, W7_WORKERS

SYSTEMS = [                       # (key, column title)
    ("sharedmp", "sharedmp"),
    ("sharedmp_fs", "sharedmp fs"),
    ("sharedmp_torch", "sharedmp torch"),
    ("sharedmp_torch_fs", "sharedmp torch fs"),
    ("torch_fd", "torch fd"),
    ("torch_fs", "torch fs"),
    ("torch_spawn", "torch spawn"),
    ("stdlib", "stdlib"),
]
QUEUE_SYSTEMS = ["sharedmp", "sharedmp_fs", "sharedmp_torch", "torch_fd", "torch_fs",  # W1-W6
                 "stdlib"]
COLORS = {"sharedmp": "#d62728", "sharedmp_fs": "#e377c2", "sharedmp_torch": "#ff9896",
          "sharedmp_torch_fs": "#c5b0d5",
          "torch_fd": "#1f77b4", "torch_fs": "#9ecae1", "torch_spawn": "#17becf",
          "stdlib": "#7f7f7f"}
LONG_NAMES = {"sharedmp": "sharedmp (file_descriptor)", "sharedmp_fs": "sharedmp file_system",
              "sharedmp_torch": "sharedmp, torch tensors",
              "sharedmp_torch_fs": "sharedmp file_system, torch tensors (P3 only)",
              "torch_fd": "torch file_descriptor (W7: torch's default DataLoader, fork)",
              "torch_fs": "torch file_system", "torch_spawn": "torch DataLoader, spawn (W7 only)",
              "stdlib": "stdlib (pickled by value)"}


def state_dict_shapes():
    """A small CNN's state_dict: 33 conv+batchnorm pairs over widths 16..128, and a head.

    200 arrays, 5.6 MiB, as ``torch.nn`` lays it out: a conv weight, then the batchnorm's
    weight, bias, running_mean, running_var (float32) and num_batches_tracked (int64, 0-d).
    """
    shapes = []

    def conv_bn(cin, cout):
        shapes.append(((cout, cin, 3, 3), "float32"))
        shapes.extend([((cout,), "float32")] * 4)
        shapes.append(((), "int64"))

    conv_bn(3, 16)
    cin = 16
    for width in (16, 32, 64, 128):
        for _ in range(8):
            conv_bn(cin, width)
            cin = width
    shapes.append(((10, cin), "float32"))
    shapes.append(((10,), "float32"))
    return shapes


def _nbytes(shapes):
    total = 0
    for shape, dtype in shapes:
        n = 1
        for d in shape:
            n *= d
        total += n * (8 if dtype == "int64" else 4)
    return total


# id, full count, kind, shape (float32 elements), what the table shows
WORKLOADS = [
    dict(id="W1", n=5000, kind="fresh", shape=[256], title="fresh 1 KiB array each",
         metrics=["msgs"]),
    dict(id="W2", n=1000, kind="fresh", shape=[256 * 1024], title="fresh 1 MiB array each",
         metrics=["msgs", "gbps"]),
    dict(id="W3", n=40, kind="fresh", shape=[16 * MiB], title="fresh 64 MiB array each",
         metrics=["gbps"]),
    dict(id="W4", n=20, kind="state_dict", title="fresh CNN state_dict (200 arrays, {size}) each",
         metrics=["msgs"]),
    dict(id="W5", n=200, kind="same", shape=[16 * MiB], title="the same shared 64 MiB array",
         metrics=["msgs"], stdlib_fraction=0.1),
    dict(id="W6", n=5000, kind="fresh", shape=[256], keep=True,
         title="fds held while keeping the 1 KiB arrays alive", metrics=["fds"]),
    # What most users send: arrays and tensors made by NumPy or torch, not in shared memory
    # yet (sharedmp copies each into its arenas at put(), torch moves each tensor's storage)
    dict(id="P1", n=5000, kind="plain", shape=[256], title="plain NumPy 1 KiB array each",
         metrics=["msgs"], systems=["sharedmp", "sharedmp_fs", "torch_fd", "torch_fs", "stdlib"]),
    dict(id="P2", n=1000, kind="plain", shape=[256 * 1024], title="plain NumPy 1 MiB array each",
         metrics=["msgs"], systems=["sharedmp", "sharedmp_fs", "torch_fd", "torch_fs", "stdlib"]),
    dict(id="P3", n=5000, kind="plain", shape=[256], title="plain torch 1 KiB tensor each",
         metrics=["msgs"], systems=["sharedmp_torch", "sharedmp_torch_fs", "torch_fd",
                                    "torch_fs", "stdlib"]),
    dict(id="W7", n=1000, kind="dataloader", batch=64,
         title="DataLoader batches of 64 dicts of 3 tensors", metrics=["batches"],
         systems=["sharedmp_torch", "torch_fd", "torch_spawn"]),
]
METRIC_UNITS = {"msgs": "msg/s", "gbps": "GB/s", "fds": "fds (lower is better)",
                "batches": "batch/s"}

TARGETS = [   # (workload, metric, system, against, at least / at most, factor, text)
    ("W1", "msgs", "sharedmp", "torch_fd", ">=", 80, "W1 >= 80x torch fd"),
    ("W1", "msgs", "sharedmp", "stdlib", ">=", 1.0, "W1 >= 1.0x stdlib"),
    ("W1", "msgs", "sharedmp_fs", "torch_fs", ">=", 50, "W1 file_system >= 50x torch fs"),
    ("W3", "gbps", "sharedmp", "torch_fd", ">=", 2, "W3 >= 2x torch fd"),
    ("W3", "gbps", "sharedmp", "alloc_fill", ">=", 0.7, "W3 >= 0.7x alloc+fill bound"),
    ("W4", "msgs", "sharedmp", "torch_fd", ">=", 30, "W4 >= 30x torch fd"),
    ("W5", "msgs", "sharedmp", None, ">=", 10000, "W5 >= 10,000 msg/s"),
    ("W6", "fds", "sharedmp", None, "<=", 32, "W6 <= 32 fds for 5,000 live arrays"),
] + [(w, m, "sharedmp_torch", "sharedmp", ">=", 0.8, f"{w} torch >= 0.8x sharedmp NumPy")
     for w, m in (("W1", "msgs"), ("W2", "gbps"), ("W3", "gbps"), ("W4", "msgs"),
                  ("W5", "msgs"))] + [
    ("W6", "fds", "sharedmp_torch", "sharedmp", "<=", None, "W6 torch fds <= sharedmp NumPy fds"),
    ("W7", "batches", "sharedmp_torch", "torch_fd", ">=", 5,
     "W7 >= 5x torch's default DataLoader"),
    ("P1", "msgs", "sharedmp", "stdlib", ">=", 2, "P1 plain 1 KiB >= 2x stdlib"),
    ("P2", "msgs", "sharedmp", "stdlib", ">=", 10, "P2 plain 1 MiB >= 10x stdlib"),
    ("P1", "msgs", "sharedmp_fs", "sharedmp", ">=", 0.5, "P1 file_system >= 0.5x fd"),
    ("P2", "msgs", "sharedmp_fs", "sharedmp", ">=", 0.5, "P2 file_system >= 0.5x fd"),
    ("P3", "msgs", "sharedmp_torch_fs", "sharedmp_torch", ">=", 0.5,
     "P3 file_system >= 0.5x fd"),
]


# The program rows (start.py), each figure from fresh programs: sharedmp's time against its
# baseline's, in the same run; two tables: process start (S1-S6) and data frames (F1-F3).
# n: S1 the timed runs of each import (the median), F1-F3 the timed messages per run, the
# others the rounds or calls per run; needs: the modules a row cannot run without.
FRAME_ROWS = 1_000_000            # F1-F3: 8 float64 columns + 1 string column, about 80 MB
def _small(wid, n, case, item, title, **more):
    """An L row: against the standard library, and torch.multiprocessing unless ``also``
    says otherwise."""
    return {"id": wid, "n": n, "kind": "small", "case": case, "item": item,
            "baseline": "stdlib", "also": ["torch_mp"], "unit": "us", "title": title, **more}


START_WORKLOADS = [
    dict(id="S1", n=9, kind="import", baseline="stdlib", unit="ms",
         title="import sharedmp / import multiprocessing, fresh interpreter"),
    dict(id="S2", n=100, kind="pool", method="spawn", baseline="stdlib", unit="s",
         title="Pool(2) + map(abs, 10 items) + terminate(), spawn"),
    dict(id="S3", n=100, kind="pool", method="fork", baseline="stdlib", unit="s",
         title="Pool(2) + map(abs, 10 items) + terminate(), fork"),
    dict(id="S4", n=100, kind="pool", method="forkserver", baseline="stdlib", unit="s",
         title="Pool(2) + map(abs, 10 items) + terminate(), forkserver"),
    dict(id="S5", n=100, kind="joblib", calls="tiny", baseline="loky", unit="s",
         needs=["joblib"], title="joblib Parallel(n_jobs=2) calls of 10 x abs"),
    dict(id="S6", n=10, kind="joblib", calls="tensors", baseline="loky", unit="s",
         needs=["joblib", "torch"],
         title="joblib Parallel(n_jobs=2) calls, a fresh 64 MiB tensor to 2 tasks"),
    # One table or frame per message through a spawn Queue; the figure is ms per message.
    dict(id="F1", n=5, kind="frame", frame="arrow", baseline="stdlib", unit="ms",
         needs=["pyarrow"], title="pyarrow.Table"),
    dict(id="F2", n=5, kind="frame", frame="pandas", baseline="stdlib", unit="ms",
         needs=["pyarrow", "pandas"], title="pandas DataFrame (table.to_pandas())"),
    dict(id="F3", n=5, kind="frame", frame="polars", baseline="stdlib", unit="ms",
         needs=["pyarrow", "polars"], title="Polars DataFrame (polars.from_arrow(table))"),
    # Small messages, one program per run (small.py's SMALL_SCRIPT), spawn, against the
    # standard library and torch.multiprocessing ("torch_mp", where torch is installed):
    # round trips (us, the median; p90 shown), maps (us per item), streams from warm
    # producers (us per message; msg/s shown). items: 1 KiB float32 arrays made fresh for each
    # message ("torch": fresh tensors for sharedmp and torch, NumPy for the stdlib; "tuple":
    # (int, float, a 16-character str, int)).
    _small("L1", 2000, "pingpong", "int", "Pipe ping-pong of an int, median round trip"),
    _small("L2", 2000, "pingpong", "array",
           "Pipe ping-pong of a fresh 1 KiB array, median round trip"),
    _small("L3", 1000, "executor_one", "array",
           "ProcessPoolExecutor(1) submit + result of a 1 KiB array, median"),
    _small("L4", 2000, "executor_map", "array",
           "ProcessPoolExecutor(2).map echoing 1 KiB arrays, per item"),
    _small("L5", 2000, "pool_map", "array",
           "Pool(2).map (chunksize 1) of 1 KiB arrays to a float, per item"),
    _small("L6", 5000, "stream", "array", "a standard-library Queue of fresh 1 KiB arrays "
           "with sharedmp imported (not: baseline), per message", channel="stdlib", also=[]),
    _small("L7", 5000, "stream", "array",
           "burst: fresh 1 KiB arrays through a Queue, per message"),
    _small("L8", 50000, "stream", "array",
           "steady: fresh 1 KiB arrays through a Queue, per message"),
    _small("L9", 5000, "stream", "torch",
           "burst: fresh 1 KiB tensors (stdlib: arrays) through a Queue, per message",
           needs=["torch"]),
    # (L10 without torch_mp: its 50,000 tensors, 2 ms each there (L9), take minutes a run)
    _small("L10", 50000, "stream", "torch",
           "steady: fresh 1 KiB tensors (stdlib: arrays) through a Queue, per message",
           needs=["torch"], also=[]),
    _small("L11", 50000, "stream", "tuple",
           "steady: small tuples (int, float, str, int) through a Queue, per message"),
    _small("L12", 50000, "stream4", "array",
           "four producers of fresh 1 KiB arrays into one Queue, per message"),
]
SMALL_RUNS = 3              # L rows: runs per system at least (where the OS puts the two
                            # processes, one CPU or two, changes a round trip 4x: best of runs)
START_TARGETS = [   # (workload, sharedmp's time at most this factor of the baseline's, text)
    ("S1", 2.0, "S1 import time <= 2x multiprocessing's"),
    ("S2", 1.3, "S2 spawn Pool time <= 1.3x stdlib's"),
    ("S3", 1.3, "S3 fork Pool time <= 1.3x stdlib's"),
    ("S4", 1.3, "S4 forkserver Pool time <= 1.3x stdlib's"),
    ("S5", 1.0, "S5 joblib tiny-call time <= 1x loky's"),
    ("S6", 0.5, "S6 joblib tensor time <= 0.5x loky's"),
    ("F1", 0.2, "F1 pyarrow.Table time <= 0.2x stdlib's"),
    ("F2", 0.2, "F2 pandas DataFrame time <= 0.2x stdlib's"),
    ("F3", 0.2, "F3 Polars DataFrame time <= 0.2x stdlib's"),
    ("L1", 0.5, "L1 ping-pong of an int <= 0.5x stdlib's time"),
    ("L2", 0.15, "L2 ping-pong of a 1 KiB array <= 0.15x stdlib's time"),
    ("L3", 1.3, "L3 executor submit + result <= 1.3x stdlib's time"),
    ("L4", 1.0, "L4 executor map <= 1x stdlib's time"),
    ("L5", 1.0, "L5 Pool map <= 1x stdlib's time"),
    ("L6", 1.0, "L6 stdlib Queue with sharedmp imported <= 1x its time without"),
    ("L7", 1 / 2.5, "L7 burst >= 2.5x stdlib's rate"),
    ("L8", 1 / 3, "L8 steady >= 3x stdlib's rate"),
    ("L9", 1 / 2, "L9 tensor burst >= 2x stdlib's rate"),
    ("L10", 1 / 2, "L10 tensor steady >= 2x stdlib's rate"),
    ("L11", 1 / 2, "L11 small tuples >= 2x stdlib's rate"),
    ("L12", 1 / 3, "L12 four producers >= 3x stdlib's rate"),
]


# The dataset rows (datasets.py): torch's DataLoader, persistent workers, over a plain dataset
# and its shared form (mp.share_dataset), each (row, workers) pair a fresh program per form.
# n: samples at scale 1 (records; array rows of 4 KiB: 256 MiB), at the least 10,000 records
# (1.7 MiB: above share_dataset's default threshold) and 4 batches; epochs: shuffled epochs.
# Records in batches of 1,024: at 256 the plain rows spent most of 3.5 minutes passing
# torch's fds for two tensors a batch, which is not what they measure.
DATASET_WORKERS = [1, 2, 4]
DATASET_WORKLOADS = [
    dict(id=f"D{i + 1}", kind="dataset", dataset="records", method=m, n=1_000_000, epochs=3,
         batch=1024, needs=["torch"],
         title="records (int, str, float) in a list, 3 shuffled epochs, " + m)
    for i, m in enumerate(("fork", "spawn", "forkserver"))] + [
    dict(id=f"D{i + 4}", kind="dataset", dataset="array", method=m, n=65536, epochs=1,
         batch=256, needs=["torch"], title="float32 array rows ({size}), 1 shuffled epoch, " + m)
    for i, m in enumerate(("fork", "spawn", "forkserver"))]
DATASET_ROW_BYTES = 4096          # D4-D6: a row of 1,024 float32
DATASET_TARGETS = [   # (workload, measure, at most / below, factor, text)
    *[(w, "workers", "<=", 1.25, f"{w} {m}: shared MiB, 4 workers <= 1.25x 1")
      for w, m in (("D1", "fork"), ("D2", "spawn"), ("D3", "forkserver"))],
    ("D1", "form", "<=", 0.5, "records: shared form <= 0.5x the list's Pss"),
    ("D1", "build", "<=", 2.0, "records: build <= 2x pickling each record"),
    *[(w, "time", "<=", 1.2, f"{w} fork: shared epoch time <= 1.2x plain") for w in ("D1", "D4")],
    *[(w, "time", "<", 1.0, f"{w} {m}: shared epoch time < plain")
      for w, m in (("D2", "spawn"), ("D3", "forkserver"), ("D5", "spawn"),
                   ("D6", "forkserver"))],
]


def make_dataset_plan(scale, quick=False):
    """The dataset rows at ``scale``; ``quick``: 1 and 4 workers."""
    plan = []
    workers = [1, 4] if quick else DATASET_WORKERS
    for w in DATASET_WORKLOADS:
        least = 10_000 if w["dataset"] == "records" else 4 * w["batch"]
        w = dict(w, n=scaled(w["n"], scale, minimum=least), workers=workers)
        if w["dataset"] == "array":
            w["bytes"] = w["n"] * DATASET_ROW_BYTES
            w["title"] = w["title"].format(size=_fmt_size(w["bytes"]))
        plan.append(w)
    return plan


def make_start_plan(scale):
    """The program rows with their counts at ``scale`` (F1-F3: 100,000 rows at the least,
    enough to be data, not a message's fixed costs)."""
    plan = []
    for w in START_WORKLOADS:
        w = dict(w, n=scaled(w["n"], scale, minimum=3 if w["kind"] == "import" else 2))
        if w["kind"] == "frame":
            w["rows"] = scaled(FRAME_ROWS, scale, minimum=100_000)
        if w["kind"] == "small":          # (scaled above as the others; at least 200 items)
            w["n"] = max(w["n"], 200)
        plan.append(w)
    return plan


def _fmt_size(n):
    if n >= MiB:
        return f"{n / MiB:.1f} MiB"
    return f"{n / 1024:.0f} KiB"


def scaled(n, scale, minimum=2):
    return max(minimum, int(round(n * scale)))


def make_plan(scale, rounds):
    """The workloads with their counts at ``scale``: one dict per workload (and system tweaks)."""
    shapes = state_dict_shapes()
    plan = []
    for base in WORKLOADS:
        w = dict(base)
        w.setdefault("systems", QUEUE_SYSTEMS)
        if w["kind"] == "state_dict":
            w["shapes"] = [[list(s), d] for s, d in shapes]
            w["bytes"] = _nbytes(shapes)
            w["title"] = w["title"].format(size=_fmt_size(w["bytes"]))
        elif w["kind"] == "dataloader":
            w["bytes"] = w["batch"] * (32 * F32 + 8 + 16)          # one batch: x, y, mask
        else:
            w["bytes"] = _nbytes([(tuple(w["shape"]), "float32")])
        least = 10 if w.get("keep") else W7_WORKERS + 2 if w.get("batch") else 2
        w["n"] = scaled(w["n"], scale, minimum=least)
        # bounded queues keep about 256 MiB in flight at most
        w["maxsize"] = max(4, min(10000, (256 * MiB) // w["bytes"]))
        plan.append(w)
    return plan


def counts(w, system, rounds):
    """[warm-up, timed, timed, ...] message counts of ``w`` for ``system``."""
    n = w["n"]
    if system == "stdlib" and w.get("stdlib_fraction"):
        n = max(2, int(round(n * w["stdlib_fraction"])))
    if w.get("keep"):
        return [n]                     # W6: one round, nothing received before it
    warm = max(1, min(50, n // 10))
    return [warm] + [n] * rounds

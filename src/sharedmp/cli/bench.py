"""``python -m sharedmp bench [--quick] [--json FILE] [--plot FILE]``: side-by-side speed.

One run measures, on this machine and at the same time, these systems:

``sharedmp``
    ``sharedmp.get_context("spawn").Queue()``; arrays made with ``sharedmp.empty``.
``sharedmp fs``
    The same, with the file_system strategy: arrays are named segments, tracked by the
    manager daemon (a reference in flight per message).
``sharedmp torch``
    The same queue with CPU tensors made with ``torch.empty`` (sharedmp moves them into its
    shared memory in place on ``put``; W5's tensor is moved once by ``sharedmp.share_memory_``).
``torch file_descriptor`` / ``torch file_system``
    ``torch.multiprocessing.get_context("spawn").Queue()`` with that sharing strategy set
    in both processes; CPU tensors made with ``torch.empty`` (torch moves them into
    shared memory on ``put``). "n/a" when torch is not installed.
``torch spawn``
    W7 only: torch's DataLoader with ``torch.multiprocessing.get_context("spawn")``.
``stdlib``
    ``multiprocessing.get_context("spawn").Queue()``; plain NumPy arrays, pickled by value.

How it is measured (the same for every system):

- Every system runs in fresh processes: a consumer started with ``subprocess`` (this
  file run as a script, so that it imports only what its system needs: the stdlib and
  torch ones never import sharedmp, whose NumPy reducers would otherwise turn the
  "stdlib" column into shared memory) and a producer it starts with the spawn method.
  Full runs use a fresh pair per (system, workload); ``--quick`` one pair per system.
- Each round, the consumer releases a semaphore; the producer then puts a start marker
  and the round's messages, making (allocating and filling) each array as it goes. The
  time is from the consumer's ``get()`` of the marker to its last ``get()``; it reads one
  element of each array it receives, then drops it (W6 keeps them). A warm-up round is
  not timed; the figure is the best of the timed rounds.
- The producer stays alive until the consumer has received everything (torch's
  file_descriptor strategy serves its fds from the producer's resource sharer).
- Queues are bounded to about 256 MiB in flight, so that the big workloads keep memory
  modest; OMP_NUM_THREADS=1 and ``torch.set_num_threads(1)``, so that every system
  fills its arrays with one thread, as NumPy does.
- Every subprocess has a timeout; on expiry its process group is killed and the table
  says "timeout".

W7 (torch only) is a ``torch.utils.data.DataLoader`` (2 workers, batches of 64 samples, each
a dict of three small tensors, collated by torch's default collate) iterated in the consumer,
no producer: batches/s from the batch by which each worker has delivered one (the second)
to the last, so that the workers' start-up (reported apart: ``iter()`` to that batch; with
spawn the second worker starts ~0.1 s after the first) is left out; a fresh loader per round. Its
baseline "torch fd" is torch's default, what unchanged torch code gets
(``multiprocessing_context=None``: fork on Linux, file_descriptor strategy); "torch spawn"
isolates the start method.

The machine's bounds are measured in the same run: memcpy (``np.copyto`` of 64 MiB),
allocation + fill (a fresh ``np.empty`` of 64 MiB filled, in a loop) and round trips of
a tiny message over ``multiprocessing.Pipe`` between two processes.

This module must stay importable without sharedmp: its top level imports only the
standard library (the workers import NumPy, torch or sharedmp as their system needs). The
table, the ratios, the targets and the plot are in ``bench_report``, imported lazily.
"""
import json
import os
import signal
import subprocess
import sys
import time

MARK = "@@sharedmp-bench@@ "
MiB = 1 << 20
GB = 1e9
F32 = 4

SYSTEMS = [                       # (key, column title)
    ("sharedmp", "sharedmp"),
    ("sharedmp_fs", "sharedmp fs"),
    ("sharedmp_torch", "sharedmp torch"),
    ("torch_fd", "torch fd"),
    ("torch_fs", "torch fs"),
    ("torch_spawn", "torch spawn"),
    ("stdlib", "stdlib"),
]
QUEUE_SYSTEMS = ["sharedmp", "sharedmp_fs", "sharedmp_torch", "torch_fd", "torch_fs", "stdlib"]   # W1-W6
TORCH_STRATEGY = {"torch_fd": "file_descriptor", "torch_fs": "file_system", "torch_spawn": "file_descriptor"}
TORCH_SYSTEMS = {"sharedmp_torch", *TORCH_STRATEGY}      # the systems that send torch tensors
COLORS = {"sharedmp": "#d62728", "sharedmp_fs": "#e377c2", "sharedmp_torch": "#ff9896", "torch_fd": "#1f77b4",
          "torch_fs": "#9ecae1", "torch_spawn": "#17becf", "stdlib": "#7f7f7f"}
LONG_NAMES = {"sharedmp": "sharedmp (file_descriptor)", "sharedmp_fs": "sharedmp file_system",
              "sharedmp_torch": "sharedmp, torch tensors",
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
    dict(id="W7", n=1000, kind="dataloader", batch=64, title="DataLoader batches of 64 dicts of 3 tensors",
         metrics=["batches"], systems=["sharedmp_torch", "torch_fd", "torch_spawn"]),
]
W7_WORKERS = 2
METRIC_UNITS = {"msgs": "msg/s", "gbps": "GB/s", "fds": "fds (lower is better)", "batches": "batch/s"}

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
     for w, m in (("W1", "msgs"), ("W2", "gbps"), ("W3", "gbps"), ("W4", "msgs"), ("W5", "msgs"))] + [
    ("W6", "fds", "sharedmp_torch", "sharedmp", "<=", None, "W6 torch fds <= sharedmp NumPy fds"),
    ("W7", "batches", "sharedmp_torch", "torch_fd", ">=", 5, "W7 >= 5x torch's default DataLoader"),
]


# =================================================================== worker side
#
# Run as ``python bench.py --worker SPEC``: the consumer of one system (or the bounds).
# Its producer is a spawned child that runs ``_producer`` from this same file.

def _emit(obj):
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _raise_nofile():
    """Soft RLIMIT_NOFILE up to the hard limit (torch file_descriptor holds an fd per tensor)."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, ValueError, OSError):
        return None


def _nfds():
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


def _context(system):
    """The spawn context of ``system`` (importing only what it needs)."""
    if system in ("sharedmp", "sharedmp_fs", "sharedmp_torch"):
        if system == "sharedmp_torch":
            import torch
            torch.set_num_threads(1)
        import sharedmp
        if system == "sharedmp_fs":
            sharedmp.set_sharing_strategy("file_system")
        return sharedmp.get_context("spawn")
    if system in TORCH_STRATEGY:
        import torch
        import torch.multiprocessing as tmp
        torch.set_num_threads(1)
        tmp.set_sharing_strategy(TORCH_STRATEGY[system])
        return tmp.get_context("spawn")
    import multiprocessing
    return multiprocessing.get_context("spawn")


def _maker(system, w):
    """A function i -> the i-th message of workload ``w`` for ``system``."""
    import numpy as np
    kind = w["kind"]
    if system in TORCH_SYSTEMS:
        import torch
        dtypes = {"float32": torch.float32, "int64": torch.int64}

        def new(shape, dtype="float32"):
            return torch.empty(shape, dtype=dtypes[dtype])

        def fill(a, v):
            a.fill_(v)
            return a
    else:
        if system in ("sharedmp", "sharedmp_fs"):
            import sharedmp
            empty = sharedmp.empty
        else:
            empty = np.empty

        def new(shape, dtype="float32"):
            return empty(tuple(shape), dtype=dtype)

        def fill(a, v):
            a.fill(v)
            return a

    if kind == "fresh":
        shape = tuple(w["shape"])
        return lambda i: fill(new(shape), i)
    if kind == "state_dict":
        shapes = [(tuple(s), d) for s, d in w["shapes"]]
        names = [f"layer{k}" for k in range(len(shapes))]
        return lambda i: {name: fill(new(s, d), i) for name, (s, d) in zip(names, shapes)}
    if kind == "same":
        a = fill(new(tuple(w["shape"])), 1)
        if system in TORCH_STRATEGY:
            a.share_memory_()        # once; every message then refers to the same storage
        elif system == "sharedmp_torch":
            import sharedmp
            sharedmp.share_memory_(a)
        return lambda i: a
    raise ValueError(f"unknown workload kind {kind!r}")


def _toucher(system):
    """A function that reads one element of each array of a message."""
    if system in TORCH_SYSTEMS:
        def one(a):
            return a.numpy().item(0)
    else:
        def one(a):
            return a.item(0)

    def touch(x):
        if isinstance(x, dict):
            for v in x.values():
                one(v)
        else:
            one(x)
    return touch


def _foreign_modules(system):
    """The modules that must not be loaded in this system's processes but are."""
    banned = {"sharedmp": ["torch"], "sharedmp_fs": ["torch"], "sharedmp_torch": [],
              "stdlib": ["sharedmp", "torch"]}.get(system, ["sharedmp"])
    return [m for m in banned if m in sys.modules]


def _producer(system, plan, queues, go, done, timeout):
    """The producer (a spawned child): for each round, a marker then the round's messages."""
    _raise_nofile()
    _context(system)                  # the torch strategy is per process: set it here too
    for w, q in zip(plan, queues):
        make = _maker(system, w)
        for count in w["counts"]:
            if not go.acquire(timeout=timeout):
                return
            q.put(("start", _foreign_modules(system)))
            for i in range(count):
                q.put(make(i))
        del make
    done.wait(timeout)


def _timed(counts):
    """The indices of the timed rounds: all but the warm-up round."""
    return range(1, len(counts)) if len(counts) > 1 else range(len(counts))


def _consume(w, q, go, touch, system):
    """Receive the rounds of one workload; its figures."""
    from time import perf_counter
    keep = bool(w.get("keep"))
    counts = w["counts"]
    timed = _timed(counts)
    seconds, fds, foreign = [], [], set(_foreign_modules(system))
    for r, count in enumerate(counts):
        kept = []
        fds_before = _nfds()
        go.release()
        marker = q.get()
        t0 = perf_counter()
        for _ in range(count):
            x = q.get()
            touch(x)
            if keep:
                kept.append(x)
        t1 = perf_counter()
        x = None
        if r in timed:
            seconds.append(t1 - t0)
            fds.append(_nfds() - fds_before)
        kept = None
        if not (isinstance(marker, tuple) and marker[0] == "start"):
            raise RuntimeError(f"expected the start marker, got {marker!r}")
        foreign.update(marker[1])
    n = counts[-1]
    best = min(seconds)
    out = {"workload": w["id"], "status": "ok", "n": n, "rounds_s": seconds, "seconds": best,
           "msgs": n / best if best > 0 else None,
           "gbps": n * w["bytes"] / best / GB if best > 0 else None}
    if keep:
        out["fds"] = max(fds)
        out["fd_limit"] = _raise_nofile()
    if foreign:
        out["status"] = "error"
        out["error"] = f"{system} processes imported {sorted(foreign)}: the figures would be wrong"
    return out


class _Features:
    """W7's map-style dataset: sample ``i`` is a dict of three small tensors. (Not derived from
    ``torch.utils.data.Dataset``, which the DataLoader does not need: this module imports no torch.)"""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import torch
        return {"x": torch.randn(32), "y": torch.tensor(i), "mask": torch.ones(16, dtype=torch.bool)}


def _consume_loader(w, system, timeout):
    """W7: iterate a fresh DataLoader per round, in this process; its figures."""
    from time import perf_counter

    import torch.utils.data as tud
    ctx = _context(system)
    if system == "torch_fd":
        ctx = None                     # torch's default: fork on Linux
    touch, size = _toucher(system), w["batch"]
    seconds, startup = [], []
    for r, count in enumerate(w["counts"]):
        loader = tud.DataLoader(_Features(count * size), batch_size=size, num_workers=W7_WORKERS,
                                multiprocessing_context=ctx, timeout=timeout)
        got, t0 = [], perf_counter()
        for batch in loader:
            touch(batch)
            got.append((batch["y"][0].item(), tuple(batch["x"].shape)))
            t2 = perf_counter()              # the last batch (not the end of the loop: the
            if len(got) == W7_WORKERS:       # workers' shutdown); every worker has started
                t1 = t2
        if got != [(i, (size, 32)) for i in range(0, count * size, size)]:
            raise RuntimeError(f"W7: wrong batches: {got[:3]}...")
        del loader, batch
        if r in _timed(w["counts"]):
            seconds.append(t2 - t1)
            startup.append(t1 - t0)
    n, best = w["counts"][-1], min(seconds)
    out = {"workload": w["id"], "status": "ok", "n": n, "rounds_s": seconds, "seconds": best,
           "batches": (n - W7_WORKERS) / best, "startup_s": startup}  # the first batches: start-up
    if _foreign_modules(system):
        out["status"] = "error"
        out["error"] = f"{system} processes imported {_foreign_modules(system)}: the figures would be wrong"
    return out


def _consumer_main(spec):
    system, timeout = spec["system"], spec["timeout"]
    plan = [w for w in spec["plan"] if w["kind"] != "dataloader"]
    loaders = [w for w in spec["plan"] if w["kind"] == "dataloader"]
    if plan:
        ctx = _context(system)
        touch = _toucher(system)
        queues = [ctx.Queue(w["maxsize"]) for w in plan]
        go, done = ctx.Semaphore(0), ctx.Event()
        p = ctx.Process(target=_producer, args=(system, plan, queues, go, done, timeout), daemon=True)
        p.start()
        try:
            for w, q in zip(plan, queues):
                _emit_or_raise(w, _consume, w, q, go, touch, system)
        finally:
            done.set()
            _reap(p, 30)
    for w in loaders:
        _emit_or_raise(w, _consume_loader, w, system, timeout)
    return 0


def _emit_or_raise(w, fn, *args):
    try:
        _emit(fn(*args))
    except Exception as e:     # report it and stop: a producer is out of step now
        _emit({"workload": w["id"], "status": "error", "error": f"{type(e).__name__}: {e}"})
        raise


def _reap(p, timeout):
    """Wait for ``p`` to exit, by polling: not ``join()``, whose sentinel pipe can stay open
    after the exit (torch's file_system strategy starts torch_shm_manager from the
    producer, and that daemon inherits it); kill it after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while p.is_alive() and time.monotonic() < deadline:
        time.sleep(0.005)
    if p.is_alive():
        p.kill()
        p.join(5)


def _echo(conn):
    while True:
        m = conn.recv_bytes()
        if not m:
            return
        conn.send_bytes(m)


def _bounds_main(spec):
    """memcpy, allocation + fill, and Pipe round trips: this machine's bounds, best of rounds."""
    import multiprocessing

    import numpy as np
    from time import perf_counter
    rounds, loops, trips = spec["rounds"], spec["loops"], spec["trips"]
    n = 16 * MiB                                     # 64 MiB of float32
    nbytes = n * F32
    src = np.ones(n, np.float32)
    dst = np.zeros(n, np.float32)
    np.copyto(dst, src)
    best = []
    for _ in range(rounds + 1):
        t0 = perf_counter()
        for _ in range(loops):
            np.copyto(dst, src)
        best.append(loops * nbytes / (perf_counter() - t0) / GB)
    memcpy = max(best[1:])
    del src, dst
    best = []
    for _ in range(rounds + 1):
        t0 = perf_counter()
        for i in range(loops):
            a = np.empty(n, np.float32)
            a.fill(i)
            del a
        best.append(loops * nbytes / (perf_counter() - t0) / GB)
    alloc_fill = max(best[1:])
    # The same without transparent huge pages (NumPy asks for them on big arrays; where
    # the kernel grants them, a 64 MiB array costs 32 page faults instead of 16,384).
    alloc_fill_4k = None
    try:
        try:
            from numpy._core.multiarray import _get_madvise_hugepage, _set_madvise_hugepage
        except ImportError:
            from numpy.core.multiarray import _get_madvise_hugepage, _set_madvise_hugepage
    except ImportError:
        pass
    else:
        was = _get_madvise_hugepage()
        _set_madvise_hugepage(False)
        try:
            best = []
            for _ in range(rounds + 1):
                t0 = perf_counter()
                for i in range(loops):
                    a = np.empty(n, np.float32)
                    a.fill(i)
                    del a
                best.append(loops * nbytes / (perf_counter() - t0) / GB)
            alloc_fill_4k = max(best[1:])
        finally:
            _set_madvise_hugepage(was)
    shm_fill = None
    if hasattr(os, "memfd_create"):
        # The same for fresh shared memory: a memfd of 64 MiB, mapped and filled, then let
        # go. NumPy's big arrays get transparent huge pages (it asks for them); shared
        # memory gets them only where /sys/kernel/mm/transparent_hugepage/shmem_enabled allows.
        import mmap
        best = []
        for _ in range(rounds + 1):
            t0 = perf_counter()
            for i in range(loops):
                fd = os.memfd_create("sharedmp-bench", os.MFD_CLOEXEC)
                try:
                    os.ftruncate(fd, nbytes)
                    mm = mmap.mmap(fd, nbytes)
                finally:
                    os.close(fd)
                a = np.frombuffer(mm, np.float32)
                a.fill(i)
                del a
                mm.close()
            best.append(loops * nbytes / (perf_counter() - t0) / GB)
        shm_fill = max(best[1:])
    ctx = multiprocessing.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=_echo, args=(b,), daemon=True)
    p.start()
    best = []
    try:
        for _ in range(rounds + 1):
            t0 = perf_counter()
            for _ in range(trips):
                a.send_bytes(b"x")
                a.recv_bytes()
            best.append(trips / (perf_counter() - t0))
        a.send_bytes(b"")
    finally:
        _reap(p, 10)
    _emit({"workload": "bounds", "status": "ok", "memcpy_gbps": memcpy, "alloc_fill_gbps": alloc_fill,
           "alloc_fill_4k_gbps": alloc_fill_4k, "shm_alloc_fill_gbps": shm_fill,
           "pipe_roundtrips_per_s": max(best[1:]), "loops": loops, "trips": trips,
           "foreign_modules": _foreign_modules("stdlib")})
    return 0


def _worker_main(argv):
    here = os.path.dirname(os.path.abspath(__file__))
    # Run as a script, Python put this package's directory first on sys.path: drop it,
    # so that its modules cannot shadow others (spawned children inherit sys.path).
    if sys.path and sys.path[0] and os.path.abspath(sys.path[0]) == here:
        del sys.path[0]
    spec = json.loads(argv[1])
    _raise_nofile()
    if spec["system"] == "bounds":
        return _bounds_main(spec)
    return _consumer_main(spec)


# =================================================================== parent side

def _fmt_size(n):
    if n >= MiB:
        return f"{n / MiB:.1f} MiB"
    return f"{n / 1024:.0f} KiB"


def _scaled(n, scale, minimum=2):
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
        w["n"] = _scaled(w["n"], scale, minimum=10 if w.get("keep") else W7_WORKERS + 2 if w.get("batch") else 2)
        # bounded queues keep about 256 MiB in flight at most
        w["maxsize"] = max(4, min(10000, (256 * MiB) // w["bytes"]))
        plan.append(w)
    return plan


def _counts(w, system, rounds):
    """[warm-up, timed, timed, ...] message counts of ``w`` for ``system``."""
    n = w["n"]
    if system == "stdlib" and w.get("stdlib_fraction"):
        n = max(2, int(round(n * w["stdlib_fraction"])))
    if w.get("keep"):
        return [n]                     # W6: one round, nothing received before it
    warm = max(1, min(50, n // 10))
    return [warm] + [n] * rounds


def _worker_env():
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["MKL_NUM_THREADS"] = "1"
    env["SHAREDMP_SHARING_STRATEGY"] = "file_descriptor"   # the sharedmp column's strategy
    env.pop("SHAREDMP_KEEP_ORPHANS", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid):
    """Whether a live (not zombie) process of process group ``pgid`` remains."""
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return False
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in "ZX":
            return True
    return False


def _wait_group(pgid, timeout):
    """Let what the worker left running finish by itself (multiprocessing's resource
    tracker unlinks the semaphores of a worker that has exited), for up to ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.02)


def run_worker(spec, timeout):
    """Run one worker; (list of its result dicts, status, stderr tail, seconds)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_worker_env(), start_new_session=True)
    status = "ok"
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        status = "timeout"
        _kill_group(proc)
        out, err = proc.communicate()
    else:
        _wait_group(proc.pid, 10)
        _kill_group(proc)              # whatever it started and left behind
        if proc.returncode != 0:
            status = "error"
    results = []
    for line in out.splitlines():
        if line.startswith(MARK):
            try:
                results.append(json.loads(line[len(MARK):]))
            except ValueError:
                pass
    tail = "\n".join(err.strip().splitlines()[-15:])
    return results, status, tail, time.monotonic() - t0


def _shm_entries():
    """The paths in /dev/shm and in sharedmp's shared-memory directory ($SHAREDMP_SHM_DIR)."""
    from ..memory.segment import shm_dir
    out = set()
    for d in {"/dev/shm", shm_dir()}:
        try:
            out.update(os.path.join(d, n) for n in os.listdir(d))
        except OSError:
            pass
    return out


def _in_use(paths):
    """The paths of ``paths`` that some process maps or holds open."""
    paths, used = set(paths), set()
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    for p in paths:
                        if p in line:
                            used.add(p)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}").removesuffix(" (deleted)")
                except OSError:
                    continue
                if target in paths:
                    used.add(target)
        except OSError:
            continue
    return used


def _clean_shm(new_paths):
    """Remove what the killed workers left in /dev/shm (ours: torch_* and sharedmp_*, unused)."""
    paths = {p for p in new_paths if os.path.basename(p).startswith(("torch_", "sharedmp_"))}
    removed = []
    for p in sorted(paths - _in_use(paths)):
        try:
            os.unlink(p)
            removed.append(p)
        except OSError:
            pass
    return removed


def _torch_available():
    import importlib.util
    return importlib.util.find_spec("torch") is not None


def machine_info():
    import platform
    info = {"platform": platform.platform(), "machine": platform.machine(),
            "python": platform.python_version(), "executable": sys.executable,
            "cpus": os.cpu_count()}
    try:
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    info["memory_gib"] = round(int(line.split()[1]) / (1 << 20), 1)
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            info["transparent_hugepages"] = f.read().strip()
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            info["shmem_hugepages"] = f.read().strip()
    except OSError:
        pass
    try:
        info["loadavg_start"] = os.getloadavg()
    except OSError:
        pass
    return info


def versions():
    from . import dist_version
    from .. import __version__
    return {"sharedmp": __version__, "numpy": dist_version("numpy"), "torch": dist_version("torch"),
            "matplotlib": dist_version("matplotlib"), "python": sys.version.split()[0]}


# ---------------------------------------------------------------------------- run

def _log(msg):
    print(msg, file=sys.stderr, flush=True)


def bench(scale, rounds, quick, timeout=None, systems=None, workloads=None, isolation=None):
    """Run everything; the report (a JSON-able dict)."""
    from .bench_report import _fmt_num, check_targets, compute_ratios

    t_start = time.monotonic()
    shm_before = _shm_entries()
    plan = make_plan(scale, rounds)
    if workloads:
        plan = [w for w in plan if w["id"] in workloads]
    have_torch = _torch_available()
    chosen = [s for s, _ in SYSTEMS if systems is None or s in systems]
    runnable = [s for s in chosen if have_torch or s not in TORCH_SYSTEMS]
    if isolation is None:
        isolation = "system" if quick or scale < 1 else "workload"
    report = {"command": [sys.executable, "-m", "sharedmp"] + sys.argv[1:] if sys.argv else [],
              "argv": sys.argv, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "quick": quick, "scale": scale, "rounds": rounds, "isolation": isolation,
              "machine": machine_info(), "versions": versions(),
              "systems": {s: LONG_NAMES[s] for s, _ in SYSTEMS},
              "workloads": [{k: v for k, v in w.items() if k != "shapes"} for w in plan],
              "results": {w["id"]: {s: None for s, _ in SYSTEMS} for w in plan},
              "workers": [], "problems": []}
    if any(w["kind"] == "state_dict" for w in plan):
        report["state_dict_shapes"] = [[list(s), d] for s, d in state_dict_shapes()]
    per_msg_timeout = timeout

    def worker_timeout(ws):
        if per_msg_timeout is not None:
            return per_msg_timeout
        return max(60.0, 150.0 * scale * rounds * len(ws) / 3 + 30.0 * len(ws))

    # the bounds
    loops = _scaled(WORKLOADS[2]["n"], scale, minimum=4)
    spec = {"system": "bounds", "rounds": rounds, "loops": loops, "trips": _scaled(20000, scale, 500)}
    _log("bounds ...")
    res, status, tail, secs = run_worker(spec, worker_timeout([1]))
    report["workers"].append({"system": "bounds", "status": status, "seconds": secs})
    report["bounds"] = res[0] if res else {"status": status, "error": tail}
    if res and res[0].get("foreign_modules"):
        report["problems"].append(f"the bounds worker imported {res[0]['foreign_modules']}")
    if not res:
        report["problems"].append(f"bounds: {status}: {tail}")

    # the systems
    if isolation == "workload":
        batches = [(s, [w]) for w in plan for s in runnable if s in w["systems"]]
    else:
        # W6 first: it counts the fds a consumer gains, from processes that hold none yet
        ordered = sorted(plan, key=lambda w: not w.get("keep"))
        batches = [(s, [w for w in ordered if s in w["systems"]]) for s in runnable]
        batches = [(s, ws) for s, ws in batches if ws]
    timed_out = False
    for system, ws in batches:
        sp = []
        for w in ws:
            ww = {k: v for k, v in w.items()}
            ww["counts"] = _counts(w, system, rounds)
            sp.append(ww)
        spec = {"system": system, "plan": sp, "timeout": worker_timeout(ws)}
        _log(f"{system:<14} {' '.join(w['id'] for w in ws)} ...")
        results, status, tail, secs = run_worker(spec, worker_timeout(ws))
        report["workers"].append({"system": system, "workloads": [w["id"] for w in ws],
                                  "status": status, "seconds": secs})
        got = {r["workload"]: r for r in results}
        for w in ws:
            r = got.get(w["id"])
            if r is None:
                r = {"status": "timeout" if status == "timeout" else "error"}
                if status != "timeout":
                    r["error"] = tail
            report["results"][w["id"]][system] = r
            if r.get("status") == "ok":
                shown = ", ".join(f"{_fmt_num(r.get(m))} {METRIC_UNITS[m]}" for m in w["metrics"])
                _log(f"    {w['id']} {system}: {shown}")
            else:
                _log(f"    {w['id']} {system}: {r['status']} {r.get('error', '')}")
                report["problems"].append(f"{w['id']} {system}: {r['status']} {r.get('error', '')}".strip())
        if status == "timeout":
            timed_out = True
        elif status == "error" and tail and not any(r.get("status") != "ok" for r in results):
            report["problems"].append(f"{system}: exited with an error: {tail}")

    report["ratios"] = compute_ratios(report)
    report["targets"] = check_targets(report)
    # What is left in /dev/shm: releases may trail the processes a moment (torch_shm_manager).
    deadline = time.monotonic() + 5
    while (new := _shm_entries() - shm_before) and time.monotonic() < deadline:
        time.sleep(0.1)
    report["shm_removed"] = _clean_shm(new) if timed_out and new else []
    # Left behind: new files that no live process maps or holds open (others' files, e.g.
    # of a test suite running meanwhile, are in use and not this run's to report).
    new = _shm_entries() - shm_before
    report["shm_left"] = sorted(new - _in_use(new))
    try:
        report["machine"]["loadavg_end"] = os.getloadavg()
    except OSError:
        pass
    report["wall_s"] = time.monotonic() - t_start
    return report


def add_parser(subparsers):
    import argparse

    from . import COMMANDS
    p = subparsers.add_parser(
        "bench", help=COMMANDS["bench"], description=COMMANDS["bench"] + ". " +
        "Each system runs in fresh processes (spawn); the table shows messages/s, GB/s or fds, "
        "and sharedmp's ratio to torch (file_descriptor) and to the standard library.")
    p.add_argument("--quick", action="store_true",
                   help="a fifth of the counts, two timed rounds, one process pair per system (under a minute)")
    p.add_argument("--json", metavar="FILE", help="write every figure, the machine and the versions to FILE")
    p.add_argument("--plot", metavar="FILE", help="draw a bar chart to FILE (needs matplotlib)")
    p.add_argument("--scale", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--systems", metavar="S1,S2", default=None,
                   help="run only these systems, comma-separated (e.g. sharedmp,torch_fd)")
    p.add_argument("--workloads", metavar="W1,W2", default=None,
                   help="run only these workloads, comma-separated (e.g. W2,W3)")
    p.add_argument("--isolation", choices=["workload", "system"], default=None, help=argparse.SUPPRESS)
    return p


def run(args):
    from . import bench_cuda
    from .bench_report import format_footer, format_header, format_table, plot

    if args.plot:                      # fail before minutes of measuring, not after
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("error: --plot needs matplotlib: pip install 'sharedmp[bench]'", file=sys.stderr)
            return 2
    scale = args.scale if args.scale is not None else (0.2 if args.quick else 1.0)
    if not scale > 0:
        print("error: --scale must be > 0", file=sys.stderr)
        return 2
    rounds = args.rounds if args.rounds is not None else (2 if args.quick else 1 if scale < 1 else 5)
    systems = set(args.systems.split(",")) if args.systems else None
    workloads = set(args.workloads.split(",")) if args.workloads else None
    for flag, given, known in (("--systems", systems, [s for s, _ in SYSTEMS]),
                               ("--workloads", workloads, [w["id"] for w in WORKLOADS] + [c[0] for c in bench_cuda.WORKLOADS])):
        unknown = sorted(given - set(known)) if given else []
        if unknown:
            print(f"error: {flag}: unknown {', '.join(unknown)}; choose from {','.join(known)}",
                  file=sys.stderr)
            return 2
    report = bench(scale, max(1, rounds), args.quick, timeout=args.timeout, systems=systems,
                   workloads=workloads, isolation=args.isolation)
    print(format_header(report))
    print()
    print(format_table(report))
    # ---- CUDA rows (cli/bench_cuda.py): sharedmp vs torch on a GPU; skipped without one ----
    if workloads is None or any(w.startswith("C") for w in workloads):
        report["cuda"] = bench_cuda.run(args.quick)
        print()
        print(bench_cuda.format_rows(report["cuda"]))
    if args.plot:
        plot(report, args.plot)
        report["plot"] = os.path.abspath(args.plot)
    print(format_footer(report), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    return 1 if report["problems"] or report["shm_left"] else 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))

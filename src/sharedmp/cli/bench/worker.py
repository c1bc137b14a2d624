"""The worker side of ``python -m sharedmp bench``: the consumer of one system, or the bounds.

Run as a script, ``python worker.py --worker SPEC`` (``driver.run_worker`` starts it in a
fresh process), so that it imports only what its system needs: its top level imports only
the standard library, and the stdlib and torch systems never import sharedmp, whose NumPy
reducers would otherwise turn the "stdlib" column into shared memory. ``_foreign_modules``
checks it in every process. The consumer's producer is a spawned child that runs
``_producer`` from this same file (spawn runs it again as ``__mp_main__``).

The other modules of the bench import its constants; it imports none of them.
"""
import json
import os
import sys
import time

MARK = "@@sharedmp-bench@@ "      # the prefix of a result line on the worker's stdout
MiB = 1 << 20
GB = 1e9
F32 = 4
TORCH_STRATEGY = {"torch_fd": "file_descriptor", "torch_fs": "file_system",
                  "torch_spawn": "file_descriptor"}
# the systems that send torch tensors
TORCH_SYSTEMS = {"sharedmp_torch", "sharedmp_torch_fs", *TORCH_STRATEGY}
W7_WORKERS = 2
BOUNDS_ELEMENTS = 16 * MiB                                # the bounds' 64 MiB of float32

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
    if system in ("sharedmp", "sharedmp_fs", "sharedmp_torch", "sharedmp_torch_fs"):
        if system in TORCH_SYSTEMS:
            import torch
            torch.set_num_threads(1)
        import sharedmp
        if system.endswith("_fs"):
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
        if system in ("sharedmp", "sharedmp_fs") and w["kind"] != "plain":
            import sharedmp
            empty = sharedmp.empty
        else:
            empty = np.empty

        def new(shape, dtype="float32"):
            return empty(tuple(shape), dtype=dtype)

        def fill(a, v):
            a.fill(v)
            return a

    if kind in ("fresh", "plain"):       # (plain: NumPy's or torch's own memory, for all)
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
              "sharedmp_torch_fs": [],
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
    """W7's map-style dataset: sample ``i`` is a dict of three small tensors. (Not derived
    from ``torch.utils.data.Dataset``, which the DataLoader does not need: this module
    imports no torch.)"""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import torch
        return {"x": torch.randn(32), "y": torch.tensor(i),
                "mask": torch.ones(16, dtype=torch.bool)}


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
        out["error"] = (f"{system} processes imported {_foreign_modules(system)}: "
                        "the figures would be wrong")
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
        p = ctx.Process(target=_producer, args=(system, plan, queues, go, done, timeout),
                        daemon=True)
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


def _best_gbps(rounds, loops, nbytes, step):
    """GB/s of ``loops`` calls ``step(i)`` that each move ``nbytes``: the best of ``rounds``
    timed rounds after an untimed one."""
    from time import perf_counter
    best = []
    for _ in range(rounds + 1):
        t0 = perf_counter()
        for i in range(loops):
            step(i)
        best.append(loops * nbytes / (perf_counter() - t0) / GB)
    return max(best[1:])


def _fill_fresh(i):
    """Allocate a fresh array of the bounds' size, fill it, let it go."""
    import numpy as np
    a = np.empty(BOUNDS_ELEMENTS, np.float32)
    a.fill(i)


def _memcpy_gbps(rounds, loops):
    import numpy as np
    src = np.ones(BOUNDS_ELEMENTS, np.float32)
    dst = np.zeros(BOUNDS_ELEMENTS, np.float32)
    np.copyto(dst, src)
    return _best_gbps(rounds, loops, BOUNDS_ELEMENTS * F32, lambda i: np.copyto(dst, src))


def _alloc_fill_4k_gbps(rounds, loops):
    """Allocation + fill without transparent huge pages (NumPy asks for them on big arrays;
    where the kernel grants them, a 64 MiB array costs 32 page faults instead of 16,384);
    None where NumPy cannot be told not to ask."""
    try:
        try:
            from numpy._core.multiarray import _get_madvise_hugepage, _set_madvise_hugepage
        except ImportError:
            from numpy.core.multiarray import _get_madvise_hugepage, _set_madvise_hugepage
    except ImportError:
        return None
    was = _get_madvise_hugepage()
    _set_madvise_hugepage(False)
    try:
        return _best_gbps(rounds, loops, BOUNDS_ELEMENTS * F32, _fill_fresh)
    finally:
        _set_madvise_hugepage(was)


def _fill_fresh_memfd(i):
    """A fresh memfd of the bounds' size, mapped and filled, then let go."""
    import mmap

    import numpy as np
    nbytes = BOUNDS_ELEMENTS * F32
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


def _shm_fill_gbps(rounds, loops):
    """Allocation + fill of fresh shared memory. NumPy's big arrays get transparent huge pages
    (it asks for them); shared memory gets them only where
    /sys/kernel/mm/transparent_hugepage/shmem_enabled allows. None without memfd."""
    if not hasattr(os, "memfd_create"):
        return None
    return _best_gbps(rounds, loops, BOUNDS_ELEMENTS * F32, _fill_fresh_memfd)


def _pipe_roundtrips(rounds, trips):
    """Round trips per second of a tiny message over a spawn Pipe, best of ``rounds``."""
    import multiprocessing
    from time import perf_counter
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
    return max(best[1:])


def _bounds_main(spec):
    """memcpy, allocation + fill, and Pipe round trips: this machine's bounds, best of rounds."""
    rounds, loops, trips = spec["rounds"], spec["loops"], spec["trips"]
    _emit({"workload": "bounds", "status": "ok", "memcpy_gbps": _memcpy_gbps(rounds, loops),
           "alloc_fill_gbps": _best_gbps(rounds, loops, BOUNDS_ELEMENTS * F32, _fill_fresh),
           "alloc_fill_4k_gbps": _alloc_fill_4k_gbps(rounds, loops),
           "shm_alloc_fill_gbps": _shm_fill_gbps(rounds, loops),
           "pipe_roundtrips_per_s": _pipe_roundtrips(rounds, trips), "loops": loops,
           "trips": trips, "foreign_modules": _foreign_modules("stdlib")})
    return 0

def main(argv):
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

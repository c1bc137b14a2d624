"""joblib's default backend (loky) against the "sharedmp" backend, on the same jobs, in one run.

    .venv/bin/python scripts/bench_joblib.py [--quick] [--n-jobs N] [--repeat R]
                                             [--start-method M] [--json FILE]

Each job is one ``Parallel(n_jobs=N)`` call, run under ``parallel_config(backend=...)``
with each backend in turn, ``R`` times alternating (the median is reported), its results
checked equal between the two. Seconds per call (lower is better) and loky/sharedmp:

J1   40 tasks, each summing a 64 MiB array already in shared memory (``mp.share``)
J1p  the same with a plain NumPy array (loky dumps it once to a file and memmaps it;
     sharedmp copies it once per call into shared memory)
J2   40 tasks, each returning a fresh 8 MiB array; the parent reads one element of each
J3   5,000 tiny tasks (``abs``): the per-task overhead, with joblib's auto-batching
J4   20 tasks, each summing a 64 MiB torch tensor (if torch is installed)
J5   scikit-learn: ``cross_val_score`` of a 50-tree random forest on digits, 4 folds

What each backend pays, as it would in a program: both keep their workers between calls
(loky's reusable executor, sharedmp's warm pool; they are started and warmed up, NumPy,
torch and scikit-learn imported, before timing); sharedmp with joblib's start method for
it (fork on Linux before Python 3.14) unless ``--start-method``.
One BLAS/OpenMP/torch thread per process for both (loky gives its workers
cpu_count // n_jobs threads, 1 on a 2-core machine), set before NumPy is imported.
"""
import argparse
import json
import os
import statistics
import sys
import time

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

import numpy as np  # noqa: E402

import joblib  # noqa: E402

import sharedmp as mp  # noqa: E402
import sharedmp.joblib  # noqa: E402  (registers "sharedmp")

MiB = 1 << 20


# ------------------------------------------------------------------------- what tasks run

def total(a):
    return float(a.sum())


def block(i, n):
    return np.full(n, i, dtype=np.float32)


def tensor_total(t):
    return float(t.sum())


def warm(_):
    """Imports what the timed tasks will need, in the worker (loky's stay alive)."""
    import sklearn.ensemble  # noqa: F401
    try:
        import torch
        torch.set_num_threads(1)
    except ImportError:
        pass
    return os.getpid()


# ---------------------------------------------------------------------------------- jobs

def jobs(quick):
    k = 4 if quick else 1                         # --quick: fewer tasks
    n64 = 64 * MiB // 8
    shared = mp.share(np.random.default_rng(0).random(n64))
    plain = np.random.default_rng(1).random(n64)

    def j1():
        return joblib.Parallel()(joblib.delayed(total)(shared) for _ in range(40 // k))

    def j1p():
        return joblib.Parallel()(joblib.delayed(total)(plain) for _ in range(40 // k))

    def j2():
        out = joblib.Parallel()(joblib.delayed(block)(i, 2 * MiB) for i in range(40 // k))
        return [float(b[-1]) for b in out]

    def j3():
        return joblib.Parallel()(joblib.delayed(abs)(-i) for i in range(5000 // k))

    found = [("J1", f"{40 // k} tasks x 64 MiB shared array, sum", j1),
             ("J1p", f"{40 // k} tasks x 64 MiB plain NumPy array, sum", j1p),
             ("J2", f"{40 // k} tasks returning 8 MiB each", j2),
             ("J3", f"{5000 // k:,} tiny tasks", j3)]
    try:
        import torch
        torch.set_num_threads(1)
        tensor = torch.rand(n64, generator=torch.Generator().manual_seed(2),
                            dtype=torch.float64)   # 64 MiB, not shared yet

        def j4():
            return joblib.Parallel()(joblib.delayed(tensor_total)(tensor) for _ in range(20 // k))
        found.append(("J4", f"{20 // k} tasks x 64 MiB torch tensor, sum", j4))
    except ImportError:
        pass
    try:
        from sklearn.datasets import load_digits
        from sklearn.ensemble import RandomForestClassifier
        from sklearn.model_selection import cross_val_score
        X, y = load_digits(return_X_y=True)

        def j5():
            forest = RandomForestClassifier(n_estimators=50 // k, random_state=0)
            return cross_val_score(forest, X, y, cv=4).tolist()
        found.append(("J5", f"sklearn cross_val_score, {50 // k}-tree forest, digits, 4 folds",
                      j5))
    except ImportError:
        pass
    return found


def timed(backend, n_jobs, options, job):
    with joblib.parallel_config(backend=backend, n_jobs=n_jobs, **options):
        t = time.perf_counter()
        result = job()
        return time.perf_counter() - t, result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a quarter of the tasks, 1 round")
    parser.add_argument("--n-jobs", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--start-method", choices=["fork", "spawn", "forkserver"], default=None,
                        help="sharedmp's (default: joblib's for its multiprocessing backend)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    repeat = 1 if args.quick else args.repeat
    smp = {"start_method": args.start_method} if args.start_method else {}
    backends = [("loky", {}), ("sharedmp", smp)]

    for backend, options in backends:             # loky's workers up, imports done
        timed(backend, args.n_jobs, options,
              lambda: joblib.Parallel()(joblib.delayed(warm)(i) for i in range(4 * args.n_jobs)))
    rows = []
    for key, title, job in jobs(args.quick):
        times = {b: [] for b, _ in backends}
        results = {}
        for _ in range(repeat):
            for backend, options in backends:
                seconds, results[backend] = timed(backend, args.n_jobs, options, job)
                times[backend].append(seconds)
        if results["loky"] != results["sharedmp"]:
            raise SystemExit(f"{key}: the backends disagree: {results['loky']!r} != "
                             f"{results['sharedmp']!r}")
        med = {b: statistics.median(t) for b, t in times.items()}
        rows.append({"job": key, "what": title, "loky_s": med["loky"],
                     "sharedmp_s": med["sharedmp"], "ratio": med["loky"] / med["sharedmp"],
                     "runs": {b: t for b, t in times.items()}})
        print(f"  {key}: loky {med['loky']:.3f} s, sharedmp {med['sharedmp']:.3f} s", flush=True)

    from joblib.externals.loky import get_reusable_executor
    get_reusable_executor().shutdown(wait=True)
    sharedmp.joblib.release_pool()

    method = args.start_method or joblib.parallel.DEFAULT_MP_CONTEXT or mp.get_start_method()
    method = method if isinstance(method, str) else method.get_start_method()
    print(f"\nn_jobs={args.n_jobs}, {os.cpu_count()} CPUs, joblib {joblib.__version__}, "
          f"sharedmp start method {method}, median of {repeat} (seconds per call, lower is better)\n")
    print("| job | loky (default) | sharedmp | loky / sharedmp |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['job']} {r['what']} | {r['loky_s']:.3f} | {r['sharedmp_s']:.3f} | "
              f"{r['ratio']:.1f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"n_jobs": args.n_jobs, "start_method": method, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

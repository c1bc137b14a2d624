"""The process-start rows of ``python -m sharedmp bench`` (S1-S6): what starting processes
costs with sharedmp, against the standard library (and joblib's loky), in the same run.

S1     ``import sharedmp`` against ``import multiprocessing``: milliseconds of the import
       statement in a fresh ``python -c`` (interpreter start excluded), the median of
       several runs after an untimed one each, and how many modules it adds.
S2-S4  rounds of ``ctx.Pool(2)``, ``pool.map(abs, range(-10, 0))``, ``pool.terminate()``
       under spawn, fork and forkserver, ``ctx`` sharedmp's context or multiprocessing's.
S5     ``joblib.Parallel(n_jobs=2)`` calls of 10 ``delayed(abs)`` tasks: backend "sharedmp"
       (its pool kept warm between calls; joblib's start method) against loky, joblib's
       default (its reusable executor).
S6     ``Parallel(n_jobs=2)`` calls that each pass a fresh 64 MiB torch tensor to 2 tasks
       returning its sum: "sharedmp" (the tensor moves into shared memory once) against
       loky (which pickles it by value into each task).

Each figure of S2-S6 is one run of a small script, a fresh interpreter that imports its
library at its top as a user's script does (forkserver preloads ``__main__``, and each run
gets a forkserver of its own), timed inside from its first round to its last; the best of
the runs. The scripts are written to a temporary directory (``scripts``) and run by the
driver; they print one result line each (``worker.MARK``).
"""
import os
import statistics

from .worker import MARK

TENSOR_ELEMENTS = 16 << 20        # S6: 64 MiB of float32

# S1: one line, "seconds modules heavy..." (json would add modules of its own to the count)
IMPORT_CODE = """\
import sys, time
before = len(sys.modules)
t0 = time.perf_counter()
import {module}
seconds = time.perf_counter() - t0
print(seconds, len(sys.modules) - before, *sorted({{"numpy", "torch"}} & set(sys.modules)))
"""

POOL_SCRIPT = """\
import {module} as lib      # at the top, as in a user's script: forkserver preloads __main__
import json
import sys
import time


def main(method, rounds):
    ctx = lib.get_context(method)
    t0 = time.perf_counter()
    for _ in range(rounds):
        pool = ctx.Pool(2)
        if pool.map(abs, range(-10, 0)) != list(range(10, 0, -1)):
            raise SystemExit("Pool.map returned wrong results")
        pool.terminate()
    seconds = time.perf_counter() - t0
    print({mark!r} + json.dumps({{"seconds": seconds, "n": rounds}}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
"""

JOBLIB_SCRIPT = """\
import json
import sys
import time

import joblib
{backend_import}


def total(t):
    return float(t.sum())


def tiny(calls, backend):
    for _ in range(calls):
        out = joblib.Parallel(n_jobs=2, backend=backend)(
            joblib.delayed(abs)(-i) for i in range(10))
        if out != list(range(10)):
            raise SystemExit("Parallel returned wrong results")


def tensors(calls, backend):
    import torch
    for _ in range(calls):
        t = torch.ones({elements})           # fresh each call: not in shared memory yet
        out = joblib.Parallel(n_jobs=2, backend=backend)(
            joblib.delayed(total)(t) for _ in range(2))
        if out != [float({elements})] * 2:
            raise SystemExit("Parallel returned wrong sums")


def main(kind, backend, calls):
    if kind == "tensors":
        import torch
        torch.set_num_threads(1)
    t0 = time.perf_counter()
    (tiny if kind == "tiny" else tensors)(calls, backend)
    seconds = time.perf_counter() - t0
    print({mark!r} + json.dumps({{"seconds": seconds, "n": calls}}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
"""


def scripts(directory):
    """Write the scripts into ``directory``; {name: path}."""
    texts = {f"pool_{m}.py": POOL_SCRIPT.format(module=m, mark=MARK)
             for m in ("sharedmp", "multiprocessing")}
    # The loky script never imports sharedmp: loky runs as it does without it.
    for backend, line in (("sharedmp", "import sharedmp.joblib  # registers the backend"),
                          ("loky", "")):
        texts[f"joblib_{backend}.py"] = JOBLIB_SCRIPT.format(
            backend_import=line, elements=TENSOR_ELEMENTS, mark=MARK)
    paths = {}
    for name, text in texts.items():
        paths[name] = os.path.join(directory, name)
        with open(paths[name], "w") as f:
            f.write(text)
    return paths


def commands(w, system, paths, python):
    """The command line of one run of workload ``w`` for ``system``."""
    if w["kind"] == "import":
        module = "sharedmp" if system == "sharedmp" else "multiprocessing"
        return [python, "-c", IMPORT_CODE.format(module=module)]
    if w["kind"] == "pool":
        module = "sharedmp" if system == "sharedmp" else "multiprocessing"
        return [python, paths[f"pool_{module}.py"], w["method"], str(w["n"])]
    return [python, paths[f"joblib_{system}.py"], w["calls"], system, str(w["n"])]


def parse(w, out):
    """The figures of one run from its stdout; None if it printed none."""
    if w["kind"] == "import":
        lines = [line.split() for line in out.splitlines() if line.strip()]
        if not lines:
            return None
        seconds, modules, *heavy = lines[-1]
        return {"ms": float(seconds) * 1e3, "modules": int(modules), "heavy": heavy}
    import json
    found = [json.loads(line[len(MARK):]) for line in out.splitlines() if line.startswith(MARK)]
    return found[-1] if found else None


def summary(w, runs):
    """One system's result from its runs' figures: S1 the median, the others the best."""
    if w["kind"] == "import":
        ms = statistics.median(r["ms"] for r in runs)
        return {"status": "ok", "ms": ms, "modules": runs[-1]["modules"],
                "heavy": runs[-1]["heavy"], "runs_ms": [r["ms"] for r in runs], "n": len(runs)}
    seconds = min(r["seconds"] for r in runs)
    return {"status": "ok", "seconds": seconds, "n": w["n"],
            "runs_s": [r["seconds"] for r in runs]}


def missing(w):
    """Why workload ``w`` cannot run here (a module it needs is not installed), or None."""
    import importlib.util
    needs = {"joblib": ["joblib"], "tensors": ["joblib", "torch"]}.get(w.get("calls"), [])
    absent = [m for m in needs if importlib.util.find_spec(m) is None]
    return f"needs {', '.join(absent)}" if absent else None

"""The program rows of ``python -m sharedmp bench``, each figure from fresh programs, against
the standard library (or joblib's loky) in the same run: what starting processes costs with
sharedmp (S1-S6), and what sending a table or data frame does (F1-F3).

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
L1-L12 small messages (``SMALL_SCRIPT``), spawn, sharedmp's channels against the standard
       library's and torch.multiprocessing's (L6: the standard library's ``Queue`` with
       sharedmp imported against without): a ``Pipe`` ping-pong (median and p90 of 2,000
       round trips), a ``ProcessPoolExecutor`` submit + result, executor and ``Pool`` maps
       of 2,000 arrays, and streams from warm producers that make each array (tensor, small
       tuple) as they put it, a burst of 5,000 and a steady 50,000 (L12: four producers),
       timed from the go to the last get; the producers live until it. A fresh
       program per run, the best of at least 3 runs: whether the OS puts the two processes
       on one CPU or two changes a round trip 4x, from run to run.
F1-F3  one message through a spawn ``Queue`` to a child that reads its last row (a value of
       each column) and answers: a ``pyarrow.Table`` of 8 float64 columns and 1 string
       column (1,000,000 rows, about 80 MB), the same as a pandas DataFrame
       (``table.to_pandas()``: pandas 3 keeps the strings in Arrow) and as a Polars
       DataFrame. Milliseconds from ``put()`` to the answer, the best of the messages of
       the runs, each run's first message (the child's imports) untimed. sharedmp sends the
       Arrow buffers out of band, through shared memory; the standard library pickles them.

Each figure of S2-S6 and F1-F3 comes from runs of a small script, a fresh interpreter that
imports its library at its top as a user's script does (forkserver preloads ``__main__``,
and each run gets a forkserver of its own), timed inside (S2-S6 from its first round to its
last); the best of the runs. The scripts are written to a temporary directory
(``scripts``) and run by the driver; they print one result line each (``worker.MARK``).
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


FRAME_SCRIPT = """\
import {module} as mp       # the system measured (the stdlib run never imports sharedmp)
import json
import queue
import sys
import time

WAIT = 30                   # seconds: the most any get() or join() waits


def make(kind, rows):
    \"\"\"The data: 8 float64 columns and 1 string column; (the Arrow table, what is sent).\"\"\"
    import numpy as np
    import pyarrow as pa
    rng = np.random.default_rng(0)
    columns = dict(("f%d" % i, rng.standard_normal(rows)) for i in range(8))
    columns["s"] = pa.array(["row-%d" % i for i in range(rows)])
    table = pa.table(columns)
    if kind == "pandas":
        return table, table.to_pandas()   # pandas 3: the string column stays in Arrow
    if kind == "polars":
        import polars
        return table, polars.from_arrow(table)
    return table, table


def last_row(kind, data):
    \"\"\"The last row, a value of each column: the whole message has arrived and is read.\"\"\"
    if kind == "pandas":
        return [data[c].iloc[-1] for c in data.columns]
    if kind == "polars":
        return list(data.row(-1))
    return [c[data.num_rows - 1].as_py() for c in data.columns]


def child(kind, inbox, outbox):
    while True:
        data = inbox.get(timeout=WAIT)
        if data is None:
            return
        row = last_row(kind, data)
        del data                # let go of the message before answering: part of its cost
        outbox.put(row)


def answer(outbox, child_proc):
    \"\"\"The child's answer; an error that says why if it dies or is silent for WAIT s.\"\"\"
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        try:
            return outbox.get(timeout=0.2)   # returns as soon as the answer is there
        except queue.Empty:
            if not child_proc.is_alive():
                raise SystemExit("the child exited with code %s" % child_proc.exitcode)
    raise SystemExit("no answer from the child in %d s" % WAIT)


def main(kind, rows, messages):
    table, data = make(kind, rows)
    expected = last_row("arrow", table)
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child_proc = ctx.Process(target=child, args=(kind, inbox, outbox), daemon=True)
    child_proc.start()
    try:
        times = []
        for _ in range(1 + messages):      # the first warms up (the child's imports): untimed
            t0 = time.perf_counter()
            inbox.put(data)
            row = answer(outbox, child_proc)
            times.append(time.perf_counter() - t0)
            if row != expected:
                raise SystemExit("the child read %r, not %r" % (row, expected))
        inbox.put(None)
        child_proc.join(WAIT)
        if child_proc.exitcode != 0:
            raise SystemExit("the child did not end cleanly: exit code %s" % child_proc.exitcode)
    finally:
        if child_proc.exitcode != 0:       # a failure above: end the child (None: alive), and
            child_proc.kill()              # do not wait at exit to write a message nobody reads
            child_proc.join(WAIT)
            inbox.cancel_join_thread()
    print({mark!r} + json.dumps({{"ms": min(times[1:]) * 1e3, "n": messages,
                                  "bytes": table.nbytes}}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
"""


SMALL_SCRIPT = """\
\"\"\"L rows: small messages one at a time and in streams. argv: system case item n; system
"sharedmp", "torch" (torch.multiprocessing), "multiprocessing", or "multiprocessing+sharedmp"
(the standard library's channels with sharedmp imported: its reducers are installed for their
pickler too).\"\"\"
import sys
if sys.argv[1] == "sharedmp":
    import sharedmp as lib
elif sys.argv[1] == "torch":
    import torch.multiprocessing as lib
else:
    import multiprocessing as lib
    if sys.argv[1] == "multiprocessing+sharedmp":
        import sharedmp  # noqa: F401  (its reducers, for the standard library's pickler too)
import concurrent.futures
import json
import time

WAIT = 60
MARK = {mark!r}


def echo(x):
    return x


def first(a):
    return float(a[0])


def echo_conn(conn):
    while True:
        x = conn.recv()
        if x is None:
            return
        conn.send(x)


def make_maker(kind):
    if kind == "torch":
        import torch
        torch.set_num_threads(1)
        return lambda i: torch.full((256,), float(i))
    import numpy as np
    if kind == "int":
        return lambda i: i
    if kind == "tuple":
        return lambda i: (i, i * 0.5, "abcdefghijklmnop", i)
    return lambda i: np.full(256, float(i), dtype=np.float32)


def producer(kind, q, go, done, n):
    make = make_maker(kind)
    go.wait(WAIT)
    for i in range(n):
        q.put(make(i))
    q.put(None)
    done.wait(WAIT)       # (alive until all is taken: torch's fds come from the sender)


def first_of(x):
    return x[0], x[-1]


def quantiles(times):
    times = sorted(times)
    return {{"us": times[len(times) // 2] * 1e6, "p90_us": times[int(0.9 * len(times))] * 1e6}}


def pingpong(ctx, kind, n):
    make = make_maker(kind)
    a, b = ctx.Pipe()
    p = ctx.Process(target=echo_conn, args=(b,), daemon=True)
    p.start()
    times = []
    try:
        for i in range(n + 1):
            x = make(i)
            t0 = time.perf_counter()
            a.send(x)
            if not a.poll(WAIT):
                raise SystemExit("no answer in %d s" % WAIT)
            a.recv()
            times.append(time.perf_counter() - t0)
        a.send(None)
        p.join(WAIT)
    finally:
        if p.is_alive():
            p.kill()
    return quantiles(times[1:])          # the first round trip: the child's imports


def executor_one(ctx, kind, n):
    make = make_maker(kind)
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as ex:
        ex.submit(echo, make(0)).result(WAIT)        # the worker's start, untimed
        times = []
        for i in range(n):
            x = make(i)
            t0 = time.perf_counter()
            ex.submit(echo, x).result(WAIT)
            times.append(time.perf_counter() - t0)
    return quantiles(times)


def executor_map(ctx, kind, n):
    make = make_maker(kind)
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=ctx) as ex:
        list(ex.map(abs, range(4)))                  # the workers' start, untimed
        arrays = [make(i) for i in range(n)]
        t0 = time.perf_counter()
        out = list(ex.map(echo, arrays, timeout=WAIT))
        seconds = time.perf_counter() - t0
    assert len(out) == n
    return {{"us": seconds / n * 1e6}}


def pool_map(ctx, kind, n):
    make = make_maker(kind)
    with ctx.Pool(2) as pool:
        pool.map(abs, range(4))
        arrays = [make(i) for i in range(n)]
        t0 = time.perf_counter()
        out = pool.map_async(first, arrays, chunksize=1).get(WAIT)
        seconds = time.perf_counter() - t0
    assert out == [float(i) for i in range(n)]
    return {{"us": seconds / n * 1e6}}


def stream(ctx, kind, n, producers=1):
    \"\"\"``producers`` producers (spawned, warm) make and put n items in all; this process
    gets them.\"\"\"
    q, go, done = ctx.Queue(), ctx.Event(), ctx.Event()
    ps = [ctx.Process(target=producer, args=(kind, q, go, done, n // producers), daemon=True)
          for _ in range(producers)]
    for p in ps:
        p.start()
    make_maker(kind)                                 # (this process's imports, untimed)
    try:
        time.sleep(0.5 * producers)                  # the producers' start, untimed
        t0 = time.perf_counter()
        go.set()
        k = ended = 0
        while ended < producers:
            x = q.get(timeout=WAIT)
            if x is None:
                ended += 1
                continue
            first_of(x)
            k += 1
        seconds = time.perf_counter() - t0
        done.set()
        for p in ps:
            p.join(WAIT)
    finally:
        for p in ps:
            if p.is_alive():
                p.kill()
    assert k == n // producers * producers
    return {{"us": seconds / k * 1e6, "msgs": k / seconds}}


def stream4(ctx, kind, n):
    return stream(ctx, kind, n, 4)


CASES = {{"pingpong": pingpong, "executor_one": executor_one, "executor_map": executor_map,
         "pool_map": pool_map, "stream": stream, "stream4": stream4}}


def main(case, kind, n):
    ctx = lib.get_context("spawn")
    res = CASES[case](ctx, kind, n)
    res["n"] = n
    print(MARK + json.dumps(res), flush=True)


if __name__ == "__main__":
    main(sys.argv[2], sys.argv[3], int(sys.argv[4]))
"""


def scripts(directory):
    """Write the scripts into ``directory``; {name: path}."""
    texts = {}
    for m in ("sharedmp", "multiprocessing"):
        texts[f"pool_{m}.py"] = POOL_SCRIPT.format(module=m, mark=MARK)
        texts[f"frames_{m}.py"] = FRAME_SCRIPT.format(module=m, mark=MARK)
    texts["small.py"] = SMALL_SCRIPT.format(mark=MARK)
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
    module = "sharedmp" if system == "sharedmp" else "multiprocessing"   # S5-S6: below
    if w["kind"] == "import":
        return [python, "-c", IMPORT_CODE.format(module=module)]
    if w["kind"] == "pool":
        return [python, paths[f"pool_{module}.py"], w["method"], str(w["n"])]
    if w["kind"] == "frame":
        return [python, paths[f"frames_{module}.py"], w["frame"], str(w["rows"]), str(w["n"])]
    if w["kind"] == "small":
        if system == "torch_mp":
            module = "torch"
        elif w.get("channel") == "stdlib" and system == "sharedmp":
            module = "multiprocessing+sharedmp"
        item = "array" if w["item"] == "torch" and system == "stdlib" else w["item"]
        return [python, paths["small.py"], module, w["case"], item, str(w["n"])]
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


def figure(w):
    """The key of row ``w``'s figure in its results: "ms", "us" or "seconds", as its unit."""
    return w["unit"] if w["unit"] in ("ms", "us") else "seconds"


def summary(w, runs):
    """One system's result from its runs' figures: S1 the median, the others the best."""
    if w["kind"] == "import":
        ms = statistics.median(r["ms"] for r in runs)
        return {"status": "ok", "ms": ms, "modules": runs[-1]["modules"],
                "heavy": runs[-1]["heavy"], "runs_ms": [r["ms"] for r in runs], "n": len(runs)}
    if w["kind"] == "frame":
        return {"status": "ok", "ms": min(r["ms"] for r in runs), "n": w["n"],
                "bytes": runs[-1]["bytes"], "runs_ms": [r["ms"] for r in runs]}
    if w["kind"] == "small":
        best = min(runs, key=lambda r: r["us"])
        return dict(best, status="ok", runs_us=[r["us"] for r in runs])
    seconds = min(r["seconds"] for r in runs)
    return {"status": "ok", "seconds": seconds, "n": w["n"],
            "runs_s": [r["seconds"] for r in runs]}


def missing(w, system=None):
    """Why workload ``w`` cannot run here (a module of its ``needs`` is not installed, or
    torch for ``system`` torch_mp), or None. Asked before its programs run, so a skipped row
    costs nothing and says why."""
    import importlib.util
    needs = [*w.get("needs", []), *(["torch"] if system == "torch_mp" else [])]
    absent = [m for m in dict.fromkeys(needs) if importlib.util.find_spec(m) is None]
    return f"needs {', '.join(absent)}" if absent else None

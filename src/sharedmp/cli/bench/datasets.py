"""The dataset rows of ``python -m sharedmp bench``, D1-D6: torch's DataLoader with persistent
workers over a dataset that the workers share (``mp.share_dataset``) or copy (the plain
dataset, as torch's own DataLoader has it), the memory the processes take and the time of an
epoch; each figure from a fresh program.

D1-D3  1,000,000 records ``(int, str, float)`` in a Python list held by a plain
       ``torch.utils.data.Dataset`` subclass; 3 shuffled epochs, batches of 1,024, the default
       collate; under fork, spawn and forkserver.
D4-D6  a 256 MiB float32 array (65,536 rows of 1,024), a row per sample; one shuffled epoch,
       batches of 256; under fork, spawn and forkserver.

Each (row, workers) pair, 1, 2 and 4 workers, runs twice, one fresh program each
(``DATASET_SCRIPT``): "plain", the dataset as is and ``multiprocessing_context=method`` (torch's
context; the program never imports sharedmp), and "shared", ``mp.share_dataset(ds)`` and
``multiprocessing_context=mp.get_context(method)``. Each program measures:

memory  the sum of the Pss (``/proc/<pid>/smaps_rollup``) of the program and every process
        under it (the workers, and a fork server where there is one) at the end of the last
        epoch, before the workers are shut down, minus the same measured first in the same
        program for a tiny dataset (one batch per worker, the same loader and epochs; the
        shared program's tiny dataset shared too): what the dataset costs the processes.
        The figure is the Pss of anonymous and shared memory (``Pss_Anon + Pss_Shmem``), where
        every dataset lies; file-backed pages (the interpreter, torch's libraries) are left
        out: their Pss moves by +-50 MiB between two measurements of one program, with the
        processes of other programs that map the same libraries (a test suite running
        meanwhile). The whole Pss difference is in the JSON too (``pss_delta_mib``, with
        ``anon_mib``, ``file_mib`` and ``shmem_mib``).
time    seconds per epoch, the mean of the epochs, each from ``iter()`` to its last batch: the
        first includes the workers' start (the dataset pickled into each one under spawn and
        forkserver). Every epoch's batches are checked (every sample once).
build   (shared records) the Pss of the list, and of its shared form while the list is still
        alive; the time of ``mp.share_dataset(ds)`` against that of ``pickle.dumps`` of each
        record (protocol 5), measured just before.

The program prints one result line (``worker.MARK``); the driver runs it (``driver.py``).
"""
import json
import os
import statistics

from .worker import MARK

DATASET_SCRIPT = """\
\"\"\"D rows: a torch DataLoader (persistent workers) over records or array rows, plain or
shared. argv: variant dataset method workers n epochs batch.\"\"\"
import sys
SHARED = sys.argv[1:2] == ["shared"]    # (a fork server that imports this file has no argv)
if SHARED:
    import sharedmp as mp
import json
import os
import pickle
import time
import warnings

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

WAIT = 120                  # seconds: the most the loader waits for a batch
MARK = {mark!r}
MiB = 1 << 20
WIDTH = 1024                # array rows: 1,024 float32 (4 KiB)
FIELDS = ["Pss", "Pss_Anon", "Pss_File", "Pss_Shmem"]      # of smaps_rollup
warnings.filterwarnings("ignore", message="This DataLoader will create")   # 4 workers, 2 CPUs


class Records(Dataset):
    \"\"\"A list of records (int, str, float), as a user's Dataset holds it.\"\"\"

    def __init__(self, records):
        self.records = records

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        return self.records[i]


class Rows(Dataset):
    \"\"\"A float32 array; sample i is its row i.\"\"\"

    def __init__(self, array):
        self.array = array

    def __len__(self):
        return len(self.array)

    def __getitem__(self, i):
        return self.array[i]


def make(kind, n):
    \"\"\"The dataset: sample i holds i (the checks add them up).\"\"\"
    if kind == "records":
        return Records([(i, "record-%d" % i, float(i)) for i in range(n)])
    a = np.empty((n, WIDTH), dtype=np.float32)
    a[:] = np.arange(n, dtype=np.float32)[:, None]
    return Rows(a)


def pss(pid):
    \"\"\"Bytes of Pss of process pid: [total, anonymous, file, shmem]; zeros if it is gone.\"\"\"
    out = [0, 0, 0, 0]
    try:
        with open("/proc/%d/smaps_rollup" % pid) as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in FIELDS:
                    out[FIELDS.index(key)] = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return out


def tree():
    \"\"\"This process and every process under it.\"\"\"
    children = {{}}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open("/proc/%s/stat" % name, "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(name))
    out, todo = [], [os.getpid()]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def run_epochs(ds, ctx, workers, batch, epochs):
    \"\"\"Iterate a DataLoader over ds for epochs; (seconds of each, the processes' Pss at the
    end of the last as pss() gives it, how many processes).\"\"\"
    loader = DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers,
                        persistent_workers=True, multiprocessing_context=ctx, timeout=WAIT)
    n = len(ds)
    times = []
    try:
        for _ in range(epochs):
            t0 = time.perf_counter()
            got = total = 0
            for b in loader:
                first = b[0] if isinstance(b, list) else b[:, 0]     # the i of each sample
                got += len(first)
                total += float(first.double().sum())
            times.append(time.perf_counter() - t0)
            if (got, total) != (n, float(n * (n - 1) // 2)):
                raise SystemExit("an epoch gave %d samples summing to %r, not %d summing to %d"
                                 % (got, total, n, n * (n - 1) // 2))
        pids = set(tree()) | {{w.pid for w in loader._iterator._workers}}
        memory = [sum(column) for column in zip(*map(pss, pids))]
    finally:
        if loader._iterator is not None:
            loader._iterator._shutdown_workers()
    return times, memory, len(pids)


def main(kind, method, workers, n, epochs, batch):
    torch.set_num_threads(1)
    ctx = mp.get_context(method) if SHARED else method
    tiny = make(kind, workers * batch)                  # one batch per worker
    if SHARED:
        mp.share_dataset(tiny, threshold=0)             # (below the default threshold)
    base = run_epochs(tiny, ctx, workers, batch, epochs)[1]
    del tiny
    res = {{}}
    before = pss(os.getpid())[0]
    t0 = time.perf_counter()
    ds = make(kind, n)
    res["make_s"] = time.perf_counter() - t0
    res["private_mib"] = (pss(os.getpid())[0] - before) / MiB  # the list (the array)
    if SHARED:
        data = ds.records if kind == "records" else ds.array   # alive until the form is made
        if kind == "records":
            dumps = pickle.dumps
            t0 = time.perf_counter()
            for r in data:
                dumps(r, 5)
            res["pickle_s"] = time.perf_counter() - t0
        before = pss(os.getpid())[0]
        t0 = time.perf_counter()
        ds = mp.share_dataset(ds)
        res["build_s"] = time.perf_counter() - t0
        res["form_mib"] = (pss(os.getpid())[0] - before) / MiB
        converted = ds.records is not data if kind == "records" else mp.is_shared(ds.array)
        if not converted:
            raise SystemExit("mp.share_dataset left the dataset as it was (below its threshold)")
        del data
    times, memory, processes = run_epochs(ds, ctx, workers, batch, epochs)
    res.update(epochs_s=times, epoch_s=sum(times) / len(times), pss_mib=memory[0] / MiB,
               base_mib=base[0] / MiB, pss_delta_mib=(memory[0] - base[0]) / MiB,
               processes=processes, n=n, sharedmp="sharedmp" in sys.modules)
    for key, got, was in zip(("anon_mib", "file_mib", "shmem_mib"), memory[1:], base[1:]):
        res[key] = (got - was) / MiB                 # the parts of pss_delta_mib
    res["memory_mib"] = res["anon_mib"] + res["shmem_mib"]      # the figure: files left out
    print(MARK + json.dumps(res), flush=True)


if __name__ == "__main__":
    main(sys.argv[2], sys.argv[3], *map(int, sys.argv[4:8]))
"""

VARIANTS = ("plain", "shared")


def script(directory):
    """Write the program into ``directory``; its path."""
    path = os.path.join(directory, "dataset.py")
    with open(path, "w") as f:
        f.write(DATASET_SCRIPT.format(mark=MARK))
    return path


def command(w, variant, workers, path, python):
    """The command line of one run of row ``w``."""
    return [python, path, variant, w["dataset"], w["method"],
            *map(str, (workers, w["n"], w["epochs"], w["batch"]))]


def parse(variant, out):
    """The figures of one run from its stdout; None if it printed none, or a plain run
    imported sharedmp (its reducers would share what the plain loader copies)."""
    found = [json.loads(line[len(MARK):]) for line in out.splitlines() if line.startswith(MARK)]
    if not found or found[-1]["sharedmp"] != (variant == "shared"):
        return None
    return dict(found[-1], status="ok")


def _value(res, key):
    return res.get(key) if res and res.get("status") == "ok" else None


def _ratio(a, b):
    return a / b if a is not None and b is not None and b > 0 else None


def ratios(res):
    """Per worker count (a str, as JSON keys are): shared over plain, memory and time."""
    return {k: {"memory": _ratio(_value(r.get("shared"), "memory_mib"),
                                 _value(r.get("plain"), "memory_mib")),
                "time": _ratio(_value(r.get("shared"), "epoch_s"),
                               _value(r.get("plain"), "epoch_s"))}
            for k, r in res.items()}


def build_figures(rows):
    """(records) The medians over the shared runs of ``rows`` (results of rows): list MiB,
    shared form MiB, build s, pickling s; None where no shared run gave them."""
    runs = [r["shared"] for res in rows for r in res.values()
            if _value(r.get("shared"), "pickle_s")]
    if not runs:
        return None
    return {k: statistics.median(r[k] for r in runs)
            for k in ("private_mib", "form_mib", "build_s", "pickle_s")}

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

- Every system runs in fresh processes: a consumer started with ``subprocess``
  (``worker.py`` run as a script, so that it imports only what its system needs: the
  stdlib and torch ones never import sharedmp, whose NumPy reducers would otherwise turn
  the "stdlib" column into shared memory) and a producer it starts with the spawn method.
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
spawn the second worker starts a while after the first) is left out; a fresh loader per
round. Its baseline "torch fd" is torch's default, what unchanged torch code gets
(``multiprocessing_context=None``: fork on Linux, file_descriptor strategy); "torch spawn"
isolates the start method.

The machine's bounds are measured in the same run: memcpy (``np.copyto`` of 64 MiB),
allocation + fill (a fresh ``np.empty`` of 64 MiB filled, in a loop) and round trips of
a tiny message over ``multiprocessing.Pipe`` between two processes.

The process-start rows, S1-S6 (``start.py``), are a table of their own, in seconds or
milliseconds: ``import sharedmp`` against ``import multiprocessing``; rounds of
``Pool(2)``/``map``/``terminate()`` under spawn, fork and forkserver against the standard
library's; joblib ``Parallel`` calls of tiny tasks, and of a 64 MiB tensor, with the
"sharedmp" backend against loky. Each run is a fresh program; ``--systems`` does not
select them, ``--workloads`` does.

The data-frame rows, F1-F3 (``start.py`` too, a table of their own, in ms per message): a
``pyarrow.Table`` of 1,000,000 rows (8 float64 columns, 1 string column, about 80 MB), the
same as a pandas and as a Polars DataFrame, one message through a spawn ``Queue`` to a child
that reads its last row, sharedmp against the standard library; a row whose library
(pyarrow, pandas, polars) is not installed is n/a, with the reason.

The dataset rows, D1-D6 (``datasets.py``, a table of their own, in MiB and seconds per
epoch): torch's DataLoader with persistent workers (1, 2 and 4; ``--quick``: 1 and 4) under
fork, spawn and forkserver over 1,000,000 records in a list (3 shuffled epochs) and over a
256 MiB float32 array (one epoch), the plain dataset against ``mp.share_dataset(ds)`` with
sharedmp's context: the Pss of the processes beyond a tiny dataset's, and the epoch time.

The modules: this one is the command (``add_parser``, ``run``); ``plan`` says what is
measured (systems, workloads, targets); ``driver`` runs the workers and makes the report;
``worker`` is the workers' script, importing only the standard library at its top (the
others import from it, it from none of them); ``start`` the program rows' programs;
``datasets`` the dataset rows' program; ``report`` makes the tables, the ratios, the targets
and the plot; ``cuda`` the CUDA rows, on a GPU.
"""
import json
import os
import sys

from . import cuda as bench_cuda
from .driver import bench
from .plan import DATASET_WORKLOADS, START_WORKLOADS, SYSTEMS, WORKLOADS
from .report import format_datasets, format_footer, format_header, format_start, format_table
from .report import plot


def add_parser(subparsers):
    import argparse

    from .. import COMMANDS
    p = subparsers.add_parser(
        "bench", help=COMMANDS["bench"], description=COMMANDS["bench"] + ". " +
        "Each system runs in fresh processes (spawn); the table shows messages/s, GB/s or fds, "
        "and sharedmp's ratio to torch (file_descriptor) and to the standard library.")
    p.add_argument("--quick", action="store_true",
                   help="a fifth of the counts, two timed rounds, one process pair per system, "
                   "the dataset rows with 1 and 4 workers (a few minutes)")
    p.add_argument("--json", metavar="FILE",
                   help="write every figure, the machine and the versions to FILE")
    p.add_argument("--plot", metavar="FILE", help="draw a bar chart to FILE (needs matplotlib)")
    p.add_argument("--scale", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--systems", metavar="S1,S2", default=None,
                   help="run only these systems, comma-separated (e.g. sharedmp,torch_fd)")
    p.add_argument("--workloads", metavar="W1,W2", default=None,
                   help="run only these workloads, comma-separated (e.g. W2,W3; S1-S6, F1-F3, "
                   "L1-L12 and D1-D6: the process-start, data-frame, small-message and dataset "
                   "rows, which --systems does not select)")
    p.add_argument("--isolation", choices=["workload", "system"], default=None,
                   help=argparse.SUPPRESS)
    return p


def _error(msg):
    print(f"error: {msg}", file=sys.stderr)
    return 2


def _unknown_choice(systems, workloads):
    """The error for a --systems or --workloads name that is not one; None if all are."""
    known_workloads = ([w["id"] for w in WORKLOADS] + [w["id"] for w in START_WORKLOADS]
                       + [w["id"] for w in DATASET_WORKLOADS]
                       + [c[0] for c in bench_cuda.WORKLOADS])
    for flag, given, known in (("--systems", systems, [s for s, _ in SYSTEMS]),
                               ("--workloads", workloads, known_workloads)):
        unknown = sorted(given - set(known)) if given else []
        if unknown:
            return f"{flag}: unknown {', '.join(unknown)}; choose from {','.join(known)}"
    return None


def _write_json(report, path):
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")


def run(args):
    if args.plot:                      # fail before minutes of measuring, not after
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return _error("--plot needs matplotlib: pip install 'sharedmp[bench]'")
    scale = args.scale if args.scale is not None else (0.2 if args.quick else 1.0)
    if not scale > 0:
        return _error("--scale must be > 0")
    rounds = args.rounds if args.rounds is not None else \
        (2 if args.quick else 1 if scale < 1 else 5)
    systems = set(args.systems.split(",")) if args.systems else None
    workloads = set(args.workloads.split(",")) if args.workloads else None
    unknown = _unknown_choice(systems, workloads)
    if unknown:
        return _error(unknown)
    report = bench(scale, max(1, rounds), args.quick, timeout=args.timeout, systems=systems,
                   workloads=workloads, isolation=args.isolation)
    print(format_header(report))
    if report["workloads"]:
        print()
        print(format_table(report))
    if report.get("start"):
        print()
        print(format_start(report))
    if report.get("datasets"):
        print()
        print(format_datasets(report))
    # The CUDA rows (cuda.py): sharedmp against torch on a GPU; skipped without one.
    if workloads is None or any(w.startswith("C") for w in workloads):
        report["cuda"] = bench_cuda.run(args.quick)
        print()
        print(bench_cuda.format_rows(report["cuda"]))
    if args.plot and report["workloads"]:
        plot(report, args.plot)
        report["plot"] = os.path.abspath(args.plot)
    elif args.plot:
        print("\n--plot: nothing drawn (the plot shows the queue workloads, none was run)")
    print(format_footer(report), flush=True)
    if args.json:
        _write_json(report, args.json)
    return 1 if report["problems"] or report["shm_left"] else 0

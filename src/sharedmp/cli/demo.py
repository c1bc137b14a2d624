"""``python -m sharedmp demo``: Hogwild training of a real model with N processes sharing it.

Trains an MLP on scikit-learn's bundled digits (or ``--data FILE.npz``) with
``sharedmp.training``: the model (and Adam's state) in shared memory, N spawned workers
stepping it without locks, a progress bar fed by shared counters. Prints the test
accuracy and samples/s; ``--compare`` runs 1 worker as well and prints the speed-up.

Exit status: 0 done, 1 a worker failed (its traceback is printed), 2 bad arguments or
data, 130 interrupted (Ctrl-C: the workers are stopped, nothing is left behind).
"""
import json
import os
import sys
import time

# Compute-bound: ~0.4 GFLOP per step of 64 samples. Measured on the 2-core dev machine,
# 2 workers vs 1: 64-256-256-10 1.3x (short steps; the shared weights' cache lines bounce
# between the cores), 64-512-512-10 1.65x, 64-1024-1024-10 ~2x.
DEFAULT_HIDDEN = "1024,1024"
DEFAULT_EPOCHS = 40


def add_parser(subparsers):
    from . import COMMANDS
    p = subparsers.add_parser("demo", help=COMMANDS["demo"], description=COMMANDS["demo"])
    p.add_argument("--workers", type=int, default=2, metavar="N",
                   help="worker processes that train the one shared model (default: 2)")
    p.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS, metavar="E",
                   help=f"passes over the training data, all workers together (default: {DEFAULT_EPOCHS})")
    p.add_argument("--strategy", metavar="S",
                   help="sharing strategy: file_descriptor or file_system (default: the current one)")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd",
                   help="sgd, or adam with its moments shared among the workers (default: sgd)")
    p.add_argument("--lr", type=float, metavar="LR",
                   help="learning rate (default: 0.05 for sgd, 0.001 for adam)")
    p.add_argument("--batch-size", type=int, default=64, metavar="B", help="samples per step (default: 64)")
    p.add_argument("--hidden", default=DEFAULT_HIDDEN, metavar="W,W",
                   help=f"widths of the MLP's hidden layers (default: {DEFAULT_HIDDEN})")
    p.add_argument("--data", metavar="FILE.npz",
                   help="your own data: an .npz file with arrays X (samples x features) and y (labels)")
    p.add_argument("--compare", action="store_true",
                   help="also train with 1 worker and print the speed-up")
    p.add_argument("--plot", metavar="FILE", help="write a PNG: loss per worker and test accuracy over time")
    p.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    p.add_argument("--seed", type=int, default=0, help="seed of the split, the model and the shuffles")
    return p


def _hidden(text):
    try:
        widths = tuple(int(w) for w in text.split(","))
    except ValueError:
        widths = ()
    if not widths or min(widths) < 1:
        raise ValueError(f"--hidden takes positive widths separated by commas (e.g. 1024,1024), not {text!r}")
    return widths


def _check(args):
    """The arguments' errors, as messages (argparse checks the types)."""
    errors = []
    for name in ("workers", "epochs", "batch_size"):
        if getattr(args, name) < 1:
            errors.append(f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}")
    if args.lr is not None and not args.lr > 0:
        errors.append(f"--lr must be positive, not {args.lr}")
    try:
        _hidden(args.hidden)
    except ValueError as e:
        errors.append(str(e))
    if args.strategy is not None:
        import sharedmp as mp
        if args.strategy not in mp.get_all_sharing_strategies():
            errors.append(f"--strategy {args.strategy!r} is not one of "
                          f"{', '.join(sorted(mp.get_all_sharing_strategies()))}")
    return errors


def _row(name, value):
    print(f"{name:<15} {value}", flush=True)


def _summary(result, label):
    _row(f"{label}", f"test accuracy {result.test_accuracy:.1%}, {result.samples_per_s:,.0f} samples/s "
         f"({result.samples:,} samples in {result.train_seconds:.2f} s; "
         f"start-up {result.startup_seconds:.1f} s not counted)")


def run(args):
    errors = _check(args)
    if errors:
        for e in errors:
            print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    import sharedmp as mp
    if args.strategy is not None:
        mp.set_sharing_strategy(args.strategy)
    from .. import training

    try:
        if args.data:
            data = training.load_npz(args.data, seed=args.seed)
        else:
            data = training.load_digits(seed=args.seed)
    except training.DataError as e:
        print(f"error: --data {e}" if args.data else f"error: {e}", file=sys.stderr)
        return 2
    if len(data.y_train) < args.workers:
        print(f"error: {len(data.y_train)} training samples cannot be split among {args.workers} "
              "workers; use fewer --workers", file=sys.stderr)
        return 2
    factory = training.mlp_factory(data, _hidden(args.hidden))
    cores = len(os.sched_getaffinity(0))
    _row("dataset", data.describe())
    _row("model", training.describe_model(factory()))
    _row("workers", f"{args.workers} processes (spawn), 1 intra-op thread each; this machine has "
                    f"{cores} core{'s' * (cores > 1)}")
    lr = training.DEFAULT_LR[args.optimizer] if args.lr is None else args.lr
    shared = "parameters and Adam's moments and step shared" if args.optimizer == "adam" \
        else "parameters shared, gradients private"
    _row("optimizer", f"{args.optimizer}, lr {lr:g}, batch {args.batch_size}, "
                      f"{args.epochs} epochs ({shared})")
    _row("strategy", mp.get_sharing_strategy())
    if args.workers > cores:
        print(f"note: {args.workers} workers on {cores} cores: they will take turns, "
              "so samples/s cannot scale past the core count", file=sys.stderr)

    settings = dict(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                    optimizer=args.optimizer, seed=args.seed)
    runs = []
    try:
        result = training.train(factory, data, workers=args.workers, **settings)
        runs.append(result)
        _summary(result, f"{args.workers} worker{'s' * (args.workers > 1)}")
        if args.compare and args.workers != 1:
            runs.append(training.train(factory, data, workers=1, **settings))
            _summary(runs[-1], "1 worker")
    except KeyboardInterrupt:
        print("\ninterrupted: the workers were stopped", file=sys.stderr, flush=True)
        return 130
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        print(f"error: a worker failed, training stopped:\n{e}", file=sys.stderr)
        return 1
    speedup = runs[0].samples_per_s / runs[1].samples_per_s if len(runs) == 2 else None
    _row("test accuracy", f"{result.test_accuracy:.1%}")
    _row("samples/s", f"{result.samples_per_s:,.0f}")
    if speedup is not None:
        _row("speed-up", f"{speedup:.2f}x ({args.workers} workers vs 1, samples/s)")
    elapsed = time.monotonic() - t0
    _row("elapsed", f"{elapsed:.1f} s")
    report = {"dataset": data.describe(), "model": training.describe_model(result.model),
              "hidden": list(_hidden(args.hidden)), "speedup": speedup, "elapsed_seconds": elapsed,
              "runs": [r.to_json() for r in runs]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot:
        plot(runs, report, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def plot(runs, report, path):
    """A PNG: loss per worker over time (left), the parent's test accuracy over time (right)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    main = runs[0]
    for i, c in enumerate(main.loss_curves):
        if len(c):
            left.plot(c[:, 0], _smooth(c[:, 2]), lw=1, label=f"worker {i}")
    if len(runs) > 1 and len(runs[1].loss_curves[0]):
        c = runs[1].loss_curves[0]
        left.plot(c[:, 0], _smooth(c[:, 2]), lw=1, color="0.5", ls="--", label="1 worker alone")
    left.set(title="training loss per worker (moving average)", xlabel="seconds since start",
             ylabel="cross-entropy loss", yscale="log")
    left.legend(fontsize=8)
    for r, style in zip(runs, ("-o", "--s")):
        t, acc = zip(*r.accuracy_curve)
        right.plot(t, [100 * a for a in acc], style, ms=3, color=None if style == "-o" else "0.5",
                   label=f"{r.workers} worker{'s' * (r.workers > 1)}: {r.samples_per_s:,.0f} samples/s")
    right.set(title="test accuracy seen by the parent", xlabel="seconds since start", ylabel="%")
    right.legend(fontsize=8, loc="lower right")
    title = f"{report['dataset']} - {report['model']}"
    if report["speedup"] is not None:
        title += f" - speed-up {report['speedup']:.2f}x"
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _smooth(values, span=10):
    """An exponential moving average (the raw loss of one batch is noisy)."""
    out, avg, alpha = [], values[0], 2 / (span + 1)
    for v in values:
        avg += alpha * (v - avg)
        out.append(avg)
    return out

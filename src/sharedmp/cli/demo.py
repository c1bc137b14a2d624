"""``python -m sharedmp demo``: Hogwild training of a real model with N processes sharing it.

Trains an MLP on scikit-learn's bundled digits (or ``--data FILE.npz``) with
``sharedmp.training``: the model (and Adam's state) in shared memory, N spawned workers
stepping it without locks, a progress bar fed by shared counters. Prints the test
accuracy and samples/s; ``--compare`` runs 1 worker as well and prints the speed-up.

Several nodes (``sharedmp.distributed``): run under ``torchrun --nproc-per-node 1`` on each
machine (the variables it sets make this process its node's leader), or ``--nodes N`` to
simulate N nodes here: N leaders on loopback, each with its own workers. Node 0 prints the
figures of every node.

Exit status: 0 done, 1 a worker or a node failed (its traceback or the node is printed),
2 bad arguments or data, 130 interrupted (Ctrl-C: the workers are stopped, nothing is left
behind).
"""
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time

# Compute-bound: ~0.4 GFLOP per step of 64 samples. Measured on the 2-core dev machine,
# 2 workers vs 1: 64-256-256-10 1.3x (short steps; the shared weights' cache lines bounce
# between the cores), 64-512-512-10 1.65x, 64-1024-1024-10 ~2x.
DEFAULT_HIDDEN = "1024,1024"
DEFAULT_EPOCHS = 40
DEFAULT_SYNC_EVERY = 50        # steps of each worker between averaging rounds (several nodes)
DEFAULT_DIST_TIMEOUT = 60.0


def add_parser(subparsers):
    from . import COMMANDS
    p = subparsers.add_parser("demo", help=COMMANDS["demo"], description=COMMANDS["demo"])
    p.add_argument("--workers", type=int, default=2, metavar="N",
                   help="worker processes that train the one shared model (default: 2)")
    p.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS, metavar="E",
                   help="passes over the training data, all workers together "
                        f"(default: {DEFAULT_EPOCHS})")
    p.add_argument("--strategy", metavar="S",
                   help="sharing strategy: file_descriptor or file_system "
                        "(default: the current one)")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd",
                   help="sgd, or adam with its moments shared among the workers (default: sgd)")
    p.add_argument("--lr", type=float, metavar="LR",
                   help="learning rate (default: 0.05 for sgd, 0.001 for adam)")
    p.add_argument("--batch-size", type=int, default=64, metavar="B",
                   help="samples per step (default: 64)")
    p.add_argument("--hidden", default=DEFAULT_HIDDEN, metavar="W,W",
                   help=f"widths of the MLP's hidden layers (default: {DEFAULT_HIDDEN})")
    p.add_argument("--data", metavar="FILE.npz",
                   help="your own data: an .npz file with arrays X (samples x features) "
                        "and y (labels)")
    p.add_argument("--compare", action="store_true",
                   help="also train with 1 worker and print the speed-up")
    p.add_argument("--plot", metavar="FILE",
                   help="write a PNG: loss per worker and test accuracy over time")
    p.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the split, the model and the shuffles")
    g = p.add_argument_group(
        "several nodes", "Hogwild inside each node, parameters averaged across nodes with "
        "torch.distributed. On real machines run, on each: torchrun --nnodes N "
        "--nproc-per-node 1 --node-rank R --master-addr HOST0 --master-port PORT "
        "-m sharedmp demo [options]")
    g.add_argument("--nodes", type=int, metavar="N",
                   help="simulate N nodes on this machine: N leaders on loopback, each with "
                        "--workers workers")
    g.add_argument("--sync-every", type=int, default=DEFAULT_SYNC_EVERY, metavar="K",
                   help=f"average the parameters across nodes every K steps of each worker "
                        f"(default: {DEFAULT_SYNC_EVERY})")
    g.add_argument("--backend", choices=["gloo", "nccl"], default="gloo",
                   help="torch.distributed backend (default: gloo; nccl needs a GPU per node)")
    g.add_argument("--dist-timeout", type=float, default=DEFAULT_DIST_TIMEOUT, metavar="S",
                   help="seconds to wait for the other nodes, at start and in each averaging "
                        f"round, before giving up (default: {DEFAULT_DIST_TIMEOUT:g})")
    return p


def _hidden(text):
    try:
        widths = tuple(int(w) for w in text.split(","))
    except ValueError:
        widths = ()
    if not widths or min(widths) < 1:
        raise ValueError("--hidden takes positive widths separated by commas (e.g. 1024,1024), "
                         f"not {text!r}")
    return widths


def _check(args):
    """The arguments' errors, as messages (argparse checks the types)."""
    errors = []
    for name in ("workers", "epochs", "batch_size"):
        if getattr(args, name) < 1:
            option = f"--{name.replace('_', '-')}"
            errors.append(f"{option} must be at least 1, not {getattr(args, name)}")
    if args.lr is not None and not args.lr > 0:
        errors.append(f"--lr must be positive, not {args.lr}")
    if args.nodes is not None and args.nodes < 1:
        errors.append(f"--nodes must be at least 1, not {args.nodes}")
    if args.sync_every < 1:
        errors.append(f"--sync-every must be at least 1, not {args.sync_every}")
    if not args.dist_timeout > 0:
        errors.append(f"--dist-timeout must be positive, not {args.dist_timeout}")
    if args.compare and (args.nodes is not None or _launched()):
        errors.append("--compare runs on one node only; leave it out with several nodes")
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


def _lr(args):
    """The learning rate the run uses: --lr, or the optimizer's default."""
    from .. import training
    return training.DEFAULT_LR[args.optimizer] if args.lr is None else args.lr


def _row(name, value):
    print(f"{name:<15} {value}", flush=True)


def _summary(result, label):
    _row(f"{label}", f"test accuracy {result.test_accuracy:.1%}, "
         f"{result.samples_per_s:,.0f} samples/s ({result.samples:,} samples in "
         f"{result.train_seconds:.2f} s; start-up {result.startup_seconds:.1f} s not counted)")


def _launched():
    """True if torchrun (or ``--nodes``) started this process as a node leader."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run(args):
    errors = _check(args)
    if errors:
        for e in errors:
            print(f"error: {e}", file=sys.stderr)
        return 2
    if _launched():
        return run_node(args)
    if args.nodes is not None:
        return launch_local(args)
    return _run_here(args)


def _load(args, me=""):
    """The data set, or None once its error is printed (``me``: which node says it)."""
    from .. import training
    try:
        if args.data:
            return training.load_npz(args.data, seed=args.seed)
        return training.load_digits(seed=args.seed)
    except training.DataError as e:
        print(f"{me}error: --data {e}" if args.data else f"{me}error: {e}", file=sys.stderr)
        return None


def _run_here(args):
    """One machine: train with ``--workers`` (and, with ``--compare``, 1 worker); report."""
    t0 = time.monotonic()
    import sharedmp as mp
    from .. import training
    if args.strategy is not None:
        mp.set_sharing_strategy(args.strategy)
    data = _load(args)
    if data is None:
        return 2
    if len(data.y_train) < args.workers:
        print(f"error: {len(data.y_train)} training samples cannot be split among {args.workers} "
              "workers; use fewer --workers", file=sys.stderr)
        return 2
    factory = training.mlp_factory(data, _hidden(args.hidden))
    _describe(args, data, factory)
    settings = dict(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                    optimizer=args.optimizer, seed=args.seed)
    runs = []
    try:
        runs.append(training.train(factory, data, workers=args.workers, **settings))
        _summary(runs[0], f"{args.workers} worker{'s' * (args.workers > 1)}")
        if args.compare and args.workers != 1:
            runs.append(training.train(factory, data, workers=1, **settings))
            _summary(runs[-1], "1 worker")
    except KeyboardInterrupt:
        print("\ninterrupted: the workers were stopped", file=sys.stderr, flush=True)
        return 130
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        print(f"error: a worker failed, training stopped:\n{e}", file=sys.stderr)
        return 1
    _report(args, data, runs, time.monotonic() - t0)
    return 0


def _describe(args, data, factory):
    """The rows printed before training: data, model, workers, optimizer, strategy."""
    import sharedmp as mp
    from .. import training
    cores = len(os.sched_getaffinity(0))
    _row("dataset", data.describe())
    _row("model", training.describe_model(factory()))
    _row("workers", f"{args.workers} process{'es' * (args.workers > 1)} (spawn), "
                    "1 intra-op thread each; this machine has "
                    f"{cores} core{'s' * (cores > 1)}")
    lr = _lr(args)
    shared = "parameters and Adam's moments and step shared" if args.optimizer == "adam" \
        else "parameters shared, gradients private"
    _row("optimizer", f"{args.optimizer}, lr {lr:g}, batch {args.batch_size}, "
                      f"{args.epochs} epochs ({shared})")
    _row("strategy", mp.get_sharing_strategy())
    if args.workers > cores:
        print(f"note: {args.workers} workers on {cores} cores: they will take turns, "
              "so samples/s cannot scale past the core count", file=sys.stderr)


def _report(args, data, runs, elapsed):
    """The rows printed after training; the JSON and the plot if asked for."""
    from .. import training
    result = runs[0]
    speedup = runs[0].samples_per_s / runs[1].samples_per_s if len(runs) == 2 else None
    _row("test accuracy", f"{result.test_accuracy:.1%}")
    _row("samples/s", f"{result.samples_per_s:,.0f}")
    if speedup is not None:
        _row("speed-up", f"{speedup:.2f}x ({args.workers} workers vs 1, samples/s)")
    _row("elapsed", f"{elapsed:.1f} s")
    report = {"dataset": data.describe(), "model": training.describe_model(result.model),
              "hidden": list(_hidden(args.hidden)), "speedup": speedup, "elapsed_seconds": elapsed,
              "runs": [r.to_json() for r in runs]}
    _write(args, runs, report)


def _write(args, runs, report):
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot:
        plot(runs, report, args.plot)
        print(f"plot written to {args.plot}")


# ------------------------------------------------------------------------- several nodes

def run_node(args):
    """This process is one node's leader (torchrun or ``--nodes``): train, average, report.

    It ends the process itself (``exit_now``: see the hazard there).
    """
    from ..hogwild.nodes import exit_now
    exit_now(_lead(args))


def _lead(args):
    t0 = time.monotonic()
    import sharedmp as mp
    from .. import distributed, training
    try:
        env = distributed.NodeEnv.from_env()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    me = f"node {env.rank}: "
    if args.nodes is not None and args.nodes != env.world_size:
        print(f"{me}error: --nodes {args.nodes} but WORLD_SIZE={env.world_size}; leave --nodes "
              "out under torchrun (--nnodes sets the number of nodes)", file=sys.stderr)
        return 2
    if args.strategy is not None:
        mp.set_sharing_strategy(args.strategy)
    data = _load(args, me)
    if data is None:
        return 2
    factory = training.mlp_factory(data, _hidden(args.hidden))
    if env.rank == 0:
        lr = _lr(args)
        _row("dataset", data.describe())
        _row("model", training.describe_model(factory()))
        _row("optimizer", f"{args.optimizer}, lr {lr:g}, batch {args.batch_size}, {args.epochs} "
                          "epochs of each node's shard (parameters averaged across nodes; "
                          "optimizer state per node)")
    try:
        node = distributed.Node(env, args.backend, args.sync_every, args.dist_timeout)
    except ValueError as e:
        print(f"{me}error: {e}", file=sys.stderr)
        return 2
    except distributed.NodeLost as e:
        print(f"{me}error: {e}", file=sys.stderr)
        return 1
    try:
        code, result, nodes = _train_node(args, node, data, factory)
    finally:
        node.close()
    if code == 0 and env.rank == 0:
        _report_nodes(args, data, result, nodes, time.monotonic() - t0)
    return code


def _train_node(args, node, data, factory):
    """Train this node's share, averaged with the others: (exit status, result, figures)."""
    import sharedmp as mp
    from .. import distributed, training
    me, workers = f"node {node.rank}: ", f"{args.workers} worker{'s' * (args.workers > 1)}"
    try:
        if node.rank == 0:
            _row("nodes", f"{node.describe()}; {workers} (spawn) per node")
        result = training.train(factory, data, workers=args.workers, epochs=args.epochs,
                                batch_size=args.batch_size, lr=args.lr, optimizer=args.optimizer,
                                seed=args.seed, progress=node.rank == 0, node=node,
                                label=f"node 0 of {node.world_size}, {workers}")
        return 0, result, node.gather(_node_figures(result, node))
    except KeyboardInterrupt:
        print(f"\n{me}interrupted: the workers were stopped", file=sys.stderr, flush=True)
        return 130, None, None
    except (distributed.NodeLost, TimeoutError) as e:
        print(f"{me}error: {e}; this node's workers were stopped", file=sys.stderr, flush=True)
        return 1, None, None
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        print(f"{me}error: a worker failed, training stopped (the other nodes will stop too):"
              f"\n{e}", file=sys.stderr, flush=True)
        return 1, None, None
    except ValueError as e:                        # a shard too small for --workers
        print(f"{me}error: {e}", file=sys.stderr)
        return 2, None, None


def _node_figures(result, node):
    """What node 0 prints for each node (gathered from every node)."""
    return {"rank": node.rank, "host": socket.gethostname(), "pid": os.getpid(),
            "workers": result.workers, "samples": result.samples,
            "train_seconds": result.train_seconds, "samples_per_s": result.samples_per_s,
            "test_accuracy": result.test_accuracy, "rounds": len(result.rounds),
            "allreduce_seconds": result.allreduce_seconds,
            "paused_seconds": sum(result.paused_seconds) / len(result.paused_seconds),
            "round_checksums": [r[2] for r in result.rounds],
            "final_checksum": result.parent_checksum,
            "workers_see_final":
                result.worker_checksums == [result.parent_checksum] * result.workers}


def _report_nodes(args, data, result, nodes, elapsed):
    from .. import training
    for n in nodes:
        workers = f"{n['workers']} worker{'s' * (n['workers'] > 1)}"
        _row(f"node {n['rank']}", f"{n['host']}, {workers}: test accuracy "
             f"{n['test_accuracy']:.1%}, {n['samples_per_s']:,.0f} samples/s ({n['samples']:,} "
             f"samples in {n['train_seconds']:.2f} s); {n['rounds']} rounds, all-reduce "
             f"{n['allreduce_seconds']:.2f} s, workers paused {n['paused_seconds']:.2f} s each")
    equal = all(n["round_checksums"] == nodes[0]["round_checksums"] for n in nodes)
    final = len({n["final_checksum"] for n in nodes}) == 1 \
        and all(n["workers_see_final"] for n in nodes)
    samples = sum(n["samples"] for n in nodes)
    seconds = max(n["train_seconds"] for n in nodes)
    rate = samples / seconds if seconds > 0 else float("nan")
    rounds = nodes[0]["rounds"]
    _row("averaging", f"{rounds} rounds; node models equal after every round: "
                      f"{'yes' if equal else 'NO'}; at the end: {'yes' if final else 'NO'} "
                      "(checksums compared)")
    _row("test accuracy", f"{result.test_accuracy:.1%}")
    _row("samples/s", f"{rate:,.0f} (all nodes: {samples:,} samples in {seconds:.2f} s)")
    _row("all-reduce", ", ".join(f"{n['allreduce_seconds']:.2f} s on node {n['rank']}"
                                 for n in nodes) + " (waiting for slower nodes included)")
    _row("elapsed", f"{elapsed:.1f} s")
    report = {"dataset": data.describe(), "model": training.describe_model(result.model),
              "hidden": list(_hidden(args.hidden)), "speedup": None, "elapsed_seconds": elapsed,
              "backend": args.backend, "sync_every": args.sync_every, "nodes": nodes,
              "test_accuracy": result.test_accuracy, "samples": samples, "samples_per_s": rate,
              "models_equal_after_each_round": equal, "models_equal_at_end": final,
              "runs": [result.to_json()]}
    _write(args, [result], report)


def launch_local(args):
    """``--nodes N``: run N node leaders on this machine over loopback; the worst exit status.

    Each leader is ``python -m sharedmp demo`` with torchrun's variables (a free port on
    127.0.0.1), in its own process group, and dies with this process. When one ends badly
    the others get a grace period to notice and stop by themselves (each says which node it
    lost), then are killed. Ctrl-C here is passed on to every leader.
    """
    from ..processes import pdeath
    from ..hogwild.trainer import STOP_GRACE
    grace = args.dist_timeout + STOP_GRACE + 10
    with socket.socket() as s:           # a free port (another program may take it first)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    preexec = None
    if pdeath.HAVE_PDEATHSIG and not pdeath.keep_orphans():
        preexec = functools.partial(pdeath.arm, os.getpid())
    leaders = []
    try:
        for rank in range(args.nodes):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.nodes), LOCAL_RANK="0",
                       LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
            argv = [sys.executable, "-m", "sharedmp", "demo", *_leader_argv(args)]
            leaders.append(subprocess.Popen(argv, env=env, start_new_session=True,
                                            preexec_fn=preexec))
        return _wait_leaders(leaders, grace)
    except KeyboardInterrupt:
        for p in leaders:
            _signal_group(p, signal.SIGINT)
        _wait_leaders(leaders, grace)
        print("\ninterrupted: every node was stopped", file=sys.stderr, flush=True)
        return 130
    finally:
        for p in leaders:                          # whatever happened: nothing left behind
            _signal_group(p, signal.SIGKILL)
            p.wait()


def _leader_argv(args):
    """The options of this command, for each leader (paths made absolute)."""
    argv = ["--workers", str(args.workers), "--epochs", str(args.epochs),
            "--optimizer", args.optimizer, "--batch-size", str(args.batch_size),
            "--hidden", args.hidden, "--seed", str(args.seed), "--nodes", str(args.nodes),
            "--sync-every", str(args.sync_every), "--backend", args.backend,
            "--dist-timeout", repr(args.dist_timeout)]
    for option, value in (("--lr", args.lr), ("--strategy", args.strategy)):
        if value is not None:
            argv += [option, str(value)]
    for option, path in (("--data", args.data), ("--json", args.json), ("--plot", args.plot)):
        if path:
            argv += [option, os.path.abspath(path)]
    return argv


def _wait_leaders(leaders, grace):
    """Wait for every leader; once one has failed, kill those still running after ``grace`` s."""
    failed_at, reported = None, set()
    while True:
        running = [p.poll() is None for p in leaders]
        for rank, p in enumerate(leaders):
            if p.returncode not in (None, 0) and rank not in reported:
                reported.add(rank)
                failed_at = failed_at or time.monotonic()
                later = f"; the other nodes have {grace:.0f} s to stop" if any(running) else ""
                print(f"launcher: node {rank} (pid {p.pid}) {_how(p.returncode)}{later}",
                      file=sys.stderr, flush=True)
        if not any(running):
            break
        if failed_at is not None and time.monotonic() - failed_at > grace:
            for rank, p in enumerate(leaders):
                if p.poll() is None:
                    print(f"launcher: node {rank} (pid {p.pid}) did not stop within "
                          f"{grace:.0f} s: killed", file=sys.stderr, flush=True)
                    _signal_group(p, signal.SIGKILL)
                    p.wait()
                    reported.add(rank)
        time.sleep(0.05)
    codes = [p.returncode for p in leaders]
    if all(c == 0 for c in codes):
        return 0
    if 130 in codes:
        return 130
    return 2 if all(c in (0, 2) for c in codes) else 1


def _how(code):
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def _signal_group(proc, sig):
    """Signal a leader and its workers (its process group), unless it has been reaped."""
    if proc.poll() is not None:                    # reaped: its pid may be reused
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


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
                   label=f"{r.workers} worker{'s' * (r.workers > 1)}: "
                         f"{r.samples_per_s:,.0f} samples/s")
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

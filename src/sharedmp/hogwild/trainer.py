"""The parent's side of Hogwild training: share the model, start the workers, watch them.

The parent builds the model and its optimizer, moves both into shared memory with
``mp.share_memory_`` and starts the workers with ``mp.start_processes`` (spawn). With
``adam`` the moments and step counter are shared too, as in A3C-style training. It then
evaluates the shared model while they train and feeds the progress bar from the board.
It stops the workers through the board (Ctrl-C, timeout, a failed worker): they return
normally, so nothing prints a traceback; what has not returned after ``STOP_GRACE`` s is
killed (``LATE_GRACE`` s once a worker missed an averaging round by the node's timeout).
A worker that raises ends the run with ``mp.ProcessRaisedException``.

Several nodes (``node=``, a ``Node`` of ``nodes.py``): the parent is its node's leader.
Once every worker waits for the current averaging round (or is done), the leader averages
the parameters with the other nodes and releases the round. So the averaged weights are
exactly what every node holds, and a node's workers are idle only while it averages or
waits for slower nodes. Each node trains on its own shard of the data (by rank); its
workers on sub-shards.
"""
from __future__ import annotations

import math
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

import sharedmp as mp

from .board import DONE, READY, Board
from .data import Dataset
from .model import DEFAULT_LR, OPTIMIZERS, accuracy, checksum, make_optimizer
from .progress import progress_bar, update
from .worker import WorkerArgs, worker

if TYPE_CHECKING:
    from numpy.typing import NDArray

    from .nodes import Node

__all__ = ["train", "Result", "STARTUP_TIMEOUT", "STOP_GRACE"]

STARTUP_TIMEOUT = 120.0    # seconds for every worker to be ready (spawn + import torch)
STOP_GRACE = 10.0          # seconds for stopped workers to return before they are killed
LATE_GRACE = 1.0           # the same for workers that missed an averaging round: stuck


@dataclass
class Result:
    """What ``train`` measured. ``model`` is the trained (shared) model."""
    workers: int
    optimizer: str
    lr: float
    epochs: int
    batch_size: int
    strategy: str
    test_accuracy: float
    samples: int              # samples trained, all workers together
    train_seconds: float      # from go to the last worker's last step
    startup_seconds: float    # from start to go: spawn, import torch, unpickle the model
    elapsed_seconds: float    # the whole call
    steps: list[int]          # optimizer steps per worker
    # per worker: an array of (seconds, samples, mean loss) rows
    loss_curves: list[NDArray[np.float64]]
    accuracy_curve: list[tuple[float, float]]   # (seconds since go, test accuracy), parent
    worker_checksums: list[int]    # each worker's checksum of the final weights
    parent_checksum: int      # the parent's checksum of the same weights
    shared_step: float | None  # adam: the shared step counter after training
    model: torch.nn.Module | None = field(repr=False, default=None)
    node: int | None = None   # several nodes: this node's rank
    # per averaging round: (seconds since go, all-reduce seconds, checksum after it)
    rounds: list[tuple[float, float, int]] = field(default_factory=list)
    paused_seconds: list[float] = field(default_factory=list)   # per worker: waited for averaging

    @property
    def allreduce_seconds(self) -> float:
        """Time the leader spent averaging (waiting for slower nodes included)."""
        return float(sum(r[1] for r in self.rounds))

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.train_seconds if self.train_seconds > 0 else float("nan")

    def to_json(self) -> dict[str, Any]:
        """The figures as JSON-ready data (no model)."""
        return {
            "workers": self.workers, "optimizer": self.optimizer, "lr": self.lr,
            "epochs": self.epochs, "batch_size": self.batch_size, "strategy": self.strategy,
            "test_accuracy": self.test_accuracy, "samples": self.samples,
            "samples_per_s": self.samples_per_s, "train_seconds": self.train_seconds,
            "startup_seconds": self.startup_seconds, "elapsed_seconds": self.elapsed_seconds,
            "steps": self.steps, "shared_step": self.shared_step,
            "loss_curves": [c.tolist() for c in self.loss_curves],
            "accuracy_curve": self.accuracy_curve,
            "node": self.node, "rounds": self.rounds, "allreduce_seconds": self.allreduce_seconds,
            "paused_seconds": self.paused_seconds,
        }


def train(model_factory: Callable[[], torch.nn.Module], data: Dataset, workers: int = 2,
          epochs: int = 10, batch_size: int = 64, lr: float | None = None,
          optimizer: str = "sgd", seed: int = 0, progress: bool = True,
          eval_interval: float = 0.5, timeout: float | None = None, label: str | None = None,
          node: Node | None = None) -> Result:
    """Train ``model_factory()`` on ``data`` (a ``Dataset``) with ``workers`` Hogwild processes.

    ``lr`` defaults to ``DEFAULT_LR[optimizer]``. The parent evaluates the shared model on
    the test set every ``eval_interval`` seconds (0: only at the end) and shows a tqdm bar
    when ``progress``. ``timeout`` (seconds) bounds the whole run: past it the workers are
    stopped and ``TimeoutError`` is raised. ``node`` (a ``sharedmp.distributed.Node``):
    this is one node of several, trained on its shard and averaged with the others (see
    the module doc); ``epochs`` then counts passes over the node's shard. Returns a ``Result``.
    """
    lr = _checked(workers, epochs, batch_size, optimizer, lr)
    order = _order(len(data.y_train), workers, seed, node)
    t_call = time.monotonic()
    torch.manual_seed(seed)
    model = model_factory()
    opt = make_optimizer(optimizer, model.parameters(), lr)
    mp.share_memory_(model)
    mp.share_memory_(opt)                     # adam: moments and step shared (A3C style)
    board = Board.create(workers)
    args = WorkerArgs(model, opt, mp.share(data.X_train), mp.share(data.y_train),
                      mp.share(order), board, workers, epochs, batch_size, seed,
                      node.every if node is not None else 0)
    watch = _Watch(model, data, board, node, t_call, timeout, eval_interval)
    with _Threads(1):                         # the parent must not compete with the workers
        pctx = _start(workers, args)
        try:
            watch.run(pctx, epochs * len(order), label or f"{workers} worker{'s' * (workers > 1)}",
                      progress)
        except BaseException:                 # Ctrl-C, timeout, a worker that failed
            _stop(pctx, board, LATE_GRACE if watch.stuck else STOP_GRACE)
            raise
        finally:
            watch.close_bar()
    train_seconds = float(np.max(board.seconds))
    test_accuracy = watch.accuracy()
    watch.curve.append((train_seconds, test_accuracy))
    step = opt.state[next(model.parameters())].get("step") if optimizer == "adam" else None
    return Result(
        workers=workers, optimizer=optimizer, lr=lr, epochs=epochs, batch_size=batch_size,
        strategy=mp.get_sharing_strategy(), test_accuracy=test_accuracy,
        samples=int(board.samples.sum()), train_seconds=train_seconds,
        startup_seconds=watch.t_go - t_call, elapsed_seconds=time.monotonic() - t_call,
        steps=board.steps.tolist(), loss_curves=[board.loss_curve(i) for i in range(workers)],
        accuracy_curve=watch.curve, worker_checksums=board.checksums.tolist(),
        parent_checksum=checksum(model), shared_step=None if step is None else float(step),
        model=model, node=None if node is None else node.rank, rounds=watch.rounds,
        paused_seconds=board.paused.tolist())


def _checked(workers: int, epochs: int, batch_size: int, optimizer: str,
             lr: float | None) -> float:
    """The learning rate to use; ``ValueError`` naming a bad setting."""
    for name, value in (("workers", workers), ("epochs", epochs), ("batch_size", batch_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, not {value!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    lr = DEFAULT_LR[optimizer] if lr is None else lr
    if not lr > 0:
        raise ValueError(f"lr must be positive, not {lr!r}")
    return lr


def _order(n: int, workers: int, seed: int, node: Node | None) -> NDArray[np.int64]:
    """The samples this node trains on, shuffled; ``ValueError`` if too few for the workers."""
    order: NDArray[np.int64] = np.random.default_rng(seed).permutation(n)
    if node is not None:
        order = order[node.rank::node.world_size]   # the same permutation on every node
    if len(order) < workers:
        where = f"node {node.rank}'s {len(order)}" if node is not None else f"{len(order)}"
        raise ValueError(f"{where} training samples cannot be split among {workers} "
                         "workers; use fewer workers")
    return order


class _Watch:
    """The parent while the workers train: go, evaluate, average, show progress."""

    def __init__(self, model: torch.nn.Module, data: Dataset, board: Board, node: Node | None,
                 t_call: float, timeout: float | None, eval_interval: float) -> None:
        self.model, self.data, self.board, self.node = model, data, board, node
        self.t_call, self.timeout, self.eval_interval = t_call, timeout, eval_interval
        self.t_go = t_call
        self.curve: list[tuple[float, float]] = []     # (seconds since go, test accuracy)
        self.rounds: list[tuple[float, float, int]] = []
        self.bar: Any = None                           # a tqdm bar (or plain lines), or None
        self.stuck = False                             # a worker missed an averaging round

    def accuracy(self) -> float:
        return accuracy(self.model, self.data.X_test, self.data.y_test)

    def run(self, pctx: mp.ProcessContext, total: int, label: str, progress: bool) -> None:
        """Wait for the workers, let them go, watch them until every one has returned."""
        self.bar = progress_bar(total, f"starting {label}", progress)
        _wait_ready(pctx, self.board, self.t_call, self.timeout)
        if self.node is not None:
            self.node.start(self.model)       # rank 0's weights, once every node is ready
        if self.eval_interval > 0:
            self.curve.append((0.0, self.accuracy()))
        if self.bar is not None:
            self.bar.set_description(label, refresh=False)
            self.bar.reset(total)             # the bar's clock and rate start with training
        self.t_go = time.monotonic()
        self.board.go_time = self.t_go
        self.board.go = 1
        self._watch(pctx)
        update(self.bar, self.board, self.curve)

    def _watch(self, pctx: mp.ProcessContext) -> None:
        poll = 0.1 if self.node is None else 0.002     # workers wait for each round: see it soon
        next_eval = self.t_go + self.eval_interval if self.eval_interval > 0 else math.inf
        averaging, next_update = self.node is not None, self.t_go
        self.last_round = self.t_go
        while not pctx.join(poll):
            now = time.monotonic()
            if self.timeout is not None and now - self.t_call > self.timeout:
                raise TimeoutError(f"training did not finish within {self.timeout} s")
            training = self.board.training()
            if averaging and self._round_due():
                averaging = self._average(now, training)
                continue
            if averaging:
                self._check_round_late(now)
            if now >= next_eval and training:
                self.curve.append((now - self.t_go, self.accuracy()))
                next_eval = now + self.eval_interval
            if now >= next_update:
                update(self.bar, self.board, self.curve)
                next_update = now + 0.05
            if not training and self.bar is not None:
                # The final model's accuracy on the bar, not the last evaluation's; closed
                # before the workers' exit, so that its rate is training's.
                update(self.bar, self.board, [*self.curve, (now - self.t_go, self.accuracy())])
                self.close_bar()

    def _round_due(self) -> bool:
        """Every worker waits for the next averaging round, or is done."""
        b = self.board
        return bool(((b.waiting > len(self.rounds)) | (b.status == DONE)).all())

    def _average(self, now: float, training: bool) -> bool:
        """One averaging round with the other nodes; False once every node is done."""
        assert self.node is not None
        averaging = self.node.average(self.model, training)
        self.rounds.append((now - self.t_go, time.monotonic() - now, checksum(self.model)))
        self.board.released = len(self.rounds)
        self.board.final = not averaging
        self.last_round = time.monotonic()
        return averaging

    def _check_round_late(self, now: float) -> None:
        assert self.node is not None
        node, b = self.node, self.board
        if now - self.last_round <= node.timeout:
            return
        # The other nodes give up on this one after as long, in their all_reduce.
        late = np.flatnonzero((b.waiting <= len(self.rounds)) & (b.status != DONE))
        self.stuck = True
        raise TimeoutError(
            f"node {node.rank}: worker(s) {', '.join(map(str, late))} did not reach averaging "
            f"round {len(self.rounds) + 1} within {node.timeout:.0f} s: a step hangs or "
            f"{node.every} steps take longer than that; raise the timeout (--dist-timeout) or "
            "average more often (--sync-every)")

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class _Threads:
    """Set torch's intra-op threads for a block and restore them after."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __enter__(self) -> None:
        self.old = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.old)


def _start(workers: int, args: WorkerArgs) -> mp.ProcessContext:
    """Start the workers with SIGINT ignored, so that they inherit that (see ``worker``)."""
    # A spawned child keeps an ignored SIGINT ignored (CPython installs its KeyboardInterrupt
    # handler only over SIG_DFL), which covers its start-up, before ``worker`` runs.
    def start() -> mp.ProcessContext:
        return mp.start_processes(worker, args=(args,), nprocs=workers, join=False,
                                  start_method="spawn")
    if threading.current_thread() is not threading.main_thread():
        return start()                        # signal.signal works in the main thread only
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return start()
    finally:
        signal.signal(signal.SIGINT, old)


def _wait_ready(pctx: mp.ProcessContext, board: Board, t_call: float,
                timeout: float | None) -> None:
    """Wait until every worker is ready. A worker that fails raises here."""
    limit = STARTUP_TIMEOUT if timeout is None else min(STARTUP_TIMEOUT, timeout)
    while (board.status < READY).any():
        if pctx.join(0.02):
            raise RuntimeError("the workers exited before they were ready")
        if time.monotonic() - t_call > limit:
            raise TimeoutError(f"the workers were not ready within {limit:.0f} s")


def _stop(pctx: mp.ProcessContext, board: Board, grace: float) -> None:
    """Ask the workers to return, wait ``grace`` s, kill what is left (by pid)."""
    board.go = -1 if board.go == 0 else board.go
    board.stop = True
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            if pctx.join(0.1):
                return
        except (mp.ProcessRaisedException, mp.ProcessExitedException):
            return                             # one failed while stopping: the others are ended
    for process in pctx.processes:             # is_alive(): never a reaped pid, reused since
        if process.is_alive():
            process.kill()
    try:
        pctx.join(STOP_GRACE)
    except (mp.ProcessRaisedException, mp.ProcessExitedException):
        pass

"""Hogwild training: worker processes update one model whose parameters live in shared memory.

The parent builds the model and its optimizer, moves both into shared memory with
``mp.share_memory_`` and starts the workers with ``mp.start_processes`` (spawn). Each
worker trains on its own shard of the data and steps the shared parameters without
locks (Hogwild!, Niu et al. 2011); with ``adam`` the moments and step counter are
shared too, as in A3C-style training. Gradients stay private to each worker.

Workers report through a ``Board`` of shared NumPy arrays, one slot per worker and one
writer per slot, so reporting costs them no message and no lock:

    status[i]   STARTING -> READY -> DONE        samples[i]  samples trained so far
    log[i, k]   (seconds since go, samples, mean loss since the previous row)
    waiting[i]  the last averaging round worker i reached (several nodes only; see below)

Workers wait for the parent's "go" after their start-up (spawn, import torch), so that
samples/s measures training, not start-up. The parent stops them through the board
(Ctrl-C, timeout): they return normally, so nothing prints a traceback. A worker that
raises ends the run with ``mp.ProcessRaisedException``, its traceback in the message.

Several nodes (``node=``, a ``sharedmp.distributed.Node``): the parent is its node's
leader. Each worker, after every ``node.every``-th step, records the round it reached in
``waiting`` and waits until the leader releases that round (``control[RESUME]``); once every
worker waits or is done, the leader averages the parameters with the other nodes and
releases the round. So the averaged weights are exactly what every node holds, and a
node's workers are idle only while it averages or waits for slower nodes. Each node trains
on its own shard of the data (by rank); its workers on sub-shards.

This module imports torch; ``import sharedmp`` never imports it.
"""
from __future__ import annotations

import functools
import math
import os
import signal
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import numpy as np
import torch

import sharedmp as mp

if TYPE_CHECKING:
    from numpy.typing import ArrayLike, NDArray

    from sharedmp.distributed import Node
    from sharedmp.processes.spawn import ProcessContext

__all__ = ["DataError", "Dataset", "split", "load_digits", "load_npz", "mlp", "mlp_factory",
           "describe_model", "accuracy", "checksum", "train", "Result", "OPTIMIZERS", "DEFAULT_LR"]

OPTIMIZERS = ("sgd", "adam")
DEFAULT_LR = {"sgd": 0.05, "adam": 0.001}
STARTING, READY, DONE = 0, 1, 2
RESUME, FINAL = 3, 4       # control[]: last averaging round released; 1 once the last is done
LOG_ROWS = 500             # loss rows kept per worker: steps are averaged to fit
STARTUP_TIMEOUT = 120.0    # seconds for every worker to be ready (spawn + import torch)
STOP_GRACE = 10.0          # seconds for stopped workers to return before they are killed


class DataError(ValueError):
    """A data set that cannot be trained on; the message says what is wrong and how to fix it."""


# ------------------------------------------------------------------------------------- data

@dataclass
class Dataset:
    """A classification data set split into train and test, features standardised."""
    name: str
    X_train: NDArray[np.float32]  # float32 (n_train, n_features)
    y_train: NDArray[np.int64]    # int64 class indices in [0, n_classes)
    X_test: NDArray[np.float32]
    y_test: NDArray[np.int64]
    classes: NDArray[Any]  # the original label of each class index

    @property
    def n_features(self) -> int:
        return int(self.X_train.shape[1])

    @property
    def n_classes(self) -> int:
        return len(self.classes)

    def describe(self) -> str:
        return (f"{self.name}: {len(self.y_train)} train / {len(self.y_test)} test samples, "
                f"{self.n_features} features, {self.n_classes} classes")


def split(name: str, X: ArrayLike, y: ArrayLike, test_fraction: float = 0.25, seed: int = 0) -> Dataset:
    """A ``Dataset`` from features ``X`` and labels ``y``: shuffled split, standardised by the train part."""
    if not 0 < test_fraction < 1:
        raise DataError(f"test_fraction must be between 0 and 1, not {test_fraction}")
    classes, y = np.unique(y, return_inverse=True)
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = max(1, round(len(y) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    X = np.asarray(X, dtype=np.float64)
    mean, std = X[train].mean(axis=0), X[train].std(axis=0)
    std[std == 0] = 1.0                       # constant features (digits has some): leave at 0
    X = ((X - mean) / std).astype(np.float32)
    y = y.astype(np.int64)
    return Dataset(name, X[train], y[train], X[test], y[test], classes)  # type: ignore[index, arg-type]  # (arrays by now)


def load_digits(test_fraction: float = 0.25, seed: int = 0) -> Dataset:
    """scikit-learn's bundled 8x8 digits (1,797 images, 10 classes; no download)."""
    from sklearn.datasets import load_digits as sk_load_digits
    X, y = sk_load_digits(return_X_y=True)
    return split("digits (scikit-learn, 8x8 images)", X, y, test_fraction, seed)


def load_npz(path: str | os.PathLike[str], test_fraction: float = 0.25, seed: int = 0) -> Dataset:
    """A user's data set: an ``.npz`` file with arrays ``X`` (samples x features) and ``y`` (labels)."""
    how = "save it with np.savez(FILE, X=features, y=labels)"
    try:
        archive = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except OSError as e:                      # a directory, no permission, ...
        raise DataError(f"{path}: cannot read it ({e.strerror or e})") from None
    except Exception as e:                    # not npy/npz (ValueError, EOFError, BadZipFile, ...)
        raise DataError(f"{path}: not a NumPy .npz file of plain arrays "
                        f"({type(e).__name__}: {e}); {how}") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise DataError(f"{path}: holds a single array, not arrays named X and y; {how}")
    with archive:
        missing = [k for k in ("X", "y") if k not in archive.files]
        if missing:
            raise DataError(f"{path}: no array named {' or '.join(missing)} "
                            f"(it has: {', '.join(archive.files) or 'nothing'}); {how}")
        try:
            X, y = archive["X"], archive["y"]
        except ValueError as e:               # object arrays: allow_pickle=False
            raise DataError(f"{path}: X and y must be plain numeric arrays ({e}); {how}") from None
        except Exception as e:                # a corrupt member (zipfile.BadZipFile, EOFError, ...)
            raise DataError(f"{path}: cannot read X and y ({type(e).__name__}: {e})") from None
    if X.ndim != 2 or X.shape[0] == 0 or X.shape[1] == 0:
        raise DataError(f"{path}: X must be 2-D, samples x features, with at least one of each; "
                        f"it has shape {X.shape}")
    if X.dtype.kind not in "biuf":
        raise DataError(f"{path}: X must be numeric (int, float or bool), not {X.dtype}")
    if not np.isfinite(X).all():
        raise DataError(f"{path}: X holds NaN or infinite values; remove or impute them")
    if y.ndim != 1:
        raise DataError(f"{path}: y must be 1-D, one label per sample; it has shape {y.shape}")
    if len(y) != len(X):
        raise DataError(f"{path}: X has {len(X)} samples but y has {len(y)} labels; "
                        "they must have the same length")
    if y.dtype.kind == "f" and not (np.isfinite(y).all() and (y == np.round(y)).all()):
        raise DataError(f"{path}: y must hold class labels (integers or strings), "
                        "not continuous values: the demo trains a classifier")
    if y.dtype.kind not in "biufUS":
        raise DataError(f"{path}: y must hold class labels (integers or strings), not {y.dtype}")
    n_classes = len(np.unique(y))
    if n_classes < 2:
        raise DataError(f"{path}: y has a single class; a classifier needs at least two")
    if len(y) < 4:
        raise DataError(f"{path}: {len(y)} samples are too few to split into train and test")
    return split(os.path.basename(path), X, y, test_fraction, seed)


# ------------------------------------------------------------------------------------ model

def mlp(n_in: int, n_out: int, hidden: Sequence[int] = (1024, 1024)) -> torch.nn.Sequential:
    """A multi-layer perceptron: Linear + ReLU per hidden width, then a Linear to ``n_out``."""
    layers, width = [], n_in
    for h in hidden:
        layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
        width = h
    layers.append(torch.nn.Linear(width, n_out))
    return torch.nn.Sequential(*layers)


def mlp_factory(data: Dataset, hidden: Sequence[int] = (1024, 1024)) -> Callable[[], torch.nn.Sequential]:
    """A picklable model factory for ``train``: an MLP sized for ``data``."""
    return functools.partial(mlp, data.n_features, data.n_classes, tuple(hidden))


def describe_model(model: torch.nn.Module) -> str:
    """'MLP 64-1024-1024-10 (1,126,410 parameters)' for an ``mlp``, else the class and size."""
    n = sum(p.numel() for p in model.parameters())
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if isinstance(model, torch.nn.Sequential) and linears:
        widths = [linears[0].in_features] + [m.out_features for m in linears]
        return f"MLP {'-'.join(map(str, widths))} ({n:,} parameters)"
    return f"{type(model).__name__} ({n:,} parameters)"


def accuracy(model: torch.nn.Module, X: NDArray[np.float32], y: NDArray[np.int64]) -> float:
    """The fraction of samples of ``X`` whose predicted class is ``y``."""
    with torch.no_grad():
        predicted = model(torch.from_numpy(X)).argmax(dim=1).numpy()
    return float((predicted == y).mean())


def checksum(model: torch.nn.Module) -> int:
    """A CRC of the bytes of every parameter: equal checksums mean identical weights."""
    crc = 0
    for p in model.parameters():
        crc = zlib.crc32(p.detach().numpy().tobytes(), crc)
    return crc


def make_optimizer(name: str, params: Iterable[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")


# ------------------------------------------------------------------------ shared reporting

@dataclass
class Board:
    """What workers and parent share besides the model: shared NumPy arrays (see the module doc)."""
    status: NDArray[np.int64]     # int64 (workers,)
    samples: NDArray[np.int64]    # int64 (workers,)
    steps: NDArray[np.int64]      # int64 (workers,)
    seconds: NDArray[np.float64]  # float64 (workers,): when each finished, seconds since go
    log: NDArray[np.float64]      # float64 (workers, LOG_ROWS, 3)
    rows: NDArray[np.int64]       # int64 (workers,): rows of log written
    checksums: NDArray[np.int64]  # int64 (workers,): each worker's view of the final weights
    control: NDArray[np.float64]  # float64 (5,): go (1 go, -1 stop before start), stop, go time,
                              # RESUME, FINAL (several nodes)
    waiting: NDArray[np.int64]   # int64 (workers,): the averaging round each worker last reached
    paused: NDArray[np.float64]  # float64 (workers,): seconds each worker waited for averaging

    @classmethod
    def create(cls, workers: int) -> Board:
        return cls(mp.zeros(workers, np.int64), mp.zeros(workers, np.int64),
                   mp.zeros(workers, np.int64), mp.zeros(workers), mp.zeros((workers, LOG_ROWS, 3)),
                   mp.zeros(workers, np.int64), mp.zeros(workers, np.int64), mp.zeros(5),
                   mp.zeros(workers, np.int64), mp.zeros(workers))

    def loss_curve(self, i: int) -> NDArray[np.float64]:
        """Worker i's (seconds, samples, loss) rows."""
        rows: NDArray[np.float64] = self.log[i, :self.rows[i]].copy()
        return rows


@dataclass
class WorkerArgs:
    """Everything a worker gets: the shared model, optimizer, data, board and settings."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    X: NDArray[np.float32]    # shared float32 train features
    y: NDArray[np.int64]      # shared int64 train labels
    order: NDArray[np.int64]  # shared permutation; worker i trains on order[i::workers]
    board: Board
    workers: int
    epochs: int
    batch_size: int
    seed: int
    every: int = 0            # several nodes: wait for averaging after every `every` steps


def worker(rank: int, a: WorkerArgs) -> None:
    """One Hogwild worker: train the shared model on shard ``rank``, reporting on the board."""
    # The parent owns Ctrl-C and stops workers through the board, so that a Ctrl-C at the
    # terminal (which reaches the whole process group) prints no traceback per worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)                 # one core per worker: N workers on N cores
    board, control = a.board, a.board.control
    X, y = torch.from_numpy(a.X), torch.from_numpy(a.y)
    shard = a.order[rank::a.workers]
    steps_per_epoch = math.ceil(len(shard) / a.batch_size)
    every = max(1, math.ceil(a.epochs * steps_per_epoch / LOG_ROWS))   # steps per log row
    loss_fn = torch.nn.CrossEntropyLoss()
    rng = np.random.default_rng([a.seed, rank])
    # The first zero_grad() imports torch._dynamo (~1 s): a start-up cost, paid before "ready".
    a.optimizer.zero_grad()
    board.status[rank] = READY
    while control[0] == 0:
        time.sleep(0.001)
    if control[0] < 0:
        return
    go = control[2]
    samples = steps = 0
    loss_sum = 0.0
    for _ in range(a.epochs):
        batches = shard[rng.permutation(len(shard))]
        for start in range(0, len(batches), a.batch_size):
            if control[1]:
                return
            index = torch.from_numpy(batches[start:start + a.batch_size])
            a.optimizer.zero_grad()
            loss = loss_fn(a.model(X[index]), y[index])
            loss.backward()
            a.optimizer.step()                # writes the shared weights, no lock: Hogwild
            samples += len(index)
            steps += 1
            loss_sum += loss.item()
            board.samples[rank], board.steps[rank] = samples, steps
            if steps % every == 0 and board.rows[rank] < LOG_ROWS:
                board.log[rank, board.rows[rank]] = (time.monotonic() - go, samples, loss_sum / every)
                board.rows[rank] += 1
                loss_sum = 0.0
            if a.every and steps % a.every == 0:
                _wait_for_round(board, rank, steps // a.every)
    board.seconds[rank] = time.monotonic() - go
    board.status[rank] = DONE
    # Once every worker is done (and with several nodes, the last averaging round), record
    # the weights this worker sees: with shared parameters all workers and the parent see
    # the same ones.
    while ((board.status != DONE).any() or (a.every and not control[FINAL])) and not control[1]:
        time.sleep(0.001)
    board.checksums[rank] = checksum(a.model)


def _wait_for_round(board: Board, rank: int, n: int) -> None:
    """(in a worker) Wait until the leader has averaged round ``n`` (or stops the run)."""
    t0 = time.monotonic()
    board.waiting[rank] = n
    while board.control[RESUME] < n and not board.control[1]:
        time.sleep(0.0005)
    board.paused[rank] += time.monotonic() - t0


# --------------------------------------------------------------------------------- trainer

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
    loss_curves: list[NDArray[np.float64]]      # per worker: array of (seconds, samples, mean loss) rows
    accuracy_curve: list[tuple[float, float]]   # (seconds since go, test accuracy) seen by the parent
    worker_checksums: list[int]    # each worker's checksum of the final weights
    parent_checksum: int      # the parent's checksum of the same weights
    shared_step: float | None  # adam: the shared step counter after training
    model: torch.nn.Module | None = field(repr=False, default=None)
    node: int | None = None   # several nodes: this node's rank
    rounds: list[tuple[float, float, int]] = field(default_factory=list)   # per averaging round: (seconds since go,
                                                  # all-reduce seconds, checksum after it)
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


class _Threads:
    """Set torch's intra-op threads for a block and restore them after."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __enter__(self) -> None:
        self.old = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.old)


def _start(workers: int, args: WorkerArgs) -> ProcessContext:
    """Start the workers with SIGINT ignored, so that they inherit that (see ``worker``)."""
    # A spawned child keeps an ignored SIGINT ignored (CPython installs its KeyboardInterrupt
    # handler only over SIG_DFL), which covers its start-up, before ``worker`` runs.
    def start() -> ProcessContext:
        return mp.start_processes(worker, args=(args,), nprocs=workers, join=False,
                                  start_method="spawn")
    if threading.current_thread() is not threading.main_thread():
        return start()                        # signal.signal works in the main thread only
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return start()
    finally:
        signal.signal(signal.SIGINT, old)


def _stop(pctx: ProcessContext, board: Board) -> None:
    """Ask the workers to return, wait a little, kill what is left (by pid)."""
    board.control[0] = -1 if board.control[0] == 0 else board.control[0]
    board.control[1] = 1
    deadline = time.monotonic() + STOP_GRACE
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


def train(model_factory: Callable[[], torch.nn.Module], data: Dataset, workers: int = 2, epochs: int = 10,
          batch_size: int = 64, lr: float | None = None, optimizer: str = "sgd", seed: int = 0,
          progress: bool = True, eval_interval: float = 0.5, timeout: float | None = None,
          label: str | None = None, node: Node | None = None) -> Result:
    """Train ``model_factory()`` on ``data`` (a ``Dataset``) with ``workers`` Hogwild processes.

    ``lr`` defaults to ``DEFAULT_LR[optimizer]``. The parent evaluates the shared model on
    the test set every ``eval_interval`` seconds (0: only at the end) and shows a tqdm bar
    when ``progress``. ``timeout`` (seconds) bounds the whole run: past it the workers are
    stopped and ``TimeoutError`` is raised. ``node`` (a ``sharedmp.distributed.Node``):
    this is one node of several, trained on its shard and averaged with the others (see
    the module doc); ``epochs`` then counts passes over the node's shard. Returns a ``Result``.
    """
    for name, value in (("workers", workers), ("epochs", epochs), ("batch_size", batch_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, not {value!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    lr = DEFAULT_LR[optimizer] if lr is None else lr
    if not lr > 0:
        raise ValueError(f"lr must be positive, not {lr!r}")
    order = np.random.default_rng(seed).permutation(len(data.y_train))
    if node is not None:
        order = order[node.rank::node.world_size]   # the same permutation on every node
    if len(order) < workers:
        where = f"node {node.rank}'s {len(order)}" if node is not None else f"{len(order)}"
        raise ValueError(f"{where} training samples cannot be split among {workers} "
                         "workers; use fewer workers")
    t_call = time.monotonic()
    torch.manual_seed(seed)
    model = model_factory()
    opt = make_optimizer(optimizer, model.parameters(), lr)
    mp.share_memory_(model)
    mp.share_memory_(opt)                     # adam: moments and step shared (A3C style)
    board = Board.create(workers)
    args = WorkerArgs(model, opt, mp.share(data.X_train), mp.share(data.y_train), mp.share(order),
                      board, workers, epochs, batch_size, seed, node.every if node is not None else 0)
    total = epochs * len(order)
    curve: list[tuple[float, float]]
    bar: Any                                  # a tqdm bar, or None
    rounds: list[tuple[float, float, int]]
    curve, bar, rounds = [], None, []
    poll = 0.1 if node is None else 0.002     # workers wait for each round: notice it soon
    with _Threads(1):                         # the parent must not compete with the workers
        pctx = _start(workers, args)
        try:
            label = label or f"{workers} worker{'s' * (workers > 1)}"
            bar = _progress_bar(total, f"starting {label}", progress)
            _wait_ready(pctx, board, t_call, timeout)
            if node is not None:
                node.start(model)             # rank 0's weights, once every node is ready
            if eval_interval > 0:
                curve.append((0.0, accuracy(model, data.X_test, data.y_test)))
            if bar is not None:
                bar.set_description(label, refresh=False)
                bar.reset(total)              # the bar's clock and rate start with training
            t_go = time.monotonic()
            board.control[2] = t_go
            board.control[0] = 1
            next_eval = t_go + eval_interval if eval_interval > 0 else math.inf
            averaging, next_update, last_round = node is not None, t_go, t_go
            while not pctx.join(poll):
                now = time.monotonic()
                if timeout is not None and now - t_call > timeout:
                    raise TimeoutError(f"training did not finish within {timeout} s")
                training = (board.status != DONE).any()
                if averaging and node is not None and ((board.waiting > len(rounds)) | (board.status == DONE)).all():
                    averaging = node.average(model, training)   # False: every node is done
                    rounds.append((now - t_go, time.monotonic() - now, checksum(model)))
                    board.control[RESUME] = len(rounds)
                    board.control[FINAL] = not averaging
                    last_round = time.monotonic()
                    continue
                if averaging and node is not None and now - last_round > node.timeout:
                    # The other nodes give up on this one after as long, in their all_reduce.
                    late = np.flatnonzero((board.waiting <= len(rounds)) & (board.status != DONE))
                    raise TimeoutError(
                        f"node {node.rank}: worker(s) {', '.join(map(str, late))} did not reach "
                        f"averaging round {len(rounds) + 1} within {node.timeout:.0f} s: a step hangs "
                        f"or {node.every} steps take longer than that; raise the timeout (--dist-timeout) "
                        "or average more often (--sync-every)")
                if now >= next_eval and training:
                    curve.append((now - t_go, accuracy(model, data.X_test, data.y_test)))
                    next_eval = now + eval_interval
                if now >= next_update:
                    _update(bar, board, curve)
                    next_update = now + 0.05
                if not training and bar is not None:
                    # The final model's accuracy on the bar, not the last evaluation's; closed
                    # before the workers' exit, so that its rate is training's.
                    _update(bar, board, [*curve, (now - t_go, accuracy(model, data.X_test, data.y_test))])
                    bar.close()
                    bar = None
            _update(bar, board, curve)
        except BaseException:                 # Ctrl-C, timeout, a worker that failed
            _stop(pctx, board)
            raise
        finally:
            if bar is not None:
                bar.close()
    train_seconds = float(board.seconds.max())
    test_accuracy = accuracy(model, data.X_test, data.y_test)
    curve.append((train_seconds, test_accuracy))
    step = opt.state[next(model.parameters())].get("step") if optimizer == "adam" else None
    return Result(
        workers=workers, optimizer=optimizer, lr=lr, epochs=epochs, batch_size=batch_size,
        strategy=mp.get_sharing_strategy(), test_accuracy=test_accuracy,
        samples=int(board.samples.sum()), train_seconds=train_seconds,
        startup_seconds=t_go - t_call, elapsed_seconds=time.monotonic() - t_call,
        steps=board.steps.tolist(), loss_curves=[board.loss_curve(i) for i in range(workers)],
        accuracy_curve=curve, worker_checksums=board.checksums.tolist(),
        parent_checksum=checksum(model), shared_step=None if step is None else float(step),
        model=model, node=None if node is None else node.rank, rounds=rounds,
        paused_seconds=board.paused.tolist())


def _wait_ready(pctx: ProcessContext, board: Board, t_call: float, timeout: float | None) -> None:
    """Wait until every worker is ready. A worker that fails raises here."""
    limit = STARTUP_TIMEOUT if timeout is None else min(STARTUP_TIMEOUT, timeout)
    while (board.status < READY).any():
        if pctx.join(0.02):
            raise RuntimeError("the workers exited before they were ready")
        if time.monotonic() - t_call > limit:
            raise TimeoutError(f"the workers were not ready within {limit:.0f} s")


def _progress_bar(total: int, label: str, enabled: bool) -> Any:   # a tqdm bar, _Lines, or None
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:               # tqdm is the demo extra's; plain lines do without it
        return _Lines(total, label)
    return tqdm(total=total, desc=label, unit="sample", unit_scale=True, leave=True,
                dynamic_ncols=True, disable=None)


class _Lines:
    """What ``train`` uses of a tqdm bar, as a line on stderr every few seconds and at the end."""

    EVERY = 2.0

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.n = total, label, 0
        self.postfix: dict[str, str] = {}
        self._t0 = self._last = time.monotonic()

    def set_description(self, label: str, refresh: bool = True) -> None:
        self.label = label

    def reset(self, total: int) -> None:
        self.total, self.n = total, 0
        self._t0 = self._last = time.monotonic()

    def update(self, n: int) -> None:
        self.n += n

    def set_postfix(self, postfix: dict[str, str], refresh: bool = True) -> None:
        self.postfix = postfix
        if time.monotonic() - self._last >= self.EVERY:
            self._print()

    def close(self) -> None:
        self._print()

    def _print(self) -> None:
        self._last = now = time.monotonic()
        rate = self.n / max(now - self._t0, 1e-9)
        extra = "".join(f", {k} {v}" for k, v in self.postfix.items())
        print(f"{self.label}: {self.n:,}/{self.total:,} samples ({self.n / max(self.total, 1):.0%}), "
              f"{rate:,.0f} samples/s{extra}", file=sys.stderr, flush=True)


def _update(bar: Any, board: Board, curve: list[tuple[float, float]]) -> None:
    if bar is None:
        return
    bar.update(int(board.samples.sum()) - bar.n)
    postfix = {}
    rows = board.rows
    losses = [board.log[i, rows[i] - 1, 2] for i in range(len(rows)) if rows[i] > 0]
    if losses:
        postfix["loss"] = f"{np.mean(losses):.3f}"
    if curve:
        postfix["test acc"] = f"{curve[-1][1]:.1%}"
    bar.set_postfix(postfix, refresh=False)

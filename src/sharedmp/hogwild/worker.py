"""One Hogwild worker: it trains the shared model on its shard, without locks.

The worker steps the shared parameters (and, with Adam, the shared moments) in place:
Hogwild! (Niu et al. 2011). Gradients stay private. It reports on the board, waits for the
parent's "go" after its start-up (so that samples/s measures training, not spawn and
``import torch``), and returns when the board says stop, so that nothing prints a
traceback. With several nodes it waits on the board after every ``every``-th step until
the leader has averaged that round.
"""
from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from .board import DONE, LOG_ROWS, READY, Board
from .model import checksum

if TYPE_CHECKING:
    from numpy.typing import NDArray


@dataclass
class WorkerArgs:
    """Everything a worker gets: the shared model, optimizer, data, board and settings."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    X: NDArray[np.float32]    # shared train features
    y: NDArray[np.int64]      # shared train labels
    order: NDArray[np.int64]  # shared permutation; worker i trains on order[i::workers]
    board: Board
    workers: int
    epochs: int
    batch_size: int
    seed: int
    every: int = 0            # several nodes: wait for averaging after every `every` steps


def worker(rank: int, a: WorkerArgs) -> None:
    """Train the shared model on shard ``rank``, reporting on the board."""
    # The parent owns Ctrl-C and stops workers through the board, so that a Ctrl-C at the
    # terminal (which reaches the whole process group) prints no traceback per worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)                 # one core per worker: N workers on N cores
    board = a.board
    # The first zero_grad() imports torch._dynamo (~1 s): a start-up cost, paid before "ready".
    a.optimizer.zero_grad()
    board.status[rank] = READY
    while board.go == 0:
        time.sleep(0.001)
    if board.go < 0 or not _train_shard(rank, a):
        return
    board.seconds[rank] = time.monotonic() - board.go_time
    board.status[rank] = DONE
    # Once every worker is done (and with several nodes, the last averaging round), record
    # the weights this worker sees: with shared parameters all workers and the parent see
    # the same ones.
    while (board.training() or (a.every and not board.final)) and not board.stop:
        time.sleep(0.001)
    board.checksums[rank] = checksum(a.model)


def _train_shard(rank: int, a: WorkerArgs) -> bool:
    """The epochs over this worker's shard; False if the parent stopped the run."""
    board, go = a.board, a.board.go_time
    X, y = torch.from_numpy(a.X), torch.from_numpy(a.y)
    shard = a.order[rank::a.workers]
    steps_per_epoch = math.ceil(len(shard) / a.batch_size)
    every = max(1, math.ceil(a.epochs * steps_per_epoch / LOG_ROWS))   # steps per log row
    loss_fn = torch.nn.CrossEntropyLoss()
    rng = np.random.default_rng([a.seed, rank])
    samples = steps = 0
    loss_sum = 0.0
    for _ in range(a.epochs):
        batches = shard[rng.permutation(len(shard))]
        for start in range(0, len(batches), a.batch_size):
            if board.stop:
                return False
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
                board.log[rank, board.rows[rank]] = (time.monotonic() - go, samples,
                                                     loss_sum / every)
                board.rows[rank] += 1
                loss_sum = 0.0
            if a.every and steps % a.every == 0:
                _wait_for_round(board, rank, steps // a.every)
    return True


def _wait_for_round(board: Board, rank: int, n: int) -> None:
    """Wait until the leader has averaged round ``n`` (or stops the run)."""
    t0 = time.monotonic()
    board.waiting[rank] = n
    while board.released < n and not board.stop:
        time.sleep(0.0005)
    board.paused[rank] += time.monotonic() - t0

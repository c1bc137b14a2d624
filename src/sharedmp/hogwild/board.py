"""The board: what the workers and the parent share besides the model.

Shared NumPy arrays, one slot per worker and one writer per slot, so reporting costs a
worker no message and no lock:

    status[i]   STARTING -> READY -> DONE        samples[i]  samples trained so far
    log[i, k]   (seconds since go, samples, mean loss since the previous row)
    waiting[i]  the last averaging round worker i reached (several nodes only)

and the parent's control slots, read by every worker: ``go`` (0 wait, 1 go, -1 stopped
before the start), ``stop``, ``go_time``, ``released`` (the last averaging round the
leader released) and ``final`` (the last round is done).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Generic, TypeVar

import numpy as np

import sharedmp as mp

if TYPE_CHECKING:
    from numpy.typing import NDArray

STARTING, READY, DONE = 0, 1, 2
LOG_ROWS = 500             # loss rows kept per worker: steps are averaged to fit
_T = TypeVar("_T", bound=float)     # float, int or bool


class _Slot(Generic[_T]):
    """A named slot of ``Board.control``, read and written as a plain value."""

    def __init__(self, index: int, kind: Callable[[float], _T]) -> None:
        self.index = index
        self.kind: Callable[[float], _T] = kind

    def __get__(self, board: Board, owner: object = None) -> _T:
        return self.kind(float(board.control[self.index]))

    def __set__(self, board: Board, value: _T) -> None:
        board.control[self.index] = value


@dataclass
class Board:
    """The shared arrays of one run (see the module doc)."""
    status: NDArray[np.int64]     # (workers,)
    samples: NDArray[np.int64]    # (workers,)
    steps: NDArray[np.int64]      # (workers,)
    seconds: NDArray[np.float64]  # (workers,): when each finished, seconds since go
    log: NDArray[np.float64]      # (workers, LOG_ROWS, 3)
    rows: NDArray[np.int64]       # (workers,): rows of log written
    checksums: NDArray[np.int64]  # (workers,): each worker's view of the final weights
    waiting: NDArray[np.int64]    # (workers,): the averaging round each worker last reached
    paused: NDArray[np.float64]   # (workers,): seconds each worker waited for averaging
    control: NDArray[np.float64]  # (5,): the named slots below

    @classmethod
    def create(cls, workers: int) -> Board:
        def ints() -> NDArray[np.int64]:
            return mp.zeros(workers, np.int64)

        def floats(*shape: int) -> NDArray[np.float64]:
            return mp.zeros((workers, *shape))

        return cls(status=ints(), samples=ints(), steps=ints(), seconds=floats(),
                   log=floats(LOG_ROWS, 3), rows=ints(), checksums=ints(), waiting=ints(),
                   paused=floats(), control=mp.zeros(5))

    def loss_curve(self, i: int) -> NDArray[np.float64]:
        """Worker i's (seconds, samples, loss) rows."""
        rows: NDArray[np.float64] = self.log[i, :self.rows[i]].copy()
        return rows

    def training(self) -> bool:
        """Some worker has not finished its shard."""
        return bool((self.status != DONE).any())

    go = _Slot(0, float)          # 0 wait, 1 go, -1 stopped before the start
    stop = _Slot(1, bool)
    go_time = _Slot(2, float)     # time.monotonic() of the go
    released = _Slot(3, int)      # the last averaging round the leader released
    final = _Slot(4, bool)        # the last averaging round is done

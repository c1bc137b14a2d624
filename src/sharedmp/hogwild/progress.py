"""The parent's progress display: a tqdm bar fed by the board's shared counters or, without
tqdm (the demo extra's) or a terminal, a plain line on stderr every few seconds."""
from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np

from .board import Board


def progress_bar(total: int, label: str, enabled: bool) -> Any:
    """A tqdm bar, plain lines without tqdm, or None when not ``enabled``."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:               # tqdm is the demo extra's; plain lines do without it
        tqdm = None
    if tqdm is None or not sys.stderr.isatty():   # a log or a pipe: lines it can follow
        return _Lines(total, label)
    return tqdm(total=total, desc=label, unit="sample", unit_scale=True, leave=True,
                dynamic_ncols=True)


class _Lines:
    """What ``train`` uses of a tqdm bar, as a line on stderr every few seconds and at the end."""

    EVERY = 2.0

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.n = total, label, 0
        self.postfix: dict[str, str] = {}
        self._t0 = self._last = self._t_n = time.monotonic()

    def set_description(self, label: str, refresh: bool = True) -> None:
        self.label = label

    def reset(self, total: int) -> None:
        self.total, self.n = total, 0
        self._t0 = self._last = self._t_n = time.monotonic()

    def update(self, n: int) -> None:
        if n:
            self.n += n
            self._t_n = time.monotonic()   # the rate is up to the last sample seen, not to
                                           # the final evaluation that follows it

    def set_postfix(self, postfix: dict[str, str], refresh: bool = True) -> None:
        self.postfix = postfix
        if time.monotonic() - self._last >= self.EVERY:
            self._print()

    def close(self) -> None:
        self._print()

    def _print(self) -> None:
        self._last = time.monotonic()
        rate = self.n / max(self._t_n - self._t0, 1e-9)
        extra = "".join(f", {k} {v}" for k, v in self.postfix.items())
        done = self.n / max(self.total, 1)
        print(f"{self.label}: {self.n:,}/{self.total:,} samples ({done:.0%}), "
              f"{rate:,.0f} samples/s{extra}", file=sys.stderr, flush=True)


def update(bar: Any, board: Board, curve: list[tuple[float, float]]) -> None:
    """Show the board's counters, the latest loss and the latest test accuracy on ``bar``."""
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

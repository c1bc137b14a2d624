"""The model side of the trainer: the MLP, its optimizer, and what is measured of it."""
from __future__ import annotations

import functools
import zlib
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import numpy as np
import torch

if TYPE_CHECKING:
    from numpy.typing import NDArray

    from .data import Dataset

__all__ = ["OPTIMIZERS", "DEFAULT_LR", "mlp", "mlp_factory", "describe_model", "accuracy",
           "checksum", "make_optimizer"]

OPTIMIZERS = ("sgd", "adam")
DEFAULT_LR = {"sgd": 0.05, "adam": 0.001}

def mlp(n_in: int, n_out: int, hidden: Sequence[int] = (1024, 1024)) -> torch.nn.Sequential:
    """A multi-layer perceptron: Linear + ReLU per hidden width, then a Linear to ``n_out``."""
    layers, width = [], n_in
    for h in hidden:
        layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
        width = h
    layers.append(torch.nn.Linear(width, n_out))
    return torch.nn.Sequential(*layers)


def mlp_factory(data: Dataset,
                hidden: Sequence[int] = (1024, 1024)) -> Callable[[], torch.nn.Sequential]:
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



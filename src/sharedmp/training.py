"""Hogwild training: worker processes update one model whose parameters live in shared memory.

The public names of the trainer in ``sharedmp.hogwild`` (see ``docs/reference.md``). The
parent moves the model and its optimizer into shared memory and starts the workers (spawn);
each trains on its own shard and steps the shared parameters without locks; with ``adam``
the moments and step counter are shared too. Workers report through shared arrays, so
reporting costs no message and no lock. ``node=`` (a ``sharedmp.distributed.Node``) makes
this one node of several, averaged with the others.

This module imports torch; ``import sharedmp`` never imports it.
"""
from .hogwild.data import DataError, Dataset, load_digits, load_npz, split
from .hogwild.model import (DEFAULT_LR, OPTIMIZERS, accuracy, checksum, describe_model, mlp,
                            mlp_factory)
from .hogwild.trainer import Result, train

__all__ = ["DataError", "Dataset", "split", "load_digits", "load_npz", "mlp", "mlp_factory",
           "describe_model", "accuracy", "checksum", "train", "Result", "OPTIMIZERS", "DEFAULT_LR"]

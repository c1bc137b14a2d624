"""The data sets the trainer learns from: a classification set split into train and test.

``load_digits`` is scikit-learn's bundled digits (no download); ``load_npz`` reads a user's
``.npz`` file and checks it, so that a wrong file ends in a ``DataError`` that says what to
fix, not in a traceback from inside a worker.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from numpy.typing import ArrayLike, NDArray

__all__ = ["DataError", "Dataset", "split", "load_digits", "load_npz"]

class DataError(ValueError):
    """A data set that cannot be trained on; the message says what is wrong and how to fix it."""


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


def split(name: str, X: ArrayLike, y: ArrayLike, test_fraction: float = 0.25,
          seed: int = 0) -> Dataset:
    """A ``Dataset`` from features ``X`` and labels ``y``: a shuffled split, standardised
    by the train part."""
    if not 0 < test_fraction < 1:
        raise DataError(f"test_fraction must be between 0 and 1, not {test_fraction}")
    classes, codes = np.unique(np.asarray(y), return_inverse=True)
    order = np.random.default_rng(seed).permutation(len(codes))
    n_test = max(1, round(len(codes) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    features = np.asarray(X, dtype=np.float64)
    mean, std = features[train].mean(axis=0), features[train].std(axis=0)
    std[std == 0] = 1.0                       # constant features (digits has some): leave at 0
    scaled = ((features - mean) / std).astype(np.float32)
    labels = codes.astype(np.int64)
    return Dataset(name, scaled[train], labels[train], scaled[test], labels[test], classes)


def load_digits(test_fraction: float = 0.25, seed: int = 0) -> Dataset:
    """scikit-learn's bundled 8x8 digits (1,797 images, 10 classes; no download)."""
    from sklearn.datasets import load_digits as sk_load_digits
    X, y = sk_load_digits(return_X_y=True)
    return split("digits (scikit-learn, 8x8 images)", X, y, test_fraction, seed)


def load_npz(path: str | os.PathLike[str], test_fraction: float = 0.25,
             seed: int = 0) -> Dataset:
    """A user's data set: an ``.npz`` file with arrays ``X`` (samples x features) and ``y``
    (labels)."""
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
            raise DataError(f"{path}: X and y must be plain numeric arrays ({e}); "
                            f"{how}") from None
        except Exception as e:                # a corrupt member (BadZipFile, EOFError, ...)
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
        raise DataError(f"{path}: y must hold class labels (integers or strings), "
                        f"not {y.dtype}")
    n_classes = len(np.unique(y))
    if n_classes < 2:
        raise DataError(f"{path}: y has a single class; a classifier needs at least two")
    if len(y) < 4:
        raise DataError(f"{path}: {len(y)} samples are too few to split into train and test")
    return split(os.path.basename(path), X, y, test_fraction, seed)



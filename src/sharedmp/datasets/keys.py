"""The key index of a ``SharedDict``: a hash of each key that is the same in every process,
and the sorted table a lookup searches.

Python's ``hash`` of str and bytes differs between processes (PYTHONHASHSEED), so a key's
hash is sharedmp's own (``key_hash``): CRC-32 of str and bytes, ``hash`` of numbers (the
same in every process, and equal for equal numbers), combined for tuples and frozensets;
any other key is hashed by its pickle. The hashes, mixed (Fibonacci hashing), are sorted with
the row of each; a directory by their top k bits (2**k >= n/2) gives the few entries to look
at. A lookup unpickles only the keys whose hash matches.
"""
from __future__ import annotations

import numbers
import operator
import pickle
import sys
import zlib
from array import array
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from numpy.typing import NDArray

_M64 = (1 << 64) - 1
_NONE_HASH = 0x5F3759DF


def key_hash(key: Any) -> int:
    """A hash of ``key`` that is the same in every process, and equal for equal keys."""
    t = type(key)
    if t is str:
        return zlib.crc32(key.encode("utf-8", "surrogatepass"))
    if t is int or t is bool:
        return hash(key) & _M64
    if t is float:
        return hash(key) & _M64 if key == key else 0
    if t is tuple:
        h = 0x345678
        for item in key:
            h = ((h ^ key_hash(item)) * 1000003) & _M64
        return h ^ len(key)
    return _other_hash(key)


def _other_hash(key: Any) -> int:
    if key is None:                     # (hash(None) is its address before Python 3.12)
        return _NONE_HASH
    if isinstance(key, str):
        return zlib.crc32(str(key).encode("utf-8", "surrogatepass"))
    if isinstance(key, bytes):
        return zlib.crc32(key)
    if isinstance(key, tuple):
        return key_hash(tuple(key))
    if isinstance(key, frozenset):
        h = 0x2C1B3C6D
        for item in key:               # (xor: the same whatever order the set iterates in)
            h ^= mix(key_hash(item))
        return h
    if isinstance(key, (numbers.Number, np.bool_)):
        # Python hashes numbers by value, alike in every process and for equal numbers of
        # any type (1, 1.0, Fraction(1), numpy.int8(1)), but NaN by identity: nothing equals it.
        return hash(key) & _M64 if key == key else 0
    hash(key)                           # unhashable: TypeError, as a dict says
    if hasattr(type(key), "__index__"):     # other integers
        return hash(operator.index(key)) & _M64
    pathlib = sys.modules.get("pathlib")    # (a path key: pathlib is imported)
    if pathlib is not None and isinstance(key, pathlib.PurePath):
        # By its text, as Python hashes it (case-folded for Windows paths, where equality
        # ignores case): from 3.13 equal paths pickle as they were built, Path("/a/b") as
        # ("/a/b",), Path("/a") / "b" as ("/a", "b").
        return zlib.crc32(str(key).lower().encode("utf-8", "surrogatepass"))
    return zlib.crc32(pickle.dumps(key, 5))   # other keys: by their pickle


# Fibonacci hashing: a key's place is the top bits of its hash times 2**64 / golden ratio,
# which spreads keys that differ in any bit (consecutive ints too) over the directory. A
# bijection: two places' products are equal only if their hashes are.
_GOLDEN = 0x9E3779B97F4A7C15


def mix(h: int) -> int:
    return (h * _GOLDEN) & _M64


def _mix_all(h: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """``mix`` of every element (NumPy's uint64 arithmetic wraps, as ``& _M64`` does)."""
    out: NDArray[np.uint64] = h * np.uint64(_GOLDEN)
    return out


def key_index(hashes: array[int]) -> tuple[NDArray[Any], NDArray[Any], NDArray[Any], int]:
    """(sorted mixed hashes, their rows, directory, k) of the keys' hashes."""
    n = len(hashes)
    mixed = _mix_all(np.frombuffer(hashes, np.uint64) if n else np.zeros(0, np.uint64))
    rows = np.argsort(mixed, kind="stable")
    mixed = mixed[rows]
    k = max(0, (n - 1).bit_length() - 1)          # 2**k >= n / 2: two entries a bucket
    buckets = mixed >> np.uint64(64 - k) if k else np.zeros(n, np.uint64)
    directory = np.searchsorted(buckets, np.arange(2 ** k + 1, dtype=np.uint64))
    return mixed, rows.astype(np.int64), directory.astype(np.int64), k



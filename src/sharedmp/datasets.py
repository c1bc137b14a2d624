"""Datasets that worker processes share instead of copying: ``SharedList``, ``SharedDict``,
and ``share_dataset``, which puts an existing dataset object's attributes in those forms.

A dataset of Python records (a list of tuples, a dict of annotations) held by a DataLoader's
``Dataset`` is copied into every worker: pickled into each one under spawn and forkserver,
and under fork copied page by page, as the workers' reads write the records' reference
counts. Here the records are pickled once (protocol 5) into one block of shared memory
(``mp.empty``) and unpickled on each read: no object a reader touches belongs to the dataset.

The block, written once by its maker and read-only after::

    header           magic, kind, n records, m buffers, k, and where each section lies
    offsets          int64[n + 1]: record i is records[offsets[i]:offsets[i + 1]]
    buffer index     int64[n + 1]: record i's buffers are rows bufindex[i] to bufindex[i + 1]
    buffer table     int64[m, 2]: (offset, length) of each buffer   (both absent when m = 0)
    key offsets, hashes, rows, directory        (SharedDict only: the key index, below)
    keys, records    the pickles, one after another
    buffers          out-of-band buffers, 64-byte aligned (16 for buffers under 64 bytes)

Buffers out of band (PEP 574): NumPy arrays, pyarrow buffers (Arrow tables and arrays) and
torch CPU tensors (pickled as the NumPy array over their memory) inside a record are written
into the block, not into its pickle, and come back as read-only views of the block: no copy,
and ``mp.is_shared`` is true of them.

Travel: a container pickles as its block alone (a NumPy array in shared memory: sharedmp's
reducer in ``ForkingPickler`` sends its segment handle) and, for a slice, a range. Through
sharedmp's channels and the process arguments of every spawn and forkserver context (the
standard library's too, as DataLoader's), the receiver maps the same memory; a forked child
inherits it. The memory goes back when the last process lets go of its last container or
record array, as every segment does. Plain ``pickle`` (to a file) carries the block by value:
what it loads is a private copy.

The key index of a ``SharedDict``: Python's ``hash`` of str and bytes differs between
processes (PYTHONHASHSEED), so a key's hash is sharedmp's own (``_key_hash``): CRC-32 of
str and bytes, ``hash`` of numbers (the same in every process, and equal for equal numbers),
combined for tuples and frozensets; any other key is hashed by its pickle. The hashes, mixed
(Fibonacci hashing), are sorted with the row of each; a directory by their top k bits (2**k >= n/2)
gives the few entries to look at. A lookup unpickles only the keys whose hash matches.

Failure modes:
- a record (key, value) that cannot be pickled: TypeError or pickle.PicklingError naming its
  index (key) and the reason, chained from pickle's error;
- a block larger than the free shared memory: ``OutOfSharedMemory`` when it is allocated,
  after pickling and before anything is copied, never SIGBUS in a worker;
- a hostile block (a header or an index that points outside it): ``ProtocolError`` when it
  is attached; each read checks again the bounds it uses (the block is another process's
  writable memory), so a block changed after the check is a ``ProtocolError`` too, never a
  crash;
- writing: a container raises TypeError naming ``mp.zeros``; an array in a record is
  read-only (NumPy's own ValueError "assignment destination is read-only"). torch has no
  read-only tensors: a tensor in a record is a view of the block, and writing into it would
  change the dataset for every process (``.clone()`` it first).

``share_dataset(obj)`` (last section) replaces each large attribute of a dataset object by a
shared form, in place: lists, tuples and dicts of records by these containers, NumPy arrays
by their shared copy, torch tensors moved into shared memory; pandas, pyarrow and Polars
objects are pickled out of band once, their buffers copied into one shared block, and
unpickled over it, so that sharedmp's reducers find their memory shared and send its handle
at every pickling after (Arrow buffers and pandas' Arrow columns: ``reductions/arrow.py``).
"""
from __future__ import annotations

import io
import itertools
import logging
import numbers
import operator
import pickle
import reprlib
import struct
import sys
import types
import warnings
import weakref
import zlib
from array import array
from collections.abc import ItemsView, Iterable, Iterator, KeysView, Mapping, Sequence
from collections.abc import ValuesView
from typing import (TYPE_CHECKING, Any, List, Literal, NamedTuple, TypeVar,
                    Union, overload)

import numpy as np

from .arrays import empty
from .errors import ProtocolError
from .memory import cache, segment

if TYPE_CHECKING:
    from numpy.typing import NDArray

MAGIC = b"sharedmp"
VERSION = 1
LIST, DICT = 1, 2
_KIND_NAMES = {LIST: "SharedList", DICT: "SharedDict"}
# Sections, in the order they lie in the block.
(OFFSETS, BUFINDEX, BUFTABLE, KEYOFFSETS, HASHES, ROWS, DIRECTORY, KEYS, RECORDS,
 BUFFERS) = range(10)
_NSECTIONS = 10
# magic, version, kind, n, m, k, then (offset, length) of each section
_HEADER = struct.Struct(f"<8s5q{2 * _NSECTIONS}q")
_ALIGN = 64
_M64 = (1 << 64) - 1
_T = TypeVar("_T")
_READ_ONLY = ("{} is read-only: its records are pickled once into shared memory and unpickled "
              "at each read. Make a new one from changed records, or keep what processes write "
              "in shared arrays (mp.zeros, mp.empty, mp.full, mp.share)")


def _align(n: int, to: int = _ALIGN) -> int:
    return (n + to - 1) & ~(to - 1)


# ---------------------------------------------------------------------------- pickling

class _Pickled:
    """Records pickled one after another: their bytes, offsets, and out-of-band buffers
    (record index, bytes) in the order their pickles name them."""

    def __init__(self) -> None:
        self.out = io.BytesIO()
        self.offsets = array("q", [0])
        self.buffers: list[tuple[int, memoryview]] = []
        self.i = 0                     # the record being pickled (read by the callback)

    def pickler(self, out_of_band: bool = True) -> pickle.Pickler:
        def buffer_callback(buf: pickle.PickleBuffer) -> bool:
            self.buffers.append((self.i, buf.raw()))   # (BufferError if not contiguous)
            return False                                 # out of band
        cls = _TorchPickler if "torch" in sys.modules else pickle.Pickler
        return cls(self.out, 5, buffer_callback=buffer_callback if out_of_band else None)


class _TorchPickler(pickle.Pickler):
    """A torch CPU tensor as the NumPy array over its memory: its bytes go out of band (torch
    pickles them in band). Used only once torch is imported: the override costs a call for
    every object that is not a builtin."""

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules["torch"]
        if type(obj) is not torch.Tensor or obj.device.type != "cpu" or obj.requires_grad \
                or obj.layout is not torch.strided or obj.is_conj() or obj.is_neg():
            return NotImplemented
        try:
            a = obj.numpy()
        except (TypeError, RuntimeError):      # dtypes NumPy lacks (bfloat16, ...)
            return NotImplemented
        return _tensor_from_numpy, (a,)


def _tensor_from_numpy(a: NDArray[Any]) -> Any:
    import torch
    if a.flags.writeable:
        return torch.from_numpy(a)
    with warnings.catch_warnings():     # (that writing is undefined is in the module docstring)
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        return torch.from_numpy(a)


def _unpicklable(what: str, e: Exception) -> Exception:
    """The error for a record that cannot be pickled: pickle's kind where it is one of the
    usual (TypeError, PicklingError, AttributeError of local objects), else PicklingError."""
    kind = type(e) if type(e) in (TypeError, pickle.PicklingError, AttributeError) \
        else pickle.PicklingError
    return kind(f"{what} cannot be pickled into shared memory: {type(e).__name__}: {e}")


def _pickle_records(records: Iterable[Any]) -> _Pickled:
    p = _Pickled()
    pickler = p.pickler()
    dump, clear, tell, append = pickler.dump, pickler.clear_memo, p.out.tell, p.offsets.append
    for p.i, record in enumerate(records):
        try:
            dump(record)
        except Exception as e:
            raise _unpicklable(f"SharedList record {p.i}", e) from e
        clear()                        # each record stands alone: no memo across records
        append(tell())
    return p


def _pickle_items(items: Iterable[tuple[Any, Any]]) -> tuple[_Pickled, _Pickled, array[int]]:
    keys, values, hashes = _Pickled(), _Pickled(), array("Q")
    kp, vp = keys.pickler(out_of_band=False), values.pickler()
    kdump, kclear, ktell, kappend = kp.dump, kp.clear_memo, keys.out.tell, keys.offsets.append
    vdump, vclear, vtell, vappend = vp.dump, vp.clear_memo, values.out.tell, values.offsets.append
    hash_of, append_hash = _key_hash, hashes.append
    for values.i, (key, value) in enumerate(items):
        try:
            append_hash(hash_of(key))
            kdump(key)
        except Exception as e:
            raise _unpicklable(f"SharedDict key {reprlib.repr(key)}", e) from e
        try:
            vdump(value)
        except Exception as e:
            raise _unpicklable(f"the value of SharedDict key {reprlib.repr(key)}", e) from e
        kclear()
        vclear()
        kappend(ktell())
        vappend(vtell())
    return keys, values, hashes


# ---------------------------------------------------------------------------- key hashes

_NONE_HASH = 0x5F3759DF


def _key_hash(key: Any) -> int:
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
            h = ((h ^ _key_hash(item)) * 1000003) & _M64
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
        return _key_hash(tuple(key))
    if isinstance(key, frozenset):
        h = 0x2C1B3C6D
        for item in key:               # (xor: the same whatever order the set iterates in)
            h ^= _mix(_key_hash(item))
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


def _mix(h: int) -> int:
    return (h * _GOLDEN) & _M64


def _mix_all(h: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """``_mix`` of every element (NumPy's uint64 arithmetic wraps, as ``& _M64`` does)."""
    out: NDArray[np.uint64] = h * np.uint64(_GOLDEN)
    return out


def _key_index(hashes: array[int]) -> tuple[NDArray[Any], NDArray[Any], NDArray[Any], int]:
    """(sorted mixed hashes, their rows, directory, k) of the keys' hashes."""
    n = len(hashes)
    mixed = _mix_all(np.frombuffer(hashes, np.uint64) if n else np.zeros(0, np.uint64))
    rows = np.argsort(mixed, kind="stable")
    mixed = mixed[rows]
    k = max(0, (n - 1).bit_length() - 1)          # 2**k >= n / 2: two entries a bucket
    buckets = mixed >> np.uint64(64 - k) if k else np.zeros(n, np.uint64)
    directory = np.searchsorted(buckets, np.arange(2 ** k + 1, dtype=np.uint64))
    return mixed, rows.astype(np.int64), directory.astype(np.int64), k


# ---------------------------------------------------------------------------- the block

def _write_block(kind: int, values: _Pickled, keys: _Pickled | None,
                 index: tuple[NDArray[Any], NDArray[Any], NDArray[Any], int] | None
                 ) -> NDArray[np.uint8]:
    """The block of a container, in shared memory (``OutOfSharedMemory`` before any copy)."""
    n, m = len(values.offsets) - 1, len(values.buffers)
    table, nbuffers = _place_buffers(values.buffers)
    parts: list[Any] = [b""] * _NSECTIONS
    parts[OFFSETS] = values.offsets
    if m:
        owners = np.fromiter((i for i, _ in values.buffers), np.int64, m)
        bufindex = np.zeros(n + 1, np.int64)
        np.cumsum(np.bincount(owners, minlength=n), out=bufindex[1:])
        parts[BUFINDEX], parts[BUFTABLE] = bufindex, table
    if keys is not None and index is not None:
        parts[KEYOFFSETS], parts[HASHES], parts[ROWS], parts[DIRECTORY] = (
            keys.offsets, *index[:3])
    views = [memoryview(p).cast("B") for p in parts]
    with values.out.getbuffer() as data, \
            (keys.out if keys is not None else io.BytesIO()).getbuffer() as keydata:
        views[RECORDS], views[KEYS] = data, keydata
        lengths = [len(v) for v in views]
        lengths[BUFFERS] = nbuffers
        places, size = [], _HEADER.size
        for length in lengths:
            places.append(_align(size))
            size = places[-1] + length
        mem = empty(max(size, 1), np.uint8)     # OutOfSharedMemory here: nothing copied yet
        dst = mem.data
        for at, view in zip(places, views):
            dst[at:at + len(view)] = view
    at = places[BUFFERS]
    for (_, raw), (start, length) in zip(values.buffers, table.tolist()):
        dst[at + start:at + start + length] = raw
    k = index[3] if index is not None else 0
    sections = [x for pair in zip(places, lengths) for x in pair]
    _HEADER.pack_into(dst, 0, MAGIC, VERSION, kind, n, m, k, *sections)
    mem.flags.writeable = False
    return mem


def _place_buffers(buffers: list[tuple[int, memoryview]]) -> tuple[NDArray[np.int64], int]:
    """The (offset, length) of each buffer in the buffers section, and its length."""
    places, at = [], 0
    for _, raw in buffers:
        n = raw.nbytes
        at = _align(at, _ALIGN if n >= _ALIGN else 16)
        places.append((at, n))
        at += n
    return np.array(places, np.int64).reshape(len(buffers), 2), at


class _Store:
    """One sequence of pickled records in a block: read-only views of its sections."""

    __slots__ = ("offsets", "data", "bufindex", "buftable", "buffers", "m")

    def __init__(self, offsets: memoryview, data: memoryview, bufindex: memoryview | None,
                 buftable: memoryview | None, buffers: memoryview, m: int) -> None:
        self.offsets, self.data, self.buffers, self.m = offsets, data, buffers, m
        self.bufindex, self.buftable = bufindex, buftable


def _load(store: _Store, i: int) -> Any:
    """Record ``i`` (0 <= i < n), unpickled from the block."""
    offsets = store.offsets
    start, end = offsets[i], offsets[i + 1]
    data = store.data
    if not 0 <= start <= end <= len(data):
        raise _corrupt(f"record {i} at {start}:{end} lies outside its section")
    bufindex = store.bufindex
    if bufindex is None or bufindex[i] == bufindex[i + 1]:
        return pickle.loads(data[start:end])
    return pickle.loads(data[start:end], buffers=_buffers(store, bufindex[i], bufindex[i + 1]))


def _buffers(store: _Store, first: int, end: int) -> list[memoryview]:
    if not 0 <= first <= end <= store.m:
        raise _corrupt(f"buffers {first}:{end} of {store.m}")
    table, buffers, out = store.buftable, store.buffers, []
    assert table is not None
    for j in range(first, end):
        at, n = table[2 * j], table[2 * j + 1]
        if not (0 <= at and 0 <= n <= len(buffers) - at):
            raise _corrupt(f"buffer {j} at {at} of {n} bytes lies outside its section")
        out.append(buffers[at:at + n])
    return out


def _corrupt(what: str) -> ProtocolError:
    return ProtocolError(f"the block of a shared dataset is corrupt or hostile: {what}")


class _Block:
    """A container's block as this process sees it (one per make or attach): the array over
    the shared memory, and views of its sections."""

    __slots__ = ("mem", "kind", "n", "store", "keys", "hashes", "rows", "directory", "shift",
                 "__weakref__")

    def __init__(self, mem: NDArray[np.uint8], kind: int, n: int, store: _Store) -> None:
        self.mem, self.kind, self.n, self.store = mem, kind, n, store
        self.keys: _Store | None = None
        self.hashes = self.rows = self.directory = memoryview(b"")
        self.shift = 64
        _live.add(self)

    @property
    def nbytes(self) -> int:
        return len(self.mem)


# Every block this process holds (doctor: ``live``)
_live: weakref.WeakSet[_Block] = weakref.WeakSet()


def _expected_lengths(kind: int, n: int, m: int, k: int) -> list[int | None]:
    """The length each section must have (None: any)."""
    lengths: list[int | None] = [0] * _NSECTIONS
    lengths[OFFSETS] = 8 * (n + 1)
    lengths[BUFINDEX], lengths[BUFTABLE] = (8 * (n + 1), 16 * m) if m else (0, 0)
    if kind == DICT:
        lengths[KEYOFFSETS], lengths[HASHES], lengths[ROWS] = 8 * (n + 1), 8 * n, 8 * n
        lengths[DIRECTORY] = 8 * (2 ** k + 1)
        lengths[KEYS] = None
    lengths[RECORDS] = lengths[BUFFERS] = None
    return lengths


def _attach(mem: Any, kind: int) -> _Block:
    """The block ``mem`` (made here or received), checked: ProtocolError if it is not one of
    ``kind`` or anything in its header or indexes points outside it."""
    if not (isinstance(mem, np.ndarray) and mem.dtype == np.uint8 and mem.ndim == 1
            and mem.flags.c_contiguous and len(mem) >= _HEADER.size):
        raise _corrupt(f"not a block: {type(mem).__name__}")
    view = mem.data.toreadonly()
    magic, version, got, n, m, k, *places = _HEADER.unpack_from(view)
    if magic != MAGIC or version != VERSION or got not in _KIND_NAMES:
        raise _corrupt(f"header {magic!r} version {version} kind {got}")
    if got != kind:
        raise _corrupt(f"a {_KIND_NAMES[got]}'s block where a {_KIND_NAMES[kind]}'s belongs")
    size = len(view)
    if not (0 <= n <= size and 0 <= m <= size and 0 <= k <= 40):
        raise _corrupt(f"{n} records, {m} buffers, k = {k} in {size} bytes")
    sections = []
    for s, expected in enumerate(_expected_lengths(kind, n, m, k)):
        at, length = places[2 * s], places[2 * s + 1]
        if at % 8 or not (_HEADER.size <= at <= size and 0 <= length <= size - at) \
                or expected is not None and length != expected:
            raise _corrupt(f"section {s} at {at} of {length} bytes")
        sections.append(view[at:at + length])
    ints = [sections[s].cast("q") for s in (OFFSETS, BUFINDEX, BUFTABLE, KEYOFFSETS, ROWS,
                                            DIRECTORY)]
    offsets, bufindex, buftable, keyoffsets, rows, directory = ints
    _check_index(np.frombuffer(offsets, np.int64), len(sections[RECORDS]), "offsets")
    store = _Store(offsets, sections[RECORDS], bufindex if m else None,
                   buftable if m else None, sections[BUFFERS], m)
    if m:
        _check_index(np.frombuffer(bufindex, np.int64), m, "buffer index", exact=True)
        table = np.frombuffer(buftable, np.int64).reshape(m, 2)
        if not ((table >= 0).all() and (table[:, 1] <= len(sections[BUFFERS]) - table[:, 0])
                .all()):
            raise _corrupt("a buffer lies outside its section")
    block = _Block(mem, kind, n, store)
    if kind == DICT:
        _check_index(np.frombuffer(keyoffsets, np.int64), len(sections[KEYS]), "key offsets")
        _check_index(np.frombuffer(directory, np.int64), n, "directory", exact=True)
        r = np.frombuffer(rows, np.int64)
        if n and not (np.min(r) >= 0 and np.max(r) < n):
            raise _corrupt("a key's row lies outside the records")
        block.keys = _Store(keyoffsets, sections[KEYS], None, None, memoryview(b""), 0)
        block.hashes, block.rows, block.directory = sections[HASHES].cast("Q"), rows, directory
        block.shift = 64 - k
    return block


def _check_index(a: NDArray[np.int64], limit: int, what: str, exact: bool = False) -> None:
    """That ``a`` starts at 0, never decreases and ends at ``limit`` (``exact``) or within."""
    if a[0] != 0 or a[-1] > limit or (exact and a[-1] != limit) or (a[1:] < a[:-1]).any():
        raise _corrupt(f"its {what} do not rise from 0 to at most {limit}")


def live() -> list[dict[str, Any]]:
    """The shared datasets this process holds now, each once however many containers and
    slices view its block: [{"kind", "records", "bytes"}] (what doctor shows)."""
    found: dict[int, dict[str, Any]] = {}
    for block in list(_live):
        address = block.mem.__array_interface__["data"][0]
        found.setdefault(address, {"kind": _KIND_NAMES[block.kind], "records": block.n,
                                   "bytes": block.nbytes})
    return list(found.values())


cache.describe("datasets", live)


# ---------------------------------------------------------------------------- containers

class SharedList(Sequence[Any]):
    """A read-only sequence whose records live in shared memory, pickled once, unpickled on
    each read. A slice is a SharedList over the same memory (no copy: ``list(s[a:b])`` for a
    list). Pickles as its memory's handle; ``==`` compares with a list or a SharedList."""

    __slots__ = ("_block", "_rows")

    def __init__(self, iterable: Iterable[Any] = ()) -> None:
        self._block = _attach(_write_block(LIST, _pickle_records(iterable), None, None), LIST)
        self._rows = range(self._block.n)

    @classmethod
    def _view(cls, block: _Block, rows: range) -> SharedList:
        self = cls.__new__(cls)
        self._block, self._rows = block, rows
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        full = self._rows == range(self._block.n)
        return _rebuild_list, (self._block.mem, None if full else self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, index: int) -> Any: ...
    @overload
    def __getitem__(self, index: slice) -> SharedList: ...
    def __getitem__(self, index: Union[int, slice]) -> Any:
        try:
            i = self._rows[index]
        except IndexError:
            raise IndexError("SharedList index out of range") from None
        except TypeError:
            raise TypeError("SharedList indices must be integers or slices, not "
                            f"{type(index).__name__}") from None
        if type(i) is range:
            return SharedList._view(self._block, i)
        return _load(self._block.store, i)

    def __iter__(self) -> Iterator[Any]:
        store = self._block.store
        for i in self._rows:
            yield _load(store, i)

    def __setitem__(self, index: Any, value: Any) -> None:
        raise TypeError(_READ_ONLY.format("a SharedList"))

    def __delitem__(self, index: Any) -> None:
        raise TypeError(_READ_ONLY.format("a SharedList"))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SharedList):
            if other._block.mem is self._block.mem and other._rows == self._rows:
                return True
        elif not isinstance(other, list):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]  # (mutable-looking: as a list, unhashable)

    def __repr__(self) -> str:
        shown = [repr(r) for r in self[:6]]
        if len(self) <= 6:
            return f"SharedList([{', '.join(shown)}])"
        return f"SharedList([{', '.join(shown[:5])}, ...], len={len(self)})"

    @property
    def nbytes(self) -> int:
        """Bytes of shared memory the block takes (a slice: its whole list's)."""
        return self._block.nbytes


def _rebuild_list(mem: Any, rows: range | None) -> SharedList:
    block = _attach(mem, LIST)
    if rows is None:
        rows = range(block.n)
    elif type(rows) is not range or (rows and not (0 <= min(rows[0], rows[-1])
                                                  and max(rows[0], rows[-1]) < block.n)):
        raise _corrupt(f"rows {rows!r} of {block.n} records")
    return SharedList._view(block, rows)


class SharedDict(Mapping[Any, Any]):
    """A read-only mapping whose keys and values live in shared memory, pickled once; a
    lookup unpickles only the keys whose hash matches. Iterates in the order it was given.
    Pickles as its memory's handle; ``==`` compares with any mapping."""

    __slots__ = ("_block",)

    def __init__(self, mapping: Mapping[Any, Any] | Iterable[tuple[Any, Any]] = ()) -> None:
        items = (mapping if isinstance(mapping, Mapping) else dict(mapping)).items()
        keys, values, hashes = _pickle_items(items)
        mem = _write_block(DICT, values, keys, _key_index(hashes))
        self._block = _attach(mem, DICT)

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_dict, (self._block.mem,)

    def _find(self, key: Any) -> int:
        """The row of ``key``, or -1."""
        block = self._block
        h = _mix(_key_hash(key))
        directory, hashes, rows, n = block.directory, block.hashes, block.rows, block.n
        b = h >> block.shift
        j, end = directory[b], directory[b + 1]
        if not 0 <= j <= end <= n:
            raise _corrupt(f"directory entry {b}: {j}:{end} of {n}")
        while j < end:
            if hashes[j] == h:
                row = rows[j]
                if not 0 <= row < n:
                    raise _corrupt(f"row {row} of {n}")
                if _load(block.keys, row) == key:  # type: ignore[arg-type]  # (a SharedDict's)
                    return row
            j += 1
        return -1

    def __getitem__(self, key: Any) -> Any:
        row = self._find(key)
        if row < 0:
            raise KeyError(key)
        return _load(self._block.store, row)

    def __contains__(self, key: object) -> bool:
        return self._find(key) >= 0

    def get(self, key: Any, default: Any = None) -> Any:
        row = self._find(key)
        return default if row < 0 else _load(self._block.store, row)

    def __len__(self) -> int:
        return self._block.n

    def __iter__(self) -> Iterator[Any]:
        keys = self._block.keys
        for i in range(self._block.n):
            yield _load(keys, i)  # type: ignore[arg-type]  # (a SharedDict's)

    def _values(self) -> Iterator[Any]:
        store = self._block.store
        for i in range(self._block.n):
            yield _load(store, i)

    def keys(self) -> KeysView[Any]:
        return KeysView(self)

    def values(self) -> ValuesView[Any]:
        return _Values(self)

    def items(self) -> ItemsView[Any, Any]:
        return _Items(self)

    def __setitem__(self, key: Any, value: Any) -> None:
        raise TypeError(_READ_ONLY.format("a SharedDict"))

    def __delitem__(self, key: Any) -> None:
        raise TypeError(_READ_ONLY.format("a SharedDict"))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        if isinstance(other, SharedDict) and other._block.mem is self._block.mem:
            return True
        return len(self) == len(other) and all(
            k in other and other[k] == v for k, v in self.items())

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        shown = [f"{k!r}: {v!r}" for (k, v), _ in zip(self.items(), range(6))]
        if len(self) <= 6:
            return f"SharedDict({{{', '.join(shown)}}})"
        return f"SharedDict({{{', '.join(shown[:5])}, ...}}, len={len(self)})"

    @property
    def nbytes(self) -> int:
        """Bytes of shared memory the block takes."""
        return self._block.nbytes


class _Values(ValuesView[Any]):
    """The values in order, read from their section (not looked up key by key)."""

    _mapping: SharedDict

    def __iter__(self) -> Iterator[Any]:
        return self._mapping._values()

    def __contains__(self, value: object) -> bool:
        return any(v is value or v == value for v in self)


class _Items(ItemsView[Any, Any]):
    _mapping: SharedDict

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        return zip(iter(self._mapping), self._mapping._values())


def _rebuild_dict(mem: Any) -> SharedDict:
    self = SharedDict.__new__(SharedDict)
    self._block = _attach(mem, DICT)
    return self


# ---------------------------------------------------------------------------- share_dataset

class Entry(NamedTuple):
    """What ``share_dataset`` did with one attribute."""

    name: str            # the attribute ("records"; "dataset.records" inside a nested dataset)
    kind: str            # its type before ("list", "ndarray", "DataFrame", ...)
    to: str | None       # its shared form ("SharedList", ...); None: left as it was
    nbytes: int          # its size, estimated (a list's from a sample of its records)
    why: str


class ShareReport(List[Entry]):
    """The attributes ``share_dataset`` converted and those it left, one ``Entry`` each, in
    the order it met them; ``str()`` is one line each."""

    @property
    def converted(self) -> list[Entry]:
        return [e for e in self if e.to is not None]

    @property
    def left(self) -> list[Entry]:
        return [e for e in self if e.to is None]

    def __str__(self) -> str:
        lines = [f"share_dataset: {len(self.converted)} converted, {len(self.left)} left"]
        for e in self:
            if e.to is not None:
                lines.append(f"  {e.name}: {e.kind} -> {e.to} ({_size(e.nbytes)}): {e.why}")
            else:
                lines.append(f"  {e.name}: {e.kind} left: {e.why}")
        return "\n".join(lines)


DEFAULT_THRESHOLD = 1 << 20
_log = logging.getLogger(__name__)
_SAMPLE = 32                 # records sampled to estimate the size of a list, tuple or dict
_MAX_DEPTH = 8               # nested datasets walked (Subset of a ConcatDataset of ...)
_INBAND_NOTE = 64 << 10      # a frame's bytes pickled in band that the report mentions
_MAX_COLUMNS = 64            # a list or tuple of at most this many arrays: each one shared
# What share_dataset made, {id: weak reference}: a second call leaves them (a frame's
# pickle, which the check of its buffers looks at, is not always over its own memory:
# pandas combines the chunks of an Arrow column into new ones as it pickles).
_converted: dict[int, weakref.ref[Any]] = {}


@overload
def share_dataset(obj: _T, threshold: int = ..., *, report: Literal[False] = ...) -> _T: ...
@overload
def share_dataset(obj: Any, threshold: int = ..., *, report: Literal[True]) -> ShareReport: ...
def share_dataset(obj: Any, threshold: int = DEFAULT_THRESHOLD, *, report: bool = False) -> Any:
    """Make the dataset object ``obj`` shareable in place and return it (``report=True``:
    return the ``ShareReport`` instead). Each attribute of at least ``threshold`` bytes is
    replaced by a shared form: a list or tuple of records by a ``SharedList``, a dict by a
    ``SharedDict``, a NumPy array by its shared copy (``mp.share``), a torch CPU tensor
    moved into shared memory in place; pandas, pyarrow and Polars objects are rebuilt over
    their buffers copied once into shared memory. Nested torch datasets (``Subset.dataset``,
    ``ConcatDataset.datasets``) are walked too. Sending the result to any number of
    workers sends handles of that memory, never its bytes again.

    If an attribute fails (a record that cannot be pickled, too little shared memory),
    nothing of ``obj`` is replaced."""
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Integral):
        raise TypeError(f"threshold must be a number of bytes, not {type(threshold).__name__}")
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0 bytes, not {threshold}")
    _check_dataset(obj)
    sharer = _Sharer(int(threshold))
    sharer.walk(obj, "", 0)
    for tensor in sharer.tensors:       # in place, so after every other conversion succeeded
        _arrays().share(tensor)
    for owner, name, value in sharer.assign:
        _set_attribute(owner, name, value)
        _remember(value)
    for value in sharer.made:
        _remember(value)
    for e in sharer.report:
        _log.debug("share_dataset: %s: %s %s: %s", e.name, e.kind,
                   f"-> {e.to}" if e.to is not None else "left", e.why)
    return sharer.report if report else obj


def _arrays() -> Any:
    from . import arrays
    return arrays


def _check_dataset(obj: Any) -> None:
    """TypeError unless ``obj`` is an object whose attributes hold its data."""
    if isinstance(obj, (list, tuple, range)):
        raise TypeError(f"mp.share_dataset() shares the attributes of a dataset object; for a "
                        f"{type(obj).__name__} of records use mp.SharedList(records)")
    if isinstance(obj, Mapping):
        raise TypeError("mp.share_dataset() shares the attributes of a dataset object; for a "
                        "mapping use mp.SharedDict(mapping)")
    if isinstance(obj, np.ndarray) or _is_tensor(obj):
        raise TypeError("mp.share_dataset() shares the attributes of a dataset object; for an "
                        "array or tensor use mp.share(a)")
    if _frame_kind(obj) is not None:
        raise TypeError("mp.share_dataset() shares the attributes of a dataset object; a "
                        f"{type(obj).__name__} is shared as one of them: share the object "
                        "that holds it")
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.nn.Module):
        # (its parameters live in dicts of its own, which a SharedDict would break)
        raise TypeError("mp.share_dataset() shares the attributes of a dataset object; for a "
                        "torch Module use mp.share_memory_(module)")
    if isinstance(obj, (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
                        types.MethodType, str, bytes, bytearray, numbers.Number)) \
            or not _attributes(obj) and not hasattr(obj, "__dict__"):
        raise TypeError("mp.share_dataset() shares the attributes of a dataset object (a "
                        "torch Dataset, or any object whose attributes hold its data), not "
                        f"{type(obj).__name__!r}; a list of records is mp.SharedList(records)")


def _attributes(obj: Any) -> list[tuple[str, Any]]:
    """(name, value) of ``obj``'s attributes: its ``__dict__``, then its slots that are set."""
    d = getattr(obj, "__dict__", None)
    out = list(d.items()) if isinstance(d, dict) else []
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if slot in ("__dict__", "__weakref__"):
                continue
            name = slot
            if slot.startswith("__") and not slot.endswith("__"):     # (name mangling)
                name = f"_{cls.__name__.lstrip('_')}{slot}"
            try:
                out.append((name, object.__getattribute__(obj, name)))
            except AttributeError:              # (a slot not set)
                pass
    return out


def _set_attribute(owner: Any, name: str, value: Any) -> None:
    # Into the __dict__ it was read from, not through setattr: a property or __setattr__ of
    # the class (a frozen dataclass) would refuse it, or transform it.
    d = getattr(owner, "__dict__", None)
    if isinstance(d, dict) and name in d:
        d[name] = value
    else:
        object.__setattr__(owner, name, value)          # (a slot)


def _is_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _is_torch_dataset(x: Any) -> bool:
    torch = sys.modules.get("torch")
    if torch is None or isinstance(x, type):
        return False
    data = getattr(getattr(torch, "utils", None), "data", None)
    return data is not None and isinstance(x, data.Dataset)


class _Left(Exception):
    """An attribute left as it is, and why."""


class _Sharer:
    """One call of share_dataset: what it will assign, and its report."""

    def __init__(self, threshold: int) -> None:
        self.threshold = threshold
        self.report = ShareReport()
        self.assign: list[tuple[Any, str, Any]] = []     # (owner, attribute, shared form)
        self.tensors: list[Any] = []                     # moved in place, at the end
        self.seen: set[int] = set()                      # datasets walked
        self.done: dict[int, tuple[str, Any, Any]] = {}  # id -> (first name, value, shared)
        self.made: list[Any] = []                        # shared items of a list or tuple

    def walk(self, obj: Any, prefix: str, depth: int) -> None:
        self.seen.add(id(obj))
        for name, value in _attributes(obj):
            self.attribute(obj, prefix + name, name, value, depth)

    def attribute(self, owner: Any, path: str, name: str, value: Any, depth: int) -> None:
        kind = _kind(value)
        first = self.done.get(id(value))
        if first is not None:               # one object under two names: one shared form
            first_path, _, shared = first
            if shared is not value:
                self.assign.append((owner, name, shared))
            self.report.append(Entry(path, kind, None if shared is value else _kind(shared), 0,
                                     f"the same object as {first_path}"))
            return
        try:
            shared, to, nbytes, why = self.convert(path, value, depth)
        except _Left as left:
            self.report.append(Entry(path, kind, None, _estimate(value), str(left)))
            return
        self.done[id(value)] = (path, value, shared)
        if shared is not value:
            self.assign.append((owner, name, shared))
        self.report.append(Entry(path, kind, to, nbytes, why))

    def small(self, nbytes: int) -> None:
        if nbytes < self.threshold:
            raise _Left(f"small: {_size(nbytes)} < threshold {_size(self.threshold)}")

    def convert(self, path: str, value: Any, depth: int) -> tuple[Any, str, int, str]:
        """(shared form, its type's name, bytes, why), or raise _Left(why)."""
        t = type(value)
        if isinstance(value, (SharedList, SharedDict)):
            raise _Left("shared already")
        if _was_converted(value):
            raise _Left("shared already (by share_dataset)")
        if t is list or t is tuple:
            return self.sequence(path, value, depth)
        if t is dict:
            nbytes = _estimate(value)
            self.small(nbytes)
            shared: Any = _pickled_once(path, SharedDict, value)
            return shared, "SharedDict", shared.nbytes, (
                f"{len(value)} items pickled once into shared memory, unpickled at each read "
                "(read-only)")
        if isinstance(value, np.ndarray):
            return self.ndarray(value)
        if _is_tensor(value):
            return self.tensor(value)
        frame = _frame_kind(value)
        if frame is not None:
            return self.frame(value, frame)
        if _is_torch_dataset(value):
            if id(value) in self.seen:
                raise _Left("walked already (a dataset met twice)")
            if depth >= _MAX_DEPTH:
                raise _Left(f"a dataset nested deeper than {_MAX_DEPTH}: not walked")
            self.walk(value, path + ".", depth + 1)
            raise _Left("a torch dataset: walked, its attributes shared in turn (above)")
        raise _Left(_why_not(value))

    def sequence(self, path: str, value: Any, depth: int) -> tuple[Any, str, int, str]:
        if value and all(_is_torch_dataset(x) for x in _sample(value)):
            if len(value) > 1000:
                raise _Left(f"{len(value)} datasets: not walked (more than 1000)")
            for i, x in enumerate(value):      # ConcatDataset.datasets
                if id(x) not in self.seen and depth < _MAX_DEPTH:
                    self.walk(x, f"{path}[{i}].", depth + 1)
            raise _Left("datasets, each walked (the list itself stays)")
        if 0 < len(value) <= _MAX_COLUMNS and all(_buffer_bytes(x) is not None for x in value):
            return self.columns(value)
        nbytes = _estimate(value)
        self.small(nbytes)
        shared = _pickled_once(path, SharedList, value)
        note = " (a tuple becomes a SharedList: a read-only sequence too)" \
            if type(value) is tuple else ""
        return shared, "SharedList", shared.nbytes, (
            f"{len(value)} records pickled once into shared memory, unpickled at each read "
            f"(read-only){note}")

    def columns(self, value: Any) -> tuple[Any, str, int, str]:
        """A few arrays, tensors or frames in a list or tuple (``TensorDataset.tensors``):
        each shared as an attribute would be, in a container of the same type."""
        nbytes = sum(_buffer_bytes(x) or 0 for x in value)
        self.small(nbytes)
        threshold, self.threshold = self.threshold, 0      # (each, whatever its own size)
        moved, items, reasons = len(self.tensors), [], []
        try:
            for x in value:
                try:
                    items.append(self.convert("", x, _MAX_DEPTH)[0])
                except _Left as left:
                    items.append(x)
                    reasons.append(str(left))
        finally:
            self.threshold = threshold
        if len(self.tensors) == moved and all(y is x for x, y in zip(value, items)):
            raise _Left(f"its {len(value)} arrays: {reasons[0]}")
        self.made.extend(y for x, y in zip(value, items) if y is not x)
        shared = value if all(y is x for x, y in zip(value, items)) else type(value)(items)
        return shared, type(value).__name__, nbytes, (
            f"{len(value)} arrays, tensors or frames, each shared as an attribute would be "
            f"(a {type(value).__name__} of them still)")

    def ndarray(self, value: Any) -> tuple[Any, str, int, str]:
        if type(value) is not np.ndarray:
            if isinstance(value, np.memmap):
                raise _Left("a file-backed np.memmap: its shared copy would hold the whole file "
                            "in memory (workers can map the file themselves)")
            raise _Left(f"a subclass of ndarray ({type(value).__name__}): its shared copy "
                        "would be a plain ndarray")
        if value.dtype.hasobject:
            raise _Left("an array of Python objects (dtype object): no shared form (a list of "
                        "them would be a SharedList)")
        if _arrays().is_shared(value):
            raise _Left("shared already")
        self.small(value.nbytes)
        shared = _arrays().share(value)
        return shared, "ndarray", shared.nbytes, (
            "copied once into shared memory (mp.share): sent as a handle; writable, and "
            "what a process writes every process sees")

    def tensor(self, value: Any) -> tuple[Any, str, int, str]:
        if value.device.type != "cpu":
            raise _Left(f"a {value.device.type} tensor: not in CPU memory (a CUDA tensor is "
                        "sent by CUDA IPC, shared already)")
        try:
            nbytes = value.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError) as e:    # sparse, ...
            raise _Left(f"a {value.layout} tensor: no storage to share ({e})") from None
        if _arrays().is_shared(value):
            raise _Left("shared already")
        self.small(nbytes)
        self.tensors.append(value)
        return value, "Tensor", nbytes, (
            "moved into shared memory in place (share_memory_): sent as a handle; what a "
            "process writes every process sees")

    def frame(self, value: Any, frame: str) -> tuple[Any, str, int, str]:
        self.small(_estimate(value))
        if frame == "polars":
            shared, nbytes, inband = _polars_over_shared_memory(value)
        else:
            shared, nbytes, inband = _over_shared_memory(value)
        what = {"pandas": "NumPy columns writable, Arrow ones read-only",
                "arrow": "read-only, as Arrow data is", "polars": "read-only"}[frame]
        note = ""
        if inband >= max(self.threshold, _INBAND_NOTE):
            note = (f"; {_size(inband)} of Python objects in it (object columns) stay private: "
                    "copied into each spawned worker")
        return shared, type(shared).__name__, nbytes, (
            f"rebuilt over its buffers copied once into shared memory: sent as handles "
            f"({what}){note}")


def _remember(value: Any) -> None:
    key = id(value)
    try:
        _converted[key] = weakref.ref(value, lambda _: _converted.pop(key, None))
    except TypeError:                           # (not weakly referable: SharedList, ...)
        pass


def _was_converted(value: Any) -> bool:
    ref = _converted.get(id(value))
    return ref is not None and ref() is value


def _pickled_once(path: str, cls: Any, value: Any) -> Any:
    """``cls(value)``, its errors naming the attribute ``path``."""
    try:
        return cls(value)
    except (TypeError, pickle.PicklingError, AttributeError) as e:
        raise type(e)(f"mp.share_dataset: attribute {path!r}: {e}") from e


def _frame_kind(value: Any) -> str | None:
    """"pandas", "arrow" or "polars" for the frames share_dataset rebuilds (only of the
    libraries imported already: none is imported here), else None."""
    pd = sys.modules.get("pandas")
    if pd is not None and isinstance(value, (pd.DataFrame, pd.Series, pd.Index)):
        return "pandas"
    pa = sys.modules.get("pyarrow")
    if pa is not None and isinstance(value, (pa.Table, pa.RecordBatch, pa.Array,
                                             pa.ChunkedArray)):
        return "arrow"
    pl = sys.modules.get("polars")
    if pl is not None and isinstance(value, (pl.DataFrame, pl.Series)):
        return "polars"
    return None


def _kind(value: Any) -> str:
    t = type(value)
    if t in (list, tuple, dict):
        return f"{t.__name__} of {len(value)}"
    return t.__name__


def _why_not(value: Any) -> str:
    """Why ``value``, of no kind share_dataset converts, is left."""
    if isinstance(value, (type, types.ModuleType)) or callable(value):
        return "code, not data"
    if isinstance(value, io.IOBase):
        return "a file: not data"
    if isinstance(value, (str, bytes, bytearray, memoryview)):
        return (f"no shared form keeps it a {type(value).__name__} (large bytes: "
                "np.frombuffer(b, np.uint8) and mp.share)")
    if value is None or isinstance(value, (numbers.Number, np.generic, bool, range, slice)):
        return "a scalar"
    if isinstance(value, (list, tuple, dict)):
        base = next(c for c in (list, tuple, dict) if isinstance(value, c)).__name__
        return (f"a subclass of {base} ({type(value).__name__}): its shared form would lose "
                "its behaviour")
    if isinstance(value, (set, frozenset)):
        return ("a set: no shared form keeps it a set (mp.SharedDict(dict.fromkeys(s)) "
                "answers `in`)")
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.nn.Module):
        return "a torch Module: mp.share_memory_(module) shares its parameters"
    return (f"a {type(value).__name__}: not a kind share_dataset converts (lists, tuples and "
            "dicts of records, NumPy arrays, torch tensors, pandas, pyarrow and Polars data, "
            "torch datasets)")


# -- sizes

_size = segment.format_size          # "16.2 MiB", as doctor writes sizes


def _sample(seq: Any) -> list[Any]:
    """At most _SAMPLE items of a list or tuple, spread over it."""
    n = len(seq)
    step = max(1, n // _SAMPLE)
    return [seq[i] for i in range(0, n, step)][:_SAMPLE]


def _estimate(value: Any, depth: int = 3) -> int:
    """Bytes ``value`` takes, estimated: a container's from a sample of its items (so a list
    of a million records costs a few dozen getsizeof calls), arrays and frames exactly."""
    nbytes = _buffer_bytes(value)
    if nbytes is not None:
        return nbytes
    try:
        n = sys.getsizeof(value)
    except TypeError:
        n = 64
    t = type(value)
    if depth <= 0 or t in (int, float, bool, str, bytes, complex) or value is None:
        return n
    if isinstance(value, (list, tuple)):
        sample = _sample(value)
    elif isinstance(value, (set, frozenset)):
        sample = list(itertools.islice(value, _SAMPLE))
    elif isinstance(value, dict):
        sample = list(itertools.islice(value.items(), _SAMPLE))
    else:
        d = getattr(value, "__dict__", None)
        return n + _estimate(d, depth - 1) if isinstance(d, dict) and d else n
    if not sample:
        return n
    return n + len(value) * sum(_estimate(x, depth - 1) for x in sample) // len(sample)


def _buffer_bytes(value: Any) -> int | None:
    """The bytes of an array, tensor or frame; None for anything else."""
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if _is_tensor(value):
        try:
            return int(value.untyped_storage().nbytes())
        except (RuntimeError, NotImplementedError):
            return int(value.element_size() * value.numel())
    kind = _frame_kind(value)
    if kind == "pandas":
        usage = value.memory_usage(deep=False) if isinstance(value, sys.modules[
            "pandas"].Index) else value.memory_usage(index=True, deep=False)
        return int(usage.sum() if hasattr(usage, "sum") else usage)
    if kind == "arrow":
        return int(value.nbytes)
    if kind == "polars":
        return int(value.estimated_size())
    return None


# -- frames: rebuilt over their buffers copied once into shared memory

def _buffer_address(raw: memoryview) -> int:
    return int(np.frombuffer(raw, np.uint8).__array_interface__["data"][0])


def _in_shared_memory(raw: memoryview) -> bool:
    return raw.nbytes == 0 or segment.containing(_buffer_address(raw), raw.nbytes)[0] is not None


def _over_shared_memory(value: Any) -> tuple[Any, int, int]:
    """``value`` pickled (protocol 5) with its buffers out of band (NumPy arrays, Arrow
    buffers), those copied once into one block of shared memory, and unpickled over them:
    (the copy, bytes shared, bytes pickled in band). Its NumPy arrays are writable views of
    the block (as they were writable), its Arrow buffers read-only: so sharedmp's reducers
    find them in shared memory and send the block's handle, at every pickling after."""
    p = _Pickled()
    try:
        p.pickler().dump(value)
    except Exception as e:
        raise _Left(f"cannot be pickled ({type(e).__name__}: {e})") from None
    if not p.buffers:
        raise _Left("holds no buffers (Python objects only): nothing to share")
    if all(_in_shared_memory(raw) for _, raw in p.buffers):
        raise _Left("shared already (its buffers lie in shared memory)")
    table, total = _place_buffers(p.buffers)
    mem = empty(max(total, 1), np.uint8)         # OutOfSharedMemory here: nothing copied yet
    dst = mem.data
    views = []
    for (_, raw), (at, n) in zip(p.buffers, table.tolist()):
        dst[at:at + n] = raw
        view = dst[at:at + n]
        views.append(view.toreadonly() if raw.readonly else view)
    with p.out.getbuffer() as data:
        inband = len(data)
        copy = pickle.loads(data, buffers=views)
    return copy, total, inband


def _polars_over_shared_memory(value: Any) -> tuple[Any, int, int]:
    """A Polars frame or series through Arrow (Polars pickles itself in band): its Arrow
    export rebuilt over shared memory, and Polars' frame over that (``from_arrow`` keeps
    numbers and string views without a copy)."""
    import polars as pl

    from .reductions import polars as polars_reduction
    series = isinstance(value, pl.Series)
    try:
        table = polars_reduction.to_arrow(value.to_frame() if series else value)
    except Exception as e:           # (an Object column)
        raise _Left(f"Polars cannot export it to Arrow ({type(e).__name__}: {e})") from None
    shared_table, nbytes, inband = _over_shared_memory(table)
    shared: Any = pl.from_arrow(shared_table, rechunk=False)
    if series:
        shared = shared.to_series()
        same = shared.dtype == value.dtype and shared.name == value.name
    else:
        same = shared.schema == value.schema
    if not same:
        raise _Left("Polars rebuilds it from Arrow with other types: left as it was")
    return shared, nbytes, inband

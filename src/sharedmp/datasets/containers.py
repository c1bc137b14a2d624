"""``SharedList`` and ``SharedDict``: read-only containers whose records are pickled once into
a sealed block of shared memory (``block.py``) and unpickled at each read.

Travel: a container pickles as its block alone (a NumPy array in shared memory: sharedmp's
reducer in ``ForkingPickler`` sends its segment handle) and, for a slice, a range. Through
sharedmp's channels and the process arguments of every spawn and forkserver context (the
standard library's too, as DataLoader's), the receiver maps the same memory; a forked child
inherits it. The memory goes back when the last process lets go of its last container or
record array, as every segment does. Plain ``pickle`` (to a file) carries the block by value:
what it loads is a private copy.

Writing: a container raises TypeError saying where changes belong. A record read is the
reader's own copy (unpickled for it): changing it changes nothing stored. An array in a
record is read-only (NumPy's own ValueError "assignment destination is read-only"); torch
has no read-only tensors: what a process writes into a record's tensor stays in its own
copy-on-write pages, the block is sealed.
"""
from __future__ import annotations

import reprlib

from collections.abc import ItemsView, Iterable, Iterator, KeysView, Mapping, Sequence
from collections.abc import ValuesView
from typing import Any, Union, overload

from . import block as _b
from .block import DICT, LIST
from .keys import key_hash, key_index, mix

READ_ONLY = ("{} is read-only: its records were pickled once into shared memory, which no "
             "process can write, and each read unpickles a fresh copy, so a change would be "
             "lost. Make changes before mp.share_dataset (or mp.{}) is called, or build a new "
             "one from the changed records; keep what processes write in shared arrays "
             "(mp.zeros, mp.empty, mp.full, mp.share)")


class SharedList(Sequence[Any]):
    """A read-only sequence whose records live in shared memory, pickled once, unpickled on
    each read. A slice is a SharedList over the same memory (no copy: ``list(s[a:b])`` for a
    list). Pickles as its memory's handle; ``==`` compares with a list or a SharedList."""

    __slots__ = ("_block", "_rows")

    def __init__(self, iterable: Iterable[Any] = ()) -> None:
        self._block = _b.attach(_b.write_block(LIST, _b.pickle_records(iterable), None, None),
                                LIST)
        self._rows = range(self._block.n)

    @classmethod
    def _view(cls, block: _b.Block, rows: range) -> SharedList:
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
        return _b.load(self._block.store, i)

    def __iter__(self) -> Iterator[Any]:
        store = self._block.store
        for i in self._rows:
            yield _b.load(store, i)

    def __setitem__(self, index: Any, value: Any) -> None:
        raise TypeError(READ_ONLY.format("a SharedList", "SharedList(records)"))

    def __delitem__(self, index: Any) -> None:
        raise TypeError(READ_ONLY.format("a SharedList", "SharedList(records)"))

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
    block = _b.attach(mem, LIST)
    if rows is None:
        rows = range(block.n)
    elif type(rows) is not range or (rows and not (0 <= min(rows[0], rows[-1])
                                                  and max(rows[0], rows[-1]) < block.n)):
        raise _b.corrupt(f"rows {rows!r} of {block.n} records")
    return SharedList._view(block, rows)


class SharedDict(Mapping[Any, Any]):
    """A read-only mapping whose keys and values live in shared memory, pickled once; a
    lookup unpickles only the keys whose hash matches. Iterates in the order it was given.
    Pickles as its memory's handle; ``==`` compares with any mapping."""

    __slots__ = ("_block",)

    def __init__(self, mapping: Mapping[Any, Any] | Iterable[tuple[Any, Any]] = ()) -> None:
        d = mapping if isinstance(mapping, Mapping) else dict(mapping)
        keys = list(d)
        pickled_keys, hashes = _b.pickle_keys(keys, key_hash)
        values = _b.pickle_records(
            list(d.values()), lambda i: f"the value of SharedDict key {reprlib.repr(keys[i])}")
        mem = _b.write_block(DICT, values, pickled_keys, key_index(hashes))
        self._block = _b.attach(mem, DICT)

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_dict, (self._block.mem,)

    def _find(self, key: Any) -> int:
        """The row of ``key``, or -1."""
        block = self._block
        h = mix(key_hash(key))
        directory, hashes, rows, n = block.directory, block.hashes, block.rows, block.n
        b = h >> block.shift
        j, end = directory[b], directory[b + 1]
        if not 0 <= j <= end <= n:
            raise _b.corrupt(f"directory entry {b}: {j}:{end} of {n}")
        while j < end:
            if hashes[j] == h:
                row = rows[j]
                if not 0 <= row < n:
                    raise _b.corrupt(f"row {row} of {n}")
                if _b.load(block.keys, row) == key:  # type: ignore[arg-type]  # (a SharedDict's)
                    return row
            j += 1
        return -1

    def __getitem__(self, key: Any) -> Any:
        row = self._find(key)
        if row < 0:
            raise KeyError(key)
        return _b.load(self._block.store, row)

    def __contains__(self, key: object) -> bool:
        return self._find(key) >= 0

    def get(self, key: Any, default: Any = None) -> Any:
        row = self._find(key)
        return default if row < 0 else _b.load(self._block.store, row)

    def __len__(self) -> int:
        return self._block.n

    def __iter__(self) -> Iterator[Any]:
        keys = self._block.keys
        for i in range(self._block.n):
            yield _b.load(keys, i)  # type: ignore[arg-type]  # (a SharedDict's)

    def _values(self) -> Iterator[Any]:
        store = self._block.store
        for i in range(self._block.n):
            yield _b.load(store, i)

    def keys(self) -> KeysView[Any]:
        return KeysView(self)

    def values(self) -> ValuesView[Any]:
        return _Values(self)

    def items(self) -> ItemsView[Any, Any]:
        return _Items(self)

    def __setitem__(self, key: Any, value: Any) -> None:
        raise TypeError(READ_ONLY.format("a SharedDict", "SharedDict(mapping)"))

    def __delitem__(self, key: Any) -> None:
        raise TypeError(READ_ONLY.format("a SharedDict", "SharedDict(mapping)"))

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
    self._block = _b.attach(mem, DICT)
    return self


# ---------------------------------------------------------------------------- share_dataset

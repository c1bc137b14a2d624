"""``share_dataset``: a dataset object's large attributes replaced by shared forms, in place.

Lists, tuples and dicts of records become ``SharedList`` and ``SharedDict`` (``containers.py``);
NumPy arrays their copies in one sealed block, views of one base kept views of one copy, each
process's writes its own (``copies.py``); torch CPU tensors are moved into shared memory in
place; pandas, pyarrow and Polars objects are rebuilt over their buffers copied once into a
sealed block, so that sharedmp's reducers find their memory shared and send its handle at
every pickling after (Arrow buffers and pandas' Arrow columns: ``reductions/arrow.py``).
"""
from __future__ import annotations

import io
import itertools
import logging
import numbers
import pickle
import sys
import types
import weakref
from collections.abc import Mapping
from typing import Any, List, Literal, NamedTuple, TypeVar, overload

import numpy as np

from ..memory import segment
from .block import shared_nbytes
from .containers import SharedDict, SharedList
from .copies import _Left, copy_arrays, frame_copy, groups, polars_copy

_T = TypeVar("_T")


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

    @property
    def read_only(self) -> list[Entry]:
        """The attributes that became read-only containers: a change to them, or to a record
        read from them, is lost (changes belong before ``share_dataset``)."""
        return [e for e in self if e.to in ("SharedList", "SharedDict")]

    def __str__(self) -> str:
        lines = [f"share_dataset: {len(self.converted)} converted, {len(self.left)} left"]
        for e in self:
            if e.to is not None:
                lines.append(f"  {e.name}: {e.kind} -> {e.to} ({_size(e.nbytes)}): {e.why}")
            else:
                lines.append(f"  {e.name}: {e.kind} left: {e.why}")
        if self.read_only:
            lines.append(f"  read-only now: {', '.join(e.name for e in self.read_only)} (a "
                         "change to them, or to a record read from them, is lost: make it "
                         "before mp.share_dataset)")
        return "\n".join(lines)


DEFAULT_THRESHOLD = 1 << 20
_log = logging.getLogger(__name__)         # (under the "sharedmp.datasets" logger)
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
    sharer.copy_arrays()
    for tensor in sharer.tensors:       # in place, so after every other conversion succeeded
        _arrays().share(tensor)
    for owner, name, value in sharer.assign:
        if isinstance(value, _Pending) and value.copy is None:
            continue                    # (small, and no larger array views its memory)
        value = _resolve(value)
        _set_attribute(owner, name, value)
        _remember(value)
    for value in sharer.made:
        if not (isinstance(value, _Pending) and value.copy is None):
            _remember(_resolve(value))
    for e in sharer.report:
        _log.debug("share_dataset: %s: %s %s: %s", e.name, e.kind,
                   f"-> {e.to}" if e.to is not None else "left", e.why)
    return sharer.report if report else obj


def _arrays() -> Any:
    from .. import arrays
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


class _Pending:
    """An array to copy once the walk is over, with every other: views of one base stay
    views of one copy (``copies.groups``), whatever the size of each."""

    __slots__ = ("array", "force", "entries", "copy")

    def __init__(self, array: Any, force: bool) -> None:
        self.array, self.force = array, force
        self.entries: list[int] = []    # its places in the report
        self.copy: Any = None


def _resolve(value: Any) -> Any:
    """``value`` with each _Pending in it (a list or tuple of arrays) replaced by its copy."""
    if isinstance(value, _Pending):
        return value.array if value.copy is None else value.copy
    if type(value) in (list, tuple) and any(isinstance(x, _Pending) for x in value):
        return type(value)(_resolve(x) for x in value)
    return value


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
        self.arrays: list[_Pending] = []                 # copied together, at the end

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
            if isinstance(shared, _Pending):
                shared.entries.append(len(self.report))
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
        if isinstance(shared, _Pending):
            shared.entries.append(len(self.report))
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
                f"{len(value)} items pickled once into sealed shared memory, unpickled at each "
                f"read{_objects_note(shared)}; read-only")
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
            f"{len(value)} records pickled once into sealed shared memory, unpickled at each "
            f"read{_objects_note(shared)}; read-only{note}")

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
        pending = _Pending(value, force=self.threshold == 0)
        self.arrays.append(pending)
        return pending, "ndarray", value.nbytes, ""       # (why: ``copy_arrays``)

    def copy_arrays(self) -> None:
        """Copy the arrays met, in one sealed block: each group of arrays that view the same
        memory as one, if any of them is large (a small view of a large array goes with it),
        else left. Their report entries are written here."""
        pending = self.arrays
        if not pending:
            return
        chosen, names = [], {}
        for group in groups([p.array for p in pending]):
            members = sorted((pending[i] for i in group), key=lambda p: p.entries[0])
            if any(p.force or p.array.nbytes >= self.threshold for p in members):
                chosen.append(members)
            else:
                for p in members:
                    self.left_small(p)
            for p in members:
                names[id(p)] = [self.report[i].name for i in p.entries[:1]]
        flat = [p for members in chosen for p in members]
        together, at = [], 0
        for members in chosen:
            together.append(list(range(at, at + len(members))))
            at += len(members)
        made = copy_arrays([p.array for p in flat], together)
        for p, copy in zip(flat, made):
            p.copy = copy
        for members in chosen:
            for p in members:
                others = [n for q in members if q is not p for n in names[id(q)]]
                why = ("copied once into sealed shared memory, sent as a handle; writable, and "
                       "what a process writes stays its own (copy-on-write), as with a plain "
                       "array")
                if others:
                    why += f"; its memory is shared with {', '.join(others)}, as before"
                for i in p.entries:         # (the first: its own; others: the same object)
                    e = self.report[i]
                    self.report[i] = e._replace(to="ndarray",
                                                why=why if i == p.entries[0] else e.why)

    def left_small(self, p: _Pending) -> None:
        for i in p.entries:
            e = self.report[i]
            why = e.why if i != p.entries[0] else (
                f"small: {_size(e.nbytes)} < threshold {_size(self.threshold)}")
            self.report[i] = e._replace(to=None, why=why)

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
            shared, nbytes, inband = polars_copy(value)
        else:
            shared, nbytes, inband = frame_copy(value)
        what = {"pandas": "NumPy columns writable, each process's writes its own; Arrow ones "
                          "read-only",
                "arrow": "read-only, as Arrow data is", "polars": "read-only"}[frame]
        note = ""
        if inband >= max(self.threshold, _INBAND_NOTE):
            note = (f"; {_size(inband)} of Python objects in it (object columns) stay private: "
                    "copied into each spawned worker")
        return shared, type(shared).__name__, nbytes, (
            f"rebuilt over its buffers copied once into sealed shared memory: sent as handles "
            f"({what}){note}")


def _objects_note(shared: Any) -> str:
    store = shared._block.store
    if not store.nobjects:
        return ""
    return (f"; {store.nobjects} objects several records refer to stored once "
            f"({_size(shared_nbytes(store))}), read once by each process that needs them")


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



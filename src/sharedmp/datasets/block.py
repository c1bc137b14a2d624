"""The block of a shared dataset: records pickled once into sealed shared memory, read back one
at a time.

Written once by its maker, and sealed: no process can write it after (``segment.create_sealed``:
a memfd sealed against writes, mapped copy-on-write by every process)::

    header           magic, version, kind, n records, m buffers, k, s, and each section's place
    offsets          int64[e + 1]: entry i is records[offsets[i]:offsets[i + 1]]
                     (e = n, or n + 1 with the shared objects: entry n)
    buffer index     int64[e + 1]: entry i's buffers are rows bufindex[i] to bufindex[i + 1]
    buffer table     int64[m, 2]: (offset, length) of each buffer   (both absent when m = 0)
    flags            uint8[n]: 1 where the record refers to shared objects   (absent when s = 0)
    key offsets, hashes, rows, directory        (SharedDict only: ``keys.py``)
    keys, records    the pickles, one after another
    buffers          out-of-band buffers, 64-byte aligned (16 for buffers under 64 bytes)

Buffers out of band (PEP 574): NumPy arrays, pyarrow buffers (Arrow tables and arrays) and
torch CPU tensors (pickled as the NumPy array over their memory) inside a record are written
into the block, not into its pickle, and come back as read-only views of the block: no copy,
and ``mp.is_shared`` is true of them.

Objects several records refer to (a vocabulary, a class map: found by identity while the
records are pickled) are stored once, together, as entry n: the list of the s of them, one
pickle, so that what they share among themselves (cycles too) stays shared. A record refers to
one as a persistent id (its place in the list). A process unpickles that list once, at the
first read of a record that needs it, and keeps it while it holds the block: the records it
reads then share those objects, as the records of a list do (``s[0][1] is s[1][1]``).

Failure modes:
- a record (key, value) that cannot be pickled: TypeError or pickle.PicklingError naming it
  and the reason, chained from pickle's error;
- a block larger than the free shared memory: ``OutOfSharedMemory`` when it is allocated,
  after pickling and before anything is copied, never SIGBUS in a worker;
- a hostile or damaged block (a header or an index that points outside it, a persistent id
  that is no shared object's): ``ProtocolError`` when it is attached, or when the record is
  read (each read checks again the bounds it uses: where memfd is missing, a block is
  writable by any process of the user).
"""
from __future__ import annotations

import enum
import gc
import io
import itertools
import pickle
import reprlib
import struct
import sys
import threading
import types
import warnings
import weakref
from array import array
from typing import TYPE_CHECKING, Any, Callable, Iterable

import numpy as np

from .. import forks
from ..errors import ProtocolError
from ..memory import cache, segment

if TYPE_CHECKING:
    from numpy.typing import NDArray

MAGIC = b"sharedmp"
VERSION = 2
LIST, DICT = 1, 2
KIND_NAMES = {LIST: "SharedList", DICT: "SharedDict"}
# Sections, in the order they lie in the block.
(OFFSETS, BUFINDEX, BUFTABLE, FLAGS, KEYOFFSETS, HASHES, ROWS, DIRECTORY, KEYS, RECORDS,
 BUFFERS) = range(11)
_NSECTIONS = 11
# magic, version, kind, n, m, k, s, then (offset, length) of each section
HEADER = struct.Struct(f"<8s6q{2 * _NSECTIONS}q")
_ALIGN = 64


def _align(n: int, to: int = _ALIGN) -> int:
    return (n + to - 1) & ~(to - 1)


# ---------------------------------------------------------------------------- pickling

# Objects never stored apart: values (no identity worth keeping, and a str or bytes is copied
# by value as pickle copies it), and what pickle saves by name or by value alike everywhere.
_ATOMIC = frozenset({int, float, complex, bool, str, bytes, type(None)})
_PLAIN = _ATOMIC | {tuple, list, dict, set, frozenset}      # records pickled at C speed
_BY_NAME = (type, types.FunctionType, types.BuiltinFunctionType, types.ModuleType,
            types.MethodType, enum.Enum, np.dtype)
_CHUNK = 4096                    # records looked at together (``pickle_records``)


class Entries:
    """Entries pickled one after another (protocol 5), each standing alone: their bytes,
    offsets, out-of-band buffers (entry, bytes) in the order their pickles name them, and
    for records, the objects several records share (``objects``) and which records refer
    to them (``flags``)."""

    def __init__(self) -> None:
        self.out = io.BytesIO()
        self.offsets = array("q", [0])
        self.buffers: list[tuple[int, memoryview]] = []
        self.i = 0                     # the entry being pickled (read by the callback)
        self.objects: list[Any] = []   # stored once: entry n, when there are any
        self.flags = bytearray()       # (records) 1: refers to objects

    def pickler(self, cls: type[pickle.Pickler] | None = None,
                out: io.BytesIO | None = None, out_of_band: bool = True) -> Any:
        def buffer_callback(buf: pickle.PickleBuffer) -> bool:
            self.buffers.append((self.i, buf.raw()))   # (BufferError if not contiguous)
            return False                                 # out of band
        if cls is None:
            cls = _TorchPickler if "torch" in sys.modules else pickle.Pickler
        return cls(self.out if out is None else out, 5,
                   buffer_callback=buffer_callback if out_of_band else None)

    def append(self, data: bytes | None = None) -> None:
        """Close the entry pickled into ``out`` (or write ``data`` first)."""
        if data is not None:
            self.out.write(data)
        self.offsets.append(self.out.tell())


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


class _Tracking:
    """A pickler that finds the objects several records refer to (by identity) and saves
    each of them, once found, as a persistent id: its place in ``objects``.

    An object is met first in one record, pickled there; met again in another, it joins
    ``objects`` and the first record is marked ``dirty``, to be pickled again. The pickle of
    the objects themselves is one more place (``OBJECTS``): an object met there and in a
    record is found shared too. Only objects some other reference holds are looked at (their
    reference count says so: ``_FLOOR``), and each one looked at is held (``seen``) until the
    block is built, so that no id is reused by another object meanwhile."""

    entries: Entries
    top: Any = None                    # the record itself: a record is always its own copy
    record = 0                         # the place being pickled: a record, or OBJECTS
    seen: dict[int, tuple[int, Any]]   # id -> (first place, the object)
    found: dict[int, int]              # id -> place in ``objects``
    dirty: set[int]
    refers = False                     # the record being pickled refers to objects
    tracked = False                    # ... holds an object in ``seen``

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) in _ATOMIC or obj is self.top:
            return None
        j = self.found.get(id(obj))
        if j is not None:
            if self.record == OBJECTS:  # the objects' own pickle holds each of them
                return None
            self.refers = True
            return j
        # (nothing above binds ``obj`` to another name: the count is the one _FLOOR measured)
        if sys.getrefcount(obj) <= _FLOOR or isinstance(obj, _BY_NAME):
            return None
        first = self.seen.get(id(obj))
        if first is None:
            self.seen[id(obj)] = (self.record, obj)
            self.tracked = True
            return None
        if first[0] == self.record:     # twice in one record: pickle's memo keeps it one
            return None
        j = self.found[id(obj)] = len(self.entries.objects)
        self.entries.objects.append(obj)
        self.dirty.add(first[0])
        if self.record == OBJECTS:
            return None
        self.refers = True
        return j


OBJECTS = -1                           # (_Tracking) the place of the objects' own pickle


class _TrackingPickler(_Tracking, pickle.Pickler):
    pass


class _TrackingTorchPickler(_Tracking, _TorchPickler):
    pass


def _tracking(p: Entries, cls: type[Any], out: io.BytesIO | None, seen: dict[int, Any],
              found: dict[int, int], dirty: set[int]) -> Any:
    """A tracking pickler of ``p``'s entries (into ``out``), sharing the others' state."""
    pickler = p.pickler(cls, out)
    pickler.entries, pickler.seen, pickler.found, pickler.dirty = p, seen, found, dirty
    return pickler


def _floor() -> int:
    """The reference count ``persistent_id`` sees of an object that a single container refers
    to (the least over the containers pickle walks): one more reference means another holder."""
    counts = []

    class Probe(pickle.Pickler):
        def persistent_id(self, obj: Any) -> None:
            if type(obj) is bytearray:
                counts.append(sys.getrefcount(obj))

    for shape in (lambda: (bytearray(),), lambda: [bytearray()], lambda: {"a": bytearray()}):
        Probe(io.BytesIO(), 5).dump(shape())
    return min(counts)


_FLOOR = _floor()


def unpicklable(what: str, e: Exception) -> Exception:
    """The error for a record that cannot be pickled: pickle's kind where it is one of the
    usual (TypeError, PicklingError, AttributeError of local objects), else PicklingError."""
    kind = type(e) if type(e) in (TypeError, pickle.PicklingError, AttributeError) \
        else pickle.PicklingError
    return kind(f"{what} cannot be pickled into shared memory: {type(e).__name__}: {e}")


def pickle_records(records: Iterable[Any],
                   name: Callable[[int], str] = "SharedList record {}".format) -> Entries:
    """The records pickled, each standing alone, and the objects several of them refer to
    stored once (``Entries.objects``, entry n). ``name(i)`` names record i in errors."""
    p = Entries()
    torch = "torch" in sys.modules
    tracking = _tracking(p, _TrackingTorchPickler if torch else _TrackingPickler, None, {}, {},
                         set())
    seq = records if type(records) in (list, tuple) else None
    it = iter(records)
    held: dict[int, Any] = {}          # records to pickle again, when ``records`` is no list
    out, offsets = p.out, p.offsets
    flags: list[int] = []
    while True:
        chunk = list(itertools.islice(it, _CHUNK))
        if not chunk:
            break
        # Records of builtin containers whose parts are all values (``_ATOMIC``) share
        # nothing, and have no out-of-band buffer: each its own pickle.dumps, looped in C.
        if (set(map(type, chunk)) <= _PLAIN
                and set(map(type, gc.get_referents(*chunk))) <= _ATOMIC):
            pickles = list(map(pickle.dumps, chunk, itertools.repeat(5)))   # (cannot fail)
            ends = np.fromiter(map(len, pickles), np.int64, len(pickles)).cumsum()
            offsets.frombytes((ends + offsets[-1]).tobytes())
            out.write(b"".join(pickles))
            p.i += len(chunk)
            continue
        dump, clear = tracking.dump, tracking.clear_memo
        for record in chunk:
            i = p.i
            tracking.top, tracking.record = record, i
            try:
                dump(record)
            except Exception as e:
                raise unpicklable(name(i), e) from e
            clear()
            offsets.append(out.tell())
            if tracking.refers:
                flags.append(i)
            if tracking.tracked and seq is None:
                held[i] = record
            tracking.refers = tracking.tracked = False
            p.i += 1
    tracking.top = None
    if p.objects:
        _finish_objects(p, tracking, seq if seq is not None else held, flags, name)
    return p


def _finish_objects(p: Entries, tracking: Any, records: Any, flags: list[int],
                    name: Callable[[int], str]) -> None:
    """Pickle again the records that held an object found shared later (``dirty``), and the
    objects, as entry n; again until no place holds a copy of an object another place holds
    (an object inside a shared one that a record holds too is shared as well)."""
    n = p.i
    seen, found, refers = tracking.seen, tracking.found, set(flags)
    again: dict[int, tuple[bytes, list[tuple[int, memoryview]]]] = {}
    dirty = tracking.dirty | {OBJECTS}
    while dirty:
        # What the places to pickle again held is met anew there (or not, now behind a ref).
        for key in [key for key, (place, _) in seen.items() if place in dirty]:
            del seen[key]
        places, dirty = sorted(dirty), set()
        for i in places:
            out, mark = io.BytesIO(), len(p.buffers)
            pickler = _tracking(p, type(tracking), out, seen, found, dirty)
            obj = p.objects if i == OBJECTS else records[i]
            pickler.top, pickler.record, p.i = obj, i, n if i == OBJECTS else i
            try:
                pickler.dump(obj)       # (the objects: one pickle, what they share stays shared)
            except Exception as e:
                raise unpicklable("an object several records refer to" if i == OBJECTS
                                  else name(i), e) from e
            again[i] = (out.getvalue(), p.buffers[mark:])
            del p.buffers[mark:]
            if pickler.refers:
                refers.add(i)
        if dirty:
            dirty.add(OBJECTS)          # (its pickle holds every object: again, with the new)
    objects = again.pop(OBJECTS)
    if again:                          # the stream with those records in their new form
        old, offsets = p.out.getbuffer(), np.frombuffer(p.offsets, np.int64)
        lengths = np.diff(offsets)
        out, prev = io.BytesIO(), 0
        for i in sorted(again):
            out.write(old[offsets[prev]:offsets[i]])
            out.write(again[i][0])
            lengths[i], prev = len(again[i][0]), i + 1
        out.write(old[offsets[prev]:offsets[n]])
        old.release()
        p.out, p.offsets = out, array("q", [0])
        p.offsets.extend(np.cumsum(lengths).tolist())
        p.buffers = [b for b in p.buffers if b[0] not in again]
        p.buffers.extend(b for _, bufs in again.values() for b in bufs)
        p.buffers.sort(key=lambda b: b[0])          # (stable: each entry's in its order)
    p.i = n
    p.append(objects[0])
    p.buffers.extend(objects[1])                    # (entry n: the last)
    p.flags = bytearray(n)
    for i in refers:
        p.flags[i] = 1


def pickle_keys(keys: list[Any], hash_of: Callable[[Any], int]
                ) -> tuple[Entries, array[int]]:
    """A SharedDict's keys pickled (in band, each alone) and their hashes."""
    p, hashes = Entries(), array("Q")
    pickler = p.pickler(out_of_band=False)
    dump, clear, append, append_hash = pickler.dump, pickler.clear_memo, p.append, hashes.append
    for key in keys:
        try:
            append_hash(hash_of(key))
            dump(key)
        except Exception as e:
            raise unpicklable(f"SharedDict key {reprlib.repr(key)}", e) from e
        clear()
        append()
    return p, hashes


# ---------------------------------------------------------------------------- the block

def write_block(kind: int, values: Entries, keys: Entries | None,
                index: tuple[NDArray[Any], NDArray[Any], NDArray[Any], int] | None
                ) -> NDArray[np.uint8]:
    """The block of a container, sealed (``OutOfSharedMemory`` before any copy)."""
    n = len(values.offsets) - 1 - (1 if values.objects else 0)
    e, m = len(values.offsets) - 1, len(values.buffers)
    table, nbuffers = place_buffers(values.buffers)
    parts: list[Any] = [b""] * _NSECTIONS
    parts[OFFSETS] = values.offsets
    if m:
        owners = np.fromiter((i for i, _ in values.buffers), np.int64, m)
        bufindex = np.zeros(e + 1, np.int64)
        np.cumsum(np.bincount(owners, minlength=e), out=bufindex[1:])
        parts[BUFINDEX], parts[BUFTABLE] = bufindex, table
    if values.objects:
        parts[FLAGS] = values.flags
    if keys is not None and index is not None:
        parts[KEYOFFSETS], parts[HASHES], parts[ROWS], parts[DIRECTORY] = (
            keys.offsets, *index[:3])
    views = [memoryview(p).cast("B") for p in parts]
    with values.out.getbuffer() as data, \
            (keys.out if keys is not None else io.BytesIO()).getbuffer() as keydata:
        views[RECORDS], views[KEYS] = data, keydata
        lengths = [len(v) for v in views]
        lengths[BUFFERS] = nbuffers
        places, size = [], HEADER.size
        for length in lengths:
            places.append(_align(size))
            size = places[-1] + length
        k = index[3] if index is not None else 0
        sections = [x for pair in zip(places, lengths) for x in pair]

        def fill(dst: memoryview) -> None:
            for at, view in zip(places, views):
                dst[at:at + len(view)] = view
            at = places[BUFFERS]
            for (_, raw), (start, length) in zip(values.buffers, table.tolist()):
                dst[at + start:at + start + length] = raw
            HEADER.pack_into(dst, 0, MAGIC, VERSION, kind, n, m, k, len(values.objects),
                             *sections)

        mapping = segment.create_sealed(max(size, 1), fill)   # OutOfSharedMemory: no copy yet
    mem = np.frombuffer(mapping, np.uint8)
    mem.flags.writeable = False
    return mem


def place_buffers(buffers: list[tuple[int, memoryview]]) -> tuple[NDArray[np.int64], int]:
    """The (offset, length) of each buffer in the buffers section, and its length."""
    places, at = [], 0
    for _, raw in buffers:
        n = raw.nbytes
        at = _align(at, _ALIGN if n >= _ALIGN else 16)
        places.append((at, n))
        at += n
    return np.array(places, np.int64).reshape(len(buffers), 2), at


# ---------------------------------------------------------------------------- reading

class Store:
    """One sequence of pickled entries in a block: read-only views of its sections, and the
    objects its records share once this process has read them."""

    __slots__ = ("offsets", "data", "bufindex", "buftable", "buffers", "m", "flags", "n",
                 "objects", "nobjects")

    def __init__(self, offsets: memoryview, data: memoryview, bufindex: memoryview | None,
                 buftable: memoryview | None, buffers: memoryview, m: int,
                 flags: memoryview | None = None, n: int = 0, nobjects: int = 0) -> None:
        self.offsets, self.data, self.buffers, self.m = offsets, data, buffers, m
        self.bufindex, self.buftable = bufindex, buftable
        self.flags, self.n, self.nobjects = flags, n, nobjects    # (entry n: the objects)
        self.objects: list[Any] | None = None


def load(store: Store, i: int) -> Any:
    """Record ``i`` (0 <= i < n), unpickled from the block."""
    flags = store.flags
    if flags is not None and flags[i]:
        return _load_referring(store, *_entry(store, i))
    # (``_entry``'s steps, inline: this is every read of a record that refers to nothing)
    offsets = store.offsets
    start, end = offsets[i], offsets[i + 1]
    data = store.data
    if not 0 <= start <= end <= len(data):
        raise corrupt(f"record {i} at {start}:{end} lies outside its section")
    bufindex = store.bufindex
    if bufindex is None or bufindex[i] == bufindex[i + 1]:
        return pickle.loads(data[start:end])
    return pickle.loads(data[start:end], buffers=_buffers(store, bufindex[i], bufindex[i + 1]))


def _entry(store: Store, i: int) -> tuple[memoryview, list[memoryview]]:
    """The pickle of entry ``i`` and its buffers, checked."""
    start, end = store.offsets[i], store.offsets[i + 1]
    if not 0 <= start <= end <= len(store.data):
        raise corrupt(f"record {i} at {start}:{end} lies outside its section")
    bufindex = store.bufindex
    if bufindex is None:
        return store.data[start:end], []
    return store.data[start:end], _buffers(store, bufindex[i], bufindex[i + 1])


def _buffers(store: Store, first: int, end: int) -> list[memoryview]:
    if not 0 <= first <= end <= store.m:
        raise corrupt(f"buffers {first}:{end} of {store.m}")
    table, buffers, out = store.buftable, store.buffers, []
    assert table is not None
    for j in range(first, end):
        at, n = table[2 * j], table[2 * j + 1]
        if not (0 <= at and 0 <= n <= len(buffers) - at):
            raise corrupt(f"buffer {j} at {at} of {n} bytes lies outside its section")
        out.append(buffers[at:at + n])
    return out


class _Referring(pickle.Unpickler):
    """A record that refers to shared objects: each persistent id is a place in ``objects``."""

    objects: list[Any]

    def persistent_load(self, pid: Any) -> Any:
        if type(pid) is not int or not 0 <= pid < len(self.objects):
            raise corrupt(f"a record refers to shared object {pid!r} of {len(self.objects)}")
        return self.objects[pid]


_objects_lock = threading.Lock()
forks.renew_locks(globals(), "_objects_lock")     # (another thread may hold it at a fork)


def _load_referring(store: Store, data: memoryview, buffers: list[memoryview]) -> Any:
    u = _Referring(io.BytesIO(data), buffers=buffers)
    u.objects = store.objects if store.objects is not None else objects(store)
    return u.load()


def objects(store: Store) -> list[Any]:
    """The objects the records share, unpickled once in this process (by whichever thread
    comes first: they must be the same objects for every record)."""
    with _objects_lock:
        if store.objects is None:
            data, buffers = _entry(store, store.n)
            got = pickle.loads(data, buffers=buffers)
            if type(got) is not list or len(got) != store.nobjects:
                raise corrupt(f"its shared objects are a {type(got).__name__}, not a list of "
                              f"{store.nobjects}")
            store.objects = got
        return store.objects


def corrupt(what: str) -> ProtocolError:
    return ProtocolError(f"the block of a shared dataset is corrupt or hostile: {what}")


class Block:
    """A container's block as this process sees it (one per make or attach): the array over
    the shared memory, and views of its sections."""

    __slots__ = ("mem", "kind", "n", "store", "keys", "hashes", "rows", "directory", "shift",
                 "__weakref__")

    def __init__(self, mem: NDArray[np.uint8], kind: int, n: int, store: Store) -> None:
        self.mem, self.kind, self.n, self.store = mem, kind, n, store
        self.keys: Store | None = None
        self.hashes = self.rows = self.directory = memoryview(b"")
        self.shift = 64
        _live.add(self)
        _announce(mem)

    @property
    def nbytes(self) -> int:
        return len(self.mem)


# Every block this process holds (doctor: ``live``)
_live: weakref.WeakSet[Block] = weakref.WeakSet()
# The addresses of the blocks this process held when it last published its stats
_announced: set[int] = set()


def _announce(mem: NDArray[np.uint8]) -> None:
    """Publish this process's stats now if ``mem`` is a block it did not hold yet: doctor
    lists its datasets though no pass of the caches may come for a while (memory/cache.py:
    passes run at sharedmp's operations). Not again for each attach of a block it holds."""
    address = mem.__array_interface__["data"][0]
    if address in _announced:
        return
    _announced.clear()                # (forget the blocks gone: an address may be reused)
    _announced.update(b.mem.__array_interface__["data"][0] for b in list(_live))
    cache.publish()


def _expected_lengths(kind: int, n: int, m: int, k: int, s: int) -> list[int | None]:
    """The length each section must have (None: any)."""
    e = n + (1 if s else 0)
    lengths: list[int | None] = [0] * _NSECTIONS
    lengths[OFFSETS] = 8 * (e + 1)
    lengths[BUFINDEX], lengths[BUFTABLE] = (8 * (e + 1), 16 * m) if m else (0, 0)
    lengths[FLAGS] = n if s else 0
    if kind == DICT:
        lengths[KEYOFFSETS], lengths[HASHES], lengths[ROWS] = 8 * (n + 1), 8 * n, 8 * n
        lengths[DIRECTORY] = 8 * (2 ** k + 1)
        lengths[KEYS] = None
    lengths[RECORDS] = lengths[BUFFERS] = None
    return lengths


def attach(mem: Any, kind: int) -> Block:
    """The block ``mem`` (made here or received), checked: ProtocolError if it is not one of
    ``kind`` or anything in its header or indexes points outside it."""
    if not (isinstance(mem, np.ndarray) and mem.dtype == np.uint8 and mem.ndim == 1
            and mem.flags.c_contiguous and len(mem) >= HEADER.size):
        raise corrupt(f"not a block: {type(mem).__name__}")
    view = mem.data.toreadonly()
    magic, version, got, n, m, k, s, *places = HEADER.unpack_from(view)
    if magic != MAGIC or version != VERSION or got not in KIND_NAMES:
        raise corrupt(f"header {magic!r} version {version} kind {got}")
    if got != kind:
        raise corrupt(f"a {KIND_NAMES[got]}'s block where a {KIND_NAMES[kind]}'s belongs")
    size = len(view)
    if not (0 <= n <= size and 0 <= m <= size and 0 <= k <= 40 and 0 <= s <= size):
        raise corrupt(f"{n} records, {m} buffers, k = {k}, {s} shared objects in {size} bytes")
    sections = []
    for sec, expected in enumerate(_expected_lengths(kind, n, m, k, s)):
        at, length = places[2 * sec], places[2 * sec + 1]
        if at % 8 or not (HEADER.size <= at <= size and 0 <= length <= size - at) \
                or expected is not None and length != expected:
            raise corrupt(f"section {sec} at {at} of {length} bytes")
        sections.append(view[at:at + length])
    ints = [sections[sec].cast("q") for sec in (OFFSETS, BUFINDEX, BUFTABLE, KEYOFFSETS, ROWS,
                                                DIRECTORY)]
    offsets, bufindex, buftable, keyoffsets, rows, directory = ints
    _check_index(np.frombuffer(offsets, np.int64), len(sections[RECORDS]), "offsets")
    store = Store(offsets, sections[RECORDS], bufindex if m else None, buftable if m else None,
                  sections[BUFFERS], m, sections[FLAGS] if s else None, n, s)
    if m:
        _check_index(np.frombuffer(bufindex, np.int64), m, "buffer index", exact=True)
        table = np.frombuffer(buftable, np.int64).reshape(m, 2)
        if not ((table >= 0).all() and (table[:, 1] <= len(sections[BUFFERS]) - table[:, 0])
                .all()):
            raise corrupt("a buffer lies outside its section")
    block = Block(mem, kind, n, store)
    if kind == DICT:
        _check_index(np.frombuffer(keyoffsets, np.int64), len(sections[KEYS]), "key offsets")
        _check_index(np.frombuffer(directory, np.int64), n, "directory", exact=True)
        r = np.frombuffer(rows, np.int64)
        if n and not (np.min(r) >= 0 and np.max(r) < n):
            raise corrupt("a key's row lies outside the records")
        block.keys = Store(keyoffsets, sections[KEYS], None, None, memoryview(b""), 0)
        block.hashes, block.rows, block.directory = sections[HASHES].cast("Q"), rows, directory
        block.shift = 64 - k
    return block


def _check_index(a: NDArray[np.int64], limit: int, what: str, exact: bool = False) -> None:
    """That ``a`` starts at 0, never decreases and ends at ``limit`` (``exact``) or within."""
    if a[0] != 0 or a[-1] > limit or (exact and a[-1] != limit) or (a[1:] < a[:-1]).any():
        raise corrupt(f"its {what} do not rise from 0 to at most {limit}")


def shared_nbytes(store: Store) -> int:
    """The bytes of the pickle of the objects the records share (0: none)."""
    if not store.nobjects:
        return 0
    return int(store.offsets[store.n + 1] - store.offsets[store.n])


def live() -> list[dict[str, Any]]:
    """The shared datasets this process holds now, each once however many containers and
    slices view its block: [{"kind", "records", "bytes", "objects", "objects_read"}] (what
    doctor shows; ``objects``: how many objects several records share, stored once;
    ``objects_read``: whether this process holds them unpickled)."""
    found: dict[int, dict[str, Any]] = {}
    for block in list(_live):
        address = block.mem.__array_interface__["data"][0]
        entry = found.setdefault(address, {
            "kind": KIND_NAMES[block.kind], "records": block.n, "bytes": block.nbytes,
            "objects": block.store.nobjects, "objects_read": False})
        entry["objects_read"] |= block.store.objects is not None
    return list(found.values())


cache.describe("datasets", live)

"""``mp.SharedList`` and ``mp.SharedDict``: records pickled once into shared memory.

In this process: the sequence and mapping semantics, arrays inside records as read-only views
of the block, the errors (a record that cannot be pickled, too little shared memory, writing,
hostile blocks). Between processes: what children read under every start method through
sharedmp's contexts and the standard library's, that they get no copy (their Pss), that
nothing is left after the container goes or a child is SIGKILLed, and DataLoader workers.
"""
import decimal
import enum
import fractions
import gc
import mmap
import multiprocessing
import os
import pathlib
import pickle
import signal
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest

import sharedmp as mp
from sharedmp import datasets
from sharedmp.datasets import block, containers
from sharedmp.memory import named

import _dataset_workers as dw
import _workers as w
from conftest import TIMEOUT, eventually, join_or_kill, shm_files


def _round_trip(obj):
    """``obj`` pickled as a process argument or a message is (ForkingPickler), unpickled here."""
    return pickle.loads(ForkingPickler.dumps(obj))


# -- a sequence ----------------------------------------------------------------------------

def test_shared_list_reads_as_the_list():
    records = dw.make_records(100)
    plain = [r[:3] for r in records]
    s = mp.SharedList(plain)
    assert len(s) == 100 and s == plain and plain == s and s == mp.SharedList(plain)
    assert s[0] == (0, "record-0", 0.0) and s[-1] == plain[-1] and s[-100] == plain[0]
    assert list(s) == plain and list(reversed(s)) == plain[::-1]
    assert s.index(plain[42]) == 42 and s.count(plain[3]) == 1 and plain[5] in s
    assert s[np.int64(7)] == plain[7]
    for bad in (100, -101, 10**30):
        with pytest.raises(IndexError, match="SharedList index out of range"):
            s[bad]
    with pytest.raises(TypeError, match="integers or slices, not str"):
        s["1"]
    assert s != plain[:-1] and s != plain[::-1] and s != tuple(plain) and s != 3
    with pytest.raises(TypeError):
        hash(s)


def test_a_slice_is_a_shared_list_over_the_same_memory():
    plain = list(range(50))
    s = mp.SharedList(plain)
    for sl in (slice(None), slice(3, 40, 4), slice(None, None, -1), slice(-5, None),
               slice(10, 3), slice(40, 3, -7)):
        view = s[sl]
        assert type(view) is mp.SharedList and view == plain[sl] and len(view) == len(plain[sl])
        assert view._block is s._block                       # no copy
        assert _round_trip(view) == plain[sl]                 # travels as the handle + a range
    assert s[10:40][5:][::2] == plain[10:40][5:][::2]
    assert s[10:40][-1] == 39


def test_repr_empty_and_any_iterable():
    assert repr(mp.SharedList([1, "a"])) == "SharedList([1, 'a'])"
    assert repr(mp.SharedList(range(100))) == "SharedList([0, 1, 2, 3, 4, ...], len=100)"
    empty = mp.SharedList()
    assert len(empty) == 0 and list(empty) == [] and empty == []
    assert repr(empty) == "SharedList([])"
    assert mp.SharedList(x * x for x in range(5)) == [0, 1, 4, 9, 16]   # a generator: one pass
    assert _round_trip(empty) == []


def test_records_of_every_kind_come_back_equal():
    class Local:
        pass
    records = [None, True, 2**100, -1.5, "é\udcff", b"\x00" * 100, bytearray(b"ab"), [1, [2]],
               {"a": {"b": (1, 2)}}, {1, 2}, frozenset("ab"), 3 + 4j, pathlib.Path("/x"),
               Color.RED, range(3), slice(1, 2), np.float32(1.5), np.arange(4).reshape(2, 2).T]
    s = mp.SharedList(records)
    for got, want in zip(s, records):
        if isinstance(want, np.ndarray):
            assert np.array_equal(got, want) and got.flags.f_contiguous
        else:
            assert got == want and type(got) is type(want)
    with pytest.raises((AttributeError, pickle.PicklingError), match="record 1 cannot be pickled"):
        mp.SharedList([1, Local()])                 # (a local class: pickle's error kind varies)


class Color(enum.Enum):
    RED = 1
    BLUE = 2


def test_pickled_as_the_handle_of_its_memory_only():
    s = mp.SharedList(r[:3] for r in dw.make_records(50_000))
    d = mp.SharedDict(dw.make_mapping(20_000))
    assert s.nbytes > 1 << 20 and d.nbytes > 1 << 20
    for c in (s, d):
        message = ForkingPickler.dumps(c)
        assert len(message) < 1024, len(message)             # a segment handle, no record
        back = pickle.loads(message)
        assert type(back) is type(c) and back == c
        assert np.shares_memory(back._block.mem, c._block.mem)     # the same memory
    # plain pickle (a file) carries the block by value: a private copy, equal
    copy = pickle.loads(pickle.dumps(s))
    assert copy == s and not mp.is_shared(copy._block.mem)


# -- arrays, tensors and Arrow data inside records -------------------------------------------

def test_arrays_in_records_are_read_only_views_of_the_block():
    a = np.arange(1000, dtype=np.float64).reshape(10, 100)
    s = mp.SharedList([{"x": a, "y": a[:, :3].copy(), "z": np.arange(3, dtype=np.int8)}] * 3)
    mem = s._block.mem
    lo = mem.__array_interface__["data"][0]
    for record in s:
        for key in "xyz":
            v = record[key]
            assert np.array_equal(v, {"x": a, "y": a[:, :3], "z": np.arange(3)}[key])
            assert mp.is_shared(v) and not v.flags.writeable
            ptr = v.__array_interface__["data"][0]
            assert lo <= ptr and ptr + v.nbytes <= lo + len(mem)
            assert ptr % (64 if v.nbytes >= 64 else 16) == 0
        with pytest.raises(ValueError, match="read-only"):
            record["x"][0, 0] = 1.0
    x = s[0]["x"]
    del s, record
    gc.collect()
    assert x.sum() == a.sum()                     # the array keeps the memory alive


def test_arrow_data_in_records_is_zero_copy():
    pa = pytest.importorskip("pyarrow")
    table = pa.table({"n": list(range(1000)), "s": [f"v{i}" for i in range(1000)]})
    s = mp.SharedList([table, pa.py_buffer(b"x" * 4096)])
    lo = s._block.mem.__array_interface__["data"][0]
    got, buf = s[0], s[1]
    assert got.equals(table) and bytes(buf) == b"x" * 4096
    column = got.column("n").chunk(0).buffers()[1]
    assert lo <= column.address < lo + s.nbytes and lo <= buf.address < lo + s.nbytes


def test_torch_tensors_in_records_are_views_of_the_block():
    torch = pytest.importorskip("torch")
    t = torch.arange(100, dtype=torch.float32).reshape(10, 10)
    s = mp.SharedList([(t, t[2:4], t.T, torch.ones(3, dtype=torch.bfloat16),
                        torch.zeros(2, requires_grad=True))])
    got = s[0]
    assert all(torch.equal(g, e) for g, e in zip(got, (t, t[2:4], t.T))), got
    lo = s._block.mem.__array_interface__["data"][0]
    assert lo <= got[0].data_ptr() < lo + s.nbytes and mp.is_shared(got[0])
    assert torch.equal(got[3], torch.ones(3, dtype=torch.bfloat16))      # torch's own pickle
    assert got[4].requires_grad and torch.equal(got[4].detach(), torch.zeros(2))


# -- a mapping ------------------------------------------------------------------------------

def test_shared_dict_reads_as_the_dict():
    mapping = dw.make_mapping(500)
    d = mp.SharedDict(mapping)
    assert len(d) == len(mapping) and d == mapping and mapping == d
    assert list(d) == list(mapping) and list(d.keys()) == list(mapping.keys())
    assert list(d.values()) == list(mapping.values())
    assert list(d.items()) == list(mapping.items())
    assert all(d[k] == v for k, v in mapping.items())
    assert ("key-3", ["3", 3]) not in d.items() and ("key-3", [3, "3"]) in d.items()
    assert [3, "3"] in d.values() and "key-3" in d.keys() and len(d.keys()) == len(mapping)
    assert d.get("missing") is None and d.get("missing", 5) == 5 and d.get(None) == "none"
    with pytest.raises(KeyError, match="missing"):
        d["missing"]
    assert "missing" not in d and 10**6 not in d and ("tuple", 4) not in d
    assert d != {**mapping, "x": 1} and d != {k: 0 for k in mapping} and d != [1]
    assert _round_trip(d) == mapping
    assert repr(mp.SharedDict({"a": 1})) == "SharedDict({'a': 1})"
    assert mp.SharedDict() == {} and mp.SharedDict([("a", 1), ("a", 2)]) == {"a": 2}


def test_keys_equal_in_python_are_found_equal():
    d = mp.SharedDict({1: "int", "s": "str", b"s": "bytes", (1, ("a", None)): "tuple",
                       frozenset({"a", 2}): "frozenset", 2.5: "float", Color.BLUE: "enum",
                       pathlib.Path("/a/b"): "path", None: "none"})
    assert d[1.0] == d[True] == d[np.int64(1)] == d[np.True_] == d[fractions.Fraction(1)] == "int"
    assert d[decimal.Decimal("2.5")] == d[np.float32(2.5)] == d[complex(2.5)] == "float"
    assert d[np.str_("s")] == "str" and d[b"s"] == "bytes" and d[np.float64(2.5)] == "float"
    assert d[(1.0, ("a", None))] == "tuple" and d[frozenset({2.0, "a"})] == "frozenset"
    assert d[Color.BLUE] == "enum" and d[pathlib.Path("/a") / "b"] == "path"
    assert Color.RED not in d and float("nan") not in d and 3 not in d
    with pytest.raises(TypeError, match="unhashable"):
        d[[1]]


def test_many_keys_one_bucket_and_colliding_hashes():
    # Multiples of 2**40 would share the low bits; strings that share a CRC-32 one hash.
    n = 20_000
    d = mp.SharedDict({i << 40: i for i in range(n)})
    assert all(d[i << 40] == i for i in range(0, n, 97)) and (n << 40) not in d
    a, b = "plumless", "buckeroo"                 # crc32 of both is 0x4DDB0C25
    import zlib
    assert zlib.crc32(a.encode()) == zlib.crc32(b.encode())
    d = mp.SharedDict({a: 1, b: 2})
    assert d[a] == 1 and d[b] == 2 and "x" not in d


# -- errors -------------------------------------------------------------------------------

def test_writing_raises_naming_the_writable_arrays():
    s, d = mp.SharedList([1]), mp.SharedDict({"a": 1})
    for do in (lambda: s.__setitem__(0, 2), lambda: s.__delitem__(0),
               lambda: d.__setitem__("a", 2), lambda: d.__delitem__("a")):
        with pytest.raises(TypeError, match=r"read-only.*mp\.zeros"):
            do()
    for name in ("append", "extend", "sort"):
        assert not hasattr(s, name)
    for name in ("update", "pop", "setdefault", "clear"):
        assert not hasattr(d, name)


def test_a_record_that_cannot_be_pickled_is_named():
    import threading
    lock = threading.Lock()
    with pytest.raises(TypeError, match=r"SharedList record 2 cannot be pickled.*'_thread.lock'")\
            as info:
        mp.SharedList([1, 2, {"lock": lock}, 4])
    assert isinstance(info.value.__cause__, TypeError)
    with pytest.raises(TypeError, match=r"the value of SharedDict key 'k' cannot be pickled"):
        mp.SharedDict({"j": 1, "k": lock})
    with pytest.raises(pickle.PicklingError, match=r"SharedDict key <.*ValueError: not this one"):
        mp.SharedDict({Unpicklable(): 1})
    with pytest.raises(ZeroDivisionError):       # the iterable's own error goes through
        mp.SharedList(1 // (3 - i) for i in range(5))


class Unpicklable:
    def __reduce__(self):
        raise ValueError("not this one")


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_larger_than_free_shared_memory_raises_before_copying(strategy, tmp_path):
    # A record whose array is a 64 GiB sparse file mapped read-only: no memory is used
    # until the block is allocated, which must be refused.
    mp.set_sharing_strategy(strategy)
    path = tmp_path / "sparse"
    with open(path, "wb") as f:
        f.truncate(64 << 30)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    try:
        huge = np.frombuffer(mm, np.uint8)
        with pytest.raises(mp.OutOfSharedMemory, match="64.0 GiB|cannot reserve"):
            mp.SharedList([1, {"image": huge}])
        del huge
    finally:
        gc.collect()
        mm.close()


# -- hostile blocks -----------------------------------------------------------------------

class Handle:
    """A pickled container whose block a test chose (``rebuild``, ``args``)."""

    def __init__(self, rebuild, *args):
        self.rebuild, self.args = rebuild, args

    def __reduce__(self):
        return self.rebuild, self.args


def _writable_copy(container):
    mem = mp.empty(container.nbytes, np.uint8)
    mem[:] = container._block.mem
    return mem


def _header(mem):
    return list(block.HEADER.unpack_from(mem.data))


def _set_header(mem, fields):
    block.HEADER.pack_into(mem.data, 0, *fields)


def _section(fields, s):
    """(offset, length) of section ``s`` in an unpacked header."""
    return fields[7 + 2 * s], fields[8 + 2 * s]


def test_hostile_blocks_are_protocol_errors_when_attached():
    s = mp.SharedList([(i, np.arange(i + 1.0)) for i in range(20)])
    d = mp.SharedDict({i: i for i in range(20)})
    cases = []
    for change in ("magic", "kind", "n", "offset past the end", "offsets fall",
                   "section out of the block", "buffer outside"):
        mem = _writable_copy(s)
        fields = _header(mem)
        if change == "magic":
            fields[0] = b"sharedmq"
        elif change == "kind":
            fields[2] = block.DICT
        elif change == "n":
            fields[3] += 1
        elif change == "section out of the block":
            fields[7 + 2 * block.RECORDS] = len(mem) - 8
        _set_header(mem, fields)
        offsets = mem[slice(*_span(fields, block.OFFSETS))].view(np.int64)
        table = mem[slice(*_span(fields, block.BUFTABLE))].view(np.int64)
        if change == "offset past the end":
            offsets[-1] = 1 << 40
        elif change == "offsets fall":
            offsets[5] = offsets[4] - 1
        elif change == "buffer outside":
            table[7] = 1 << 50
        cases.append((change, Handle(containers._rebuild_list, mem, None)))
    cases.append(("not a block", Handle(containers._rebuild_list, b"x" * 300, None)))
    cases.append(("a dict's block", Handle(containers._rebuild_list, d._block.mem, None)))
    cases.append(("rows past the end", Handle(containers._rebuild_list, s._block.mem, range(30))))
    cases.append(("rows not a range", Handle(containers._rebuild_list, s._block.mem, [1, 2])))
    mem = _writable_copy(d)
    fields = _header(mem)
    mem[slice(*_span(fields, block.ROWS))].view(np.int64)[3] = 99
    cases.append(("a key's row", Handle(containers._rebuild_dict, mem)))
    for change, handle in cases:
        with pytest.raises(mp.ProtocolError, match="corrupt or hostile"):
            _round_trip(handle)
            pytest.fail(f"{change}: attached")


def _span(fields, s):
    at, length = _section(fields, s)
    return at, at + length


def test_a_block_changed_after_it_was_attached_is_a_protocol_error_on_reading():
    s = mp.SharedList([(i, np.arange(i + 1.0)) for i in range(20)])
    mem = _writable_copy(s)
    got = containers._rebuild_list(mem, None)
    assert len(got) == 20 and got[3][0] == 3
    fields = _header(mem)
    offsets = mem[slice(*_span(fields, block.OFFSETS))].view(np.int64)
    offsets[4] = 1 << 40
    with pytest.raises(mp.ProtocolError, match="record 3"):
        got[3]
    table = mem[slice(*_span(fields, block.BUFTABLE))].view(np.int64)
    table[2 * 9] = -5
    with pytest.raises(mp.ProtocolError, match="buffer 9"):
        got[9]
    d = mp.SharedDict({i: i for i in range(20)})
    mem = _writable_copy(d)
    got = containers._rebuild_dict(mem)
    assert got[7] == 7
    fields = _header(mem)
    mem[slice(*_span(fields, block.DIRECTORY))].view(np.int64)[:] = 1 << 40
    with pytest.raises(mp.ProtocolError, match="directory"):
        got[7]


def test_random_damage_to_the_header_and_indexes_never_crashes():
    s = mp.SharedList([(i, f"r{i}", np.arange(i % 5 + 1)) for i in range(30)])
    rng = np.random.default_rng(34)
    index_end = _header(s._block.mem)[7 + 2 * block.KEYS]     # header and int sections
    outcomes = set()
    for _ in range(300):
        mem = _writable_copy(s)
        for at in rng.integers(0, index_end, 3):
            mem[at] = rng.integers(0, 256)
        try:
            got = containers._rebuild_list(mem, None)
            list(got)
            outcomes.add("read")
        except Exception as e:          # any exception: what must not happen is a crash
            outcomes.add(type(e).__name__)
    assert "ProtocolError" in outcomes, outcomes


def test_live_lists_each_block_once_for_doctor():
    from sharedmp.cli import doctor
    gc.collect()
    assert datasets.live() == []
    s = mp.SharedList(range(1000))
    views = [s[1:], s[::2], _round_trip(s)]
    d = mp.SharedDict({"a": 1})
    found = sorted(datasets.live(), key=lambda e: e["kind"])
    assert found == [{"kind": "SharedDict", "records": 1, "bytes": d.nbytes, "objects": 0,
                      "objects_read": False},
                     {"kind": "SharedList", "records": 1000, "bytes": s.nbytes, "objects": 0,
                      "objects_read": False}]
    line = doctor._shared_datasets({"datasets": found})
    assert line == (f"; shared datasets: SharedDict of 1 records ({doctor._fmt_size(d.nbytes)}), "
                    f"SharedList of 1000 records ({doctor._fmt_size(s.nbytes)})")
    del s, views, d
    gc.collect()
    assert datasets.live() == []


# -- between processes ----------------------------------------------------------------------

@pytest.mark.parametrize("context", ["sharedmp", "multiprocessing"])
def test_children_read_the_same_records(start_method, context):
    n = 300
    s, d = mp.SharedList(dw.make_records(n)), mp.SharedDict(dw.make_mapping(n))
    ctx = (mp if context == "sharedmp" else multiprocessing).get_context(start_method)
    got = w.run(ctx, dw.read_all, s, d, n)
    assert got.pop("pid") != os.getpid()
    assert got == {k: True for k in got}, got


def test_a_container_sent_on_a_sharedmp_queue_arrives_as_its_handle():
    ctx = mp.get_context("spawn")
    s = mp.SharedList(dw.make_records(30_000))
    q = ctx.SimpleQueue()
    q.put(s)
    got = q.get()
    assert dw.same_records(got, s) and np.shares_memory(got._block.mem, s._block.mem)
    q.close()


def _measure(ctx, data, through_pipe):
    if not through_pipe:
        return w.run(ctx, dw.measure_reading, data)
    p, conn = w.start(ctx, dw.measure_reading, None, duplex=True)
    try:
        assert w.recv(p, conn)[0] == "ready"
        conn.send(data)
        return w.result(p, conn)
    finally:
        conn.close()


def test_a_child_reads_without_copying(fork_or_spawn):
    # fork: the child inherits what the parent holds (a list's pages are copied as its reads
    # write the reference counts); spawn: it is sent through a sharedmp Pipe.
    ctx = mp.get_context(fork_or_spawn)
    n = 200_000
    records = [(i, f"record-{i}", i * 0.25) for i in range(n)]
    shared = mp.SharedList(records)
    plain = _measure(ctx, records, fork_or_spawn == "spawn")
    del records
    gc.collect()
    mine = _measure(ctx, shared, fork_or_spawn == "spawn")
    assert plain["count"] == mine["count"] == n
    # The child maps the block the parent made: half of each page it touches is its Pss.
    # The child maps the block the parent made: half of each page it reads is its Pss, and
    # none of it is private. The plain list: the child's own copy (spawn), or the pages its
    # reads copied (fork: its Pss grows by half of them, shared with the parent before).
    print(f"child's growth reading {n} records ({fork_or_spawn}): SharedList of "
          f"{shared.nbytes >> 10} KiB: {mine}; list: {plain}")
    assert mine["pss"] < 0.75 * shared.nbytes, (mine, shared.nbytes)
    # (fork: the plain list's Pss grows by half of the pages its reads copy, those pages
    # having been shared with the parent before: against what it copied)
    assert mine["pss"] < plain["private_dirty"] / 2, (mine, plain)
    assert mine["private_dirty"] < 4 << 20, mine
    assert plain["private_dirty"] > shared.nbytes, plain    # (3.14 fork: 1.6x, 3.11: > 2x)


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_nothing_is_left_after_the_container_goes(strategy):
    mp.set_sharing_strategy(strategy)
    before = shm_files()
    s = mp.SharedList(dw.make_records(20_000))
    d = mp.SharedDict(dw.make_mapping(20_000))
    assert s.nbytes > 1 << 20                                 # a segment of its own
    assert shm_files() == before            # sealed memfds under both strategies: no name
    kept = s[10][3]                      # an array of a record keeps the block's memory
    del s, d
    gc.collect()
    assert np.array_equal(kept, np.arange(10, 26, dtype=np.float32))
    del kept
    gc.collect()
    if strategy == "file_system":
        assert eventually(lambda: shm_files() == before)
    assert datasets.live() == []


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_nothing_is_left_after_a_child_holding_it_is_killed(strategy):
    mp.set_sharing_strategy(strategy)
    ctx = mp.get_context("spawn")
    s = mp.SharedList(dw.make_records(20_000))
    p, conn = w.start(ctx, dw.hold_until_killed, s)
    try:
        assert w.recv(p, conn) == ("holding", "record-19999")
        os.kill(p.pid, signal.SIGKILL)
        assert join_or_kill(p) == -signal.SIGKILL
    finally:
        conn.close()
    p = multiprocessing.get_context("fork").Process(target=dw.kill_self, args=(s,))
    p.start()
    assert join_or_kill(p) == -signal.SIGKILL
    assert s[5][1] == "record-5"         # the parent's is intact; the leak check follows
    del s


# -- torch's DataLoader ---------------------------------------------------------------------

def test_dataloader_workers_read_the_shared_records(start_method):
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader
    records = dw.make_records(200)
    dataset = dw.RecordsDataset(records)
    message = ForkingPickler.dumps(dataset)                  # what each worker gets: the handle
    assert len(message) < 1024 and len(pickle.loads(message).records) == 200
    loader = DataLoader(dataset, batch_size=8, num_workers=2, collate_fn=dw.as_list,
                        multiprocessing_context=mp.get_context(start_method), timeout=TIMEOUT)
    got = [r for batch in loader for r in batch]
    assert dw.same_records(got, records)
    assert all(isinstance(r[3], np.ndarray) and not r[3].flags.writeable
               for r in got if len(r) == 4)
    del loader
    assert torch is not None


def test_doctor_lists_the_datasets_another_process_holds():
    # A process publishes its datasets with its stats; doctor reads them from another process.
    import subprocess
    import sys
    from sharedmp.cli import doctor
    code = ("import sys, sharedmp as mp\n"
            "s = mp.SharedList(range(1000))\n"
            "print(s.nbytes, flush=True)\n"
            "sys.stdin.read()\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        nbytes = int(p.stdout.readline())

        def listed():
            return [q["datasets"] for q in doctor.survey_processes() if q["pid"] == p.pid]
        assert eventually(lambda: listed() == [[{"kind": "SharedList", "records": 1000,
                                                  "bytes": nbytes, "objects": 0,
                                                  "objects_read": False}]], TIMEOUT), listed()
    finally:
        p.kill()
        p.wait(TIMEOUT)
        p.stdin.close()
        p.stdout.close()


# -- mp.share_dataset ----------------------------------------------------------------------

class Dataset:
    """A dataset object as users write them: nothing of sharedmp in it."""

    def __init__(self, n):
        self.records = [(i, f"record-{i}", i * 0.25) for i in range(n)]
        self.pairs = tuple((i, -i) for i in range(n))
        self.labels = {f"key-{i}": i % 7 for i in range(n)}
        self.features = np.arange(n * 8, dtype=np.float32).reshape(n, 8)
        self.small = [1, 2, 3]
        self.root = "/data"
        self.transform = len
        self.ids = set(range(10))


def _by_name(report):
    return {e.name: e for e in report}


def test_share_dataset_converts_large_attributes_and_says_what_it_left():
    n = 100_000
    ds = Dataset(n)
    records, pairs, labels, features = ds.records, ds.pairs, ds.labels, ds.features.copy()
    report = mp.share_dataset(ds, report=True)
    assert isinstance(report, datasets.ShareReport)
    got = _by_name(report)
    assert {e.name for e in report.converted} == {"records", "pairs", "labels", "features"}
    assert {e.name for e in report.left} == {"small", "root", "transform", "ids"}
    assert got["records"].to == "SharedList" and got["pairs"].to == "SharedList"
    assert got["labels"].to == "SharedDict" and got["features"].to == "ndarray"
    assert got["records"].nbytes == ds.records.nbytes and got["records"].kind == f"list of {n}"
    assert "small" in got["small"].why and "threshold 1.0 MiB" in got["small"].why
    assert got["transform"].why == "code, not data" and got["ids"].why.startswith("a set")
    assert "no shared form keeps it a str" in got["root"].why
    text = str(report)
    assert text.startswith("share_dataset: 4 converted, 4 left") and "features: ndarray ->" in text
    # equal to what they were, in their shared forms
    assert type(ds.records) is mp.SharedList and ds.records == records
    assert type(ds.pairs) is mp.SharedList and list(ds.pairs) == list(pairs)
    assert type(ds.labels) is mp.SharedDict and ds.labels == labels
    assert mp.is_shared(ds.features) and np.array_equal(ds.features, features)
    assert ds.features.flags.writeable                  # (mp.share: writes are seen by all)
    assert ds.small == [1, 2, 3] and ds.transform is len
    # a second call converts nothing
    again = mp.share_dataset(ds, report=True)
    assert again.converted == [] and len(again) == len(report)
    assert all("shared already" in e.why for e in again if e.name in got and got[e.name].to)
    assert mp.share_dataset(ds) is ds


def test_share_dataset_threshold_and_one_object_under_two_names():
    ds = Dataset(1000)                               # every attribute under 1 MiB
    assert mp.share_dataset(ds, report=True).converted == []
    assert type(ds.records) is list
    ds.alias = ds.features
    report = _by_name(mp.share_dataset(ds, threshold=0, report=True))
    assert type(ds.records) is mp.SharedList and type(ds.small) is mp.SharedList
    assert ds.alias is ds.features and mp.is_shared(ds.features)    # one shared copy
    assert report["alias"].why == "the same object as features"
    for bad, error in ((-1, ValueError), (1.5, TypeError), ("1", TypeError), (True, TypeError)):
        with pytest.raises(error, match="threshold"):
            mp.share_dataset(Dataset(10), bad)


def test_share_dataset_sends_handles_only():
    pd = pytest.importorskip("pandas")
    pa = pytest.importorskip("pyarrow")
    n = 100_000
    ds = Dataset(n)
    # Strings as pandas 3 makes them by default (Arrow-backed), named so that pandas 2.3
    # (Python 3.10) makes them too: its default is an object column, which stays private.
    strings = pd.StringDtype("pyarrow", na_value=np.nan)
    ds.frame = pd.DataFrame({"id": np.arange(n), "score": np.linspace(0, 1, n),
                             "name": pd.array([f"name-{i}" for i in range(n)], dtype=strings)})
    ds.table = pa.table({"id": np.arange(n), "name": [f"name-{i}" for i in range(n)]})
    frame, table = ds.frame.copy(), ds.table
    before = {}
    for name, value in (("frame", frame), ("table", table)):
        message = ForkingPickler.dumps(value)
        before[name] = len(message)
        pickle.loads(message)                # (fetches the fds it lent: none is left open)
    report = _by_name(mp.share_dataset(ds, report=True))
    assert report["frame"].to == "DataFrame" and report["table"].to == "Table"
    assert ds.frame.equals(frame) and ds.table.equals(table)
    for name in ("records", "labels", "features", "frame", "table"):
        value = getattr(ds, name)
        message = ForkingPickler.dumps(value)
        assert len(message) < 4096, (name, len(message), before)      # handles, no data
        back = pickle.loads(message)
        assert type(back) is type(value), name
        if name == "frame":
            assert back.equals(frame)
            assert np.shares_memory(back["score"].to_numpy(), ds.frame["score"].to_numpy())
            mine = ds.frame["name"].array._pa_array.chunk(0).buffers()[2]
            theirs = back["name"].array._pa_array.chunk(0).buffers()[2]
            assert theirs.address == mine.address            # the same mapping, no copy
        elif name == "table":
            assert back.equals(table)
            assert back.column("name").chunk(0).buffers()[2].address == \
                ds.table.column("name").chunk(0).buffers()[2].address
        elif name == "features":
            assert np.shares_memory(back, value)
        else:
            assert back == value
    assert before["frame"] > 1 << 20 and before["table"] > 1 << 20     # (by value before)


def test_share_dataset_polars_frames():
    pl = pytest.importorskip("polars")
    pytest.importorskip("pyarrow")
    n = 200_000
    ds = Dataset(10)
    ds.frame = pl.DataFrame({"id": np.arange(n), "name": [f"a-longer-name-{i}" for i in range(n)]})
    ds.series = pl.Series("score", np.linspace(0, 1, n))
    frame, series = ds.frame.clone(), ds.series.clone()
    report = _by_name(mp.share_dataset(ds, report=True))
    assert report["frame"].to == "DataFrame" and report["series"].to == "Series"
    assert ds.frame.equals(frame) and ds.series.equals(series)
    for value in (ds.frame, ds.series):
        message = ForkingPickler.dumps(value)
        assert len(message) < 4096, len(message)
        assert pickle.loads(message).equals(value)
    assert mp.share_dataset(ds, report=True).converted == []


def test_share_dataset_walks_nested_torch_datasets():
    pytest.importorskip("torch")
    from torch.utils.data import ConcatDataset, Subset
    import _dataset_torch as dt
    a, b = dt.PlainDataset(50_000, frame=False), dt.PlainDataset(50_000, frame=False)
    subset = Subset(ConcatDataset([a, b]), list(range(0, 100_000, 3)))
    expected = [subset[i] for i in (0, 1, 20_000, -1)]
    report = _by_name(mp.share_dataset(subset, report=True))
    assert {"dataset.datasets[0].records", "dataset.datasets[1].features", "indices"} <= {
        e.name for e in report.values() if e.to}, str(report)
    assert report["dataset.datasets"].why.startswith("datasets, each walked")
    assert report["dataset"].why.startswith("a torch dataset: walked")
    assert type(a.records) is mp.SharedList and mp.is_shared(b.features)
    assert type(subset.indices) is mp.SharedList
    assert [subset[i] for i in (0, 1, 20_000, -1)] == expected
    # a few tensors in a tuple: each moved into shared memory in place, the tuple kept
    import torch
    from torch.utils.data import TensorDataset
    x, y = torch.arange(400_000.0).reshape(100_000, 4), torch.arange(100_000)
    tensors = TensorDataset(x, y)
    report = _by_name(mp.share_dataset(tensors, report=True))
    assert report["tensors"].to == "tuple" and tensors.tensors == (x, y)
    assert type(tensors.tensors) is tuple and tensors.tensors[0] is x
    assert mp.is_shared(x) and mp.is_shared(y) and torch.equal(tensors[7][0], x[7])
    again = _by_name(mp.share_dataset(tensors, report=True))
    assert again["tensors"].to is None and "shared already" in again["tensors"].why


def test_share_dataset_bad_input_and_records_that_cannot_be_pickled():
    import threading
    for bad, names in (([1, 2], "mp.SharedList"), ((1,), "mp.SharedList"),
                       ({"a": 1}, "mp.SharedDict"), (np.zeros(3), r"mp.share\(a\)"),
                       (3, "mp.SharedList"), ("text", "mp.SharedList"),
                       (object(), "mp.SharedList")):
        with pytest.raises(TypeError, match=names):
            mp.share_dataset(bad)
    pd = pytest.importorskip("pandas")
    with pytest.raises(TypeError, match="share the object that holds it"):
        mp.share_dataset(pd.DataFrame({"a": [1]}))
    ds = Dataset(10)
    ds.features = np.zeros(1 << 20)
    ds.records = [1, 2, {"lock": threading.Lock()}, 4] * 100_000
    with pytest.raises(TypeError, match=r"attribute 'records': SharedList record 2 cannot be "
                                        r"pickled.*'_thread.lock'") as info:
        mp.share_dataset(ds)
    assert isinstance(info.value.__cause__, TypeError)
    assert type(ds.records) is list and not mp.is_shared(ds.features)     # nothing replaced


def test_dataloader_workers_of_an_unchanged_dataset_read_shared_memory(start_method):
    pytest.importorskip("torch")
    pytest.importorskip("pandas")
    from torch.utils.data import DataLoader
    import _dataset_torch as dt
    n = 100_000
    dataset = mp.share_dataset(dt.PlainDataset(n))
    assert type(dataset.records) is mp.SharedList and mp.is_shared(dataset.features)
    message = ForkingPickler.dumps(dataset)                  # what a spawned worker gets
    assert len(message) < 8192, len(message)
    assert len(pickle.loads(message)) == n                   # (and fetch the fds it lent)
    del message
    loader = DataLoader(dataset, batch_size=1000, num_workers=2, collate_fn=dt.collate,
                        multiprocessing_context=mp.get_context(start_method), timeout=TIMEOUT)
    samples, facts = [], {}
    for batch, worker in loader:
        samples.extend(batch)
        facts[worker["pid"]] = worker
    assert [r for r, _ in samples] == dt.make_records(n)
    assert [x for _, x in samples] == [8.0 * i + 1 for i in range(n)]
    assert len(facts) == 2 and os.getpid() not in facts
    for worker in facts.values():
        assert worker["records"] == "SharedList" and worker["features_equal"], worker
        assert worker["features_shared"] and worker["features_in_segment"], worker
        assert worker["frame"] == {"id": True, "name": True} and worker["frame_equal"], worker
    del loader


def _shm_bytes():
    """Bytes the sharedmp files in the shm directory take (file_system segments)."""
    d = named.shm_dir()
    total = 0
    for name in os.listdir(d):
        if name.startswith(named.PREFIX):
            try:
                total += os.stat(os.path.join(d, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def _hold(ctx, dataset, k):
    """Start ``k`` children that hold ``dataset``: their reports, the shm bytes while they
    hold it, and their processes and conns (to release)."""
    started = [w.start(ctx, dw.hold_dataset, dataset, duplex=True) for _ in range(k)]
    reports = [w.recv(p, conn) for p, conn in started]
    assert all(r[0] == "holding" for r in reports), reports
    # Each one's Pss once all hold it: a share among the processes that touched it (what a
    # reader says as it starts depends on how many others had touched it by then)
    for (p, conn), (_, report) in zip(started, reports):
        conn.send("pss")
        report["pss"] = w.recv(p, conn)
    return [r[1] for r in reports], _shm_bytes(), started


def _release(started):
    for p, conn in started:
        conn.send("go")
    try:
        for p, conn in started:
            assert w.result(p, conn) is None
    finally:
        for p, conn in started:
            conn.close()


def test_a_shared_dataset_sent_to_more_workers_adds_no_memory():
    # file_system: every segment is a file in the shm directory, whose bytes tell what was
    # made. A plain array is copied into shared memory each time it is pickled for a child;
    # after share_dataset, each child gets the handle of the one copy.
    mp.set_sharing_strategy("file_system")
    ctx = mp.get_context("spawn")
    nbytes = 8 << 20
    plain = dw.Holder(20_000, nbytes)
    base = _shm_bytes()
    reports, held, started = _hold(ctx, plain, 4)
    _release(started)
    plain_added = held - base
    assert plain_added >= 4 * nbytes, plain_added              # a copy for each child
    del reports, started
    gc.collect()
    assert eventually(lambda: _shm_bytes() <= base + (1 << 20), TIMEOUT)

    dataset = mp.share_dataset(dw.Holder(20_000, nbytes))
    base = _shm_bytes()
    figures = {}
    for k in (1, 4):
        reports, held, started = _hold(ctx, dataset, k)
        try:
            assert held - base < 1 << 20, (k, held - base)            # nothing new
            for r in reports:
                assert r["shared"] and r["in_segment"] and r["count"] == 20_000, r
                assert r["private_dirty"] < 1 << 20, r                  # no copy
                assert r["sum"] == float(dataset.features.sum())
            figures[k] = ([r["pss"] >> 10 for r in reports], (held - base) >> 10)
        finally:
            _release(started)
    print(f"a {nbytes >> 20} MiB array: plain, 4 children: +{plain_added >> 10} KiB of shared "
          f"memory; shared (Pss growth of each child KiB, shm added KiB): 1 child "
          f"{figures[1]}, 4 children {figures[4]}")
    # each child's Pss of the array: its share among the processes that touched it
    assert max(figures[4][0]) < max(figures[1][0])


def test_a_killed_program_with_dataloader_workers_leaves_nothing(tmp_path):
    # The whole program SIGKILLed while its spawned DataLoader workers hold a SharedList and
    # a shared array (file_system, a shm directory of its own): the workers die with it
    # (sharedmp's Process), the daemon unlinks every segment and exits.
    pytest.importorskip("torch")
    import select
    import subprocess
    import sys
    from sharedmp.memory import leftovers, manager
    tests = os.path.dirname(os.path.abspath(__file__))
    code = ("import sys, time\n"
            f"sys.path.insert(0, {tests!r})\n"
            "import sharedmp as mp\n"
            "from sharedmp.memory import manager\n"
            "from torch.utils.data import DataLoader\n"
            "import _dataset_torch as dt\n"
            "ds = mp.share_dataset(dt.PlainDataset(50_000, frame=False))\n"
            "assert type(ds.records) is mp.SharedList and mp.is_shared(ds.features)\n"
            "loader = DataLoader(ds, batch_size=100, num_workers=2, collate_fn=dt.collate,\n"
            "                    multiprocessing_context=mp.get_context('spawn'))\n"
            "it = iter(loader)\n"
            "batches = [next(it) for _ in range(4)]\n"
            "print(manager.daemon_pid(), *[p.pid for p in it._workers], flush=True)\n"
            "time.sleep(60)\n")
    shm = tmp_path / "shm"
    shm.mkdir()
    env = {k: v for k, v in os.environ.items() if k != manager.ENV}
    env[named.SHM_DIR_ENV] = str(shm)
    env[mp.strategy.ENV] = "file_system"
    # (its stderr to a file: the standard resource tracker it leaves behind says what it
    # cleaned up once the program is gone, which is not this test's business)
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                stderr=err, text=True)
    pids = []
    try:
        try:
            ready = select.select([proc.stdout], [], [], TIMEOUT)[0]
            line = proc.stdout.readline() if ready else ""
            pids = [int(x) for x in line.split()]
            assert len(pids) == 3, (f"the program did not start its workers: {line!r}\n"
                                    f"{(tmp_path / 'stderr').read_text()}")
            with open(f"/proc/{proc.pid}/maps") as f:       # the dataset: sealed memfds
                assert "/memfd:sharedmp-sealed" in f.read()
        finally:
            proc.kill()                         # SIGKILL: the program alone, not its workers
            proc.wait(TIMEOUT)
            proc.stdout.close()

        def clean():
            listed = [n for n in os.listdir(shm) if n.startswith(named.PREFIX)]
            pooled = [n for p in leftovers.pool_dirs(str(shm)) for n in os.listdir(p)]
            return not listed and not pooled and not any(_alive(pid) for pid in pids)
        assert eventually(clean, TIMEOUT), (os.listdir(shm), [_alive(p) for p in pids])
    finally:
        for pid in pids:                       # (the daemon and workers, should they be left)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_the_example_program_runs():
    pytest.importorskip("torch")                     # (its DataLoader workers)
    import sys
    from conftest import run_bounded
    path = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "shared_dataset.py")
    code, out, err = run_bounded([sys.executable, path, "--records", "20000", "--workers", "2"],
                                 TIMEOUT, what="shared_dataset.py")
    assert code == 0, err
    assert "records: list of 20000 -> SharedList" in out
    assert "plain list:" in out and "share_dataset: parent" in out

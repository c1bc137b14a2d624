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
    return list(datasets._HEADER.unpack_from(mem.data))


def _set_header(mem, fields):
    datasets._HEADER.pack_into(mem.data, 0, *fields)


def _section(fields, s):
    """(offset, length) of section ``s`` in an unpacked header."""
    return fields[6 + 2 * s], fields[7 + 2 * s]


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
            fields[2] = datasets.DICT
        elif change == "n":
            fields[3] += 1
        elif change == "section out of the block":
            fields[6 + 2 * datasets.RECORDS] = len(mem) - 8
        _set_header(mem, fields)
        offsets = mem[slice(*_span(fields, datasets.OFFSETS))].view(np.int64)
        table = mem[slice(*_span(fields, datasets.BUFTABLE))].view(np.int64)
        if change == "offset past the end":
            offsets[-1] = 1 << 40
        elif change == "offsets fall":
            offsets[5] = offsets[4] - 1
        elif change == "buffer outside":
            table[7] = 1 << 50
        cases.append((change, Handle(datasets._rebuild_list, mem, None)))
    cases.append(("not a block", Handle(datasets._rebuild_list, b"x" * 300, None)))
    cases.append(("a dict's block", Handle(datasets._rebuild_list, d._block.mem, None)))
    cases.append(("rows past the end", Handle(datasets._rebuild_list, s._block.mem, range(30))))
    cases.append(("rows not a range", Handle(datasets._rebuild_list, s._block.mem, [1, 2])))
    mem = _writable_copy(d)
    fields = _header(mem)
    mem[slice(*_span(fields, datasets.ROWS))].view(np.int64)[3] = 99
    cases.append(("a key's row", Handle(datasets._rebuild_dict, mem)))
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
    got = datasets._rebuild_list(mem, None)
    assert len(got) == 20 and got[3][0] == 3
    fields = _header(mem)
    offsets = mem[slice(*_span(fields, datasets.OFFSETS))].view(np.int64)
    offsets[4] = 1 << 40
    with pytest.raises(mp.ProtocolError, match="record 3"):
        got[3]
    table = mem[slice(*_span(fields, datasets.BUFTABLE))].view(np.int64)
    table[2 * 9] = -5
    with pytest.raises(mp.ProtocolError, match="buffer 9"):
        got[9]
    d = mp.SharedDict({i: i for i in range(20)})
    mem = _writable_copy(d)
    got = datasets._rebuild_dict(mem)
    assert got[7] == 7
    fields = _header(mem)
    mem[slice(*_span(fields, datasets.DIRECTORY))].view(np.int64)[:] = 1 << 40
    with pytest.raises(mp.ProtocolError, match="directory"):
        got[7]


def test_random_damage_to_the_header_and_indexes_never_crashes():
    s = mp.SharedList([(i, f"r{i}", np.arange(i % 5 + 1)) for i in range(30)])
    rng = np.random.default_rng(34)
    index_end = _header(s._block.mem)[6 + 2 * datasets.KEYS]     # header and int sections
    outcomes = set()
    for _ in range(300):
        mem = _writable_copy(s)
        for at in rng.integers(0, index_end, 3):
            mem[at] = rng.integers(0, 256)
        try:
            got = datasets._rebuild_list(mem, None)
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
    assert found == [{"kind": "SharedDict", "records": 1, "bytes": d.nbytes},
                     {"kind": "SharedList", "records": 1000, "bytes": s.nbytes}]
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
    assert mine["pss"] < plain["pss"] / 2, (mine, plain)
    assert mine["private_dirty"] < 4 << 20, mine
    assert plain["private_dirty"] > 2 * shared.nbytes, plain


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_nothing_is_left_after_the_container_goes(strategy):
    mp.set_sharing_strategy(strategy)
    before = shm_files()
    s = mp.SharedList(dw.make_records(20_000))
    d = mp.SharedDict(dw.make_mapping(20_000))
    assert s.nbytes > 1 << 20                                 # a segment of its own
    if strategy == "file_system":
        assert len(shm_files() - before) == 2
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
                                                  "bytes": nbytes}]], TIMEOUT), listed()
    finally:
        p.kill()
        p.wait(TIMEOUT)
        p.stdin.close()
        p.stdout.close()

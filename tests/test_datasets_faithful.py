"""Shared datasets are safe and faithful (issue 42): no process can rewrite a block, objects
that several records share are stored once and stay one object, views stay views, and what a
worker writes stays its own, as with a plain dataset; changes that would be lost raise.

Each test here failed before: blocks were writable by any process of the user, a shared
object was copied into each record, views became copies, and a worker's writes reached every
process.
"""
import ast
import gc
import mmap
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sharedmp as mp
from sharedmp.memory import named, segment

import _dataset_workers as dw
import _workers as w
from conftest import TIMEOUT, shm_files

VOCAB = {f"k{i}": i for i in range(5000)}


# -- sealed blocks -----------------------------------------------------------------------------

# Run by another program of the same user, without sharedmp: try every way to write the
# blocks the test process holds (its memfds through /proc, any file of the shm directory);
# print the inodes of the files it could write.
TAMPER = textwrap.dedent("""
    import mmap, os, sys
    pid, shm = int(sys.argv[1]), sys.argv[2]
    paths = [f"/proc/{pid}/fd/{n}" for n in os.listdir(f"/proc/{pid}/fd")
             if "memfd:" in os.readlink(f"/proc/{pid}/fd/{n}")]
    paths += [os.path.join(shm, n) for n in os.listdir(shm) if n.startswith("sharedmp_")]
    wrote = set()
    for path in paths:
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            try:
                os.pwrite(fd, b"X" * 64, 4096)
                wrote.add(os.fstat(fd).st_ino)
            except OSError:
                pass
            try:
                with mmap.mmap(fd, 8192, mmap.MAP_SHARED, mmap.PROT_WRITE) as m:
                    m[4096:4160] = b"Y" * 64
                wrote.add(os.fstat(fd).st_ino)
            except (OSError, ValueError):
                pass
        finally:
            os.close(fd)
    print(len(paths), sorted(wrote))
""")


def _segment(container):
    """(Segment, mapping) of a container's block."""
    return segment.containing(container._block.mem.__array_interface__["data"][0],
                              container.nbytes)


def _inode(container):
    seg, _ = _segment(container)
    return os.fstat(seg.fd).st_ino if seg.fd >= 0 else os.stat(seg.path).st_ino


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_no_other_process_can_write_a_block(strategy):
    mp.set_sharing_strategy(strategy)
    records = [(i, f"record-{i}", np.full(8, i)) for i in range(2000)]
    s = mp.SharedList(records)
    d = mp.SharedDict({f"key-{i}": r for i, r in enumerate(records)})
    proc = subprocess.run([sys.executable, "-I", "-c", TAMPER, str(os.getpid()),
                           named.shm_dir()], capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    count, wrote = proc.stdout.split(" ", 1)
    assert int(count) >= 2                    # it found the blocks
    assert not {_inode(s), _inode(d)} & set(ast.literal_eval(wrote))
    for got in (list(s), [d[f"key-{i}"] for i in range(len(records))]):
        assert all(a[:2] == b[:2] and np.array_equal(a[2], b[2]) for a, b in zip(got, records))
    seg, _ = _segment(s)                      # how: a memfd sealed against writes
    assert seg.kind == "file_descriptor" and segment.sealed(seg.fd, segment.SEALED)


def test_this_process_cannot_write_a_block_either():
    s = mp.SharedList([(i, "x" * 100) for i in range(1000)])
    seg, mapping = _segment(s)
    with pytest.raises(PermissionError):
        os.pwrite(seg.fd, b"X", 100)
    with pytest.raises(PermissionError):
        mmap.mmap(seg.fd, seg.size, mmap.MAP_SHARED, mmap.PROT_WRITE)
    with pytest.raises(ValueError, match="read-only"):
        s._block.mem[100] = 1
    # a copy-on-write write into the process's own mapping changes that process only
    private, at = np.frombuffer(mapping, np.uint8), seg.size - 1
    was = os.pread(seg.fd, 1, at)
    private[at] = was[0] ^ 0xFF
    assert os.pread(seg.fd, 1, at) == was and s._block.mem[at] == was[0] ^ 0xFF


# -- objects several records share -------------------------------------------------------------

def _records_sharing():
    pair = [VOCAB, "pair"]
    return [(i, VOCAB, pair) for i in range(200)]


def test_an_object_several_records_share_is_stored_once_and_stays_one():
    records = _records_sharing()
    s = mp.SharedList(records)
    assert s.nbytes < 200 << 10, s.nbytes          # one copy of the vocabulary (10 MiB before)
    a, b = s[0], s[1]
    assert a == records[0] and a[1] is b[1] and a[2] is b[2] and a[2][0] is a[1]
    assert s[0][1] is s[-1][1]                    # read at any time, through any slice
    assert s[5:][0][1] is s[1][1]
    assert list(s) == records
    assert mp.SharedList(iter(records)) == records          # read once: a generator too
    d = mp.SharedDict({"x": (VOCAB, 1), "y": (VOCAB, 2)})
    assert d.nbytes < 200 << 10 and d["x"][0] is d["y"][0]


def test_readers_in_other_processes_see_one_object_too(fork_or_spawn):
    s = mp.SharedList(_records_sharing())
    d = mp.SharedDict({"x": (VOCAB, 1), "y": (VOCAB, 2)})
    got = w.run(mp.get_context(fork_or_spawn), dw.identity_facts, s, d)
    assert got == {"same": True, "equal": True, "dict_same": True, "pair": True}


def test_cycles_between_shared_objects():
    a, b = {"name": "a"}, {"name": "b"}
    a["other"], b["other"] = b, a
    s = mp.SharedList([(a,), (b,), (a, b)])
    x, y, z = s[0][0], s[1][0], s[2]
    assert x["other"] is y and y["other"] is x and z[0] is x and z[1] is y


def _labels(records):
    """Each record's structure, objects (not values) named by the order they are met in: two
    lists of records with the same labels share the same objects the same way."""
    names, out = {}, []

    def walk(x):
        if isinstance(x, (int, float, str, bytes, type(None))):
            return repr(x)
        key = id(x)
        if key in names:
            return f"@{names[key]}"
        names[key] = len(names)
        if isinstance(x, dict):
            return f"#{names[key]}{{" + ",".join(f"{k!r}:{walk(v)}" for k, v in x.items()) + "}"
        return f"#{names[key]}{type(x).__name__}(" + ",".join(walk(v) for v in x) + ")"
    for r in records:
        out.append(walk(r))
    return out


# Records made of a few objects some of them share (lists, dicts, tuples, nested).
_leaf = st.one_of(st.integers(-5, 5), st.text(max_size=3), st.none())


@st.composite
def _shared_records(draw):
    pool = []
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["list", "dict", "tuple"]))
        parts = draw(st.lists(st.one_of(_leaf, st.sampled_from(pool) if pool else _leaf),
                              max_size=4))
        pool.append(parts if kind == "list" else tuple(parts) if kind == "tuple"
                    else {f"f{i}": v for i, v in enumerate(parts)})
    part = st.one_of(_leaf, st.sampled_from(pool)) if pool else _leaf
    n = draw(st.integers(0, 40))
    return [tuple(draw(st.lists(part, max_size=4))) for _ in range(n)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_shared_records(), st.booleans())
def test_records_read_back_share_objects_as_the_list_did(records, generator):
    s = mp.SharedList(iter(records) if generator else records)
    got = list(s)
    assert got == records
    assert _labels(got) == _labels(records)
    del got, s
    gc.collect()


# Chunks of 4,096 records (``block._CHUNK``) of builtin containers of values are pickled
# apart, at C speed; the others by the tracking pickler. Whole chunks of each kind, in any
# order (and a last one cut short), must read back as the records, types and sharing kept.
def _chunk_of(kind, start, size, pool):
    if kind == "values":
        makers = [lambda i: (i, f"r{i}", i / 3), lambda i: {"i": i, "b": b"%d" % i},
                  lambda i: [i, None, True, 1j], lambda i: {i, -i}, lambda i: frozenset((i,)),
                  lambda i: f"s{i}", lambda i: i, lambda i: ()]
        return [makers[i % len(makers)](i) for i in range(start, start + size)]
    if kind == "arrays":
        return [np.full(3, i) if i % 2 else (i, np.arange(i % 5)) for i in range(start, start + size)]
    return [(i, pool[i % len(pool)]) for i in range(start, start + size)]      # "shared"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(["values", "arrays", "shared"]), min_size=1, max_size=4),
       st.integers(1, 4096), st.booleans())
def test_chunks_of_each_kind_read_back_as_the_records(kinds, last, generator):
    pool = [[1, 2], {"k": [3]}]
    pool.append((pool[0], pool[1]))
    records = []
    for j, kind in enumerate(kinds):
        size = last if j == len(kinds) - 1 else 4096
        records += _chunk_of(kind, len(records), size, pool)
    s = mp.SharedList(iter(records) if generator else records)
    got = list(s)
    assert len(got) == len(records)
    for g, r in zip(got, records):
        assert type(g) is type(r)
        if isinstance(r, np.ndarray):
            assert np.array_equal(g, r)
        elif isinstance(r, tuple) and r and isinstance(r[-1], np.ndarray):
            assert g[0] == r[0] and np.array_equal(g[1], r[1])
        else:
            assert g == r
    if "shared" in kinds:
        shared = [g for g, r in zip(got, records) if isinstance(r, tuple) and len(r) == 2
                  and any(r[1] is x for x in pool)]
        assert _labels(shared) == _labels([r for r in records if isinstance(r, tuple)
                                           and len(r) == 2 and any(r[1] is x for x in pool)])
    del got, s
    gc.collect()


# -- views and private writes ------------------------------------------------------------------

def test_views_of_one_array_stay_views_of_one_copy():
    ds = dw.ArrayDataset(4096)                      # 2 MiB; first_half 1 MiB, every_other too
    data = ds.data.copy()
    report = mp.share_dataset(ds, report=True)
    assert {e.name: e.to for e in report} == {"data": "ndarray", "first_half": "ndarray",
                                              "every_other": "ndarray"}
    assert np.shares_memory(ds.first_half, ds.data) and np.shares_memory(ds.every_other, ds.data)
    assert np.array_equal(ds.data, data) and np.array_equal(ds.every_other, data[::2])
    seg, _ = segment.containing(ds.data.__array_interface__["data"][0], ds.data.nbytes)
    assert seg.size < ds.data.nbytes + 4096          # one copy (1.5x and 2x before)
    small = dw.ArrayDataset(64)                     # a small view of a large array goes with it
    small.data = ds_big = np.zeros((4096, 64))
    small.first_half, small.every_other = ds_big[:2], ds_big[::1000]
    report = mp.share_dataset(small, report=True)
    assert [e.to for e in report] == ["ndarray"] * 3
    assert "shared with data, every_other, as before" in report[1].why


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_workers_writes_stay_its_own(method):
    ds = mp.share_dataset(dw.ArrayDataset(4096))
    before = ds.data[:4, 0].copy()
    ctx = mp.get_context(method)
    one = w.run(ctx, dw.views_and_writes, ds, [0, 1])
    two = w.run(ctx, dw.views_and_writes, ds, [2])
    assert one["views"] and two["views"] and one["shared"] and two["shared"]
    assert one["values"] == [0.5, 64.5, 128.0, 192.0] and one["first_half"] == 0.5
    assert two["values"] == [0.0, 64.0, 128.5, 192.0]    # not the first worker's writes
    assert np.array_equal(ds.data[:4, 0], before)         # nor the parent's
    ds[3]                                                # the parent's stay its own too
    three = w.run(ctx, dw.views_and_writes, ds, [1])
    assert three["values"][3] == (192.5 if method == "fork" else 192.0)    # (inherited)
    assert three["values"][:3] == [0.0, 64.5, 128.0]


def test_dataloader_workers_augment_in_place_privately(start_method):
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader
    ds = mp.share_dataset(dw.ArrayDataset(4096))
    loader = DataLoader(ds, batch_size=256, num_workers=2, timeout=TIMEOUT,
                        multiprocessing_context=mp.get_context(start_method))
    for _ in range(2):                              # two epochs: each row augmented twice
        rows = torch.cat(list(loader))
        assert torch.equal(rows[:, 1:] - rows[:, :1], torch.arange(1.0, 64).expand(4096, 63))
    assert rows[0, 0].item() == 0.5                  # new workers each epoch: a fresh copy
    assert ds.data[0, 0] == 0.0                      # the parent's data is as it was


# -- changes that would be lost ----------------------------------------------------------------

def test_changing_a_read_only_container_says_where_changes_belong():
    class Records:
        def __init__(self, records):
            self.records = records
    ds = Records([(i, {"label": i}) for i in range(20_000)])
    report = mp.share_dataset(ds, report=True)
    assert [e.name for e in report.read_only] == ["records"]
    assert "read-only now: records" in str(report) and "before mp.share_dataset" in str(report)
    with pytest.raises(TypeError, match=r"before mp.share_dataset \(or mp.SharedList"):
        ds.records[0] = (0, {"label": 99})
    with pytest.raises(TypeError, match=r"before mp.share_dataset \(or mp.SharedDict"):
        mp.SharedDict({"a": 1})["a"] = 2
    record = ds.records[0]
    record[1]["label"] = 99                         # the reader's own copy, as documented
    assert ds.records[0][1]["label"] == 0


def test_no_shared_memory_file_is_left_by_sealed_blocks():
    before = shm_files()
    mp.set_sharing_strategy("file_system")
    s = mp.SharedList(_records_sharing())
    ds = mp.share_dataset(dw.ArrayDataset(4096))
    assert shm_files() == before                     # memfds: nothing named to leak
    del s, ds
    gc.collect()

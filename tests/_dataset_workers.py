"""Functions that run in child processes of tests/test_datasets.py (and the records they check).

A spawned child imports this module, numpy and sharedmp, not pytest, nor torch unless the
test is about torch. Each target reports through a Pipe end (``_workers._guard``).
"""
import gc
import os
import signal
import time

import numpy as np

import sharedmp as mp

from _workers import TIMEOUT, _guard


def make_records(n):
    """The records the tests share: (int, str, float) tuples; every 10th has an array."""
    return [(i, f"record-{i}", i * 0.25) if i % 10 else
            (i, f"record-{i}", i * 0.25, np.arange(i, i + 16, dtype=np.float32))
            for i in range(n)]


def make_mapping(n):
    """{key: value} with keys of several types."""
    out = {f"key-{i}": [i, str(i)] for i in range(n)}
    out.update({i: -i for i in range(0, n, 7)})
    out[("tuple", 3)] = None
    out[None] = "none"
    return out


def same_records(got, expected):
    """Whether two sequences of records hold the same values (arrays compared by value)."""
    if len(got) != len(expected):
        return False
    for a, b in zip(got, expected):
        if len(a) != len(b) or a[:3] != b[:3]:
            return False
        if len(a) == 4 and not np.array_equal(a[3], b[3]):
            return False
    return True


def read_all(conn, shared_list, shared_dict, n):
    """Read every record and value; report whether they are equal to what the parent shared
    and whether the arrays in records are read-only views of shared memory."""
    def run():
        expected = make_records(n)
        arrays = [r[3] for r in shared_list if len(r) == 4]
        mapping = make_mapping(n)
        return {"records_equal": same_records(list(shared_list), expected),
                "indexing_equal": same_records([shared_list[i] for i in range(-n, 0)], expected),
                "slice_equal": same_records(list(shared_list[5:n:3]), expected[5:n:3]),
                "dict_equal": shared_dict == mapping,
                "lookups_equal": all(shared_dict[k] == v for k, v in mapping.items()),
                "arrays_shared": all(mp.is_shared(a) for a in arrays) and len(arrays) > 0,
                "arrays_read_only": not any(a.flags.writeable for a in arrays),
                "pid": os.getpid()}
    _guard(conn, run)


def smaps():
    """{field: bytes} of this process's /proc/self/smaps_rollup (Pss, Private_Dirty, ...)."""
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def measure_reading(conn, data):
    """Pss and Private_Dirty of this process before and after reading every record of
    ``data`` (a Process argument; None: received through ``conn`` after the first figure)."""
    def run():
        gc.collect()
        before = smaps()
        if data is None:
            conn.send(("ready", None))
            if not conn.poll(TIMEOUT):
                raise TimeoutError("nothing received")
            got = conn.recv()
        else:
            got = data
        count = sum(1 for _ in got)
        gc.collect()
        after = smaps()
        return {"count": count, "pss": after["Pss"] - before["Pss"],
                "private_dirty": after["Private_Dirty"] - before["Private_Dirty"]}
    _guard(conn, run)


def hold_until_killed(conn, shared_list):
    """Read one record, say so, and wait to be SIGKILLed."""
    def run():
        conn.send(("holding", shared_list[len(shared_list) - 1][1]))
        time.sleep(TIMEOUT)
        return None
    _guard(conn, run)


def kill_self(shared_list):
    """Read a record, then SIGKILL this process (no cleanup of any kind)."""
    shared_list[0]
    os.kill(os.getpid(), signal.SIGKILL)


class RecordsDataset:
    """A map-style dataset (no torch import: DataLoader needs only ``__getitem__``, ``__len__``)
    holding its records in a SharedList."""

    def __init__(self, records):
        self.records = mp.SharedList(records)

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        return self.records[i]


def as_list(batch):
    """DataLoader collate_fn: the samples as they are."""
    return list(batch)


class Holder:
    """A dataset object that knows nothing of sharedmp: records in a list (an array in every
    10th), features in a NumPy array of ``nbytes``."""

    def __init__(self, n, nbytes):
        self.records = make_records(n)
        self.features = np.arange(nbytes // 8, dtype=np.float64)

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        return self.records[i]


def hold_dataset(conn, dataset):
    """Read the features and every record; report the growth of this process's Pss and
    Private_Dirty, and whether the features lie in sharedmp memory; hold the dataset until
    the parent says so."""
    def run():
        from sharedmp.memory import segment
        gc.collect()
        before = smaps()
        f = dataset.features
        total = float(f.sum())
        count = sum(1 for _ in dataset.records)
        gc.collect()
        after = smaps()
        address = f.__array_interface__["data"][0]
        conn.send(("holding", {
            "pid": os.getpid(), "count": count, "sum": total, "shared": mp.is_shared(f),
            "in_segment": segment.containing(address, f.nbytes)[0] is not None,
            "pss": after["Pss"] - before["Pss"],
            "private_dirty": after["Private_Dirty"] - before["Private_Dirty"]}))
        while True:                   # "pss": the growth now, once every reader holds it
            if not conn.poll(TIMEOUT):
                raise TimeoutError("the parent did not let go")
            if conn.recv() != "pss":
                return None
            conn.send(smaps()["Pss"] - before["Pss"])
    _guard(conn, run)


# -- issue 42: sealed, faithful datasets -----------------------------------------------------

class ArrayDataset:
    """A dataset of one array and views of it, as users write them."""

    def __init__(self, n):
        self.data = np.arange(n * 64, dtype=np.float64).reshape(n, 64)
        self.first_half = self.data[: n // 2]
        self.every_other = self.data[::2]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        self.data[i] += 0.5              # in-place augmentation: private to each worker
        return self.data[i].copy()


def identity_facts(conn, shared_list, shared_dict):
    """What a reader sees of the objects records share: identities and values."""
    def run():
        a, b, c = shared_list[0], shared_list[1], shared_list[-1]
        v1, v2 = shared_dict["x"], shared_dict["y"]
        return {"same": a[1] is b[1] is c[1], "equal": a[1] == {f"k{i}": i for i in range(5000)},
                "dict_same": v1[0] is v2[0], "pair": a[2] is b[2] and a[2][0] is a[1]}
    _guard(conn, run)


def views_and_writes(conn, dataset, rows):
    """Write into the dataset's array in place (``__getitem__``), then report what this process
    sees: whether the views still view the array, and the rows' first values."""
    def run():
        for i in rows:
            dataset[i]
        return {"views": bool(np.shares_memory(dataset.first_half, dataset.data)
                              and np.shares_memory(dataset.every_other, dataset.data)),
                "first_half": float(dataset.first_half[rows[0], 0]),
                "shared": mp.is_shared(dataset.data),
                "values": [float(dataset.data[i, 0]) for i in range(4)]}
    _guard(conn, run)


def first_record(conn, shared_list):
    def run():
        return shared_list[0]
    _guard(conn, run)

"""Functions that joblib's workers run in tests/test_joblib.py.

In a module of their own so that a spawned or forkserver worker imports numpy and
sharedmp (and joblib when a test nests a call), not pytest and the test module.
"""
import os

import numpy as np

import sharedmp as mp
from sharedmp.arrays import mapping_of
from sharedmp.memory import segment


def where(a):
    """(segment key, byte offset in it) of ndarray ``a``'s memory, or None if not shared.

    The key of a memfd segment is its (st_dev, st_ino): two processes with the same key
    map the same memory. A named segment's key is its name."""
    mapping, seg = mapping_of(a)
    if seg is None:
        return None
    return seg.key, a.__array_interface__["data"][0] - seg.address


def tensor_where(t):
    """(segment key, byte offset) of a torch CPU tensor's memory, or None if not sharedmp's."""
    seg, mm = segment.containing(t.data_ptr(), max(t.untyped_storage().nbytes(), 1))
    return None if seg is None else (seg.key, t.data_ptr() - seg.address)


def fill_slot(a, i):
    """Write slot ``i`` of the shared array ``a`` in place; this worker's pid."""
    a[i] = i + 1
    return os.getpid()


def fill_tensor(t, i):
    t[i] = i + 1
    return tensor_where(t), os.getpid()


def look(a):
    """Where the worker's view of ``a`` lies, whether it is shared, and a checksum."""
    return where(a), mp.is_shared(a), float(a[::4096].sum()), a.flags.writeable


def look_nested(items, mapping, key):
    """Where the arrays in a list, a dict and a tuple keyword lie (all the same copy)."""
    found = (items[1], mapping["x"], key[0])
    assert not any(a.flags.writeable for a in found)
    return [where(a) for a in found]


def scale_and_sum(a, i):
    a[i] = -1.0                   # into a copy, if ``a`` was not shared in the parent
    return where(a), float(a[i + 1:i + 3].sum())


def make_block(i, n):
    """A fresh array made in the worker: it comes back as shared memory."""
    return np.full(n, i, dtype=np.float32)


def fail(i):
    if i == 3:
        raise ValueError(f"task {i} failed in pid {os.getpid()}")
    return i


def pid(_):
    return os.getpid()


def nested(i):
    """A Parallel call inside a worker: joblib runs it sequentially in the worker."""
    import warnings

    import joblib

    import sharedmp.joblib  # noqa: F401  (a spawned worker registers the backend too)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with joblib.parallel_config(backend="sharedmp", n_jobs=2):
            out = joblib.Parallel()(joblib.delayed(pid)(j) for j in range(3))
    return i, out, os.getpid(), [str(w.message) for w in caught]


_initialised = None


def init(value):
    global _initialised
    _initialised = value


def initialised(_):
    return _initialised


def sleep(seconds):
    """A task that outlives the call's timeout (the pool must be killed under it)."""
    import time
    time.sleep(seconds)
    return os.getpid()


def pid_or_fail(i):
    """This worker's pid; task 1 raises (the call aborts)."""
    if i == 1:
        raise ValueError("task 1 fails")
    return os.getpid()


def call_in_child(q):
    """In a forked child: the pools it sees kept warm (the parent's must not be its own) and
    the pids of a Parallel call of its own."""
    import joblib

    import sharedmp.joblib  # noqa: F401
    from sharedmp.memory import cache
    inherited = cache.processes()
    with joblib.parallel_config(backend="sharedmp", n_jobs=2):
        pids = joblib.Parallel(timeout=60)(joblib.delayed(pid)(i) for i in range(8))
    q.put((inherited, sorted(set(pids))))

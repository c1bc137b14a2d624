"""Contexts, the drop-in surface, Pool and ProcessPoolExecutor, with real processes.

sharedmp.get_context(method) is the standard context of its start method with
Queue/SimpleQueue/JoinableQueue/Pipe/Pool/Process replaced; everything else in
``multiprocessing.__all__`` is the very same object in sharedmp. Pools built on it
carry arrays as shared memory both ways. Every wait is bounded.
"""
import concurrent.futures
import multiprocessing
import multiprocessing.pool
import os
import sys

import numpy as np
import pytest

import sharedmp as mp
from sharedmp.channels import connection, queues
from sharedmp.processes import context

import _channel_workers as cw
import _process_workers as w
from conftest import FORK_AND_SPAWN, START_METHODS, TIMEOUT, join_or_kill

OVERRIDDEN = {"Queue", "SimpleQueue", "JoinableQueue", "Pipe", "Pool", "Process", "get_context"}


# -- contexts ------------------------------------------------------------------------------

def test_context_factories_are_sharedmp(start_method):
    ctx = mp.get_context(start_method)
    std = multiprocessing.get_context(start_method)
    assert isinstance(ctx, type(std))                    # usable wherever the standard one is
    assert ctx.get_start_method() == start_method
    assert mp.get_context(start_method) is ctx
    assert ctx.get_context() is ctx
    assert ctx.get_context("spawn") is mp.get_context("spawn")
    assert type(ctx.Queue()) is queues.Queue
    assert type(ctx.Queue(3)) is queues.Queue and ctx.Queue(3)._maxsize == 3
    assert type(ctx.JoinableQueue()) is queues.JoinableQueue
    assert type(ctx.SimpleQueue()) is queues.SimpleQueue
    a, b = ctx.Pipe()
    r, w = ctx.Pipe(duplex=False)
    for c in (a, b, r, w):
        assert type(c) is connection.Connection
        c.close()
    assert not r.writable and not w.readable
    assert issubclass(ctx.Process, context._CarryStrategy)
    assert issubclass(ctx.Process, type(std.Process()))  # the standard Process of that method
    assert ctx.Process.__module__ == "sharedmp.processes.context"
    assert type(ctx).Pool is context._Channels.Pool
    # the standard parts are the standard ones
    assert type(ctx.Lock()) is type(std.Lock())
    assert type(ctx.Event()) is type(std.Event())


def _public(cls):
    return {n for n in dir(cls) if not n.startswith("_")}


def test_processes_have_the_public_methods_of_this_pythons(start_method):
    """No more, no fewer than the standard Process of the running Python: 3.14's interrupt()
    (SIGINT, through the standard Popen) comes by inheritance; 3.11-3.13 have none."""
    ctx, std = mp.get_context(start_method), multiprocessing.get_context(start_method)
    assert _public(ctx.Process) == _public(std.Process)
    assert _public(mp.Process) == _public(multiprocessing.Process)
    assert hasattr(ctx.Process, "interrupt") == (sys.version_info >= (3, 14))


def test_get_context_unknown_method():
    with pytest.raises(ValueError) as info:
        mp.get_context("nope")
    for name in ("'nope'", "fork", "spawn", "forkserver"):
        assert name in str(info.value)
    with pytest.raises(ValueError, match="forkserver"):
        mp.get_context("spawn").get_context("nope")


def test_get_context_none_is_the_default_start_method():
    assert mp.get_context(None) is mp.get_context(multiprocessing.get_start_method())
    assert mp.get_context() is mp.get_context(None)


def test_module_level_factories_use_the_default_start_method():
    for f, t in ((mp.Queue, queues.Queue), (mp.JoinableQueue, queues.JoinableQueue),
                 (mp.SimpleQueue, queues.SimpleQueue)):
        assert type(f()) is t
    a, b = mp.Pipe()
    assert type(a) is connection.Connection
    a.close()
    b.close()
    previous = multiprocessing.get_start_method(allow_none=True)
    try:
        for method in ("fork", "spawn"):
            multiprocessing.set_start_method(method, force=True)
            q = mp.Queue()
            # the queue's semaphore was made by that method's context (fork: unlinked at once,
            # so nameless; _is_fork_ctx says so too from 3.11)
            assert (q._sem._semlock.name is None) == (method == "fork")
            assert mp.get_context() is mp.get_context(method)
    finally:
        multiprocessing.set_start_method(previous, force=True)


def test_every_multiprocessing_name_is_exported():
    missing = [n for n in multiprocessing.__all__ if not hasattr(mp, n)]
    assert not missing
    assert set(multiprocessing.__all__) <= set(mp.__all__)
    different = [n for n in multiprocessing.__all__
                 if n not in OVERRIDDEN and getattr(mp, n) is not getattr(multiprocessing, n)]
    assert not different, different
    assert issubclass(mp.Process, multiprocessing.Process)     # dies with its parent (pdeath)
    for name in ("Lock", "RLock", "Event", "Condition", "Semaphore", "Manager",
                 "Value", "Array", "Barrier", "current_process", "cpu_count",
                 "set_start_method", "get_start_method", "TimeoutError", "BufferTooShort"):
        assert getattr(mp, name) is getattr(multiprocessing, name), name
    for name in OVERRIDDEN:
        assert getattr(mp, name) is not getattr(multiprocessing, name), name
    for name in ("Queue", "JoinableQueue", "SimpleQueue", "Pipe", "Pool", "Process",
                 "get_context"):
        assert getattr(mp, name).__module__ == "sharedmp.processes.context"


# -- channels in children ------------------------------------------------------------------

def test_channels_as_process_arguments(start_method):
    """spawn/forkserver: pickled while spawning (DupFd); fork: inherited."""
    ctx = mp.get_context(start_method)
    q, sq, jq = ctx.Queue(), ctx.SimpleQueue(), ctx.JoinableQueue()
    mine, theirs = ctx.Pipe()
    reader, writer = ctx.Pipe(duplex=False)
    p = ctx.Process(target=cw.use_channels, args=(q, sq, jq, theirs, reader), daemon=True)
    p.start()
    theirs.close()
    reader.close()
    try:
        tag, a = q.get(timeout=TIMEOUT)
        assert tag == "queue" and a.tolist() == [1.0, 1.0] and mp.is_shared(a)
        assert sq._reader.poll(TIMEOUT)
        tag, a = sq.get()
        assert tag == "simple" and a.tolist() == [2.0, 2.0]
        tag, a = jq.get(timeout=TIMEOUT)
        assert tag == "joinable" and a.tolist() == [3.0, 3.0]
        jq.task_done()
        assert mine.poll(TIMEOUT)
        tag, a = mine.recv()
        assert tag == "pipe" and a.tolist() == [4.0, 4.0]
        shared = mp.zeros(3)
        writer.send(shared)
        assert mine.poll(TIMEOUT)
        assert mine.recv() == ("done", "sharedmp.channels.queues", "sharedmp.channels.connection")
        assert shared.tolist() == [1.0, 1.0, 1.0]           # the child's write, in our memory
        assert join_or_kill(p) == 0
    finally:
        join_or_kill(p)
        mine.close()
        writer.close()
    for x in (q, jq):
        x.close()
        x.join_thread()


def test_strategy_carried_into_a_forkserver_child():
    """The forkserver may predate set_sharing_strategy: the Process object carries it."""
    ctx = mp.get_context("forkserver")
    warm = ctx.Process(target=cw.pid_of, args=(0,), daemon=True)  # the server starts before
    warm.start()
    assert join_or_kill(warm) == 0
    mp.set_sharing_strategy("file_system")
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=cw.strategy_child, args=(q, done), daemon=True)
    p.start()
    try:
        name, kind, a, b = q.get(timeout=TIMEOUT)
        assert name == "file_system" and kind == "file_system"
        assert mp.is_shared(a) and a.tolist() == [3.0] * 5
        assert mp.is_shared(b) and b.shape == (256, 1024) and (b == 2.0).all()
        a[0] = 9                                      # still mapped and writable here
        done.set()                                    # the child may release (and unlink) now
        assert join_or_kill(p) == 0
        assert a[0] == 9 and (b == 2.0).all()         # our mapping outlives the name
    finally:
        done.set()
        join_or_kill(p)
    del a, b
    q.close()
    q.join_thread()


def test_a_forkserver_child_attaches_named_arguments_with_its_parents_daemon():
    # The fork server predates the daemon, so its children's environment names none: had the
    # child attached the argument with a daemon of its own, that one would have unlinked the
    # name once the child left (and the second child found it gone).
    ctx = mp.get_context("forkserver")
    warm = ctx.Process(target=cw.pid_of, args=(0,), daemon=True)
    warm.start()
    assert join_or_kill(warm) == 0
    mp.set_sharing_strategy("file_system")
    out = mp.full(2, -1, dtype=np.int64)
    name = mp.arrays.mapping_of(out)[1].path
    mp.start_processes(w.fill_index, args=(out,), nprocs=2, start_method="forkserver")
    assert out.tolist() == [1, 2] and os.path.exists(name)


def test_default_strategy_in_children(start_method):
    ctx = mp.get_context(start_method)
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=cw.strategy_child, args=(q, done), daemon=True)
    p.start()
    try:
        name, kind, a, b = q.get(timeout=TIMEOUT)
        assert name == kind == "file_descriptor"
        assert a.tolist() == [3.0] * 5 and (b == 2.0).all()
        done.set()
        assert join_or_kill(p) == 0
    finally:
        done.set()
        join_or_kill(p)
    del a, b
    q.close()
    q.join_thread()


# -- Pool ----------------------------------------------------------------------------------

# A Pool of each start method's context, and the module-level mp.Pool (the default method).
POOLS = [*START_METHODS, "default"]
# A worker per task: under forkserver (each worker imports sharedmp again, as under spawn)
# that is 4 s more for little; fork and spawn are the two ends.
POOLS_OF_MANY_WORKERS = [*FORK_AND_SPAWN, "default"]


def make_pool(which, *args, **kwargs):
    if which == "default":
        return mp.Pool(*args, **kwargs)
    return mp.get_context(which).Pool(*args, **kwargs)


@pytest.mark.parametrize("which", POOLS)
def test_pool_with_arrays(which):
    arrays = [mp.full(3, float(i)) for i in range(6)]
    plain = [np.full(2, i) for i in range(4)]            # small: they travel by value
    with make_pool(which, 2) as pool:
        assert isinstance(pool, multiprocessing.pool.Pool)
        assert type(pool._inqueue) is queues.SimpleQueue
        assert type(pool._outqueue) is queues.SimpleQueue

        got = pool.map_async(cw.double, arrays).get(TIMEOUT)
        assert [g.tolist() for g in got] == [[2.0 * i] * 3 for i in range(6)]
        assert not any(mp.is_shared(g) for g in got)       # fresh and small: by value

        it = pool.imap(cw.double, plain)
        got = [it.next(timeout=TIMEOUT) for _ in plain]
        assert [g.tolist() for g in got] == [[2 * i] * 2 for i in range(4)]
        with pytest.raises(StopIteration):
            it.next(timeout=TIMEOUT)

        it = pool.imap_unordered(cw.double, arrays)
        got = sorted(float(it.next(timeout=TIMEOUT)[0]) for _ in arrays)
        assert got == [2.0 * i for i in range(6)]

        got = pool.starmap_async(cw.add, zip(arrays, arrays[::-1])).get(TIMEOUT)
        assert all(g.tolist() == [5.0] * 3 for g in got)

        r = pool.apply_async(cw.add, (arrays[2], plain[1][:1]))
        assert r.get(TIMEOUT).tolist() == [3.0] * 3

        assert pool.map_async(cw.is_shared, arrays + plain).get(TIMEOUT) == [True] * 6 + [False] * 4
        big = [np.full(10_000, i) for i in range(2)]      # 80 KB: shared memory
        assert pool.map_async(cw.is_shared, big).get(TIMEOUT) == [True] * 2

        made = pool.map_async(cw.make_full_shared, range(5)).get(TIMEOUT)
        for i, (shared_there, a) in enumerate(made):
            assert shared_there and mp.is_shared(a) and a.tolist() == [i] * 3
        del made, got

        target = mp.zeros(10)
        pids = pool.starmap_async(cw.write_into, [(target, i) for i in range(10)]).get(TIMEOUT)
        assert target.tolist() == [i + 1.0 for i in range(10)]   # the workers' writes, here
        assert os.getpid() not in pids
        pool.close()
        pool.join()


@pytest.mark.parametrize("which", POOLS)
def test_pool_initializer(which):
    with make_pool(which, 2, initializer=cw.init_worker, initargs=(mp.full(2, 7),)) as pool:
        got = pool.map_async(cw.get_init, range(4)).get(TIMEOUT)
        assert all(v.tolist() == [7, 7] and pid != os.getpid() for v, pid in got)
        del got


@pytest.mark.parametrize("which", POOLS_OF_MANY_WORKERS)
def test_pool_maxtasksperchild_1(which):
    with make_pool(which, 2, maxtasksperchild=1) as pool:
        got = pool.map_async(cw.pid_and_full, range(20), chunksize=1).get(TIMEOUT)
        assert [a.tolist() for _, a in got] == [[i] * 3 for i in range(20)]
        assert all(mp.is_shared(a) for _, a in got)         # made by workers that have exited
        assert len({pid for pid, _ in got}) == 20           # a fresh worker for every task
        del got


def test_pool_worker_exception_reaches_the_caller():
    with make_pool("fork", 1) as pool:
        r = pool.apply_async(cw.add, (mp.zeros(2), mp.zeros(3)))    # shapes do not broadcast
        with pytest.raises(ValueError):
            r.get(TIMEOUT)
        assert pool.apply_async(cw.add, (1, 2)).get(TIMEOUT) == 3


def test_process_pool_executor_with_a_sharedmp_context():
    ctx = mp.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=2, mp_context=ctx) as ex:
        a = mp.full(4, 1.5)
        r = ex.submit(cw.double, a).result(timeout=TIMEOUT)
        assert r.tolist() == [3.0] * 4 and not mp.is_shared(r)      # small: by value
        r = ex.submit(cw.double, mp.full(10_000, 1.5)).result(timeout=TIMEOUT)
        assert r.tolist() == [3.0] * 10_000 and mp.is_shared(r)
        got = list(ex.map(cw.double, [np.arange(3) + i for i in range(5)], timeout=TIMEOUT))
        assert [g.tolist() for g in got] == [[2 * (j + i) for j in range(3)] for i in range(5)]
        made = list(ex.map(cw.make_full_shared, range(3), timeout=TIMEOUT))
        assert all(s and mp.is_shared(m) and m.tolist() == [i] * 3
                   for i, (s, m) in enumerate(made))
        target = mp.zeros(6)
        list(ex.map(cw.write_into, [target] * 6, range(6), timeout=TIMEOUT))
        assert target.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
        del r, got, made

"""Process helpers: spawn()/start_processes(), children that die with their parent, fork safety.

The parent-death tests run a real main process (``_orphan_driver.py``) and SIGKILL it;
its children are not ours, so these tests find them through /proc, kill what is left
by pid (checking the start time, so a reused pid is never hit) and check that nothing
of the driver's process tree survives.
"""
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import sharedmp as mp
from sharedmp.errors import ProcessException
from sharedmp.processes import pdeath

import _process_workers as w
from _helpers import eventually, proc_stat as _stat
from conftest import TIMEOUT, fork_and_wait, join_or_kill, run_bounded

HERE = os.path.dirname(os.path.abspath(__file__))
DRIVER = os.path.join(HERE, "_orphan_driver.py")


# -- /proc helpers ---------------------------------------------------------------------------

def descendants(root):
    """{pid: start time} of every process below ``root`` now."""
    children = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None and st[0] not in "ZX":
                children.setdefault(st[1], []).append((int(name), st[2]))
    out, todo = {}, [root]
    while todo:
        for pid, start in children.get(todo.pop(), []):
            out[pid] = start
            todo.append(pid)
    return out


def alive(procs):
    """The pids of ``procs`` ({pid: start time}) that still run (not zombies, not reused)."""
    out = []
    for pid, start in procs.items():
        st = _stat(pid)
        if st is not None and st[2] == start and st[0] not in "ZX":
            out.append(pid)
    return out


def wait_gone(procs, timeout):
    """Poll until none of ``procs`` runs; return those still running after ``timeout``."""
    deadline = time.monotonic() + timeout
    while (left := alive(procs)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


def watchers(procs):
    """The pids among ``procs`` that are pdeath's watcher (by its program's text)."""
    out = []
    for pid in procs:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"pidfd_send_signal" in f.read():
                    out.append(pid)
        except OSError:
            pass
    return out


def kill_all(procs):
    for pid in alive(procs):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not wait_gone(procs, 10), "could not kill the leftovers"


def wait_for(predicate, timeout=TIMEOUT, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}", pytrace=False)
        time.sleep(0.02)


def ready_pids(where):
    return sorted(int(n[6:]) for n in os.listdir(where) if n.startswith("ready-") and "." not in n)


def start_driver(where, *args, keep_orphans=False):
    env = dict(os.environ)
    env.pop(pdeath.ENV, None)
    if keep_orphans:
        env[pdeath.ENV] = "1"
    err = open(os.path.join(where, "driver.err"), "w")
    with err:
        return subprocess.Popen([sys.executable, DRIVER, str(where), *args], env=env,
                                stdout=subprocess.DEVNULL, stderr=err, cwd=HERE)


def driver_errors(where):
    with open(os.path.join(where, "driver.err")) as f:
        return f.read()[-3000:]


def run_tree(where, keep_orphans):
    """Start the driver's tree, wait until every child runs, SIGKILL the driver.

    Returns ({pid: start time} of the whole tree below the driver, the children's pids,
    the pids of the driver's watchers before the kill).
    """
    driver = start_driver(where, "tree", keep_orphans=keep_orphans)
    tree = {}
    try:
        info = os.path.join(where, "driver.json")
        wait_for(lambda: os.path.exists(info) or driver.poll() is not None, what="the driver")
        assert driver.poll() is None, driver_errors(where)
        with open(info) as f:
            n = json.load(f)["n"]
        wait_for(lambda: len(ready_pids(where)) == n, what=f"{n} children to run")
        tree = descendants(driver.pid)
        children = ready_pids(where)
        assert set(children) <= set(tree)
        # Children started from threads that have ended are still alive.
        assert sorted(alive({p: tree[p] for p in children})) == children
        watching = watchers(tree)
        os.kill(driver.pid, signal.SIGKILL)
        assert driver.wait(TIMEOUT) == -signal.SIGKILL
        return tree, children, watching
    except BaseException:
        kill_all(tree)
        raise
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(TIMEOUT)


# -- parent death ----------------------------------------------------------------------------

@pytest.mark.skipif(not pdeath.HAVE_PDEATHSIG, reason="PR_SET_PDEATHSIG is Linux only")
def test_sigkilled_main_process_leaves_no_child(tmp_path):
    tree, children, watching = run_tree(str(tmp_path), keep_orphans=False)
    try:
        # one watcher, for the children started by the fork server or from other threads
        assert len(watching) == 1, watching
        left = wait_gone(tree, 2)
        assert not left, f"alive 2 s after the main process was SIGKILLed: {left} (children {children})"
    finally:
        kill_all(tree)


@pytest.mark.skipif(not pdeath.HAVE_PDEATHSIG, reason="PR_SET_PDEATHSIG is Linux only")
def test_keep_orphans_lets_children_outlive_the_parent(tmp_path):
    tree, children, watching = run_tree(str(tmp_path), keep_orphans=True)
    try:
        assert watching == []
        time.sleep(1.0)       # the signal comes within milliseconds when it comes
        assert sorted(alive({p: tree[p] for p in children})) == children
    finally:
        kill_all(tree)


@pytest.mark.skipif(not pdeath.HAVE_PDEATHSIG, reason="PR_SET_PDEATHSIG is Linux only")
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
@pytest.mark.parametrize("start_from", ["main", "thread"])      # prctl, or the watcher
def test_child_whose_parent_died_before_it_armed_never_runs(tmp_path, method, start_from):
    where = str(tmp_path)
    driver = start_driver(where, "early", method, *(["thread"] if start_from == "thread" else []))
    try:
        assert driver.wait(TIMEOUT) == -signal.SIGKILL, driver_errors(where)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(TIMEOUT)
    with open(os.path.join(where, "child.pid")) as f:
        pid = int(f.read())
    st = _stat(pid)
    child = {pid: st[2]} if st is not None else {}
    try:
        # 1 s to unpickle its arguments, then it must find its parent gone and die.
        assert not wait_gone(child, 10), driver_errors(where)
        assert not os.path.exists(os.path.join(where, "ran")), "the orphan ran its target"
    finally:
        kill_all(child)


@pytest.mark.skipif(not pdeath.HAVE_PDEATHSIG, reason="PR_SET_PDEATHSIG is Linux only")
def test_forkserver_child_outlives_a_killed_fork_server():
    # A forkserver child dies with the process that started it, not with the fork server
    # (its OS parent, a helper): with the server SIGKILLed, the standard library starts
    # another and running children go on (CPython's test_forkserver_sigkill).
    from multiprocessing import forkserver
    ctx = mp.get_context("forkserver")
    go = ctx.Event()
    here, there = ctx.Pipe()
    p = ctx.Process(target=w.wait_then_report, args=(there, go, TIMEOUT))
    p.start()
    try:
        assert here.poll(TIMEOUT) and here.recv() == p.pid
        server = forkserver._forkserver._forkserver_pid
        assert server and _stat(p.pid)[1] == server          # the child's OS parent
        os.kill(server, signal.SIGKILL)
        # (not reaped here: the standard library reaps it as it starts the next server)
        assert eventually(lambda: _stat(server)[0] == "Z", TIMEOUT, collect=False)
        time.sleep(0.3)                      # a signal at the server's death would have landed
        st = _stat(p.pid)                    # (is_alive() asks the dead server: False)
        assert st is not None and st[0] != "Z", st
        go.set()
        assert here.poll(TIMEOUT) and here.recv() == "done"
        assert join_or_kill(p) in (0, 255)   # (255: its exit status went with the server)
        # the next forkserver child starts from a new server, and is armed as well
        q = ctx.Process(target=w.wait_then_report, args=(there, go, TIMEOUT))
        q.start()
        assert here.poll(TIMEOUT) and here.recv() == q.pid
        assert join_or_kill(q) == 0 and forkserver._forkserver._forkserver_pid != server
    finally:
        join_or_kill(p)


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_child_started_from_a_thread_outlives_that_thread(method):
    ctx = mp.get_context(method)
    go = ctx.Event()
    here, there = ctx.Pipe()
    p = ctx.Process(target=w.wait_then_report, args=(there, go, TIMEOUT))

    def starter():
        p.start()
        assert here.poll(TIMEOUT)        # the child runs (armed) before this thread ends
        started.append(here.recv())

    started = []
    t = threading.Thread(target=starter)
    t.start()
    t.join(TIMEOUT)
    assert started == [p.pid]
    time.sleep(0.2)                      # a signal sent at the thread's end would have landed
    assert p.is_alive()
    go.set()
    assert here.poll(TIMEOUT) and here.recv() == "done"
    assert join_or_kill(p) == 0


def test_start_from_a_thread_raises_in_that_thread():
    ctx = mp.get_context("spawn")
    unpicklable = lambda: None                                        # noqa: E731
    try:                    # the error pickle raises for it: its type and text vary by version
        pickle.dumps(unpicklable)
    except Exception as e:
        expected = e
    p = ctx.Process(target=w.touch, args=("unused", unpicklable))
    errors = []

    def starter():
        try:
            p.start()
        except Exception as e:
            errors.append(e)

    t = threading.Thread(target=starter)
    t.start()
    t.join(TIMEOUT)
    assert len(errors) == 1
    assert type(errors[0]) is type(expected) and str(errors[0]) == str(expected)
    assert mp.active_children() == []


@pytest.mark.parametrize("method, tasks", [("fork", 50), ("spawn", 10)])   # spawn: 0.3 s a worker
def test_pool_replacement_workers_survive_the_handler_thread(method, tasks):
    # maxtasksperchild=1: every task gets a fresh worker, started by the pool's handler
    # thread, which ends at close(); the workers then take 0.3 s to exit. Killed at the
    # thread's end, they would exit with -SIGKILL.
    pool = mp.get_context(method).Pool(2, initializer=w.slow_exit_initializer, initargs=(0.3,),
                                       maxtasksperchild=1)
    try:
        results = pool.map_async(w.square, range(tasks), chunksize=1).get(TIMEOUT * 3)
        assert [r for r, _ in results] == [x * x for x in range(tasks)]
        assert len({pid for _, pid in results}) == tasks       # one worker per task
        pool.close()
        pool.join()
        assert [p.exitcode for p in pool._pool] == [0, 0]
    finally:
        pool.terminate()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_no_thread_is_left_after_a_pool_that_replaced_workers(method):
    # A Pool's handler thread starts the replacement workers (maxtasksperchild=1): no thread
    # of sharedmp's outlives the pool, so the process is single-threaded again after
    # close()/join(), as with the standard library, and os.fork() there is not the
    # multi-threaded fork that Python 3.12+ warns of (3.10, 3.11: no such warning, the
    # threads tell). A fresh program: this one has the test runner's threads.
    results = {}
    for library in ("multiprocessing", "sharedmp"):
        code, out, err = run_bounded(
            [sys.executable, "-c", "import sys, _process_workers as w; w.pool_then_fork(*sys.argv[1:])",
             library, method], cwd=HERE, what=f"a {library} pool")
        assert code == 0, err[-3000:]
        results[library] = json.loads(out.splitlines()[-1])
    ours = results["sharedmp"]
    assert ours["workers"] == 6                          # 4 started by the handler thread
    assert ours["threads"] == ["MainThread"], ours
    forks = [w for w in ours["warnings"] if "fork" in w]
    assert not forks, forks
    assert ours == {**results["multiprocessing"], "workers": ours["workers"]}


def test_keep_orphans_rejects_unknown_values(monkeypatch):
    monkeypatch.setenv(pdeath.ENV, "maybe")
    p = mp.get_context("fork").Process(target=w.touch, args=("unused",))
    with pytest.raises(ValueError, match=r"\$SHAREDMP_KEEP_ORPHANS must be 1 to let children outlive"):
        p.start()
    monkeypatch.setenv(pdeath.ENV, "0")
    assert pdeath.keep_orphans() is False
    monkeypatch.setenv(pdeath.ENV, "1")
    assert pdeath.keep_orphans() is True


# -- spawn() / start_processes() -------------------------------------------------------------

def _no_error_dir(ctx):
    """The tracebacks' pipes are closed (nothing of them is left in the file system, ever)."""
    return all(conn.closed for conn in ctx.error_pipes)


def test_spawn_runs_fn_with_index_and_args():
    out = mp.zeros(4)
    assert mp.spawn(w.fill_index, args=(out,), nprocs=4) is None
    assert out.tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_start_processes_carries_the_sharing_strategy(method):
    mp.set_sharing_strategy("file_system")
    out = mp.full(2, -1, dtype=np.int64)
    mp.start_processes(w.report_strategy, args=(out,), nprocs=2, start_method=method)
    code = sorted(mp.get_all_sharing_strategies()).index("file_system")
    assert out.tolist() == [code, code]


def test_raising_child_gives_its_traceback_and_the_others_are_stopped(tmp_path):
    ctx = mp.spawn(w.raise_at, args=(1, str(tmp_path)), nprocs=3, join=False)
    with pytest.raises(mp.ProcessRaisedException) as info:
        while not ctx.join(TIMEOUT):
            pass
    e = info.value
    assert (e.error_index, e.error_pid) == (1, ctx.pids()[1])
    text = str(e)
    assert "-- Process 1 terminated with the following error:" in text
    assert "Traceback (most recent call last)" in text
    assert "_nested_failure" in text and "ValueError: boom in child 1" in text
    assert sorted(ready_pids(str(tmp_path))) == sorted([ctx.pids()[0], ctx.pids()[2]])
    assert [ctx.processes[i].exitcode for i in (0, 2)] == [-signal.SIGTERM] * 2
    assert _no_error_dir(ctx)


@pytest.mark.parametrize("how, code, name", [("exit3", 3, None), ("SIGKILL", -9, "SIGKILL"),
                                             ("SIGSEGV", -11, "SIGSEGV")])
def test_exiting_child_gives_code_or_signal(tmp_path, how, code, name):
    ctx = mp.start_processes(w.exit_with, args=(how, str(tmp_path)), nprocs=2,
                             start_method="fork", join=False)
    with pytest.raises(mp.ProcessExitedException) as info:
        while not ctx.join(TIMEOUT):
            pass
    e = info.value
    assert (e.error_index, e.error_pid, e.exit_code, e.signal_name) == (0, ctx.pids()[0], code, name)
    assert (name or f"exit code {code}") in str(e)
    assert not ctx.processes[1].is_alive()
    assert _no_error_dir(ctx)
    with pytest.raises(mp.ProcessExitedException):        # joining again says it again
        ctx.join()


def test_grace_period_then_sigkill_for_a_child_ignoring_sigterm(tmp_path):
    ctx = mp.start_processes(w.ignore_term_then_sleep, args=(str(tmp_path),), nprocs=2,
                             start_method="fork", join=False)
    with pytest.raises(mp.ProcessRaisedException, match="first child fails"):
        while not ctx.join(TIMEOUT, grace_period=0.3):
            pass
    assert ctx.processes[1].exitcode == -signal.SIGKILL    # SIGTERM was ignored


def test_stopping_the_others_is_logged_as_torch_logs_it(tmp_path, caplog):
    # torch warns for each child it terminates, under its logger: logging set up for torch
    # (and torch's own tests, which watch the "torch" logger) sees sharedmp's the same way.
    ctx = mp.spawn(w.raise_at, args=(1, str(tmp_path)), nprocs=3, join=False)
    with caplog.at_level("WARNING", logger="torch"), pytest.raises(mp.ProcessRaisedException):
        while not ctx.join(TIMEOUT):
            pass
    records = [r for r in caplog.records if r.name == "torch.multiprocessing.spawn"]
    assert sorted(r.getMessage() for r in records) == sorted(
        f"Terminating process {ctx.pids()[i]} via signal SIGTERM" for i in (0, 2))


def test_forkserver_children_start_in_parallel_when_asked(tmp_path, monkeypatch):
    monkeypatch.setenv(mp.ENV_VAR_PARALLEL_START, "1")
    out = mp.zeros(4, dtype=np.int64)
    mp.start_processes(w.fill_index, args=(out,), nprocs=4, start_method="forkserver")
    assert list(out) == [1, 2, 3, 4]       # every index ran, with its own index


def test_join_timeout_false_while_running_then_true(tmp_path):
    flag = str(tmp_path / "go")
    ctx = mp.spawn(w.wait_for_file, args=(flag,), nprocs=2, join=False)
    try:
        assert isinstance(ctx, mp.ProcessContext)
        assert ctx.pids() == [p.pid for p in ctx.processes] and all(ctx.pids())
        assert ctx.join(timeout=0.2) is False
        w.write_file(flag)
        deadline = time.monotonic() + TIMEOUT
        while not ctx.join(timeout=1):
            assert time.monotonic() < deadline
        assert ctx.join() is True                           # and again, once done
        assert [p.exitcode for p in ctx.processes] == [0, 0]
        assert _no_error_dir(ctx)
    finally:
        for p in ctx.processes:
            join_or_kill(p)


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """A temporary directory of this test's own: what other tests (other xdist workers)
    make in the shared one meanwhile is not counted as this test's leak."""
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    return str(tmp_path)


def test_a_traceback_longer_than_a_pipe_buffer_is_shortened_not_a_hang(private_tmp):
    before = set(os.listdir(private_tmp))
    with pytest.raises(mp.ProcessRaisedException) as info:
        mp.start_processes(w.raise_long, args=(300_000,), nprocs=2, start_method="fork")
    text = str(info.value)
    assert "traceback shortened" in text and "end of the long message" in text
    assert "Traceback (most recent call last)" in text and len(text) < 40_000
    assert not [n for n in set(os.listdir(private_tmp)) - before if n.startswith("sharedmp-")]


def test_nonzero_sys_exit_is_an_exit_code():
    with pytest.raises(mp.ProcessExitedException, match="exit code 7") as info:
        mp.start_processes(w.exit_code_of, args=(7,), nprocs=1, start_method="fork")
    assert info.value.exit_code == 7 and info.value.signal_name is None


def test_failed_start_stops_the_children_already_started(private_tmp):
    w.FailSecondPickle.pickled = 0
    before = set(os.listdir(private_tmp))
    with pytest.raises(TypeError, match="refusing to be pickled twice"):
        mp.spawn(w.sleep_with, args=(w.FailSecondPickle(),), nprocs=3)
    assert w.FailSecondPickle.pickled == 2          # the first child did start
    assert mp.active_children() == []
    after = set(os.listdir(private_tmp))
    assert not [n for n in after - before if n.startswith("sharedmp-")]


def test_bad_arguments_raise_before_anything_starts():
    with pytest.raises(TypeError, match="callable"):
        mp.spawn("not a function")
    with pytest.raises(TypeError, match="nprocs must be an int"):
        mp.spawn(w.fill_index, nprocs=2.0)
    with pytest.raises(ValueError, match="at least 1"):
        mp.spawn(w.fill_index, nprocs=0)
    with pytest.raises(ValueError, match="valid start methods"):
        mp.start_processes(w.fill_index, start_method="thread")
    with pytest.warns(FutureWarning, match="start_processes"):
        mp.spawn(w.fill_index, args=(mp.zeros(1),), start_method="fork")
    assert mp.active_children() == []


def test_exceptions_pickle_with_their_fields():
    raised = mp.ProcessRaisedException("trace text", 2, 1234)
    exited = mp.ProcessExitedException("killed", 1, 99, exit_code=-9, signal_name="SIGKILL")
    for e in (raised, exited):
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is type(e) and isinstance(back, ProcessException)
        assert vars(back) == vars(e) and str(back) == str(e)
    assert (exited.exit_code, exited.signal_name) == (-9, "SIGKILL")


# -- fork safety -----------------------------------------------------------------------------

def _torch_or_none():
    """torch where it is installed (3.11 here), else None: sharedmp's torch side and its
    locks exist only once torch is imported."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def _module_locks():
    """(module name, attribute) of every module-level lock of sharedmp, torch's included
    where torch is installed."""
    _torch_or_none()
    import sharedmp.channels.queues  # noqa: F401  (imported on first use)
    import sharedmp.processes.spawn  # noqa: F401
    lock_types = (type(threading.Lock()), type(threading.RLock()))
    found = []
    for name, module in sorted(sys.modules.items()):
        if name == "sharedmp" or name.startswith("sharedmp."):
            for attr, value in sorted(vars(module).items()):
                if isinstance(value, lock_types):
                    found.append((name, attr))
    return found


# Locks a fork takes itself (its before-fork hooks), held across it: another thread holding one
# makes the fork wait for it, by design, so they are not held here.
TAKEN_BY_FORK = {"sharedmp.memory.named._fork_gate"}


def test_fork_while_other_threads_hold_every_sharedmp_lock():
    torch = _torch_or_none()                 # without torch: every lock but torch's side's
    locks = [(m, a) for m, a in _module_locks() if f"{m}.{a}" not in TAKEN_BY_FORK]
    names = {f"{m}.{a}" for m, a in locks}
    expected = {"sharedmp.memory.segment._lock", "sharedmp.memory.arena._lock",
                "sharedmp.processes.pdeath._watch_lock"}
    if torch is not None:
        expected.add("sharedmp.reductions.torch.storage._lock")
    assert expected <= names
    held, release = threading.Event(), threading.Event()

    def hold_all():
        got = [getattr(sys.modules[m], a) for m, a in locks]
        for lock in got:
            lock.acquire()
        held.set()
        release.wait(TIMEOUT)
        for lock in reversed(got):
            lock.release()

    t = threading.Thread(target=hold_all)
    t.start()
    try:
        assert held.wait(TIMEOUT)

        def child():
            for m, a in locks:                       # re-created, so free in the child
                if not getattr(sys.modules[m], a).acquire(timeout=5):
                    return False
                getattr(sys.modules[m], a).release()
            a = mp.zeros(1000)                        # arena and segment
            a += 1
            if torch is not None:
                t = mp.share_memory_(torch.ones(10))  # torch's move path
                if not t.is_shared():
                    return False
            return (a.sum() == 1000
                    and pdeath._watch is None and pdeath._watcher() is not None)  # its own

        assert fork_and_wait(child) == 0
    finally:
        release.set()
        t.join(TIMEOUT)


def test_forked_child_resets_queues_of_its_parent():
    q = mp.get_context("fork").Queue()
    n = 0
    while q._thread is None:                          # a full socket starts the feeder thread here
        q.put(b"x" * 60_000)
        n += 1
    q.put(mp.zeros(10) + 1)                           # waits in the feeder's buffer

    def child():
        reset = q._thread is None and not q._held._held and q._notempty.acquire(timeout=5)
        q.put("from the child")                       # a non-creator sends directly
        return reset

    got = []                                          # read meanwhile: the child's put needs room
    reader = threading.Thread(target=lambda: got.extend(q.get(timeout=TIMEOUT) for _ in range(n + 2)))
    reader.start()
    with q._notempty:                                 # as if the feeder were in the middle of it
        status = fork_and_wait(child)
    assert status == 0
    reader.join(TIMEOUT)
    assert len(got) == n + 2
    assert sum(isinstance(x, bytes) for x in got) == n
    assert any(isinstance(x, np.ndarray) and (x == 1).all() for x in got)
    assert any(isinstance(x, str) and x == "from the child" for x in got)
    q.close()
    q.join_thread()


def _fork_child(make, monkeypatch, target, *args):
    """A started fork child running ``target``: of sharedmp's fork context, of mp.Process
    under fork, or of the standard library's fork context."""
    import multiprocessing
    std = multiprocessing.get_context("fork")
    if make == "context":
        p = mp.get_context("fork").Process(target=target, args=args)
    elif make == "mp.Process":
        monkeypatch.setattr(multiprocessing.context._default_context, "_actual_context", std)
        p = mp.Process(target=target, args=args)
    else:
        p = std.Process(target=target, args=args)
    p.start()
    return p


@pytest.mark.parametrize("make", ["context", "mp.Process", "stdlib"])
def test_fork_children_keep_the_collector_of_the_standard_library(make, monkeypatch):
    # A drop-in: a forked child freezes nothing of what it inherits, as the standard
    # library's does (SHAREDMP_FREEZE_FORKED=1 asks for it: tests/test_fork_gc.py).
    import gc
    import multiprocessing
    monkeypatch.delenv("SHAREDMP_FREEZE_FORKED", raising=False)
    q = multiprocessing.get_context("fork").Queue()
    inherited = gc.get_freeze_count()        # (what a forked child starts with: 0 mostly)
    p = _fork_child(make, monkeypatch, w.report_freeze, q)
    try:
        assert q.get(timeout=TIMEOUT) == inherited
    finally:
        assert join_or_kill(p) == 0
    # A spawned child inherits nothing to freeze: it has what a fresh interpreter has frozen
    # at start-up (0 mostly; 375 on 3.12.1 here).
    fresh = subprocess.run([sys.executable, "-c", "import gc; print(gc.get_freeze_count())"],
                           capture_output=True, text=True, timeout=TIMEOUT, check=True)
    q = mp.get_context("spawn").Queue()
    spawned = mp.get_context("spawn").Process(target=w.report_freeze, args=(q,))
    spawned.start()
    try:
        assert q.get(timeout=TIMEOUT) == int(fresh.stdout)
    finally:
        assert join_or_kill(spawned) == 0


@pytest.mark.parametrize("make", ["context", "mp.Process", "stdlib"])
def test_a_fork_child_collects_an_inherited_cycle_it_drops(make, monkeypatch):
    # (issue 40: frozen, a dropped inherited cycle stayed, 50 MB of it, and its __del__
    # never ran)
    import multiprocessing
    monkeypatch.delenv("SHAREDMP_FREEZE_FORKED", raising=False)
    q = multiprocessing.get_context("fork").Queue()
    monkeypatch.setattr(w, "INHERITED", w.Cycle())
    w.Cycle.finalized.clear()
    p = _fork_child(make, monkeypatch, w.drop_inherited_cycle, q)
    try:
        found, finalized = q.get(timeout=TIMEOUT)
    finally:
        assert join_or_kill(p) == 0
    assert found > 0 and finalized


OVERTIME = """
import time
import sharedmp as mp
if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q, lock = ctx.Queue(), ctx.Lock()        # named semaphores (sem.mp-*) in /dev/shm
    p = ctx.Process(target=time.sleep, args=(100,))
    p.start()
    names = [s._semlock.name for s in (q._rlock._sem, q._rlock._takeover, q._sem, lock)]
    print("running", " ".join("sem." + n.lstrip("/") for n in names), flush=True)
    time.sleep(100)
"""


def test_a_program_past_its_bound_is_ended_leaving_no_semaphore(tmp_path):
    # The tests' own bound (conftest.run_bounded): the program's group is ended so that the
    # standard library's resource tracker unlinks its semaphores (SIGKILL alone leaves them,
    # and a bench run beside this suite reported them as its own leftovers).
    script = tmp_path / "overtime.py"
    script.write_text(OVERTIME)
    with pytest.raises(pytest.fail.Exception, match="did not finish within 5 s") as e:
        run_bounded([sys.executable, str(script)], 5)
    names = str(e.value).split("running ", 1)[1].split("\n", 1)[0].split()
    assert len(names) == 4, str(e.value)
    assert eventually(lambda: not any(os.path.exists(f"/dev/shm/{n}") for n in names)), names

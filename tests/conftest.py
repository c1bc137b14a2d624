"""Shared fixtures (start methods, sharing strategies) and a leak check around every test.

Helpers that child processes import too live in ``_helpers.py``; the others are here.

The leak check fails a test that leaves behind, once it has ended:
- a child process (killed by pid, then reported),
- a ``sharedmp_*`` file in the shared-memory directory that was not there before
  (polled for up to 5 s: releases may trail the last process by a moment),
- an fd of this process that was not open before and points to a sharedmp segment.
"""
import contextlib
import faulthandler
import fcntl
import gc
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

import sharedmp as mp
from sharedmp import host
from sharedmp.memory import arena, named, segment

from _helpers import (TIMEOUT, data_ptr, eventually, fds_on, memfd_maps,  # noqa: F401
                      open_fds, proc_stat, segment_memfds)

# Every start method. The channel and queue suites run under each (the ``start_method``
# fixture): fork inherits what the parent has, spawn pickles everything into a fresh
# interpreter, forkserver pickles too but forks from a server that predates the test.
START_METHODS = ["fork", "spawn", "forkserver"]
# The two ends, for tests too costly to run three times (children that import torch, pools
# that start a worker per task): forkserver pickles what it sends as spawn does.
FORK_AND_SPAWN = ["fork", "spawn"]
SHARING_STRATEGIES = ["file_descriptor", "file_system"]


@pytest.fixture
def never_by_value(monkeypatch):
    """Plain arrays sent by this process go through shared memory whatever their size (small
    ones travel by value otherwise: reductions/ndarray.py), to test that path with small
    arrays of every layout."""
    from sharedmp import wire
    from sharedmp.reductions import ndarray
    monkeypatch.setattr(ndarray, "STD_BY_VALUE_MAX", -1)
    monkeypatch.setattr(wire, "INBAND_MAX", -1)


@pytest.fixture
def pool_stays(monkeypatch):
    """The caches keep what they hold until the test lets it go (``recycle.clear``,
    ``empty_cache``): their idle timer is not what such a test checks, and on a loaded machine
    a ``gc.collect()`` alone can outlast its second (a segment given to the pool was gone when
    the test looked: a full .ci/run, 3.11)."""
    from sharedmp.memory import cache
    monkeypatch.setattr(cache, "_idle", 3600.0)


def shm_files():
    """sharedmp_* files in the shared-memory directory, except the allocator's arenas'."""
    arenas = [a.ref() for a in [*arena._current.values(), *arena._idle.values()]]
    keep = {seg.name for seg in map(segment.segment_of, arenas) if seg is not None}
    try:
        names = os.listdir(named.shm_dir())
    except FileNotFoundError:
        return set()
    return {n for n in names if n.startswith(named.PREFIX) and n not in keep}


def segment_fds():
    """fds of this process that point to a sharedmp segment, except the current arenas'.

    The allocator keeps its current arena (and so its fds) on purpose, across tests.
    """
    return arena.stray_segment_fds()


def run_bounded(argv, timeout=TIMEOUT, env=None, what=None, cwd=None):
    """Run ``argv`` in its own session: (returncode, stdout, stderr); on a timeout its whole
    process group is killed and the test fails."""
    proc = subprocess.Popen(argv, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, env=env, cwd=cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        host.end_group(proc, 5)     # (SIGTERM first: the resource tracker unlinks semaphores)
        out, err = proc.communicate()
        pytest.fail(f"{what or ' '.join(argv)} did not finish within {timeout} s; the end of "
                    f"its output:\n{out[-2000:]}\n{err[-6000:]}", pytrace=False)
    return proc.returncode, out, err


@contextlib.contextmanager
def dev_shm_alone(alone):
    """Across every test process of the machine (the suites .ci/run runs side by side):
    ``alone`` (the bench's check that /dev/shm is as it was) waits until none of the others
    runs and keeps them out; the others (CPython's suites, whose own tests sometimes leave
    sem.mp-* files under load, and others' files cannot be told apart) run together.
    Two flock files, so that a waiting ``alone`` is not starved: it holds the turnstile."""
    # (in /dev/shm where there is one: the runs of Python 3.14/3.15 in the sid tree have a
    # /tmp of their own, and the host's /dev)
    where = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    turnstile, room = (open(os.path.join(where, f".sharedmp-tests-shm.{n}"), "a")
                       for n in ("turnstile", "room"))
    with turnstile, room:
        if alone:
            fcntl.flock(turnstile, fcntl.LOCK_EX)
            fcntl.flock(room, fcntl.LOCK_EX)
        else:
            fcntl.flock(turnstile, fcntl.LOCK_SH)
            fcntl.flock(room, fcntl.LOCK_SH)
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield                                       # (closing the files lets both go)


def kill_children():
    """Kill every child of this process by pid; return how many were still alive."""
    alive = multiprocessing.active_children()
    for p in alive:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.join(5)
    return len(alive)


@pytest.fixture(autouse=True)
def no_leaks(request):
    strategy = os.environ.get(mp.strategy.ENV)
    shm_before, fds_before = shm_files(), segment_fds()
    yield
    if strategy is None:
        os.environ.pop(mp.strategy.ENV, None)
    else:
        os.environ[mp.strategy.ENV] = strategy
    mp.strategy.reload_from_environment()
    stray = kill_children()
    if request.node.get_closest_marker("leaks_ok"):
        return
    gc.collect()
    mp.empty_cache()            # what this process caches on purpose (memory/cache.py)
    # (bounded waits: a segment file goes when the daemon hears of it, and an fd sent by
    # DupFd within this process is closed by multiprocessing's resource-sharer thread, both
    # a moment after the test)
    deadline = time.monotonic() + 5
    while (((left := shm_files() - shm_before) or segment_fds() - fds_before)
           and time.monotonic() < deadline):
        time.sleep(0.05)
        gc.collect()
        mp.empty_cache()
    fds = segment_fds() - fds_before
    problems = []
    if stray:
        problems.append(f"{stray} child process(es) still alive after the test (killed)")
    if left:
        problems.append(f"segments left in {named.shm_dir()}: {sorted(left)[:5]}")
    if fds:
        problems.append(f"segment fds left open: {sorted(fds)[:10]}")
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)


@pytest.fixture(params=START_METHODS, ids=START_METHODS)
def start_method(request):
    """Each start method in turn: "fork", "spawn", "forkserver".

    A test that covers only some on purpose says so: ``fork_or_spawn``, or a direct
    ``@pytest.mark.parametrize("start_method", [...])`` with a comment saying why.
    """
    return request.param


@pytest.fixture(params=FORK_AND_SPAWN, ids=FORK_AND_SPAWN)
def fork_or_spawn(request):
    """"fork" and "spawn" only: for tests too costly to run under all three (FORK_AND_SPAWN)."""
    return request.param


@pytest.fixture
def ctx(start_method):
    """The standard multiprocessing context of each start method (not sharedmp's)."""
    return multiprocessing.get_context(start_method)


@pytest.fixture(params=SHARING_STRATEGIES)
def sharing_strategy(request):
    """Each sharing strategy in turn, set for the test (no_leaks restores the environment)."""
    mp.set_sharing_strategy(request.param)
    return request.param


def start_process(ctx, target, *args):
    """A started daemon ``ctx.Process`` running ``target(*args)``."""
    p = ctx.Process(target=target, args=args, daemon=True)
    p.start()
    return p


# A program as a terminal starts it: SIGINT at its default (Python then makes it
# KeyboardInterrupt) and not blocked, whatever this process has (a disposition or a mask
# inherited by the test run: a program started in the background of a non-interactive shell
# has SIGINT ignored, and Python then leaves it ignored). Exec'd with -X faulthandler: a
# SIGABRT prints every thread's stack (what a Ctrl-C test shows when the program hangs).
_AS_FROM_A_TERMINAL = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                       "signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT]); "
                       "os.execv(sys.executable, [sys.executable, '-X', 'faulthandler', "
                       "*sys.argv[1:]])")


def as_from_a_terminal(argv):
    """``[python, *args]`` run as a terminal would start it (see above)."""
    assert argv[0] == sys.executable
    return [sys.executable, "-c", _AS_FROM_A_TERMINAL, *argv[1:]]


def signal_state(pid="self"):
    """SigBlk/SigIgn/SigCgt of a process (/proc), for a failure's message."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return " ".join(line.strip() for line in f if line.startswith(("SigBlk", "SigIgn", "SigCgt")))
    except OSError:
        return "(gone)"


def group_gone(pgid, wait=10):
    """True once neither process ``pgid`` nor any of its group is left (polled ``wait`` s)."""
    deadline = time.monotonic() + wait
    while True:
        for probe in (os.kill, os.killpg):
            try:
                probe(pgid, 0)
                break
            except ProcessLookupError:
                pass
        else:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def fork_and_wait(child, timeout=TIMEOUT, meanwhile=None):
    """Run ``child()`` in a raw os.fork() child (the ``forks.in_child`` hooks run): its exit
    status, 0 if it returned true, 2 if false, 1 if it raised (bounded: killed after
    ``timeout`` s, and the test fails, with where the child's threads were on its stderr).
    ``meanwhile()`` runs in the parent once forked."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            faulthandler.register(signal.SIGUSR1, all_threads=True)    # (see _dump_and_kill)
            code = 0 if child() else 2
        finally:
            os._exit(code)
    try:
        if meanwhile is not None:
            meanwhile()
    except BaseException:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            _dump_and_kill(pid)
            pytest.fail(f"forked child deadlocked (no exit in {timeout} s; its threads' "
                        "tracebacks are in the captured stderr)", pytrace=False)
        time.sleep(0.01)


def _dump_and_kill(pid):
    """SIGUSR1 to a stuck forked child (its faulthandler writes every thread's traceback to
    the test's stderr: where it waits), then SIGKILL."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGUSR1)
        time.sleep(1)
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def join_or_kill(proc, timeout=TIMEOUT):
    """Join ``proc``; kill it and fail if it is still running after ``timeout``."""
    proc.join(timeout)
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(5)
        pytest.fail(f"process {proc.pid} did not finish within {timeout} s", pytrace=False)
    return proc.exitcode


# Opt-in: SHAREDMP_TEST_START_METHOD=forkserver runs the suite with that default start method
# (Python 3.14's default on Linux; fork before it), as multiprocessing.set_start_method would
# in a user's program. Only this process and its children: programs the tests run as
# subprocesses keep their Python's default.
START_METHOD_ENV = "SHAREDMP_TEST_START_METHOD"


def pytest_configure(config):
    config.addinivalue_line("markers", "leaks_ok: the test checks leaks itself")
    config.addinivalue_line("markers", "slow: one of the slowest tests (.ci/run leaves them "
                            "out on the interpreters other than 3.11)")
    method = os.environ.get(START_METHOD_ENV)
    if method:
        if method not in multiprocessing.get_all_start_methods():
            raise pytest.UsageError(f"{START_METHOD_ENV}={method!r}: not one of "
                                    f"{multiprocessing.get_all_start_methods()}")
        multiprocessing.set_start_method(method, force=True)
    # Named segments of this run (and of the processes it starts) go to a tmpfs directory
    # of its own: the leak check must not count files of another run on the same machine.
    # (each pytest-xdist worker too: they inherit the controller's environment)
    inherited = os.environ.get(named.SHM_DIR_ENV)
    mine = not inherited or (os.environ.get("PYTEST_XDIST_WORKER")
                             and os.path.basename(inherited).startswith("sharedmp-tests-"))
    if mine and os.path.isdir("/dev/shm"):
        config._sharedmp_shm_dir = tempfile.mkdtemp(prefix="sharedmp-tests-", dir="/dev/shm")
        os.environ[named.SHM_DIR_ENV] = config._sharedmp_shm_dir


def pytest_report_header(config):
    from sharedmp import native
    paths = ", ".join(f"{k} {v}" for k, v in native.status().items())
    return [f"default start method: {multiprocessing.get_start_method()}",
            f"sharedmp's compiled core: {paths}"]


def pytest_unconfigure(config):
    directory = getattr(config, "_sharedmp_shm_dir", None)
    if directory:
        os.environ.pop(named.SHM_DIR_ENV, None)
        shutil.rmtree(directory, ignore_errors=True)

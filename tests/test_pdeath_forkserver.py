"""A forkserver child follows the process that started it as a spawn child does: killed when
that process dies, whatever the child did with its fds or by exec; alive on when that process
execs (the same process), and killed when the program it became dies. So does a child of
any start method started from a thread other than the main one (the watcher, not the
kernel's parent-death signal, which follows the thread), once that thread has ended.

Each test runs a real starting process (``_pdeath_workers.py``) and SIGKILLs it; what is
left of its tree is found through /proc and killed by pid (with its start time, so that a
reused pid is never hit).
"""
import os
import signal
import subprocess
import sys
import time

import pytest

from sharedmp.processes import pdeath

from _helpers import proc_stat
from conftest import TIMEOUT

HERE = os.path.dirname(os.path.abspath(__file__))
DRIVE = "import _pdeath_workers as w; w.main()"

pytestmark = pytest.mark.skipif(not pdeath.HAVE_PDEATHSIG, reason="Linux only")


def descendants(root):
    """{pid: start time} of every process below ``root`` now."""
    children = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = proc_stat(int(name))
            if st is not None and st[0] not in "ZX":
                children.setdefault(st[1], []).append((int(name), st[2]))
    out, todo = {}, [root]
    while todo:
        for pid, start in children.get(todo.pop(), []):
            out[pid] = start
            todo.append(pid)
    return out


def alive(procs):
    """The pids of ``procs`` ({pid: start time}) still running (not zombies, not reused)."""
    return [pid for pid, start in procs.items()
            if (st := proc_stat(pid)) is not None and st[2] == start and st[0] not in "ZX"]


def wait_gone(procs, timeout):
    deadline = time.monotonic() + timeout
    while (left := alive(procs)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


def kill_all(procs):
    for pid in alive(procs):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not wait_gone(procs, 10), "could not kill the starter's leftovers"


def read_when_there(path, starter, where):
    deadline = time.monotonic() + TIMEOUT
    while not os.path.exists(path):
        if starter.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"no {os.path.basename(path)}: {errors(where)}", pytrace=False)
        time.sleep(0.01)
    with open(path) as f:
        return int(f.read())


def errors(where):
    with open(os.path.join(where, "starter.err")) as f:
        return f.read()[-3000:]


def start(where, method, child, starter, start_from="main"):
    """The starting process, once its child runs (and has done ``child``) and the thread
    that started it has ended: (Popen, child pid)."""
    env = dict(os.environ)
    env.pop(pdeath.ENV, None)
    with open(os.path.join(where, "starter.err"), "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", DRIVE, where, method, child, starter,
                                 start_from],
                                env=env, cwd=HERE, stdout=subprocess.DEVNULL, stderr=err)
    pid = read_when_there(os.path.join(where, "child.pid"), proc, where)
    threads = read_when_there(os.path.join(where, "started"), proc, where)
    assert threads == 1, f"the starter has {threads} threads: sharedmp left one"
    return proc, pid


def sigkill(proc):
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(TIMEOUT) == -signal.SIGKILL


def _gone_with(proc, pid, tree):
    """The starter SIGKILLed: its tree (the child ``pid`` in it) is gone within 5 s."""
    sigkill(proc)
    left = wait_gone(tree, 5)
    assert not left, f"alive 5 s after the starter was SIGKILLed: {left} (the child: {pid})"


def _alive_then_gone_with(proc, pid, tree, settle, event):
    """The child ``pid`` lives ``settle`` s after ``event`` (a signal sent then would have
    landed), and dies with its starter."""
    time.sleep(settle)
    assert alive({pid: tree[pid]}) == [pid], f"the child died {event}"
    _gone_with(proc, pid, tree)


def _end(proc, tree):
    if proc.poll() is None:
        proc.kill()
        proc.wait(TIMEOUT)
    kill_all(tree)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
@pytest.mark.parametrize("child", ["sleep", "closerange", "exec"])
def test_child_dies_with_its_starter_whatever_it_did(tmp_path, method, child):
    where = str(tmp_path)
    proc, pid = start(where, method, child, "sleep")
    tree = {}
    try:
        tree = descendants(proc.pid)
        open(os.path.join(where, "go"), "w").close()
        assert pid in tree
        _gone_with(proc, pid, tree)
    finally:
        _end(proc, tree)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_child_lives_on_when_its_starter_execs_and_dies_with_what_it_became(tmp_path, method):
    where = str(tmp_path)
    proc, pid = start(where, method, "sleep", "exec")
    tree = {}
    try:
        tree = descendants(proc.pid)
        open(os.path.join(where, "go"), "w").close()
        assert read_when_there(os.path.join(where, "starter.exec"), proc, where) == proc.pid
        _alive_then_gone_with(proc, pid, tree, 0.5, "when its starter exec'd")
    finally:
        _end(proc, tree)


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
@pytest.mark.parametrize("child", ["sleep", "closerange", "exec"])
def test_child_started_from_an_ended_thread_dies_with_its_starter(tmp_path, method, child):
    # The thread that started the child is joined before the starter is killed: the kernel's
    # parent-death signal would have followed that thread; the watcher follows the process.
    where = str(tmp_path)
    proc, pid = start(where, method, child, "sleep", start_from="thread")
    tree = {}
    try:
        tree = descendants(proc.pid)
        open(os.path.join(where, "go"), "w").close()
        assert pid in tree
        _alive_then_gone_with(proc, pid, tree, 0.2, "with the thread that started it")
    finally:
        _end(proc, tree)

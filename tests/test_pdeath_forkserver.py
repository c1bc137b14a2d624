"""A forkserver child follows the process that started it as a spawn child does: killed when
that process dies, whatever the child did with its fds or by exec; alive on when that process
execs (the same process), and killed when the program it became dies. So does a child of
any start method started from a thread other than the main one (the watcher, not the
kernel's parent-death signal, which follows the thread), once that thread has ended.

Each test runs a real starting process (``_pdeath_workers.py``) and SIGKILLs it; what is
left of its tree is found through /proc and killed by pid (with its start time, so that a
reused pid is never hit).
"""
import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from sharedmp.processes import pdeath

from conftest import TIMEOUT
from test_processes import alive, descendants, kill_all, wait_gone

HERE = os.path.dirname(os.path.abspath(__file__))
DRIVE = "import _pdeath_workers as w; w.main()"

pytestmark = pytest.mark.skipif(not pdeath.HAVE_PDEATHSIG, reason="Linux only")


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


@contextlib.contextmanager
def started(tmp_path, method, child, starter, start_from="main"):
    """``start``, then tell the child to go on: (Popen, child pid, the starter's tree); what
    is left of the tree is killed at the end."""
    where = str(tmp_path)
    proc, pid = start(where, method, child, starter, start_from)
    tree = {}
    try:
        tree = descendants(proc.pid)
        open(os.path.join(where, "go"), "w").close()
        yield proc, pid, tree
    finally:
        _end(proc, tree)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
@pytest.mark.parametrize("child", ["sleep", "closerange", "exec"])
def test_child_dies_with_its_starter_whatever_it_did(tmp_path, method, child):
    with started(tmp_path, method, child, "sleep") as (proc, pid, tree):
        assert pid in tree
        _gone_with(proc, pid, tree)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_child_lives_on_when_its_starter_execs_and_dies_with_what_it_became(tmp_path, method):
    with started(tmp_path, method, "sleep", "exec") as (proc, pid, tree):
        assert read_when_there(str(tmp_path / "starter.exec"), proc, str(tmp_path)) == proc.pid
        _alive_then_gone_with(proc, pid, tree, 0.5, "when its starter exec'd")


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
@pytest.mark.parametrize("child", ["sleep", "closerange", "exec"])
def test_child_started_from_an_ended_thread_dies_with_its_starter(tmp_path, method, child):
    # The thread that started the child is joined before the starter is killed: the kernel's
    # parent-death signal would have followed that thread; the watcher follows the process.
    with started(tmp_path, method, child, "sleep", start_from="thread") as (proc, pid, tree):
        assert pid in tree
        _alive_then_gone_with(proc, pid, tree, 0.2, "with the thread that started it")

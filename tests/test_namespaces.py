"""A program that is pid 1 of its PID namespace (a container started without an init) loses
nothing and leaves nothing under file_system.

The kernel kills every process of a PID namespace once its pid 1 exits, the manager daemon
with them: at a normal exit pid 1 has the daemon end first (``E``, daemon.py); after a
SIGKILL, the next program's daemon sweeps what the dead daemon's ledger names (daemon.py,
"Ledgers"), never what a live process still uses. Each program runs with ``unshare --pid
--fork --mount-proc`` (skipped where that is missing or not permitted), its own shm
directory and runtime directory, and no $SHAREDMP_MANAGER.
"""
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from sharedmp.memory import daemon
from sharedmp.memory.named import PREFIX

from conftest import TIMEOUT, eventually, run_bounded

UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]

PROGRAM = r"""
import json, multiprocessing, os, sys, time
import numpy as np
import sharedmp as mp
from sharedmp.memory import manager

def child(q, event):
    kept = [mp.full(50000, 7.0) for _ in range(3)]
    for i in range(10):
        q.put(mp.full(20000 + i, float(i)))          # never read
    event.set()
    time.sleep(600)                                  # (until the end of the program)

def main(mode):
    ctx = mp.get_context("fork")
    kept = [mp.full(300000, 1.0) for _ in range(4)] + [mp.zeros(100)]
    dropped = mp.zeros(300000)
    del dropped                                      # pooled for reuse
    if mode in ("exit", "kill"):
        q = ctx.Queue()
        for i in range(10):
            q.put(mp.full(30000, float(i)))          # never read
        std = multiprocessing.get_context("fork").SimpleQueue()
        for i in range(5):
            std.put(mp.full(30000, float(i)))        # never read, no token
        event = ctx.Event()
        p = ctx.Process(target=child, args=(q, event), daemon=True)
        p.start()
        assert event.wait(60)
    manager.sync()                                   # (what the daemon knows: in its ledger)
    names = sorted(n for n in os.listdir(os.environ["SHAREDMP_SHM_DIR"])
                   if n.startswith("sharedmp_"))
    print(json.dumps({"pid": os.getpid(), "daemon": manager.daemon_pid(), "names": names}),
          flush=True)
    if mode in ("kill", "hold"):
        sys.stdin.readline()
        assert all((a == 1.0).all() for a in kept[:4])

main(sys.argv[1])
"""


def _unshare_works():
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    try:
        r = subprocess.run([*UNSHARE, "true"], capture_output=True, text=True, timeout=TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare --pid fails here: {e}"
    if r.returncode != 0:
        return f"unshare --pid is not permitted here: {r.stderr.strip()[:200]}"
    return None


_why_not = _unshare_works() if sys.platform.startswith("linux") else "needs Linux"
pytestmark = pytest.mark.skipif(_why_not is not None, reason=_why_not or "")


@pytest.fixture
def dirs(tmp_path):
    """(shm dir, runtime dir, environment) of a program of its own (the runtime dir short
    enough for the daemon's socket: a longer one is passed over for /tmp)."""
    shm, run = tmp_path / "shm", tempfile.mkdtemp(prefix="sharedmp-run-", dir="/tmp")
    shm.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "SHAREDMP_MANAGER"}
    env.update(SHAREDMP_SHM_DIR=str(shm), TMPDIR=run, XDG_RUNTIME_DIR=run,
               SHAREDMP_SHARING_STRATEGY="file_system", SHAREDMP_KEEP_ORPHANS="1")
    yield str(shm), run, env
    shutil.rmtree(run, ignore_errors=True)


def argv(mode, namespace=True):
    return [*(UNSHARE if namespace else []), sys.executable, "-c", PROGRAM, mode]


class Program:
    """A program waiting on its stdin once it has said what it holds (its JSON line)."""

    def __init__(self, mode, env, namespace=True):
        self.proc = subprocess.Popen(argv(mode, namespace), env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     start_new_session=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], TIMEOUT)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.kill()
            pytest.fail(f"{mode}: no report within {TIMEOUT} s", pytrace=False)
        self.report = json.loads(line)
        # (its pid namespace, to wait for its every process to be gone)
        self.ns = _pid_ns(_child_of(self.proc.pid)) if namespace else None

    def finish(self):
        """Let it go on to a normal exit; its exit status."""
        self.proc.stdin.write("\n")
        self.proc.stdin.close()
        try:
            return self.proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"{self.proc.args} did not exit within {TIMEOUT} s", pytrace=False)

    def kill(self, frozen=False):
        """SIGKILL (unshare's --kill-child: its pid 1 too, so the whole namespace); wait until
        every process of it is gone. ``frozen``: every process of the namespace is stopped
        first (SIGSTOP), so that none acts between pid 1's death and its own (the daemon
        removes what dead clients left, when it gets the time): the worst case."""
        if frozen and self.ns is not None:
            for pid in _members(self.ns):
                try:
                    os.kill(pid, signal.SIGSTOP)
                except ProcessLookupError:
                    pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(TIMEOUT)
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()
        if self.ns is not None:
            assert eventually(lambda: not _members(self.ns), TIMEOUT), _members(self.ns)


def _child_of(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return int(f.read().split()[0])


def _pid_ns(pid):
    return os.readlink(f"/proc/{pid}/ns/pid")


def _members(ns):
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/ns/pid") == ns:
                out.append(int(pid))
        except OSError:
            pass
    return out


def everything_in(*directories):
    return sorted(os.path.join(d, n) for d in directories for n in os.listdir(d))


def test_normal_exit_of_pid_1_leaves_nothing(dirs):
    shm, run, env = dirs
    rc, out, err = run_bounded(argv("exit"), env=env)
    assert rc == 0, err[-3000:]
    names = json.loads(out)["names"]
    assert len(names) >= 5, names                    # (what there was to remove)
    # At once: the namespace is gone, no process of it could remove anything later.
    assert everything_in(shm, run) == []


def test_what_a_killed_pid_1_left_goes_when_the_next_program_starts(dirs):
    shm, run, env = dirs
    killed = Program("kill", env)
    assert killed.report["pid"] == 1
    killed.kill(frozen=True)      # (not frozen, its daemon may remove some first: 3 of 5 left)
    left = [p for p in everything_in(shm) if os.path.basename(p).startswith(PREFIX)]
    assert len(left) >= 5, left                      # (what there is to sweep)
    # The next start, in a namespace of its own: its daemon may have the dead one's pid.
    rc, out, err = run_bounded(argv("exit"), env=env)
    assert rc == 0, err[-3000:]
    assert everything_in(shm, run) == []


def test_the_sweep_leaves_what_live_programs_use(dirs):
    shm, run, env = dirs
    live = Program("hold", env)                      # pid 1 of a namespace, its daemon alive
    orphaned = Program("hold", env, namespace=False)  # its daemon killed, it lives on
    os.kill(orphaned.report["daemon"], signal.SIGKILL)
    assert eventually(lambda: not os.path.exists(f"/proc/{orphaned.report['daemon']}"), TIMEOUT)
    used = [os.path.join(shm, n) for n in live.report["names"] + orphaned.report["names"]]
    try:
        # The next program starts beside them (where it sees both: this namespace).
        rc, out, err = run_bounded(argv("start", namespace=False), env=env)
        assert rc == 0, err[-3000:]
        assert [p for p in used if not os.path.exists(p)] == []
        assert orphaned.finish() == 0                # (its arrays read back intact)
        # Its segments are no one's now: the next start removes them, not the live one's.
        rc, out, err = run_bounded(argv("start"), env=env)
        assert rc == 0, err[-3000:]
        gone = [os.path.join(shm, n) for n in orphaned.report["names"]
                if n not in live.report["names"]]
        assert eventually(lambda: not any(map(os.path.exists, gone)), TIMEOUT), \
            everything_in(shm)
        assert [p for p in used if p not in gone and not os.path.exists(p)] == []
        assert len(daemon.ledgers(shm)) == 1         # the live program's daemon's
        assert live.finish() == 0
    finally:
        for program in (live, orphaned):
            if program.proc.poll() is None:
                program.kill()
    assert eventually(lambda: everything_in(shm, run) == [], TIMEOUT), everything_in(shm, run)

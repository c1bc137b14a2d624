"""Resource limits: few fds (RLIMIT_NOFILE 64), a small address space (RLIMIT_AS), a memory cgroup.

Each case runs in a fresh subprocess that lowers its own limit, then does ordinary sharedmp
work; it must end in success or in a clear exception that names the setting to change,
never in a crash (a signal) or a hang (the subprocess is bounded).
"""
import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid

import pytest

TIMEOUT = 120

PRELUDE = """
import json, os, resource, sys
import numpy as np
import sharedmp as mp
out = {}
def attempt(name, fn):
    try:
        fn()
        out[name] = "ok"
    except Exception as e:
        out[name] = f"{type(e).__name__}: {e}"
"""


def run(body, *args):
    """Run PRELUDE + body in a fresh interpreter; its ``out`` dict (printed as JSON).

    Named segments go to a private directory, which must be empty once the program has
    ended (its manager daemon unlinks what is left; on a busy machine that takes a while).
    """
    code = PRELUDE + textwrap.dedent(body) + "\nprint(json.dumps(out), flush=True)\n"
    proc = run_program(["-c", code, *args])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_program(argv):
    """``python argv`` with a private shm directory and a daemon of its own (under its own
    limits); the finished process. It must succeed and leave no segment behind."""
    shm = tempfile.mkdtemp(prefix="sharedmp-limits-", dir="/dev/shm")
    env = dict(os.environ, SHAREDMP_SHM_DIR=shm)
    env.pop("SHAREDMP_MANAGER", None)
    try:
        proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                              timeout=TIMEOUT, env=env)
        assert proc.returncode == 0, f"crashed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        deadline = time.monotonic() + 30
        while os.listdir(shm) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.listdir(shm), f"segments left behind: {os.listdir(shm)}"
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return proc


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_64_fds(strategy):
    out = run("""
        mp.set_sharing_strategy(sys.argv[1])
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        small = []
        attempt("10000 small arrays", lambda: small.extend(mp.zeros(100) for _ in range(10000)))

        def queue_round_trip():
            ctx = mp.get_context("spawn")
            q, r = ctx.Queue(), ctx.Queue()
            p = ctx.Process(target=np.copyto, args=(mp.zeros(3), np.ones(3)))   # a child, too
            p.start(); p.join(60)
            assert p.exitcode == 0, p.exitcode
            for i in range(300):
                q.put([mp.full(10, i), {"i": i}])
            got = [q.get(timeout=60) for _ in range(300)]
            assert [int(a[0]) for a, _ in got] == list(range(300))
        attempt("queue of 300 messages", queue_round_trip)

        big = []
        attempt("100 arrays of 2 MiB", lambda: big.extend(mp.zeros(1 << 18) for _ in range(100)))
        big.clear()

        def many_fds_in_one_message():                # the receiver cannot take them all
            a, b = mp.Pipe()
            resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
            arrays = [mp.zeros(1 << 18) for _ in range(60)]          # 60 segments, 60 fds
            a.send(arrays)
            del arrays
            resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
            b.recv()
        attempt("one message with 60 fds", many_fds_in_one_message)
    """, strategy)
    assert out["10000 small arrays"] == "ok"
    assert out["queue of 300 messages"] == "ok"
    big = out["100 arrays of 2 MiB"]
    if strategy == "file_descriptor":       # 2 fds per mapped memfd segment on Python < 3.13
        assert big.startswith("OSError: [Errno 24] too many open files to create") and "ulimit -n" in big, big
    else:                                   # named segments keep no fd of their own
        assert big == "ok" or "ulimit -n" in big, big
    many = out["one message with 60 fds"]
    if strategy == "file_descriptor":       # the kernel drops the fds it cannot install
        assert many.startswith("ProtocolError") and "ulimit -n" in many, many
    elif sys.version_info < (3, 13):        # names travel; each mapping keeps mmap's dup
        assert many.startswith("OSError: [Errno 24] too many open files to map") and "ulimit -n" in many, many
    else:                                   # from 3.13 a mapping keeps no fd (trackfd=False)
        assert many == "ok", many


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_small_address_space(strategy):
    out = run("""
        mp.set_sharing_strategy(sys.argv[1])
        with open("/proc/self/status") as f:
            size = [int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize")][0]
        resource.setrlimit(resource.RLIMIT_AS, (size + (256 << 20), resource.RLIM_INFINITY))
        attempt("small", lambda: mp.zeros(1000).sum())
        attempt("512 MiB", lambda: mp.empty(512 << 20, np.uint8)[::4096].fill(1))
        attempt("small after", lambda: mp.zeros(1 << 20).sum())
    """, strategy)
    assert out["small"] == "ok" and out["small after"] == "ok", out
    assert out["512 MiB"].startswith("OutOfSharedMemory") and "ulimit -v" in out["512 MiB"], out


def _memory_cgroup(limit):
    """A fresh memory cgroup (v2 or v1) limited to ``limit`` bytes, or skip."""
    name = f"sharedmp-test-{uuid.uuid4().hex[:8]}"
    for base, limit_file in (("/sys/fs/cgroup", "memory.max"), ("/sys/fs/cgroup/memory", "memory.limit_in_bytes")):
        path = os.path.join(base, name)
        try:
            os.mkdir(path)
        except OSError:
            continue
        if not os.path.exists(os.path.join(path, "cgroup.procs")):     # a plain directory
            os.rmdir(path)
            continue
        try:
            with open(os.path.join(path, limit_file), "w") as f:
                f.write(str(limit))
            return path
        except OSError:
            os.rmdir(path)
    pytest.skip("no writable memory cgroup here (needs root and cgroup v1 or v2 with the memory controller)")


def _rmdir_when_empty(path, wait=10):
    # Under file_system the program's manager daemon lives in the cgroup too, and exits
    # within about 2 s of its last client (EBUSY until then).
    deadline = time.monotonic() + wait
    while True:
        try:
            return os.rmdir(path)
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
        time.sleep(0.05)


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_memory_cgroup(strategy):
    path = _memory_cgroup(256 << 20)
    try:
        out = run("""
            with open(os.path.join(sys.argv[2], "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
            mp.set_sharing_strategy(sys.argv[1])
            attempt("small", lambda: mp.zeros(1000).sum())
            attempt("512 MiB", lambda: mp.empty(512 << 20, np.uint8)[::4096].fill(1))
            attempt("64 MiB", lambda: mp.empty(64 << 20, np.uint8)[::4096].fill(1))
        """, strategy, path)
    finally:
        _rmdir_when_empty(path)
    assert out["small"] == "ok" and out["64 MiB"] == "ok", out
    assert out["512 MiB"].startswith("OutOfSharedMemory") and "cgroup" in out["512 MiB"], out


KEEP = """
import resource, sys, torch
import sharedmp as mp

def consume(q, r, n):
    kept = [q.get(timeout=120) for _ in range(n)]          # every tensor received is kept
    r.put((sum(int(t[0]) for t in kept), all(mp.is_shared(t) for t in kept)))

if __name__ == "__main__":
    strategy, n = sys.argv[1], int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))  # children and daemon inherit it
    mp.set_sharing_strategy(strategy)
    ctx = mp.get_context("spawn")
    q, r = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=consume, args=(q, r, n))
    p.start()
    for i in range(n):
        q.put(torch.full((256,), float(i)))                 # plain tensors, not shared yet
    print(r.get(timeout=120), flush=True)
    p.join(60)
    assert p.exitcode == 0, p.exitcode
"""


@pytest.mark.parametrize("n", [2000, 20000])
@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_kept_tensors_under_an_fd_limit_of_256(strategy, n, tmp_path):
    # file_system exists for this: many kept tensors under a low fd limit. Its daemon holds
    # a few pipes per channel end, not one per message in flight (it died of EMFILE once).
    pytest.importorskip("torch")
    script = tmp_path / "keep.py"
    script.write_text(KEEP)
    proc = run_program([str(script), strategy, str(n)])
    assert proc.stdout.split("\n")[-2] == f"({n * (n - 1) // 2}, True)", proc.stdout


def test_a_daemon_out_of_fds_refuses_new_clients_clearly_and_serves_the_others():
    # The daemon's fd limit lowered (prlimit) until it cannot accept a client: that client is
    # told why and what to do; the daemon keeps serving, and leaves nothing behind.
    out = run("""
        import socket
        from sharedmp.memory import manager
        mp.set_sharing_strategy("file_system")
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        for i in range(100):
            q.put(mp.full(10, i))                        # in flight while the daemon is full
        pid = manager.daemon_pid()
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (48, 48))
        held, reply = [], b""
        while len(held) < 100:
            s = socket.socket(socket.AF_UNIX)
            s.connect(manager.address())
            s.settimeout(30)
            reply = s.recv(4096)
            held.append(s)
            if not reply.startswith(b"OK "):
                break
        out["reply"] = reply.decode()
        out["refused_after"] = len(held)
        def clear_error():
            manager._hello(manager.address())
        attempt("hello while full", clear_error)
        # Freed and asked at once: the daemon stopped while the held clients leave and a new
        # one connects, so it sees both in one wake-up; the new one is taken, not refused.
        import signal
        os.kill(pid, signal.SIGSTOP)
        for s in held:
            s.close()
        s = socket.socket(socket.AF_UNIX)
        s.connect(manager.address())
        s.settimeout(30)
        os.kill(pid, signal.SIGCONT)
        out["freed and asked"] = s.recv(4096).decode()
        s.close()
        got = [int(q.get(timeout=30)[0]) for _ in range(100)]
        out["received"] = got == list(range(100))
        attempt("served after", lambda: [q.put(mp.full(1 << 18, 1.0)), q.get(timeout=30)])
        out["daemon"] = manager.stats()["clients"] >= 1
    """)
    assert out["reply"].startswith("FULL ") and "ulimit -n" in out["reply"], out
    assert out["refused_after"] > 10, out
    hello = out["hello while full"]
    assert hello.startswith("ManagerError") and "ulimit -n" in hello and "(48)" in hello, hello
    assert out["freed and asked"].startswith("OK "), out
    assert out["received"] and out["served after"] == "ok" and out["daemon"], out


FULL_TMPFS = """
import gc, json, os, sys, time
import sharedmp as mp
mp.set_sharing_strategy("file_system")
shm = os.environ["SHAREDMP_SHM_DIR"]

def pooled():
    return sum(len(os.listdir(os.path.join(shm, d))) for d in os.listdir(shm)
               if d.startswith(".sharedmp-pool-"))

out = []
for _ in range(5):
    a = [mp.zeros(1 << 19) for _ in range(2)]          # 2 x 4 MiB of the 12 MiB tmpfs
    del a
    gc.collect()
    deadline = time.monotonic() + 10
    while pooled() < 2 and time.monotonic() < deadline:   # the daemon pools them
        time.sleep(0.01)
    try:
        b = mp.zeros(1 << 20)          # 8 MiB: no pooled segment fits, and only 4 MiB is free
        b[:] = 1
        out.append("ok")
    except Exception as e:             # noqa: BLE001 (reported)
        out.append(f"{type(e).__name__}: {e}")
    b = None
    mp.empty_cache()
print(json.dumps(out), flush=True)
"""


def test_a_full_shm_directory_is_retried_once_the_pool_is_given_back(tmp_path):
    """The segments kept for reuse fill a 12 MiB tmpfs; a segment that does not fit is made
    once they are given back: under file_system the retry waits for the daemon to unlink
    them (issue 40: it retried at once, and raised OutOfSharedMemory while the memory was
    about to come back). The tmpfs is mounted in a user and mount namespace of its own."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1)")
    mnt = tmp_path / "shm"
    mnt.mkdir()
    script = tmp_path / "full.py"
    script.write_text(FULL_TMPFS)
    env = dict(os.environ, SHAREDMP_SHM_DIR=str(mnt))
    env.pop("SHAREDMP_MANAGER", None)
    proc = subprocess.run(
        [unshare, "-rm", "sh", "-c", 'mount -t tmpfs -o size=12m tmpfs "$0" || exit 77; '
         'exec "$1" "$2"', str(mnt), sys.executable, str(script)],
        capture_output=True, text=True, timeout=TIMEOUT, env=env)
    if proc.returncode == 77 or "unshare failed" in proc.stderr:
        pytest.skip(f"cannot mount a tmpfs in a namespace of its own here: {proc.stderr[-200:]}")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == ["ok"] * 5

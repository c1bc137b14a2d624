"""The file_system manager daemon: reference tracking, crashes of any process, other users.

The whole-program scenarios run ``_manager_drivers.py`` in subprocesses without
$SHAREDMP_MANAGER, so that each has a daemon of its own, and a private shm directory,
so that what it leaves is its own.
"""
import concurrent.futures
import gc
import json
import os
import random
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

import sharedmp as mp
from sharedmp.memory import manager, named, segment

from conftest import TIMEOUT, eventually, join_or_kill, proc_stat

HERE = os.path.dirname(os.path.abspath(__file__))
DRIVERS = os.path.join(HERE, "_manager_drivers.py")
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")


def alive(pid):
    """Whether ``pid`` is a live process (a zombie is not)."""
    st = proc_stat(pid)
    return st is not None and st[0] not in "ZX"


def kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def segments_in(directory):
    return sorted(n for n in os.listdir(directory) if n.startswith(named.PREFIX))


def size_of(path):
    # The daemon may unlink a segment between listdir() and stat(): that is the point.
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


class Driver:
    """A program of _manager_drivers.py in a subprocess, read line by line with timeouts."""

    def __init__(self, shm_dir, *args, **env):
        e = {k: v for k, v in os.environ.items()
             if k not in (manager.ENV, mp.strategy.ENV, "SHAREDMP_KEEP_ORPHANS")}
        e.update({named.SHM_DIR_ENV: str(shm_dir), "PYTHONUNBUFFERED": "1"}, **env)
        self.proc = subprocess.Popen([sys.executable, DRIVERS, *map(str, args)], env=e, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
        self.pids = []              # more processes of the program, killed by close()

    def read(self, timeout=TIMEOUT):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            kill(self.proc.pid)
            err = self.proc.stderr.read()[-3000:]
            self.close()
            pytest.fail(f"the driver said nothing within {timeout} s: {err}")
        return json.loads(line)

    def wait(self, timeout=TIMEOUT):
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.close()
            pytest.fail(f"the driver did not end within {timeout} s")

    def close(self):
        for pid in [self.proc.pid] + self.pids:
            kill(pid)
        self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            f.close()


# -- one process and its children -------------------------------------------------------

@pytest.fixture
def fs(tmp_path, monkeypatch):
    monkeypatch.setenv(named.SHM_DIR_ENV, str(tmp_path))
    mp.set_sharing_strategy("file_system")
    return tmp_path


def test_daemon_in_its_own_session_with_a_private_socket(fs):
    mp.zeros(1 << 18)
    path, pid = manager.address(), manager.daemon_pid()
    assert os.environ[manager.ENV] == path
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert stat.S_ISSOCK(os.stat(path).st_mode)
    assert os.getsid(pid) != os.getsid(0)                                # its own session
    assert proc_stat(pid)[1] != os.getpid()          # not our child: nothing of ours waits for it


# A program that leaves what it holds to its exit: arrays it keeps, a queue's feeder, a child
# whose thread makes a named segment after its run() returned.
AT_EXIT = """
import sys
import threading
import time
import numpy as np
import sharedmp as mp
from sharedmp.memory import manager

def late(outbox):
    time.sleep(0.3)
    outbox.put(mp.full(1 << 18, 7.0))      # a named segment made after run() returned

def child(inbox, outbox):
    outbox.put(inbox.get(timeout=60) + 1)
    threading.Thread(target=late, args=(outbox,)).start()

if __name__ == "__main__":
    mp.set_sharing_strategy("file_system")
    keep = [mp.zeros(1 << 18), mp.full(10, 3.0)]
    ctx = mp.get_context(sys.argv[1])
    inbox, outbox = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(inbox, outbox))
    p.start()
    inbox.put(keep[0])
    print(manager.daemon_pid(), flush=True)
    assert (outbox.get(timeout=60) == 1).all()
    assert (outbox.get(timeout=60) == 7).all()
    p.join(60)
    inbox.put(np.ones(1 << 16))            # left in the queue: the feeder flushes it at exit
"""


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_a_program_ends_without_resource_warnings_leaving_nothing(tmp_path, method):
    # The standard library at exit (python -X dev) warns of nothing it left open; nor does a
    # program of sharedmp's: no unclosed socket to the daemon, no daemon Popen still running.
    env = {k: v for k, v in os.environ.items() if k not in (manager.ENV, mp.strategy.ENV)}
    env[named.SHM_DIR_ENV] = str(tmp_path)
    script = tmp_path / "at_exit.py"
    script.write_text(AT_EXIT)
    proc = subprocess.run([sys.executable, "-X", "dev", str(script), method], env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    # (3.12+ also warns, DeprecationWarning, of a fork in a process with threads: here the
    # queue's feeder thread, as the standard library's; sharedmp runs no thread of its own
    # for the memory it caches, memory/cache.py)
    assert "ResourceWarning" not in proc.stderr, proc.stderr
    daemon = int(proc.stdout.split()[0])
    assert eventually(lambda: not alive(daemon)), "the daemon outlived its last client"
    assert segments_in(tmp_path) == []


def test_children_reuse_the_parents_daemon_unrelated_programs_get_their_own(fs):
    mp.zeros(10)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_report_daemon, args=(q,))
    p.start()
    child = q.get(timeout=TIMEOUT)
    assert join_or_kill(p) == 0
    assert child == manager.daemon_pid()
    d = Driver(fs, "daemon_killed")               # an unrelated program: no $SHAREDMP_MANAGER
    other = d.read()["daemon"]
    d.close()
    assert other != manager.daemon_pid()


def _report_daemon(q):
    mp.zeros(1 << 18)
    q.put(manager.daemon_pid())


def test_in_flight_name_outlives_the_sender(fs):
    # The child makes the segment, sends it and exits at once: the name must stay valid
    # until this process attaches, though no process maps it in between.
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_send_and_exit, args=(q,))      # (this process connects here)
    clients = manager.stats()["clients"]
    p.start()
    assert join_or_kill(p) == 0
    # The daemon has read the child's last records and seen it go (what it held, dropped).
    assert eventually(lambda: manager.stats()["clients"] <= clients, TIMEOUT, collect=False)
    small, big = q.get(timeout=TIMEOUT)
    assert (small == 3).all() and (big == 4).all() and mp.is_shared(big)
    del small, big
    segment.forget_recent()                        # the receiver keeps its recent arenas mapped
    assert eventually(lambda: not segments_in(fs))


def _send_and_exit(q):
    q.put((mp.full(10, 3.0), mp.full(1 << 18, 4.0)))
    os._exit(0)


def test_killed_client_releases_what_it_held(fs):
    # While this process lives (so the daemon does too), a child's SIGKILL alone must free
    # the segments only that child held.
    ctx = mp.get_context("spawn")
    r, w = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_make_and_hang, args=(w,))
    p.start()
    try:
        assert r.poll(TIMEOUT)
        names = r.recv()
        assert set(names) <= set(segments_in(fs)) and len(names) == 2
        kill(p.pid)
        assert join_or_kill(p) == -signal.SIGKILL
        assert eventually(lambda: not set(names) & set(segments_in(fs)))
        assert alive(manager.daemon_pid())                 # the daemon itself lives on
    finally:
        kill(p.pid)


def _make_and_hang(w):
    kept = [mp.zeros(10), mp.zeros(1 << 18)]
    w.send([mp.arrays.mapping_of(a)[1].name for a in kept])
    time.sleep(TIMEOUT)


def test_fork_child_holds_what_it_inherited(fs):
    a = mp.full(1 << 18, 1.0)
    name = mp.arrays.mapping_of(a)[1].name
    ctx = mp.get_context("fork")
    r, w = ctx.Pipe(duplex=False)
    go = ctx.Event()
    p = ctx.Process(target=_inherit, args=(a, w, go))
    p.start()
    assert r.poll(TIMEOUT) and r.recv() == "holding"
    del a                                          # the parent lets go; the child still holds
    gc.collect()
    time.sleep(0.1)                # (nothing to wait for: had the daemon unlinked it, by now)
    assert name in segments_in(fs)
    go.set()
    assert r.poll(TIMEOUT) and r.recv() == name    # the child sent it on by name: it still exists
    assert join_or_kill(p) == 0
    segment.forget_recent()
    assert eventually(lambda: not segments_in(fs))


def _inherit(a, w, go):
    w.send("holding")
    go.wait(TIMEOUT)
    q = mp.get_context("fork").SimpleQueue()
    q.put(a)
    b = q.get()                                    # attaches by name
    assert (b == 1.0).all()
    w.send(mp.arrays.mapping_of(b)[1].name)


def test_prompt_release_keeps_the_directory_bounded(fs):
    # 10,000 arrays of 64 KiB (625 MiB in all, 157 arenas if nothing were freed), each
    # dropped by the producer after put() and by the consumer after reading it.
    ctx = mp.get_context("spawn")
    q = ctx.Queue(maxsize=32)
    p = ctx.Process(target=_stream, args=(q, 10000, 1 << 13))
    p.start()
    most_files = most_bytes = most_tracked = 0
    before = manager.stats()                       # this process's own arenas of earlier tests
    try:
        for i in range(10000):
            a = q.get(timeout=TIMEOUT)
            assert a[0] == i
            del a
            if i % 100 == 0:
                names = segments_in(fs)
                sizes = [size_of(fs / n) for n in names]
                most_files, most_bytes = max(most_files, len(names)), max(most_bytes, sum(sizes))
            if i % 1000 == 0:
                most_tracked = max(most_tracked, manager.stats()["segments"])
    finally:
        join_or_kill(p)
    assert most_files <= 16 and most_bytes <= 64 << 20, (most_files, most_bytes)
    assert most_tracked <= before["segments"] + 16
    segment.forget_recent()
    assert eventually(lambda: not segments_in(fs))
    assert eventually(lambda: manager.stats() == before)


def _stream(q, n, size):
    for i in range(n):
        q.put(mp.full(size, float(i)))


def test_hostile_records_never_unlink_foreign_files(fs):
    bystander = fs / "not_a_segment"
    bystander.write_bytes(b"x")
    lookalike = fs / ("sharedmp_" + "a" * 20)
    lookalike.write_bytes(b"y")
    mp.zeros(10)
    s = socket.socket(socket.AF_UNIX)
    s.connect(manager.address())
    assert s.recv(100).startswith(b"OK ")
    s.sendall(b"HELLO 1\n")
    s.sendall(b"C %s\nD %s\nC /etc/passwd\nD /etc/passwd\nC relative/sharedmp_%s\nQ junk\n\n"
              % (bytes(bystander), bytes(bystander), b"b" * 20))
    s.sendall(b"C %s\nD %s\n" % (bytes(lookalike), bytes(lookalike)))   # same uid: its call
    s.close()
    assert eventually(lambda: not lookalike.exists())
    assert bystander.exists() and os.path.exists("/etc/passwd")
    s = socket.socket(socket.AF_UNIX)                  # no HELLO: hung up on
    s.connect(manager.address())
    s.settimeout(TIMEOUT)
    assert s.recv(100).startswith(b"OK ")
    s.sendall(b"GARBAGE\n")
    assert s.recv(100) == b""
    s.close()
    assert (mp.zeros(1 << 18) == 0).all()              # the daemon still serves


def test_token_records_read_before_or_after_the_end_of_their_pipe(fs):
    # The daemon reads a client's socket and its token pipes in no set order, so a "t"
    # record (one more message on a token) sent before the token's last copy closed may be
    # read after its end. Such a record must hold nothing (its message is gone); had it been
    # taken for a new token, its reference would have stayed in flight until the client left.
    import array
    a = mp.zeros(10)
    path = os.fsencode(mp.arrays.mapping_of(a)[1].path)
    name = os.path.basename(path).decode()
    before = manager.stats()
    s = socket.socket(socket.AF_UNIX)
    s.connect(manager.address())
    s.settimeout(TIMEOUT)
    assert s.recv(100).startswith(b"OK ")
    s.sendall(b"HELLO 1\n")

    def applied():             # one client's records are applied in order: "?" answers after
        s.sendall(b"? -\n")
        reply = b""
        while not reply.endswith(b"\n"):
            reply += s.recv(100)

    def new_token(ident):
        r, w = os.pipe()
        s.sendmsg([b"T %d %s\n" % (ident, path)],
                  [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [r]))])
        os.close(r)
        return w

    try:
        live = new_token(1)
        s.sendall(b"t 1 %s\n" % path)                  # a second message on a live token
        os.close(new_token(2))                          # a token whose messages are all gone
        applied()
        assert eventually(lambda: manager.stats()["tokens"] == before["tokens"] + 1)
        assert manager.stats()["in_flight"] == before["in_flight"] + 2     # token 1's two
        s.sendall(b"t 2 %s\n" % path)                  # read after its end
        applied()
        assert manager.stats()["in_flight"] == before["in_flight"] + 2
        del a
        segment.forget_recent()
        mp.empty_cache()
        gc.collect()
        applied()
        assert name in segments_in(fs)                  # token 1 still holds it in flight
        os.close(live)
        assert eventually(lambda: name not in segments_in(fs))
    finally:
        s.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root")
def test_another_uid_is_refused(fs):
    import pwd
    try:
        nobody = pwd.getpwnam("nobody").pw_uid
    except KeyError:
        pytest.skip("no user 'nobody'")
    # The code below needs only the standard library: any Python that user may run.
    python = next((p for p in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3")
                   if _runs_as(nobody, p)), None)
    if python is None:
        pytest.skip("no Python that user 'nobody' may run")
    mp.zeros(10)
    path = manager.address()
    code = ("import socket, sys\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            "try:\n"
            f"    s.connect({path!r})\n"
            "except OSError as e:\n"
            "    print('connect', type(e).__name__); sys.exit()\n"
            "s.settimeout(30)\n"
            "print('reply', s.recv(200).decode().strip())\n")

    def as_nobody():
        return subprocess.run([python, "-I", "-S", "-c", code], user=nobody, capture_output=True,
                              text=True, timeout=TIMEOUT, cwd="/").stdout.strip()
    assert as_nobody() == "connect PermissionError"    # the 0700 directory
    directory = os.path.dirname(path)
    os.chmod(directory, 0o755)                         # past the directory: SO_PEERCRED
    os.chmod(path, 0o777)
    try:
        reply = as_nobody()
    finally:
        os.chmod(directory, 0o700)
    assert reply.startswith("reply NO") and "user" in reply
    assert (mp.zeros(1 << 18) == 0).all()


def _runs_as(uid, python):
    try:
        return subprocess.run([python, "-I", "-S", "-c", "pass"], user=uid, capture_output=True,
                              timeout=TIMEOUT, cwd="/").returncode == 0
    except OSError:
        return False


# -- whole programs killed --------------------------------------------------------------

def _one_round(base, seed):
    """A program whose producer (and sometimes the program) is SIGKILLed at a random moment."""
    rng = random.Random(seed)
    shm = os.path.join(base, f"round{seed}")
    os.mkdir(shm)
    d = Driver(shm, "round", seed)
    first = d.read()
    d.pids.append(first["child"])
    time.sleep(rng.uniform(0, 0.25))                   # before, during, after put(); while mapping
    kill(first["child"])
    if rng.random() < 0.3:
        kill(d.proc.pid)                               # the receiver too
    try:
        d.proc.wait(TIMEOUT)
    finally:
        d.close()
    gone = eventually(lambda: not alive(first["daemon"]) and not segments_in(shm), timeout=5)
    return seed, gone, segments_in(shm), alive(first["daemon"]), d.proc.returncode


@linux_only
@pytest.mark.leaks_ok
@pytest.mark.timeout(600)
@pytest.mark.slow    # (.ci/run: 3.11 only)
def test_100_rounds_of_sigkill_leave_nothing(tmp_path):
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda s: _one_round(str(tmp_path), s), range(100)))
    bad = [r for r in results if not r[1]]
    assert not bad, f"rounds that left segments or a daemon: {bad[:5]}"
    assert all(r[4] in (0, -signal.SIGKILL) for r in results), \
        [r for r in results if r[4] not in (0, -9)]


@linux_only
@pytest.mark.leaks_ok
@pytest.mark.slow    # (.ci/run: 3.11 only; 21 s each)
def test_parent_sigkilled_while_children_hold_segments(tmp_path, fork_or_spawn):
    # (Not forkserver: there the children are the fork server's, not the killed program's,
    # and the run takes 20 s more, until the orphaned server has gone.)
    d = Driver(tmp_path, "parent", fork_or_spawn, SHAREDMP_KEEP_ORPHANS="1")   # they outlive it
    info = d.read()
    d.pids += info["children"]
    assert len(segments_in(tmp_path)) >= 2
    kill(d.proc.pid)
    d.proc.wait(TIMEOUT)
    try:
        assert eventually(lambda: not any(alive(p) for p in info["children"]), timeout=TIMEOUT)
        assert eventually(lambda: not segments_in(tmp_path) and not alive(info["daemon"]))
    finally:
        d.close()


@linux_only
@pytest.mark.leaks_ok
def test_daemon_sigkilled_clear_error_then_doctor_clean(tmp_path):
    # A runtime directory of its own: a doctor --clean of another test meanwhile (the other
    # pytest worker) would clean the dead daemon's directory of the shared one first. (Short:
    # an AF_UNIX socket's path has at most 107 bytes, tmp_path's can be longer.)
    runtime = tempfile.mkdtemp(prefix="rt-", dir="/tmp")
    try:
        _daemon_sigkilled_then_doctor(tmp_path, runtime)
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


def _daemon_sigkilled_then_doctor(tmp_path, runtime):
    d = Driver(tmp_path, "daemon_killed", XDG_RUNTIME_DIR=runtime)
    info = d.read()
    kill(info["daemon"])
    assert eventually(lambda: not alive(info["daemon"]))
    d.proc.stdin.write("go\n")
    d.proc.stdin.flush()
    out = d.read()
    d.wait()
    d.close()
    for what, text in out["errors"].items():           # documented: a clear error, no crash
        assert text and "doctor --clean" in text and "file_descriptor" in text, (what, text)
    assert out["kept_ok"]
    left = segments_in(tmp_path)
    assert left, "nothing was left: this scenario tests the cleaning"
    env = {k: v for k, v in os.environ.items() if k != manager.ENV}
    env[named.SHM_DIR_ENV] = str(tmp_path)
    env["XDG_RUNTIME_DIR"] = runtime
    doctor = subprocess.run([sys.executable, "-m", "sharedmp", "doctor", "--clean"], env=env,
                            capture_output=True, text=True, timeout=TIMEOUT)
    assert not segments_in(tmp_path), doctor.stdout
    for name in left:
        assert name in doctor.stdout                   # it lists what it removed
    assert not os.path.exists(info["socket"])          # and the dead daemon's socket
    assert os.path.dirname(info["socket"]) in doctor.stdout


def test_two_threads_carrying_on_one_channel_never_get_a_closed_token():
    # A token dying in one thread (its last message gone) while the other takes it back
    # through the channel's weak reference: once __del__ closed the fd before that reference
    # died, and the taker went on sending a closed (later a reused) fd number.
    import threading
    prev = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        a = mp.zeros(10)                    # the daemon runs; a named segment exists
        path = mp.arrays.mapping_of(a)[1].path
        tokens = manager.Tokens()
        bad = []

        def carry(n):
            try:
                for i in range(n):
                    if i % 500 == 0:
                        tokens.expire(None)     # let go of the current one, as the cache does
                    fd, owner = tokens.carry([path])
                    try:
                        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                            bad.append(f"fd {fd} is no pipe")
                    except OSError as e:
                        bad.append(f"fd {fd}: {e}")
                    del owner                   # the message is gone: its token may die now
            except Exception as e:
                bad.append(repr(e))

        threads = [threading.Thread(target=carry, args=(10000,)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        assert not any(t.is_alive() for t in threads)
        assert not bad, f"{len(bad)} of 20000 messages got a closed token: {bad[:3]}"
        del a
        # Every reference in flight ends with its token, in whatever order the daemon reads
        # the records and the token pipes (a record read after its token's end held the
        # segment until this process left).
        assert eventually(lambda: not os.path.exists(path), timeout=TIMEOUT), path
    finally:
        mp.set_sharing_strategy(prev)


@linux_only
def test_the_daemons_fds_do_not_grow_with_messages_in_flight(fs):
    # 20,300 messages put and not yet read, from a child and from this process: the daemon
    # holds a few pipes per channel end (tokens), not one per message or per burst.
    mp.zeros(10)
    pid = manager.daemon_pid()
    base = len(os.listdir(f"/proc/{pid}/fd"))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_put_many, args=(q, 300))
    p.start()
    assert join_or_kill(p) == 0
    for i in range(20000):
        q.put(mp.full(10, i))             # (what the socket cannot take waits in the feeder)
        if i % 50 == 0:
            time.sleep(0.001)             # spread over more than one token's time
    in_flight = manager.stats()
    most = len(os.listdir(f"/proc/{pid}/fd"))
    # (+48: connections of processes that come and go meanwhile, of this test and of others
    # of this pytest worker, that a busy daemon has not seen close yet; not one per message
    # of the 20,300: the tokens, below, are the bound that counts)
    assert most <= base + 2 * (manager.MAX_OPEN + 1) + 48, (base, most, in_flight)
    assert in_flight["tokens"] <= 2 * (manager.MAX_OPEN + 1), in_flight
    got = sorted(int(q.get(timeout=TIMEOUT)[0]) for _ in range(20300))
    assert got == sorted([*range(300), *range(20000)])      # nothing lost


def _put_many(q, n):
    for i in range(n):
        q.put(mp.full(10, i))


STDLIB_QUEUE_PROGRAM = '''
import multiprocessing, sys, time
import numpy as np
import sharedmp as mp

def child(q):
    q.put(np.full(1 << 17, 7.0))            # 1 MiB plain array: copied into a named segment

if __name__ == "__main__":
    mp.set_sharing_strategy("file_system")
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    p.join(30)
    time.sleep(3)                           # the child's daemon had no client left 1.5 s ago
    a = q.get(timeout=10)
    print(float(a[0]), a.shape[0], mp.is_shared(a), flush=True)
'''


def test_a_message_on_a_stdlib_queue_outlives_its_senders_exit(tmp_path):
    """Issue 46: a spawn child of the standard library's context puts an array on its Queue
    and exits; the parent, which never needed a daemon, gets it 3 s later (it raised
    SegmentError: the child's daemon had quit 1.5 s after the child, and the parent would
    have started another). Nothing is left once the program has ended."""
    from conftest import run_bounded
    script, shm = tmp_path / "program.py", tmp_path / "shm"
    script.write_text(STDLIB_QUEUE_PROGRAM)
    shm.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "SHAREDMP_MANAGER"}
    env["SHAREDMP_SHM_DIR"] = str(shm)
    code, out, err = run_bounded([sys.executable, str(script)], env=env, cwd=str(tmp_path))
    assert code == 0, err[-3000:]
    assert out.split() == ["7.0", str(1 << 17), "True"]
    assert eventually(lambda: os.listdir(shm) == [], timeout=10), os.listdir(shm)


def test_any_runtime_dir_works(tmp_path):
    """Issue 46: a long $XDG_RUNTIME_DIR (or $TMPDIR) made every file_system allocation raise
    `OSError: AF_UNIX path too long`: the daemon's socket goes under /tmp then."""
    from conftest import run_bounded
    long_dir = tmp_path / ("x" * 86)
    long_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "SHAREDMP_MANAGER"}
    env.update(XDG_RUNTIME_DIR=str(long_dir), TMPDIR=str(long_dir),
               SHAREDMP_SHARING_STRATEGY="file_system", SHAREDMP_SHM_DIR=str(tmp_path))
    code, out, err = run_bounded([sys.executable, "-c", (
        "import sharedmp as mp; from sharedmp.memory import manager\n"
        "a = mp.full(10, 3.0); print(manager.address(), a.sum())")], env=env)
    assert code == 0, err[-3000:]
    path, total = out.split()
    assert path.startswith("/tmp/sharedmp-") and float(total) == 30.0

"""`python -m sharedmp doctor`: real runs in subprocesses, and the leftover functions in-process."""
import ctypes
import json
import mmap
import os
import pathlib
import secrets
import shutil
import subprocess
import sys
import tempfile

import pytest

import sharedmp
from sharedmp.cli import doctor as doctor_mod
from sharedmp.memory import daemon, leftovers, named, segment
from sharedmp.memory.named import PREFIX, SHM_DIR_ENV
from sharedmp.strategy import ENV as STRATEGY_ENV

from _helpers import eventually

TIMEOUT = 60
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")


def sharedmp_cli(*args, env=None, **kwargs):
    full_env = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    return subprocess.run([sys.executable, "-m", "sharedmp", *args], capture_output=True, text=True,
                          timeout=TIMEOUT, env=full_env, **kwargs)


def run_doctor(*args, env=None, **kwargs):
    return sharedmp_cli("doctor", *args, env=env, **kwargs)


def run_json(*args, env=None):
    proc = run_doctor("--json", *args, env=env)
    report = json.loads(proc.stdout)
    assert report["exit_status"] == proc.returncode
    return proc.returncode, report


def checks_named(report, name):
    return [c for c in report["checks"] if c["name"] == name]


def segment_file(directory, size=4096):
    path = os.path.join(directory, PREFIX + secrets.token_hex(10))
    with open(path, "wb") as f:
        f.write(b"\0" * size)
    return path


class MapOnly:
    """A shared mapping of ``path`` with no fd left open (Python's mmap keeps a dup fd)."""

    def __init__(self, path, size=4096):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.mmap.restype = ctypes.c_void_p
        self.libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                   ctypes.c_int, ctypes.c_long]
        self.libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        fd = os.open(path, os.O_RDWR)
        try:
            addr = self.libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        finally:
            os.close(fd)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        self.addr, self.size = addr, size

    def close(self):
        self.libc.munmap(self.addr, self.size)


def test_doctor_passes_here():
    proc = run_doctor()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "file_descriptor" in out and "file_system" in out
    for name in ("platform", "python", "numpy", "torch", "fd limit", "memfd", "shm dir", "leftovers",
                 "round trip"):
        assert name in out
    assert " FAIL " not in out
    assert out.rstrip().endswith("(exit 0)")


def test_doctor_json():
    code, report = run_json()
    assert code == 0
    by_name = {c["name"]: c for c in report["checks"]}
    assert by_name["strategies"]["status"] == "ok"
    assert {c["status"] for c in report["checks"]} <= {"ok", "warn", "FAIL"}
    assert len(checks_named(report, "round trip")) == len(sharedmp.get_all_sharing_strategies())
    assert report["removed"] == []


def test_doctor_does_not_import_torch():
    code = ("import sys, contextlib, io\n"
            "from sharedmp.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    rc = main(['doctor'])\n"
            "assert 'torch' not in sys.modules, 'doctor imported torch'\n"
            "sys.exit(rc)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_help_lists_doctor_and_command_is_required():
    proc = sharedmp_cli("--help")
    assert proc.returncode == 0 and "doctor" in proc.stdout
    proc = sharedmp_cli()
    assert proc.returncode == 2
    proc = sharedmp_cli("no-such-command")
    assert proc.returncode == 2


def test_invalid_strategy_fails_naming_the_variable():
    proc = run_doctor(env={STRATEGY_ENV: "nope"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert STRATEGY_ENV in proc.stdout
    assert "FAIL" in proc.stdout and "file_system" in proc.stdout


def test_missing_shm_dir_fails_under_file_system(tmp_path):
    missing = str(tmp_path / "no" / "such" / "dir")
    proc = run_doctor(env={SHM_DIR_ENV: missing, STRATEGY_ENV: "file_system"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert missing in proc.stdout and "FAIL" in proc.stdout
    assert not os.path.exists(missing)


@linux_only
def test_missing_shm_dir_only_warns_under_file_descriptor(tmp_path):
    missing = str(tmp_path / "missing")
    code, report = run_json(env={SHM_DIR_ENV: missing, STRATEGY_ENV: "file_descriptor"})
    assert code == 0
    assert checks_named(report, "shm dir")[0]["status"] == "warn"


def test_low_fd_limit():
    resource = pytest.importorskip("resource")

    def limit(n):
        return lambda: resource.setrlimit(resource.RLIMIT_NOFILE,
                                          (n, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    proc = run_doctor("--json", preexec_fn=limit(256))
    fd = checks_named(json.loads(proc.stdout), "fd limit")[0]
    assert proc.returncode == 0 and fd["status"] == "warn" and "ulimit -n" in fd["fix"]
    proc = run_doctor("--json", preexec_fn=limit(40))
    fd = checks_named(json.loads(proc.stdout), "fd limit")[0]
    assert proc.returncode == 1 and fd["status"] == "FAIL"


@linux_only
def test_leftovers_reported_and_cleaned(tmp_path):
    directory = str(tmp_path)
    leftover = segment_file(directory, 8192)
    mapped = segment_file(directory)            # mapped here (Python's mmap also keeps an fd)
    map_only = segment_file(directory)          # mapped, no fd
    fd_only = segment_file(directory)           # open, not mapped
    other = os.path.join(directory, "not_a_segment")
    open(other, "w").close()
    # (not this pytest process's daemon, inherited through $SHAREDMP_MANAGER: it would keep
    # a pool directory in this directory until the whole run ends)
    env = {SHM_DIR_ENV: directory, STRATEGY_ENV: None, "SHAREDMP_MANAGER": None}
    with open(mapped, "r+b") as f:
        mm = mmap.mmap(f.fileno(), 4096)
    raw = MapOnly(map_only)
    fd = os.open(fd_only, os.O_RDONLY)
    try:
        code, report = run_json(env=env)
        assert code == 0
        (check,) = checks_named(report, "leftovers")
        assert check["status"] == "warn" and "--clean" in check["fix"]
        listed = "\n".join(check["items"])
        assert leftover in listed and "8.0 KiB" in listed
        for busy in (mapped, map_only, fd_only):
            assert busy not in listed
        assert os.path.exists(leftover)         # reporting removes nothing

        proc = run_doctor("--clean", env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"removed {leftover}" in proc.stdout
        assert not os.path.exists(leftover)
        for busy in (mapped, map_only, fd_only, other):
            assert os.path.exists(busy), busy
            assert f"removed {busy}" not in proc.stdout

        code, report = run_json("--clean", env=env)
        assert code == 0 and report["removed"] == []
        assert checks_named(report, "leftovers")[0]["status"] == "ok"
    finally:
        mm.close()
        raw.close()
        os.close(fd)
    # Released now: all three are leftovers, and --clean takes them (the test's own cleanup).
    code, report = run_json("--clean", env=env)
    assert code == 0
    assert sorted(r["path"] for r in report["removed"]) == sorted([mapped, map_only, fd_only])
    # (the daemon doctor started removes its pool directory as it exits, a moment after
    # doctor's own exit)
    assert eventually(lambda: os.listdir(directory) == ["not_a_segment"], TIMEOUT), \
        os.listdir(directory)


@linux_only
def test_find_leftovers_and_clean_in_process(tmp_path):
    directory = str(tmp_path)
    leftover = segment_file(directory, 12345)
    busy = segment_file(directory)
    young = segment_file(directory)
    old = os.stat(leftover).st_mtime - 3600
    os.utime(leftover, (old, old))
    os.utime(busy, (old, old))
    with open(busy, "r+b") as f:
        mm = mmap.mmap(f.fileno(), 4096)
    try:
        found = leftovers.find_leftovers(directory)
        assert sorted(p for p, _, _ in found) == sorted([leftover, young])
        size = {p: s for p, s, _ in found}
        assert size[leftover] == 12345
        assert [p for p, _, _ in leftovers.find_leftovers(directory, min_age=60)] == [leftover]
        assert leftovers.clean(directory, min_age=60) == [leftover]
        assert not os.path.exists(leftover) and os.path.exists(young) and os.path.exists(busy)
        assert leftovers.clean(directory) == [young]
        assert leftovers.clean(directory) == []
        assert os.path.exists(busy)
    finally:
        mm.close()
    assert leftovers.clean(directory) == [busy]
    assert leftovers.find_leftovers(str(tmp_path / "missing")) == []


@linux_only
def test_in_use_of_any_file_and_proc_stat(tmp_path):
    """The scanner bench uses for /dev/shm: any file (torch's too), held by an fd or a mapping."""
    held, mapped, idle = (tmp_path / f"{kind}_{secrets.token_hex(8)}" for kind in ("torch", "x", "y"))
    for p in (held, mapped, idle):
        p.write_bytes(b"\0" * 4096)
    fd = os.open(held, os.O_RDONLY)
    raw = MapOnly(str(mapped))
    try:
        assert leftovers.in_use([str(held), str(mapped), str(idle)]) == {str(held), str(mapped)}
    finally:
        os.close(fd)
        raw.close()
    assert leftovers.in_use([str(held), str(mapped), str(idle)]) == set()
    st = leftovers.proc_stat(os.getpid())
    assert st.alive and st.pgrp == os.getpgrp() and st.ppid == os.getppid()
    assert os.getpid() in leftovers.pids() and leftovers.proc_stat(-1) is None


def test_one_segment_name_pattern():
    """The daemon, a stdlib-only script, cannot import segment.py: its copy of the pattern must
    stay the same, or it would refuse (never unlink) the names segment.py makes."""
    assert daemon.NAME_RE.pattern == named.NAME_RE.pattern
    name = PREFIX + secrets.token_hex(10)
    assert named.NAME_RE.match(name) and not named.NAME_RE.match(name + "0")


_HOLDER = """
import sys, time
import numpy as np
import sharedmp as mp
kept = [mp.zeros(1 << 21), mp.zeros(100)]          # 16 MiB of its own, and an arena
dropped = mp.zeros(1 << 20); del dropped            # 8 MiB, now in the recycle pool
import sharedmp.memory.cache as c; c._publish()
print("ready", flush=True)
sys.stdin.read()
"""


@linux_only
def test_doctor_shows_what_each_process_holds_and_how_much_is_cache():
    env = {**os.environ, "SHAREDMP_CACHE_IDLE": "60", STRATEGY_ENV: "file_descriptor"}
    p = subprocess.Popen([sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, env=env)
    try:
        assert p.stdout.readline().strip() == "ready"
        rc, report = run_json()
        [check] = checks_named(report, "processes")
        [line] = [i for i in check["items"] if i.startswith(f"pid {p.pid}:")]
        [entry] = [e for e in doctor_mod.survey_processes() if e["pid"] == p.pid]
        assert entry["mapped"] >= (16 + 8 + 4) << 20 and entry["fds"] >= 3     # from /proc
        assert entry["cache"] >= 8 << 20 and entry["cache_fds"] >= 1           # the pool's 8 MiB
        assert entry["cache"] < entry["mapped"] - (16 << 20)                   # kept arrays: not cache
        assert "MiB mapped" in line and "cache" in line
    finally:
        p.kill()
        p.wait(TIMEOUT)
        p.stdin.close()
        p.stdout.close()


_KILLED = """
import sys
import sharedmp as mp
from sharedmp.memory import manager
kept = [mp.zeros(1 << 18) for _ in range(3)]
manager.sync()
print(manager.daemon_pid(), flush=True)
sys.stdin.read()
"""


@linux_only
def test_what_a_killed_daemon_left_is_shown_and_cleaned(tmp_path, request):
    """A daemon SIGKILLed with its program: its ledger in the shm directory names what it
    left (daemon.py, "Ledgers"); doctor shows it, --clean removes it all."""
    # (a runtime directory short enough for the daemon's socket: a longer one is passed over)
    shm = tmp_path / "shm"
    run = pathlib.Path(tempfile.mkdtemp(prefix="sharedmp-run-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(run, ignore_errors=True))
    shm.mkdir()
    env = {SHM_DIR_ENV: str(shm), STRATEGY_ENV: "file_system", "SHAREDMP_MANAGER": None,
           "TMPDIR": str(run), "XDG_RUNTIME_DIR": str(run)}
    full_env = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
    p = subprocess.Popen([sys.executable, "-c", _KILLED], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=full_env)
    try:
        os.kill(int(p.stdout.readline()), 9)
    finally:
        p.kill()
        p.wait(TIMEOUT)
        p.stdin.close()
        p.stdout.close()
    left = [n for n in os.listdir(shm) if n.startswith(PREFIX)]
    assert len(left) >= 3 and os.listdir(run)
    code, report = run_json(env=env)
    (managers,) = checks_named(report, "managers")
    assert managers["status"] == "warn" and "1 ledger(s)" in managers["detail"], managers
    assert any(".sharedmp-ledger-" in item and "segment(s) it names still there" in item
               for item in managers["items"]), managers
    listed = "\n".join(checks_named(report, "leftovers")[0]["items"])
    assert all(n in listed for n in left), (left, listed)
    code, report = run_json("--clean", env=env)
    assert code == 0
    # (the daemon doctor started for its round trip, and removes at its exit, included)
    assert eventually(lambda: not os.listdir(shm) and not os.listdir(run), TIMEOUT), \
        (os.listdir(shm), os.listdir(run))

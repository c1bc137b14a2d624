"""The platform's facts (sharedmp/host.py): found out there only, and right on this machine."""
import ast
import os
import subprocess
import sys
from pathlib import Path

from sharedmp import host
from sharedmp.memory import leftovers, segment

from conftest import eventually  # noqa: E402

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "sharedmp"


def _platform_reads(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value.startswith("/proc") and not node.value.startswith("/proc "):
            yield node.lineno, node.value
        elif isinstance(node, ast.JoinedStr) and node.values and isinstance(
                node.values[0], ast.Constant) and str(node.values[0].value).startswith("/proc"):
            yield node.lineno, ast.unparse(node)
        elif isinstance(node, ast.Attribute) and node.attr == "platform" and isinstance(
                node.value, ast.Name) and node.value.id == "sys":
            yield node.lineno, "sys.platform"
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "hasattr" and len(
                node.args) == 2 and ast.unparse(node.args[0]) == "os":
            yield node.lineno, ast.unparse(node)


def test_only_host_reads_the_platform():
    # (the command line's tools read /proc for their reports: cpuinfo, smaps, cmdline; the
    # daemon, a script run with -I -S, imports the standard library only: its sweep reads
    # /proc to see what the processes of its namespace map and hold open)
    found = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in ("host.py", "memory/daemon.py") or rel.startswith("cli/"):
            continue
        hits = list(_platform_reads(ast.parse(path.read_text())))
        if hits:
            found[rel] = hits
    assert found == {}


def test_the_rule_sees_a_proc_read():
    tree = ast.parse('open(f"/proc/{pid}/maps")\nopen("/proc/meminfo")\nsys.platform\n'
                     'hasattr(os, "memfd_create")\n')
    assert {line for line, _ in _platform_reads(tree)} == {1, 2, 3, 4}


def test_the_facts_on_this_machine():
    assert host.HAVE_MEMFD == (sys.platform.startswith("linux") and hasattr(os, "memfd_create"))
    assert segment.HAVE_MEMFD is host.HAVE_MEMFD         # (named there too)
    avail = host.available_memory()
    assert avail is None or avail > 0
    assert host.have_proc() == os.path.isdir("/proc/self/fd")
    if host.have_proc():
        assert os.getpid() in host.pids()
        st = host.proc_stat(os.getpid())
        assert st.alive and st.ppid == os.getppid()
        r, w = os.pipe()
        try:
            paths = dict(host.fd_targets("self"))
            assert paths[f"/proc/self/fd/{r}"].startswith("pipe:")
            again = host.reopen(w, os.O_WRONLY)
            os.write(again, b"x")
            os.close(again)
            assert os.read(r, 1) == b"x"
        finally:
            os.close(r)
            os.close(w)
        assert any("python" in line or "[heap]" in line for line in host.maps_lines("self"))
    assert leftovers.proc_stat is host.proc_stat
    # (pid 1: EPERM unless root, and it exists)
    assert host.pid_exists(os.getpid()) and host.pid_exists(1)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(30)
    assert not host.pid_exists(child.pid)          # reaped: gone (unless reused within the test)


# A leader and a helper in its group: the helper (as the resource tracker does) ignores
# SIGTERM; with HOLD the leader ignores it too.
GROUP = """
import os, signal, subprocess, sys, time
helper = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); "
    "time.sleep(float(__import__('sys').argv[1]))", sys.argv[1]], stdout=subprocess.PIPE)
helper.stdout.readline()
if len(sys.argv) > 2:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print(helper.pid, flush=True)
time.sleep(60)
"""


def _group(helper_s, *hold):
    proc = subprocess.Popen([sys.executable, "-c", GROUP, str(helper_s), *hold], text=True,
                            stdout=subprocess.PIPE, start_new_session=True)
    with proc.stdout:
        return proc, int(proc.stdout.readline())


def test_end_group_lets_what_outlives_sigterm_finish_then_kills_what_is_left():
    proc, helper = _group(1)                  # the helper ends by itself within the grace
    try:
        assert host.end_group(proc, 20) and proc.returncode == -15
        st = host.proc_stat(helper)           # (ended: gone, or a zombie a moment)
        assert not host.group_alive(proc.pid) and (st is None or not st.alive)
    finally:
        host.end_group(proc, 0)
    proc, helper = _group(60, "hold")         # nothing ends: SIGKILL after the grace
    try:
        assert not host.end_group(proc, 0.5)
        assert proc.returncode == -9                  # (the leader reaped; the helper dies
        assert eventually(lambda: not host.group_alive(proc.pid))   # of SIGKILL a moment on)
    finally:
        host.end_group(proc, 0)
    proc, _ = _group(60)                      # no signal: the group is waited for, then killed
    assert not host.end_group(proc, 0.3, first=None) and proc.returncode == -9

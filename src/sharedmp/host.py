"""What this machine and its OS offer, found out in one place.

Capability flags (memfd, fallocate, the parent-death signal), the memory that can still be
made resident (``/proc/meminfo`` capped by the memory cgroup), the readers of ``/proc``
(processes, their state and their fds), and ending a process group (the bench's programs, the
tests'). Everything here answers "unknown" (None, [], False)
where the OS does not say, and the callers fall back: no memfd means named segments,
no /proc means nothing is called a leftover. sharedmp is tested on Linux.
"""
from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
import time
from typing import Any, Iterator, NamedTuple

HAVE_MEMFD = sys.platform.startswith("linux") and hasattr(os, "memfd_create")
HAVE_FALLOCATE = hasattr(os, "posix_fallocate")
HAVE_PDEATHSIG = sys.platform.startswith("linux")
# Total store order (x86-64): stores are seen in the order made, loads are made in order.
# What plain Python reads and writes of shared memory may rely on (channels/ring.py's twin).
TOTAL_STORE_ORDER = platform.machine() in ("x86_64", "AMD64")


# -- memory ------------------------------------------------------------------------------

_avail_cache = (-1.0, None)      # (monotonic time, bytes): parsing /proc/meminfo is not free


def available_memory_cached(max_age=0.1):
    global _avail_cache
    now = time.monotonic()
    if now - _avail_cache[0] > max_age:
        _avail_cache = (now, available_memory())
    return _avail_cache[1]


def available_memory():
    """Bytes that can still be made resident: MemAvailable + SwapFree, capped by the cgroup."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        avail = (int(info["MemAvailable"].split()[0])
                 + int(info.get("SwapFree", "0 kB").split()[0])) * 1024
        for limit, used in _cgroup_memory_files():
            try:
                with open(limit) as f:
                    lim = f.read().strip()
                if lim != "max":
                    with open(used) as f:
                        avail = min(avail, int(lim) - int(f.read()))
            except OSError:
                pass
    except (OSError, KeyError, ValueError):
        pass
    return avail


def _cgroup_memory_files():
    """(limit, usage) files of this process's memory cgroup and of its ancestors, v2 and v1.

    Over its cgroup's limit, a process is OOM-killed at fallocate, not refused. In a
    container the path in /proc/self/cgroup may start above the mounted root: the
    longest tail of it that exists under the mount is ours.
    """
    out = []
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        hid, controllers, path = line.split(":", 2)
        if hid == "0" and controllers == "":
            mount, files = "/sys/fs/cgroup", ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            mount, files = ("/sys/fs/cgroup/memory",
                            ("memory.limit_in_bytes", "memory.usage_in_bytes"))
        else:
            continue
        parts = [x for x in path.split("/") if x]
        for i in range(len(parts) + 1):
            here = os.path.join(mount, *parts[i:])
            if os.path.exists(os.path.join(here, files[0])):
                break
        else:
            continue
        while True:
            out.append((os.path.join(here, files[0]), os.path.join(here, files[1])))
            if os.path.normpath(here) == mount:
                break
            here = os.path.dirname(here)
    return out


# -- /proc -------------------------------------------------------------------------------

def have_proc() -> bool:
    """Whether this system shows processes' fds in /proc (Linux)."""
    return os.path.isdir("/proc/self/fd")


def pids() -> list[int]:
    """The pids of the live processes (zombies included: see ``proc_stat``), [] without /proc."""
    try:
        return sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    except OSError:
        return []


def pid_exists(pid: int) -> bool:
    """Whether a process ``pid`` exists (a zombie too; one of another user too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:              # (EPERM: it exists, owned by another user)
        pass
    return True


class ProcStat(NamedTuple):
    state: str                 # R, S, D, ... Z (zombie), X (dead)
    ppid: int
    pgrp: int
    start: int                 # clock ticks after boot: tells a reused pid from its old process

    @property
    def alive(self) -> bool:
        """Not a zombie: the process still runs (and may hold fds and mappings)."""
        return self.state not in ("Z", "X")


def proc_stat(pid: int) -> ProcStat | None:
    """The state, parent, process group and start time of ``pid``, or None if it is gone or
    unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # The command name may hold spaces and parentheses: the fields follow its last ")".
            fields = f.read().rsplit(b")", 1)[1].split()
        return ProcStat(fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[19]))
    except (OSError, IndexError, ValueError):
        return None


def group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process of process group ``pgid`` remains (without /proc:
    whether the group exists, zombies included)."""
    if not have_proc():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for pid in pids():
        st = proc_stat(pid)
        if st is not None and st.pgrp == pgid and st.alive:
            return True
    return False


def end_group(proc: "subprocess.Popen[Any]", grace: float,
              first: "signal.Signals | None" = signal.SIGTERM) -> bool:
    """End the process group that ``proc`` leads (started with ``start_new_session``): send
    ``first`` (None: nothing, it ends by itself), give every process of the group ``grace`` s
    to go, then SIGKILL what is left. The leader is reaped. Whether it ended before SIGKILL.

    SIGTERM first because the standard library's resource tracker ignores it: it outlives the
    others and unlinks the semaphores they leave (SIGKILL alone leaves sem.mp-* files)."""
    deadline = time.monotonic() + grace
    if first is not None:
        _signal_group(proc.pid, first)
    while proc.poll() is None or group_alive(proc.pid):
        if time.monotonic() > deadline:
            _signal_group(proc.pid, signal.SIGKILL)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
            return False
        time.sleep(0.02)
    return True


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):    # gone (or its pid another user's now)
        pass


def owner(pid: int) -> int | None:
    """The uid that owns process ``pid``, or None if it is gone."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def fd_targets(pid: int | str) -> Iterator[tuple[str, str]]:
    """(path under /proc, target) of each fd of ``pid`` (or "self"); OSError if its fds
    cannot be listed."""
    base = f"/proc/{pid}/fd"
    for fd in os.listdir(base):
        try:
            yield f"{base}/{fd}", os.readlink(f"{base}/{fd}")
        except OSError:
            continue                                  # closed meanwhile


def fd_target(fd: int) -> str:
    """What this process's ``fd`` is open on, as /proc shows it ("anon_inode:[eventfd]", a
    path, ...); "?" where it cannot be read."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


def reopen(fd: int, flags: int) -> int:
    """A new open file description of what ``fd`` is open on (OSError without /proc)."""
    return os.open(f"/proc/self/fd/{fd}", flags)


def maps_lines(pid: int | str) -> list[str]:
    """The lines of /proc/``pid``/maps: what the process maps (OSError if unreadable)."""
    with open(f"/proc/{pid}/maps") as f:
        return f.readlines()

"""What processes hold in shared memory, read from /proc; and the segment files nobody holds.

The one reader of other processes' /proc entries for sharedmp's tools (doctor, bench,
stress): the live pids and their ``stat``, the segments a process maps or holds open,
and which files of a shared-memory directory are in use.

A file is *in use* while some process maps it (``/proc/*/maps``) or holds an fd to it
(``/proc/*/fd``). A ``sharedmp_*`` file of this user that nobody uses is a *leftover* of
processes that are all gone (killed before they could unlink it): ``find_leftovers`` lists
them, ``clean`` removes them (``python -m sharedmp doctor --clean``). So are those in the
pool directories (``.sharedmp-pool-<daemon pid>``, ``recycle.py``) of the directory, where
the manager daemon keeps the segments its clients made for reuse; a pool directory left
empty by a daemon that is gone is removed with its last leftover.

A segment that a live daemon's ledger names (``daemon.py``, "Ledgers") is in use too,
whether or not a process this one can see maps it (a program in another PID namespace, a
container sharing /dev/shm). A dead daemon's ledger (``dead_ledgers``) is swept by the next
daemon that starts there, or by ``sweep`` (``doctor --clean``).

Without /proc nothing can be called a leftover: nothing is ever removed then.
"""
from __future__ import annotations

import os
import re
import stat
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

# (host.py reads /proc; its readers are named here too, for the tools)
from ..host import (ProcStat, fd_targets, have_proc, maps_lines, owner,  # noqa: F401
                    pid_exists, pids, proc_stat)
from . import daemon
from .named import NAME_RE, PREFIX

POOL_RE = re.compile(r"\.sharedmp-pool-(\d+)\Z")   # manager.POOL_DIR's names

# What /proc shows for a memfd segment (segment.py names its memfds "sharedmp").
MEMFD_TARGET = "/memfd:sharedmp (deleted)"
_DELETED = " (deleted)"

K = TypeVar("K")
Leftover = tuple[str, int, float]          # (path, size, mtime)


def _is_segment(target: str) -> bool:
    return target == MEMFD_TARGET or PREFIX in target


def segments_of(pid: int) -> tuple[int, int] | None:
    """(bytes mapped, fds) of sharedmp segments in process ``pid``; None if unreadable."""
    mapped = {}
    try:
        for line in maps_lines(pid):
            if MEMFD_TARGET not in line and PREFIX not in line:
                continue
            parts = line.split(None, 5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            mapped[(parts[3], parts[4], lo)] = hi - lo
        fds = sum(_is_segment(t) for _, t in fd_targets(pid))
    except (OSError, ValueError, IndexError):
        return None
    return sum(mapped.values()), fds


# ---------------------------------------------------------------------------- in use

def _name(path: str) -> str:
    return path.removesuffix(_DELETED).rsplit("/", 1)[-1]


class _Files(Generic[K]):
    """The files looked for, each known by a key: by name and by (device, inode)."""

    def __init__(self, by_name: Mapping[str, list[K]], by_inode: Mapping[tuple[int, int], K]):
        self.by_name, self.by_inode = by_name, by_inode
        self.keys = {k for ks in by_name.values() for k in ks} | set(by_inode.values())
        # A maps line shows the device as "major:minor" in hex: a cheap filter of lines.
        self.devs = tuple({f" {os.major(d):02x}:{os.minor(d):02x} " for d, _ in by_inode})

    def in_maps_line(self, line: str) -> list[K]:
        if PREFIX not in line and not any(d in line for d in self.devs):
            return []
        parts = line.split(None, 5)
        if len(parts) < 5:
            return []
        found = self.by_name.get(_name(parts[5].rstrip("\n")) if len(parts) == 6 else "")
        if found:
            return found
        try:
            major, minor = (int(x, 16) for x in parts[3].split(":"))
            key = self.by_inode.get((os.makedev(major, minor), int(parts[4])))
        except ValueError:
            return []
        return [] if key is None else [key]

    def add_used_by(self, pid: int, used: set[K]) -> None:
        """Add to ``used`` the keys of the files ``pid`` maps or holds open (OSError once it
        cannot be read further: what was found until then stays in ``used``)."""
        for line in maps_lines(pid):
            used.update(self.in_maps_line(line))
        for _, target in fd_targets(pid):
            used.update(self.by_name.get(_name(target), ()))


def _users(files: _Files[K]) -> tuple[set[K], list[int]] | tuple[None, list[int]]:
    """(keys in use, pids that could not be inspected), or (None, []) without /proc.

    A file is in use when a mapping or an fd of some process points to a file of its name
    (any directory: mount namespaces see the same file under other paths), or a mapping
    has its device and inode. Matching by name errs on the side of keeping.
    """
    if not have_proc():
        return None, []
    used: set[K] = set()
    blind: list[int] = []
    uid = os.getuid()
    for pid in pids():
        if used >= files.keys:
            break
        try:
            files.add_used_by(pid, used)
        except (FileNotFoundError, ProcessLookupError):
            continue                                  # it exited meanwhile: it holds nothing
        except PermissionError:
            if uid == 0 or owner(pid) == uid:         # one of ours we cannot see into
                blind.append(pid)
        except OSError:
            continue
    return used, blind


def _stat(path: str) -> os.stat_result | None:
    try:
        return os.stat(path)
    except OSError:
        return None


def in_use(paths: Iterable[str]) -> set[str]:
    """The ``paths`` (any files, e.g. in /dev/shm) that some live process maps or holds open,
    and the pool directories of live daemons; all of them without /proc, where it cannot be
    told."""
    paths = set(paths)
    pools = {p for p in paths if (m := POOL_RE.match(os.path.basename(p)))
             and pid_exists(int(m.group(1)))}
    by_name: dict[str, list[str]] = {}
    by_inode = {}
    for p in paths:
        by_name.setdefault(os.path.basename(p), []).append(p)
        st = _stat(p)
        if st is not None:
            by_inode[(st.st_dev, st.st_ino)] = p
    used, _ = _users(_Files(by_name, by_inode))
    return paths if used is None else used | pools


# ---------------------------------------------------------------------------- leftovers

def candidates(directory: str) -> dict[str, tuple[str, os.stat_result]]:
    """{name: (path, stat)} of the segment files in ``directory`` this user may remove."""
    out: dict[str, tuple[str, os.stat_result]] = {}
    uid = os.getuid()
    for d in [directory, *pool_dirs(directory)]:
        try:
            entries = os.scandir(d)
        except OSError:
            continue
        with entries:
            for entry in entries:
                if not NAME_RE.match(entry.name):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode) and (uid == 0 or st.st_uid == uid):
                    out[entry.name] = (entry.path, st)
    return out


def pool_dirs(directory: str) -> list[str]:
    """The pool directories of this user in ``directory`` (see the module docstring)."""
    out: list[str] = []
    uid = os.getuid()
    try:
        names = os.listdir(directory)
    except OSError:
        return out
    for name in names:
        if POOL_RE.match(name):
            path = os.path.join(directory, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode) and (uid == 0 or st.st_uid == uid):
                out.append(path)
    return sorted(out)


def scan_proc(found: Mapping[str, tuple[str, os.stat_result]]
              ) -> tuple[set[str], list[int]] | tuple[None, list[int]]:
    """(names in use, pids that could not be inspected) of ``candidates``' result, or
    (None, []) without /proc."""
    by_inode = {(st.st_dev, st.st_ino): name for name, (_, st) in found.items()}
    return _users(_Files({name: [name] for name in found}, by_inode))


@dataclass
class Survey:
    directory: str
    leftovers: list[Leftover]
    in_use: list[str]          # paths
    blind: list[int]           # pids that might use this user's segments but cannot be inspected
    inspectable: bool          # False without /proc: nothing can be called a leftover


def survey(directory: str, min_age: float = 0.0, strict: bool = False) -> Survey:
    """Which segment files in ``directory`` are in use and which are leftovers.

    ``blind`` lists processes that could hold this user's segments but whose maps or fds
    cannot be read (non-dumpable processes of this user; for root, processes with more
    capabilities, such as a sandbox's init). With ``strict``, their existence means that
    nothing is a leftover; otherwise they are reported and otherwise ignored.
    """
    found = candidates(directory)
    if not found:
        return Survey(directory, [], [], [], have_proc())
    used, blind = scan_proc(found)
    if used is None:
        return Survey(directory, [], sorted(p for p, _ in found.values()), [], False)
    used |= {n for _, alive, _, _, names in daemon.ledgers(directory) if alive for n in names}
    now = time.time()
    leftovers, busy = [], []
    for name, (path, st) in sorted(found.items()):
        if name in used or (strict and blind) or now - st.st_mtime < min_age:
            busy.append(path)
        else:
            leftovers.append((path, st.st_size, st.st_mtime))
    return Survey(directory, leftovers, busy, blind, True)


def find_leftovers(directory: str, min_age: float = 0.0, strict: bool = False) -> list[Leftover]:
    """[(path, size, mtime)] of this user's ``sharedmp_*`` files in ``directory`` that no
    live process maps or holds open, and that are at least ``min_age`` seconds old.

    Without /proc nothing is a leftover; with ``strict``, nothing is either while some
    process that might use the segments cannot be inspected (see ``survey``).
    """
    return survey(directory, min_age, strict).leftovers


def remove(entries: Iterable[Leftover]) -> list[Leftover]:
    """Unlink the given leftovers; the (path, size, mtime) of those this call removed (one
    that is gone already, cleaned by someone else meanwhile, is not)."""
    removed = []
    for entry in entries:
        try:
            os.unlink(entry[0])
        except OSError:
            continue
        removed.append(entry)
        parent = os.path.dirname(entry[0])
        m = POOL_RE.match(os.path.basename(parent))
        if m and not pid_exists(int(m.group(1))):
            try:
                os.rmdir(parent)              # (once empty: the daemon is gone)
            except OSError:
                pass
    return removed


def clean(directory: str, min_age: float = 0.0, strict: bool = False) -> list[str]:
    """Remove the leftovers of ``directory`` (see ``find_leftovers``); the paths removed."""
    return [path for path, _, _ in remove(find_leftovers(directory, min_age, strict))]


# ---------------------------------------------------------------------------- ledgers

def dead_ledgers(directory: str) -> list[tuple[str, int]]:
    """[(path, how many of the segments it names are still there)] of the ledgers that this
    user's daemons that are gone (killed) left in ``directory`` (``daemon.py``, "Ledgers")."""
    return [(path, len(names)) for path, alive, _, _, names in daemon.ledgers(directory)
            if not alive]


def sweep(directory: str) -> list[str]:
    """Remove what dead daemons left in ``directory`` (see ``daemon.sweep``): the paths of
    the dead ledgers kept, some of whose segments are still in use."""
    return daemon.sweep(directory)

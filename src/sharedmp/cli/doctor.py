"""``python -m sharedmp doctor [--clean] [--json]``: what this machine supports, where it would
fail.

One line per check, each ``ok``, ``warn`` or ``FAIL``, with the fix where something is
wrong. The exit status is 1 when some check FAILs (something sharedmp needs, with the
current settings, does not work), 0 otherwise: warnings do not fail.

Torch is never imported: its version comes from the installed distribution's metadata.

Which segments are leftovers, and what each process holds, is read from /proc by
``memory/leftovers.py`` (``find_leftovers``, ``clean``: reusable outside the command).
"""
import json
import mmap
import os
import platform
import re
import secrets
import sys
import time
from dataclasses import asdict, dataclass, field

from .. import __version__
from . import dist_version
from ..errors import OutOfSharedMemory
from ..memory import leftovers, named, segment
from ..memory.named import SHM_DIR_ENV
from .. import strategy as _strategy
from ..strategy import ENV as STRATEGY_ENV

OK, WARN, FAIL = "ok", "warn", "FAIL"
GiB = 1 << 30
FD_WARN = 1024           # soft RLIMIT_NOFILE below this: warn
FD_FAIL = 64             # below this: a handful of arrays in flight exhausts it
FREE_WARN = 1 * GiB      # free space in the shm dir / available memory below this: warn
TMPFS_TYPES = ("tmpfs", "ramfs")


@dataclass
class Check:
    name: str
    status: str                                  # OK | WARN | FAIL
    detail: str
    fix: str | None = None
    items: list = field(default_factory=list)   # extra lines (e.g. the leftovers)


# ---------------------------------------------------------------------------- leftovers

def _fmt_size(n):
    return segment.format_size(n)


def _fmt_age(seconds):
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


# ---------------------------------------------------------------------------- checks

def _version_tuple(v):
    out = []
    for part in re.split(r"[.+-]", v):
        if not part.isdigit():
            break
        out.append(int(part))
    return tuple(out)


def check_versions():
    import numpy as np
    checks = []
    checks.append(Check("platform", OK, f"{platform.platform()} ({platform.machine()})"))
    py = sys.version_info
    checks.append(Check("python", OK if py >= (3, 11) else FAIL,
                        f"{platform.python_version()} ({platform.python_implementation()}, "
                        f"{sys.executable})",
                        None if py >= (3, 11) else "sharedmp needs Python >= 3.11"))
    np_ok = _version_tuple(np.__version__) >= (1, 24)
    checks.append(Check("numpy", OK if np_ok else WARN, np.__version__,
                        None if np_ok else
                        "sharedmp is tested with numpy >= 1.24: pip install -U numpy"))
    where = os.path.dirname(os.path.dirname(__file__))
    checks.append(Check("sharedmp", OK, f"{__version__} ({where})"))
    checks.append(check_native())
    torch = dist_version("torch")
    if torch is None:
        checks.append(Check("torch", OK,
                            "not installed (optional: pip install 'sharedmp[torch]')"))
    elif _version_tuple(torch) < (2, 3):
        checks.append(Check("torch", WARN, f"{torch}: sharedmp's torch support needs torch >= 2.3",
                            "pip install -U 'torch>=2.3'"))
    else:
        checks.append(Check("torch", OK, f"{torch} (installed; not imported by sharedmp until "
                            "a tensor is met)"))
    cuda = dist_version("cuda-bindings") or dist_version("cuda-python")
    checks.append(Check("cuda-bindings", OK,
                        cuda or "not installed (optional: pip install 'sharedmp[cuda]')"))
    return checks


def check_native():
    """Which path the message path runs: the compiled core or its pure-Python twins."""
    from .. import native
    paths = native.status()
    compiled = all(v == "compiled" for v in paths.values())
    detail = ", ".join(f"{k}: {v}" for k, v in paths.items())
    from .. import settings
    from ..channels import board
    detail += (f"; queues: small messages through rings ({board.SLOTS} producers' rings of "
               f"{board.CAPACITY >> 10} KiB a queue)" if settings.get(settings.QUEUE_RINGS)
               else f"; queues: every message through the socket (${settings.QUEUE_RINGS}=0)")
    if compiled or native.disabled():
        return Check("compiled core", OK, detail)
    return Check("compiled core", WARN, detail,
                 "reinstall where a C compiler and Python's headers exist (pip install "
                 f"--force-reinstall sharedmp), or set {native.ENV}=1 to run the twins quietly")


def check_start_methods():
    import multiprocessing
    methods = multiprocessing.get_all_start_methods()
    default = multiprocessing.get_context().get_start_method()
    return Check("start methods", OK, f"{', '.join(methods)} (default: {default})")


def check_strategy():
    """(checks, current strategy or None if the setting is invalid, all strategies)."""
    from ..strategy import _DEFAULT, get_all_sharing_strategies, get_sharing_strategy
    strategies = get_all_sharing_strategies()
    names = sorted(strategies)
    checks = [Check("strategies", OK, ", ".join(names) + f" (default: {_DEFAULT})")]
    try:
        current = get_sharing_strategy()
    except ValueError as e:
        checks.append(Check("strategy", FAIL, str(e),
                            f"unset ${STRATEGY_ENV} or set it to one of: {', '.join(names)}"))
        return checks, None, strategies
    source = f"from ${STRATEGY_ENV}" if os.environ.get(STRATEGY_ENV) else "default"
    checks.append(Check("strategy", OK, f"{current} ({source})"))
    return checks, current, strategies


def check_fd_limit():
    try:
        import resource
    except ImportError:
        return Check("fd limit", OK, "no RLIMIT_NOFILE on this platform")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    show = lambda n: "unlimited" if n == resource.RLIM_INFINITY else str(n)  # noqa: E731
    detail = f"soft {show(soft)}, hard {show(hard)}"
    soft_n = float("inf") if soft == resource.RLIM_INFINITY else soft
    if soft_n >= FD_WARN:
        return Check("fd limit", OK, detail)
    target = FD_WARN * 4 if hard == resource.RLIM_INFINITY else min(hard, FD_WARN * 4)
    if target > soft_n:
        fix = (f"raise it before starting Python: `ulimit -n {target}` (the hard limit allows "
               f"{show(hard)}), or resource.setrlimit(resource.RLIMIT_NOFILE, ({target}, hard)) "
               "at startup")
    else:
        fix = (f"the hard limit is {show(hard)} too: raise it (as root: /etc/security/limits.conf "
               f"'nofile', systemd LimitNOFILE=, docker --ulimit nofile={FD_WARN * 4}), "
               f"then `ulimit -n {FD_WARN * 4}`")
    if soft_n < FD_FAIL:
        return Check("fd limit", FAIL,
                     detail + f": below {FD_FAIL}, a few arrays in flight exhaust it", fix)
    return Check("fd limit", WARN,
                 detail + f": below {FD_WARN}, many segments in flight may exhaust it "
                 "(each segment sent under file_descriptor costs an fd until it is received)", fix)


def check_memory():
    avail = segment.available_memory()
    if avail is None:
        return Check("memory", OK, "available memory unknown on this platform")
    detail = (f"{_fmt_size(avail)} can be reserved "
              "(MemAvailable + SwapFree, within the cgroup limit)")
    if avail < FREE_WARN:
        return Check("memory", WARN, detail, "free memory or raise the container's memory limit: "
                     "shared arrays are reserved in RAM when they are made")
    return Check("memory", OK, detail)


def _check_sealed(fd, lease):
    """That the kernel enforces on the segment of ``fd`` what sharedmp relies on; OSError
    says what it does not."""
    import fcntl

    import numpy as np
    if not segment.sealed(fd, segment.SEALS):
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        raise OSError(f"seals read back as {seals:#x}, expected {segment.SEALS:#x} set")
    try:
        os.ftruncate(fd, 0)
    except PermissionError:
        pass                                      # the seal holds
    else:
        raise OSError("F_SEAL_SHRINK is not enforced: a sealed memfd could be truncated")
    lease[:4] = np.frombuffer(b"sdmp", np.uint8)
    if os.pread(fd, 4, 0) != b"sdmp":
        raise OSError("a write through the mapping is not visible through the fd")


def check_memfd(current):
    needed = current == "file_descriptor"
    bad = FAIL if needed else WARN
    fix = (f"the file_descriptor strategy needs Linux memfd_create with sealing (kernel >= 3.17, "
           f"not blocked by seccomp); use ${STRATEGY_ENV}=file_system")
    if not segment.HAVE_MEMFD:
        return Check("memfd", FAIL if needed else OK,
                     "memfd_create is not available on this platform: file_system only",
                     fix if needed else None)
    import fcntl
    try:                          # made as the file_descriptor strategy makes every segment
        seg, lease = segment.create(mmap.PAGESIZE)
    except (OSError, OutOfSharedMemory) as e:
        return Check("memfd", bad, f"a sealed memfd segment cannot be made: {e}", fix)
    try:
        _check_sealed(seg.fd, lease)          # the fd a message would carry
    except OSError as e:
        return Check("memfd", bad, f"memfd works but sealing does not: {e}", fix)
    names = [n for n in ("F_SEAL_SHRINK", "F_SEAL_GROW", "F_SEAL_SEAL")
             if segment.SEALS & getattr(fcntl, n)]
    return Check("memfd", OK, f"memfd_create, fallocate and seals ({', '.join(names)}) work")


def _mount_of(path):
    """(mount point, fs type) of ``path`` from /proc/mounts, or None."""
    try:
        with open("/proc/mounts") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    path = os.path.realpath(path)
    best = None
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[1])
        if path == point or path.startswith(point.rstrip("/") + "/"):
            if best is None or len(point) >= len(best[0]):   # later lines over-mount earlier ones
                best = (point, parts[2])
    return best


def check_shm_dir(current, strategies):
    """(checks, usable): the directory of named segments (the file_system strategy)."""
    d = named.shm_dir()
    source = f"${SHM_DIR_ENV}" if os.environ.get(SHM_DIR_ENV) else "default"
    fatal = current == "file_system" or strategies == {"file_system"}
    bad = FAIL if fatal else WARN
    note = "" if fatal else f" (only the file_system strategy needs it; current: {current})"
    label = f"{d} ({source})"
    alt = "" if strategies == {"file_system"} else ", or use the file_descriptor strategy"
    if not os.path.exists(d):
        fix = (f"create it (mkdir -p {d}; better a tmpfs: mount -t tmpfs tmpfs {d}), "
               f"point ${SHM_DIR_ENV} at an existing tmpfs directory{alt}")
        return [Check("shm dir", bad, f"{label} does not exist{note}", fix)], False
    if not os.path.isdir(d):
        return [Check("shm dir", bad, f"{label} is not a directory{note}",
                      f"point ${SHM_DIR_ENV} at a tmpfs directory{alt}")], False
    probe = os.path.join(d, f".sharedmp-doctor-{secrets.token_hex(8)}")
    try:
        flags = os.O_CREAT | os.O_EXCL | os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(probe, flags, 0o600)
        try:
            if segment.HAVE_FALLOCATE:
                os.posix_fallocate(fd, 0, mmap.PAGESIZE)
            else:
                os.ftruncate(fd, mmap.PAGESIZE)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        return [Check("shm dir", bad, f"{label} is not writable: {e.strerror}{note}",
                      f"make it writable for this user (chmod 1777 {d} as root), "
                      f"point ${SHM_DIR_ENV} at a writable tmpfs directory{alt}")], False
    checks = []
    mount = _mount_of(d)
    if mount is None:
        checks.append(Check("shm dir", OK, f"{label} exists and is writable"))
    elif mount[1] in TMPFS_TYPES:
        checks.append(Check("shm dir", OK,
                            f"{label} exists, is writable, {mount[1]} at {mount[0]}"))
    else:
        checks.append(Check("shm dir", WARN,
                            f"{label} is on {mount[1]} at {mount[0]}, not a tmpfs: named "
                            "segments are written back to disk (slower) and survive a reboot",
                            f"point ${SHM_DIR_ENV} at a tmpfs directory such as /dev/shm"))
    st = os.statvfs(d)
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    detail = f"{_fmt_size(free)} free of {_fmt_size(size)}"
    if free < FREE_WARN:
        fix = (f"enlarge it (sudo mount -o remount,size=8G {mount[0] if mount else d}; Docker: "
               f"--shm-size=8g; Kubernetes: an emptyDir with medium: Memory)"
               + (f"{alt}, which does not use {d}" if alt else ""))
        checks.append(Check("shm space", WARN,
                            detail + f": below {_fmt_size(FREE_WARN)}; more than that in shared "
                            f"arrays under file_system raises OutOfSharedMemory{note}", fix))
    else:
        checks.append(Check("shm space", OK, detail))
    return checks, True


def check_leftovers(directory, do_clean):
    """(checks, removed entries)."""
    s = leftovers.survey(directory)
    removed = leftovers.remove(s.leftovers) if do_clean else []
    checks = []
    now = time.time()
    def line(p, size, mtime):
        return f"{p}  {_fmt_size(size)}  {_fmt_age(now - mtime)} old"
    if do_clean:
        freed = _fmt_size(sum(e[1] for e in removed))
        detail = (f"removed {len(removed)} leftover segment(s), {freed}"
                  if removed else "nothing to remove")
        checks.append(Check("clean", OK, detail, items=[f"removed {line(*e)}" for e in removed]))
    left = [] if do_clean else s.leftovers
    if do_clean:  # what could not be removed (a race, or permissions) is still a leftover
        gone = {e[0] for e in removed}
        left = [e for e in s.leftovers if e[0] not in gone]
    notes = []
    if s.in_use:
        notes.append(f"{len(s.in_use)} in use by live processes")
    if s.blind:
        pids = ", ".join(map(str, s.blind[:5])) + (" ..." if len(s.blind) > 5 else "")
        notes.append(f"{len(s.blind)} process(es) not inspectable (pid {pids})")
    extra = f"; {'; '.join(notes)}" if notes else ""
    if not s.inspectable:
        checks.append(Check("leftovers", WARN if s.in_use else OK,
                            f"{len(s.in_use)} segment(s) in {directory}; without /proc it cannot "
                            "be told which are still in use"))
    elif left:
        total = sum(e[1] for e in left)
        checks.append(Check("leftovers", WARN,
                            f"{len(left)} leftover segment(s) in {directory}, {_fmt_size(total)}, "
                            f"that no live process maps or holds open{extra}",
                            "python -m sharedmp doctor --clean", items=[line(*e) for e in left]))
    else:
        checks.append(Check("leftovers", OK, f"none in {directory}{extra}"))
    return checks, removed


def check_managers(do_clean, directory=None):
    """file_system manager daemons of this user: live ones, and what killed ones left: their
    sockets in the runtime directory, their ledgers in the shm ``directory``."""
    from ..memory import manager
    daemons = manager.find_daemons()
    stale = [p for p, alive in daemons if not alive]
    live = len(daemons) - len(stale)
    dead = leftovers.dead_ledgers(directory) if directory else []
    if (stale or dead) and do_clean:
        for p in stale:
            manager.remove_stale(p)
        kept = set(leftovers.sweep(directory)) if dead else set()
        return Check("managers", OK,
                     f"{live} live; removed {len(stale)} stale socket(s) and "
                     f"{len(dead) - len(kept)} ledger(s) of killed daemons",
                     items=[f"removed {os.path.dirname(p)}" for p in stale]
                     + [f"removed {p}" for p, _ in dead if p not in kept]
                     + [f"kept {p}: {n} segment(s) it names still in use"
                        for p, n in dead if p in kept])
    if stale or dead:
        return Check("managers", WARN,
                     f"{live} live; {len(stale)} stale socket(s) and {len(dead)} ledger(s) "
                     "of killed daemons",
                     "python -m sharedmp doctor --clean",
                     items=[os.path.dirname(p) for p in stale]
                     + [f"{p}: {n} segment(s) it names still there" for p, n in dead])
    return Check("managers", OK, f"{live} live file_system manager daemon(s) of this user")


def _command_line(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def survey_processes():
    """[{pid, command, mapped, fds, cache, cache_fds, processes}] of this user's live processes
    that hold sharedmp memory or keep a pool (this one excepted): mapped bytes and fds from
    /proc, the part of them that is cache, and the processes kept warm ({name: {pids,
    idle_s}}: the joblib backend's pool), from what each process publishes
    (``memory/cache.py``)."""
    from ..memory import cache
    out = []
    uid, me = os.getuid(), os.getpid()
    for pid in leftovers.pids():
        if pid == me or leftovers.owner(pid) != uid:
            continue
        held = leftovers.segments_of(pid)
        stats = cache.read_stats(pid)
        if held is None or (held == (0, 0) and stats is None):
            continue
        parts = (stats or {}).get("cache", {}).values()
        out.append({"pid": pid, "command": _command_line(pid)[:80], "mapped": held[0],
                    "fds": held[1], "cache": sum(p[0] for p in parts),
                    "cache_fds": sum(p[1] for p in parts), "idle_s": (stats or {}).get("idle_s"),
                    "processes": (stats or {}).get("processes") or {},
                    "datasets": (stats or {}).get("datasets") or []})
    return out


def _kept_processes(p):
    """``; joblib-pool: 2 workers (pids ...), ...`` for each pool a process keeps warm."""
    return "".join(f"; {name}: {len(d['pids'])} workers (pids "
                   f"{', '.join(map(str, d['pids']))}), released after {d['idle_s']:g} s idle"
                   for name, d in p["processes"].items())


def _shared_datasets(p):
    """``; shared datasets: SharedList of 1000 records (1.2 MiB), ...`` of what a process
    holds (``datasets.live()``, as the process publishes it)."""
    if not p.get("datasets"):
        return ""
    return "; shared datasets: " + ", ".join(
        f"{d['kind']} of {d['records']} records ({_fmt_size(d['bytes'])}{_objects(d)})"
        for d in p["datasets"])


def _objects(d):
    """What a dataset's records share: stored once, held unpickled by a process once read."""
    if not d.get("objects"):
        return ""
    return (f"; {d['objects']} objects its records share, "
            f"{'held' if d.get('objects_read') else 'not read'} here")


def check_processes():
    """What each live process of this user holds in sharedmp memory, and how much is cache."""
    procs = survey_processes()
    if not procs:
        return Check("processes", OK, "no other process of this user holds sharedmp memory")
    total = sum(p["mapped"] for p in procs)
    cached = sum(p["cache"] for p in procs)
    items = [f"pid {p['pid']}: {_fmt_size(p['mapped'])} mapped, {p['fds']} fds; cache "
             f"{_fmt_size(p['cache'])}, {p['cache_fds']} fds{_kept_processes(p)}"
             f"{_shared_datasets(p)}  "
             f"({p['command']})" for p in procs]
    pools = sum(bool(p["processes"]) for p in procs)
    kept = f"; {pools} keep a pool of workers warm" if pools else ""
    return Check("processes", OK,
                 f"{len(procs)} process(es) hold {_fmt_size(total)} of sharedmp memory, "
                 f"{_fmt_size(cached)} of it cache (given back after "
                 f"{procs[0]['idle_s'] or 1:g} s idle, at the process's next sharedmp "
                 f"operation or wait, or at once by mp.empty_cache() in that process; as "
                 f"each process last published it){kept}", items=items)


def check_round_trip(strategy, fatal):
    """Allocate, write, pickle with ForkingPickler, unpickle here, compare: one strategy."""
    import pickle
    from multiprocessing.reduction import ForkingPickler

    import numpy as np

    from .. import arrays
    name = "round trip"
    saved = os.environ.get(STRATEGY_ENV)
    os.environ[STRATEGY_ENV] = strategy
    _strategy.reload_from_environment()
    try:
        t0 = time.perf_counter()
        a = arrays.zeros(1024)
        if a.any():
            raise AssertionError("fresh shared memory is not zero")
        a[:] = np.arange(1024)
        message = bytes(ForkingPickler.dumps(a))
        b = pickle.loads(message)
        if not (b.shape == a.shape and b.dtype == a.dtype and np.array_equal(a, b)):
            raise AssertionError("the unpickled array differs from the original")
        b[0] = -1.0
        if a[0] != -1.0:
            raise AssertionError("the unpickled array does not share the original's memory")
        ms = (time.perf_counter() - t0) * 1e3
        del a, b
    except Exception as e:
        fix = (f"use the other strategy (${STRATEGY_ENV}) and report this at sharedmp's issue "
               "tracker"
               if not fatal or strategy == "file_descriptor" else
               f"see the shm dir check above, or use ${STRATEGY_ENV}=file_descriptor")
        return Check(name, FAIL if fatal else WARN, f"{strategy}: {type(e).__name__}: {e}", fix)
    finally:
        if saved is None:
            os.environ.pop(STRATEGY_ENV, None)
        else:
            os.environ[STRATEGY_ENV] = saved
        _strategy.reload_from_environment()
    return Check(name, OK, f"{strategy}: zeros(1024) -> write -> ForkingPickler -> loads: equal, "
                 f"same memory ({len(message)}-byte message, {ms:.1f} ms)")


def run_checks(do_clean=False):
    """Every check, in report order; and what --clean removed."""
    checks = check_versions()
    checks.append(check_start_methods())
    strategy_checks, current, strategies = check_strategy()
    checks += strategy_checks
    checks.append(check_fd_limit())
    checks.append(check_memory())
    checks.append(check_memfd(current))
    shm_checks, shm_ok = check_shm_dir(current, strategies)
    checks += shm_checks
    directory = named.shm_dir()
    if os.path.isdir(directory):
        leftover_checks, removed = check_leftovers(directory, do_clean)
        checks += leftover_checks
    else:
        removed = []
    if "file_system" in strategies:
        checks.append(check_managers(do_clean, directory if os.path.isdir(directory) else None))
    if os.path.isdir("/proc/self/fd"):
        checks.append(check_processes())
    for s in sorted(strategies):
        fatal = s == current or len(strategies) == 1
        if s == "file_system" and not shm_ok:
            if fatal:
                checks.append(Check("round trip", FAIL, f"{s}: skipped, the shm dir is not usable",
                                    "see the shm dir check"))
            continue
        checks.append(check_round_trip(s, fatal))
    return checks, removed


def exit_status(checks):
    return 1 if any(c.status == FAIL for c in checks) else 0


def format_report(checks):
    width = max(len(c.name) for c in checks)
    out = ["sharedmp doctor"]
    for c in checks:
        out.append(f"  {c.status:<4}  {c.name:<{width}}  {c.detail}")
        pad = " " * (10 + width)
        out += [f"{pad}{item}" for item in c.items]
        if c.fix and c.status != OK:
            out.append(f"{pad}fix: {c.fix}")
    counts = {s: sum(c.status == s for c in checks) for s in (OK, WARN, FAIL)}
    status = exit_status(checks)
    verdict = "problems found" if status else \
        "no problems" + (" (see warnings)" if counts[WARN] else "")
    out.append(f"{counts[OK]} ok, {counts[WARN]} warn, {counts[FAIL]} FAIL: {verdict} "
               f"(exit {status})")
    return "\n".join(out)


def format_json(checks, removed):
    return json.dumps({
        "sharedmp": __version__,
        "exit_status": exit_status(checks),
        "checks": [asdict(c) for c in checks],
        "removed": [{"path": p, "size": size, "mtime": mtime} for p, size, mtime in removed],
    }, indent=2)


# ---------------------------------------------------------------------------- command line

def add_parser(subparsers):
    from . import COMMANDS
    p = subparsers.add_parser("doctor", help=COMMANDS["doctor"], description=COMMANDS["doctor"])
    p.add_argument("--clean", action="store_true",
                   help="remove leftover sharedmp_* segments "
                   "(those no live process maps or holds open)")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    return p


def run(args):
    checks, removed = run_checks(do_clean=args.clean)
    print(format_json(checks, removed) if args.json else format_report(checks), flush=True)
    return exit_status(checks)

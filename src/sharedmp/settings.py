"""Every environment variable sharedmp reads, read here, with one policy.

Unset or empty, a variable means its default. Any other value is parsed by its kind; a
value that does not parse, or is out of range, raises ``ValueError`` naming the variable
and what it accepts, in the caller that needed the setting (never in a background
thread, never ignored).

``get(name)`` reads the environment each time it is called: the modules that read a
setting on a hot path keep what it returned (and say so); tests and programs that change
the environment later call those modules' own reset functions. ``export(name, value)``
sets a variable for the children started from now on (the strategy, the daemon's
address). ``VARIABLES`` is the table ``docs/reference.md`` lists (a test checks both
agree).

The command line (``cli/``) and the Hogwild trainer (``hogwild/``) read variables of
their own (a terminal's width, a rank); this module is only for sharedmp's library.
"""
from __future__ import annotations

import os
from typing import Any, Callable, NamedTuple

SHARING_STRATEGY = "SHAREDMP_SHARING_STRATEGY"
SHM_DIR = "SHAREDMP_SHM_DIR"
CACHE_IDLE = "SHAREDMP_CACHE_IDLE"
JOBLIB_IDLE = "SHAREDMP_JOBLIB_IDLE"
RECYCLE_BYTES = "SHAREDMP_RECYCLE_BYTES"
WINDOW_BYTES = "SHAREDMP_WINDOW_BYTES"
SPIN_US = "SHAREDMP_SPIN_US"
QUEUE_RINGS = "SHAREDMP_QUEUE_RINGS"
KEEP_ORPHANS = "SHAREDMP_KEEP_ORPHANS"
CUDA_EXIT_TIMEOUT = "SHAREDMP_CUDA_EXIT_TIMEOUT"
CUDA_EXIT_UNCLAIMED = "SHAREDMP_CUDA_EXIT_UNCLAIMED"
MANAGER = "SHAREDMP_MANAGER"
FREEZE_FORKED = "SHAREDMP_FREEZE_FORKED"
NO_EXTENSIONS = "SHAREDMP_NO_EXTENSIONS"
# torch.multiprocessing's own, honoured as torch does
PARALLEL_START = "TORCH_MP_PARALLEL_START"


class Variable(NamedTuple):
    name: str
    default: Any            # what an unset or empty variable means
    parse: Callable[[str], Any]   # raw -> value; ValueError(what it accepts) if bad
    accepts: str            # for the error message and the docs


def _number(low: float, high: float = float("inf"), integer: bool = False):
    def parse(raw: str) -> float | int:
        value = int(raw) if integer else float(raw)     # ValueError if not a number
        if not low <= value <= high:
            raise ValueError(raw)
        return value
    return parse


def _flag(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


def _choice(*choices: str):
    def parse(raw: str) -> str:
        if raw not in choices:
            raise ValueError(raw)
        return raw
    return parse


def _path(raw: str) -> str:
    return raw


VARIABLES: dict[str, Variable] = {v.name: v for v in (
    Variable(SHARING_STRATEGY, "file_descriptor", _choice("file_descriptor", "file_system"),
             "'file_descriptor' or 'file_system'"),
    Variable(SHM_DIR, "/dev/shm", _path, "a directory on a tmpfs"),
    Variable(CACHE_IDLE, 1.0, _number(0), "a number of seconds >= 0"),
    Variable(JOBLIB_IDLE, 300.0, _number(0),
             "a number of seconds >= 0 (0: no warm pool, a pool per Parallel call)"),
    Variable(RECYCLE_BYTES, 256 << 20, _number(0, integer=True),
             "a number of bytes >= 0 (0 turns recycling off)"),
    Variable(WINDOW_BYTES, None, _number(1, integer=True),
             "a positive number of bytes (unset: sized by the memory available, "
             "docs/reference.md: mp.Pipe)"),
    Variable(SPIN_US, 50.0, _number(0, 1e6),
             "a number of microseconds from 0 (no spinning) to 1000000"),
    Variable(QUEUE_RINGS, True, _flag,
             "1 (or unset) for queues whose small messages travel through rings in shared "
             "memory, or 0 for queues that send every message through their socket"),
    Variable(KEEP_ORPHANS, False, _flag,
             "1 to let children outlive their parent, or 0 (or unset) for children that "
             "die with it"),
    Variable(CUDA_EXIT_TIMEOUT, 5.0, _number(0), "a number of seconds >= 0"),
    Variable(CUDA_EXIT_UNCLAIMED, 2.0, _number(0), "a number of seconds >= 0"),
    Variable(MANAGER, None, _path, "the path of a sharedmp manager daemon's socket"),
    Variable(FREEZE_FORKED, None, _flag,
             "1 to freeze what every forked child inherits (gc.freeze()), 0 for none, or "
             "unset for torch DataLoader workers of sharedmp's contexts only"),
    Variable(NO_EXTENSIONS, False, _flag,
             "1 to run the pure-Python twins of the compiled core, or 0 (or unset) for the "
             "compiled core where it is installed"),
    Variable(PARALLEL_START, False, lambda raw: raw == "1",
             "1 to start forkserver children from threads, as torch does"),
)}


def get(name: str) -> Any:
    """The value of the variable ``name`` now: its default if unset or empty."""
    var = VARIABLES[name]
    raw = os.environ.get(name, "")
    if not raw:
        return var.default
    try:
        return var.parse(raw)
    except ValueError:
        raise ValueError(f"${name} must be {var.accepts}, not {raw!r}") from None


def export(name: str, value: str) -> None:
    """Set ``name`` for this process and the children it starts from now on."""
    VARIABLES[name].parse(value)       # (what the children would read back must parse)
    os.environ[name] = value


# The daemon's socket is <runtime dir>/sharedmp-XXXXXXXX/manager.sock, and a socket's path
# has at most 107 bytes (AF_UNIX, Linux; 103 on macOS)
_SOCKET_ROOM = 103 - len("/sharedmp-XXXXXXXX/manager.sock")


def runtime_dir() -> str:
    """Where the manager daemon's private directory is made: $XDG_RUNTIME_DIR if it is
    usable, else Python's temporary directory ($TMPDIR, else /tmp, ...); either only if short
    enough for the socket's path, else /tmp."""
    d = os.environ.get("XDG_RUNTIME_DIR")
    if d and len(os.fsencode(d)) <= _SOCKET_ROOM and os.access(d, os.W_OK | os.X_OK):
        return d
    import tempfile                      # (deferred: most programs never need it)
    d = tempfile.gettempdir()
    return d if len(os.fsencode(d)) <= _SOCKET_ROOM else "/tmp"

"""mp.spawn() and mp.start_processes(): run fn(i, *args) in nprocs children, as torch does.

Adapted from torch/multiprocessing/spawn.py; changed:
- the children are Processes of sharedmp's contexts, so they start with the parent's
  sharing strategy and die with the parent (``pdeath.py``; torch's wrapper sets SIGINT);
- a child's traceback comes back through a pipe of its own, not a file: nothing is left
  in /tmp, even when the parent is killed (torch leaves its files);
- if starting the k-th child fails, the children already started are killed;
- bad ``fn``/``nprocs``/``start_method`` raise before anything starts;
- ``join()`` after a failure raises the same exception again.

As torch's: with ``$TORCH_MP_PARALLEL_START=1`` (``ENV_VAR_PARALLEL_START``) forkserver
children are started in parallel, and stopping the others after a failure logs a warning
for each one that gets SIGTERM or SIGKILL, under torch's logger name
(``torch.multiprocessing.spawn``), so that logging set up for torch applies unchanged.
"""
from __future__ import annotations

import logging
import multiprocessing.connection
import operator
import signal
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Iterable, Literal, overload

from .. import settings
from .context import get_context
from ..errors import ProcessExitedException, ProcessRaisedException

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.process import BaseProcess

_TERM_WAIT = 30          # seconds between SIGTERM and SIGKILL when no grace_period is given
ENV_VAR_PARALLEL_START = settings.PARALLEL_START      # torch's name and variable
log = logging.getLogger("torch.multiprocessing.spawn")       # (creating it imports nothing)


# The parent reads a traceback only once the child has ended, so what the child writes
# must fit in the pipe's buffer (64 KiB on Linux): a longer one keeps its start and its end.
_TRACE_HEAD, _TRACE_TAIL = 4096, 28672


def _wrap(fn: Callable[..., object], i: int, args: tuple[Any, ...],
          error_conn: Connection) -> None:
    """(in the child) fn(i, *args); an exception's traceback goes to ``error_conn``."""
    try:
        fn(i, *args)
    except KeyboardInterrupt:
        pass                            # as torch: Ctrl-C reached the parent as well
    except Exception:
        import traceback
        text = traceback.format_exc()
        data = text.encode("utf-8", "replace")
        if len(data) > _TRACE_HEAD + _TRACE_TAIL:
            data = data[:_TRACE_HEAD] + b"\n[... traceback shortened ...]\n" + data[-_TRACE_TAIL:]
        try:
            error_conn.send_bytes(data)
        except OSError:                     # the parent has gone
            sys.stderr.write(text)
        sys.exit(1)
    finally:
        error_conn.close()


class ProcessContext:
    """The children of one start_processes() call: ``join()`` them, ``pids()``."""

    def __init__(self, processes: list[BaseProcess], error_pipes: list[Connection]) -> None:
        self.processes = processes
        self.error_pipes = error_pipes      # the read ends: a failing child's traceback
        self.sentinels = {p.sentinel: i for i, p in enumerate(processes)}
        self._failure: ProcessRaisedException | ProcessExitedException | None = None

    def pids(self) -> list[int]:
        """The children's pids, by index."""
        # (started: pid is never None)
        return [int(p.pid) for p in self.processes]  # type: ignore[arg-type]

    def join(self, timeout: float | None = None, grace_period: float | None = None) -> bool:
        """Wait up to ``timeout`` s (None: until a child ends); True once every child ended well.

        If a child failed, the others get ``grace_period`` s to end by themselves (None:
        none), then SIGTERM, then SIGKILL after ``grace_period`` s more (None: 30 s), and
        ProcessRaisedException (it raised: its traceback) or ProcessExitedException (exit
        code or signal) is raised.
        """
        if self._failure is not None:
            raise self._failure
        if not self.sentinels:
            return True
        # (sentinels: ints)
        ready: list[Any] = multiprocessing.connection.wait(list(self.sentinels), timeout=timeout)
        failed = None
        # report the lowest failing index
        # the lowest failing index is the one reported
        for sentinel in sorted(ready, key=self.sentinels.get):  # type: ignore[arg-type]
            index = self.sentinels.pop(sentinel)
            process = self.processes[index]
            process.join()
            if process.exitcode != 0 and failed is None:
                failed = index
        if failed is None:
            if not self.sentinels:
                self._done()
            return not self.sentinels
        self._stop_all(grace_period)
        self._failure = self._exception(failed)
        self._done()
        raise self._failure

    def _stop_all(self, grace_period: float | None) -> None:
        if grace_period is not None:
            _join_all(self.processes, grace_period)
        for p in self.processes:
            if p.is_alive():
                log.warning("Terminating process %s via signal SIGTERM", p.pid)
                p.terminate()
        _join_all(self.processes, _TERM_WAIT if grace_period is None else grace_period)
        for p in self.processes:
            if p.is_alive():            # stuck in C code that never reaches Python's handler
                log.warning("Unable to shutdown process %s via SIGTERM, forcefully exiting via "
                            "SIGKILL", p.pid)
                p.kill()
            p.join()
        self.sentinels.clear()

    def _exception(self, i: int) -> ProcessRaisedException | ProcessExitedException:
        pid = self.processes[i].pid
        trace = None
        try:
            if self.error_pipes[i].poll():
                trace = self.error_pipes[i].recv_bytes().decode("utf-8", "replace")
        except (EOFError, OSError):          # killed before or while writing it
            pass
        if trace is not None:
            return ProcessRaisedException(
                f"\n\n-- Process {i:d} terminated with the following error:\n{trace}", i, pid)
        code: int = self.processes[i].exitcode  # type: ignore[assignment]  # (joined: not None)
        if code >= 0:
            return ProcessExitedException(f"process {i:d} terminated with exit code {code:d}",
                                          i, pid, exit_code=code)
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"<Unknown signal {-code}>"
        hint = (" (often the kernel's out-of-memory killer: see `dmesg`)"
                if -code == signal.SIGKILL else "")
        return ProcessExitedException(f"process {i:d} terminated with signal {name}{hint}",
                                      i, pid, exit_code=code, signal_name=name)

    def _done(self) -> None:
        for conn in self.error_pipes:
            conn.close()


class SpawnContext(ProcessContext):
    """torch's old name of ProcessContext; warns as torch does."""

    def __init__(self, processes: list[BaseProcess], error_pipes: list[Connection]) -> None:
        warnings.warn("SpawnContext is renamed to ProcessContext since 1.4 release.", stacklevel=2)
        super().__init__(processes, error_pipes)


def _join_all(processes: list[BaseProcess], timeout: float) -> None:
    """Join every process within one shared ``timeout``."""
    import time
    end = time.monotonic() + timeout
    for p in processes:
        p.join(max(0.0, end - time.monotonic()))


@overload
def start_processes(fn: Callable[..., object], args: Iterable[Any] = (), nprocs: int = 1,
                    join: Literal[True] = True, daemon: bool = False,
                    start_method: str = "spawn") -> None: ...
@overload
def start_processes(fn: Callable[..., object], args: Iterable[Any], nprocs: int,
                    join: Literal[False], daemon: bool = False,
                    start_method: str = "spawn") -> ProcessContext: ...
@overload
def start_processes(fn: Callable[..., object], args: Iterable[Any] = (), nprocs: int = 1, *,
                    join: Literal[False], daemon: bool = False,
                    start_method: str = "spawn") -> ProcessContext: ...
@overload
def start_processes(fn: Callable[..., object], args: Iterable[Any] = (), nprocs: int = 1,
                    join: bool = True, daemon: bool = False,
                    start_method: str = "spawn") -> ProcessContext | None: ...
def start_processes(fn: Callable[..., object], args: Iterable[Any] = (), nprocs: int = 1,
                    join: bool = True, daemon: bool = False,
                    start_method: str = "spawn") -> ProcessContext | None:
    """Run fn(i, *args) in a child for each i < nprocs; join them or return their
    ProcessContext."""
    if not callable(fn):
        raise TypeError(f"fn must be a callable run as fn(i, *args), got {type(fn).__name__}")
    try:
        nprocs = operator.index(nprocs)
    except TypeError:
        raise TypeError(f"nprocs must be an int, got {type(nprocs).__name__}") from None
    if nprocs < 1:
        raise ValueError(f"nprocs must be at least 1, got {nprocs}")
    ctx = get_context(start_method)        # ValueError naming the valid start methods
    args = tuple(args)

    processes: list[BaseProcess | None]
    error_pipes: list[Connection | None]
    processes, error_pipes = [None] * nprocs, [None] * nprocs

    def start(i: int) -> None:
        reader, writer = multiprocessing.connection.Pipe(duplex=False)
        error_pipes[i] = reader
        try:
            p = ctx.Process(target=_wrap, args=(fn, i, args, writer), daemon=daemon)
            p.start()                   # spawn: an unpicklable fn or args raises here
        finally:
            writer.close()              # the child has its own; EOF once it is gone
        processes[i] = p

    try:
        if start_method == "forkserver" and settings.get(ENV_VAR_PARALLEL_START):
            with ThreadPoolExecutor(max_workers=nprocs) as executor:
                for future in [executor.submit(start, i) for i in range(nprocs)]:
                    future.result()
        else:
            for i in range(nprocs):
                start(i)
    except BaseException:
        for p in filter(None, processes):
            p.kill()
        for p in filter(None, processes):
            p.join()
        for conn in filter(None, error_pipes):
            conn.close()
        raise
    context = ProcessContext(processes, error_pipes)  # type: ignore[arg-type]  # (all set by now)
    if not join:
        return context
    while not context.join():
        pass
    return None


@overload
def spawn(fn: Callable[..., object], args: Iterable[Any] = (), nprocs: int = 1,
          join: Literal[True] = True, daemon: bool = False,
          start_method: str = "spawn") -> None: ...
@overload
def spawn(fn: Callable[..., object], args: Iterable[Any], nprocs: int, join: Literal[False],
          daemon: bool = False, start_method: str = "spawn") -> ProcessContext: ...
@overload
def spawn(fn: Callable[..., object], args: Iterable[Any] = (), nprocs: int = 1, *,
          join: Literal[False], daemon: bool = False,
          start_method: str = "spawn") -> ProcessContext: ...
@overload
def spawn(fn: Callable[..., object], args: Iterable[Any] = (), nprocs: int = 1,
          join: bool = True, daemon: bool = False,
          start_method: str = "spawn") -> ProcessContext | None: ...
def spawn(fn: Callable[..., object], args: Iterable[Any] = (), nprocs: int = 1,
          join: bool = True, daemon: bool = False,
          start_method: str = "spawn") -> ProcessContext | None:
    """start_processes() with the spawn start method (``start_method``: deprecated, as in
    torch)."""
    if start_method != "spawn":
        warnings.warn(f"spawn() always uses the 'spawn' start method (got {start_method!r}); "
                      f"use mp.start_processes(..., start_method={start_method!r}) for another",
                      FutureWarning, stacklevel=2)
    return start_processes(fn, args, nprocs, join, daemon, start_method="spawn")

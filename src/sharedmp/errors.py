"""Exceptions of sharedmp, in one place; each message says what to do."""
from typing import Any


class OutOfSharedMemory(MemoryError):
    """Shared memory could not be reserved; raised at allocation, never as SIGBUS later."""


class SegmentError(OSError):
    """A segment handle that arrived from another process cannot be used."""


class ProtocolError(ConnectionError):
    """A frame on a sharedmp channel is malformed (hostile, truncated or corrupt)."""


class ManagerError(RuntimeError):
    """The file_system strategy's manager daemon is gone or refused this process."""


class CudaError(RuntimeError):
    """A CUDA driver call failed (the message names the call and its error), or CUDA memory
    cannot be shared: raised at ``put()``, naming the setting that would make it shareable."""


class ProcessException(Exception):
    """A child of ``mp.spawn()`` / ``mp.start_processes()`` failed (as torch's, picklable)."""

    def __init__(self, msg: str, error_index: int, error_pid: int | None) -> None:
        super().__init__(msg)
        self.msg = msg
        self.error_index = error_index      # fn(i, ...): which i failed
        self.error_pid = error_pid

    def __reduce__(self) -> tuple[type["ProcessException"], tuple[Any, ...]]:
        return type(self), (self.msg, self.error_index, self.error_pid)


class ProcessRaisedException(ProcessException):
    """A child raised; the message holds the child's full traceback text."""


class ProcessExitedException(ProcessException):
    """A child exited with a non-zero code or was killed by a signal (``signal_name``)."""

    def __init__(self, msg: str, error_index: int, error_pid: int | None, exit_code: int,
                 signal_name: str | None = None) -> None:
        super().__init__(msg, error_index, error_pid)
        self.exit_code = exit_code          # as Process.exitcode: -N for signal N
        self.signal_name = signal_name

    def __reduce__(self) -> tuple[type["ProcessException"], tuple[Any, ...]]:
        return type(self), (self.msg, self.error_index, self.error_pid, self.exit_code,
                            self.signal_name)

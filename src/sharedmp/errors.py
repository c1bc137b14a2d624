"""Exceptions of sharedmp, in one place; each message says what to do."""


class OutOfSharedMemory(MemoryError):
    """Shared memory could not be reserved; raised at allocation, never as SIGBUS later."""


class SegmentError(OSError):
    """A segment handle that arrived from another process cannot be used."""


class ProtocolError(ConnectionError):
    """A frame on a sharedmp channel is malformed (hostile, truncated or corrupt)."""


class ManagerError(RuntimeError):
    """The file_system strategy's manager daemon is gone or refused this process."""

"""File descriptors that travel out of band, beside a message's pickled bytes.

While a sharedmp channel pickles a message, the reducers put the fds of the segments
it references into the message's ``OutOfBand`` (one per segment, however many arrays
view it) and pickle only their index; the channel sends them in the same ``sendmsg``
as the frame (SCM_RIGHTS). While it unpickles, the rebuild functions look the
received fds up by index. Outside a sharedmp channel there is no ``OutOfBand`` and the
reducers fall back to multiprocessing's ``DupFd``.
"""
import threading

from ..errors import ProtocolError

_local = threading.local()


class OutOfBand:
    """The fds of one message: collected while pickling, looked up while unpickling."""

    __slots__ = ("fds", "_index")

    def __init__(self, fds=None):
        self.fds = [] if fds is None else fds
        self._index = {}

    def add(self, fd):
        """The index of ``fd`` in this message, adding it once."""
        i = self._index.get(fd)
        if i is None:
            i = self._index[fd] = len(self.fds)
            self.fds.append(fd)
        return i

    def get(self, i):
        if not isinstance(i, int) or not 0 <= i < len(self.fds):
            raise ProtocolError(f"message refers to fd #{i!r} but carried {len(self.fds)} fds")
        return self.fds[i]


def current():
    """The OutOfBand of the message this thread is pickling or unpickling, or None."""
    return getattr(_local, "oob", None)


def swap(oob):
    """Make ``oob`` current; returns the previous one, to be restored with swap(prev)."""
    prev = getattr(_local, "oob", None)
    _local.oob = oob
    return prev

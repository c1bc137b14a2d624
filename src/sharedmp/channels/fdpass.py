"""File descriptors that travel out of band, beside a message's pickled bytes.

While a sharedmp channel pickles a message, the reducers put the fds of the segments
it references into the message's ``OutOfBand`` (one per segment, however many arrays
view it) and pickle only their index; the channel sends them in the same ``sendmsg``
as the frame (SCM_RIGHTS). While it unpickles, the rebuild functions look the
received fds up by index. Outside a sharedmp channel there is no ``OutOfBand`` and the
reducers fall back to multiprocessing's ``DupFd``.
"""
import array
import errno
import os
import socket
import struct
import threading
import time

from ..errors import ProtocolError

_local = threading.local()


class Fds(list):
    """The fds of a message being sent, and (``keep``) the objects that own them until then."""

    __slots__ = ("keep",)

    def __init__(self):           # (list's own __init__ has nothing to do for an empty list)
        self.keep = []


class OutOfBand:
    """The fds of one message: collected while pickling, looked up while unpickling."""

    __slots__ = ("fds", "_index")

    def __init__(self, fds=None):
        self.fds = Fds() if fds is None else fds
        self._index = {}

    def keep_alive(self, owner):
        """Keep ``owner`` (a mapping whose fd this message carries) alive as long as ``fds``:
        the caller holds ``fds`` until they are sent (or dup'ed)."""
        self.fds.keep.append(owner)

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


# ---------------------------------------------------------------------------------------
# Frames on an AF_UNIX stream socket.
#
#   header  <2sBBIQ: magic b"SM", version, flags, fd count, payload length (16 bytes)
#           sent with the first <= 253 fds (SCM_MAX_FD) in SCM_RIGHTS
#   marker  one byte b"+" per further batch of <= 253 fds (a message may reference more)
#   payload the pickled bytes
#
# A receiver checks the magic, that the fds that arrived are the fds announced (and that
# the kernel truncated none: MSG_CTRUNC), that the length is sane and that the peer does
# not close mid-frame; each failure is a ProtocolError, and the fds that did arrive are
# closed. A claimed length is never allocated up front beyond what has arrived.
# ---------------------------------------------------------------------------------------

HEADER = struct.Struct("<2sBBIQ")
MAGIC = b"SM"
VERSION = 1
MAX_FDS_PER_MSG = 253                 # SCM_MAX_FD in the Linux kernel
MAX_FDS = 1 << 16                     # a sane bound on the fds of one message
MAX_PAYLOAD = 1 << 40                 # a sane bound on one message's bytes (1 TiB)
_EAGER = 16 << 20                     # payloads up to this size are allocated at once
_CMSG_SPACE = socket.CMSG_SPACE(MAX_FDS_PER_MSG * 4)
_CLOEXEC = int(getattr(socket, "MSG_CMSG_CLOEXEC", 0))
_MSG_CTRUNC = int(socket.MSG_CTRUNC)      # plain ints: enum flag arithmetic is slow


def _rights(fds):
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]


def _sendmsg(sock, buffers, fds):
    """sendmsg with ``fds`` attached, waiting while the kernel refuses more fds in flight.

    Linux counts the fds a user has in flight (sent, not yet received, on any socket) and
    refuses more than RLIMIT_NOFILE of them with ETOOMANYREFS unless the sender has
    CAP_SYS_RESOURCE. Receivers take them out of flight as they read, so this is
    back-pressure like a full socket buffer: wait and retry (nothing was sent).
    """
    if not fds:
        return sock.sendmsg(buffers)
    delay = 0.0005
    while True:
        try:
            return sock.sendmsg(buffers, _rights(fds))
        except OSError as e:
            if e.errno != errno.ETOOMANYREFS:
                raise
        time.sleep(delay)
        delay = min(2 * delay, 0.02)


def send_frame(sock, payload, fds=(), flags=0):
    """Send one frame: the header with the fds, then the payload (blocking)."""
    if type(payload) is not bytes:
        payload = memoryview(payload).cast("B")
    header = HEADER.pack(MAGIC, VERSION, flags, len(fds), len(payload))
    if len(payload) <= 65536 and len(fds) <= MAX_FDS_PER_MSG:     # the whole frame in one sendmsg
        sent = _sendmsg(sock, [header, payload], fds)
        if sent < len(header) + len(payload):  # a stream socket may take a part; the fds went with it
            sock.sendall((header + payload)[sent:])
        return
    first, rest = fds[:MAX_FDS_PER_MSG], fds[MAX_FDS_PER_MSG:]
    sent = _sendmsg(sock, [header], first)
    if sent < len(header):
        sock.sendall(header[sent:])
    for i in range(0, len(rest), MAX_FDS_PER_MSG):
        _sendmsg(sock, [b"+"], rest[i:i + MAX_FDS_PER_MSG])
    sock.sendall(payload)


def close_all(fds):
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _take_fds(ancdata, msg_flags, fds):
    """Append the fds of a recvmsg result to ``fds``; raise if the kernel dropped some."""
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(data[:len(data) - len(data) % a.itemsize])
            fds.extend(a)
    if msg_flags & _MSG_CTRUNC:
        raise ProtocolError("file descriptors were dropped in transit (MSG_CTRUNC): the "
                            "receiver's fd limit is too low (raise it with `ulimit -n`)")


def _recv_exact(sock, n, what):
    """``n`` bytes. A small read is usually all there: one recv, no buffer to fill."""
    got = 0
    if n <= 65536:
        data = sock.recv(n)
        if len(data) == n:
            return data
        if not data:
            raise ProtocolError(f"peer closed the connection in the middle of a frame ({what})")
        got = len(data)
    buf = bytearray(n)
    if got:
        buf[:got] = data
    view = memoryview(buf)
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ProtocolError(f"peer closed the connection in the middle of a frame ({what})")
        got += k
    return buf


def recv_frame(sock):
    """Receive one frame: (payload bytes or bytearray, fds, flags). EOFError on a clean end of stream."""
    fds = []
    try:
        data, ancdata, msg_flags, _ = sock.recvmsg(HEADER.size, _CMSG_SPACE, _CLOEXEC)
        _take_fds(ancdata, msg_flags, fds)
        if not data:
            raise EOFError("the other end of the channel was closed")
        if len(data) < HEADER.size:
            data += _recv_exact(sock, HEADER.size - len(data), "header")
        magic, version, flags, nfds, length = HEADER.unpack(data)
        if magic != MAGIC or version != VERSION:
            raise ProtocolError(f"not a sharedmp frame (header {bytes(data)!r}): the peer is not "
                                "a sharedmp channel of this version, or the stream is corrupt")
        if nfds > MAX_FDS or length > MAX_PAYLOAD:
            raise ProtocolError(f"frame announces {nfds} fds and {length} bytes: over the sane bounds")
        if len(fds) != min(nfds, MAX_FDS_PER_MSG):
            raise ProtocolError(f"frame announces {nfds} fds but {len(fds)} arrived with its header")
        while len(fds) < nfds:
            data, ancdata, msg_flags, _ = sock.recvmsg(1, _CMSG_SPACE, _CLOEXEC)
            before = len(fds)
            _take_fds(ancdata, msg_flags, fds)
            if data != b"+" or len(fds) == before or len(fds) > nfds:
                raise ProtocolError(f"frame announces {nfds} fds but the fd batches that follow "
                                    "do not match")
        if length <= _EAGER:
            payload = _recv_exact(sock, length, "payload")
        else:                          # grow as data arrives: a lying length costs nothing
            payload = bytearray()
            while len(payload) < length:
                payload += _recv_exact(sock, min(length - len(payload), max(_EAGER, len(payload))),
                                       "payload")
        return payload, fds, flags
    except BaseException:
        close_all(fds)
        raise

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
# Frames on an AF_UNIX SOCK_SEQPACKET socket. Records keep their boundaries, so a receiver
# reads a small frame -- header, fds and payload -- in one recvmsg, and never reads into
# the next frame (which may be another consumer's: a queue has many).
#
#   first record   header <2sBBIQ: magic b"SM", version, flags, fd count, payload length
#                  (16 bytes), with the first <= 253 fds (SCM_MAX_FD) in SCM_RIGHTS; then the
#                  payload's first bytes, when the fds fit in this record
#   fd records     b"+" with each further batch of <= 253 fds (a message may reference more)
#   payload        the rest of the pickled bytes, in records of at most RECORD bytes
#
# A receiver checks the magic, that the fds that arrived are the fds announced (and that
# the kernel truncated none: MSG_CTRUNC), that the length is sane, that no record runs
# past the frame and that the peer does not close mid-frame; each failure is a
# ProtocolError, and the fds that did arrive are closed. A claimed length is never
# allocated up front beyond what has arrived.
# ---------------------------------------------------------------------------------------

SOCK_TYPE = socket.SOCK_SEQPACKET
HEADER = struct.Struct("<2sBBIQ")
MAGIC = b"SM"
VERSION = 1
RECORD = 1 << 16                      # the largest record sent (the socket buffer takes more)
MAX_FDS_PER_MSG = 253                 # SCM_MAX_FD in the Linux kernel
MAX_FDS = 1 << 16                     # a sane bound on the fds of one message
MAX_PAYLOAD = 1 << 40                 # a sane bound on one message's bytes (1 TiB)
_EAGER = 16 << 20                     # payloads up to this size are allocated at once
_CMSG_SPACE = socket.CMSG_SPACE(MAX_FDS_PER_MSG * 4)
_CLOEXEC = int(getattr(socket, "MSG_CMSG_CLOEXEC", 0))
_MSG_CTRUNC = int(socket.MSG_CTRUNC)      # plain ints: enum flag arithmetic is slow
_MSG_TRUNC = int(socket.MSG_TRUNC)
_SOL_SOCKET, _SCM_RIGHTS = int(socket.SOL_SOCKET), int(socket.SCM_RIGHTS)
_FDS = [struct.Struct(f"{n}i") for n in range(MAX_FDS_PER_MSG + 1)]   # the fds of a record, by count


def _rights(fds):
    return [(_SOL_SOCKET, _SCM_RIGHTS, array.array("i", fds))]


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
    """Send one frame: a record of the header, the fds and (most often) the whole payload,
    then the records of what did not fit (blocking). A record is sent whole or not at all."""
    if type(payload) is not bytes:
        payload = memoryview(payload).cast("B")
    header = HEADER.pack(MAGIC, VERSION, flags, len(fds), len(payload))
    if len(fds) <= MAX_FDS_PER_MSG:
        if len(payload) <= RECORD - HEADER.size:          # the usual case: one record
            _sendmsg(sock, [header, payload], fds)
            return
        done = RECORD - HEADER.size
        _sendmsg(sock, [header, payload[:done]], fds)
    else:
        done = 0
        _sendmsg(sock, [header], fds[:MAX_FDS_PER_MSG])
        for i in range(MAX_FDS_PER_MSG, len(fds), MAX_FDS_PER_MSG):
            _sendmsg(sock, [b"+"], fds[i:i + MAX_FDS_PER_MSG])
    view = memoryview(payload)
    for i in range(done, len(payload), RECORD):
        sock.sendmsg([view[i:i + RECORD]])


def close_all(fds):
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _record(sock, fds, what=None):
    """The next record, its fds appended to ``fds``; raises if the kernel dropped some fds or
    cut the record (one longer than any sharedmp sends), or if the peer closed in the middle
    of ``what`` (without ``what``, a closed peer gives b"")."""
    data, ancdata, msg_flags, _ = sock.recvmsg(RECORD, _CMSG_SPACE, _CLOEXEC)
    for level, kind, cdata in ancdata:
        if level == _SOL_SOCKET and kind == _SCM_RIGHTS:
            fds.extend(_FDS[len(cdata) // 4].unpack_from(cdata))
    if msg_flags & (_MSG_CTRUNC | _MSG_TRUNC):
        if msg_flags & _MSG_CTRUNC:
            raise ProtocolError("file descriptors were dropped in transit (MSG_CTRUNC): the "
                                "receiver's fd limit is too low (raise it with `ulimit -n`)")
        raise ProtocolError(f"a record longer than {RECORD} bytes ({what or 'header'}): the peer is not a "
                            "sharedmp channel of this version")
    if not data and what is not None:
        raise ProtocolError(f"peer closed the connection in the middle of a frame ({what})")
    return data


def _recv_payload(sock, payload, got, length):
    """Fill ``payload`` (a bytearray of ``got`` bytes so far) with records up to ``length``
    bytes, growing it as data arrives: a lying length costs nothing."""
    while got < length:
        want = min(RECORD, length - got)
        if len(payload) - got < want:
            payload.extend(bytes(min(length, max(_EAGER, 2 * len(payload))) - len(payload)))
        with memoryview(payload) as view:
            # A record is taken whole: MSG_TRUNC makes recv_into tell its true length.
            k = sock.recv_into(view[got:got + want], want, _MSG_TRUNC)
        if k == 0:
            raise ProtocolError("peer closed the connection in the middle of a frame (payload)")
        if k > want:
            raise ProtocolError(f"a record of {k} bytes runs past the end of its frame ({length - got} "
                                "bytes were due): the peer is not a sharedmp channel, or the stream is corrupt")
        got += k
    return payload


def recv_frame(sock):
    """Receive one frame: (payload bytes or bytearray, fds, flags). EOFError on a clean end of stream."""
    fds = []
    try:
        data = _record(sock, fds)
        if not data:
            raise EOFError("the other end of the channel was closed")
        while len(data) < HEADER.size:          # a header in pieces: not from sharedmp, but fine
            data += _record(sock, fds, "header")
        magic, version, flags, nfds, length = HEADER.unpack_from(data)
        if magic != MAGIC or version != VERSION:
            raise ProtocolError(f"not a sharedmp frame (header {bytes(data[:HEADER.size])!r}): the peer "
                                "is not a sharedmp channel of this version, or the stream is corrupt")
        if nfds > MAX_FDS or length > MAX_PAYLOAD:
            raise ProtocolError(f"frame announces {nfds} fds and {length} bytes: over the sane bounds")
        if len(fds) != min(nfds, MAX_FDS_PER_MSG):
            raise ProtocolError(f"frame announces {nfds} fds but {len(fds)} arrived with its header")
        while len(fds) < nfds:
            before = len(fds)
            if _record(sock, fds, "fds") != b"+" or len(fds) == before or len(fds) > nfds:
                raise ProtocolError(f"frame announces {nfds} fds but the fd batches that follow "
                                    "do not match")
        got = len(data) - HEADER.size
        if got == length:                                   # the usual case: all in one record
            return data[HEADER.size:], fds, flags
        if got > length:
            raise ProtocolError(f"a frame's first record carries {got} payload bytes, its header "
                                f"announces {length}: the stream is corrupt")
        payload = bytearray(min(length, _EAGER))
        payload[:got] = memoryview(data)[HEADER.size:]
        return _recv_payload(sock, payload, got, length), fds, flags
    except BaseException:
        close_all(fds)
        raise

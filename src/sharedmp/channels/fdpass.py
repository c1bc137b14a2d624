"""Records and their fds on AF_UNIX sockets: what ``wire.dumps`` made, moved whole.

A message's fds (collected by ``wire.OutOfBand`` while it is pickled) travel in the same
``sendmsg`` as its record (SCM_RIGHTS); the receiver gets both from one ``recvmsg``.
"""
from __future__ import annotations

import array
import errno
import fcntl
import os
import socket
import stat
import struct
import time
from typing import TYPE_CHECKING, Any, Sequence

from .. import native
from ..errors import ProtocolError
from ..memory import arena, segment
from ..wire import Fds, OutOfBand, close_all, current, swap  # noqa: F401 (used by the channels)

if TYPE_CHECKING:
    from .flow import Window
    from _typeshed import ReadableBuffer

# ---------------------------------------------------------------------------------------
# Frames on an AF_UNIX SOCK_SEQPACKET socket. One frame is one record, sent by one sendmsg
# and read by one recvmsg, whole or not at all: a sender killed at any instant leaves the
# channel intact, concurrent senders and receivers need no lock, and a receiver never
# reads into a frame that is another's.
#
#   record  header <2sBBIQ: magic b"SM", version, flags, fd count, payload length (16
#           bytes); then the payload when it fits in RECORD bytes; with the fds (SCM_RIGHTS)
#   flags   low 5 bits (KIND): what the payload is (0 a pickle; wire.py names 1-15)
#           TAGGED (in KIND's bits): a queue's frame whose payload starts with the 8-byte tag
#             of its marker in the sender's ring (board.py)
#           FLIGHT_TOKEN: the record carries a flight token (flow.py) after the message's fds
#             (or their socket): the receiver closes it once it has read the record
#           PAYLOAD_IN_MEMFD: the payload lies in a memfd sealed against shrinking, the
#             record's last fd, at the offset (<Q) that follows the header (a larger
#             payload, which no record holds)
#           FDS_ON_SOCKET: the message's fds wait on a socket, the record's first fd, in
#             records b"+" of up to 253 (SCM_MAX_FD: more than one sendmsg carries)
#
# A receiver checks the magic, the bounds, that the fds that arrived are the fds announced
# (and that the kernel truncated none: MSG_CTRUNC), that the payload is as long as
# announced; each failure is a ProtocolError, and the fds that did arrive are closed. A
# claimed length is never allocated beyond what the peer has written.
# ---------------------------------------------------------------------------------------

SOCK_TYPE = socket.SOCK_SEQPACKET
HEADER = struct.Struct("<2sBBIQ")
_OFFSET = struct.Struct("<Q")
MAGIC = b"SM"
VERSION = 3
KIND = 0x1F
TAGGED = 0x10
FLIGHT_TOKEN = 0x20
PAYLOAD_IN_MEMFD = 0x40
FDS_ON_SOCKET = 0x80
RECORD = 1 << 16                      # the largest record sent (the socket buffer takes more)
MAX_FDS_PER_MSG = 253                 # SCM_MAX_FD in the Linux kernel
MAX_FDS = 1 << 16                     # a sane bound on the fds of one message
MAX_PAYLOAD = 1 << 40                 # a sane bound on one message's bytes (1 TiB)
_CMSG_SPACE = socket.CMSG_SPACE(MAX_FDS_PER_MSG * 4)
_CLOEXEC = int(getattr(socket, "MSG_CMSG_CLOEXEC", 0))
_DONTWAIT = int(socket.MSG_DONTWAIT)
_MSG_CTRUNC = int(socket.MSG_CTRUNC)      # plain ints: enum flag arithmetic is slow
_MSG_TRUNC = int(socket.MSG_TRUNC)
_SOL_SOCKET, _SCM_RIGHTS = int(socket.SOL_SOCKET), int(socket.SCM_RIGHTS)
# the fds of a record, by count
_FDS = [struct.Struct(f"{n}i") for n in range(MAX_FDS_PER_MSG + 1)]


def _rights(fds):
    return [(_SOL_SOCKET, _SCM_RIGHTS, array.array("i", fds))]


def _sendmsg(sock, buffers, fds, block=True):
    """sendmsg with ``fds`` attached, waiting while the kernel refuses more fds in flight;
    with ``block`` false it waits for nothing (MSG_DONTWAIT) and raises instead.

    Linux counts the fds a user has in flight (sent, not yet received, on any socket) and
    refuses more than RLIMIT_NOFILE of them with ETOOMANYREFS unless the sender has
    CAP_SYS_RESOURCE. Receivers take them out of flight as they read, so this is
    back-pressure like a full socket buffer: wait and retry (nothing was sent).
    """
    flags = 0 if block else _DONTWAIT
    if not fds:
        return sock.sendmsg(buffers, [], flags)
    delay = 0.0005
    while True:
        try:
            return sock.sendmsg(buffers, _rights(fds), flags)
        except OSError as e:
            if e.errno != errno.ETOOMANYREFS or not block:
                raise
        time.sleep(delay)
        delay = min(2 * delay, 0.02)


def _send_record_py(sock, flags, nfds, length, payload, fds, block):
    """One record: the header (MAGIC, VERSION, ``flags``, ``nfds``, ``length``), then
    ``payload``, with ``fds`` attached (``_sendmsg``). The twin of ``_cframe.send_record``."""
    _sendmsg(sock, [HEADER.pack(MAGIC, VERSION, flags, nfds, length), payload], fds, block)


def _send_frame_py(sock: socket.socket, payload: ReadableBuffer, fds: Sequence[int] = (),
                   flags: int = 0, window: Window | None = None,
                   flight: int | None = None) -> None:
    """Send one frame as one record (blocking while the socket is full), then, with a
    ``window``, while the flight of its messages passes it. ``flight``: the bytes this
    message copied into shared memory (default: ``fds.flight``). The twin of
    ``_cframe.send_frame`` (which hands it every frame but a plain record)."""
    if type(payload) is not bytes:
        payload = memoryview(payload).cast("B")
    nfds, length = len(fds), len(payload)
    if flight is None:
        flight = getattr(fds, "flight", 0)
    extra = []                        # the record's own fds, after the message's
    if length > RECORD - HEADER.size:
        # Carved from this process's arenas (or a segment of its own when large): warm memory
        # once recycled, where a memfd per message would cost a page fault per 4 KiB.
        mapping, offset = arena.allocate(length, "file_descriptor", zero=False)
        # (``mapping`` lives until sent; a NumPy view of bytes takes a memoryview, not bytes)
        mapping[offset:offset + length] = memoryview(payload)
        # the payload's fd comes last
        extra.append(segment.segment_of(mapping).fd)  # type: ignore[union-attr]
        payload, flags, flight = _OFFSET.pack(offset), flags | PAYLOAD_IN_MEMFD, flight + length
    token = window.token(flight) if window is not None else None
    if token is not None:
        extra.insert(0, token)
        flags |= FLIGHT_TOKEN
    try:
        on_socket = nfds + len(extra) > MAX_FDS_PER_MSG
        if not on_socket:
            _send_record(sock, flags, nfds, length, payload, [*fds, *extra], True)
        else:
            side = _fds_socket(fds)   # the message's fds; the record's own stay in the record
            try:
                _send_record(sock, flags | FDS_ON_SOCKET, nfds, length, payload, [side, *extra],
                             True)
            finally:
                os.close(side)
    finally:
        if token is not None:
            os.close(token)           # the message's copy is the one that counts
    if window is not None:
        window.wait()


def try_send_frame(sock: socket.socket, payload: Any, fds: Sequence[int] = (), flags: int = 0,
                   window: Window | None = None) -> bool:
    """Send one frame now if it is one plain record, the window has room for it (so that
    sending it would not wait), and the socket takes it at once; False (nothing sent, nothing
    counted) otherwise: then ``send_frame`` it, which waits or raises. A message that brings
    the window's uncounted bytes to a step carries its flight token here too: sending it
    through a thread instead would send every message after it that way too."""
    nfds = len(fds)
    if len(payload) > RECORD - HEADER.size or nfds >= MAX_FDS_PER_MSG:
        return False
    flight = getattr(fds, "flight", 0)
    pair = None
    if window is not None:
        if not window.room(flight):
            return False
        pair = window.open(flight)
        if pair is not None:
            fds, flags = [*fds, pair[1]], flags | FLIGHT_TOKEN
    try:
        _send_record(sock, flags, nfds, len(payload), payload, fds, False)
    except OSError:                   # full (EAGAIN), ETOOMANYREFS, EPIPE, ...: a record is
        if window is not None:        # queued whole or not at all, so nothing went out
            window.cancel(None if pair is None else pair[0], flight)
        return False
    finally:
        if pair is not None:
            os.close(pair[1])         # the message's copy is the one that counts
    return True


def _fds_socket(fds):
    """A socket from which the receiver takes ``fds`` (all queued on it already)."""
    r, w = socket.socketpair(socket.AF_UNIX, SOCK_TYPE)
    try:
        w.setblocking(False)             # all of them fit in its buffer, or the message is refused
        for i in range(0, len(fds), MAX_FDS_PER_MSG):
            try:
                _sendmsg(w, [b"+"], fds[i:i + MAX_FDS_PER_MSG])
            except BlockingIOError:
                raise OSError(f"a message referencing {len(fds)} segments is too many to send: "
                              "send fewer arrays at a time, or arrays that share "
                              "segments") from None
        return r.detach()
    finally:
        w.close()
        r.close()


def _take_fds(ancdata, msg_flags, fds):
    """Append the fds of a recvmsg result to ``fds``; raise if the kernel dropped some."""
    for level, kind, cdata in ancdata:
        if level == _SOL_SOCKET and kind == _SCM_RIGHTS:
            fds.extend(_FDS[len(cdata) // 4].unpack_from(cdata))
    if msg_flags & _MSG_CTRUNC:
        raise ProtocolError("file descriptors were dropped in transit (MSG_CTRUNC): the "
                            "receiver's fd limit is too low (raise it with `ulimit -n`)")


def _recv_frame_py(sock: socket.socket,
                   block: bool = True) -> tuple[bytes | bytearray, list[int], int]:
    """Receive one frame: (payload, fds, kind). EOFError on a clean end of stream;
    BlockingIOError if ``block`` is false and no frame is there. The twin of
    ``_cframe.recv_frame``."""
    fds: list[int] = []
    try:
        data, ancdata, msg_flags, _ = sock.recvmsg(RECORD, _CMSG_SPACE, _CLOEXEC if block else
                                                   _CLOEXEC | _DONTWAIT)
        _take_fds(ancdata, msg_flags, fds)
        if not data:
            raise EOFError("the other end of the channel was closed")
        if msg_flags & _MSG_TRUNC:
            raise ProtocolError(f"a record longer than {RECORD} bytes: the peer is not a sharedmp "
                                "channel of this version")
        if len(data) < HEADER.size:
            raise ProtocolError(f"a record of {len(data)} bytes, shorter than a frame header: the "
                                "peer is not a sharedmp channel of this version")
        magic, version, flags, nfds, length = HEADER.unpack_from(data)
        if magic != MAGIC or version != VERSION:
            raise ProtocolError(f"not a sharedmp frame (header {bytes(data[:HEADER.size])!r}): "
                                "the peer is not a sharedmp channel of this version, or the "
                                "stream is corrupt")
        if nfds > MAX_FDS or length > MAX_PAYLOAD:
            raise ProtocolError(f"frame announces {nfds} fds and {length} bytes: over the sane "
                                "bounds")
        in_memfd, on_socket, token = (flags & PAYLOAD_IN_MEMFD, flags & FDS_ON_SOCKET,
                                      flags & FLIGHT_TOKEN)
        expected = (1 if on_socket else nfds) + (1 if in_memfd else 0) + (1 if token else 0)
        if len(fds) != expected:
            raise ProtocolError(f"frame announces {nfds} fds{' on a socket' if on_socket else ''}"
                                f"{' and its payload in a memfd' if in_memfd else ''}"
                                f"{' and a flight token' if token else ''} but {len(fds)} "
                                "arrived with it")
        got = len(data) - HEADER.size
        if in_memfd:
            if got != _OFFSET.size:
                raise ProtocolError(f"a frame with its payload in a memfd carries {got} bytes "
                                    "instead of the payload's offset there")
            payload = _payload_of(fds.pop(), _OFFSET.unpack_from(data, HEADER.size)[0], length)
        elif got != length:
            raise ProtocolError(f"a frame's record carries {got} payload bytes, its header "
                                f"announces {length}: the peer is not a sharedmp channel, or the "
                                "stream is corrupt")
        else:
            payload = data[HEADER.size:]
        if token:                     # taken: the sender's window is free of this message
            os.close(fds.pop())
        if on_socket:
            fds = _fds_of_socket(fds.pop(), nfds)
        return payload, fds, flags & KIND
    except BaseException:
        close_all(fds)
        raise


def _payload_of(fd, offset, length):
    """The ``length`` bytes at ``offset`` of the memfd ``fd`` (closed here). Read, not mapped:
    a peer that shrinks it cannot make this process fault (SIGBUS)."""
    try:
        st = os.fstat(fd)
        # st_blocks: a sparse file would make a reader allocate what the peer never wrote.
        if not stat.S_ISREG(st.st_mode) or st.st_size < offset + length \
                or st.st_blocks * 512 < length or not segment.sealed(fd, fcntl.F_SEAL_SHRINK):
            raise ProtocolError(f"a frame's payload of {length} bytes should be in a memfd sealed "
                                "against shrinking that holds them, and is not: the peer is not a "
                                "sharedmp channel of this version")
        payload = bytearray(length)
        with memoryview(payload) as view:
            done = 0
            while done < length:
                k = os.preadv(fd, [view[done:]], offset + done)
                if k == 0:
                    raise ProtocolError(f"a frame's payload memfd ends at {done} of {length} "
                                        "bytes")
                done += k
        return payload
    finally:
        os.close(fd)


def _fds_of_socket(fd, nfds):
    """The ``nfds`` fds waiting on the socket ``fd`` (closed here): all must be there already."""
    try:
        side = socket.socket(fileno=fd)
    except OSError:
        os.close(fd)
        raise ProtocolError(f"a frame's {nfds} fds should wait on a socket, and its fd is not "
                            "one") from None
    fds = []
    try:
        with side:
            while len(fds) < nfds:
                try:
                    data, ancdata, msg_flags, _ = side.recvmsg(1, _CMSG_SPACE,
                                                               _CLOEXEC | _DONTWAIT)
                except OSError:
                    data, ancdata, msg_flags = b"", [], 0
                before = len(fds)
                _take_fds(ancdata, msg_flags, fds)
                if data != b"+" or len(fds) == before or len(fds) > nfds:
                    raise ProtocolError(f"frame announces {nfds} fds on a socket, and the socket "
                                        f"does not hold them (after {before})")
        return fds
    except BaseException:
        close_all(fds)
        raise


# The compiled twins (_c/cframe.c) where built, else these (sharedmp/native.py).
_send_record, send_frame, recv_frame = _send_record_py, _send_frame_py, _recv_frame_py
_c = native.load("_cframe")
if _c is not None:
    _c.setup_fdpass(ProtocolError, _payload_of, _fds_of_socket, _send_frame_py)
    _send_record, send_frame, recv_frame = _c.send_record, _c.send_frame, _c.recv_frame

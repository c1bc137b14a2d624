"""Leases: a sender keeps the CUDA memory it sent alive until every receiver has let go.

CUDA IPC maps the sender's allocation into the receiver; if the sender frees it (its
tensor dies, the caching allocator reuses the block) the receiver silently reads and
writes someone else's data. So each array sent takes a *lease* in its sender, holding
the objects that keep the memory (and the event recorded for it) alive.

Protocol. Each sending process runs one ``LeaseServer``: a daemon thread on an
abstract AF_UNIX stream socket (random name; peers of another uid are refused by
SO_PEERCRED). A receiver keeps one connection per sender (``LeaseClient``) and writes
fixed 17-byte records, never awaiting a reply:

    b"C" + token(16)   CLAIM: the array with this token arrived here
    b"R" + token(16)   RELEASE: the last array over it has died here

A lease goes pending (sent) -> claimed (by one connection) -> released. A connection is
ordered, so a CLAIM precedes its RELEASE.

How it fails:

=============================== ======================================================
receiver dies (SIGKILL too)     the server reads what it had sent, then EOF, and frees
                                every lease that connection claimed
RELEASE twice, or of a token    ignored (counted in ``ignored``): only the connection
not claimed by this connection  that claimed a lease can release it, once
a malformed record              the connection is closed, as if that receiver had died
a lease never claimed (the      stays pending until the sender exits: ``pending()``
message was never received)     reports it, ``drop()`` frees it explicitly (freeing on
                                a guess would corrupt a late receiver silently)
sender exits with leases        at exit it warns and waits (the exit rule below), then
                                warns again if any is left and exits
sender dies                     receivers' next CLAIM fails ("the sender exited"); a
                                RELEASE to it is dropped with one warning
=============================== ======================================================

The exit rule. A claimed lease is memory a receiver has mapped and uses: the sender waits
up to SHAREDMP_CUDA_EXIT_TIMEOUT seconds (default 5) for its release. A pending lease is a
message nobody has taken yet. Its receiver may be about to (a sender that puts and returns,
its receiver a second behind), or there may be none (an actor that has left, a ``Queue``
the parent holds and never reads): the sender cannot tell the two apart, since whoever
holds the channel could still read it. So it waits for pending leases only
SHAREDMP_CUDA_EXIT_UNCLAIMED seconds (default 2, at most the exit timeout): enough for a
live receiver to take what is at the head of its queue, short enough that an abandoned
message does not hold the sender (torch's ``test_cuda_ipc_deadlock`` joins its learner
within 10 s of its start). A pending lease claimed during the wait becomes claimed and is
waited for as such.
"""
import errno
import os
import secrets
import selectors
import socket
import struct
import threading
import time
import warnings
from multiprocessing import util

from .. import forks, settings

RECORD = 17
CLAIM, RELEASE = b"C", b"R"
EXIT_TIMEOUT_ENV = settings.CUDA_EXIT_TIMEOUT
EXIT_UNCLAIMED_ENV = settings.CUDA_EXIT_UNCLAIMED
_UCRED = struct.Struct("3i")


def new_token():
    """A fresh 128-bit lease token."""
    return secrets.token_bytes(16)


def exit_timeout():
    """Seconds a sender waits at exit for receivers to release what they claimed."""
    return float(settings.get(EXIT_TIMEOUT_ENV))


def exit_unclaimed():
    """Seconds a sender waits at exit for messages not received yet (at most exit_timeout)."""
    return min(float(settings.get(EXIT_UNCLAIMED_ENV)), exit_timeout())


class _Lease:
    __slots__ = ("holds", "conn", "since")

    def __init__(self, holds):
        self.holds = holds        # what keeps the memory alive; dropped on release
        self.conn = None          # the connection that claimed it
        self.since = time.monotonic()


class LeaseServer:
    """The sender's side: leases by token, freed by their receivers' RELEASE or death."""

    def __init__(self, on_release=None):
        self.address = b"\0sharedmp-cuda-%d-%s" % (os.getpid(), secrets.token_hex(10).encode())
        self.on_release = on_release     # called with a lease's holds once it is released
        self.ignored = 0                 # RELEASE/CLAIM records that matched no lease of theirs
        self._leases = {}
        self._claims = {}                # connection -> set of tokens it claimed
        self._cond = threading.Condition()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.address)
        self._sock.listen(64)
        self._sock.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="sharedmp-cuda-leases",
                                        daemon=True)
        self._thread.start()

    # -- the sender's API ------------------------------------------------------------------

    def add(self, token, holds):
        """Hold ``holds`` until the lease ``token`` is released."""
        with self._cond:
            self._leases[token] = _Lease(holds)

    def outstanding(self):
        """How many leases are not released yet (pending or claimed)."""
        with self._cond:
            return len(self._leases)

    def pending(self):
        """[(token, seconds since sent)] of the leases no receiver has claimed yet."""
        now = time.monotonic()
        with self._cond:
            return [(t, now - lease.since) for t, lease in self._leases.items()
                    if lease.conn is None]

    def claimed_by(self):
        """{receiver pid: leases it holds}."""
        with self._cond:
            return {pid: len(tokens) for (_, pid), tokens in self._claims.items() if tokens}

    def drop(self, token):
        """Free a pending lease explicitly (its message will never be received)."""
        with self._cond:
            lease = self._leases.get(token)
            if lease is None or lease.conn is not None:
                return False
            del self._leases[token]
            self._cond.notify_all()
        self._released(lease)
        return True

    def wait_idle(self, timeout, unclaimed=None):
        """Wait until no lease is outstanding; whether that happened within ``timeout``.
        With ``unclaimed``, stop waiting after that many seconds if every lease left is
        pending (no receiver has claimed it)."""
        now = time.monotonic()
        deadline = now + timeout
        pending_deadline = deadline if unclaimed is None else now + min(unclaimed, timeout)
        with self._cond:
            while self._leases:
                now = time.monotonic()
                claimed = any(lease.conn is not None for lease in self._leases.values())
                end = deadline if claimed else pending_deadline
                if now >= end:
                    return False
                self._cond.wait(end - now)     # (a CLAIM notifies too)
        return True

    def close(self):
        """Stop serving (leases still held are dropped with the server)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(5)

    # -- the thread --------------------------------------------------------------------------

    def _serve(self):
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ, None)
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        buffers = {}
        try:
            while not self._closed:
                for key, _ in sel.select():
                    if key.data == "wake":
                        continue
                    if key.fileobj is self._sock:
                        self._accept(sel, buffers)
                    else:
                        self._read(sel, buffers, key.fileobj, key.data)
        finally:
            for conn, (pid, _) in list(buffers.items()):
                sel.unregister(conn)
                conn.close()
            sel.close()
            self._sock.close()
            self._wake_r.close()
            self._wake_w.close()

    def _accept(self, sel, buffers):
        try:
            conn, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        pid, uid, _ = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                    _UCRED.size))
        if uid != os.getuid():           # the abstract namespace is visible to every user
            conn.close()
            return
        conn.setblocking(False)
        key = (conn, pid)
        buffers[conn] = (pid, bytearray())
        with self._cond:
            self._claims[key] = set()
        sel.register(conn, selectors.EVENT_READ, key)

    def _read(self, sel, buffers, conn, key):
        try:
            data = conn.recv(RECORD * 256)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        buf = buffers[conn][1]
        buf += data
        n = len(buf) - len(buf) % RECORD
        ok = all(self._record(key, bytes(buf[i:i + RECORD])) for i in range(0, n, RECORD))
        del buf[:n]
        if not data or not ok:           # EOF (the receiver exited or died) or garbage
            sel.unregister(conn)
            del buffers[conn]
            conn.close()
            self._disconnected(key)

    def _record(self, key, rec):
        op, token = rec[:1], rec[1:]
        with self._cond:
            lease = self._leases.get(token)
            if op == CLAIM:
                if lease is None or lease.conn is not None:
                    self.ignored += 1
                else:
                    lease.conn = key
                    self._claims[key].add(token)
                    self._cond.notify_all()      # (an exit wait now waits for it as claimed)
                return True
            if op != RELEASE:
                return False
            if lease is None or lease.conn != key:
                self.ignored += 1
                return True
            del self._leases[token]
            self._claims[key].discard(token)
            self._cond.notify_all()
        self._released(lease)
        return True

    def _disconnected(self, key):
        with self._cond:
            tokens = self._claims.pop(key, ())
            freed = [self._leases.pop(t) for t in tokens if t in self._leases]
            self._cond.notify_all()
        for lease in freed:
            self._released(lease)

    def _released(self, lease):
        holds, lease.holds = lease.holds, None
        if self.on_release is not None:
            try:
                self.on_release(holds)
            except Exception as e:       # never let one release stop the server
                warnings.warn(f"sharedmp: releasing a CUDA lease failed: {e!r}", RuntimeWarning)

    # -- exit --------------------------------------------------------------------------------

    def wait_at_exit(self, timeout=None, unclaimed=None):
        """Warn and wait (bounded: the exit rule above) while receivers still hold, or may
        still take, memory this process sent."""
        timeout = exit_timeout() if timeout is None else timeout
        unclaimed = exit_unclaimed() if unclaimed is None else min(unclaimed, timeout)
        n = self.outstanding()
        if n:
            holders = self.claimed_by()
            warnings.warn(
                f"sharedmp: process {os.getpid()} is exiting while {n} CUDA array(s) it sent are "
                "still in use by other processes (pids and counts: "
                f"{holders or 'none claimed yet'}); waiting up to {timeout:g} s "
                f"({EXIT_TIMEOUT_ENV}) for them to be released, {unclaimed:g} s "
                f"({EXIT_UNCLAIMED_ENV}) for those not received yet. Keep the sender alive "
                "until its receivers drop what they got.",
                RuntimeWarning, stacklevel=2)
            if not self.wait_idle(timeout, unclaimed):
                warnings.warn(
                    f"sharedmp: exiting with {self.outstanding()} CUDA array(s) still held by "
                    "other processes: their memory is freed now and what they read from it is "
                    "undefined.",
                    RuntimeWarning, stacklevel=2)
        self.close()


class LeaseClient:
    """The receiver's side: one connection per sender, CLAIM and RELEASE records."""

    def __init__(self):
        self._conns = {}
        self._dead = set()
        self._lock = threading.Lock()

    def _conn(self, address):
        conn = self._conns.get(address)
        if conn is None:
            if address in self._dead:
                raise ConnectionRefusedError(errno.ECONNREFUSED, "the sender has exited")
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(address)
            except OSError:
                conn.close()
                raise
            self._conns[address] = conn
        return conn

    def claim(self, address, token):
        """CLAIM ``token``; RuntimeError if its sender is gone (its memory may be too)."""
        with self._lock:
            try:
                self._conn(address).sendall(CLAIM + token)
            except OSError as e:
                self._forget(address)
                raise RuntimeError(
                    "a CUDA array arrived from a process that has exited (or closed its lease "
                    f"server: {e.strerror or e}); its memory is gone. Keep the sender alive until "
                    "the receivers have got its arrays.") from None

    def release(self, address, *tokens):
        """RELEASE each of ``tokens``, in one write (dropped, with one warning, if the
        sender is gone)."""
        with self._lock:
            if address in self._dead:
                return
            try:
                self._conn(address).sendall(b"".join(RELEASE + t for t in tokens))
            except OSError:
                self._forget(address)
                warnings.warn("sharedmp: the sender of CUDA arrays held here has exited; their "
                              "memory was freed and what was read from it is undefined.",
                              RuntimeWarning, stacklevel=2)

    def _forget(self, address):
        self._dead.add(address)
        conn = self._conns.pop(address, None)
        if conn is not None:
            conn.close()

    def close(self):
        with self._lock:
            for conn in self._conns.values():
                conn.close()
            self._conns.clear()


# -- the process's server and client ----------------------------------------------------------

_server = None
_client = None
_lock = threading.Lock()


def server(on_release=None):
    """This process's LeaseServer (started on first use; waits for its leases at exit)."""
    global _server
    if _server is None:
        with _lock:
            if _server is None:
                _server = LeaseServer(on_release)
                # multiprocessing's exit hook runs in the main process (atexit) and in every
                # child it started, fork and forkserver ones too (which skip atexit);
                # exitpriority >= 0 runs before daemonic children are terminated.
                util.Finalize(None, _server.wait_at_exit, exitpriority=100)
    return _server


def client():
    global _client
    if _client is None:
        with _lock:
            if _client is None:
                _client = LeaseClient()
    return _client


@forks.in_child
def _after_fork_in_child() -> None:
    # The server's thread and the client's sockets belong to the parent.
    global _server, _client
    _server = _client = None


forks.renew_locks(globals(), "_lock")

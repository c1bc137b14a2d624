"""The client side of the file_system manager daemon.

Every process that makes, receives or sends a named segment keeps one connection to its
program's daemon and tells it, without waiting for an answer, what it holds and what is in
flight; a message of a sharedmp channel carries a token (``Tokens``) whose pipe holds its
references. The protocol, the tokens and the daemon's rules are written once: ``daemon.py``.

Records go out in order on one socket; a record posted from a finalizer (``dropped``,
``parked``) never blocks on the lock: a thread holding it sends what is queued before it
leaves.
"""
import array
import atexit
import collections
import errno
import itertools
import os
import select
import socket
import stat
import sys
import threading
import time
import weakref
from multiprocessing import util

from .. import fds, forks, settings
from ..errors import ManagerError
from . import cache

ENV = settings.MANAGER
HELLO_TIMEOUT = 10.0
_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "daemon.py")
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)   # EPIPE as an exception even if SIGPIPE is default

_lock = threading.Lock()        # held while connecting and while sending
# encoded records not sent yet
_pending: "collections.deque[tuple[bytes, int]]" = collections.deque()
_sock = None                    # the connection, once made
_dead = None                    # why this process can no longer use its daemon
_daemon: "tuple[int, str] | None" = None  # (pid, socket path) of the daemon we talk to
_generation = 0                 # counts connections made: a token belongs to one of them
_MAX_FDS = 250                  # fds passed in one sendmsg (SCM_MAX_FD is 253)
POOL_DIR = ".sharedmp-pool-%d"  # where the daemon (of this pid) moves parked segments once free


class _Gone(Exception):
    """That daemon exited cleanly (its socket file is gone): start a fresh one."""


def _hello(path):
    """A connection to the daemon at ``path`` that has accepted this process."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(HELLO_TIMEOUT)
        try:
            s.connect(path)
            reply = b""
            while not reply.endswith(b"\n") and len(reply) < 4096:
                chunk = s.recv(4096)
                if not chunk:
                    break
                reply += chunk
            if reply.startswith(b"OK "):
                s.sendall(b"HELLO %d\n" % os.getpid())
        except (FileNotFoundError, ConnectionError) as e:
            if not os.path.exists(path):
                raise _Gone() from None
            raise ManagerError(
                f"the sharedmp manager daemon at {path} is gone ({e.strerror or e}): it was "
                "killed, so named segments can no longer be tracked. Restart the program (its "
                "children inherit the dead daemon through $SHAREDMP_MANAGER), run `python -m "
                "sharedmp doctor --clean` to remove the segments it left, or use the "
                "'file_descriptor' strategy.") from None
        except PermissionError:
            raise ManagerError(f"the sharedmp manager daemon at {path} belongs to another user; "
                               f"unset ${ENV} to start one of this user's own") from None
        except socket.timeout:
            raise ManagerError(f"the sharedmp manager daemon at {path} did not answer within "
                               f"{HELLO_TIMEOUT:.0f} s (is the machine overloaded?)") from None
        if reply.startswith(b"FULL "):
            raise ManagerError(f"the sharedmp manager daemon at {path} cannot take this process: "
                               f"{reply[5:].decode(errors='replace').strip()}")
        if reply.startswith(b"NO "):
            raise ManagerError(f"the sharedmp manager daemon at {path} refused this process: "
                               f"{reply[3:].decode(errors='replace').strip()}; unset ${ENV} to "
                               "start one of this user's own")
        if not reply.startswith(b"OK "):
            if not os.path.exists(path):
                raise _Gone()
            raise ManagerError(f"the sharedmp manager daemon at {path} answered {reply[:60]!r}: "
                               "not a sharedmp manager of this version")
        s.settimeout(None)
        return s, int(reply[3:])
    except BaseException:
        s.close()
        raise


def _start():
    """Start a daemon of our own; the (connection, pid, path)."""
    global _started_by
    import subprocess
    import tempfile
    directory = tempfile.mkdtemp(prefix="sharedmp-", dir=settings.runtime_dir())     # mode 0700
    path = os.path.join(directory, "manager.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
        listener.listen(128)
        # The daemon inherits the bound socket, so we can connect before it even runs. The
        # process started here forks the daemon and exits (daemon.py): the daemon is not our
        # child, so no Popen is left to wait for (or to warn, ResourceWarning, at our exit).
        starter = subprocess.Popen(
            [sys.executable, "-I", "-S", _SCRIPT, path, str(listener.fileno()),
             os.path.abspath(settings.get(settings.SHM_DIR))],
            pass_fds=(listener.fileno(),), start_new_session=True,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    except BaseException:
        for p, rm in ((path, os.unlink), (directory, os.rmdir)):
            try:
                rm(p)
            except OSError:
                pass
        raise
    finally:
        listener.close()
    try:
        s, pid = _hello(path)
    finally:
        try:
            starter.wait(HELLO_TIMEOUT)    # (it exits as the daemon starts: at once)
        except subprocess.TimeoutExpired:
            starter.kill()
            starter.wait()
    _started_by = os.getpid()
    return s, pid, path


_started_by = 0                          # the pid that started the daemon we talk to, if ours


def _connect():
    global _sock, _daemon, _generation, _closing_at_exit
    if _dead is not None:
        raise ManagerError(_dead)
    path = settings.get(ENV)
    s = None
    if path:
        try:
            s, pid = _hello(path)
        except _Gone:
            pass
    if s is None:
        s, pid, path = _start()
        settings.export(ENV, path)       # children started from now on use this daemon
    _sock, _daemon = s, (pid, path)
    _generation += 1
    if _closing_at_exit != os.getpid():
        _closing_at_exit = os.getpid()
        # last of multiprocessing's exit finalizers (Queue's join: -5): after the children
        # are joined and every other finalizer has posted its records
        util.Finalize(None, _close_at_exit, exitpriority=-1000)


_closing_at_exit = 0                     # the pid that registered _close_at_exit


def _close_at_exit():
    """(this process is exiting: multiprocessing's exit handler, last) Close the connection,
    as the process's exit would a moment later: the daemon lets go of what this process held.
    Left open, the interpreter's teardown warns of an unclosed socket (ResourceWarning).
    What is posted after (finalizers of the teardown) is not sent: the daemon counts nothing
    of this process any more; a named segment made after this raises ManagerError."""
    me = threading.current_thread()
    if any(t is not me and not t.daemon and t.is_alive() for t in threading.enumerate()):
        # A child of multiprocessing before 3.13 runs this before its non-daemon threads are
        # joined (BaseProcess._bootstrap): close at its interpreter's exit instead, after them
        # (a spawned child's; a forked one ends with os._exit, no teardown to warn).
        atexit.register(_close)
        return
    _close()


def _close():
    if not _lock.acquire(timeout=1.0):   # (a thread stuck sending: leave it to the exit)
        return
    try:
        if _sock is None:
            return
        try:
            _send_pending()
        except OSError:
            pass
        if os.getpid() == 1 and _started_by == 1:
            _end_namespace()
        _hang_up("this process is exiting (multiprocessing's exit handlers have run): its "
                 "connection to the sharedmp manager daemon is closed, so no named segment can "
                 "be made now; make it before, or use the 'file_descriptor' strategy")
    finally:
        _lock.release()


def _end_namespace():
    """(pid 1 of a PID namespace, exiting: the kernel kills the namespace's every process
    then, its daemon too) Have the daemon unlink everything now and wait for it (``E``)."""
    try:
        _ask(_daemon[1], b"E -\n", "the end")  # type: ignore[index]
    except (ManagerError, OSError):
        pass


def ensure() -> None:
    """Connect to this program's daemon (starting one if needed); ManagerError if it is gone."""
    if _sock is None:
        with _lock:
            if _sock is None:
                _connect()


def _lost(e):
    """(lock held) The daemon hung up: say so on every later use."""
    pid, path = _daemon
    _hang_up(f"the sharedmp manager daemon (pid {pid}, {path}) went away ({e.strerror or e}), "
             "so named segments can no longer be tracked. Restart the program, run `python -m "
             "sharedmp doctor --clean` to remove the segments it left, or use the "
             "'file_descriptor' strategy.")


def _hang_up(why):
    """(lock held) Close the connection, unsent records dropped; every later use says ``why``
    (the first reason given)."""
    global _sock, _dead
    _dead = _dead or why
    if _sock is not None:
        _sock.close()
        _sock = None
    _pending.clear()


def _post(op, path, wait=True, fd=-1):
    """Queue a record (with ``fd`` passed along, if any) and send what is queued;
    ManagerError (unless ``wait`` is False) if the daemon has gone. With ``wait``, the
    record is in the kernel on return (``fd`` may be closed)."""
    _pending.append((op + b" " + (path if type(path) is bytes else os.fsencode(path)) + b"\n", fd))
    _flush(wait)


def _post_all(records: "list[tuple[bytes, str | bytes]]") -> None:
    """``_post`` of several records (op, path) at once: one send."""
    for op, path in records:
        _pending.append((op + b" " + (path if type(path) is bytes else os.fsencode(path)) + b"\n",
                         -1))
    _flush(True)


def _flush(wait):
    """Send what is queued (see ``_post``)."""
    while _pending:
        if not _lock.acquire(wait):
            return                       # the holder sends it before it lets go
        try:
            _send_pending()
        except OSError as e:
            _lost(e)
        finally:
            _lock.release()
    if wait:
        with _lock:                      # another thread may still be sending our record
            pass
        if _dead is not None:
            raise ManagerError(_dead)


def _send_pending():
    """(lock held) Send every queued record, the fds passed along with theirs."""
    while _pending:
        batch, passed = [], []
        while _pending and len(passed) < _MAX_FDS:
            record, fd = _pending.popleft()
            batch.append(record)
            if fd >= 0:
                passed.append(fd)
        if _sock is None:
            continue
        data = b"".join(batch)
        if passed:      # (stream socket: the fds arrive with the first byte of ``data``)
            n = _sock.sendmsg([data],
                              [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", passed))],
                              _NOSIGNAL)
            data = data[n:]
        if data:
            _sock.sendall(data, _NOSIGNAL)


def created(path: str) -> None:
    ensure()
    _post(b"C", path)


def forget(path: str) -> None:
    _post(b"F", path)


def sent(path: str) -> None:
    ensure()
    _post(b"S", path)


def received(path: str) -> None:
    ensure()
    _post(b"R", path)


def holds(path: str, token: int = -1) -> None:
    """This process maps ``path`` now; ``token``: the token fd of the message that named it
    (its reference in flight ends here, if it was that message's alone: see daemon.py)."""
    ensure()
    if token >= 0:
        try:
            st = os.fstat(token)
        except OSError:
            pass
        else:
            if stat.S_ISFIFO(st.st_mode):
                _post(b"H", os.fsencode(path) + b"\0%d" % st.st_ino)
                return
    _post(b"H", path)


def dropped(path: str) -> None:
    """From a finalizer: never blocks on the lock, never raises."""
    if _sock is not None:
        _post(b"D", path, wait=False)


def parked(path: str, nxt: str) -> bool:
    """The creator keeps ``path`` for reuse under the name ``nxt`` (held from now on): the
    daemon moves it to ``pool_path(nxt)`` once no one else holds it. From a finalizer: never
    blocks on the lock, never raises; whether the record could be sent."""
    if _sock is None or _dead is not None:
        return False
    _post(b"P", os.fsencode(path) + b"\0" + os.fsencode(nxt), wait=False)
    return _dead is None


def generation() -> int:
    """Counts the connections this process made to a daemon (pooled names belong to one)."""
    return _generation


def pool_path(path: str) -> str:
    """Where the daemon puts the segment to be reused as ``path`` (see ``parked``)."""
    directory, _, name = path.rpartition("/")
    return f"{directory}/{POOL_DIR % _daemon[0]}/{name}"  # type: ignore[index]


_checked = 0.0                  # monotonic time of the last ``check``
CHECK_EVERY = 0.05


def check() -> None:
    """ManagerError if the daemon has gone (it never writes to a client after the hello: a
    readable connection is one it closed). One poll (at most every ``CHECK_EVERY`` s), no
    record: before a segment is reused without telling the daemon."""
    global _checked
    now = time.monotonic()
    if now - _checked < CHECK_EVERY and _dead is None and _sock is not None:
        return
    _checked = now
    if _dead is None and _sock is not None:
        try:
            gone = bool(select.select([_sock], [], [], 0)[0])
        except (OSError, ValueError):
            gone = True
        if gone:
            with _lock:
                if _sock is not None:
                    _lost(ConnectionResetError(errno.ECONNRESET, "connection reset by the daemon"))
    if _dead is not None:
        raise ManagerError(_dead)
    if _sock is None:
        ensure()


# A channel end keeps its token for ROTATE seconds of sends (then the next message opens a
# new one), and at most MAX_OPEN of its tokens open at once (past that it keeps the current
# one longer): so the daemon holds at most MAX_OPEN + 1 pipes per channel end and sending
# process, however many messages are in flight.
ROTATE = 0.05
MAX_OPEN = 8


class _Token:
    """The write end of a token pipe: open while the channel end may reuse it for a next
    message, or while a message that carries it waits to be sent (``Fds.keep``).

    Closed as every owned fd is (``fds.own``: a finalizer, in this process only)."""

    __slots__ = ("fd", "id", "generation", "opened", "used", "paths", "held", "__weakref__")

    def __init__(self, fd, ident, now):
        self.fd, self.id, self.generation = fd, ident, _generation
        self.opened = self.used = now
        self.paths = set()              # the names the daemon knows it holds in flight
        self.held = set()               # those named by more than one message (``u``)
        fds.own(self, (fd,))


_token_ids = itertools.count(1)


class Tokens:
    """The token of one channel end in this process, shared by the messages it sends.

    Each message of named segments carries a copy of the current token's write end; the
    daemon holds the read end, with one reference in flight for each name the token has
    carried. The pipe ends, and those references with it, once this end has let go of
    the token (``ROTATE`` s after it opened, when unused for the cache's idle time, at
    ``mp.empty_cache()``, or with the channel) and every message that carries it has
    been received or can no longer be. This end keeps a read end of each of its tokens
    too, to count those still open (``MAX_OPEN``)."""

    __slots__ = ("_current", "_open", "_lock", "__weakref__")

    def __init__(self) -> None:
        self._current: "_Token | None" = None
        self._open: list[int] = []       # read ends of this end's tokens not yet ended
        self._lock = threading.Lock()
        fds.own(self, self._open)
        _all_tokens.add(self)

    def carry(self, paths: list[str]) -> "tuple[int, object]":
        """Count one reference in flight for each of ``paths`` (once per token): the fd the
        message carries, and the object that keeps it open until the message is sent."""
        ensure()
        with self._lock:
            now = time.monotonic()
            token = self._current
            if token is None or token.generation != _generation or (
                    now - token.opened > ROTATE and self._room()):
                token = self._current = self._new(now)
            new = [p for p in paths if p not in token.paths]
            if new:
                token.paths.update(new)
                # (``t``: a token the daemon has, or has seen end; see daemon.py)
                _post(b"t", b"%d " % token.id + b"\0".join(map(os.fsencode, new)))
            if len(new) < len(paths):
                # Named by a message before: no receiver's ``H`` may end the reference now
                # (it would be the other message's). Once per token and name.
                again = [p for p in paths if p not in token.held and p not in new]
                if again:
                    token.held.update(again)
                    _holding.add(self)
                    _post(b"u", b"%d " % token.id + b"\0".join(map(os.fsencode, again)))
            token.used = now
            return token.fd, token

    def _room(self):
        """(lock held) Whether another token may open: fewer than MAX_OPEN still open."""
        if len(self._open) < MAX_OPEN:
            return True
        self._reap()
        return len(self._open) < MAX_OPEN

    def _reap(self):
        """(lock held) Close the read ends of the tokens that have ended."""
        for r in fds.ended(self._open):
            self._open.remove(r)
            os.close(r)

    def _new(self, now):
        """(lock held) A new token, its read end passed to the daemon (with no reference)."""
        r, w = fds.pipe()
        try:
            token = _Token(w, next(_token_ids), now)
        except BaseException:
            os.close(r)
            os.close(w)
            raise
        try:
            _post(b"T", b"%d " % token.id, fd=r)
        except BaseException:
            os.close(r)
            raise
        self._open.append(r)
        cache.start()                   # lets it go once unused (``expire``)
        return token

    def expire(self, cutoff):
        """Let go of the current token if unused since ``cutoff`` (None: now), and of the
        read ends of tokens that have ended; whether something is kept. While MAX_OPEN are
        open the current one is kept: the next message would open another."""
        with self._lock:
            self._reap()
            token = self._current
            if token is not None and (cutoff is None or token.used < cutoff
                                      and len(self._open) < MAX_OPEN):
                self._current = None
            return self._current is not None or bool(self._open)

    def let_go(self, path: str) -> None:
        """Let go of the current token if more than one of its messages named ``path`` (a
        segment its creator parks: then free once those messages are taken, not only once
        the token would rotate). Never blocks: called from finalizers."""
        token = self._current
        if token is not None and path in token.held and self._lock.acquire(False):
            try:
                if self._current is token:
                    self._current = None
            finally:
                self._lock.release()

    def _after_fork(self):
        """(in a forked child) The parent's token is the parent's: close the copies."""
        _holding.discard(self)
        self._lock = threading.Lock()
        if self._current is not None:
            os.close(self._current.fd)
            self._current = None
        for r in self._open:
            os.close(r)
        self._open.clear()


_all_tokens: "weakref.WeakSet[Tokens]" = weakref.WeakSet()


# The Tokens whose tokens hold some name to their end (``u``): those ``let_go`` looks at
_holding: "weakref.WeakSet[Tokens]" = weakref.WeakSet()


def let_go(path: str) -> None:
    """A segment this process made is parked: let go of the tokens that hold it to their end
    (see ``Tokens.let_go``)."""
    if _holding:
        for tokens in list(_holding):
            tokens.let_go(path)


def _expire_tokens(cutoff):
    kept = False
    for tokens in list(_all_tokens):
        kept = tokens.expire(cutoff) or kept
    return kept


@forks.in_child
def _tokens_after_fork():
    for tokens in list(_all_tokens):
        tokens._after_fork()


def _held_tokens():
    """(bytes, fds) of the tokens this process keeps: the write ends kept for reuse (the
    names they hold in flight are counted where they are mapped) and the read ends."""
    tokens = list(_all_tokens)
    return 0, sum((t._current is not None) + len(t._open) for t in tokens)


cache.register(0, "tokens", _expire_tokens, _held_tokens)


def address() -> str:
    """The socket path of this program's daemon, started if needed (for children to inherit)."""
    ensure()
    return _daemon[1]  # type: ignore[index]  # (ensure() set it or raised)


def adopt(path: str | None) -> None:
    """(in a child) Use the daemon at ``path`` unless this process already talks to one."""
    if _sock is None and path:
        settings.export(ENV, path)


def daemon_pid():
    """The pid of the daemon this process talks to, or None."""
    return _daemon[0] if _daemon is not None and _sock is not None else None


def _ask(path, record, what):
    """Write ``record`` to the daemon at ``path`` on a connection of its own; its answer line."""
    s, _ = _hello(path)
    try:
        s.settimeout(HELLO_TIMEOUT)
        s.sendall(record)
        reply = b""
        while not reply.endswith(b"\n"):
            try:
                chunk = s.recv(4096)
            except socket.timeout:
                raise ManagerError(f"the sharedmp manager daemon at {path} did not answer {what} "
                                   f"within {HELLO_TIMEOUT:.0f} s (is the machine overloaded?)"
                                   ) from None
            if not chunk:
                raise ManagerError(f"the sharedmp manager daemon at {path} hung up")
            reply += chunk
    finally:
        s.close()
    return reply


def stats(path=None):
    """{"clients", "segments", "in_flight", "tokens", "pooled"} of the daemon at ``path``
    (default: ours), on a connection of its own; the segments are those the daemon has not
    unlinked yet (pooled: names held for reuse, see ``parked``)."""
    path = path or address()
    reply = _ask(path, b"? -\n", "stats")
    clients, segments, in_flight, tokens, *pooled = (int(x) for x in reply.split()[1:6])
    return {"clients": clients - 1, "segments": segments, "in_flight": in_flight, "tokens": tokens,
            "pooled": pooled[0] if pooled else 0}


def sync() -> None:
    """Return once the daemon has acted on every record this process sent: what no process
    holds any more is unlinked, what is free is pooled (``W``). For ``mp.empty_cache()`` and
    before a retry for memory; a no-op for a process that is not a client."""
    if _sock is None or _dead is not None:
        return
    with _lock:                          # our records first (a finalizer may have queued some)
        try:
            _send_pending()
        except OSError as e:
            _lost(e)
    if _dead is None:
        _ask(_daemon[1], b"W -\n", "a wait")  # type: ignore[index]  # (a client: it is set)


cache.on_empty(sync)


def find_daemons():
    """[(socket path, alive)] of this user's daemons in the runtime directory (for doctor).

    A socket nobody listens on is a daemon that was killed: its directory is stale.
    """
    out = []
    base = settings.runtime_dir()
    try:
        names = [n for n in os.listdir(base) if n.startswith("sharedmp-")]
    except OSError:
        return out
    for name in sorted(names):
        path = os.path.join(base, name, "manager.sock")
        try:
            if os.stat(os.path.dirname(path)).st_uid != os.getuid() or not os.path.exists(path):
                continue
        except OSError:
            continue
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(2)
            s.connect(path)
            alive = True
        except ConnectionRefusedError:
            alive = False
        except OSError:
            continue
        finally:
            s.close()
        out.append((path, alive))
    return out


def remove_stale(path):
    """Remove the socket and directory of a daemon that was killed."""
    for p, rm in ((path, os.unlink), (os.path.dirname(path), os.rmdir)):
        try:
            rm(p)
        except FileNotFoundError:
            pass


# Fork. A forked child maps what its parent mapped, so it holds those names too; it can say
# so only on a connection of its own, made after the fork, while the parent goes on at once:
# the parent's next records (``P``, ``D``) could reach the daemon first, and a segment the
# child still maps be pooled and reused by the parent. So the parent holds them for the
# child across the fork, in one record whatever it maps: just before the fork, with every
# thread's registration of a segment shut out until the fork returns (``named.py``), a
# token (``K``) holds every name this client holds; the child inherits its write end,
# connects, and adopts what it holds (``A``: the daemon ends the token then), less what it
# does not map (``D``: the parent's pool, and names another thread was still making). The
# child keeps its copy of the write end, so the token ends without ``A`` only if the child
# dies. See daemon.py, "Fork".
_fork_token: "fds.Fd | None" = None    # the write end of the token of the fork under way
_fork_parent = 0                        # the pid that made it (a child's parent, in ``A``)
_adopted: "fds.Fd | None" = None        # (in a forked child) its fork's token, kept
_unheld: "list[str]" = []               # (in a forked child) names it holds but does not map


def before_fork() -> None:
    """(parent, just before a fork, no registration possible until it returns) Hold what this
    process holds for the child until the child holds it itself. Never raises: a fork must not
    fail for this (without a daemon there is nothing to hold)."""
    global _fork_token, _fork_parent
    if _sock is None or _dead is not None:
        return
    try:
        r, w = map(fds.Fd, fds.pipe())
    except OSError:
        return
    try:
        _post(b"K", b"%d" % next(_token_ids), fd=r.fd)
    except (ManagerError, OSError):
        w.close()
        return
    finally:
        r.close()                        # (in the kernel now: _post waited)
    _fork_token, _fork_parent = w, os.getpid()


@forks.in_parent
def _after_fork_in_parent() -> None:
    global _fork_token
    if _fork_token is not None:
        _fork_token.close()              # the child's copy holds the names now
        _fork_token = None


_inherited = False                      # (in a forked child) the parent was a client


@forks.in_child
def _detach_in_child() -> None:
    """(first of the fork hooks) The inherited socket is the parent's identity: a record the
    child sent on it would be the parent's. Close the child's copy before anything can post."""
    global _lock, _pending, _sock, _inherited, _adopted, _unheld
    _lock = threading.Lock()
    _pending = collections.deque()       # the parent's records: the parent sends them
    _inherited = _sock is not None
    if _sock is not None:
        _sock.close()
        _sock = None
    if _adopted is not None:             # the token of the fork that made the parent
        _adopted.close_inherited()
        _adopted = None
    _unheld = []


def unheld_in_child(paths: "list[str]") -> None:
    """(a forked child's hook) Names the parent holds that this child does not map."""
    _unheld.extend(paths)


def after_fork_in_child(unheld: "list[str]", mapped: "list[str]") -> None:
    """(called by segment's fork hook, last) Connect and hold what the fork's token holds (the
    parent held it for the child until now), less ``unheld`` and what ``unheld_in_child`` was
    told. Without a token (the parent could not make one): hold ``mapped`` name by name."""
    global _dead, _fork_token, _adopted
    # (the parent's object: its finalizer closes nothing here, so this process owns it anew)
    w = fds.Fd(_fork_token.take()) if _fork_token is not None else None
    _fork_token = None
    try:
        if _inherited:
            ensure()
            if w is not None:
                _post_all([(b"A", b"%d %d" % (os.fstat(w.fd).st_ino, _fork_parent))]
                          + [(b"D", path) for path in {*unheld, *_unheld}])
            else:
                _post_all([(b"H", path) for path in mapped])
    except (ManagerError, OSError) as e:
        _dead = _dead or str(e)
    finally:
        _unheld.clear()
        _adopted = w                     # kept: the token ends when the daemon applies ``A``

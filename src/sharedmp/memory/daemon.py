"""The file_system strategy's manager daemon: unlinks each named segment when its last user
lets go. This docstring is the one description of its protocol (the README,
``docs/reference.md`` and ``manager.py``, the client, point here).

Run as a script by ``manager.py`` (``python -I -S daemon.py SOCKET_PATH LISTEN_FD SHM_DIR``)
in its own session, so that Ctrl-C or a killed process group does not take it down with its
clients.
It uses the standard library only, to start in milliseconds.

Where. The first process of a program that needs a daemon makes a private directory
(``tempfile.mkdtemp(prefix="sharedmp-")``, mode 0700) under ``$XDG_RUNTIME_DIR`` if that is
set and writable, else under Python's temporary directory (``tempfile.gettempdir()``:
``$TMPDIR``, else ``/tmp``, ...), binds ``manager.sock`` there, listens, and starts this
script with the listening fd, so that it can connect before the daemon even runs. It sets
``$SHAREDMP_MANAGER`` to the socket's path: its children, which inherit it, use the same
daemon. A socket path that is gone means a daemon that exited cleanly (a client starts a new
one); a socket nobody listens on, one that was killed (``ManagerError``).

Handshake. A client connects and reads ``OK <daemon pid>\\n`` -- or ``NO <reason>\\n`` and the
end, if its uid is not the daemon's (``SO_PEERCRED``), or ``FULL <reason>\\n`` and the end, if
the daemon is out of fds (below). That is the only wait. It answers ``HELLO <pid>\\n`` (a
first line that is not one: the daemon hangs up), then writes records, never waiting for an
answer, one line each, ``<op> <argument>``. A path is absolute and its name is a segment's
(``sharedmp_`` and 20 hex digits): a record naming anything else is ignored, so the daemon
never touches a file that is not a sharedmp segment. Several values in one argument are
separated by NUL. Unknown ops are ignored; a line longer than ``MAX_LINE`` ends the
connection. Fds come with the bytes of a record (SCM_RIGHTS, at most 253 in one
``recvmsg``; the client sends at most 250 in one ``sendmsg``) and are queued for the ``T``
records that follow, in order. The client's functions that write each record are named in
parentheses.

    C  <path>  created (``manager.created``): this client holds the segment. Sent before
       the file is made (``O_EXCL``), so that a creator killed at any point leaves nothing.
    H  <path>  holds (``manager.holds``): this client maps the segment now: a receiver on
       a sharedmp channel whose message's token is not known (or a fork child for what it
       inherited, where its parent could not make a fork token: see Fork).
       ``H <path>\\0<inode>``: a receiver on a sharedmp channel, from a message that carried
       the token whose pipe has this inode (``fstat`` of the token fd it received). If that
       message's reference is the token's only one for the path and not held (see ``t``,
       ``u``), it ends here. An ``H`` read before the ``t`` it ends is remembered for this
       read of every client and the next (the ``t`` was written before the ``H``, so that
       read finds it).
    S  <path>  sent (``manager.sent``): one more reference in flight, for a message on any
       other channel (a standard library queue or pipe, spawn arguments). While it is in
       flight the daemon keeps an fd of the file open, within a budget of a quarter of its fd
       limit, so that ``doctor --clean`` sees it in use.
    R  <path>  received (``manager.received``): this client holds it, and one reference in
       flight is consumed (the receiver of an ``S``).
    D  <path>  dropped (``manager.dropped``): this client no longer maps it.
    F  <path>  forget (``manager.forget``): this client does not hold it after all (the name
       was taken by another file, or nothing was made); if no one else holds it and nothing
       is in flight, the daemon forgets it without unlinking.
    P  <path>\\0<next>  parked (``manager.parked``, see ``recycle.py``): the client made the
       segment and keeps it for reuse (its own views of it are gone); ``next`` (a fresh name
       in the same directory) is the name it will have when reused, held by the client from
       now on. Only a holder parks, and ``next`` must be unknown or a name this client alone
       holds for reuse. Once no other client holds the segment and no reference to it is in
       flight (the rule of two passes below), the daemon renames it to ``next``'s name in
       the pool directory, ``<dir>/.sharedmp-pool-<daemon pid>/`` (0700, made on first use,
       same filesystem): it leaves the directory's listing, and the client, which reuses it
       by renaming it back to ``next`` (a rename that fails: not free yet), needs no answer.
       A later ``C``/``H``/``R`` of the parker (it maps it again) or its ``D``/``F`` cancels
       the park.
    T  <id> [<path>\\0<path>...]  a new token ``id`` of the client (``Tokens``, below),
       passed with the record (the read end of a pipe whose write end travels in the
       messages), and one more reference in flight for each path, held by it (the client
       sends it with no path: its paths come in ``t``). When every copy of the write end is
       closed, the pipe ends and the token's references with it. A ``T`` whose fd did not
       arrive makes a token that never ends: its references stay until the daemon exits.
    t  <id> <path>\\0<path>...  the same for a token already passed. The pipe and the socket
       are read in no set order, so this may be read after the token's end: its messages
       are gone by then (a receiver says ``H`` before it closes its copy), and the record is
       ignored. A client says ``t`` once per token and path: the reference is that of the
       first message naming the path, and the receiver's ``H`` with the token's inode ends it
       at once (a fresh segment per message is free as soon as it is received and let go,
       not only once its token ends).
    u  <id> <path>\\0...  a second message on the token names these paths: their references
       are held until the token's end (``H`` no longer ends them), counted again if one ended
       already. Said before that message is sent, so before any ``H`` it causes: whatever
       made a segment look free is undone by the confirming read. Once per token and path.
    K  <id>  a fork's token (``manager.before_fork``), passed with the record as ``T``'s
       is: one more reference in flight, held by it, for every path this client holds.
    A  <inode> <pid>  adopt (``manager.after_fork_in_child``): this client, forked by the
       client of pid ``pid``, holds every path that the fork token of this pipe inode holds,
       and the token ends. If that token is not known yet, the parent's connection is read
       first, out of turn (its ``K`` was written before the child existed).
    W  <anything>  wait (``manager.sync``): answer ``DONE\n`` once every record read so far
       has been acted on (after this pass and the next: see Ordering), so that what no one
       holds any more is unlinked (or pooled) by then. Asked on a connection of its own,
       after the client's own records are in the kernel: any read that finds the ``W`` finds
       them too (they were written first), whichever client it reads first.
    E  <anything>  end (``manager._close``, at the exit of a program that is pid 1 of its PID
       namespace and started this daemon: the kernel kills every process of the namespace,
       the daemon too, once it exits). Every client is read once more (what was written
       before the ``E`` is read then), the daemon ends as at a clean exit (below: its socket,
       every segment it knows, its pool directories and ledgers), answers ``DONE\n`` and
       exits.
    ?  <anything>  answer one line ``STATS <clients> <segments> <in flight> <tokens>
       <pooled>`` (``manager.stats``, ``doctor``; the asking connection is one of the
       clients; tokens: the open ones, and the ids clients may still use; pooled: names held
       for reuse, ``P``).

Tokens, the client's side (``manager.Tokens``, one per channel end in each sending
process). A message of a sharedmp channel that names segments carries, as its last fd, a
copy of the write end of its channel end's current token, and the client tells the daemon
the names (``t``, ``u``) before the message is sent. A token serves the messages of
``ROTATE`` (0.05) s, then the next message opens a new one (``T``); at most ``MAX_OPEN`` (8)
of a channel end's tokens are open at once (the client keeps a read end of each to know),
and past that it keeps its current one longer. The client lets go of its current token once
unused for ``$SHAREDMP_CACHE_IDLE`` s (a pass of cache.py's: so also once the channel is closed),
at ``mp.empty_cache()``, when the channel end is collected, when a segment its messages
named more than once is parked (``u``: so that it is free once they are taken), and with its
connection to the daemon (a token belongs to one). The kernel closes every copy of the write
end once the channel end has let go and each message that carries it was read (the receiver
said ``H`` first), destroyed unread with its channel, or never sent (its sender killed). So
the daemon's fds do not grow with the messages in flight: a socket per client and at most
``MAX_OPEN`` + 1 pipes per channel end and sending process (``tests/test_manager.py`` puts
20,300 messages without reading them; before tokens were shared, 1,964 pipes were open). A
receiver of a message without a token (other channels) says ``R``; one that never comes
keeps its ``S`` in flight until the daemon exits.

A segment is unlinked when no client holds it and no reference is in flight (a pooled one
under both its names). A client that disconnects (exit, SIGKILL) drops what it held: its
parked and pooled segments too. In-flight references belong to no client: a sender may exit
as soon as its message is in the kernel.

Ordering. Records of one client are applied in order. Records of different clients are
not ordered by the kernel, and a receiver's ``R``/``D`` may be read before the sender's
``C``/``S`` that preceded them in time: in-flight counts may go negative for a moment, and
a segment whose count reaches zero is unlinked (or, parked, moved to the pool) only if it
is still zero after one more read of every client (anything written before the zero was
read is read by then). That read is made at once, in the same pass.

Fork. A forked child maps what its parent mapped at the fork, but can say so only on a
connection of its own, made after the fork, while the parent goes on at once: the parent's
``P`` of a segment the child still maps could be read first, and the segment be pooled and
handed out again under the child. So the parent holds them for the child across the fork
(``manager.before_fork``, a ``before`` fork hook of ``named.py``, for sharedmp's contexts,
``os.fork()`` and anything else that forks through Python): just before the fork it sends a
token (``K <id>``: one record, whatever it holds) that holds every path it holds, and keeps
the write end until the fork returns. From its hold until then no thread of the process
registers a segment, and a segment is registered only once its ``C``, ``R`` or ``H`` was
sent: whatever the child inherits mapped, its parent held when the ``K`` was written. The
child inherits a copy of the write end, connects, and says ``A`` (the token's paths are its
own now, the token ends), then ``D`` for the paths it holds so but does not map (its
parent's pool, and names that another thread of the parent was making or attaching: the
child has not that thread). It keeps its copy of the write end: the token ends without
``A`` only if the child dies (or closes it), never before the ``A`` is applied. So no
segment mapped at a fork is ever unused, parked-free or pooled while a child of that fork
may still map it, and a fork costs one record each side, not one per segment.

Lifetime. The daemon raises its soft ``RLIMIT_NOFILE`` to the hard limit as it starts. It
waits ``STARTUP`` s for its first client. Once every client has gone, if references are
still in flight, it waits for a new client (a receiver about to connect) for ``LINGER`` s and
for as long as a process group of its clients has a member: the parent that started them
may be the receiver, a client only once it receives (a standard library channel's message
names its daemon: ``reductions/segment.py``). Then it removes its socket first (a client
that finds no socket starts a fresh daemon), unlinks whatever is left, removes its pool
directories and exits.

Ledgers. What a daemon killed (SIGKILL, the OOM killer, the end of its container's PID
namespace) leaves must be found by the next one even where pids repeat (a new container's
daemon may have the dead one's pid) and where the runtime directory is gone (a container's
/tmp) while the segments' directory is not (an emptyDir of medium Memory, ``--ipc=host``).
So in each directory it tracks segments in (the client's shm directory, ``SHM_DIR``, from
the start) the daemon keeps a ledger, ``.sharedmp-ledger-<16 random hex digits>`` (0600),
locked (``flock``) from before it has that name for as long as the daemon lives: the kernel
lets go of the lock whatever ends the daemon. It names the daemon's socket and pool
directory, then the segments it has tracked there, one name a line, those new in a pass
appended in one write at its end (rewritten under a new inode, locked first, once it has
grown past twice the segments tracked). A clean exit removes it. A ledger of this user that
nobody has locked is a dead daemon's: a daemon sweeps the directory as it starts (and each
directory it meets later, once): for each dead ledger, the segments it names (and the pooled
ones) that no process maps or holds open (``/proc``, as ``doctor --clean``: a daemon killed
alone leaves its clients' segments to them) are unlinked, and once none is left, the ledger,
the dead daemon's socket and its directory, and its pool directory. ``doctor`` lists dead
ledgers, ``doctor --clean`` sweeps. A segment made in the last pass before the daemon died
may be in no ledger: ``doctor --clean`` finds it (no process uses it).

How it fails:
- A client SIGKILLed mid-message: on a sharedmp channel the kernel closes its copy of the
  token; the message never left, so the token ends (or ends with the messages sent).
  On other channels its ``S`` stays in flight until the daemon exits (every client
  gone); a message never received likewise.
- The daemon SIGKILLed: clients see the connection end and raise ``ManagerError`` on
  their next file_system allocation, send or attach; the segments stay until the next
  daemon that starts with the same shm directory, or ``python -m sharedmp doctor --clean``,
  removes those no live process maps or holds open (see Ledgers). While it lives, the
  daemon holds an fd of each segment with references in flight (within a quarter of its fd
  limit), so doctor does not remove one that a message still carries.
- Out of fds (EMFILE, ENFILE): a client it still cannot take after one more pass (which
  drops the clients that have gone) it answers ``FULL <why>`` on a spare fd kept for that
  (the client raises ``ManagerError`` naming the limit and ``ulimit -n``), and serves the
  others.
"""
import array
import collections
import errno
import fcntl
import os
import re
import resource
import selectors
import socket
import stat
import struct
import sys
import time

NAME_RE = re.compile(r"sharedmp_[0-9a-f]{20}\Z")
LINGER = 1.5           # seconds to wait for a receiver of in-flight messages once all clients left
GROUP_POLL = 0.5       # (lingering) seconds between looks at the program's process groups
STARTUP = 2.0          # seconds to wait for the first client
PASS_DELAY = 0.002     # sleep between passes: clients' records batch up instead of waking us each
MAX_LINE = 1 << 20     # a T record names every segment of a message
MAX_FDS = 253
POOL_DIR = ".sharedmp-pool-%d"   # (manager.py keeps a copy: the pool directory, by daemon pid)
POOL_RE = re.compile(r"\.sharedmp-pool-\d+\Z")
LEDGER = ".sharedmp-ledger-%s"   # (see Ledgers)
LEDGER_RE = re.compile(r"\.sharedmp-ledger-[0-9a-f]{16}\Z")
COMPACT = 4096         # lines a ledger may have past twice the segments tracked, before a rewrite
_CMSG = socket.CMSG_SPACE(MAX_FDS * 4)


class Segment:
    __slots__ = ("holders", "inflight", "fd", "parked", "alias")

    def __init__(self):
        self.holders = set()
        self.inflight = 0
        self.fd = -1
        self.parked = None         # (client, next path): parked by its creator (``P``)
        self.alias = None          # the pool path of a name held for reuse (``P``'s next)

    def unused(self):
        return not self.holders and self.inflight <= 0

    def free(self):
        """Parked, and no one but the parker holds it nor is a reference in flight."""
        return (self.parked is not None and self.inflight <= 0 and len(self.holders) == 1
                and self.parked[0] in self.holders)

    def unpark(self, client):
        if self.parked is not None and self.parked[0] is client:
            self.parked = None


class Client:
    __slots__ = ("sock", "pid", "buf", "holds", "hello", "fds", "tokens", "gone")

    def __init__(self, sock):
        self.sock = sock
        self.pid = None                  # (bytes, from HELLO)
        self.gone = False                # hung up while read out of turn (``A``)
        self.buf = b""
        self.holds = set()
        self.hello = False
        self.fds = collections.deque()   # fds passed, for the T records that follow them
        self.tokens = {}                 # token id -> Token


class Token:
    __slots__ = ("fd", "paths", "client", "ident", "ino", "fork")

    def __init__(self, fd, client, ident):
        self.fd = fd
        self.fork = False                # a fork's hold (``K``): a child adopts it (``A``)
        # path -> its references in flight: [count, held]; not held, one reference is that
        # of one message, ended by the receiver's ``H`` (see ``t``)
        self.paths = {}
        self.client, self.ident = client, ident
        self.ino = None                  # its pipe's inode (what receivers name in ``H``)


class Ledger:
    """This daemon's ledger in one directory (see Ledgers): locked while the daemon lives."""

    def __init__(self, directory, header):
        self.path = os.path.join(directory, LEDGER % os.urandom(8).hex())
        self.header = header
        self.fd = _locked(self.path, header)
        self.lines = 0
        self.buf = b""                   # written when the directory has room again

    def add(self, names):
        """Name these segments (one write)."""
        self.buf += "".join(n + "\n" for n in names).encode()
        self.lines += len(names)
        try:
            while self.buf:
                self.buf = self.buf[os.write(self.fd, self.buf):]
        except OSError:
            pass

    def rewrite(self, names):
        """Name only these: a new file, locked, then renamed over this one."""
        try:
            fd = _locked(self.path, self.header + "".join(n + "\n" for n in names).encode())
        except OSError:
            return
        os.close(self.fd)
        self.fd, self.lines, self.buf = fd, len(names), b""

    def remove(self):
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)


def _locked(path, data):
    """An fd of a new file ``path`` holding ``data``, locked before it has that name."""
    tmp = path + "~"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        while data:
            data = data[os.write(fd, data):]
        os.rename(tmp, path)
        return fd
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class Daemon:
    def __init__(self, listener, path, shm_dir=None):
        self.listener = listener
        self.path = path
        self.uid = os.getuid()
        self.sel = selectors.DefaultSelector()
        self.sel.register(listener, selectors.EVENT_READ)
        self.clients = {}          # fd -> Client
        self.segments = {}         # path -> Segment
        self.candidates = set()    # paths found unused at the end of the previous pass
        self.free = set()          # parked paths found free at the end of the previous pass
        self.parked = set()        # paths parked (``P``), maybe no longer
        self.pool_dirs = set()     # pool directories made (removed at exit)
        self.tokens = {}           # read end fd -> Token
        self.by_ino = {}           # pipe inode -> Token (see ``H``)
        # (pipe inode, path) of the ``H`` read before the ``t`` it ends (clients are read in no
        # set order): this read of every client and the one before (the ``t`` was written
        # before the ``H``, so the next read finds it)
        self.early, self.early_before = set(), set()
        self.reading = set()       # clients being read now (``A`` reads a parent out of turn)
        self.passes = 0            # passes made (``one_pass``)
        self.waiters = []          # [(client, pass count to answer at)] (``W``)
        self.seen_client = False
        self.groups = set()        # process groups of the clients (``_linger``)
        self.started = time.monotonic()
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.fd_budget = max(0, limit // 4 - 16)   # fds of segments in flight (see ``S``)
        self.held_fds = 0
        self.spare = _spare()      # closed to answer a client when out of fds (``accept``)
        self.full_once = False     # accept found no fd once: refuse if so after the next pass
        self.ledgers = {}          # directory -> its Ledger (None: none could be made there)
        self.unrecorded = []       # paths of segments new in this pass (``_record``)
        self.to_sweep = []         # directories whose dead ledgers are swept after this pass
        self.ending = []           # clients that asked for the end (``E``)
        if shm_dir and os.path.isabs(shm_dir):
            self._ledger(shm_dir)

    # -- records ---------------------------------------------------------------------
    def _segment(self, path, create):
        seg = self.segments.get(path)
        if seg is None and create:
            seg = self.segments[path] = Segment()
            self.unrecorded.append(path)
        return seg

    def apply(self, client, op, path):
        if op in (b"T", b"t"):
            self._carry(client, path, op == b"T")
            return
        if op == b"K":
            self._fork_hold(client, path)
            return
        if op == b"A":
            self._adopt(client, path)
            return
        if op == b"P":
            self._park(client, *path.partition("\0")[::2])
            return
        if op == b"u":
            self._hold(client, path)
            return
        if not _ours(path.partition("\0")[0] if op == b"H" else path):
            return                                   # not a sharedmp segment: never touch it
        if op in (b"C", b"H"):
            path, _, ino = path.partition("\0")
            if not _ours(path):
                return
            seg = self._segment(path, True)
            seg.holders.add(client)
            seg.unpark(client)
            client.holds.add(path)
            if ino:
                self._received(path, ino)
        elif op == b"S":
            seg = self._segment(path, True)
            seg.inflight += 1
            # doctor --clean sees the file in use while in flight. Only within a budget of
            # fds: the daemon's fds must not grow with what is in flight (it keeps working
            # without them; a live daemon's segments are left alone by doctor's age rule).
            if seg.fd < 0 and self.held_fds < self.fd_budget:
                try:
                    seg.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
                    self.held_fds += 1
                except OSError:
                    pass
        elif op == b"R":
            seg = self._segment(path, True)
            seg.inflight -= 1
            seg.holders.add(client)
            seg.unpark(client)
            client.holds.add(path)
        elif op in (b"D", b"F"):
            seg = self._segment(path, False)
            client.holds.discard(path)
            if seg is not None:
                seg.holders.discard(client)
                seg.unpark(client)
                if op == b"F" and seg.unused():
                    self._forget(path)

    def _park(self, client, path, nxt):
        """``P``: the creator keeps ``path`` for reuse as ``nxt`` once no one else can see it."""
        if not (_ours(path) and _ours(nxt)) or path == nxt \
                or os.path.dirname(path) != os.path.dirname(nxt):
            return
        seg = self.segments.get(path)
        if seg is None or client not in seg.holders:
            return                                   # only a holder (its creator) parks
        target = self.segments.get(nxt)
        if target is None:
            target = self.segments[nxt] = Segment()
            self.unrecorded.append(nxt)
            target.alias = os.path.join(os.path.dirname(nxt), POOL_DIR % os.getpid(),
                                        os.path.basename(nxt))
            target.holders.add(client)
            client.holds.add(nxt)
        elif target.alias is None or target.holders != {client}:
            return                                   # a name in use: not a name to reuse
        seg.parked = (client, nxt)
        self.parked.add(path)

    def _token(self, client, ident, new):
        """The client's token ``ident``; a new one (``T``, ``K``: its pipe the next fd passed)
        if ``new``; None if it has ended."""
        token = client.tokens.get(ident)
        if token is None:
            if not new:
                return None                        # the token has ended: see ``t`` above
            if not client.fds:
                token = Token(-1, client, ident)   # its pipe did not arrive: in flight until exit
            else:
                token = Token(client.fds.popleft(), client, ident)
                os.set_blocking(token.fd, False)
                self.tokens[token.fd] = token
                self.sel.register(token.fd, selectors.EVENT_READ, token)
                try:
                    token.ino = os.fstat(token.fd).st_ino
                    self.by_ino[token.ino] = token
                except OSError:
                    pass
            client.tokens[ident] = token
        return token

    def _carry(self, client, rest, new):
        ident, _, paths = rest.partition(" ")
        token = self._token(client, ident, new)
        if token is None:
            return
        for path in paths.split("\0"):
            if _ours(path):
                if token.ino is not None and path not in token.paths and self._early(token, path):
                    continue                       # received already (its ``H`` came first)
                self.apply(client, b"S", path)
                refs = token.paths.get(path)
                if refs is None:
                    token.paths[path] = [1, False]
                else:                              # (two messages: held to the end)
                    refs[0] += 1
                    refs[1] = True

    def _hold(self, client, rest):
        """``u``: these paths' references on the token are held until its end."""
        ident, _, paths = rest.partition(" ")
        token = client.tokens.get(ident)
        if token is None:
            return                                 # ended: its messages are gone
        for path in paths.split("\0"):
            if _ours(path):
                refs = token.paths.get(path)
                if refs is None:
                    self.apply(client, b"S", path)
                    token.paths[path] = [1, True]
                else:
                    refs[1] = True

    def _fork_hold(self, client, ident):
        """``K``: a new token that holds every segment this client holds, for its child."""
        token = self._token(client, ident, True)
        token.fork = True
        for path in client.holds:
            seg = self.segments.get(path)
            if seg is not None and path not in token.paths:
                seg.inflight += 1
                token.paths[path] = [1, True]

    def _adopt(self, client, rest):
        """``A``: this client, a fork child, holds what its fork's token holds; the token ends."""
        ino, _, pid = rest.partition(" ")
        try:
            token = self.by_ino.get(int(ino))
        except ValueError:
            return
        if token is None:          # the parent's ``K`` not read yet (written before the fork)
            for parent in list(self.clients.values()):
                if parent.pid == os.fsencode(pid) and parent not in self.reading:
                    parent.gone = parent.gone or not self.read(parent)
            token = self.by_ino.get(int(ino))
        if token is None or not token.fork:
            return
        for path in token.paths:
            seg = self.segments.get(path)
            if seg is not None:
                seg.holders.add(client)
                client.holds.add(path)
        self._end(token)

    def _received(self, path, ino):
        """A message of the token of pipe inode ``ino`` naming ``path`` was received."""
        try:
            token = self.by_ino.get(int(ino))
        except ValueError:
            return
        refs = token.paths.get(path) if token is not None else None
        if refs is None:
            self.early.add((int(ino), path))
        elif refs == [1, False]:
            del token.paths[path]
            seg = self.segments.get(path)
            if seg is not None:
                seg.inflight -= 1

    def _early(self, token, path):
        """Whether a receiver's ``H`` of this token and path was read first (see ``early``)."""
        key = (token.ino, path)
        for early in (self.early, self.early_before):
            if key in early:
                early.discard(key)
                return True
        return False

    def end_token(self, token):
        """The token's pipe is readable: at its end, its references in flight end."""
        try:
            if os.read(token.fd, 4096):
                return                       # (no one writes into it: ignore, read on)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            pass
        self._end(token)

    def _end(self, token):
        """The token's references in flight end, and its pipe is closed."""
        self.sel.unregister(token.fd)
        del self.tokens[token.fd]
        if token.ino is not None and self.by_ino.get(token.ino) is token:
            del self.by_ino[token.ino]
        os.close(token.fd)
        if token.client.tokens.get(token.ident) is token:
            del token.client.tokens[token.ident]
        for path, (count, _) in token.paths.items():
            seg = self.segments.get(path)
            if seg is not None:
                seg.inflight -= count
        token.paths = {}

    def _forget(self, path):
        seg = self.segments.pop(path)
        if seg.fd >= 0:
            os.close(seg.fd)
            self.held_fds -= 1

    def _unlink(self, path):
        seg = self.segments.get(path)
        self._forget(path)
        for p in (path, seg.alias) if seg.alias else (path,):
            try:
                os.unlink(p)
            except OSError:
                pass

    def _move(self, path):
        """A parked segment is free: to the pool, under the name its creator reuses it by."""
        seg = self.segments[path]
        client, nxt = seg.parked
        target = self.segments.get(nxt)
        seg.parked = None
        if target is None or target.alias is None or client not in target.holders:
            return
        for attempt in (0, 1):
            try:
                os.rename(path, target.alias)
                break
            except FileNotFoundError:        # no pool directory yet (or no file: given up)
                if attempt or not self._pool_dir(os.path.dirname(target.alias)):
                    return
            except OSError:
                return
        self._forget(path)
        client.holds.discard(path)

    def _pool_dir(self, d):
        """Make the pool directory ``d`` (0700), or check that it is ours: whether it is."""
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            try:
                st = os.lstat(d)
            except OSError:
                return False
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != self.uid:
                return False                 # not ours (sticky /dev/shm): never move into it
        except OSError:
            return False
        self.pool_dirs.add(d)
        return True

    # -- connections -----------------------------------------------------------------
    def accept(self):
        try:
            sock, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):
                # Clients that have gone are dropped (their fds closed) by the pass after this
                # select: try once more then, so a client is not refused for fds being freed.
                if self.full_once:
                    self.refuse(e)
                self.full_once = not self.full_once
            return
        self.full_once = False
        sock.setblocking(False)
        pid, uid = peer_cred(sock)
        if uid not in (None, self.uid):
            try:
                sock.sendall(b"NO this manager serves only the user that started it\n")
            except OSError:
                pass
            sock.close()
            return
        try:
            sock.sendall(b"OK %d\n" % os.getpid())
        except OSError:
            sock.close()
            return
        self.clients[sock.fileno()] = Client(sock)
        try:
            self.groups.add(os.getpgid(pid))
        except (TypeError, OSError):
            pass
        self.sel.register(sock, selectors.EVENT_READ)
        self.seen_client = True

    def refuse(self, e):
        """Out of fds (EMFILE, ENFILE): tell the client that cannot be taken why, on the fd
        kept spare for it, and keep serving the others."""
        if self.spare >= 0:
            os.close(self.spare)
        try:
            sock, _ = self.listener.accept()
        except OSError:
            time.sleep(0.01)         # nothing can be answered now: do not spin on the backlog
        else:
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            scope = "the system's" if e.errno == errno.ENFILE else f"its fd limit ({soft})"
            try:
                sock.sendall(b"FULL the manager daemon has used %s open files (%s): raise the "
                             b"limit (`ulimit -n`) before the program starts, or use the "
                             b"'file_descriptor' strategy\n"
                             % (scope.encode(), os.strerror(e.errno).encode()))
            except OSError:
                pass
            sock.close()
        self.spare = _spare()

    def drop(self, client):
        self.sel.unregister(client.sock)
        del self.clients[client.sock.fileno()]
        client.sock.close()
        for path in client.holds:
            seg = self.segments.get(path)
            if seg is not None:
                seg.holders.discard(client)
                seg.unpark(client)
        client.holds.clear()
        client.tokens.clear()                # (its tokens live on in the messages)
        while client.fds:
            os.close(client.fds.popleft())

    def read(self, client):
        """Read and apply what the client has written; False once it has gone."""
        self.reading.add(client)
        try:
            return self._read(client)
        finally:
            self.reading.discard(client)

    def _read(self, client):
        while True:
            try:
                data, ancdata, _, _ = client.sock.recvmsg(1 << 16, _CMSG, socket.MSG_CMSG_CLOEXEC)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                return False
            for level, kind, cdata in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(cdata[:len(cdata) - len(cdata) % fds.itemsize])
                    client.fds.extend(fds)
            if not data:
                return False
            lines = (client.buf + data).split(b"\n")
            client.buf = lines.pop()
            if len(client.buf) > MAX_LINE:
                return False                         # not our protocol: hang up
            for line in lines:
                if not client.hello:
                    if not line.startswith(b"HELLO "):
                        return False
                    client.pid, client.hello = line[6:], True
                    continue
                op, _, path = line.partition(b" ")
                if op == b"?":
                    stats = (len(self.clients), len(self.segments),
                             sum(max(s.inflight, 0) for s in self.segments.values()),
                             len({*self.tokens.values(),
                                  *(t for c in self.clients.values() for t in c.tokens.values())}),
                             sum(s.alias is not None for s in self.segments.values()))
                    try:
                        client.sock.sendall(b"STATS %d %d %d %d %d\n" % stats)
                    except OSError:
                        return False
                    continue
                if op == b"W":
                    # (the records read by now are acted on in this pass or the next: the
                    # rule of two passes)
                    self.waiters.append((client, self.passes + 2))
                    continue
                if op == b"E":
                    self.ending.append(client)           # (at the end of this pass)
                    continue
                self.apply(client, op, os.fsdecode(path))

    def read_all(self):
        self.early_before, self.early = self.early, set()
        for client in list(self.clients.values()):
            if client.gone or not self.read(client):
                self.drop(client)

    def idle(self):
        """(paths unused, parked paths free) now."""
        unused = {p for p, s in self.segments.items() if s.unused()}
        free = set()
        for p in list(self.parked):
            seg = self.segments.get(p)
            if seg is None or seg.parked is None:
                self.parked.discard(p)
            elif seg.free():
                free.add(p)
        return unused, free

    def one_pass(self):
        """Read every client (ready or not); then unlink what is unused, and move to the pool
        what is parked and free, if it was so after the previous read too. Paths newly seen
        so are confirmed by one more read at once."""
        self.read_all()
        unused, free = self.idle()
        if not (unused <= self.candidates and free <= self.free):
            self.candidates, self.free = unused, free
            self.read_all()
            unused, free = self.idle()
        for path in unused & self.candidates:
            self._unlink(path)
        for path in free & self.free:
            self._move(path)
        self.candidates, self.free = unused - self.candidates, free - self.free
        if self.unrecorded:
            self._record()
        self.passes += 1
        if self.waiters:
            self._answer_waiters()
        while self.to_sweep:
            try:
                sweep(self.to_sweep.pop())
            except OSError:
                pass                             # (what could not be read stays: doctor)
        if self.ending:
            self._end_all()

    def _answer_waiters(self):
        """``W``: answer those whose records have been acted on."""
        waiting = []
        for client, at in self.waiters:
            if self.passes < at:
                waiting.append((client, at))
            elif client.sock.fileno() >= 0:
                try:
                    client.sock.sendall(b"DONE\n")
                except OSError:
                    pass
        self.waiters = waiting

    def run(self):
        while True:
            # (a waiter is answered after the next pass: make it now)
            timeout = 0 if self.waiters else 0.005 if self.candidates or self.free else 0.5
            for key, _ in self.sel.select(timeout):
                if key.fileobj is self.listener:
                    self.accept()
                elif type(key.data) is Token:
                    self.end_token(key.data)
            self.one_pass()
            if not self.clients and not self._pending_connection():
                if self.seen_client or time.monotonic() - self.started > STARTUP:
                    if not self._linger():
                        break
            time.sleep(PASS_DELAY)
        self.shutdown()

    def _pending_connection(self):
        return bool(self.sel.select(0))

    def _linger(self):
        """No client left: wait for a receiver if messages are in flight, while a process of
        the program may still take them (one of the clients' process groups has a member,
        say the parent that started them: it may receive a message of theirs and become a
        client), and ``LINGER`` s at least. True: one came."""
        if any(s.inflight > 0 for s in self.segments.values()):
            deadline = time.monotonic() + LINGER
            while time.monotonic() < deadline or any(map(_group_alive, self.groups)):
                for key, _ in self.sel.select(max(deadline - time.monotonic(), GROUP_POLL)):
                    if type(key.data) is Token:
                        self.end_token(key.data)
                    elif key.fileobj is self.listener:
                        self.accept()
                if self.clients:
                    return True
                if not any(s.inflight > 0 for s in self.segments.values()):
                    break
        return False

    def shutdown(self):
        # The socket goes first: a client that finds no socket starts a fresh daemon, while
        # one that finds the socket but no listener knows this daemon was killed.
        for p in (self.path, os.path.dirname(self.path)):
            try:
                os.unlink(p) if p == self.path else os.rmdir(p)
            except OSError:
                pass
        self.listener.close()
        for path in list(self.segments):
            self._unlink(path)
        for d in self.pool_dirs:
            try:
                os.rmdir(d)
            except OSError:
                pass
        for ledger in self.ledgers.values():
            if ledger is not None:
                ledger.remove()
        self.ledgers = {}

    # -- ledgers (see Ledgers) ------------------------------------------------------------
    def _ledger(self, directory):
        """This daemon's ledger in ``directory``, made (and the directory swept) if new."""
        ledger = self.ledgers.get(directory, False)
        if ledger is False:
            header = "socket %s\npool %s\n" % (self.path, POOL_DIR % os.getpid())
            try:
                ledger = Ledger(directory, os.fsencode(header))
            except OSError:
                ledger = None                    # (not writable: nothing recorded there)
            self.ledgers[directory] = ledger
            self.to_sweep.append(directory)
        return ledger

    def _record(self):
        """Name the segments new in this pass in their directories' ledgers: a write each."""
        by_dir = {}
        for path in self.unrecorded:
            directory, name = os.path.split(path)
            by_dir.setdefault(directory, []).append(name)
        self.unrecorded = []
        for directory, names in by_dir.items():
            ledger = self._ledger(directory)
            if ledger is None:
                continue
            ledger.add(names)
            if ledger.lines > 2 * len(self.segments) + COMPACT:
                ledger.rewrite([os.path.basename(p) for p in self.segments
                                if os.path.dirname(p) == directory])

    def _end_all(self):
        """``E``: end now, as at a clean exit; answer ``DONE``."""
        self.read_all()                          # (what was written before the ``E``)
        self.shutdown()
        for client in self.ending:
            try:
                client.sock.sendall(b"DONE\n")
            except OSError:
                pass
        raise _Ended()


class _Ended(Exception):
    """The daemon ended at a client's ``E``."""


def ledgers(directory):
    """[(path, alive, socket path, pool directory name, names of segments still there)] of
    the ledgers of this user in ``directory`` (see Ledgers). A dead one's lock is taken and
    let go here: a ledger nobody could lock is a live daemon's."""
    out = []
    try:
        present = set(os.listdir(directory))
    except OSError:
        return out
    for name in sorted(n for n in present if LEDGER_RE.match(n)):
        path = os.path.join(directory, name)
        entry = _read_ledger(path)
        if entry is None:
            continue
        alive, lines = entry
        head = dict(line.split(" ", 1) for line in lines if line.startswith(("socket ", "pool ")))
        pool = head.get("pool") if POOL_RE.match(head.get("pool", "")) else None
        if pool:
            try:
                present.update(os.listdir(os.path.join(directory, pool)))
            except OSError:
                pass
        names = {n for n in lines if NAME_RE.match(n) and n in present}
        out.append((path, alive, head.get("socket"), pool, names))
    return out


def _read_ledger(path):
    """(alive, lines) of the ledger ``path``, or None if it is not one of this user's."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            alive = False
        except OSError:
            alive = True
        if not alive and os.stat(path).st_ino != st.st_ino:
            return None                          # (rewritten under a new inode meanwhile)
        with open(fd, "rb", closefd=False) as f:
            return alive, f.read().decode(errors="replace").split("\n")
    except OSError:
        return None
    finally:
        os.close(fd)


def sweep(directory):
    """Remove what the dead daemons of this user left in ``directory`` (see Ledgers): the
    segments their ledgers name that no process maps or holds open; then, once none is
    left, the ledger, the socket and its directory, the pool directory. The paths of the
    dead ledgers kept (some of their segments are in use)."""
    dead = [entry for entry in ledgers(directory) if not entry[1]]
    busy = _in_use({n for entry in dead for n in entry[4]}) if dead else set()
    kept = []
    for path, _, sock, pool, names in dead:
        for name in names - busy:
            for d in (directory, os.path.join(directory, pool)) if pool else (directory,):
                try:
                    os.unlink(os.path.join(d, name))
                except OSError:
                    pass
        if names & busy:
            kept.append(path)
            continue
        if pool:
            try:
                os.rmdir(os.path.join(directory, pool))
            except OSError:
                pass                             # (not empty: a live daemon of that pid)
        _remove_socket(sock)
        try:
            os.unlink(path)
        except OSError:
            pass
    return kept


def _remove_socket(path):
    """Remove a dead daemon's socket and its directory (made by ``manager._start``)."""
    if not path or os.path.basename(path) != "manager.sock" \
            or not os.path.basename(os.path.dirname(path)).startswith("sharedmp-"):
        return
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
        os.rmdir(os.path.dirname(path))
    except OSError:
        pass


def _in_use(names):
    """Which of ``names`` (segment names) some process maps or holds open, as /proc shows
    (this PID namespace's processes); all of them without /proc."""
    if not names or not os.path.isdir("/proc/self/fd"):
        return set(names)
    seen = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open("/proc/%s/maps" % pid, "rb") as f:
                targets = [line.split(None, 5)[-1] for line in f if b"/sharedmp_" in line]
            fd_dir = "/proc/%s/fd" % pid
            targets += [os.fsencode(os.readlink(os.path.join(fd_dir, fd)))
                        for fd in os.listdir(fd_dir)]
        except OSError:
            continue                             # (gone, or not ours to read)
        seen.update(os.fsdecode(t.rsplit(b"/", 1)[-1].split()[0]) for t in targets if b"/" in t)
    return names & seen


def _ours(path):
    """Whether ``path`` names a sharedmp segment (an absolute path, a segment's name)."""
    return os.path.isabs(path) and NAME_RE.match(os.path.basename(path)) is not None


def _spare():
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1


def peer_cred(sock):
    """(pid, uid) of the peer process (SO_PEERCRED), or (None, None) where the platform has
    no such call."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None, None                            # macOS: the 0700 directory is the guard
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[:2]


def _group_alive(pgid):
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except OSError:                                  # (EPERM: a member of another user)
        pass
    return True


def main(argv):
    path, fd = argv[1], int(argv[2])
    shm_dir = argv[3] if len(argv) > 3 else None
    # The process the client started exits here; the daemon goes on in its child. The client
    # has no child left to wait for, and the daemon, no longer the session's leader, never
    # gets a controlling terminal (nor its Ctrl-C).
    if os.fork():
        os._exit(0)
    listener = socket.socket(fileno=fd)
    listener.setblocking(False)
    # A socket per client and a pipe per open token (a few per channel end): allow as many
    # as the hard limit does.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        pass
    try:
        Daemon(listener, path, shm_dir).run()
    except (KeyboardInterrupt, _Ended):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

"""Children that never outlive their parent: PR_SET_PDEATHSIG, or a watcher process.

Every Process of a sharedmp context (so spawn()'s children and Pool workers too)
records at ``start()`` which process starts it, and the child arms first thing in
``_bootstrap``, one of two ways:

- fork and spawn children started by the main thread: the child's OS parent is the starting
  process, and the child asks the kernel for SIGKILL when its parent dies (``prctl``), then
  checks that its parent is still the one that started it: the parent may have died before
  the ``prctl``, and the kernel would then never send the signal.
- forkserver children, and children started from any other thread: the *watcher*. The
  kernel sends the parent-death signal when the *thread* that created the child ends, not
  the process (prctl(2): "the parent thread"): ``Pool`` starts replacement workers from its
  worker-handler thread, which ends at ``close()``/``join()``, and any user thread may start
  a child and end. A forkserver child's OS parent is the fork server, a helper that may die
  (or be killed) while the starting process lives on: the standard library then starts
  another server and the running children go on. So these children do not watch their OS
  parent, and nothing of the watch stays in the child either, whose fds and image are its
  own to close or exec: the starting process starts one watcher (``_WATCHER``, an exec'd
  Python that imports no more than it needs) at its first such start, and gives it a pidfd
  of itself. Each such child gets that pidfd and the watcher's socket (spawn and forkserver
  children by ``DupFd``, passed like the child's other fds; a fork child inherits them: the
  fork hook keeps them in the child of the thread that is starting it, and closes them in
  every other fork child), sends the watcher a pidfd of itself, closes both, and then looks
  once whether the starter is gone (it died before the watcher could have heard of this
  child: the watcher reads what was sent before it acts). When the starter dies, the
  watcher SIGKILLs every child it holds that still runs, and exits. A pidfd follows a
  process, not its program: as for spawn children, an exec of the starter leaves the
  children running, and they die when what it became dies. CPython gives every forkserver
  child the write end of the server's own "alive" pipe too
  (``forkserver._forkserver_alive_fd``), which it never uses (a child that starts
  forkserver children launches its own server); while a child holds it the server never
  sees EOF, so the child closes it.

The main thread's fork and spawn children keep ``prctl``: one system call in the child, no
helper process. No thread of sharedmp's is made for any of this (there was a lasting
"starter" thread once, which created the other threads' children): a process whose own
threads have ended is single-threaded again, as with the standard library, and a later
``os.fork()`` there is not the multi-threaded fork Python 3.12+ warns of.

SIGKILL, because a parent-death signal that the child can catch or ignore does not
make it die; the kernel frees its memfd segments all the same. Linux only (pidfds: 5.3+):
elsewhere, and with ``SHAREDMP_KEEP_ORPHANS=1``, nothing here does anything.
"""
import multiprocessing
import os
import select
import signal
import socket
import threading

from .. import _compat, fds, forks, host, settings


ENV = settings.KEEP_ORPHANS
HAVE_PDEATHSIG = host.HAVE_PDEATHSIG
SIGNAL = signal.SIGKILL
_PR_SET_PDEATHSIG = 1


def keep_orphans():
    """True if $SHAREDMP_KEEP_ORPHANS asks that children may outlive their parent."""
    return settings.get(ENV)  # type: ignore[no-any-return]


class DieWithParent(_compat.ChildStart):
    """Process mixin: on Linux the child is killed when the process that started it dies."""

    def start(self) -> None:
        # What the child arms with: (pid of the starting process, None: prctl; or the
        # starter's pidfd and the socket to its watcher).
        self._sharedmp_parent: tuple[int, _Watched | None] | None = None
        if HAVE_PDEATHSIG and not keep_orphans():
            # (_start_method None: the default's)
            method = _compat.start_method_of(self) or multiprocessing.get_start_method()
            # (a forkserver child's OS parent is the fork server's thread, not ours)
            if method != "forkserver" and threading.current_thread() is threading.main_thread():
                self._sharedmp_parent = (os.getpid(), None)
                if method == "fork":
                    _prctl()               # a fork child inherits it: imports nothing itself
            elif (watch := _watcher()) is not None:
                self._sharedmp_parent = (os.getpid(), _Watched(watch, method == "forkserver"))
                if method == "fork":
                    return _keeping_watch(super().start)
        return super().start()

    def _child_starts(self) -> None:
        parent = getattr(self, "_sharedmp_parent", None)   # None: off, or start() was overridden
        if parent is not None:
            pid, watched = parent
            if isinstance(watched, _Watched):    # a fork child: the fds are the parent's own
                watched = _take_inherited()
            if watched is not False:
                arm(pid, watched)
        super()._child_starts()


_libc = None


def _prctl():
    """(ctypes, libc with errno): made once per process, and inherited by fork children
    (importing ctypes and opening libc took most of a fork child's start)."""
    global _libc
    if _libc is None:
        import ctypes  # deferred: only processes that start children or are children pay
        _libc = ctypes, ctypes.CDLL(None, use_errno=True)
    return _libc


def arm(parent_pid, watched=None):
    """(in the child) Die with the parent; die now if the parent is already gone.
    ``watched``: for a child the watcher watches, (the starter's pidfd, the socket to its
    watcher, whether the child is the fork server's)."""
    if watched is not None:
        return _arm_watched(*watched)
    ctypes, libc = _prctl()
    if libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(SIGNAL), ctypes.c_ulong(0),
                  ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
        import warnings
        err = ctypes.get_errno()
        warnings.warn(f"sharedmp: prctl(PR_SET_PDEATHSIG) failed ({os.strerror(err)}): this child "
                      "will outlive its parent if the parent dies", RuntimeWarning, stacklevel=2)
        return
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), SIGNAL)


# -- the starter's watcher: forkserver children, and those started from other threads ----

# python -I -S -c _WATCHER <pidfd of the starter> <the watcher's end of the socket>
_WATCHER = """
import os, resource, select, signal, socket, sys
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):    # (what ends a program's group)
    signal.signal(sig, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
starter, sock = int(sys.argv[1]), socket.socket(fileno=int(sys.argv[2]))
sock.setblocking(False)
poller, children = select.poll(), set()
poller.register(starter, select.POLLIN)
poller.register(sock, select.POLLIN)

def take():
    while True:
        try:
            fds = socket.recv_fds(sock, 1, 16)[1]
        except OSError:                         # (none left)
            return
        for fd in fds:
            children.add(fd)
            poller.register(fd, select.POLLIN)

while True:
    for fd, events in poller.poll():
        if fd == starter:
            take()
            for child in children:
                try:
                    signal.pidfd_send_signal(child, signal.SIGKILL)
                except OSError:
                    pass                        # (it has just ended)
            sys.exit()
        if fd == sock.fileno():
            take()
        else:                                   # a child ended
            poller.unregister(fd)
            children.discard(fd)
            os.close(fd)
"""

_watch = None                    # (pidfd of this process, socket to its watcher) once started
_watch_lock = threading.Lock()


def _watcher():
    """(this process's pidfd, the socket to its watcher): the watcher started at the first
    call; None where pidfds are missing (Linux before 5.3), said once."""
    global _watch
    with _watch_lock:
        if _watch is None:
            try:
                me = fds.Fd(os.pidfd_open(os.getpid()))
            except (AttributeError, OSError) as e:
                import warnings
                warnings.warn(f"sharedmp: no pidfd ({e}): forkserver children, and children "
                              "started from a thread other than the main one, will outlive the "
                              "process that started them if it dies", RuntimeWarning, stacklevel=3)
                _watch = False
                return None
            from multiprocessing import spawn, util
            ours, its = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
            with ours, its:
                exe = spawn.get_executable()
                util.spawnv_passfds(exe, [exe, "-I", "-S", "-c", _WATCHER, str(me.fd),
                                          str(its.fileno())], (me.fd, its.fileno()))
                _watch = (me, fds.Fd(ours.detach()))
        return _watch or None


class _Watched:
    """In a watched child's Process: what it arms with, the starter's pidfd and the socket
    to the watcher. Pickled (spawn, forkserver) as copies (``DupFd``: the spawning Popen or
    the fork server hands them to the child with its other fds); a fork child inherits them
    (``_keeping_watch``)."""

    def __init__(self, watch, forkserver):
        self.watch = watch
        self.forkserver = forkserver

    def __reduce__(self):
        from multiprocessing import reduction
        return _detach, (self.forkserver, *(reduction.DupFd(fd.fd) for fd in self.watch))


def _detach(forkserver, *dups):
    return (*(dup.detach() for dup in dups), forkserver)


# Threads now in a fork start() of a watched child (idents): in the child forked by such a
# thread, the fork hook keeps the inherited watch for it to arm with (``_inherited``);
# every other fork child closes it.
_forking: set = set()
_inherited = None


def _keeping_watch(start):
    me = threading.get_ident()
    _forking.add(me)
    try:
        return start()
    finally:
        _forking.discard(me)


def _take_inherited():
    """(in a fork child of a watched start) (starter's pidfd, socket, False), now the
    child's to close; False, said, if the fork hook did not keep them."""
    global _inherited
    watch, _inherited = _inherited, None
    if not watch:
        import warnings
        warnings.warn("sharedmp: this fork child did not inherit its watcher's socket: it will "
                      "outlive the process that started it if that one dies", RuntimeWarning,
                      stacklevel=3)
        return False
    starter, sock = (fd.take() for fd in watch)
    return starter, sock, False


def _arm_watched(starter, sock, forkserver=False):
    if forkserver:
        _compat.close_forkserver_alive_fd()
    error = None
    try:
        with socket.socket(fileno=sock) as watcher:
            me = os.pidfd_open(os.getpid())
            try:
                socket.send_fds(watcher, [b"."], [me])
            finally:
                os.close(me)
    except OSError as e:
        error = e
    finally:
        gone = bool(select.select([starter], [], [], 0)[0])
        os.close(starter)
    if gone:                                   # (told or not)
        os.kill(os.getpid(), SIGNAL)
    if error is not None:
        import warnings
        warnings.warn(f"sharedmp: the watcher was not told of this child ({error}): it will "
                      "outlive the process that started it if that one dies", RuntimeWarning,
                      stacklevel=2)


@forks.in_child
def _after_fork_in_child() -> None:
    global _watch, _forking, _inherited
    # The watcher watches the parent: a fork child starts its own for the children it starts.
    watch, _watch = _watch, None
    starting = threading.get_ident() in _forking
    _forking, _inherited = set(), None
    if watch and starting:
        _inherited = watch               # the child of DieWithParent.start: it arms with them
    else:
        for fd in watch or ():
            fd.close_inherited()


forks.renew_locks(globals(), "_watch_lock")

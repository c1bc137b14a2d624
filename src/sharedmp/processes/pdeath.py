"""Children that never outlive their parent: PR_SET_PDEATHSIG, or a watcher (forkserver).

Every Process of a sharedmp context (so spawn()'s children and Pool workers too)
records at ``start()`` which process starts it; the child, first thing in
``_bootstrap``, asks the kernel for SIGKILL when its parent dies (``prctl``) and then
checks that its parent is still the one that started it: the parent may have died
before the ``prctl``, and the kernel would then never send the signal.

- fork, spawn: the child's OS parent is the starting process.
- forkserver: the OS parent is the fork server, a helper that may die (or be killed) while
  the starting process lives on: the standard library then starts another server and the
  running children go on. So a forkserver child does not watch its OS parent, and nothing of
  the watch is in the child either, whose fds and image are its own to close or exec: the
  starting process starts one *watcher* (``_WATCHER``, an exec'd Python that imports no
  more than it needs) at its first forkserver start, and gives it a pidfd of itself. Each
  forkserver child gets that pidfd and the watcher's socket (``DupFd``, passed by the
  server like the child's other fds), sends the watcher a pidfd of itself, closes both,
  and then looks once whether the starter is gone (it died before the watcher could have
  heard of this child: the watcher reads what was sent before it acts). When the starter
  dies, the watcher SIGKILLs every child it holds that still runs, and exits. A pidfd
  follows a process, not its program: as for spawn children, an exec of the starter
  leaves the children running, and they die when what it became dies. CPython gives every
  forkserver child the write end of the server's own "alive" pipe too
  (``forkserver._forkserver_alive_fd``), which it never uses (a child that starts
  forkserver children launches its own server); while a child holds it the server never
  sees EOF, so the child closes it.

Hazard: the kernel sends the signal when the *thread* that created the child ends, not
the process (prctl(2): "the parent thread"). ``Pool`` starts replacement workers from
its worker-handler thread, which ends at ``close()``/``join()``; any user thread may
start a child and end. So a child is always created by a thread that lives as long as
the process: the main thread, or else one daemon "starter" thread that runs ``start()``
for the other threads (not for forkserver children, whose parent is the fork server: they
may be started from many threads at once, as spawn()'s parallel start does). (A daemon
thread is only abandoned at interpreter exit, after multiprocessing has joined or
terminated the children it knows.)

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
        # What the child checks: (pid of the starting process, None or, for a forkserver
        # child, the starter's pidfd and the socket to its watcher).
        self._sharedmp_parent: tuple[int, _Watched | None] | None = None
        if HAVE_PDEATHSIG and not keep_orphans():
            # (_start_method None: the default's)
            method = _compat.start_method_of(self) or multiprocessing.get_start_method()
            via_forkserver = method == "forkserver"
            if not via_forkserver:
                self._sharedmp_parent = (os.getpid(), None)
            elif (watch := _watcher()) is not None:
                self._sharedmp_parent = (os.getpid(), _Watched(watch))
            if method == "fork":
                _prctl()                   # a fork child inherits it: imports nothing itself
            # (a forkserver child's OS parent is the fork server's thread, not ours)
            if not via_forkserver and not _on_lasting_thread():
                return _start_on_lasting_thread(super().start)
        return super().start()

    def _child_starts(self) -> None:
        parent = getattr(self, "_sharedmp_parent", None)   # None: off, or start() was overridden
        if parent is not None:
            arm(*parent)
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
    ``watched``: for a forkserver child, (the starter's pidfd, the socket to its watcher)."""
    if watched is not None:
        return _arm_forkserver_child(*watched)
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


# -- forkserver children: the starter's watcher ------------------------------------------

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


def _watcher():
    """(this process's pidfd, the socket to its watcher): the watcher started at the first
    call; None where pidfds are missing (Linux before 5.3), said once."""
    global _watch
    with _starter_lock:
        if _watch is None:
            try:
                me = fds.Fd(os.pidfd_open(os.getpid()))
            except (AttributeError, OSError) as e:
                import warnings
                warnings.warn(f"sharedmp: no pidfd ({e}): forkserver children will outlive the "
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
    """Pickled into a forkserver child's Process: what it arms with, copies of the starter's
    pidfd and of the socket to the watcher (``DupFd``: the fork server hands them to the
    child with its other fds)."""

    def __init__(self, watch):
        self.watch = watch

    def __reduce__(self):
        from multiprocessing import reduction
        return _detach, tuple(reduction.DupFd(fd.fd) for fd in self.watch)


def _detach(*dups):
    return tuple(dup.detach() for dup in dups)


def _arm_forkserver_child(starter, sock):
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


# ---------------------------------------------------------------------------------------
# The starter thread: creates the children asked for by threads other than the main one.

_starter = None                  # (thread, requests) once started in this process
_starter_lock = threading.Lock()


def _on_lasting_thread():
    current = threading.current_thread()
    return current is threading.main_thread() or (_starter is not None and current is _starter[0])


def _start_on_lasting_thread(start):
    """Run ``start()`` on the starter thread and return its result (or raise its error)."""
    global _starter
    with _starter_lock:
        if _starter is None:
            import queue
            requests = queue.SimpleQueue()
            thread = threading.Thread(target=_serve, args=(requests,), name="sharedmp-starter",
                                      daemon=True)
            thread.start()
            _starter = (thread, requests)
        requests = _starter[1]
    done, outcome = threading.Event(), []
    requests.put((start, done, outcome))
    done.wait()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def _serve(requests):
    while True:
        start, done, outcome = requests.get()
        try:
            outcome.append((True, start()))
        except BaseException as e:       # handed to the caller, raised in its thread
            outcome.append((False, e))
        finally:
            done.set()
        start = done = outcome = None    # hold nothing of a finished request while waiting


@forks.in_child
def _after_fork_in_child() -> None:
    global _starter, _watch
    _starter = None                  # the starter thread does not exist in a forked child
    # The watcher watches the parent: a fork child starts its own for its forkserver children.
    for fd in _watch or ():
        fd.close_inherited()
    _watch = None


forks.renew_locks(globals(), "_starter_lock")

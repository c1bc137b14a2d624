"""Children that never outlive their parent: PR_SET_PDEATHSIG, set in every child.

Every Process of a sharedmp context (so spawn()'s children and Pool workers too)
records at ``start()`` which process starts it; the child, first thing in
``_bootstrap``, asks the kernel for SIGKILL when its parent dies (``prctl``) and then
checks that its parent is still the one that started it: the parent may have died
before the ``prctl``, and the kernel would then never send the signal.

- fork, spawn: the child's OS parent is the starting process.
- forkserver: the OS parent is the fork server, a helper that may die (or be killed) while
  the starting process lives on: the standard library then starts another server and the
  running children go on. So a forkserver child does not watch its OS parent. The starting
  process keeps one pipe, made at its first forkserver start; each forkserver child gets a
  copy of the read end (``DupFd``, passed by the server like the child's other fds) and
  asks the kernel for SIGKILL when that pipe's last write end closes: ``O_ASYNC`` with
  ``F_SETSIG`` on a description of the pipe of its own (fcntl(2); pipe(7) signals its
  readers when the writers are gone). The
  write end lives in the starting process only (made non-inheritable, closed in its fork
  children), so it closes when that process dies however it dies. After arming, the child
  looks for EOF once, in case the starter died before. CPython gives every forkserver
  child the write end of the server's own "alive" pipe too
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
make it die; the kernel frees its memfd segments all the same. Linux only: elsewhere,
and with ``SHAREDMP_KEEP_ORPHANS=1``, nothing here does anything.
"""
import fcntl
import multiprocessing
import os
import select
import signal
import threading

from .. import _compat, forks, host, settings


ENV = settings.KEEP_ORPHANS
HAVE_PDEATHSIG = host.HAVE_PDEATHSIG
SIGNAL = signal.SIGKILL
_PR_SET_PDEATHSIG = 1
_F_SETSIG = 10                     # (fcntl.h, Linux; the fcntl module does not name it)


def keep_orphans():
    """True if $SHAREDMP_KEEP_ORPHANS asks that children may outlive their parent."""
    return settings.get(ENV)  # type: ignore[no-any-return]


class DieWithParent(_compat.ChildStart):
    """Process mixin: on Linux the child is killed when the process that started it dies."""

    def start(self) -> None:
        # What the child checks: (pid of the starting process, None or, for a forkserver
        # child, the read end of the starting process's pipe).
        self._sharedmp_parent = None
        if HAVE_PDEATHSIG and not keep_orphans():
            # (_start_method None: the default's)
            method = _compat.start_method_of(self) or multiprocessing.get_start_method()
            via_forkserver = method == "forkserver"
            self._sharedmp_parent = (os.getpid(), _StarterPipe() if via_forkserver else None)
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


def arm(parent_pid, starter_pipe=None):
    """(in the child) Die with the parent; die now if the parent is already gone.
    ``starter_pipe``: for a forkserver child, the fd of its starter's pipe."""
    if starter_pipe is not None:
        return _arm_forkserver_child(starter_pipe)
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


# -- forkserver children: the starting process's pipe ------------------------------------

_pipe = None                     # (read end, write end) where forkserver children are started
_watched = None                  # in a forkserver child: the read end it watches


def _starter_pipe():
    global _pipe
    with _starter_lock:
        if _pipe is None:
            _pipe = os.pipe()          # (non-inheritable: exec'd children never hold it)
        return _pipe[0]


class _StarterPipe:
    """Pickled into a forkserver child's Process: a copy of the read end, which the fork
    server hands the child with its other fds (``DupFd`` while the child is launched)."""

    def __reduce__(self):
        from multiprocessing import reduction
        return _detach, (reduction.DupFd(_starter_pipe()),)


def _detach(dup):
    return dup.detach()


def _arm_forkserver_child(fd):
    global _watched
    _compat.close_forkserver_alive_fd()
    try:
        # Its own open file description of the pipe: the owner of the signal (F_SETOWN) is
        # kept per description, and the fd received is the starter's description, shared by
        # all its forkserver children (the last to arm would be the only one signalled).
        own = host.reopen(fd, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        fcntl.fcntl(own, fcntl.F_SETOWN, os.getpid())
        fcntl.fcntl(own, _F_SETSIG, SIGNAL)
        fcntl.fcntl(own, fcntl.F_SETFL, fcntl.fcntl(own, fcntl.F_GETFL) | os.O_ASYNC)
    except OSError as e:
        import warnings
        warnings.warn(f"sharedmp: fcntl(O_ASYNC) failed ({e}): this child will outlive the "
                      "process that started it if that one dies", RuntimeWarning, stacklevel=2)
        own = None
    finally:
        # (EOF: the starter died before we armed. Asked of the fd received: a pipe opened
        # through /proc is a FIFO to poll(), which reports no hang-up to a reader that saw
        # no writer come and go since it opened.)
        gone = bool(select.select([fd], [], [], 0)[0])
        os.close(fd)
    _watched = own
    if gone:                                   # (armed or not)
        os.kill(os.getpid(), SIGNAL)


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
    global _starter, _pipe, _watched
    _starter = None                  # the starter thread does not exist in a forked child
    # The starter's pipe is the parent's: a fork child holding its write end would keep the
    # parent's forkserver children alive after the parent; a watched read end belongs to the
    # process that armed it (the signal goes to that process only).
    for fd in (*(_pipe or ()), *((_watched,) if _watched is not None else ())):
        try:
            os.close(fd)
        except OSError:
            pass
    _pipe = _watched = None


forks.renew_locks(globals(), "_starter_lock")

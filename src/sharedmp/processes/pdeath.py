"""Children that never outlive their parent: PR_SET_PDEATHSIG, set in every child.

Every Process of a sharedmp context (so spawn()'s children and Pool workers too)
records at ``start()`` which process starts it; the child, first thing in
``_bootstrap``, asks the kernel for SIGKILL when its parent dies (``prctl``) and then
checks that its parent is still the one that started it: the parent may have died
before the ``prctl``, and the kernel would then never send the signal.

- fork, spawn: the child's OS parent is the starting process.
- forkserver: the OS parent is the fork server, which exits when the starting process
  dies (EOF on its "alive" pipe), so the signal comes one link later. The check is that
  the parent of our parent is the starting process. CPython gives every forkserver
  child the write end of that pipe too (``forkserver._forkserver_alive_fd``), which it
  never uses (a child that starts forkserver children launches its own server); while
  a child holds it the server never sees EOF, so the child closes it.

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
import multiprocessing
import os
import signal
import threading

from .. import _compat, forks, host, settings


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
        # What the child checks: (pid of the starting process, started via the fork server).
        self._sharedmp_parent = None
        if HAVE_PDEATHSIG and not keep_orphans():
            # (_start_method None: the default's)
            method = _compat.start_method_of(self) or multiprocessing.get_start_method()
            via_forkserver = method == "forkserver"
            self._sharedmp_parent = (os.getpid(), via_forkserver)
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


def arm(parent_pid, via_forkserver):
    """(in the child) Die with the parent; die now if the parent is already gone."""
    ctypes, libc = _prctl()
    if libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(SIGNAL), ctypes.c_ulong(0),
                  ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
        import warnings
        err = ctypes.get_errno()
        warnings.warn(f"sharedmp: prctl(PR_SET_PDEATHSIG) failed ({os.strerror(err)}): this child "
                      "will outlive its parent if the parent dies", RuntimeWarning, stacklevel=2)
        return
    ppid = os.getppid()
    if via_forkserver:
        _compat.close_forkserver_alive_fd()
        from ..memory import leftovers     # (deferred: dataclasses costs 5 ms)
        st = leftovers.proc_stat(ppid)
        alive = st is None or st.ppid == parent_pid       # None: cannot tell; the signal will
    else:
        alive = ppid == parent_pid
    if not alive:
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
    global _starter
    _starter = None                  # the starter thread does not exist in a forked child


forks.renew_locks(globals(), "_starter_lock")

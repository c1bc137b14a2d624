"""Small helpers shared by the tests and by the processes they start.

Children (spawn and forkserver targets in ``_*_workers.py``, the ``_*_drivers.py``
programs) import this module, so it imports neither pytest nor conftest; conftest
re-exports what the test modules use (``from conftest import eventually, ...``).
"""
import gc
import json
import os
import time

from sharedmp.memory import leftovers, segment

TIMEOUT = 60  # seconds for any join/get in a test (conftest.TIMEOUT is this one)


def eventually(predicate, timeout=5.0, collect=True, interval=0.01):
    """Poll ``predicate`` until true or ``timeout`` s have passed; return its last value.

    ``collect``: collect garbage between polls (named segments are unlinked by the manager
    daemon a few milliseconds after their last holder lets go, not synchronously; a holder
    may be garbage in a cycle). Pass False where what is awaited must not depend on it.
    """
    deadline = time.monotonic() + timeout
    while not (ok := predicate()) and time.monotonic() < deadline:
        if collect:
            gc.collect()
        time.sleep(interval)
    return ok


def wait_event(event, what, timeout=TIMEOUT):
    """``event.wait(timeout)``, or TimeoutError("did not <what>") (in a child, where no
    pytest is at hand to fail the test)."""
    if not event.wait(timeout):
        raise TimeoutError(f"did not {what}")


def data_ptr(a):
    """The address of the first element of array ``a``."""
    return a.__array_interface__["data"][0]


def open_fds(collect=False):
    """The fds open in this process (names in /proc/self/fd), once the segments that are kept
    mapped on purpose have been let go (``collect``: and garbage collected)."""
    segment.forget_recent()        # attached segments kept mapped on purpose are not leaks
    if collect:
        gc.collect()
    return set(os.listdir("/proc/self/fd"))


def segment_memfds():
    """{fd: inode} of this process's fds on sharedmp memfd segments."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:sharedmp"):
                out[int(name)] = os.stat(f"/proc/self/fd/{name}").st_ino
        except OSError:
            pass
    return out


def fds_on(key):
    """This process's fds on the file (st_dev, st_ino) == ``key``, in order."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == key:
            out.append(int(name))
    return sorted(out)


def memfd_maps(key):
    """The lines of /proc/self/maps that map the memfd (st_dev, st_ino) == ``key``."""
    with open("/proc/self/maps") as f:
        return [line for line in f
                if len(p := line.split()) >= 6 and "memfd:" in line and int(p[4]) == key[1]]


def children(pid):
    """The pids of ``pid``'s children now (none if it is gone)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def proc_stat(pid):
    """(state, ppid, start time) of process ``pid`` from /proc, or None if there is none."""
    st = leftovers.proc_stat(pid)
    return None if st is None else (st.state, st.ppid, st.start)


def say(**kw):
    """One JSON line on stdout (how the driver programs report to their test)."""
    print(json.dumps(kw), flush=True)

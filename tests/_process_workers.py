"""Functions run by the children of test_processes.py and of _orphan_driver.py.

Spawned children import this module, not pytest. Every wait here is bounded, so a
child left behind by a failed test ends by itself.
"""
import os
import signal
import sys
import time

import sharedmp as mp

LONG = 120      # seconds a "forever" child lives at most


def write_file(path, text=""):
    """Create ``path`` whole (rename), so a reader never sees half of it."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def sleep_forever(ready_dir):
    """Say "ready" with a file named by our pid, then sleep."""
    write_file(os.path.join(ready_dir, f"ready-{os.getpid()}"))
    time.sleep(LONG)


def touch(path, *unused):
    """Create ``path``: proof that the target ran."""
    write_file(path)


class SlowUnpickle:
    """An argument that takes ``seconds`` to unpickle: the child is slow to reach _bootstrap."""

    def __init__(self, seconds):
        self.seconds = seconds

    def __reduce__(self):
        return _slow_rebuild, (self.seconds,)


def _slow_rebuild(seconds):
    time.sleep(seconds)
    return SlowUnpickle(seconds)


class FailSecondPickle:
    """Pickles once, then raises: start_processes() fails at its second child."""

    pickled = 0

    def __reduce__(self):
        type(self).pickled += 1
        if type(self).pickled > 1:
            raise TypeError("FailSecondPickle: refusing to be pickled twice")
        return FailSecondPickle, ()


# -- fn(i, *args) for spawn() / start_processes() -----------------------------------------

def fill_index(i, out):
    """out[i] = i + 1 (``out`` is shared with the parent)."""
    out[i] = i + 1


def report_strategy(i, out):
    """out[i] = the position of the child's sharing strategy in the sorted list of all."""
    out[i] = sorted(mp.get_all_sharing_strategies()).index(mp.get_sharing_strategy())


def raise_at(i, bad, ready_dir):
    """Index ``bad`` raises once every other child is running; the others sleep."""
    if i != bad:
        sleep_forever(ready_dir)
        return
    deadline = time.monotonic() + 60
    while len([n for n in os.listdir(ready_dir) if n.startswith("ready-")]) < 2:
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    _nested_failure(i)


def _nested_failure(i):
    raise ValueError(f"boom in child {i}")


def exit_with(i, how, ready_dir):
    """Index 0 ends by ``how`` ("exit3" or a signal name); the others sleep."""
    if i != 0:
        sleep_forever(ready_dir)
        return
    if how == "exit3":
        os._exit(3)
    import faulthandler
    faulthandler.disable()                # pytest's, inherited by fork: no dump for SIGSEGV
    os.kill(os.getpid(), getattr(signal, how))
    time.sleep(LONG)


def ignore_term_then_sleep(i, ready_dir):
    """Index 0 raises; the others ignore SIGTERM (only SIGKILL ends them)."""
    if i == 0:
        deadline = time.monotonic() + 60
        while len([n for n in os.listdir(ready_dir) if n.startswith("ready-")]) < 1:
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        raise RuntimeError("first child fails")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sleep_forever(ready_dir)


def wait_for_file(i, path):
    """Return once ``path`` exists (at most LONG s)."""
    deadline = time.monotonic() + LONG
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)


def sleep_with(i, *unused):
    time.sleep(LONG)


def exit_code_of(i, code):
    sys.exit(code)


# -- Process targets -----------------------------------------------------------------------

def wait_then_report(conn, go, seconds):
    """Send our pid, wait for ``go`` (bounded), send "done"."""
    conn.send(os.getpid())
    go.wait(seconds)
    conn.send("done")


def square(x):
    return x * x, os.getpid()


def slow_exit_initializer(seconds):
    """Pool initializer: the worker takes ``seconds`` to exit (after its last task)."""
    from multiprocessing import util
    util.Finalize(None, time.sleep, (seconds,), exitpriority=100)


def raise_long(i, n):
    """Raise with a message of ``n`` characters (a traceback longer than a pipe's buffer)."""
    raise RuntimeError("start " + "x" * n + " end of the long message")


def report_freeze(q):
    """Put how many objects this process's garbage collector has frozen."""
    import gc
    q.put(gc.get_freeze_count())


class Cycle:
    """An object in a reference cycle that says when it is finalized."""
    finalized: list = []

    def __init__(self):
        self.me = self

    def __del__(self):
        Cycle.finalized.append(os.getpid())


INHERITED = None      # (set by the parent before a fork: what its child inherits)


def drop_inherited_cycle(q):
    """Drop the inherited ``INHERITED`` (a cycle); put what a collection then found and
    whether the cycle was finalized."""
    import gc
    global INHERITED
    INHERITED = None
    found = gc.collect()
    q.put((found, os.getpid() in Cycle.finalized))


def pool_then_fork(library, method):
    """(run as a fresh program) A Pool of ``library`` ("sharedmp" or the standard
    "multiprocessing") by ``method`` whose handler thread started replacement workers
    (maxtasksperchild=1), closed and joined; then os.fork(). Prints as JSON the threads left
    before the fork, how many workers ran, and what the fork warned."""
    import json
    import multiprocessing
    import threading
    import warnings
    ctx = (mp if library == "sharedmp" else multiprocessing).get_context(method)
    pool = ctx.Pool(2, maxtasksperchild=1)
    try:
        pids = {pid for _, pid in pool.map_async(square, range(6), chunksize=1).get(LONG)}
        pool.close()
        pool.join()
    finally:
        pool.terminate()
    threads = [t.name for t in threading.enumerate()]
    # (a thread joined has left threading's list a moment before its OS thread is gone)
    deadline = time.monotonic() + 5
    while len(os.listdir("/proc/self/task")) > 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    print(json.dumps({"threads": threads, "workers": len(pids),
                      "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}))

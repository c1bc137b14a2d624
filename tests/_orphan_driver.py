"""A main process for the parent-death tests, run as a script by test_processes.py.

    _orphan_driver.py DIR tree
        Start children by fork, spawn and forkserver, daemon and not, from the main
        thread and from threads that end; each writes DIR/ready-<pid> once running.
        Then write DIR/driver.json (our pid) and sleep until the test SIGKILLs us.
    _orphan_driver.py DIR early METHOD [thread]
        Start one child (METHOD; from a thread, joined, with "thread") that takes 1 s to
        reach its parent-death check (its arguments take that long to unpickle; a fork
        child sleeps in an at-fork hook) and whose target would create DIR/ran; write
        DIR/child.pid; SIGKILL ourselves at once, so we are gone before the child arms.
"""
import json
import os
import signal
import sys
import threading
import time

import sharedmp as mp

import _process_workers as w

TREE = [  # (start method, daemon, started from a thread that then ends)
    ("fork", False, False), ("fork", True, False),
    ("spawn", False, False), ("spawn", True, False),
    ("forkserver", False, False), ("forkserver", True, False),
    ("spawn", False, True), ("fork", True, True),
    ("fork", False, True), ("forkserver", True, True),
    (None, False, False), (None, True, True),          # mp.Process: the default start method
]


def _start(p, from_thread):
    """Start ``p`` from this thread or from a thread that has ended when this returns."""
    if from_thread:
        t = threading.Thread(target=p.start)
        t.start()
        t.join()
    else:
        p.start()


def tree(where):
    for method, daemon, from_thread in TREE:
        cls = mp.Process if method is None else mp.get_context(method).Process
        _start(cls(target=w.sleep_forever, args=(where,), daemon=daemon), from_thread)
    w.write_file(os.path.join(where, "driver.json"), json.dumps({"pid": os.getpid(), "n": len(TREE)}))
    time.sleep(w.LONG)


def early(where, method, from_thread):
    if method == "fork":                 # (after sharedmp's own hook: before _bootstrap)
        os.register_at_fork(after_in_child=lambda: time.sleep(1.0))
    p = mp.get_context(method).Process(target=w.touch,
                                       args=(os.path.join(where, "ran"), w.SlowUnpickle(1.0)))
    _start(p, from_thread)
    w.write_file(os.path.join(where, "child.pid"), str(p.pid))
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    if sys.argv[2] == "tree":
        tree(sys.argv[1])
    else:
        early(sys.argv[1], sys.argv[3], sys.argv[4:] == ["thread"])

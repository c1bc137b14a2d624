"""A starting process for test_pdeath_forkserver.py and what its child runs.

    python -c "import _pdeath_workers as w; w.main()" DIR METHOD CHILD STARTER [FROM]
        Start one child by METHOD (a sharedmp context) that does CHILD once running:
        "sleep", "closerange" (closes every fd above 2, then sleeps) or "exec" (execs a
        Python that sleeps); the child writes DIR/child.pid when it has. FROM: "main" (the
        default), or "thread": started from a thread, joined (ended) before anything else.
        Then this process writes DIR/started (how many threads it has left), waits for
        DIR/go (the test has seen its tree) and does STARTER: "sleep", or "exec" (execs a
        Python that writes DIR/starter.exec and sleeps). The test SIGKILLs it.
"""
import os
import sys
import threading
import time

import sharedmp as mp

LONG = 120      # seconds a "forever" process lives at most

# (the file is written whole: a reader never sees half of it)
_SLEEPER = ("import os, sys, time; open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid())); "
            "os.replace(sys.argv[1] + '.tmp', sys.argv[1]); time.sleep(int(sys.argv[2]))")


def write_file(path, text=""):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def exec_sleeper(path):
    """Become a Python that writes its pid to ``path``, then sleeps."""
    os.execv(sys.executable, [sys.executable, "-c", _SLEEPER, path, str(LONG)])


def child(where, what):
    path = os.path.join(where, "child.pid")
    if what == "exec":
        exec_sleeper(path)
    if what == "closerange":
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    write_file(path, str(os.getpid()))
    time.sleep(LONG)


def main():
    where, method, what, starter = sys.argv[1:5]
    p = mp.get_context(method).Process(target=child, args=(where, what), daemon=True)
    if sys.argv[5:] == ["thread"]:
        t = threading.Thread(target=p.start)
        t.start()
        t.join(60)
        assert not t.is_alive()
    else:
        p.start()
    write_file(os.path.join(where, "started"), str(threading.active_count()))
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(where, "go")):
        if time.monotonic() > deadline:
            raise TimeoutError("no go from the test")
        time.sleep(0.01)
    if starter == "exec":
        exec_sleeper(os.path.join(where, "starter.exec"))
    time.sleep(LONG)

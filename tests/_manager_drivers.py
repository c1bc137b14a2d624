"""Programs for the manager daemon tests, each run as ``python _manager_drivers.py NAME ARGS``.

Each is a whole program (its own daemon, since the tests start it without
$SHAREDMP_MANAGER) that reports on stdout as JSON lines and is killed by the test at
chosen moments. Everything is bounded by timeouts.
"""
import os
import queue
import random
import sys
import time

import numpy as np

import sharedmp as mp
from sharedmp.memory import manager

from _helpers import say

TIMEOUT = 20


def _produce(q, seed):
    """Allocate and send forever (until killed): small and big arrays, some kept, some dropped."""
    rng = random.Random(seed)
    kept = []
    for i in range(100000):
        n = rng.choice([16, 1000, 20000, 300000])      # arena-packed, and segments of their own
        a = mp.full(n, i, dtype=np.float32)
        q.put((i, a))
        if rng.random() < 0.3:
            kept.append(a)


def round_(seed):
    """One round: a fork child produces; this process receives (and maps) until the child dies."""
    mp.set_sharing_strategy("file_system")
    ctx = mp.get_context("fork")
    q = ctx.Queue(maxsize=8)
    p = ctx.Process(target=_produce, args=(q, seed), daemon=True)
    p.start()
    say(child=p.pid, daemon=manager.daemon_pid())
    received, errors, deadline = 0, [], time.monotonic() + TIMEOUT
    held = []
    while time.monotonic() < deadline:
        try:
            i, a = q.get(timeout=0.1)
        except queue.Empty:
            if not p.is_alive():
                break
            continue
        except (mp.ProtocolError, mp.SegmentError, EOFError, OSError) as e:
            errors.append(type(e).__name__)                 # the producer died mid-message
            if not p.is_alive():
                break
            continue
        if not (a == i).all():
            say(corrupt=i)
            sys.exit(3)
        received += 1
        if received % 3 == 0:
            held.append(a)
    p.join(TIMEOUT)
    say(received=received, errors=errors)


def _hold(q, ready, seconds):
    arrays = q.get(timeout=TIMEOUT)
    mine = mp.full(1 << 18, 7.0)                             # a segment this child made
    ready.put(os.getpid())
    parent = os.getppid()
    deadline = time.monotonic() + TIMEOUT
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(seconds)                                     # used after the parent's death
    ok = all((a == k).all() for k, a in enumerate(arrays)) and (mine == 7.0).all()
    os._exit(0 if ok else 3)


def parent(method):
    """Share arrays with two children, report their pids, then wait to be SIGKILLed."""
    mp.set_sharing_strategy("file_system")
    ctx = mp.get_context(method)
    arrays = [mp.full(100, 0.0), mp.full(1 << 18, 1.0), mp.full(5000, 2.0)]
    q, ready = ctx.Queue(), ctx.Queue()
    children = [ctx.Process(target=_hold, args=(q, ready, 0.3)) for _ in range(2)]
    for c in children:
        c.start()
        q.put(arrays)
    pids = sorted(ready.get(timeout=TIMEOUT) for _ in children)
    say(children=pids, daemon=manager.daemon_pid())
    time.sleep(TIMEOUT)


def daemon_killed():
    """Allocate, report the daemon; after a line on stdin (the daemon is dead by then), try
    again."""
    mp.set_sharing_strategy("file_system")
    kept = [mp.zeros(100), mp.zeros(1 << 18)]
    q = mp.get_context("spawn").SimpleQueue()
    say(daemon=manager.daemon_pid(), socket=manager.address())
    sys.stdin.readline()
    errors = {}
    for what, act in [("allocate", lambda: mp.zeros(1 << 18)), ("send", lambda: q.put(kept[1]))]:
        try:
            act()
            errors[what] = None
        except mp.ManagerError as e:
            errors[what] = str(e)
    say(errors=errors, kept_ok=bool((kept[0] == 0).all()))


if __name__ == "__main__":
    name, args = sys.argv[1], sys.argv[2:]
    {"round": lambda: round_(int(args[0])), "parent": lambda: parent(args[0]),
     "daemon_killed": daemon_killed}[name]()

"""Children of test_py314.py (importable by spawn and forkserver children)."""
import os
import signal
import time

import numpy as np

import sharedmp as mp


def wait_for_interrupt(ready, q, with_array):
    """Report whether SIGINT arrived as KeyboardInterrupt (with a shared array: over a
    sharedmp queue, which needs no sender alive once put() returned)."""
    try:
        ready.set()
        time.sleep(60)
        q.put(("slept", None))
    except KeyboardInterrupt:
        q.put(("KeyboardInterrupt", mp.full(10_000, 7.0) if with_array else None))


def sleep_forever(ready):
    ready.set()
    while True:
        time.sleep(1)


def pid_then_sleep(a):
    a[0] = os.getpid()
    time.sleep(60)
    return a


def square(a):
    return np.asarray(a) ** 2


def ignore_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)

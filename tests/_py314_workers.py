"""Children of test_py314.py (importable by spawn and forkserver children)."""
import os
import signal
import time

import numpy as np

import sharedmp as mp


def as_from_a_terminal():
    """SIGINT at Python's default, as in a program started from a terminal: one started in
    the background by a shell without job control (a CI script's `cmd &`) has it ignored, and
    its children inherit that, whichever library starts them."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


def wait_for_interrupt(ready, q, with_array):
    """Report whether SIGINT arrived as KeyboardInterrupt (with a shared array: over a
    sharedmp queue, which needs no sender alive once put() returned)."""
    as_from_a_terminal()
    try:
        ready.set()
        time.sleep(60)
        q.put(("slept", None))
    except KeyboardInterrupt:
        q.put(("KeyboardInterrupt", mp.full(10_000, 7.0) if with_array else None))


def sleep_forever(ready):
    as_from_a_terminal()
    ready.set()
    while True:
        time.sleep(1)


def pid_then_sleep(a):
    a[0] = os.getpid()
    time.sleep(60)
    return a


def square(a):
    return np.asarray(a) ** 2


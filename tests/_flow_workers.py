"""Children of the flow-control tests (test_flow.py): senders that count what returned."""
import os
import time

import numpy as np

import sharedmp as mp

TIMEOUT = 60


def rss_bytes(pid="self"):
    """The private resident memory (RssAnon) of process ``pid``, in bytes; None once it
    has exited. (Its shared memory is in the machine's Shmem: see shmem_bytes.)"""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except FileNotFoundError:
        pass
    return None


def send_payloads(conn, n, size, sent, window=None):
    """send_bytes ``n`` payloads of ``size`` bytes (payload i: bytes of value i); count each
    send that returned in ``sent``. ``window``: this process's $SHAREDMP_WINDOW_BYTES (a
    forkserver child has the environment of the fork server, not of the test)."""
    if window is not None:
        os.environ["SHAREDMP_WINDOW_BYTES"] = str(window)
    for i in range(n):
        conn.send_bytes(bytes([i]) * size)
        with sent.get_lock():
            sent.value += 1
    conn.close()


def put_arrays(q, n, nbytes, sent):
    """put() ``n`` plain (unshared) arrays of ``nbytes`` on ``q``; count each that returned."""
    for i in range(n):
        q.put(np.full(nbytes // 8, i, dtype=np.int64))
        with sent.get_lock():
            sent.value += 1


def flood(conn, nbytes, seconds, baseline, sent):
    """Send fresh plain arrays of ``nbytes`` over ``conn`` as fast as it takes them for
    ``seconds``; ``baseline`` gets this process's RSS before the first send, ``sent`` the
    number of sends that have returned."""
    baseline.value = rss_bytes()
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        conn.send(np.full(nbytes // 8, i, dtype=np.int64))
        i += 1
        sent.value = i
    conn.send(None)
    conn.close()


def send_and_exit(conn, n, nbytes):
    """Send ``n`` plain arrays and leave at once: the receiver keeps them all."""
    for i in range(n):
        conn.send(np.full(nbytes // 8, i, dtype=np.int64))
    conn.close()
    os._exit(0)


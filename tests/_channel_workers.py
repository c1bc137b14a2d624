"""Functions that run in child processes of the channel tests.

They live here, not in the test modules, so that a spawned child imports only numpy
and sharedmp (not pytest and the test modules). Every blocking call has a timeout, so
that a child never outlives a failed test for long; the parent kills it anyway.
"""
import hashlib
import os
import sys
import traceback

import numpy as np

import sharedmp as mp

TIMEOUT = 60


def _report(out, fn, *args):
    """Run fn; put ("ok", result) or ("error", traceback) on ``out`` (a queue or connection)."""
    send = out.send if hasattr(out, "send") else out.put
    try:
        result = fn(*args)
    except BaseException:
        send(("error", traceback.format_exc()))
        raise
    send(("ok", result))


def digest(b):
    return hashlib.sha256(b).hexdigest()


def pattern(n):
    """n bytes that are not all the same (so that a shifted copy would not compare equal)."""
    return (bytes(range(251)) * (n // 251 + 1))[:n]


# -- producers that exit the moment their last put() returns ----------------------------

def produce_then_exit(q, n):
    """put n arrays (mp.zeros filled with i), then os._exit(0) at once: no flush, no atexit."""
    for i in range(n):
        a = mp.zeros(8)
        a[...] = i
        q.put((i, a))
    os._exit(0)


def send_then_exit(conn, n):
    """The same through a Connection."""
    for i in range(n):
        a = mp.zeros(8)
        a[...] = i
        conn.send((i, a))
    os._exit(0)


# -- many producers, many consumers ----------------------------------------------------

def tag_bytes(producer, seq, size):
    """``size`` bytes that name their message: a frame of several records when large."""
    return bytes([producer, seq % 256]) * (size // 2)


def produce_tagged(q, producer, n, big=0):
    """put (producer, seq, array[, bytes]): every 10th message also carries ``big`` bytes."""
    for seq in range(n):
        item = (producer, seq, mp.full(4, producer * 100_000 + seq, dtype=np.int64))
        q.put(item + (tag_bytes(producer, seq, big),) if big and seq % 10 == 0 else item)


def tagged_ok(item):
    producer, seq, a = item[:3]
    ok = mp.is_shared(a) and bool((a == producer * 100_000 + seq).all())
    return ok and (len(item) == 3 or item[3] == tag_bytes(producer, seq, len(item[3])))


def consume_until_none(q, out, check):
    """Get items until None; put ("ok", [(producer, seq, check(item)), ...]) on ``out``."""
    def run():
        got = []
        while True:
            item = q.get(timeout=TIMEOUT)
            if item is None:
                return got
            got.append((item[0], item[1], check(item)))
    _report(out, run)


def consume_tagged(q, out):
    consume_until_none(q, out, tagged_ok)


# -- JoinableQueue -----------------------------------------------------------------------

def joinable_worker(q, results):
    """Double each item, put it on ``results``, task_done(); stop (and task_done) at None."""
    while True:
        item = q.get(timeout=TIMEOUT)
        try:
            if item is None:
                return
            results.put(item * 2)
        finally:
            q.task_done()


# -- Pipe peers --------------------------------------------------------------------------

def echo(conn):
    """Send back every object received, until None."""
    while True:
        if not conn.poll(TIMEOUT):
            raise TimeoutError("parent sent nothing")
        obj = conn.recv()
        if obj is None:
            return
        conn.send(obj)


def echo_bytes(conn):
    """Receive one bytes message and send it back."""
    if not conn.poll(TIMEOUT):
        raise TimeoutError("parent sent nothing")
    conn.send_bytes(conn.recv_bytes())


def send_big(conn, n):
    """Send n bytes with send_bytes and the same as a pickled object; wait for the ack."""
    data = pattern(n)
    conn.send_bytes(data)
    conn.send(data)
    if not conn.poll(TIMEOUT):
        raise TimeoutError("no ack")
    conn.recv()


def queue_roundtrip_big(qin, qout):
    """Get one (big) object from qin, report its digest and send it back through qout."""
    data = qin.get(timeout=TIMEOUT)
    qout.put(digest(data))
    qout.put(data)                     # synchronous here: returns once all is in the kernel


def close_and_exit(conn):
    conn.close()


def use_received_connection(q, value):
    """Get a Connection from q and send (pid, array) through it."""
    conn = q.get(timeout=TIMEOUT)
    conn.send((os.getpid(), mp.full(3, value)))
    if not conn.poll(TIMEOUT):
        raise TimeoutError("no ack")
    conn.recv()
    conn.close()


def use_channels(q, sq, jq, conn, reader):
    """Channels passed as Process arguments (or inherited under fork) work here."""
    q.put(("queue", mp.full(2, 1.0)))
    sq.put(("simple", mp.full(2, 2.0)))
    jq.put(("joinable", mp.full(2, 3.0)))
    conn.send(("pipe", mp.full(2, 4.0)))
    if not reader.poll(TIMEOUT):
        raise TimeoutError("nothing on the read-only end")
    a = reader.recv()
    a += 1                             # the parent sees it: same memory
    conn.send(("done", type(q).__module__, type(conn).__module__))


def strategy_child(q, done):
    """Report the sharing strategy and send an array allocated here; stay alive until told."""
    a = mp.full(5, 3.0)
    b = mp.full((256, 1024), 2.0)      # 2 MiB: a segment of its own
    from sharedmp.arrays import mapping_of
    q.put((mp.get_sharing_strategy(), mapping_of(a)[1].kind, a, b))
    done.wait(TIMEOUT)


# -- pool workers --------------------------------------------------------------------------

_init_value = None


def init_worker(value):
    global _init_value
    _init_value = value


def get_init(_):
    return _init_value, os.getpid()


def double(a):
    return a * 2                       # a plain array: by value if small, else shared memory


def add(a, b):
    return a + b


def make_full_shared(i):
    a = mp.full(3, i)
    return mp.is_shared(a), a


def write_into(a, i):
    a[i] = i + 1
    return os.getpid()


def pid_of(i):
    return os.getpid(), i


def pid_and_full(i):
    return os.getpid(), mp.full(3, i)


def is_shared(a):
    return mp.is_shared(a)


if __name__ == "__main__":
    sys.exit("not a script")


def get_forever(q, started):
    """Block in q.get() (the test kills this process there)."""
    started.set()
    q.get()


def put_until_blocked(q, started):
    """put() large messages until the socket is full and put() blocks (the test kills it there)."""
    started.set()
    while True:
        q.put(b"x" * 200_000)


def get_then_set(q, started, got):
    """Tell the test it is about to get(), get one item, then set ``got``."""
    started.set()
    q.get()
    got.set()


# -- a queue's rings (board.py): messages of every path from one producer ---------------

def mixed_item(producer, seq):
    """The seq-th message of a producer, by every path a queue has: a tuple and a small
    array (its ring), a shared array (fds: the socket), 40 KB of bytes (over a ring's
    record) and 200 KB (a frame whose payload lies in a memfd)."""
    kind = seq % 5
    if kind == 0:
        return (producer, seq, producer * 100_000 + seq)
    if kind == 1:
        return (producer, seq, np.full(8, producer * 100_000 + seq, dtype=np.int64))
    if kind == 2:
        return (producer, seq, mp.full(8, producer * 100_000 + seq, dtype=np.int64))
    return (producer, seq, tag_bytes(producer, seq, 40_000 if kind == 3 else 200_000))


def mixed_ok(item):
    producer, seq, value = item
    want = mixed_item(producer, seq)[2]
    if isinstance(want, np.ndarray):
        return isinstance(value, np.ndarray) and bool((value == want).all()) and \
            mp.is_shared(value) == (seq % 5 == 2)
    return value == want


def produce_mixed(q, producer, n, pause_every=0, hold=None):
    """put mixed_item(producer, 0..n-1) (pausing 1 ms every ``pause_every``); with ``hold``
    (an Event), put the first one, wait for it, then the rest: all such producers are alive
    together."""
    for seq in range(n):
        q.put(mixed_item(producer, seq))
        if hold is not None and seq == 0:
            hold.wait(TIMEOUT)
        if pause_every and seq % pause_every == 0:
            import time
            time.sleep(0.001)


def consume_mixed(q, out):
    consume_until_none(q, out, mixed_ok)


def produce_forever(q, ready):
    """put (seq, small array) as fast as it can until killed."""
    seq = 0
    while True:
        q.put((seq, np.full(16, seq, dtype=np.int64)))
        if seq == 100:
            ready.set()
        seq += 1

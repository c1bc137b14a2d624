"""sharedmp Queue, JoinableQueue and SimpleQueue: multiprocessing's semantics, fds in band.

In one process (the creator) a feeder thread sends; in every other process put() is
synchronous, so a producer may os._exit right after its last put(). Every wait here is
bounded: get() with a timeout, join_or_kill, join() in a thread that is joined with a
timeout.
"""
import os
import pickle
import queue
import signal
import sys
import threading
import time

import numpy as np
import pytest

import sharedmp as mp
from sharedmp.channels import fdpass, queues
from sharedmp.channels.connection import dumps

import _channel_workers as cw
from conftest import TIMEOUT, eventually, join_or_kill, proc_stat, run_bounded, start_process

POOL_DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_pool_driver.py")

UNPICKLABLE = (pickle.PicklingError, TypeError, AttributeError)
KINDS = ["Queue", "JoinableQueue", "SimpleQueue"]
TIMED = ["Queue", "JoinableQueue"]           # the kinds with get(timeout), maxsize, qsize, ...


def make(kind, method="fork", *args):
    return getattr(mp.get_context(method), kind)(*args)


def get(q, kind, timeout=TIMEOUT):
    """A bounded get for every kind (SimpleQueue.get has no timeout: poll its reader first)."""
    if kind == "SimpleQueue":
        assert q._reader.poll(timeout), "nothing arrived in time"
        return q.get()
    return q.get(timeout=timeout)


def finish(*procs):
    for p in procs:
        assert join_or_kill(p) == 0, f"child {p.pid} exited with {p.exitcode}"


def close_queue(q):
    q.close()
    if hasattr(q, "join_thread"):
        q.join_thread()


def test_types():
    assert type(mp.Queue()) is queues.Queue
    assert type(mp.JoinableQueue()) is queues.JoinableQueue
    assert type(mp.SimpleQueue()) is queues.SimpleQueue
    assert isinstance(mp.JoinableQueue(), queues.Queue)


# -- semantics in one process ----------------------------------------------------------------

@pytest.mark.parametrize("kind", TIMED)
def test_get_on_empty_raises_empty(kind):
    q = make(kind)
    t0 = time.monotonic()
    with pytest.raises(queue.Empty):
        q.get(timeout=0.1)
    assert time.monotonic() - t0 >= 0.09                # it did wait
    with pytest.raises(queue.Empty):
        q.get_nowait()
    with pytest.raises(queue.Empty):
        q.get(block=False)
    with pytest.raises(queue.Empty):
        q.get(True, 0)
    assert q.empty() and q.qsize() == 0 and not q.full()
    q.put("x")
    assert q.get(timeout=TIMEOUT) == "x"
    close_queue(q)


@pytest.mark.parametrize("kind", KINDS)
def test_roundtrip_objects_and_arrays(kind):
    q = make(kind)
    a = mp.zeros(4)
    plain = np.arange(12_000).reshape(2, 6000)       # 96 KB: over the by-value size
    small = np.arange(6).reshape(2, 3)
    q.put(("tuple", a, plain, None, {"d": [1.5]}, small))
    tag, a2, p2, none, d, s2 = get(q, kind)
    assert tag == "tuple" and none is None and d == {"d": [1.5]}
    assert mp.is_shared(a2) and mp.is_shared(p2) and not mp.is_shared(plain)
    assert p2.tolist() == plain.tolist()
    assert s2.tolist() == small.tolist() and not mp.is_shared(s2)   # by value
    a2[0] = 3                                            # same memory as the original
    assert a[0] == 3
    close_queue(q)


def test_simplequeue_empty_and_close():
    q = make("SimpleQueue")
    assert q.empty()
    q.put(1)
    assert eventually(lambda: not q.empty(), TIMEOUT, collect=False)
    assert q.get() == 1 and q.empty()
    q.close()
    with pytest.raises(OSError):
        q.put(2)


@pytest.mark.parametrize("kind", TIMED)
def test_maxsize_full(kind):
    q = make(kind, "fork", 2)
    assert q.empty() and not q.full() and q.qsize() == 0
    q.put(1)
    q.put_nowait(2)
    assert q.full() and q.qsize() == 2
    with pytest.raises(queue.Full):
        q.put_nowait(3)
    with pytest.raises(queue.Full):
        q.put(3, block=False)
    t0 = time.monotonic()
    with pytest.raises(queue.Full):
        q.put(3, timeout=0.1)
    assert time.monotonic() - t0 >= 0.09
    assert q.qsize() == 2
    assert eventually(lambda: not q.empty(), TIMEOUT, collect=False)
    assert q.get(timeout=TIMEOUT) == 1
    assert not q.full() and q.qsize() == 1
    q.put(3, timeout=0.1)
    assert [q.get(timeout=TIMEOUT) for _ in range(2)] == [2, 3]
    assert q.qsize() == 0 and not q.full()
    close_queue(q)


def test_blocked_put_resumes_when_a_get_makes_room():
    q = make("Queue", "fork", 1)
    q.put("first")
    t = threading.Timer(0.1, lambda: q.get(timeout=TIMEOUT))
    t.start()
    try:
        q.put("second", timeout=TIMEOUT)                 # blocks until the timer's get
    finally:
        t.join(TIMEOUT)
    assert q.get(timeout=TIMEOUT) == "second"
    close_queue(q)


def test_unbounded_qsize():
    q = make("Queue")
    for i in range(10):
        q.put(i)
    assert q.qsize() == 10 and not q.full()
    assert eventually(lambda: not q.empty(), TIMEOUT, collect=False)
    for i in range(10):
        assert q.get(timeout=TIMEOUT) == i
    assert q.qsize() == 0
    close_queue(q)


@pytest.mark.parametrize("kind", TIMED)
def test_close_then_put_raises_valueerror(kind):
    q = make(kind)
    q.put(mp.zeros(2))
    assert q.get(timeout=TIMEOUT).tolist() == [0, 0]
    q.put("unread")
    q.close()
    q.close()                                            # idempotent
    with pytest.raises(ValueError, match="closed"):
        q.put(1)
    with pytest.raises(ValueError, match="closed"):
        q.put_nowait(1)
    with pytest.raises(ValueError, match="closed"):
        q.get(timeout=0.1)
    q.join_thread()                                      # the feeder flushed and ended
    assert q._thread is None or not q._thread.is_alive()


def test_close_with_unread_items_is_quiet(capfd):
    """Closing a queue whose items nobody will read: no traceback from the feeder (as stdlib)."""
    q = make("Queue")
    for i in range(5):
        q.put(np.arange(3) + i)
    q.close()
    q.join_thread()
    assert "Traceback" not in capfd.readouterr().err


def test_close_without_put():
    q = make("Queue")
    q.close()
    q.join_thread()                                      # no feeder: nothing to join


@pytest.mark.parametrize("kind", TIMED)
@pytest.mark.parametrize("used", ["never", "directly", "by the feeder"])
def test_empty_after_close_as_multiprocessing(kind, used):
    """multiprocessing's close() is a no-op before the first put(): empty() is still True;
    after a put() (the feeder ended by join_thread) empty() raises OSError "is closed".
    3.11 to 3.15 alike; CPython 3.13's test_closed_queue_empty_exceptions checks it."""
    q = make(kind)
    if used == "directly":
        q.put("x")
        assert q._thread is None and q.get(timeout=TIMEOUT) == "x"
    elif used == "by the feeder":
        n = 0
        while q._thread is None:                         # a full socket starts the feeder
            q.put(b"x" * 60_000)
            n += 1
        for _ in range(n):
            assert q.get(timeout=TIMEOUT) == b"x" * 60_000
    q.close()
    q.join_thread()
    if used == "never":
        assert q.empty()
    else:
        with pytest.raises(OSError, match="is closed"):
            q.empty()


def test_join_thread_needs_close():
    q = make("Queue")
    q.put(1)
    with pytest.raises(AssertionError):                  # as multiprocessing
        q.join_thread()
    assert q.get(timeout=TIMEOUT) == 1
    close_queue(q)


@pytest.mark.parametrize("before_put", [True, False])
def test_cancel_join_thread(before_put):
    q = make("Queue")
    if before_put:
        q.cancel_join_thread()
    q.put("x")
    if not before_put:
        q.cancel_join_thread()
    assert q._joincancelled
    assert q.get(timeout=TIMEOUT) == "x"
    q.close()
    q.join_thread()                                      # returns at once; nothing to wait for
    if q._thread is not None:
        q._thread.join(TIMEOUT)


def test_joinable_task_done_and_join_in_one_process():
    q = make("JoinableQueue")
    for i in range(3):
        q.put(i)
    assert [q.get(timeout=TIMEOUT) for _ in range(3)] == [0, 1, 2]
    joined = threading.Event()

    def join():
        q.join()
        joined.set()

    t = threading.Thread(target=join, daemon=True)
    t.start()
    q.task_done()
    q.task_done()
    assert not joined.wait(0.2)                          # one task still open
    q.task_done()
    assert joined.wait(TIMEOUT)
    t.join(TIMEOUT)
    q.join()                                             # nothing open: returns at once
    with pytest.raises(ValueError, match="too many times"):
        q.task_done()
    q.put("again")                                       # still usable
    assert q.get(timeout=TIMEOUT) == "again"
    q.task_done()
    q.join()
    close_queue(q)


@pytest.mark.parametrize("kind", TIMED)
def test_one_process_puts_5000_then_gets_them_all(kind):
    """In the creator the feeder thread sends: put() never waits for a reader.

    (SimpleQueue.put is synchronous by design, as multiprocessing's: see the smaller case.)
    """
    q = make(kind)
    n = 5000
    for i in range(n):
        q.put((i, "x" * 100))                            # ~600 KB: beyond what one socket buffers
    assert q._thread is not None          # the socket filled: the rest went by the feeder
    got = [q.get(timeout=TIMEOUT) for _ in range(n)]
    assert [i for i, _ in got] == list(range(n))
    if kind == "JoinableQueue":
        for _ in range(n):
            q.task_done()
        q.join()
    close_queue(q)


def test_creator_puts_go_straight_into_a_socket_with_room():
    """No feeder thread while the socket takes each record at once (no thread hand-off)."""
    q = make("Queue")
    arrays = [mp.full(3, i) for i in range(20)]
    for a in arrays:
        q.put(a)
    assert q._thread is None
    for i in range(20):
        assert (q.get(timeout=TIMEOUT) == i).all()
    close_queue(q)


def test_one_process_puts_1000_arrays_then_gets_them_all():
    q = make("Queue")
    arrays = []
    for i in range(1000):
        a = mp.zeros(4)
        a[...] = i
        q.put(a)
        if i % 2:
            arrays.append(a)                             # half stay alive, half die before sent
    for i in range(1000):
        a = q.get(timeout=TIMEOUT)
        assert mp.is_shared(a) and (a == i).all()
    close_queue(q)


def test_simplequeue_small_burst_without_reader():
    q = make("SimpleQueue")
    for i in range(100):                                 # fits in the socket buffer
        q.put(i)
    assert [get(q, "SimpleQueue") for _ in range(100)] == list(range(100))
    q.close()


def test_value_is_frozen_at_put():
    """put() pickles in the caller: a later change is not sent (the stdlib Queue would send it)."""
    q = make("Queue")
    obj = [1, 2]
    q.put(obj)
    obj.append(3)
    assert q.get(timeout=TIMEOUT) == [1, 2]
    close_queue(q)


@pytest.mark.parametrize("kind", KINDS)
def test_unpicklable_raises_in_put_and_queue_keeps_working(kind):
    q = make(kind, "fork", *([2] if kind != "SimpleQueue" else []))
    for bad in (lambda: 1, threading.Lock(), [mp.zeros(3), threading.Lock()]):
        with pytest.raises(UNPICKLABLE):
            q.put(("bad", bad))
        if kind != "SimpleQueue":
            assert q.qsize() == 0 and not q.full()      # the slot was given back
    q.put("a")
    q.put(("b", mp.full(2, 7)))
    if kind != "SimpleQueue":
        assert q.qsize() == 2 and q.full()
    assert get(q, kind) == "a"
    tag, arr = get(q, kind)
    assert tag == "b" and arr.tolist() == [7, 7]
    if kind == "JoinableQueue":                          # only the two good puts count as tasks
        q.task_done()
        q.task_done()
        with pytest.raises(ValueError):
            q.task_done()
    close_queue(q)


def test_threads_put_and_get_on_one_queue():
    q = make("Queue", "fork", 50)
    producers, consumers, n = 4, 3, 300
    results = [[] for _ in range(consumers)]
    errors = []

    def produce(t):
        try:
            for seq in range(n):
                q.put((t, seq, mp.full(2, t * 1000 + seq)), timeout=TIMEOUT)
        except BaseException as e:                      # pragma: no cover - reported below
            errors.append(e)

    def consume(c):
        try:
            while True:
                item = q.get(timeout=TIMEOUT)
                if item is None:
                    return
                results[c].append(item)
        except BaseException as e:                      # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=consume, args=(c,), daemon=True) for c in range(consumers)]
    threads += [threading.Thread(target=produce, args=(t,), daemon=True) for t in range(producers)]
    for t in threads:
        t.start()
    for t in threads[consumers:]:
        t.join(TIMEOUT)
    for _ in range(consumers):
        q.put(None, timeout=TIMEOUT)
    for t in threads:
        t.join(TIMEOUT)
        assert not t.is_alive()
    assert not errors, errors
    seen = [(t, s) for r in results for t, s, _ in r]
    assert sorted(seen) == [(t, s) for t in range(producers) for s in range(n)]
    for r in results:
        for t, s, a in r:
            assert (a == t * 1000 + s).all()
        for t in range(producers):
            seqs = [s for tt, s, _ in r if tt == t]
            assert seqs == sorted(seqs)                  # per producer, order is kept
    close_queue(q)


# -- across processes --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_producer_exits_right_after_last_put(start_method, kind):
    ctx = mp.get_context(start_method)
    q = getattr(ctx, kind)()
    n = 1000
    p = start_process(ctx, cw.produce_then_exit, q, n)
    got = [get(q, kind) for _ in range(n)]
    assert join_or_kill(p) == 0
    assert [i for i, _ in got] == list(range(n))
    for i, a in got:
        assert mp.is_shared(a) and a.shape == (8,) and (a == i).all()
    if kind == "JoinableQueue":
        for _ in range(n):
            q.task_done()
        q.join()
    close_queue(q)


def test_4_producers_4_consumers(start_method):
    _four_producers_four_consumers(start_method, big=0)


def test_4_producers_4_consumers_with_frames_of_several_records():
    """Every 10th message is a frame of several records (200 KB of bytes): concurrent
    producers and consumers must never interleave them. (Under fork only: the records are
    the channel's business, not the start method's; eight processes more under spawn would
    double the file's time.)"""
    assert len(dumps(cw.tag_bytes(0, 0, 200_000))[0]) > 3 * fdpass.RECORD   # several records
    _four_producers_four_consumers("fork", big=200_000)


def _four_producers_four_consumers(method, big):
    ctx = mp.get_context(method)
    q, out = ctx.Queue(), ctx.Queue()
    nprod, ncons, n = 4, 4, 150
    consumers = [start_process(ctx, cw.consume_tagged, q, out) for _ in range(ncons)]
    producers = [start_process(ctx, cw.produce_tagged, q, pid, n, big) for pid in range(nprod)]
    try:
        finish(*producers)
        for _ in range(ncons):
            q.put(None)
        reports = [out.get(timeout=TIMEOUT) for _ in range(ncons)]
        finish(*consumers)
    finally:
        for p in producers + consumers:
            join_or_kill(p, 5)
    for status, value in reports:
        assert status == "ok", value
    everything = [(pid, seq) for _, got in reports for pid, seq, _ in got]
    assert len(everything) == len(set(everything)) == nprod * n          # nothing duplicated
    assert set(everything) == {(p, s) for p in range(nprod) for s in range(n)}  # nothing lost
    for _, got in reports:
        assert all(ok for _, _, ok in got)                                 # values right, shared
        for pid in range(nprod):
            seqs = [s for p, s, _ in got if p == pid]
            assert all(a < b for a, b in zip(seqs, seqs[1:]))              # per producer, in order
    close_queue(q)
    close_queue(out)


def test_joinable_join_returns_once_all_tasks_are_done_across_processes(start_method):
    ctx = mp.get_context(start_method)
    q, results = ctx.JoinableQueue(), ctx.Queue()
    workers = [start_process(ctx, cw.joinable_worker, q, results) for _ in range(2)]
    try:
        n = 20
        for i in range(n):
            q.put(i)
        for _ in workers:
            q.put(None)
        joiner = threading.Thread(target=q.join, daemon=True)
        joiner.start()
        joiner.join(TIMEOUT)
        assert not joiner.is_alive(), "JoinableQueue.join() did not return"
        # every task_done() came after its result was put (synchronously, in the child)
        got = sorted(results.get(timeout=TIMEOUT) for _ in range(n))
        assert got == [2 * i for i in range(n)]
        finish(*workers)
        with pytest.raises(ValueError):
            q.task_done()
    finally:
        for p in workers:
            join_or_kill(p, 5)
    close_queue(q)
    close_queue(results)


def test_big_message_through_queues_both_ways():
    ctx = mp.get_context("spawn")
    qin, qout = ctx.Queue(), ctx.Queue()
    p = start_process(ctx, cw.queue_roundtrip_big, qin, qout)
    try:
        data = cw.pattern(50 << 20)
        qin.put(data)                                 # the feeder sends it; put returns at once
        assert qout.get(timeout=TIMEOUT) == cw.digest(data)
        back = qout.get(timeout=TIMEOUT)
        assert back == data
        finish(p)
    finally:
        join_or_kill(p, 5)
    close_queue(qin)
    close_queue(qout)


def test_connection_through_a_queue_is_usable_in_the_child(start_method):
    ctx = mp.get_context(start_method)
    q = ctx.Queue()
    mine, theirs = mp.Pipe()
    p = start_process(ctx, cw.use_received_connection, q, 11)
    try:
        q.put(theirs)
        theirs.close()             # the in-band copy travels on its own (dup'ed for the feeder)
        assert mine.poll(TIMEOUT)
        pid, arr = mine.recv()
        assert pid == p.pid and arr.tolist() == [11, 11, 11] and mp.is_shared(arr)
        mine.send("ack")
        finish(p)
    finally:
        mine.close()
        join_or_kill(p, 5)
    close_queue(q)


_LOW_LIMIT_SCRIPT = r"""
import os, resource, sys, time
import sharedmp as mp

def produce(q, n):
    for i in range(n):
        a = mp.zeros(4)
        a[...] = i
        q.put(a)
    os._exit(0)

def held_up_or_done(pid):           # the producer waits for its reader (asleep, not on a
                                     # lock), or it has ended
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/{pid}/wchan") as f:
            wchan = f.read()
    except OSError:
        return True
    return state in "ZX" or (state == "S" and "futex" not in wchan)

soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
n = 1500
ctx = mp.get_context("fork")
q = ctx.Queue()                       # (1) the creator puts all, then gets all
for i in range(n):
    a = mp.zeros(4)
    a[...] = i
    q.put(a)
ok1 = all((q.get(timeout=60) == i).all() for i in range(n))
q2 = ctx.Queue()                      # (2) a child producer far ahead of its consumer
p = ctx.Process(target=produce, args=(q2, n))
p.start()
deadline = time.monotonic() + 10     # let it get as far ahead as it can before reading
while not held_up_or_done(p.pid) and time.monotonic() < deadline:
    time.sleep(0.01)
ok2 = all((q2.get(timeout=60) == i).all() for i in range(n))
p.join(60)
print("RESULT", ok1, ok2, p.exitcode)
"""


def _without_fd_privileges():
    """A command prefix that drops CAP_SYS_RESOURCE/CAP_SYS_ADMIN (root is exempt from the
    kernel's limit on fds in flight), or [] where that is not needed or not possible."""
    import shutil
    import subprocess
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        return []
    # With a uid of its own where this Python runs as one (not one under /root): the kernel
    # counts fds in flight per user, and other test runs on the machine as root would share
    # this one's count.
    caps = ["--bounding-set=-sys_resource,-sys_admin", "--inh-caps=-sys_resource,-sys_admin"]
    for prefix in (["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *caps],
                   ["setpriv", *caps]):
        try:
            if subprocess.run(prefix + [sys.executable, "-c", "import sharedmp"],
                              capture_output=True, timeout=60).returncode == 0:
                return prefix
        except (OSError, subprocess.SubprocessError):
            pass
    return []


@pytest.mark.timeout(4 * TIMEOUT)
def test_many_arrays_in_flight_under_a_low_fd_limit():
    """RLIMIT_NOFILE 256, 1,500 arrays of one arena ahead of the reader:
    - the creator's buffered messages share one dup of the arena fd (not 1,500 dups: EMFILE);
    - past RLIMIT_NOFILE fds in flight the kernel says ETOOMANYREFS (without CAP_SYS_RESOURCE):
      the sender waits for the reader instead of failing (child) or dropping items (feeder).
    """
    import subprocess
    import sys
    # (3,000 messages and a child: a busy machine, or the other pytest worker, slows it)
    proc = subprocess.run(_without_fd_privileges() + [sys.executable, "-c", _LOW_LIMIT_SCRIPT],
                          capture_output=True, text=True, timeout=3 * TIMEOUT)
    assert proc.returncode == 0 and "RESULT True True 0" in proc.stdout, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


_FLUSH_AT_EXIT_SCRIPT = r"""
import os, sys
from multiprocessing import util
import numpy as np
import sharedmp as mp

n = 60
ctx = mp.get_context("fork")
q = ctx.Queue()
r, w = os.pipe()

def consume(q, n):
    os.read(r, 1)                     # the parent is exiting: its atexit hooks have run
    ok = True
    for i in range(n):
        a, b = q.get(timeout=60)
        ok = ok and bool((a == i).all()) and b == bytes([i]) * 100_000
    print("CHILD", ok, flush=True)

p = ctx.Process(target=consume, args=(q, n))
p.start()
for i in range(n):
    # an array copied into shared memory (its fd held for the feeder: a dup), and a
    # payload over one record (written into the sender's arena by the feeder, at send)
    q.put((np.full(8192, i, np.float64), bytes([i]) * 100_000))
print("PARENT buffered", len(q._buffer), flush=True)
# First of multiprocessing's exit finalizers, so after the interpreter's atexit hook of
# weakref.finalize (registered later, run earlier) and before the feeder is joined.
util.Finalize(None, os.write, (w, b"x"), exitpriority=100)
"""


@pytest.mark.timeout(4 * TIMEOUT)
def test_the_feeder_flushes_at_exit_with_its_fds_open():
    """A creator that puts and exits: as multiprocessing's, its exit waits for the feeder to
    send what put() buffered (here a window of 1 byte keeps it one message ahead of the
    reader, which reads only once the exit has begun). weakref.finalize's atexit hook runs
    before multiprocessing's exit handler: had it run the finalizers of the fds the feeder
    holds (the dups of ``_Held``, the window's tokens) and of the arena it writes payloads
    into, the feeder would drop every message left (EBADF; the arena's Segment released)."""
    import subprocess
    env = dict(os.environ, SHAREDMP_WINDOW_BYTES="1")
    proc = subprocess.run([sys.executable, "-c", _FLUSH_AT_EXIT_SCRIPT], capture_output=True,
                          text=True, timeout=3 * TIMEOUT, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "CHILD True" in proc.stdout, out
    assert "Traceback" not in proc.stderr and "dropped" not in proc.stderr, out
    buffered = int(proc.stdout.split("PARENT buffered ")[1].split()[0])
    assert buffered >= 50, out          # (what the test is about: most were left to the exit)


@pytest.mark.parametrize("kind", KINDS)
def test_a_queue_cannot_be_put_on_a_queue(kind):
    """As multiprocessing: queues travel by inheritance or as Process arguments only."""
    q, other = make(kind), make("Queue")
    with pytest.raises(RuntimeError, match="inheritance"):
        q.put(other)
    q.put("fine")
    assert get(q, kind) == "fine"
    close_queue(q)
    close_queue(other)


# -- a process killed in the middle of get() or put() ---------------------------------------------
# A message is one record of the socket, read and written whole by one system call, so no lock
# is held across it: multiprocessing's queues keep their lock when its holder is killed there,
# and every other consumer (or producer) of the queue then waits forever.

def _asleep_in_the_kernel(pid):
    """Whether the main thread of ``pid`` sleeps in a system call other than a futex wait (a
    lock, or the GIL): blocked on a socket (or in poll for one)."""
    st = proc_stat(pid)
    if st is None or st[0] != "S":
        return False
    try:
        with open(f"/proc/{pid}/wchan") as f:
            return "futex" not in f.read()
    except OSError:                     # no wchan here: the state alone
        return True


def _killed_in(kind, target, sent=False):
    """A fresh ``kind`` queue and a fork child running ``target(q, started)`` on it, SIGKILLed
    once it blocks there (after ``started``, nothing else puts it to sleep) and, if ``sent``,
    once something reached the queue; returns the queue. (Fork only: how the child started
    plays no part in where it is killed.)"""
    ctx = mp.get_context("fork")
    q, started = getattr(ctx, kind)(), ctx.Event()
    p = start_process(ctx, target, q, started)
    try:
        assert started.wait(TIMEOUT)
        # (a Queue's put() may first block on its flight window, before its feeder thread
        # has sent anything: not yet the blocked put() this is about)
        assert eventually(lambda: _asleep_in_the_kernel(p.pid) and not (sent and q.empty()),
                          TIMEOUT, collect=False), "the child never blocked in the queue"
        os.kill(p.pid, signal.SIGKILL)
        p.join(TIMEOUT)
        assert p.exitcode == -signal.SIGKILL
    finally:
        join_or_kill(p, 5)
    return q


def _in_a_thread(fn):
    """fn()'s result, or what it raised, from a thread: a hang there fails the test, not the
    suite."""
    out = queue.Queue()
    threading.Thread(target=lambda: out.put(_outcome(fn)), daemon=True).start()
    try:
        status, value = out.get(timeout=TIMEOUT)
    except queue.Empty:
        pytest.fail("blocked: the killed process kept the queue's lock", pytrace=False)
    if status == "raised":
        raise value
    return value


def _outcome(fn):
    try:
        return "ok", fn()
    except BaseException as e:          # noqa: BLE001 -- re-raised in the test's thread
        return "raised", e


@pytest.mark.parametrize("kind", ["Queue", "SimpleQueue", "JoinableQueue"])
def test_consumer_killed_in_get_does_not_block_the_others(kind):
    q = _killed_in(kind, cw.get_forever)
    q.put(("after", 1))
    assert _in_a_thread(q.get) == ("after", 1)


@pytest.mark.parametrize("kind", ["Queue", "SimpleQueue"])
def test_producer_killed_in_a_blocked_put_does_not_block_the_others(kind):
    q = _killed_in(kind, cw.put_until_blocked, sent=True)   # the socket fills; put() blocks

    def drain_then_put():
        got = []
        while not q.empty():
            got.append(q.get())
        q.put("after")
        return got
    got = _in_a_thread(drain_then_put)
    # whole messages only, however it was killed
    assert got and all(x == b"x" * 200_000 for x in got)
    assert q.get() == "after"


# -- get() takes _rlock, as multiprocessing's does ----------------------------------------------
# multiprocessing.pool's _help_stuff_finish holds the task queue's _rlock and drains it with
# poll() then recv(): a worker that took a record in between would leave that recv() blocked
# for good (Pool.terminate() hung so, issue 26).

@pytest.mark.parametrize("kind", KINDS)
def test_get_waits_while_another_process_holds_rlock(start_method, kind):
    ctx = mp.get_context(start_method)
    q, started, got = getattr(ctx, kind)(), ctx.Event(), ctx.Event()
    q.put("x")
    assert eventually(lambda: not q.empty(), collect=False)
    q._rlock.acquire()
    p = start_process(ctx, cw.get_then_set, q, started, got)
    try:
        try:
            assert started.wait(TIMEOUT)
            assert not got.wait(0.5), "get() returned while another process held _rlock"
            assert not q.empty()
        finally:
            q._rlock.release()
        assert got.wait(TIMEOUT), "get() did not return once _rlock was released"
        assert q.empty()
    finally:
        join_or_kill(p, 5)


@pytest.mark.parametrize("kind", TIMED)
def test_get_with_a_timeout_counts_the_wait_for_rlock(kind):
    q = make(kind)
    q.put("x")
    assert eventually(lambda: not q.empty(), collect=False)
    with q._rlock:
        with pytest.raises(queue.Empty):
            q.get_nowait()
        t0 = time.monotonic()
        with pytest.raises(queue.Empty):
            q.get(timeout=0.2)
        assert 0.15 < time.monotonic() - t0 < 5
    assert q.get(timeout=TIMEOUT) == "x"
    with pytest.raises(queue.Empty):
        q.get(timeout=0.05)
    close_queue(q)


# Fork rounds are cheap (~20 ms here), spawn and forkserver ones ~0.2 s: 30-40 s in all.
POOL_ROUNDS = {"fork": 400, "spawn": 80, "forkserver": 80}


def test_pool_terminated_with_tasks_pending_never_hangs(start_method):
    rounds = POOL_ROUNDS[start_method]
    rc, out, err = run_bounded([sys.executable, POOL_DRIVER, start_method, str(rounds), "20"],
                               timeout=100, what=f"{rounds} Pool rounds ({start_method})")
    assert rc == 0 and out.split() == ["ok", str(rounds)], f"rc {rc}, stderr:\n{err[-3000:]}"

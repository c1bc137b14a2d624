"""``python -m sharedmp stress [--seconds S] [--seed N] [--fork-threads W] [--json FILE]``:
load, SIGKILLs, forks (beside threads that allocate), and a count of what went wrong.

The run is a series of rounds ("epochs"), alternating the two sharing strategies (and
the spawn and forkserver start methods). Each epoch is one program::

    stress (this process)          never touches shared memory; checks leftovers after each epoch
      └─ leader (spawn)            the epoch's program: shared counters, wiring, SIGKILLs, verdict
           ├─ producer × P         T threads each; random arrays (dtypes, sizes, views) and objects
           ├─ consumer × C         K threads each; checks every message end to end
           └─ forker               fork events (never killed)

Every producer has its own one-way sharedmp ``Pipe`` to every consumer, so that how a
channel ends tells of one producer and one consumer. A producer's threads send on its
channels at the same time, with no lock: one frame is one SOCK_SEQPACKET record sent by
one ``sendmsg`` (``channels/fdpass.py``), so concurrent senders never interleave, and a
writer killed in the middle of a ``send()`` leaves the channel intact for the others.
A message is ``(producer, thread, seq, items, digests, must_share, patterns)``; each item
is an array or an ordinary object and its digest (blake2b of dtype, shape, flags and bytes;
of the pickle for objects). Every array anyone makes holds a pattern of its own (a 64-bit
id repeated through its bytes, ``pattern``), so that memory recycled under a holder shows:
a consumer checks the whole pattern of each array when it receives it and again when it
drops it (each thread keeps its last ``HOLD`` messages), a producer before it drops what
it sent; a mismatch is counted as corrupted. Per stream (producer, thread, consumer), the
producer counts the messages whose ``send()`` returned and the consumer the ones it
received in order, in shared counters that outlive a SIGKILL. The leader SIGKILLs random
producers and consumers while they run; once all have ended it judges every stream:

- neither end killed: received == sent, every digest right, no duplicate, no gap;
- producer killed: nothing whose ``send()`` returned may be lost (received is sent, or
  sent + 1: the message on its way when the kill came); its channels end in EOF like any
  other. A ``ProtocolError`` there is counted apart (``truncated_frames``, which a record
  sent whole or not at all keeps at 0) and its text kept (``truncated_notes``);
- consumer killed: what was sent to it and not received is counted apart
  (``lost_to_killed_consumers``): it died with it.

Fork events (the forker, in the epoch's strategy, until the window ends): it makes arrays
of each size class (by value: private memory; 16 KiB: carved from an arena; 4 MiB: a
segment of its own), checks them, and forks, by ``os.fork()`` and by a fork-context
``Process`` in turn. At once it drops them and makes new arrays of the same classes,
``RECYCLE_ROUNDS`` times (the recycler hands out what it may), while the child keeps its
inherited copies; then the child checks every one still holds its own pattern and reports
on a pipe. A change is counted as corrupted (``fork_corrupted``); a child that never
reports (``fork_unreported``) or ends badly, and new memory of the parent that overlaps
memory the child still maps (``fork_reused_while_held``, from ``/proc/self/maps``) are
problems. Every wait is bounded (``FORK_TIMEOUT``); a child still there is SIGKILLed by pid.

Forks beside threads (``--fork-threads``: every other pair of fork events by default,
``always`` or ``never``): the forker has helper threads, two that make and drop arrays (1 MiB:
a segment of its own, 8 KiB: carved; the last ``THREAD_KEEP`` kept) and one that receives
them from a feeder process (started with the epoch's start method), and they run through
those events, from before the forks until the children have reported. Such an event forks
``THREADED_CHILDREN`` children, one at a time (``os.fork`` and Processes in turn;
``fork_events`` counts children; the first also keeps the event's arrays, the others wait
until the threads have dropped and made anew twice what they hold): each keeps the threads'
arrays as they were at its fork, checks them with the rest, and a change is counted as
corrupted too (``fork_thread_corrupted`` of ``fork_thread_checks``). (Such children found
the fork hook's race with a thread that allocates: a segment made, mapped or taken from the
pool between the hook's list of what the child inherits and the fork was not held for it,
and the parent recycled it.) The threads check each array they drop (``pattern_checks``).

Leftovers, after each epoch's program has ended: ``sharedmp_*`` files in the run's private
shared-memory directory, fds of this process on segments, live processes of the run
(found by a token in their environment: workers, fork server, manager daemon) and, in
the leader once its workers are gone, the references its manager daemon still tracks.
``left`` sums them (the daemon's only where no process was killed); processes of the run
still alive are SIGKILLed by pid.
"""
import contextlib
import gc
import hashlib
import json
import os
import pickle
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time

import numpy as np

from .. import _compat
from ..wire import INBAND_MAX as BY_VALUE_MAX   # plain arrays up to this may travel by value

RUN_ENV = "SHAREDMP_STRESS_RUN"
PRODUCERS, PRODUCER_THREADS = 3, 2
CONSUMERS, CONSUMER_THREADS = 3, 2
WINDOW = 32                  # messages a stream may have in flight (bounds memory in flight)
STARTUP = 3.0                # seconds an epoch spends starting and ending its processes (estimate)
GRACE = 60.0                 # seconds past the sending window before a process counts as hung
# Shared counters: per stream (producer, thread, consumer)...
SENT, SENT_BYTES, RECV, RECV_BYTES = range(4)
# ...per consumer...
CORRUPT, DUPLICATE, GAP, ERRORS = range(4)
# ...and how each channel (producer, consumer) ended, as its consumer saw it.
OPEN, EOF, TRUNCATED, FAILED = range(4)
# ...and, per process (producers, consumers, the forker) and thread, pattern checks made and
# failed (every array is filled with a pattern of its own: ``pattern``)...
CHECKS, BAD = range(2)
# ...and the forker's fork events (those beside its helper threads: F_THREADED; the arrays
# the threads made or received, those of them fork children checked and found changed).
(F_EVENTS, F_OS_FORK, F_PROCESS, F_CHILD_CHECKS, F_CHILD_BAD, F_UNREPORTED, F_REUSED,
 F_CHILD_FAILED, F_THREADED, F_THREAD_ARRAYS, F_THREAD_CHECKS, F_THREAD_BAD) = range(12)
F_COUNTERS = 12
HOLD = 4                     # messages a producer or consumer thread keeps before dropping
FORK_TIMEOUT = 30.0          # seconds a fork child may take to check and report
RECYCLE_ROUNDS = 3           # rounds of new arrays the forker makes while its child holds
FORK_CLASSES = (("value", 256), ("arena", 16 << 10), ("own", 4 << 20))   # name, bytes
FORK_THREADS = ("alternate", "always", "never")     # fork events beside helper threads
THREAD_CLASSES = (("own", 1 << 20), ("arena", 8 << 10))   # what a helper thread makes a step
THREAD_KEEP = 8              # arrays a helper thread keeps before dropping the oldest
THREADED_CHILDREN = 12       # children a fork event beside the threads forks (one otherwise)
DTYPES = ["|u1", "<i2", ">i4", "<i8", "<f4", "<f8", "<c8", ">c16", "|b1", "<f2", "|S5",
          [("a", "<i4"), ("b", "<f8"), ("c", "|u1")]]


# ------------------------------------------------------------------------------- messages

def digest(x):
    """What the consumer must see again: an array's dtype, shape, flag and bytes; an object's
    pickle."""
    h = hashlib.blake2b(digest_size=16)
    if isinstance(x, np.ndarray):
        h.update(repr((x.dtype.descr, x.shape, x.flags.writeable)).encode())
        h.update(x.tobytes())
    else:
        h.update(pickle.dumps(x, 4))
    return h.digest()


def pattern_id(*parts):
    """A 64-bit id unique to one array (of a run, epoch, process, thread, message, item)."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(),
                          "little") | 1


def pattern(pid, dtype, shape):
    """The array of ``dtype`` and ``shape`` whose bytes are ``pid`` repeated (its 64 bits as 64
    bytes of 0/1 for bools, whose other bytes are not canonical)."""
    dtype = np.dtype(dtype)
    unit = pid.to_bytes(8, "little") if dtype.kind != "b" else \
        bytes((pid >> i) & 1 for i in range(64))
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = (unit * (size // len(unit) + 1))[:size]          # read-only: copy to write
    return np.frombuffer(raw, np.uint8).view(dtype).reshape(shape)


def _view(a, op):
    if op == "rev":
        return a[::-1]                                   # negative strides
    if op == "step":
        return a[1::2]                                   # a gap between items
    if op == "T":
        return a.T
    if op == "ro":
        a = a.view()
        a.flags.writeable = False
    return a


def expected(spec):
    """What an array made by ``spec`` = (pattern id, dtype, shape, view ops) holds."""
    pid, dtype, shape, ops = spec
    a = pattern(pid, dtype, shape)
    for op in ops:
        a = _view(a, op)
    return a


def holds_pattern(x, spec):
    """Whether the array ``x`` holds, whole, the pattern ``spec`` put in it (a pattern check)."""
    want = expected(spec)
    return isinstance(x, np.ndarray) and x.dtype == want.dtype and x.shape == want.shape \
        and x.tobytes() == want.tobytes()


def make_array(rng, mp, pid=None):
    """A random array: shared or not, any dtype, 0-d to 3-d, up to 2 MiB, sometimes a view,
    filled with the pattern of ``pid`` (a fresh random id if None); (array, its pattern spec)."""
    pid = int(rng.integers(1, 2**63)) if pid is None else pid
    dtype = np.dtype(DTYPES[rng.integers(len(DTYPES))])
    r = rng.random()
    if r < 0.03:
        n = int(rng.integers(1 << 20, 2 << 20)) // dtype.itemsize           # its own segment
    elif r < 0.08:
        n = 0
    else:
        n = int(rng.integers(1, 1 << int(rng.integers(1, 15))))             # arena-sized
    shape = (n,) if rng.random() < 0.6 or n < 4 else (n // 4, 4)
    if n == 1 and rng.random() < 0.3:
        shape = ()
    src = pattern(pid, dtype, shape)
    if rng.random() < 0.7:
        a = mp.empty(shape, dtype)                       # shared from the start
        a[...] = src
    else:
        a = src.copy()                                   # copied once into shared memory when sent
    ops = []
    v = rng.random()
    if a.ndim >= 1 and a.shape[0] > 2 and v < 0.3:
        ops.append("rev" if v < 0.15 else "step")
    elif a.ndim == 2 and v < 0.4:
        ops.append("T")
    if rng.random() < 0.2:
        ops.append("ro")
    for op in ops:
        a = _view(a, op)
    return a, (pid, dtype, shape, tuple(ops))


def make_object(rng):
    k = int(rng.integers(4))
    if k == 0:
        return {"text": rng.bytes(int(rng.integers(1, 40))).hex(),
                "n": int(rng.integers(-2**62, 2**62))}
    if k == 1:
        return [float(x) for x in rng.random(int(rng.integers(0, 20)))]
    if k == 2:
        return bytes(rng.integers(0, 256, int(rng.integers(0, 3000)), dtype=np.uint8))
    return ("tuple", int(rng.integers(1000)), None, True, {"nested": [1, 2.5, "three"]})


def make_message(rng, mp, p, t, seq, epoch=0):
    items, specs = [], []
    for i in range(int(rng.integers(1, 5))):
        if rng.random() < 0.6:
            a, spec = make_array(rng, mp, pattern_id(epoch, p, t, seq, i))
        else:
            a, spec = make_object(rng), None
        items.append(a)
        specs.append(spec)
    nbytes = sum(x.nbytes for x in items if isinstance(x, np.ndarray))
    # Which arrays must arrive shared: those shared already, and plain ones too large to
    # travel by value (a smaller plain one may, or may not, by the message's budget).
    must_share = [isinstance(x, np.ndarray) and (mp.is_shared(x) or x.nbytes > BY_VALUE_MAX)
                  for x in items]
    return (p, t, seq, items, [digest(x) for x in items], must_share, specs), nbytes


def check_patterns(msg):
    """(pattern checks made, how many failed) over the arrays of a message."""
    items, specs = msg[3], msg[6]
    n = bad = 0
    for x, spec in zip(items, specs):
        if spec is not None:
            n += 1
            bad += not holds_pattern(x, spec)
    return n, bad


# ------------------------------------------------------------------------------- workers

def _report(conn, errors):
    try:
        conn.send({"errors": errors[:20]})
        conn.close()
    except OSError:
        pass


def _start_when_told(clock, i):
    """Say this worker is ready; the deadline the leader sets once all are (0: give up)."""
    clock[1 + i] = 1
    while clock[0] == 0:
        time.sleep(0.005)
    return clock[0]


def _drop_checked(held, row, keep=0):
    """Drop the oldest messages of ``held`` but ``keep``, each checked once more first."""
    while len(held) > keep:
        n, bad = check_patterns(held.popleft())
        row[CHECKS] += n
        row[BAD] += bad


def producer(p, links, counters, checks, clock, seed, report):
    """Send to every consumer from PRODUCER_THREADS threads until the deadline."""
    import collections
    import sharedmp as mp
    deadline = _start_when_told(clock, p)
    errors = []
    dead = [False] * len(links)

    def thread(t):
        rng = np.random.default_rng([seed, p, t])
        held = collections.deque()           # what it sent last, checked again when dropped
        try:
            send_all(t, rng, held)
        finally:
            _drop_checked(held, checks[p, t])

    def send_all(t, rng, held):
        while time.monotonic() < deadline and not all(dead):
            c = int(rng.integers(len(links)))
            row = counters[p, t, c]
            if dead[c] or row[SENT] - row[RECV] >= WINDOW:
                time.sleep(0.001)
                continue
            msg, nbytes = make_message(rng, mp, p, t, int(row[SENT]), (seed, c))
            held.append(msg)
            _drop_checked(held, checks[p, t], HOLD)
            try:
                links[c].send(msg)           # no lock: the other threads send on it too
            except (BrokenPipeError, ConnectionResetError):   # the consumer was killed
                dead[c] = True
                continue
            except Exception as e:           # noqa: BLE001 -- a problem of the verdict
                errors.append(f"producer {p} thread {t}: {e!r}")
                return
            row[SENT] += 1                   # counted once send() returned: must not be lost
            row[SENT_BYTES] += nbytes

    threads = [threading.Thread(target=thread, args=(t,)) for t in range(PRODUCER_THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for conn in links:
        conn.close()
    _report(report, errors)


def _check_message(msg, p, c, counters, cstats, mine, is_shared):
    """(consumer ``c``) Judge a message from producer ``p``: counted in ``cstats`` and the
    stream's row, its pattern checks in ``mine``."""
    sender, t, seq, items, digests, must_share, _ = msg
    row = counters[p, t, c]
    n, bad = check_patterns(msg)
    mine[CHECKS] += n
    if sender != p or len(items) != len(digests) or bad \
            or any(digest(x) != d for x, d in zip(items, digests)) \
            or not all(is_shared(x) for x, m in zip(items, must_share) if m):
        cstats[c, CORRUPT] += 1
    if seq < row[RECV]:
        cstats[c, DUPLICATE] += 1
        return
    if seq > row[RECV]:
        cstats[c, GAP] += seq - row[RECV]
    row[RECV_BYTES] += sum(x.nbytes for x in items if isinstance(x, np.ndarray))
    row[RECV] = seq + 1


def consumer(c, links, counters, cstats, checks, ends, clock, report):
    """Receive from every producer with CONSUMER_THREADS threads; check every message, when
    it arrives and again when it is dropped (each thread keeps its last HOLD)."""
    import collections
    import sharedmp as mp
    from multiprocessing.connection import wait
    deadline = _start_when_told(clock, len(counters) + c)
    errors = []

    def thread(k):
        held = collections.deque()           # what it received last, checked when dropped
        try:
            receive_all(k, held)
        finally:
            _drop_checked(held, checks[len(counters) + c, k])

    def receive_all(k, held):
        mine = {conn: p for p, conn in enumerate(links) if p % CONSUMER_THREADS == k}
        while mine:
            if time.monotonic() > deadline + GRACE:
                errors.append(f"consumer {c}: channels still open {GRACE:.0f} s after the "
                              "deadline")
                return
            for conn in wait(list(mine), timeout=0.5):
                p = mine[conn]
                try:
                    msg = conn.recv()
                except EOFError:
                    ends[p, c] = EOF
                except mp.ProtocolError as e:          # a malformed frame: judged by the leader
                    ends[p, c] = TRUNCATED
                    errors.append(f"consumer {c} from producer {p}: {e!r}")
                except Exception as e:                 # noqa: BLE001 -- judged by the leader
                    ends[p, c] = FAILED
                    cstats[c, ERRORS] += 1
                    errors.append(f"consumer {c} from producer {p}: {e!r}")
                else:
                    _check_message(msg, p, c, counters, cstats, checks[len(counters) + c, k],
                                   mp.is_shared)
                    held.append(msg)
                    del msg
                    _drop_checked(held, checks[len(counters) + c, k], HOLD)
                    continue
                del mine[conn]
                conn.close()

    threads = [threading.Thread(target=thread, args=(k,)) for k in range(CONSUMER_THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    _report(report, errors)


# ------------------------------------------------------------------------------- fork events

def _backing(addresses):
    """(st_dev-ish, inode, file offset) of the mapping of this process at each address (None
    where it is private memory), from /proc/self/maps."""
    spans = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if int(parts[4]):
                spans.append((lo, hi, parts[3], int(parts[4]), int(parts[2], 16)))
    out = []
    for a in addresses:
        hit = next(((dev, ino, off + a - lo) for lo, hi, dev, ino, off in spans if lo <= a < hi),
                   None)
        out.append(hit)
    return out


def make_fork_set(mp, ids):
    """An array of each class (by value, carved from an arena, a segment of its own) per id,
    filled with its pattern; [(array, spec)]."""
    out = []
    for pid, (kind, nbytes) in zip(ids, FORK_CLASSES * (len(ids) // len(FORK_CLASSES))):
        spec = (pid, np.dtype("<u8"), (nbytes // 8,), ())
        a = pattern(pid, "<u8", spec[2]).copy() if kind == "value" else mp.empty(spec[2], "<u8")
        if kind != "value":
            a[...] = pattern(pid, "<u8", spec[2])
        out.append((a, spec))
    return out


def _regions(arrays):
    """Where the shared ones of ``arrays`` live: [(dev, inode, first byte, end)]."""
    places = _backing([a.__array_interface__["data"][0] for a, _ in arrays])
    return [(b[0], b[1], b[2], b[2] + a.nbytes) for (a, _), b in zip(arrays, places) if b]


def _count_checks(arrays):
    return len(arrays), sum(not holds_pattern(a, spec) for a, spec in arrays)


def holds_word(a, spec):
    """``holds_pattern`` of a 1-d ``<u8`` array (the helper threads'), without a copy: every
    word is the pattern id. (Quick: the threads spend their time making and dropping.)"""
    return a.dtype == spec[1] and a.shape == spec[2] and bool((a == np.uint64(spec[0])).all())


def fork_child(arrays, go_fd, out_fd, parents_fds, thread_lists=()):
    """In a fork child: check the inherited arrays, wait until told (the parent has dropped
    them and made new ones meanwhile), check them again, and the helper threads'
    ``thread_lists`` as they were at the fork (no thread runs here; they went on dropping
    and making arrays meanwhile), drop them, report on ``out_fd``."""
    import select
    for fd in parents_fds:
        os.close(fd)
    theirs = [x for kept in thread_lists for x in list(kept)]
    n1, bad1 = _count_checks(arrays)
    told = bool(select.select([go_fd], [], [], FORK_TIMEOUT)[0])
    n2, bad2 = _count_checks(arrays)
    changed = [(a, spec) for a, spec in theirs if not holds_word(a, spec)]
    tn, tbad = len(theirs), len(changed)
    n2, bad2 = n2 + tn, bad2 + tbad
    wrong = [f"{spec[0]:#x} {a.nbytes} B: first word {int(a[0]):#x}"
             for a, spec in arrays if not holds_pattern(a, spec)][:3]
    wrong += [f"{spec[0]:#x} {a.nbytes} B (a helper thread's): first word {int(a[0]):#x}"
              for a, spec in changed][:3]
    del changed
    del arrays[:], theirs[:]
    gc.collect()
    os.write(out_fd, json.dumps(dict(checks=n1 + n2, bad=bad1 + bad2, told=told, wrong=wrong,
                                     thread_checks=tn, thread_bad=tbad)).encode() + b"\n")
    os.close(out_fd)


def read_json_line(fd, timeout):
    """A JSON line from ``fd`` (a fork child's report), or None if none came whole within
    ``timeout`` s."""
    import select
    data, end = b"", time.monotonic() + timeout
    while not data.endswith(b"\n"):
        left = end - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 65536)
        if not chunk:
            return None
        data += chunk
    return json.loads(data)


def _reap(pid, proc, timeout):
    """Wait for a fork child until ``timeout``, then SIGKILL it (by pid); whether it ended
    cleanly on its own."""
    if proc is not None:
        proc.join(timeout)
        if proc.is_alive():
            os.kill(pid, signal.SIGKILL)
            proc.join(5)
            return False
        return proc.exitcode == 0
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) == 0
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return False


def _tally(mine, arrays):
    """Check ``arrays``' patterns, counted in ``mine``."""
    n, bad = _count_checks(arrays)
    mine[CHECKS] += n
    mine[BAD] += bad


def _start_fork_child(ctx, n, arrays, go_r, out_w, parents_fds, thread_lists=()):
    """Fork a child that keeps ``arrays`` (``fork_child``): by a fork-context Process if
    ``n`` is odd, else by ``os.fork``; (pid, the Process or None)."""
    if n % 2 == 1:
        proc = ctx.Process(target=fork_child, name=f"fork-{n}",
                           args=(arrays, go_r, out_w, parents_fds, thread_lists))
        proc.start()
        return proc.pid, proc
    pid = os.fork()
    if pid == 0:                                   # the child: never returns
        code = 1
        try:
            fork_child(arrays, go_r, out_w, parents_fds, thread_lists)
            code = 0
        finally:
            os._exit(code)
    return pid, None


def _reuse_while_held(mp, seed, n, held, fstats, mine):
    """Make new arrays of the fork set's classes ``RECYCLE_ROUNDS`` times (the recycler
    hands out what it may), counting new memory that overlaps ``held`` regions; the last
    set made (checked by the caller after the child has reported)."""
    fresh = []
    for r in range(RECYCLE_ROUNDS):
        time.sleep(0.02)
        new = make_fork_set(mp, [pattern_id(seed, "fork", n, "new", r, i)
                                 for i in range(2 * len(FORK_CLASSES))])
        fstats[F_REUSED] += sum(1 for d, i, lo, hi in _regions(new) for D, I, LO, HI in held
                                if (d, i) == (D, I) and lo < HI and LO < hi)
        _tally(mine, fresh)
        fresh = new
    return fresh


def fork_event(mp, ctx, n, seed, fstats, mine, notes, helpers=None):
    """One fork event: make arrays, fork (``os.fork`` or a fork-context Process: ``n`` odd or
    even), drop them, make and recycle new ones of the same classes while the child holds
    its copies, then let the child check them. With ``helpers`` (``Helpers``): they run
    through it, and the child checks what they held at the fork too."""
    with helpers.running() if helpers is not None else contextlib.nullcontext():
        _fork_event(mp, ctx, n, seed, fstats, mine, notes, helpers)


def _fork_event(mp, ctx, n, seed, fstats, mine, notes, helpers):
    arrays = make_fork_set(mp, [pattern_id(seed, "fork", n, i)
                                for i in range(2 * len(FORK_CLASSES))])
    held = _regions(arrays)
    _tally(mine, arrays)                            # its last look before it drops them
    lists = helpers.kept if helpers is not None else ()

    def reuse():
        # At once: the child's copies are its own. (Emptied, not just unnamed: the Process
        # object holds this list as its argument too.)
        arrays.clear()
        gc.collect()
        return _reuse_while_held(mp, seed, n, held, fstats, mine)

    fresh = _fork_child_checked(ctx, n, 0, arrays, lists, reuse, fstats, notes)
    _tally(mine, fresh or [])
    del fresh
    if helpers is None:
        return
    # More children beside the threads, one at a time: each inherits the threads' arrays
    # only, and checks them once the threads have dropped as many and made as many anew.
    # (One at a time: a segment that a child inherited without its hold is held by the
    # children forked after it, while they live: not recycled under it meanwhile.)
    for c in range(1, THREADED_CHILDREN):
        _fork_child_checked(ctx, n, c, [], lists,
                            lambda: helpers.warm(2 * THREAD_KEEP * len(lists)), fstats, notes)


def _fork_child_checked(ctx, n, c, arrays, lists, meanwhile, fstats, notes):
    """Fork child ``c`` of event ``n`` (``fork_child``, keeping ``arrays`` and the helper
    threads' ``lists``), run ``meanwhile()`` while it holds them, let it check, count its
    report in ``fstats``; what ``meanwhile`` returned."""
    go_r, go_w = os.pipe()
    out_r, out_w = os.pipe()
    pid, proc = _start_fork_child(ctx, n + c, arrays, go_r, out_w, (go_w, out_r), lists)
    os.close(go_r)
    os.close(out_w)
    fstats[F_EVENTS] += 1
    fstats[F_PROCESS if proc is not None else F_OS_FORK] += 1
    fstats[F_THREADED] += bool(lists)
    how = ("Process" if proc is not None else "os.fork") + \
        (f" beside threads, child {c + 1}" if lists else "")
    rep = result = None
    try:
        result = meanwhile()
        os.write(go_w, b"g")
        rep = read_json_line(out_r, FORK_TIMEOUT)
    finally:
        os.close(go_w)
        os.close(out_r)
        clean = _reap(pid, proc, FORK_TIMEOUT)
    if rep is None:
        fstats[F_UNREPORTED] += 1
        notes.append(f"forker: fork event {n} ({how}): the child never reported")
    else:
        fstats[F_CHILD_CHECKS] += rep["checks"]
        fstats[F_CHILD_BAD] += rep["bad"]
        fstats[F_THREAD_CHECKS] += rep["thread_checks"]
        fstats[F_THREAD_BAD] += rep["thread_bad"]
        if rep["bad"]:
            notes.append(f"forker: fork event {n} ({how}): {rep['bad']} inherited arrays "
                         "changed under the child: " + "; ".join(rep["wrong"]))
    if not clean:
        fstats[F_CHILD_FAILED] += 1
    return result


def threaded(n, fork_threads):
    """Whether fork event ``n`` runs beside the helper threads: every other pair (an
    ``os.fork`` and a Process each) with "alternate"."""
    return fork_threads == "always" or (fork_threads == "alternate" and n // 2 % 2 == 1)


def thread_feeder(q, stop, seed):
    """(a process of the forker) Make arrays of THREAD_CLASSES and put them, with their
    pattern specs, on ``q`` (bounded) for the forker's receiving thread, until ``stop``."""
    import sharedmp as mp
    k = 0
    while not stop.is_set():
        for _, nbytes in THREAD_CLASSES:
            spec = (pattern_id(seed, "feeder", k), np.dtype("<u8"), (nbytes // 8,), ())
            a = mp.empty(spec[2], "<u8")
            a.fill(spec[0])                         # (its pattern: its id in every word)
            k += 1
            put_unless_stopped(q, (a, spec), stop)
            del a


def put_unless_stopped(q, item, stop):
    """Put ``item`` on the bounded ``q``, unless ``stop`` is set before there is room."""
    import queue
    while not stop.is_set():
        try:
            q.put(item, timeout=0.2)
            return
        except queue.Full:
            pass


def wait_turn(go, stop):
    """Wait until ``go`` is set (True) or ``stop`` is (False): a helper thread's turn."""
    while not stop.is_set():
        if go.wait(0.05):
            return True
    return False


def received(q, go, stop):
    """What comes on ``q`` while it is a helper thread's turn (``wait_turn``)."""
    import queue
    while wait_turn(go, stop):
        try:
            yield q.get(timeout=0.1)
        except queue.Empty:
            pass


def stop_threads(threads, stop, timeout):
    """Set ``stop`` and join each of ``threads`` (for up to ``timeout`` s); those still alive."""
    stop.set()
    left = []
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            left.append(t)
    return left


def stop_feeder(feeder, stop, q, timeout):
    """Stop the process ``feeder``, which puts arrays on ``q`` until ``stop`` is set
    (SIGKILLed if it has not ended ``timeout`` + 5 s later), let go of what it sent and close
    ``q``; whether it ended on its own."""
    import queue
    # The feeder may be blocked in put() until the window of what is in flight to us
    # drains (channels/flow.py, whatever put's timeout): receive until it has ended.
    stop.set()
    end = time.monotonic() + timeout
    while feeder.is_alive() and time.monotonic() < end:
        try:
            q.get(timeout=0.05)
        except queue.Empty:
            pass
        except (OSError, EOFError):
            break
    feeder.join(5)
    ended = not feeder.is_alive()
    if not ended:
        os.kill(feeder.pid, signal.SIGKILL)
        feeder.join(5)
    while True:                 # what it sent last, never received: let go
        try:
            q.get(timeout=0.2)
        except (queue.Empty, OSError, EOFError):
            break
    q.close()
    q.join_thread()
    return ended


class Helpers:
    """The forker's helper threads: two make and drop arrays, one receives them from a
    feeder process; each keeps its last THREAD_KEEP (``kept``: a list per thread) and checks
    each one it drops. They run while ``running()`` and wait otherwise."""

    def __init__(self, mp, feeder_ctx, seed):
        self.mp, self.seed = mp, seed
        self.kept = [[], [], []]
        self.go, self.stop_now = threading.Event(), threading.Event()
        self.made = [0, 0, 0]               # per thread: arrays made or received
        self.checks = [[0, 0], [0, 0], [0, 0]]      # per thread: [checks, bad]
        self.errors = []
        self.queue, self.feeder_stop = feeder_ctx.Queue(2), feeder_ctx.Event()
        self.feeder = feeder_ctx.Process(target=thread_feeder, name="thread-feeder",
                                         args=(self.queue, self.feeder_stop, seed))
        self.feeder.start()
        self.threads = [threading.Thread(target=self._guard, args=(j, f), daemon=True,
                                         name=f"helper-{j}")
                        for j, f in enumerate((self._alloc, self._alloc, self._recv))]
        for t in self.threads:
            t.start()

    @contextlib.contextmanager
    def running(self):
        self.go.set()
        self.warm()
        try:
            yield
        finally:
            self.go.clear()

    def warm(self, arrays=4, timeout=1.0):
        """Wait until the threads have made or received ``arrays`` more (at most ``timeout``
        s): they run when the next fork comes (on a busy machine a thread just woken may not
        have run yet)."""
        end, goal = time.monotonic() + timeout, sum(self.made) + arrays
        while sum(self.made) < goal and time.monotonic() < end and not self.errors:
            time.sleep(0.001)

    def _keep(self, j, item):
        kept = self.kept[j]
        kept.append(item)
        self.made[j] += 1
        while len(kept) > THREAD_KEEP:
            a, spec = kept.pop(0)
            self.checks[j][CHECKS] += 1
            self.checks[j][BAD] += not holds_word(a, spec)
            del a

    def _guard(self, j, loop):
        try:
            loop(j)
        except Exception as e:      # noqa: BLE001 -- a problem of the verdict
            self.errors.append(f"forker: helper thread {j}: {e!r}")

    def _alloc(self, j):
        k = 0
        while wait_turn(self.go, self.stop_now):
            for _, nbytes in THREAD_CLASSES:
                spec = (pattern_id(self.seed, "thread", j, k), np.dtype("<u8"), (nbytes // 8,),
                        ())
                a = self.mp.empty(spec[2], "<u8")
                a.fill(spec[0])                     # (its pattern: its id in every word)
                self._keep(j, (a, spec))
                k += 1
                del a

    def _recv(self, j):
        for a, spec in received(self.queue, self.go, self.stop_now):
            self.checks[j][CHECKS] += 1
            self.checks[j][BAD] += not holds_word(a, spec)
            self._keep(j, (a, spec))
            del a

    def stop(self, fstats, row):
        """Stop the threads and the feeder, let go of what they hold, count what they did
        (``fstats``; their pattern checks in ``row``); problems (a list)."""
        problems = list(self.errors)
        for t in stop_threads(self.threads, self.stop_now, FORK_TIMEOUT):
            problems.append(f"forker: helper thread {t.name} did not stop")
        for kept in self.kept:
            for a, spec in kept:
                self.checks[0][CHECKS] += 1
                self.checks[0][BAD] += not holds_word(a, spec)
            del kept[:]
        if not stop_feeder(self.feeder, self.feeder_stop, self.queue, FORK_TIMEOUT):
            problems.append("forker: the thread feeder did not stop (killed)")
        fstats[F_THREAD_ARRAYS] += sum(self.made)
        row[CHECKS] += sum(c[CHECKS] for c in self.checks)
        row[BAD] += sum(c[BAD] for c in self.checks)
        gc.collect()
        return problems


def forker(i, strategy, clock, checks, fstats, seed, report, fork_threads="never",
           feeder_method="spawn"):
    """Fork events until the deadline (in the epoch's strategy); beside the helper threads
    (``Helpers``, their feeder started by ``feeder_method``) as ``fork_threads`` says."""
    import sharedmp as mp
    mp.set_sharing_strategy(strategy)
    ctx = mp.get_context("fork")
    helpers = None if fork_threads == "never" else \
        Helpers(mp, mp.get_context(feeder_method), seed)
    deadline = _start_when_told(clock, i)
    notes, n = [], 0
    try:
        while time.monotonic() < deadline:
            try:
                fork_event(mp, ctx, n, seed, fstats, checks[i, 0], notes,
                           helpers if threaded(n, fork_threads) else None)
            except Exception as e:           # noqa: BLE001 -- a problem of the verdict
                notes.append(f"forker: fork event {n}: {e!r}")
                break
            n += 1
    finally:
        if helpers is not None:
            notes += helpers.stop(fstats, checks[i, 1])
    _report(report, notes)


# ------------------------------------------------------------------------------- the verdict

def judge(counters, cstats, ends, killed_p, killed_c):
    """The figures of one epoch from its counters and who was killed (a pure function)."""
    out = dict(messages=0, bytes=0, corrupted=int(cstats[:, CORRUPT].sum()),
               duplicated=int(cstats[:, DUPLICATE].sum()), lost=int(cstats[:, GAP].sum()),
               receive_errors=int(cstats[:, ERRORS].sum()), lost_to_killed_consumers=0,
               in_transit_at_kill=0, truncated_frames=0, bad_channel_ends=0)
    P, T, C, _ = counters.shape
    for p in range(P):
        for c in range(C):
            end = int(ends[p, c])
            if c not in killed_c:
                if end == TRUNCATED and p in killed_p:
                    out["truncated_frames"] += 1
                elif end != EOF:
                    out["bad_channel_ends"] += 1
            for t in range(T):
                s, r = int(counters[p, t, c, SENT]), int(counters[p, t, c, RECV])
                out["messages"] += r
                out["bytes"] += int(counters[p, t, c, RECV_BYTES])
                if c in killed_c:
                    out["lost_to_killed_consumers"] += max(0, s - r)
                elif p in killed_p:          # one message may have left just before the kill
                    out["lost"] += max(0, s - r)
                    out["in_transit_at_kill"] += 1 if r == s + 1 else 0
                    out["duplicated"] += max(0, r - s - 1)
                else:
                    out["lost"] += max(0, s - r)
                    out["duplicated"] += max(0, r - s)
    return out


# ------------------------------------------------------------------------------- the leader

class _Program:
    """One epoch's workers and what they share with the leader."""

    def __init__(self, cfg, mp, ctx):
        P, C = PRODUCERS, CONSUMERS
        self.counters = mp.zeros((P, PRODUCER_THREADS, C, 4), np.int64)
        self.cstats = mp.zeros((C, 4), np.int64)
        self.ends = mp.zeros((P, C), np.int64)
        self.clock = mp.zeros(2 + P + C, np.float64)   # [deadline, ready flag of each worker]
        self.checks = mp.zeros((P + C + 1, max(PRODUCER_THREADS, CONSUMER_THREADS), 2), np.int64)
        self.fstats = mp.zeros(F_COUNTERS, np.int64)
        links = [[ctx.Pipe(duplex=False) for _ in range(C)] for _ in range(P)]
        self.reports = [ctx.Pipe(duplex=False) for _ in range(P + C + 1)]
        self.procs = [ctx.Process(target=producer, name=f"producer-{p}",
                                  args=(p, [links[p][c][1] for c in range(C)], self.counters,
                                        self.checks, self.clock, cfg["seed"],
                                        self.reports[p][1]))
                      for p in range(P)]
        self.procs += [ctx.Process(target=consumer, name=f"consumer-{c}",
                                   args=(c, [links[p][c][0] for p in range(P)], self.counters,
                                         self.cstats, self.checks, self.ends, self.clock,
                                         self.reports[P + c][1]))
                       for c in range(C)]
        # The forker (never killed: index P + C, past those kill_some picks from).
        self.procs.append(ctx.Process(target=forker, name="forker",
                                      args=(P + C, cfg["strategy"], self.clock, self.checks,
                                            self.fstats, cfg["seed"], self.reports[P + C][1],
                                            cfg.get("fork_threads", "never"),
                                            cfg["start_method"])))
        for proc in self.procs:
            proc.start()
        for pair in [x for row in links for x in row] + self.reports:
            pair[1].close()                      # only the workers hold the channels now
        for row in links:
            for r, _ in row:
                r.close()

    def open_window(self, seconds):
        """Tell the workers to start, once every one runs (starting them may take seconds on a
        busy machine); (start, deadline) of the sending window."""
        ready_by = time.monotonic() + GRACE
        while not self.clock[1:].all() and time.monotonic() < ready_by \
                and all(proc.is_alive() for proc in self.procs):
            time.sleep(0.01)
        start = time.monotonic()
        self.clock[0] = start + seconds
        return start, start + seconds

    def kill_some(self, rng, start, seconds):
        """SIGKILLs at random times; at least one producer and one consumer live to the end.
        The indices (in ``procs``) of those killed."""
        P, C = PRODUCERS, CONSUMERS
        n_kills = int(rng.integers(1, 3))
        victims = []
        if rng.random() < 0.5:
            victims = [int(p) for p in rng.choice(P, size=min(n_kills, P - 1), replace=False)]
        victims += [P + int(c) for c in rng.choice(C, size=n_kills - len(victims), replace=False)]
        when = sorted(start + seconds * rng.uniform(0.1, 0.9, size=len(victims)))
        killed = []
        for at, v in zip(when, victims):
            time.sleep(max(0.0, at - time.monotonic()))
            if self.procs[v].is_alive():
                os.kill(self.procs[v].pid, signal.SIGKILL)
                killed.append(v)
        return killed

    def join(self, deadline):
        """Wait for every worker until ``deadline`` + GRACE; the names of those that hung."""
        hung = []
        for proc in self.procs:
            proc.join(max(0.0, deadline + GRACE - time.monotonic()))
            if proc.is_alive():
                hung.append(proc.name)
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(5)
        return hung

    def reports_of_survivors(self, killed, hung):
        """(errors the workers reported, unclean exits) of the workers not killed."""
        errors, unclean = [], []
        for i, (r, _) in enumerate(self.reports):
            proc = self.procs[i]
            if i not in killed:
                try:
                    if r.poll(5):
                        errors += r.recv()["errors"]
                except (EOFError, OSError):
                    pass
                if proc.exitcode != 0 and proc.name not in hung:
                    unclean.append(f"{proc.name} exit code {proc.exitcode}")
            r.close()
        return errors, unclean


# How the consumer writes down a ProtocolError (its repr), to keep those apart in the verdict.
_PROTOCOL_ERROR = "ProtocolError("


def leader(cfg, result):
    """One epoch: start, kill, wait, judge; send the verdict on ``result``."""
    import sharedmp as mp
    from ..memory import arena
    mp.set_sharing_strategy(cfg["strategy"])
    rng = np.random.default_rng([cfg["seed"], 7])
    prog = _Program(cfg, mp, mp.get_context(cfg["start_method"]))
    start, deadline = prog.open_window(cfg["window"])
    killed = prog.kill_some(rng, start, cfg["window"])
    hung = prog.join(deadline)
    errors, unclean = prog.reports_of_survivors(killed, hung)
    killed_p = {v for v in killed if v < PRODUCERS}
    killed_c = {v - PRODUCERS for v in killed if v >= PRODUCERS}
    verdict = judge(prog.counters, prog.cstats, prog.ends, killed_p, killed_c)
    verdict.update(fork_figures(prog.checks, prog.fstats))
    verdict["corrupted"] += verdict["held_corrupted"] + verdict["fork_corrupted"]
    verdict.update(strategy=cfg["strategy"], start_method=cfg["start_method"],
                   window_s=cfg["window"], killed_producers=len(killed_p),
                   killed_consumers=len(killed_c), hung=hung, unclean_exits=unclean,
                   notes=[e for e in errors if _PROTOCOL_ERROR not in e][:10],
                   truncated_notes=[e for e in errors if _PROTOCOL_ERROR in e][:3],
                   pids=[proc.pid for proc in prog.procs])
    del prog
    segment_forget_and_collect()
    verdict["leader_segment_fds"] = len(arena.stray_segment_fds())
    verdict.update(_daemon_after_workers(cfg["strategy"]))
    result.send(verdict)
    result.close()


def fork_figures(checks, fstats):
    """The pattern checks and fork events of an epoch, from their shared counters."""
    f = [int(x) for x in fstats]
    return dict(pattern_checks=int(checks[..., CHECKS].sum()) + f[F_CHILD_CHECKS],
                held_corrupted=int(checks[..., BAD].sum()),     # found when dropped
                fork_events=f[F_EVENTS], fork_os_fork=f[F_OS_FORK], fork_process=f[F_PROCESS],
                fork_child_checks=f[F_CHILD_CHECKS], fork_corrupted=f[F_CHILD_BAD],
                fork_unreported=f[F_UNREPORTED], fork_child_failed=f[F_CHILD_FAILED],
                fork_reused_while_held=f[F_REUSED], fork_threaded=f[F_THREADED],
                fork_thread_arrays=f[F_THREAD_ARRAYS], fork_thread_checks=f[F_THREAD_CHECKS],
                fork_thread_corrupted=f[F_THREAD_BAD])


def _daemon_after_workers(strategy):
    """What the daemon still tracks now that every worker is gone: references in flight of
    messages that died with a killed process (released when the program ends)."""
    from ..memory import manager
    if strategy != "file_system" or manager.daemon_pid() is None:
        return {"daemon_after_workers": None}
    time.sleep(0.2)
    return {"daemon_after_workers": manager.stats(), "daemon_pid": manager.daemon_pid()}


def segment_forget_and_collect():
    """Let go of what this process caches on purpose (recent mappings, the pool, idle arenas)."""
    from ..memory import cache
    gc.collect()
    cache.empty()


# ------------------------------------------------------------------------------- the run

def live_run_processes(token):
    """pids of live processes (zombies aside) whose environment carries this run's token,
    but for this process and its multiprocessing resource tracker (it lives as long as we do)."""
    from ..memory import leftovers
    needle = f"{RUN_ENV}={token}".encode() + b"\0"
    mine = {os.getpid(), _compat.resource_tracker_pid()}
    out = []
    for pid in leftovers.pids():
        if pid in mine:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle not in f.read() + b"\0":
                    continue
        except OSError:
            continue
        st = leftovers.proc_stat(pid)
        if st is not None and st.state != "Z":
            out.append(pid)
    return out


def _poll(predicate, timeout):
    end = time.monotonic() + timeout
    while not (value := predicate()) and time.monotonic() < end:
        time.sleep(0.05)
    return value


def run_epoch(cfg, token, shm_dir):
    import sharedmp as mp
    from ..memory import arena
    ctx = mp.get_context("spawn")
    r, w = ctx.Pipe(duplex=False)
    lead = ctx.Process(target=leader, args=(cfg, w), name=f"leader-{cfg['epoch']}")
    lead.start()
    w.close()
    limit = cfg["window"] + GRACE + 60
    verdict = None
    try:
        if r.poll(limit):
            verdict = r.recv()
    except (EOFError, OSError):
        pass
    r.close()
    lead.join(30)
    if lead.is_alive():
        os.kill(lead.pid, signal.SIGKILL)
        lead.join(5)
    if verdict is None:
        verdict = dict(strategy=cfg["strategy"], start_method=cfg["start_method"],
                       window_s=cfg["window"],
                       failed=f"the epoch's leader ended without a verdict "
                              f"(exit code {lead.exitcode})")
    # Leftovers once the epoch's program is gone (the daemon lingers up to 1.5 s, then unlinks).
    gone = _poll(lambda: not live_run_processes(token), 10)
    files = _poll(lambda: not os.listdir(shm_dir), 5) or os.listdir(shm_dir)
    stray = [] if gone else live_run_processes(token)
    verdict["leftovers"] = {
        "shm_files": 0 if files is True else len(files),
        "segment_fds": len(arena.stray_segment_fds()),
        "processes": len(stray),
    }
    verdict["left"] = left_of(verdict)
    for pid in stray:                                         # do not let one epoch spoil the next
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    for name in ([] if files is True else files):
        try:
            os.unlink(os.path.join(shm_dir, name))
        except (FileNotFoundError, IsADirectoryError):
            pass
    return verdict


def left_of(v):
    """What an epoch left: shm files, fds and processes once its program ended, fds of its
    leader on segments, and what its daemon still tracked once the workers were gone (not
    counted where a process was killed: messages that died with it, freed at the end)."""
    daemon = v.get("daemon_after_workers") or {}
    killed = v.get("killed_producers") or v.get("killed_consumers")
    return sum(v.get("leftovers", {}).values()) + v.get("leader_segment_fds", 0) \
        + (0 if killed else daemon.get("segments", 0) + daemon.get("in_flight", 0))


VIOLATIONS = ("corrupted", "lost", "duplicated", "receive_errors", "bad_channel_ends")
# (of the forker: a child that never reported or did not end cleanly, memory it held reused)
FORK_VIOLATIONS = ("fork_unreported", "fork_child_failed", "fork_reused_while_held")


def problems(v):
    """What is wrong in an epoch's verdict (empty: all good)."""
    out = [f"{k} = {v[k]}" for k in VIOLATIONS + FORK_VIOLATIONS if v.get(k)]
    if v.get("failed"):
        out.append(v["failed"])
    out += [f"hung: {h}" for h in v.get("hung", [])] + v.get("unclean_exits", [])
    # A send that raised (other than on a killed consumer) stopped its thread: never right.
    out += [n for n in v.get("notes", []) if n.startswith(("producer ", "forker"))]
    out += [f"leftover {k} = {n}" for k, n in v.get("leftovers", {}).items() if n]
    if v.get("leader_segment_fds"):
        out.append(f"leader segment fds = {v['leader_segment_fds']}")
    daemon = v.get("daemon_after_workers")
    if daemon and (daemon["segments"] or daemon["in_flight"]) \
            and not (v["killed_producers"] or v["killed_consumers"]):
        out.append(f"daemon still tracks {daemon} with no process killed")
    return out


def _totals(epochs):
    """The run's figures: each epoch's summed, and by strategy."""
    keys = ("messages", "bytes", "corrupted", "lost", "duplicated", "receive_errors",
            "bad_channel_ends",
            "lost_to_killed_consumers", "in_transit_at_kill", "truncated_frames",
            "killed_producers", "killed_consumers", "pattern_checks", "held_corrupted",
            "fork_events", "fork_os_fork", "fork_process", "fork_child_checks", "fork_corrupted",
            "fork_unreported", "fork_child_failed", "fork_reused_while_held", "fork_threaded",
            "fork_thread_arrays", "fork_thread_checks", "fork_thread_corrupted", "left")
    totals = {k: sum(v.get(k, 0) for v in epochs) for k in keys}
    totals["by_strategy"] = {s: {k: sum(v.get(k, 0) for v in epochs if v["strategy"] == s)
                                 for k in ("messages", "bytes", "killed_producers",
                                           "killed_consumers", "fork_events", "pattern_checks",
                                           "corrupted", "fork_corrupted", "fork_threaded",
                                           "fork_thread_corrupted", "left")}
                             for s in ("file_descriptor", "file_system")}
    totals["kills_survived"] = totals["killed_producers"] + totals["killed_consumers"]
    totals["leftovers"] = {k: sum(v.get("leftovers", {}).get(k, 0) for v in epochs)
                           for k in ("shm_files", "segment_fds", "processes")}
    totals["daemon_refs_after_workers"] = {
        k: sum((v.get("daemon_after_workers") or {}).get(k, 0) for v in epochs)
        for k in ("segments", "in_flight")}
    totals["hung"] = sum(len(v.get("hung", [])) for v in epochs)
    return totals


def stress(seconds=60.0, seed=None, log=print, fork_threads="alternate"):
    """Run for about ``seconds``; the report (a dict). ``fork_threads``: which fork events run
    beside the forker's helper threads (FORK_THREADS)."""
    if fork_threads not in FORK_THREADS:
        raise ValueError(f"fork_threads={fork_threads!r}: not one of {FORK_THREADS}")
    seed = secrets.randbits(32) if seed is None else seed
    token = secrets.token_hex(8)
    shm_dir = tempfile.mkdtemp(prefix="sharedmp-stress-",
                               dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    saved = {k: os.environ.get(k) for k in (RUN_ENV, "SHAREDMP_SHM_DIR", "SHAREDMP_MANAGER")}
    os.environ.update({RUN_ENV: token, "SHAREDMP_SHM_DIR": shm_dir})
    os.environ.pop("SHAREDMP_MANAGER", None)        # each epoch's program gets its own daemon
    n = max(2, round(seconds / 15))
    window = max(2.0, seconds / n - STARTUP)
    plan = [("file_descriptor", "file_system")[i % 2] for i in range(n)]
    methods = [("spawn", "forkserver")[(i // 2) % 2] for i in range(n)]
    t0 = time.monotonic()
    epochs = []
    try:
        for i in range(n):
            cfg = dict(epoch=i, strategy=plan[i], start_method=methods[i], window=round(window, 2),
                       seed=seed + i, fork_threads=fork_threads)
            v = run_epoch(cfg, token, shm_dir)
            v["problems"] = problems(v)
            epochs.append(v)
            log(f"epoch {i + 1}/{n} {v['strategy']:<15} {v['start_method']:<10} "
                f"{v.get('messages', 0):>8} msgs {v.get('bytes', 0) / 2**20:>8.1f} MiB  kills "
                f"{v.get('killed_producers', 0)}p+{v.get('killed_consumers', 0)}c  "
                f"forks {v.get('fork_events', 0)} ({v.get('fork_threaded', 0)} beside threads)  "
                f"checks {v.get('pattern_checks', 0)}  "
                + ("ok" if not v["problems"] else "PROBLEMS: " + "; ".join(v["problems"])))
    finally:
        for k, val in saved.items():
            if val is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = val
        shutil.rmtree(shm_dir, ignore_errors=True)
    wall = time.monotonic() - t0
    totals = _totals(epochs)
    bad = [f"epoch {i + 1}: {p}" for i, v in enumerate(epochs) for p in v["problems"]]
    return dict(seconds=seconds, wall_s=round(wall, 1), seed=seed, cpus=os.cpu_count(),
                loadavg=os.getloadavg(),
                config=dict(producers=PRODUCERS, producer_threads=PRODUCER_THREADS,
                            consumers=CONSUMERS, consumer_threads=CONSUMER_THREADS,
                            epochs=n, window_s=round(window, 2), fork_threads=fork_threads),
                totals=totals, epochs=epochs, problems=bad, ok=not bad)


def format_summary(rep):
    t = rep["totals"]
    lines = [
        f"sharedmp stress: {rep['wall_s']} s, {rep['config']['epochs']} epochs, "
        f"seed {rep['seed']}, "
        f"{rep['config']['producers']}x{rep['config']['producer_threads']} producer threads, "
        f"{rep['config']['consumers']}x{rep['config']['consumer_threads']} consumer threads, "
        f"{rep['cpus']} CPUs",
        f"  moved            {t['messages']} messages, {t['bytes'] / 2**20:.1f} MiB of arrays"
        + "".join(f"; {s}: {b['messages']} msgs" for s, b in t["by_strategy"].items()),
        f"  pattern checks   {t['pattern_checks']} whole arrays checked against the pattern "
        "their maker put in (receivers on arrival and when they drop them, holders before "
        "they drop them, fork children)",
        f"  fork events      {t['fork_events']} ({t['fork_os_fork']} os.fork, "
        f"{t['fork_process']} fork-context Process): children checked "
        f"{t['fork_child_checks']} inherited arrays after the parent dropped them and made new "
        f"ones; {t['fork_corrupted']} changed, {t['fork_unreported']} children never reported, "
        f"{t['fork_reused_while_held']} times the parent reused memory a child held"
        + "".join(f"; {s}: {b['fork_events']} forks, {b['fork_corrupted']} changed"
                  for s, b in t["by_strategy"].items()),
        f"  beside threads   {t['fork_threaded']} fork events ({rep['config']['fork_threads']}) "
        f"while helper threads made, dropped and received {t['fork_thread_arrays']} arrays: "
        f"children checked {t['fork_thread_checks']} of the threads' arrays they inherited, "
        f"{t['fork_thread_corrupted']} changed"
        + "".join(f"; {s}: {b['fork_threaded']} forks, {b['fork_thread_corrupted']} changed"
                  for s, b in t["by_strategy"].items()),
        f"  corrupted        {t['corrupted']}   (messages, arrays held: "
        f"{t['held_corrupted']}, in fork children: {t['fork_corrupted']})",
        f"  lost             {t['lost']}   "
        "(sent by a process not killed, or by a killed one before its kill)",
        f"  duplicated       {t['duplicated']}",
        f"  receive errors   {t['receive_errors']}, bad channel ends {t['bad_channel_ends']}, "
        f"hung {t['hung']}",
        f"  kills survived   {t['kills_survived']} ({t['killed_producers']} producers, "
        f"{t['killed_consumers']} consumers)",
        f"  with the killed  {t['lost_to_killed_consumers']} messages died with killed consumers; "
        f"{t['in_transit_at_kill']} were on their way when their producer was killed "
        "(all delivered); "
        f"{t['truncated_frames']} channels ended in a truncated frame",
        f"  leftovers        /dev/shm files {t['leftovers']['shm_files']}, "
        f"segment fds {t['leftovers']['segment_fds']}, "
        f"live processes {t['leftovers']['processes']}",
        f"  daemon refs      after workers: {t['daemon_refs_after_workers']} "
        "(messages that died with killed "
        "processes; released when their program ended)",
        f"  left             {t['left']}   (the leftovers above, leader fds on segments, daemon "
        "references after the workers with no process killed)",
        "  result           "
        + ("ok" if rep["ok"] else "PROBLEMS:\n    " + "\n    ".join(rep["problems"])),
    ]
    return "\n".join(lines)


def add_parser(subparsers):
    from . import COMMANDS
    p = subparsers.add_parser("stress", help=COMMANDS["stress"], description=(
        COMMANDS["stress"] + ". Rounds alternate the sharing strategies and start methods; "
        "exit status 1 if any message was lost or corrupted or anything was left behind."))
    p.add_argument("--seconds", type=float, default=60.0, help="how long to run (default 60)")
    p.add_argument("--seed", type=int, default=None,
                   help="random seed (default: a fresh one, printed)")
    p.add_argument("--fork-threads", choices=FORK_THREADS, default="alternate",
                   help="which fork events run beside helper threads that make, drop and "
                        "receive arrays: every other pair (alternate, the default), all "
                        "(always, a hunt for fork-with-threads races) or none (never)")
    p.add_argument("--json", metavar="FILE", help="write the full report as JSON to FILE")
    return p


def run(args):
    if not sys.platform.startswith("linux"):
        print("stress runs on Linux only (it reads /proc)", file=sys.stderr)
        return 2
    rep = stress(args.seconds, args.seed, log=lambda s: print(s, flush=True),
                 fork_threads=args.fork_threads)
    print(format_summary(rep), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1, default=str)
    return 0 if rep["ok"] else 1

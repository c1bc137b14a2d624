"""``python -m sharedmp stress [--seconds S] [--json FILE]``: load, SIGKILLs, and a count of
what went wrong.

The run is a series of rounds ("epochs"), alternating the two sharing strategies (and
the spawn and forkserver start methods). Each epoch is one program::

    stress (this process)          never touches shared memory; checks leftovers after each epoch
      └─ leader (spawn)            the epoch's program: shared counters, wiring, SIGKILLs, verdict
           ├─ producer × P         T threads each; random arrays (dtypes, sizes, views) and objects
           └─ consumer × C         K threads each; checks every message end to end

Every producer has its own one-way sharedmp ``Pipe`` to every consumer, so that how a
channel ends tells of one producer and one consumer. A producer's threads send on its
channels at the same time, with no lock: one frame is one SOCK_SEQPACKET record sent by
one ``sendmsg`` (``channels/fdpass.py``), so concurrent senders never interleave, and a
writer killed in the middle of a ``send()`` leaves the channel intact for the others.
A message is ``(producer, thread, seq, items, digests)``; each item is an array or an
ordinary object and its digest (blake2b of dtype, shape, flags and bytes; of the pickle
for objects). Per stream (producer, thread, consumer), the producer counts the messages
whose ``send()`` returned and the consumer the ones it received in order, in shared
counters that outlive a SIGKILL. The leader SIGKILLs random producers and consumers
while they run; once all have ended it judges every stream:

- neither end killed: received == sent, every digest right, no duplicate, no gap;
- producer killed: nothing whose ``send()`` returned may be lost (received is sent, or
  sent + 1: the message on its way when the kill came); its channels end in EOF like any
  other. A ``ProtocolError`` there is counted apart (``truncated_frames``, which a record
  sent whole or not at all keeps at 0) and its text kept (``truncated_notes``);
- consumer killed: what was sent to it and not received is counted apart
  (``lost_to_killed_consumers``): it died with it.

Leftovers, after each epoch's program has ended: ``sharedmp_*`` files in the run's private
shared-memory directory, fds of this process on segments, live processes of the run
(found by a token in their environment: workers, fork server, manager daemon) and, in
the leader once its workers are gone, the references its manager daemon still tracks.
"""
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


def make_array(rng, mp):
    """A random array: shared or not, any dtype, 0-d to 3-d, up to 2 MiB, sometimes a view."""
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
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = rng.integers(0, 256, size=size, dtype=np.uint8)
    if dtype.kind == "b":
        raw &= 1                                         # bools other than 0/1 are not canonical
    src = raw.view(dtype).reshape(shape)
    if rng.random() < 0.7:
        a = mp.empty(shape, dtype)                       # shared from the start
        a[...] = src
    else:
        a = src                                          # copied once into shared memory when sent
    v = rng.random()
    if a.ndim >= 1 and a.shape[0] > 2 and v < 0.3:
        a = a[::-1] if v < 0.15 else a[1::2]             # negative strides, a gap between items
    elif a.ndim == 2 and v < 0.4:
        a = a.T
    if rng.random() < 0.2:
        a = a.view()
        a.flags.writeable = False
    return a


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


def make_message(rng, mp, p, t, seq):
    items = [make_array(rng, mp) if rng.random() < 0.6 else make_object(rng)
             for _ in range(int(rng.integers(1, 5)))]
    nbytes = sum(x.nbytes for x in items if isinstance(x, np.ndarray))
    # Which arrays must arrive shared: those shared already, and plain ones too large to
    # travel by value (a smaller plain one may, or may not, by the message's budget).
    must_share = [isinstance(x, np.ndarray) and (mp.is_shared(x) or x.nbytes > BY_VALUE_MAX)
                  for x in items]
    return (p, t, seq, items, [digest(x) for x in items], must_share), nbytes


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


def producer(p, links, counters, clock, seed, report):
    """Send to every consumer from PRODUCER_THREADS threads until the deadline."""
    import sharedmp as mp
    deadline = _start_when_told(clock, p)
    errors = []
    dead = [False] * len(links)

    def thread(t):
        rng = np.random.default_rng([seed, p, t])
        while time.monotonic() < deadline and not all(dead):
            c = int(rng.integers(len(links)))
            row = counters[p, t, c]
            if dead[c] or row[SENT] - row[RECV] >= WINDOW:
                time.sleep(0.001)
                continue
            msg, nbytes = make_message(rng, mp, p, t, int(row[SENT]))
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


def consumer(c, links, counters, cstats, ends, clock, report):
    """Receive from every producer with CONSUMER_THREADS threads; check every message."""
    import sharedmp as mp
    from multiprocessing.connection import wait
    deadline = _start_when_told(clock, len(counters) + c)
    errors = []

    def check(p, msg):
        sender, t, seq, items, digests, must_share = msg
        row = counters[p, t, c]
        if sender != p or len(items) != len(digests) \
                or any(digest(x) != d for x, d in zip(items, digests)) \
                or not all(mp.is_shared(x) for x, m in zip(items, must_share) if m):
            cstats[c, CORRUPT] += 1
        if seq < row[RECV]:
            cstats[c, DUPLICATE] += 1
            return
        if seq > row[RECV]:
            cstats[c, GAP] += seq - row[RECV]
        row[RECV_BYTES] += sum(x.nbytes for x in items if isinstance(x, np.ndarray))
        row[RECV] = seq + 1

    def thread(k):
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
                    check(p, msg)
                    del msg
                    continue
                del mine[conn]
                conn.close()

    threads = [threading.Thread(target=thread, args=(k,)) for k in range(CONSUMER_THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    _report(report, errors)


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
        self.clock = mp.zeros(1 + P + C, np.float64)   # [deadline, ready flag of each worker]
        links = [[ctx.Pipe(duplex=False) for _ in range(C)] for _ in range(P)]
        self.reports = [ctx.Pipe(duplex=False) for _ in range(P + C)]
        self.procs = [ctx.Process(target=producer, name=f"producer-{p}",
                                  args=(p, [links[p][c][1] for c in range(C)], self.counters,
                                        self.clock, cfg["seed"], self.reports[p][1]))
                      for p in range(P)]
        self.procs += [ctx.Process(target=consumer, name=f"consumer-{c}",
                                   args=(c, [links[p][c][0] for p in range(P)], self.counters,
                                         self.cstats, self.ends, self.clock,
                                         self.reports[P + c][1]))
                       for c in range(C)]
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
    verdict["leftovers"] = {
        "shm_files": 0 if files is True else len(files),
        "segment_fds": len(arena.stray_segment_fds()),
        "processes": 0 if gone else len(live_run_processes(token)),
    }
    for name in ([] if files is True else files):             # do not let one epoch spoil the next
        os.unlink(os.path.join(shm_dir, name))
    return verdict


VIOLATIONS = ("corrupted", "lost", "duplicated", "receive_errors", "bad_channel_ends")


def problems(v):
    """What is wrong in an epoch's verdict (empty: all good)."""
    out = [f"{k} = {v[k]}" for k in VIOLATIONS if v.get(k)]
    if v.get("failed"):
        out.append(v["failed"])
    out += [f"hung: {h}" for h in v.get("hung", [])] + v.get("unclean_exits", [])
    # A send that raised (other than on a killed consumer) stopped its thread: never right.
    out += [n for n in v.get("notes", []) if n.startswith("producer ")]
    out += [f"leftover {k} = {n}" for k, n in v.get("leftovers", {}).items() if n]
    if v.get("leader_segment_fds"):
        out.append(f"leader segment fds = {v['leader_segment_fds']}")
    daemon = v.get("daemon_after_workers")
    if daemon and (daemon["segments"] or daemon["in_flight"]) \
            and not (v["killed_producers"] or v["killed_consumers"]):
        out.append(f"daemon still tracks {daemon} with no process killed")
    return out


def stress(seconds=60.0, seed=None, log=print):
    """Run for about ``seconds``; the report (a dict)."""
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
                       seed=seed + i)
            v = run_epoch(cfg, token, shm_dir)
            v["problems"] = problems(v)
            epochs.append(v)
            log(f"epoch {i + 1}/{n} {v['strategy']:<15} {v['start_method']:<10} "
                f"{v.get('messages', 0):>8} msgs {v.get('bytes', 0) / 2**20:>8.1f} MiB  kills "
                f"{v.get('killed_producers', 0)}p+{v.get('killed_consumers', 0)}c  "
                + ("ok" if not v["problems"] else "PROBLEMS: " + "; ".join(v["problems"])))
    finally:
        for k, val in saved.items():
            if val is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = val
        shutil.rmtree(shm_dir, ignore_errors=True)
    wall = time.monotonic() - t0
    keys = ("messages", "bytes", "corrupted", "lost", "duplicated", "receive_errors",
            "bad_channel_ends",
            "lost_to_killed_consumers", "in_transit_at_kill", "truncated_frames",
            "killed_producers", "killed_consumers")
    totals = {k: sum(v.get(k, 0) for v in epochs) for k in keys}
    totals["by_strategy"] = {s: {k: sum(v.get(k, 0) for v in epochs if v["strategy"] == s)
                                 for k in ("messages", "bytes", "killed_producers",
                                           "killed_consumers")}
                             for s in ("file_descriptor", "file_system")}
    totals["kills_survived"] = totals["killed_producers"] + totals["killed_consumers"]
    totals["leftovers"] = {k: sum(v.get("leftovers", {}).get(k, 0) for v in epochs)
                           for k in ("shm_files", "segment_fds", "processes")}
    totals["daemon_refs_after_workers"] = {
        k: sum((v.get("daemon_after_workers") or {}).get(k, 0) for v in epochs)
        for k in ("segments", "in_flight")}
    totals["hung"] = sum(len(v.get("hung", [])) for v in epochs)
    bad = [f"epoch {i + 1}: {p}" for i, v in enumerate(epochs) for p in v["problems"]]
    return dict(seconds=seconds, wall_s=round(wall, 1), seed=seed, cpus=os.cpu_count(),
                loadavg=os.getloadavg(),
                config=dict(producers=PRODUCERS, producer_threads=PRODUCER_THREADS,
                            consumers=CONSUMERS, consumer_threads=CONSUMER_THREADS,
                                                     epochs=n, window_s=round(window, 2)),
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
        f"  corrupted        {t['corrupted']}",
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
    p.add_argument("--json", metavar="FILE", help="write the full report as JSON to FILE")
    return p


def run(args):
    if not sys.platform.startswith("linux"):
        print("stress runs on Linux only (it reads /proc)", file=sys.stderr)
        return 2
    rep = stress(args.seconds, args.seed, log=lambda s: print(s, flush=True))
    print(format_summary(rep), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1, default=str)
    return 0 if rep["ok"] else 1

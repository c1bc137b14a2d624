"""The driver program and the child processes of tests/test_lifetime.py (the lifetime oracle).

``python tests/_lifetime_workers.py`` is one example's parent: a fresh interpreter started by
the test with a private $SHAREDMP_SHM_DIR, the sharing strategy in the environment and no
$SHAREDMP_MANAGER (so, under file_system, a manager daemon of its own), in a session of its
own (the test kills its process group if anything hangs). It reads one JSON command a line on
stdin and answers one JSON line on stdout: ``{"ok": true, ...}`` or ``{"ok": false, "error":
...}``. It holds arrays, starts long-lived children (fork, forkserver and spawn Processes of
sharedmp, raw ``os.fork()`` children) that run ``child_loop`` on a sharedmp Pipe, sends arrays
to them on every kind of channel, and asks every process to check the bytes of each array it
holds. Every wait is bounded: a child that does not answer in ``WAIT`` s is a failure.

Each array has an id and a pattern of its own: element i holds ``id * 2**20 + i`` (float64),
so an array that shows another array's bytes (a segment recycled while still mapped by
someone, a stale mapping, a wrong offset in an arena) is caught, and which one it shows is
reported.

Helper threads (``Helpers``, the oracle with threads): threads of the driver that make and
drop arrays (a 1 MiB segment of its own and 8 KiB carved from an arena each step, the last
few kept) and receive arrays from a feeder process, running while the main thread forks (raw
``os.fork()`` children, fork-context Processes, torch DataLoader workers). A fork child keeps
what the threads held at the fork (their ids count from ``THREAD_IDS``: the model does not
know them, only that each holds its own pattern) while the threads go on dropping and making
new ones of the same sizes: a segment made, mapped or taken from the pool between the fork
hook's list of what the child inherits and the fork itself, then recycled by the parent,
shows in the child as another array's bytes.

This module is also imported (as ``_lifetime_workers``) by the children: spawn and forkserver
children unpickle ``child_loop`` and ``checksum`` from here, not from ``__main__``.
"""
import collections
import contextlib
import gc
import itertools
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback

import numpy as np

import sharedmp as mp
from sharedmp.cli.stress import (put_unless_stopped, read_json_line, received, stop_feeder,
                                 stop_threads, wait_turn)
from sharedmp.memory import manager, named, segment

HERE = os.path.dirname(os.path.abspath(__file__))
WAIT = 30.0             # seconds for any answer of a child, any get, any join
STEP = 1 << 20          # pattern: element i of array ``id`` is id * STEP + i
# size classes: (elements, how it is made)
CLASSES = {
    "value": 64,          # a plain NumPy array, not shared: travels by value
    "copied": 1 << 18,    # a plain NumPy array of 2 MiB: copied into shared memory when sent
    "arena": 2048,        # mp.zeros: 16 KiB carved from a 4 MiB arena
    "own": 1 << 19,       # mp.zeros: 4 MiB, a segment of its own
}
# Arrays of the helper threads (ids from THREAD_IDS; the feeder's from FEEDER_IDS): what a
# step makes, in elements (1 MiB: a segment of its own; 8 KiB: carved from an arena), and
# how many arrays each thread keeps before it drops the oldest.
THREAD_IDS = 1 << 24
FEEDER_IDS = 1 << 26
THREAD_SIZES = (1 << 17, 1 << 10)
THREAD_KEEP = 8


# -- arrays -----------------------------------------------------------------------------

def pattern(ident, n):
    return ident * float(STEP) + np.arange(n, dtype=np.float64)


def make(ident, cls):
    n = CLASSES[cls]
    a = np.empty(n) if cls in ("value", "copied") else mp.zeros(n)
    a[:] = pattern(ident, n)
    return a


def make_shared(ident, n):
    a = mp.empty(n)
    a[:] = pattern(ident, n)
    return a


def verdict(ident, a, sample=False):
    """True if ``a`` holds exactly array ``ident``'s pattern, else what it holds instead
    (``sample``: true if every 97th element does, a quick look)."""
    try:
        n = len(a)
        if sample and np.array_equal(a[::97], ident * float(STEP)
                                     + np.arange(0, n, 97, dtype=np.float64)):
            return True
        if np.array_equal(a, pattern(ident, n)):
            return True
        bad = np.flatnonzero(a != pattern(ident, n))
        first = int(bad[0])
        seen = float(a[first])
        return {"bad_elements": int(len(bad)), "first_bad": first, "value": seen,
                "looks_like_id": int(seen // STEP) if seen >= 0 else None, "len": n}
    except Exception as e:     # noqa: BLE001 -- a crash reading it is a wrong answer too
        return {"error": repr(e)}


def check_held(held):
    """[(id, verdict)] of every copy in ``held`` {id: [arrays]}."""
    return [(i, verdict(i, a)) for i in sorted(held) for a in held[i]]


def checksum(ident, a):
    """A pool task: (id, pattern verdict, sum) of an array received as an argument."""
    return ident, verdict(ident, a), float(a.sum())


def expected_sum(ident, n):
    return float(pattern(ident, n).sum())


def segment_fds(shm):
    """This process's fds on sharedmp segments (memfd or a file in ``shm``)."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("/memfd:sharedmp") or (shm and target.startswith(shm + "/")):
            out.append((int(name), target))
    return out


def shm_files(shm):
    """Every sharedmp_* file under ``shm``, pool directories included."""
    out = []
    for d, _, names in os.walk(shm):
        out += [os.path.relpath(os.path.join(d, n), shm) for n in names
                if n.startswith(named.PREFIX)]
    return sorted(out)


# -- the children -----------------------------------------------------------------------

def _get(channel, kind):
    """One message from a data channel, within WAIT s (TimeoutError otherwise)."""
    if kind in ("queue", "std_queue"):
        return channel.get(timeout=WAIT)
    reader = channel._reader if kind == "simple_queue" else channel
    if not reader.poll(WAIT):
        raise TimeoutError(f"nothing on the {kind} within {WAIT} s")
    return channel.get() if kind == "simple_queue" else channel.recv()


def child_loop(conn, channels, held, args=(), extra=()):
    """A child's command loop on ``conn``, its end of a *standard* ``multiprocessing.Pipe``:
    commands and checks carry no arrays and must not call into sharedmp, so that checking a
    fork child does not change what it told the manager daemon (a child that has not used
    sharedmp since the fork is a case of its own).

    ``channels``: {kind: channel} the parent sends arrays on (a sharedmp Pipe is "pipe");
    ``held``: {id: [arrays]} it holds from the start (a fork child: what it inherited);
    ``args``: [(id, array)] it was started with (Process arguments);
    ``extra``: the helper threads' lists of [(id, array)] (a fork child: as they were at the
    fork), kept to the end.
    """
    held = inherited(held, extra)
    for i, a in args:
        held.setdefault(i, []).append(a)
    del args, extra
    while True:
        if not conn.poll(WAIT * 4):
            return                              # the parent is gone or stuck: leave
        cmd = conn.recv()
        op = cmd[0]
        try:
            if op == "check":
                reply = check_held(held)
            elif op == "recv":
                _, kind, ids = cmd
                got = []
                for _ in ids:
                    i, a = _get(channels[kind], kind)
                    held.setdefault(i, []).append(a)
                    got.append((i, verdict(i, a)))
                    del a
                reply = got
            elif op == "drop":
                held.pop(cmd[1], None)
                gc.collect()
                reply = None
            elif op == "empty_cache":
                gc.collect()
                mp.empty_cache()
                reply = None
            elif op == "exit":
                held.clear()
                gc.collect()
                mp.empty_cache()
                conn.send(("ok", None))
                return
            else:
                reply = f"unknown op {op!r}"
            conn.send(("ok", reply))
        except Exception:       # noqa: BLE001 -- reported to the parent, which fails the step
            conn.send(("error", traceback.format_exc()))


def inherited(held, extra=()):
    """{id: [arrays]}: a copy of ``held``, with the arrays of the helper threads' lists
    ``extra`` (a fork child's: as they were at the fork; no thread runs there to change them)."""
    out = {i: list(v) for i, v in held.items()}
    for kept in extra:
        for i, a in list(kept):
            out.setdefault(i, []).append(a)
    return out


def _raw_fork_main(conn, channels, held, extra=()):
    code = 1
    try:
        _die_with_parent()
        child_loop(conn, channels, held, extra=extra)
        code = 0
    except BaseException:       # noqa: BLE001
        traceback.print_exc()
    finally:
        os._exit(code)


def _die_with_parent():
    """PR_SET_PDEATHSIG(SIGKILL): a raw fork child dies with the driver."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except Exception:           # noqa: BLE001 -- best effort (the test kills the group anyway)
        pass


def burst_child(out_fd, held, extra, hold_ms):
    """A short-lived fork child of a burst: keep what it inherited (the parent's arrays and the
    helper threads' as they were at the fork) for ``hold_ms`` while the parent's threads drop
    and make arrays, check every one, report [(id, verdict)] as a JSON line on ``out_fd``."""
    mine = inherited(held, extra)
    del held, extra
    time.sleep(hold_ms / 1000)
    os.write(out_fd, json.dumps(check_held(mine)).encode() + b"\n")
    os.close(out_fd)


def _raw_burst_main(out_fd, held, extra, hold_ms):
    code = 1
    try:
        _die_with_parent()
        burst_child(out_fd, held, extra, hold_ms)
        code = 0
    except BaseException:       # noqa: BLE001
        traceback.print_exc()
    finally:
        os._exit(code)


class ForkedCheck:
    """A torch Dataset (duck-typed) whose DataLoader workers, forked while the helper threads
    run, report on what they inherited: item k is (pid, [(id, verdict)]) after ``hold_ms``."""

    def __init__(self, held, extra, hold_ms, n):
        self.held, self.extra, self.hold_ms, self.n = held, extra, hold_ms, n

    def __len__(self):
        return self.n

    def __getitem__(self, k):
        mine = inherited(self.held, self.extra)     # (a worker's: as they were at its fork)
        time.sleep(self.hold_ms / 1000)
        return os.getpid(), check_held(mine)


def first(batch):
    """DataLoader collate_fn: the one sample of a batch, as it is."""
    return batch[0]


def feeder(q, stop, base):
    """A process that makes arrays (ids from ``base``) and puts them on ``q`` (bounded) for the
    driver's receiving thread, until ``stop`` is set."""
    ids = itertools.count(base)
    while not stop.is_set():
        for n in THREAD_SIZES:
            i = next(ids)
            item = (i, make_shared(i, n))
            put_unless_stopped(q, item, stop)
            del item


class Helpers:
    """The driver's helper threads: "alloc" makes and drops arrays, "recv" receives them from a
    feeder process (started by ``feeder_method``); each keeps its last THREAD_KEEP (the lists
    of ``kept``) and checks every array as it drops it (and one received as it comes). They
    run while ``running()`` (around the driver's forks) and wait otherwise."""

    def __init__(self, kinds, feeder_method):
        self.kept = [[] for _ in kinds]
        self.go = threading.Event()
        self.stop_now = threading.Event()
        self.stats = collections.Counter()
        self.bad = []
        self.feeder = None
        if "recv" in kinds:
            ctx = mp.get_context(feeder_method)
            self.queue, self.feeder_stop = ctx.Queue(2), ctx.Event()
            self.feeder = ctx.Process(target=feeder, args=(self.queue, self.feeder_stop,
                                                           FEEDER_IDS), daemon=True)
            self.feeder.start()
        self.threads = [threading.Thread(target=getattr(self, "_" + k), args=(kept,),
                                         name=f"helper-{j}-{k}", daemon=True)
                        for j, (k, kept) in enumerate(zip(kinds, self.kept))]
        for t in self.threads:
            t.start()

    def lists(self):
        return list(self.kept)

    @contextlib.contextmanager
    def running(self):
        self.go.set()
        time.sleep(0.005)           # (the threads wake)
        try:
            yield
        finally:
            self.go.clear()

    def _keep(self, kept, i, a, kind, check):
        if check:
            v = verdict(i, a)
            if v is not True:
                self.bad.append((kind, "when received", i, v))
        kept.append((i, a))
        self.stats[f"thread_{kind}"] += 1
        while len(kept) > THREAD_KEEP:
            i, a = kept.pop(0)
            v = verdict(i, a, sample=True)
            if v is not True:
                self.bad.append((kind, "when dropped", i, v))
            del a
            self.stats[f"thread_drops_{kind}"] += 1

    def _alloc(self, kept):
        ids = itertools.count(THREAD_IDS)
        while wait_turn(self.go, self.stop_now):
            for n in THREAD_SIZES:
                i = next(ids)
                self._keep(kept, i, make_shared(i, n), "alloc", False)

    def _recv(self, kept):
        for i, a in received(self.queue, self.go, self.stop_now):
            self._keep(kept, i, a, "recv", True)
            del a

    def stop(self):
        """Stop the threads and the feeder, let go of what they hold; problems (a list)."""
        problems = [f"helper thread {t.name} did not stop within {WAIT} s"
                    for t in stop_threads(self.threads, self.stop_now, WAIT)]
        for kept in self.kept:
            del kept[:]
        if self.feeder is not None:
            if not stop_feeder(self.feeder, self.feeder_stop, self.queue, WAIT):
                problems.append(f"the feeder (pid {self.feeder.pid}) did not stop (killed)")
            elif self.feeder.exitcode != 0:
                problems.append(f"the feeder exit code {self.feeder.exitcode}")
            self.feeder = None
        if self.bad:
            problems.append(f"helper threads saw arrays whose bytes are not their own: "
                            f"{self.bad[:5]}")
        gc.collect()
        return problems


# -- the driver -------------------------------------------------------------------------

class Child:
    def __init__(self, cid, method, conn, channels, proc=None, pid=None):
        self.cid, self.method, self.conn, self.channels = cid, method, conn, channels
        self.proc, self.pid = proc, (proc.pid if proc is not None else pid)

    def ask(self, *cmd, timeout=WAIT):
        self.conn.send(cmd)
        return self.answer(cmd[0], timeout)

    def answer(self, what, timeout=WAIT):
        """The child's reply to the command ``what`` sent last (bounded; raises if it failed)."""
        if not self.conn.poll(timeout):
            raise TimeoutError(f"child {self.cid} ({self.method}, pid {self.pid}) did not "
                               f"answer {what!r} within {timeout} s")
        status, reply = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"child {self.cid} ({self.method}) failed {what!r}:\n{reply}")
        return reply

    def alive(self):
        if self.proc is not None:
            return self.proc.is_alive()
        try:
            done, _ = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return False
        return done == 0

    def join(self, timeout):
        """Wait for the child's end; its exit code, or None if it is still running."""
        if self.proc is not None:
            self.proc.join(timeout)
            return self.proc.exitcode
        deadline = time.monotonic() + timeout
        while True:
            try:
                done, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return -1
            if done:
                return os.waitstatus_to_exitcode(status)
            if time.monotonic() > deadline:
                return None
            time.sleep(0.005)

    def kill(self):
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return self.join(5)

    def close_channels(self):
        for kind, ch in self.channels.items():
            try:
                if kind in ("queue", "std_queue"):
                    ch.cancel_join_thread()      # unread items of a killed child: no hang
                ch.close()
            except Exception:    # noqa: BLE001
                pass
        self.conn.close()


def bounded(fn, timeout, what):
    """Run ``fn()`` on a thread; TimeoutError if it has not returned in ``timeout`` s."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:    # noqa: BLE001
            box["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError(f"{what} did not return within {timeout} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


class Driver:
    def __init__(self):
        self.strategy = mp.get_sharing_strategy()
        self.shm = os.path.realpath(named.shm_dir())
        self.held = {}          # id: [arrays] this process holds
        self.sizes = {}         # id: elements
        self.children = {}      # cid: Child
        self.pools = {}         # (kind, method): Pool or ProcessPoolExecutor
        self.helpers = None     # Helpers (the oracle with threads)

    def _around_fork(self):
        """While the driver forks: its helper threads run (if it has any)."""
        return self.helpers.running() if self.helpers else contextlib.nullcontext()

    def _thread_lists(self):
        return self.helpers.lists() if self.helpers else []

    def do_helpers(self, kinds, feeder):
        self.helpers = Helpers(kinds, feeder)

    # commands: each returns what goes into the reply
    def do_alloc(self, id, cls):
        self.held.setdefault(id, []).append(make(id, cls))
        self.sizes[id] = CLASSES[cls]

    def do_drop(self, id):
        self.held.pop(id, None)
        gc.collect()

    def do_wait(self, ms):
        time.sleep(ms / 1000)

    def _arrays(self, ids):
        return [(i, self.held[i][0]) for i in ids]

    def do_start(self, cid, method, ids, drop=(), check=True):
        """Start child ``cid``; then at once (within the fork's first milliseconds) drop
        ``drop`` in the parent."""
        ctx = mp.get_context("fork" if method == "raw_fork" else method)
        conn, theirs = multiprocessing.Pipe()          # commands (no arrays): not sharedmp's
        ours, pipe = mp.Pipe()
        channels = {"queue": ctx.Queue(), "simple_queue": ctx.SimpleQueue(), "pipe": pipe,
                    # the standard library's queue, created after `import sharedmp`
                    "std_queue": multiprocessing.get_context(ctx.get_start_method()).Queue()}
        forks = method in ("fork", "raw_fork")
        inherit = self.held if forks else {}
        extra = self._thread_lists() if forks else []       # (as they are at the fork)
        with self._around_fork() if forks else contextlib.nullcontext():
            if method == "raw_fork":
                pid = os.fork()
                if pid == 0:
                    conn.close()
                    ours.close()
                    _raw_fork_main(theirs, channels, inherit, extra)
                child = Child(cid, method, conn, dict(channels, pipe=ours), pid=pid)
            else:
                proc = ctx.Process(target=child_loop, daemon=True,
                                   args=(theirs, channels, inherit, self._arrays(ids), extra))
                proc.start()
                child = Child(cid, method, conn, dict(channels, pipe=ours), proc=proc)
        for i in drop:
            self.held.pop(i, None)
        gc.collect()
        theirs.close()
        pipe.close()
        self.children[cid] = child
        return {"pid": child.pid, "check": child.ask("check") if check else None}

    def do_send(self, cid, channel, ids):
        child = self.children[cid]
        child.conn.send(("recv", channel, ids))
        self._put(child, channel, ids)
        return {"got": child.answer(f"recv {ids} on the {channel}")}

    def _put(self, child, channel, ids):
        """Send the arrays ``ids`` to ``child`` on ``channel``, keeping no reference."""
        item = None
        for item in self._arrays(ids):
            if channel == "pipe":
                child.channels["pipe"].send(item)
            else:
                child.channels[channel].put(item)
        del item

    def do_child_drop(self, cid, id):
        self.children[cid].ask("drop", id)

    def do_empty_cache(self, where):
        if where == "parent":
            gc.collect()
            mp.empty_cache()
        else:
            self.children[where].ask("empty_cache")

    def do_kill(self, cid, in_flight):
        """SIGKILL child ``cid``; first, if ``in_flight`` = (channel, ids), put those arrays
        on that channel without telling it: they are in flight, never read."""
        child = self.children.pop(cid)
        if in_flight:
            self._put(child, *in_flight)
            time.sleep(0.01)          # (the Queue's feeder thread writes it)
        code = child.kill()
        child.close_channels()
        return {"exitcode": code}

    def do_pool(self, kind, method, ids):
        key = (kind, method)
        if key not in self.pools:
            ctx = mp.get_context(method)
            if kind == "pool":
                self.pools[key] = ctx.Pool(1)
            else:
                import concurrent.futures
                self.pools[key] = concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx)
        pool, args = self.pools[key], self._arrays(ids)
        if kind == "pool":
            results = pool.starmap_async(checksum, args).get(WAIT)
        else:
            futures = [pool.submit(checksum, i, a) for i, a in args]
            results = [f.result(WAIT) for f in futures]
        del args
        out = []
        for (i, ok, total) in results:
            right = expected_sum(i, self.sizes[i])
            out.append((i, ok if ok is not True or total == right
                        else {"checksum": total, "expected": right}))
        return {"results": out}

    def do_check(self):
        """{process: [(id, verdict)]} of the driver ("parent") and every live child; what the
        helper threads found wrong in their own arrays."""
        out = {"parent": check_held(self.held)}
        for cid, child in self.children.items():
            out[cid] = child.ask("check")
        return {"held": out, "threads_bad": self.helpers.bad[:5] if self.helpers else []}

    def do_fork_burst(self, method, n, hold_ms, at_once):
        """``n`` short-lived fork children (raw ``os.fork()`` or fork-context Processes), at
        most ``at_once`` alive, forked while the helper threads run: each keeps what it
        inherited for ``hold_ms``, then reports its verdicts; [[(id, verdict)]] per child."""
        ctx = mp.get_context("fork")
        extra, live, out, problems = self._thread_lists(), collections.deque(), [], []

        def collect():
            pid, proc, r = live.popleft()
            try:
                rep = read_json_line(r, WAIT)
            finally:
                os.close(r)
            child = Child("burst", method, None, {}, proc=proc, pid=pid)
            code = child.join(WAIT)
            if code is None:
                child.kill()
            if rep is None or code != 0:
                problems.append(f"burst child pid {pid} ({method}): report "
                                f"{'none' if rep is None else 'sent'}, exit code {code}")
            out.append(rep or [])

        try:
            with self._around_fork():
                for _ in range(n):
                    while len(live) >= at_once:
                        collect()
                    r, w = os.pipe()
                    proc = None
                    if method == "raw_fork":
                        pid = os.fork()
                        if pid == 0:
                            os.close(r)
                            _raw_burst_main(w, self.held, extra, hold_ms)
                    else:
                        proc = ctx.Process(target=burst_child, daemon=True,
                                           args=(w, self.held, extra, hold_ms))
                        proc.start()
                        pid = proc.pid
                    os.close(w)
                    live.append((pid, proc, r))
                while live:
                    collect()
        finally:
            for pid, proc, r in live:               # (after an error: none left behind)
                Child("burst", method, None, {}, proc=proc, pid=pid).kill()
                os.close(r)
        if problems:
            raise RuntimeError("; ".join(problems[:5]))
        return {"children": out, "threads_bad": self.helpers.bad[:5] if self.helpers else []}

    def do_dataloader(self, workers, hold_ms):
        """A torch DataLoader over ``ForkedCheck`` with ``workers`` fork workers (sharedmp's
        fork context), started and run while the helper threads run; {pid: [[(id, verdict)]]}
        per worker."""
        from torch.utils.data import DataLoader
        loader = DataLoader(ForkedCheck(self.held, self._thread_lists(), hold_ms, 2 * workers),
                            batch_size=1, num_workers=workers, collate_fn=first,
                            multiprocessing_context=mp.get_context("fork"), timeout=WAIT)
        out = collections.defaultdict(list)
        with self._around_fork():
            for pid, pairs in loader:
                out[pid].append(pairs)
        del loader
        gc.collect()
        return {"workers": out, "threads_bad": self.helpers.bad[:5] if self.helpers else []}

    def do_finish(self):
        """Teardown: children exit, pools close, everything is let go; then what is left."""
        problems, threads = [], {}
        if self.helpers is not None:
            problems += self.helpers.stop()
            threads = dict(self.helpers.stats)
            self.helpers = None
        for cid, child in list(self.children.items()):
            try:
                child.ask("exit", timeout=10)
            except Exception as e:       # noqa: BLE001
                problems.append(f"child {cid} ({child.method}) exit: {e}")
            code = child.join(10)
            if code is None:
                problems.append(f"child {cid} ({child.method}, pid {child.pid}) did not exit "
                                "within 10 s (killed)")
                child.kill()
            elif code != 0:
                problems.append(f"child {cid} ({child.method}) exit code {code}")
            child.close_channels()
        self.children.clear()
        child = None            # (the last Child: its Process object holds its popen)
        for (kind, method), pool in self.pools.items():
            try:
                if kind == "pool":
                    pool.close()
                    bounded(pool.join, 15, f"Pool({method}).join()")
                else:
                    bounded(pool.shutdown, 15, f"ProcessPoolExecutor({method}).shutdown()")
            except Exception as e:       # noqa: BLE001
                problems.append(str(e))
                if kind == "pool":
                    pool.terminate()
        self.pools.clear()
        self.held.clear()
        for p in multiprocessing.active_children():
            problems.append(f"process {p.name} pid {p.pid} still alive after teardown (killed)")
            os.kill(p.pid, signal.SIGKILL)
            p.join(5)
        fs = self.strategy == "file_system"

        def left():
            gc.collect()
            mp.empty_cache()
            segment.forget_recent()
            stats = manager.stats() if fs else None
            busy = stats and (stats["clients"] > 1 or any(
                stats[k] for k in ("segments", "in_flight", "tokens", "pooled")))
            return shm_files(self.shm), segment_fds(self.shm), stats, busy

        deadline = time.monotonic() + 5
        while True:
            files, fds, stats, busy = left()
            if not (files or fds or busy) or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        if files:
            problems.append(f"segment files left in the shm dir: {files[:8]}")
        if fds:
            problems.append(f"segment fds left open in the parent: {fds[:8]}")
        if busy:
            problems.append(f"the daemon's counts are not back to zero: {stats} (clients "
                            "counts this parent's own connection)")
        return {"problems": problems, "stats": stats, "threads": threads}


def main():
    # (imported as a module, so that children pickle ``_lifetime_workers.child_loop``)
    sys.path.insert(0, HERE)
    import _lifetime_workers as W
    driver = W.Driver()
    out = sys.stdout
    sys.stdout = sys.stderr         # stray prints must not break the protocol
    print(json.dumps({"ok": True, "pid": os.getpid(), "strategy": driver.strategy,
                      "shm": driver.shm}), file=out, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            reply = getattr(driver, "do_" + op)(**cmd) or {}
            reply["ok"] = True
        except Exception:          # noqa: BLE001 -- the test reports it
            reply = {"ok": False, "error": traceback.format_exc()}
        print(json.dumps(reply), file=out, flush=True)
        if op == "finish":
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())

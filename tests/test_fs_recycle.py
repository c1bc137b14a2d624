"""Recycling named segments (file_system): reused by their creator only once the manager
daemon has found that no other process holds them and no message in flight names them.

The daemon moves a free parked segment to its pool directory (out of the shm directory's
listing); the creator reuses it under a new name (see memory/recycle.py).
"""
import gc
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

import sharedmp as mp
from sharedmp.arrays import mapping_of
from sharedmp.memory import arena, cache, daemon, leftovers, manager, named, recycle, segment

from conftest import TIMEOUT, eventually, join_or_kill

BIG = 2 << 20          # its own segment (arena.SMALL_LIMIT is 1 MiB)
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")


@pytest.fixture
def fs(monkeypatch):
    """file_system in a directory of this test's own (on the run's tmpfs); checked empty,
    pool directories included, once the test has let go of everything."""
    base = named.shm_dir()
    d = tempfile.mkdtemp(prefix="fsrecycle-", dir=base if os.path.isdir(base) else None)
    monkeypatch.setenv(named.SHM_DIR_ENV, d)
    # Kept segments are let go after cache.idle() seconds unused (1 s): more than a loaded
    # machine's spawn and join take. Tests of that release set their own.
    monkeypatch.setattr(cache, "_idle", 60.0)
    mp.set_sharing_strategy("file_system")
    recycle.clear()
    yield d
    segment.forget_recent()

    def empty():
        mp.empty_cache()
        return not listed(d) and not pooled(d)
    assert eventually(empty), (listed(d), pooled(d))
    shutil.rmtree(d, ignore_errors=True)


def listed(d):
    """The segments in the shm directory's listing."""
    return sorted(n for n in os.listdir(d) if n.startswith(named.PREFIX))


def pooled(d):
    """The segments in the pool directories of ``d`` (one the daemon removes while this looks
    has none)."""
    out = []
    for p in leftovers.pool_dirs(d):
        try:
            out += os.listdir(p)
        except FileNotFoundError:
            pass
    return sorted(out)


def ino(a):
    return os.stat(mapping_of(a)[1].path).st_ino


def name(a):
    return mapping_of(a)[1].name


def free_in_pool(key):
    """Whether the parked segment of inode ``key`` is in the pool (the daemon found it free)."""
    for e in list(recycle._entries):
        try:
            if e[4] is not None and os.stat(e[8]).st_ino == key:
                return True
        except OSError:
            pass
    return False


def reuse_of(key, size=BIG, timeout=5.0):
    """An array of ``size`` bytes made once the daemon has found the parked segment of inode
    ``key`` free (the oldest free one of that size is reused: the caller makes sure that is
    it), or None if it is not found free by then."""
    if not eventually(lambda: free_in_pool(key), timeout):
        return None
    a = mp.full(size, 9, np.uint8)
    return a if ino(a) == key else None


# -- reuse ------------------------------------------------------------------------------

def test_reused_under_a_new_name_once_free_and_out_of_the_listing_meanwhile(fs):
    a = mp.full(BIG, 255, np.uint8)
    key, first = ino(a), name(a)
    assert listed(fs) == [first]
    del a
    gc.collect()
    assert eventually(lambda: not listed(fs) and len(pooled(fs)) == 1)   # free: in the pool
    assert recycle.kept()[0] == 1
    z = mp.zeros(BIG, np.uint8)
    assert ino(z) == key and name(z) != first and not z.any()            # a new name, zeroed
    assert listed(fs) == [name(z)] and not pooled(fs)
    del z
    gc.collect()
    f = reuse_of(key)                             # (mp.full: overwritten, not zeroed first)
    assert f is not None and (f == 9).all()


def test_a_message_in_flight_keeps_its_segment_out_of_the_pool(fs):
    q = mp.SimpleQueue()
    a = mp.full(BIG, 7, np.uint8)
    key = ino(a)
    q.put(a)                                      # in the socket, not received yet
    del a
    gc.collect()
    time.sleep(0.05)                              # (time for the daemon to have moved it)
    assert len(listed(fs)) == 1 and not pooled(fs)
    others = [mp.full(BIG, i, np.uint8) for i in range(3)]
    assert key not in [ino(b) for b in others]
    got = q.get()
    assert ino(got) == key and (got == 7).all()
    del got
    gc.collect()
    assert reuse_of(key) is not None              # received and dropped: reused
    q.close()
    del others


def _hold_then_report(inbox, outbox, go):
    mp.set_sharing_strategy("file_system")
    a = inbox.get(timeout=TIMEOUT)
    outbox.put(("got", int(a[0]), int(a[-1])))
    go.wait(TIMEOUT)
    outbox.put(("still", int(a.min()), int(a.max())))


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_no_reuse_while_a_receiver_holds_it_and_no_stale_contents(fs, method):
    ctx = mp.get_context(method)
    inbox, outbox, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_hold_then_report, args=(inbox, outbox, go))
    p.start()
    try:
        a = mp.full(BIG, 1, np.uint8)
        key = ino(a)
        inbox.put(a)
        assert outbox.get(timeout=TIMEOUT) == ("got", 1, 1)
        del a
        gc.collect()
        time.sleep(0.05)
        for i in range(2, 8):                     # the receiver still holds the first one
            b = mp.full(BIG, i, np.uint8)
            assert ino(b) != key
            del b                                 # (parked: reused by the next, once free)
            eventually(lambda: recycle.take_named(1, "", set()) is None and pooled(fs), 1)
        go.set()
        assert outbox.get(timeout=TIMEOUT) == ("still", 1, 1)   # never overwritten
    finally:
        join_or_kill(p)
    assert p.exitcode == 0
    assert reuse_of(key) is not None              # the receiver is gone: reused


def _receive_all(inbox, outbox, n):
    mp.set_sharing_strategy("file_system")
    kept, bad = [], []
    for i in range(n):
        a = inbox.get(timeout=TIMEOUT)
        if not (int(a[0]) == int(a[-1]) == i % 251):
            bad.append((i, int(a[0]), int(a[-1])))
        if i % 10 == 0:
            kept.append((i, a))                    # some held while more are reused
        del a
    bad += [(i, int(a.min()), int(a.max())) for i, a in kept if not (a == i % 251).all()]
    outbox.put((bad, len(kept)))


def test_a_stream_of_fresh_arrays_reuses_segments_and_every_message_is_right(fs):
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_receive_all, args=(inbox, outbox, 300))
    p.start()
    try:
        for i in range(300):
            a = np.full(BIG, i % 251, np.uint8)   # plain: copied into shared memory at put
            inbox.put(a)
            del a
        bad, kept = outbox.get(timeout=TIMEOUT)
    finally:
        join_or_kill(p)
    assert p.exitcode == 0
    assert bad == [] and kept == 30
    stats = manager.stats()
    assert stats["pooled"] >= 1


# -- kills ------------------------------------------------------------------------------

def _make_send_and_hang(outbox, w):
    mp.set_sharing_strategy("file_system")
    kept = [mp.full(BIG, 3, np.uint8), mp.full(100, 4.0)]          # own segment, arena
    for i in range(6):                             # sent and dropped: parked, some pooled
        outbox.put(mp.full(BIG, i, np.uint8))
    w.send([name(a) for a in kept])
    time.sleep(TIMEOUT)


@linux_only
def test_a_killed_sender_leaves_nothing(fs):
    ctx = mp.get_context("spawn")
    outbox = ctx.Queue()
    r, w = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_make_send_and_hang, args=(outbox, w))
    p.start()
    try:
        assert r.poll(TIMEOUT)
        names = r.recv()
        got = [outbox.get(timeout=TIMEOUT) for _ in range(3)]         # three received, held
        assert [int(a[0]) for a in got] == [0, 1, 2]
        assert set(names) <= set(listed(fs))
        os.kill(p.pid, signal.SIGKILL)
        assert join_or_kill(p) == -signal.SIGKILL
        assert all((a == i).all() for i, a in enumerate(got))         # still readable
        del got
        gc.collect()
        segment.forget_recent()
    finally:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
    outbox.close()
    del outbox
    gc.collect()
    assert eventually(lambda: not listed(fs) and not pooled(fs), TIMEOUT), (listed(fs), pooled(fs))


def _receive_and_hang(inbox, w):
    mp.set_sharing_strategy("file_system")
    got = [inbox.get(timeout=TIMEOUT) for _ in range(3)]
    w.send([int(a[0]) for a in got])
    time.sleep(TIMEOUT)


@linux_only
def test_a_killed_receiver_leaves_nothing(fs):
    ctx = mp.get_context("spawn")
    inbox = ctx.Queue()
    r, w = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_receive_and_hang, args=(inbox, w))
    p.start()
    try:
        for i in range(5):                         # three received and held, two in flight
            inbox.put(mp.full(BIG, i, np.uint8))
        assert r.poll(TIMEOUT) and r.recv() == [0, 1, 2]
        os.kill(p.pid, signal.SIGKILL)
        assert join_or_kill(p) == -signal.SIGKILL
    finally:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
    inbox.close()
    del inbox
    gc.collect()
    # What the receiver held is free now: in the pool, out of the listing.
    assert eventually(lambda: not listed(fs), TIMEOUT), listed(fs)
    mp.empty_cache()
    assert eventually(lambda: not pooled(fs)), pooled(fs)


@linux_only
@pytest.mark.leaks_ok
def test_a_killed_program_leaves_nothing_in_the_pool(tmp_path):
    # The creator (the whole program) SIGKILLed with segments parked and pooled: the daemon
    # unlinks them under whichever name they have, then exits.
    code = ("import sys, time, gc, numpy as np, sharedmp as mp\n"
            "from sharedmp.memory import manager\n"
            "mp.set_sharing_strategy('file_system')\n"
            "for i in range(5):\n"
            "    a = mp.full(1 << 21, i, np.uint8); del a\n"
            "gc.collect(); time.sleep(0.2)\n"
            "keep = mp.full(1 << 21, 1, np.uint8)\n"
            "print(manager.daemon_pid(), flush=True); time.sleep(60)\n")
    env = {k: v for k, v in os.environ.items() if k != manager.ENV}
    env[named.SHM_DIR_ENV] = str(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            text=True)
    try:
        daemon_pid = int(proc.stdout.readline())
        assert eventually(lambda: pooled(tmp_path), TIMEOUT)             # some pooled
        assert listed(tmp_path)
    finally:
        proc.kill()
        proc.wait(TIMEOUT)
        proc.stdout.close()

    def gone():
        try:
            os.kill(daemon_pid, 0)
            return False
        except ProcessLookupError:
            return True
    assert eventually(lambda: not listed(tmp_path) and not pooled(tmp_path) and gone(), TIMEOUT)
    assert not leftovers.pool_dirs(str(tmp_path))                        # removed at exit


# -- bounds and release ---------------------------------------------------------------

def test_the_pool_is_bounded(fs, monkeypatch):
    arrays = [mp.full(BIG + 4096 * i, 1, np.uint8) for i in range(recycle.MAX_ENTRIES + 8)]
    del arrays
    gc.collect()
    count, nbytes = recycle.kept()
    assert 0 < count <= recycle.MAX_ENTRIES and nbytes <= recycle.limit()
    assert eventually(lambda: len(pooled(fs)) == count)      # the others unlinked
    monkeypatch.setattr(recycle, "_limit", 4 * BIG)          # bytes: a quarter for one segment
    recycle.clear()
    big = mp.full(BIG + 4096, 2, np.uint8)                   # more than a quarter: not kept
    del big
    gc.collect()
    assert recycle.kept() == (0, 0)
    halves = [mp.full(BIG // 2 + 4096 * i, 3, np.uint8) for i in range(12)]
    del halves
    gc.collect()
    assert 0 < recycle.kept()[1] <= 4 * BIG
    assert eventually(lambda: len(pooled(fs)) == recycle.kept()[0] and not listed(fs))


def test_the_pool_is_released_when_idle_and_by_empty_cache(fs, monkeypatch):
    a = [mp.full(BIG, i, np.uint8) for i in range(3)]
    del a
    gc.collect()
    assert recycle.kept()[0] == 3
    assert eventually(lambda: len(pooled(fs)) == 3)
    assert "pool" in cache.stats()["cache"] and cache.stats()["cache"]["pool"][0] == 3 * BIG
    # (only now a short idle time: with it from the start, a pass could let the pool go
    # before the stats above were read)
    monkeypatch.setattr(cache, "_idle", 0.2)
    # idle: let go by a pass of the caches, here in a wait on a channel (no thread does it)
    reader, writer = mp.Pipe(duplex=False)
    assert eventually(lambda: not reader.poll(0.05) and recycle.kept()[0] == 0, 5)
    assert eventually(lambda: not pooled(fs) and not listed(fs))
    monkeypatch.setattr(cache, "_idle", 3600.0)      # (the timer is not what is tested now)
    b = [mp.full(BIG, i, np.uint8) for i in range(3)]
    del b
    gc.collect()
    assert recycle.kept()[0] == 3
    mp.empty_cache()
    assert recycle.kept()[0] == 0
    assert eventually(lambda: not pooled(fs) and not listed(fs))


# -- arenas: out of the listing as soon as their last array goes -------------------------

def test_an_arena_leaves_the_listing_when_its_last_array_goes(fs):
    # torch's test_fs: a small tensor put on a queue, got back, dropped; then gc.collect()
    # (which holds the GIL for a while) and a look at the directory, round after round.
    for i in range(5):
        time.sleep(0.02)                           # (quiet: not a burst of carves)
        q = mp.Queue()
        a = mp.full(4, float(i))
        q.put(a)
        time.sleep(0.02)
        assert listed(fs)
        b = q.get(timeout=TIMEOUT)
        assert (b == i).all()
        del a, b
        q.close()
        q.join_thread()
        del q
        gc.collect()
        assert eventually(lambda: not listed(fs), 0.5, collect=False), (i, listed(fs))


def test_a_burst_keeps_its_arena_and_lets_it_go_after(fs, monkeypatch):
    # A burst is carves less than PARK_DEFER (5 ms) apart: a loaded machine can pause this
    # test longer than that between two lines, so the test stretches the burst's window.
    with monkeypatch.context() as m:
        m.setattr(named, "PARK_DEFER", 60.0)
        got = [mp.full(10, float(i)) for i in range(100)]
        names = {name(a) for a in got}
        assert len(names) == 1                     # one arena
        del got
        gc.collect()
        b = mp.full(10, 1.0)                       # carved from the same arena (kept in the burst)
        assert name(b) in names
    del b                                          # (PARK_DEFER back to 5 ms: the burst is over)
    gc.collect()
    # at the next pass of the caches (here: in a wait on a channel): parked
    reader, writer = mp.Pipe(duplex=False)
    assert eventually(lambda: not reader.poll(0.05) and not listed(fs), 5.0)


# -- the daemon's records -------------------------------------------------------------

def test_hostile_park_records_never_move_foreign_files(fs):
    import socket
    d = os.fsencode(fs)
    mp.zeros(10)
    bystander = os.path.join(fs, "not_a_segment")
    lookalike = os.path.join(fs, "sharedmp_" + "a" * 20)
    for p in (bystander, lookalike):
        with open(p, "wb") as f:
            f.write(b"x")
    s = socket.socket(socket.AF_UNIX)
    s.connect(manager.address())
    assert s.recv(100).startswith(b"OK ")
    s.sendall(b"HELLO 1\n")
    nxt = d + b"/sharedmp_" + b"b" * 20
    s.sendall(b"P %s\0%s\n" % (os.fsencode(lookalike), nxt))          # not held: ignored
    s.sendall(b"P /etc/passwd\0%s\n" % nxt)
    s.sendall(b"P %s\0/tmp/sharedmp_%s\n" % (os.fsencode(lookalike), b"c" * 20))
    s.sendall(b"P %s\n" % os.fsencode(lookalike))
    s.sendall(b"H %s\0notanumber\nu 1 junk\nu x %s\n" % (os.fsencode(lookalike), nxt))
    s.sendall(b"? -\n")
    assert s.recv(100).startswith(b"STATS ")
    s.close()
    assert os.path.exists(bystander) and os.path.exists("/etc/passwd")
    assert eventually(lambda: not os.path.exists(lookalike))           # held, then dropped
    # Nothing foreign pooled (the arena of mp.zeros(10), dropped, may be: it is ours).
    assert not {os.path.basename(lookalike), os.path.basename(nxt.decode())} & set(pooled(fs))
    assert not os.path.exists("/tmp/sharedmp_" + "c" * 20)
    os.unlink(bystander)
    assert (mp.zeros(1 << 18) == 0).all()                             # the daemon still serves


def test_copies_agree():
    # daemon.py is a stdlib-only script: its constants are copies
    assert daemon.POOL_DIR == manager.POOL_DIR
    assert leftovers.POOL_RE.match(manager.POOL_DIR % 123)
    assert named.KEEP_RECENT_NAMED_SIZE == arena.ARENA_SIZE


@linux_only
def test_doctor_clean_removes_what_a_killed_daemons_pool_left(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(TIMEOUT)                                # a pid that is gone
    pool = tmp_path / (manager.POOL_DIR % p.pid)
    pool.mkdir(mode=0o700)
    left = pool / ("sharedmp_" + "d" * 20)
    left.write_bytes(b"\0" * 4096)
    found = leftovers.find_leftovers(str(tmp_path))
    assert [e[0] for e in found] == [str(left)]
    env = {k: v for k, v in os.environ.items() if k != manager.ENV}
    env[named.SHM_DIR_ENV] = str(tmp_path)
    doctor = subprocess.run([sys.executable, "-m", "sharedmp", "doctor", "--clean"], env=env,
                            capture_output=True, text=True, timeout=TIMEOUT)
    assert not left.exists() and not pool.exists(), doctor.stdout
    assert left.name in doctor.stdout

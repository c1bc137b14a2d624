"""A forked child's garbage collector: the standard library's by default; frozen (gc.freeze()
as the child starts, so that its collections do not copy the parent's heap) where asked:
$SHAREDMP_FREEZE_FORKED=1 for every fork child, and torch DataLoader workers started
through a sharedmp context. Real processes; every wait bounded, children killed by the
leak fixture if a test fails."""
import gc
import importlib
import multiprocessing
import os
import pkgutil
import sys
import threading

import pytest

import sharedmp as mp
from sharedmp import forks

import _process_workers as w
from conftest import TIMEOUT, fork_and_wait, join_or_kill

FREEZE = "SHAREDMP_FREEZE_FORKED"


def _run(p, q):
    p.start()
    try:
        return q.get(timeout=TIMEOUT)
    finally:
        assert join_or_kill(p) == 0


@pytest.mark.parametrize("make", ["context", "mp.Process"])
def test_the_setting_freezes_what_every_fork_child_inherits(make, monkeypatch):
    std = multiprocessing.get_context("fork")
    monkeypatch.setenv(FREEZE, "1")
    q = std.Queue()
    if make == "mp.Process":
        monkeypatch.setattr(multiprocessing.context._default_context, "_actual_context", std)
        p = mp.Process(target=w.report_freeze, args=(q,))
    else:
        p = mp.get_context("fork").Process(target=w.report_freeze, args=(q,))
    assert _run(p, q) > gc.get_freeze_count() + 1000   # (the interpreter's own objects alone)
    # What it costs: an inherited cycle the child drops stays, unfinalized.
    monkeypatch.setattr(w, "INHERITED", w.Cycle())
    w.Cycle.finalized.clear()
    found, finalized = _run(mp.get_context("fork").Process(target=w.drop_inherited_cycle,
                                                           args=(q,)), q)
    assert not finalized


def test_a_bad_setting_raises_in_start(monkeypatch):
    monkeypatch.setenv(FREEZE, "sometimes")
    p = mp.get_context("fork").Process(target=w.report_freeze, args=(None,))
    with pytest.raises(ValueError, match=r"^\$SHAREDMP_FREEZE_FORKED must be .*'sometimes'"):
        p.start()
    assert p.pid is None                            # nothing was started


class _FreezeCounts:
    """A torch Dataset whose every sample is its worker's gc.get_freeze_count()."""

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return gc.get_freeze_count()


def _worker_freeze_counts(ctx):
    from torch.utils.data import DataLoader
    loader = DataLoader(_FreezeCounts(), batch_size=1, num_workers=1,
                        multiprocessing_context=ctx, timeout=TIMEOUT)
    return [int(b) for b in loader]


@pytest.mark.parametrize("setting, frozen", [(None, True), ("1", True), ("0", False)])
def test_dataloader_fork_workers_of_a_sharedmp_context_freeze(monkeypatch, setting, frozen):
    # The sharedmp dataset path (DataLoader(multiprocessing_context=mp.get_context("fork")))
    # asks for workers that share the parent's pages: its workers freeze unless told not to.
    pytest.importorskip("torch")
    if setting is None:
        monkeypatch.delenv(FREEZE, raising=False)
    else:
        monkeypatch.setenv(FREEZE, setting)
    inherited = gc.get_freeze_count()
    counts = _worker_freeze_counts(mp.get_context("fork"))
    assert len(counts) == 2
    if frozen:
        assert min(counts) > inherited + 1000
    else:
        assert counts == [inherited, inherited]


def test_dataloader_fork_workers_of_torch_context_are_left_alone(monkeypatch):
    # torch's own fork context is the standard library's: sharedmp changes nothing there.
    pytest.importorskip("torch")
    monkeypatch.delenv(FREEZE, raising=False)
    inherited = gc.get_freeze_count()
    assert _worker_freeze_counts("fork") == [inherited, inherited]


@pytest.mark.parametrize("collecting", [True, False])
def test_a_forked_child_resets_with_the_collector_off_then_as_the_parent_had_it(collecting):
    """A collection while the child renews its locks and resets its tables would run the
    parent's garbage's finalizers (a queue's Connection and its window, in a cycle) against
    state not yet reset: a Pool worker forked so waited forever for a lock (forks.py)."""

    during = []

    def hook():
        during.append(gc.isenabled())

    forks.in_child(hook)
    was = gc.isenabled()
    (gc.enable if collecting else gc.disable)()
    try:
        code = fork_and_wait(lambda: during == [False] and gc.isenabled() == collecting)
        assert gc.isenabled() == collecting and during == []
    finally:
        forks._resets.remove(hook)
        (gc.enable if was else gc.disable)()
    assert code == 0


def test_a_failing_fork_hook_is_said_and_the_others_still_run(capfd):

    ran = []

    def failing():
        raise ValueError("a hook that fails")

    def after():
        ran.append(1)

    forks.in_child(failing)
    forks.in_child(after)
    try:
        code = fork_and_wait(lambda: ran == [1] and gc.isenabled())
    finally:
        forks._resets.remove(failing)
        forks._resets.remove(after)
    assert code == 0
    assert "a hook that fails" in capfd.readouterr().err


def test_threads_forking_at_once_leave_the_collector_as_it_was():
    """The fork hooks of two threads interleave (os.fork runs its ``before`` hooks before it
    serializes): the collector must be back on after all of them, in parent and children."""

    failures = []

    def forker():
        for _ in range(40):
            pid = os.fork()
            if pid == 0:
                os._exit(0 if gc.isenabled() else 3)
            _, status = os.waitpid(pid, 0)
            if os.waitstatus_to_exitcode(status) != 0:
                failures.append(status)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)                  # (threads switch inside the hooks)
    try:
        threads = [threading.Thread(target=forker) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
    finally:
        sys.setswitchinterval(interval)
    assert not any(t.is_alive() for t in threads)
    assert gc.isenabled() and not failures


# Locks the forking thread takes itself, in the parent's before-fork hooks: another thread
# holding one would hold up the fork, not the child (they are renewed in the child too).
_TAKEN_BY_THE_FORK = {("sharedmp.forks", "_forking_lock"), ("sharedmp.memory.named", "_fork_gate"),
                      ("sharedmp.memory.manager", "_lock")}


def _module_locks():
    """(module, name) of the module-level locks of every sharedmp module that imports here."""
    kinds = (type(threading.Lock()), type(threading.RLock()))
    out = []
    for info in pkgutil.walk_packages(mp.__path__, "sharedmp."):
        if info.name.endswith("__main__"):
            continue
        try:
            module = importlib.import_module(info.name)
        except Exception:          # (an optional library missing: nothing of it runs here)
            continue
        out += [(module, name) for name, value in vars(module).items()
                if isinstance(value, kinds) and (info.name, name) not in _TAKEN_BY_THE_FORK]
    return out


def test_a_lock_another_thread_holds_at_a_fork_is_free_in_the_child():
    """A module-level lock that another thread holds at a fork would stay held in the child
    for ever (the thread is not there to release it): each is renewed (forks.renew_locks).
    ring._fence_lock was not (a producer's fence in a thread beside a fork)."""
    locks = _module_locks()
    assert len(locks) >= 10, locks
    held, release = threading.Event(), threading.Event()

    def holder():
        taken = [getattr(module, name) for module, name in locks]
        for lock in taken:
            lock.acquire()
        held.set()
        release.wait(TIMEOUT)
        for lock in taken:
            lock.release()

    def child():
        stuck = [f"{m.__name__}.{n}" for m, n in locks if not getattr(m, n).acquire(timeout=1)]
        if stuck:
            print("held in the forked child:", stuck, file=sys.stderr, flush=True)
        return not stuck

    gc.collect()
    was = gc.isenabled()
    gc.disable()                  # (no finalizer of ours in this thread while they are held)
    t = threading.Thread(target=holder)
    t.start()
    try:
        assert held.wait(TIMEOUT)
        code = fork_and_wait(child, timeout=30)
    finally:
        release.set()
        t.join(TIMEOUT)
        if was:
            gc.enable()
    assert code == 0

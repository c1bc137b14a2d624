"""The joblib backend "sharedmp" (src/sharedmp/joblib.py), with real processes and real joblib.

Shared arrays reach the workers as the same memory (the same memfd segment, no copy) and
the workers' in-place writes are the parent's; results come back shared; errors, n_jobs and
nesting behave as joblib's multiprocessing backend; the pool stays warm between calls, as
loky's executor does, and goes when idle, on request, on an abort, at exit; scikit-learn's
n_jobs runs through it with the same results. Every call is bounded (Parallel's timeout,
pytest-timeout), every wait for processes too.
"""
import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

joblib = pytest.importorskip("joblib")

import sharedmp as mp  # noqa: E402
import sharedmp.joblib as smj  # noqa: E402
from sharedmp.cli import doctor  # noqa: E402
from sharedmp.memory import cache, named  # noqa: E402

import _joblib_workers as w  # noqa: E402
from conftest import eventually, join_or_kill, run_bounded, shm_files  # noqa: E402

pytestmark = pytest.mark.timeout(90)
TIMEOUT = 60            # Parallel(timeout=...): a stuck worker fails the test, never hangs it
METHODS = ["fork", "forkserver", "spawn"]


def run(tasks, n_jobs=2, **config):
    with joblib.parallel_config(backend="sharedmp", n_jobs=n_jobs, **config):
        return joblib.Parallel(timeout=TIMEOUT)(tasks)


def gone(pids, wait=30.0):
    """True once none of ``pids`` exists (the pool joins its workers: no zombie either)."""
    return eventually(lambda: not any(os.path.exists(f"/proc/{p}") for p in pids), wait)


def alive(pids):
    return all(os.path.exists(f"/proc/{p}") for p in pids)


def warm_pids():
    """The workers of the pool kept warm in this process, as published for doctor."""
    return set(cache.processes().get("joblib-pool", {}).get("pids", ()))


@pytest.fixture(autouse=True)
def no_warm_pool_left():
    """Each test starts without a warm pool and ends without one: its workers are joined
    before conftest's leak check counts this process's children."""
    smj.release_pool()
    yield
    smj.release_pool()
    assert eventually(lambda: not mp.active_children(), 30), "workers left after release_pool()"


# -- registration and import ---------------------------------------------------------------

def test_registered_on_import():
    from joblib.parallel import BACKENDS
    assert BACKENDS["sharedmp"] is smj.SharedmpBackend
    with joblib.parallel_config(backend="sharedmp") as config:
        assert isinstance(config["backend"], smj.SharedmpBackend)


def test_import_sharedmp_does_not_import_joblib():
    code = "import sys, sharedmp; assert 'joblib' not in sys.modules, 'joblib imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=TIMEOUT)


def test_import_without_joblib_names_the_extra():
    code = ("import sys; sys.modules['joblib'] = None\n"
            "try:\n    import sharedmp.joblib\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, timeout=TIMEOUT,
                         capture_output=True, text=True).stdout
    assert "pip install 'sharedmp[joblib]'" in out


def test_bad_options():
    with pytest.raises(ValueError, match="valid start methods"):
        joblib.parallel_config(backend="sharedmp", start_method="nope")
    with pytest.raises(TypeError, match="does not take bogus"):
        joblib.parallel_config(backend="sharedmp", bogus=1)


# -- shared memory both ways ---------------------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
def test_worker_writes_into_shared_array_are_seen(method):
    a = mp.zeros(16)
    pids = run((joblib.delayed(w.fill_slot)(a, i) for i in range(16)), start_method=method)
    assert a.tolist() == [float(i + 1) for i in range(16)]
    assert len(set(pids)) >= 1 and os.getpid() not in pids
    assert set(pids) <= warm_pids()                # kept warm for the next call
    smj.release_pool()
    assert gone(set(pids)), "workers still exist after release_pool()"
    assert not mp.active_children()


def test_worker_writes_into_torch_tensor_are_seen():
    torch = pytest.importorskip("torch")
    t = torch.zeros(8)                     # not shared: moves into shared memory when sent
    assert not mp.is_shared(t)
    out = run(joblib.delayed(w.fill_tensor)(t, i) for i in range(8))
    assert t.tolist() == [float(i + 1) for i in range(8)]
    assert mp.is_shared(t)
    assert {where for where, _ in out} == {w.tensor_where(t)}     # one segment, everywhere


def test_64mib_shared_argument_is_the_same_segment():
    a = mp.zeros(8 << 20)                  # 64 MiB of float64
    a[::4096] = 1.0
    out = run(joblib.delayed(w.look)(a) for _ in range(6))
    here = w.where(a)
    assert here is not None
    for where, shared, total, writeable in out:
        assert where == here               # the worker's view: same memfd, same offset: no copy
        assert shared and writeable and total == float(a[::4096].sum())


def test_plain_numpy_arguments_are_copied_into_shared_memory():
    # docs/API.md section 5: a NumPy array not yet shared is copied into shared memory; the
    # workers' views are shared, the parent's original is not and never sees their writes.
    # Above joblib's max_nbytes (1 MiB): one read-only copy for the whole call, as joblib's
    # memmaps; below: a writable copy per message (by value under 48 KiB).
    big, small = np.arange(1 << 20, dtype=np.float64), np.arange(10_000, dtype=np.float64)
    out = run(joblib.delayed(w.look)(big) for _ in range(6))
    keys = {where for where, _, _, _ in out}
    assert len(keys) == 1 and None not in keys                 # one copy, every task
    assert all(shared and not writeable and total == float(big[::4096].sum())
               for _, shared, total, writeable in out)
    with pytest.raises(ValueError, match="read-only"):
        run(joblib.delayed(w.scale_and_sum)(big, i) for i in range(2))
    out = run((joblib.delayed(w.scale_and_sum)(big, i) for i in range(4)), mmap_mode="r+")
    out += run(joblib.delayed(w.scale_and_sum)(small, i) for i in range(4))
    assert all(where is not None for where, _ in out)
    assert big[:4].tolist() == small[:4].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert not mp.is_shared(big) and not mp.is_shared(small)
    assert [s for _, s in out[4:]] == [float(2 * i + 3) for i in range(4)]


def test_plain_array_inside_arguments_and_max_nbytes_none():
    big = np.ones(1 << 18)                                    # 2 MiB
    out = run(joblib.delayed(w.look_nested)([1, big], {"x": big}, key=(big,)) for _ in range(3))
    keys = {key for found in out for key in found}
    assert len(keys) == 1 and None not in keys               # the same one copy for all
    out = run((joblib.delayed(w.look)(big) for _ in range(3)), max_nbytes=None)
    assert all(writeable for _, _, _, writeable in out)      # a copy per message


def test_results_are_right_and_shared():
    n = 2 << 20                            # 8 MiB of float32 each
    out = run(joblib.delayed(w.make_block)(i, n) for i in range(6))
    assert len(out) == 6
    for i, b in enumerate(out):            # in order, right values, in shared memory
        assert b.dtype == np.float32 and b.shape == (n,) and b[0] == i and b[-1] == i
        assert mp.is_shared(b)
    del out, b
    gc.collect()


def test_small_tasks_and_return_generator_refused():
    out = run(joblib.delayed(abs)(-i) for i in range(500))
    assert out == list(range(500))
    with pytest.raises(ValueError, match="does not support return_as"):
        with joblib.parallel_config(backend="sharedmp", n_jobs=2):
            joblib.Parallel(return_as="generator")(joblib.delayed(abs)(i) for i in range(3))


# -- behaviour of joblib's multiprocessing backend -----------------------------------------

def test_worker_exception_propagates_with_its_traceback():
    with joblib.parallel_config(backend="sharedmp", n_jobs=2):
        parallel = joblib.Parallel(timeout=TIMEOUT)
        with pytest.raises(ValueError, match="task 3 failed in pid") as info:
            parallel(joblib.delayed(w.fail)(i) for i in range(8))
    cause = info.value.__cause__
    assert cause is not None and "_joblib_workers.py" in str(cause)   # the worker's traceback
    assert eventually(lambda: not mp.active_children())


def test_unpicklable_function_raises():
    with pytest.raises(Exception, match="(?i)pickl|lambda"):
        run(joblib.delayed(lambda x: x)(i) for i in range(2))
    assert eventually(lambda: not mp.active_children())


def test_n_jobs_one_and_minus_one():
    with joblib.parallel_config(backend="sharedmp", n_jobs=1):     # in this process
        assert joblib.Parallel()(joblib.delayed(w.pid)(i) for i in range(3)) == [os.getpid()] * 3
    backend = smj.SharedmpBackend()
    assert backend.effective_n_jobs(-1) == joblib.cpu_count()
    assert backend.effective_n_jobs(-2) == max(joblib.cpu_count() - 1, 1)
    with pytest.raises(ValueError):
        backend.effective_n_jobs(0)


def test_nested_call_runs_sequentially_in_the_worker():
    out = run(joblib.delayed(w.nested)(i) for i in range(2))
    for i, (j, inner, worker, warnings) in enumerate(out):
        assert j == i and inner == [worker] * 3              # in the worker itself
        assert any("cannot be nested" in m for m in warnings)


def test_next_call_reuses_the_warm_pool_and_a_with_block_borrows_it():
    first = set(run(joblib.delayed(w.pid)(i) for i in range(8)))
    warm = warm_pids()
    assert first <= warm and len(warm) == 2 and alive(warm)
    second = set(run(joblib.delayed(w.pid)(i) for i in range(8)))
    assert second <= warm and warm_pids() == warm                  # the same two workers
    with joblib.Parallel(n_jobs=2, backend="sharedmp", timeout=TIMEOUT) as parallel:
        assert not warm_pids()                                     # lent to the block
        a = set(parallel(joblib.delayed(w.pid)(i) for i in range(8)))
        b = set(parallel(joblib.delayed(w.pid)(i) for i in range(8)))
        assert a | b <= warm
    assert warm_pids() == warm                                     # back, warm
    smj.release_pool()
    assert gone(warm) and not mp.active_children()


def test_another_n_jobs_or_start_method_makes_a_new_pool():
    run(joblib.delayed(w.pid)(i) for i in range(4))
    old = warm_pids()
    run((joblib.delayed(w.pid)(i) for i in range(6)), n_jobs=3)
    new = warm_pids()
    assert len(new) == 3 and not new & old and gone(old)          # the old pool terminated
    run((joblib.delayed(w.pid)(i) for i in range(6)), n_jobs=3, start_method="spawn")
    assert not warm_pids() & new and gone(new)


@pytest.mark.parametrize("how", ["parallel_config", "Parallel", "env"])
def test_idle_timeout_releases_the_workers(how, monkeypatch):
    tasks = (joblib.delayed(w.pid)(i) for i in range(8))
    if how == "env":
        monkeypatch.setenv(smj.IDLE_ENV, "0.5")
        pids = set(run(tasks))
    elif how == "parallel_config":
        pids = set(run(tasks, idle_worker_timeout=0.5))
    else:
        with joblib.parallel_config(backend="sharedmp", n_jobs=2):
            pids = set(joblib.Parallel(timeout=TIMEOUT, idle_worker_timeout=0.5)(tasks))
    assert pids <= warm_pids() and alive(pids)                     # warm for 0.5 s
    # (its timer: the sharedmp-cache thread, which runs while a pool is kept warm only)
    assert cache._thread is not None and cache._thread.name == "sharedmp-cache"
    assert gone(pids, wait=10), "the idle pool was not released"   # (cache thread: 0.25 s ticks)
    assert not warm_pids()
    assert eventually(lambda: cache._thread is None, 5, collect=False)


def test_idle_timeout_zero_is_a_pool_per_call():
    pids = set(run((joblib.delayed(w.pid)(i) for i in range(8)), idle_worker_timeout=0))
    assert not warm_pids() and gone(pids)


def test_bad_idle_timeout_names_the_fix(monkeypatch):
    for bad in (-1, float("nan"), "5"):
        with pytest.raises(ValueError, match="idle_worker_timeout must be a number of seconds >= 0"):
            joblib.parallel_config(backend="sharedmp", idle_worker_timeout=bad)
    monkeypatch.setenv(smj.IDLE_ENV, "soon")
    with pytest.raises(ValueError, match=r"\$SHAREDMP_JOBLIB_IDLE must be a number of seconds"):
        run(joblib.delayed(abs)(i) for i in range(2))


def test_empty_cache_and_release_pool_drop_it():
    pids = set(run(joblib.delayed(w.pid)(i) for i in range(8)))
    assert pids <= warm_pids()
    mp.empty_cache()
    assert not warm_pids() and gone(pids)
    pids = set(run(joblib.delayed(w.pid)(i) for i in range(8)))
    smj.release_pool()
    assert not warm_pids() and gone(pids)


def test_a_task_that_raises_ends_the_pool_and_the_next_call_works():
    # joblib aborts the call (its other tasks may still run): the pool is terminated, as
    # loky's executor is, never kept; the next call, or the rest of a with block, gets one.
    before = set(run(joblib.delayed(w.pid)(i) for i in range(8)))
    with pytest.raises(ValueError, match="task 1 fails"):
        run(joblib.delayed(w.pid_or_fail)(i) for i in range(8))
    assert not warm_pids() and gone(before)
    after = set(run(joblib.delayed(w.pid)(i) for i in range(8)))
    assert after and not after & before
    # Two tasks: all dispatched at once. (With more, joblib 1.6 dispatches the aborted call's
    # batches left in its queue in the block's next call, under loky too: not the pool's.)
    with joblib.Parallel(n_jobs=2, backend="sharedmp", timeout=TIMEOUT) as parallel:
        with pytest.raises(ValueError, match="task 1 fails"):
            parallel(joblib.delayed(w.pid_or_fail)(i) for i in range(2))
        assert gone(after)
        assert parallel(joblib.delayed(abs)(-i) for i in range(4)) == [0, 1, 2, 3]


def test_a_timeout_kills_the_pool():
    with joblib.parallel_config(backend="sharedmp", n_jobs=2):
        with pytest.raises((TimeoutError, multiprocessing.TimeoutError)):   # (the latter: Pool's)
            joblib.Parallel(timeout=1)(joblib.delayed(w.sleep)(60) for _ in range(2))
    assert not warm_pids()
    assert eventually(lambda: not mp.active_children(), 10), "the sleeping workers still run"
    assert run(joblib.delayed(abs)(-i) for i in range(4)) == [0, 1, 2, 3]


def test_a_worker_killed_between_calls_means_a_new_pool():
    run(joblib.delayed(w.pid)(i) for i in range(8))
    warm = warm_pids()
    victim = min(warm)
    os.kill(victim, signal.SIGKILL)
    assert gone({victim})                    # reaped by the pool (which would start another)
    out = set(run(joblib.delayed(w.pid)(i) for i in range(8)))
    assert out and not out & warm and gone(warm)


def test_a_forked_child_starts_its_own_pool():
    parent = set(run(joblib.delayed(w.pid)(i) for i in range(8)))
    warm = warm_pids()
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=w.call_in_child, args=(q,))    # not daemonic: it may have a pool
    p.start()
    inherited, child = q.get(timeout=TIMEOUT)
    assert join_or_kill(p) == 0
    assert inherited == {}                                   # the parent's pool is not its own
    assert child and not set(child) & warm and gone(child)   # its pool ended with it
    assert warm_pids() == warm and alive(warm)               # the parent's is still warm
    assert set(run(joblib.delayed(w.pid)(i) for i in range(8))) <= warm | parent


_MAIN_CHANGES = """
import joblib
import sharedmp.joblib
from sharedmp.memory import cache

def run(f):
    with joblib.parallel_config(backend="sharedmp", n_jobs=2, start_method="fork"):
        return joblib.Parallel(timeout=60)(joblib.delayed(f)(i) for i in range(4))

def pids():
    return set(cache.processes()["joblib-pool"]["pids"])

def twice(i):
    return 2 * i

assert run(twice) == [0, 2, 4, 6]
first = pids()
for _ in range(2):                       # names no function reads, rebound: the same pool
    out = run(twice)
assert out == [0, 2, 4, 6] and pids() == first

def later(i):                            # defined after the workers forked
    return 3 * i

assert run(later) == [0, 3, 6, 9]
second = pids()
assert not second & first

def twice(i):                            # redefined
    return 4 * i

assert run(twice) == [0, 4, 8, 12]
third = pids()
assert not third & second
SCALE = 5

def scaled(i):
    return SCALE * i

assert run(scaled) == [0, 5, 10, 15]
fourth = pids()
SCALE = 7                                # a global that a function of __main__ reads
assert run(scaled) == [0, 7, 14, 21] and not pids() & fourth
print("ok", flush=True)
"""


def test_forked_pool_is_renewed_when_main_changes():
    """Under fork the workers know __main__ as it was: a function defined or redefined there
    since, or a global one of its functions reads rebound, makes the next call fork afresh
    (a function unknown to the workers would kill the worker: the call would never end)."""
    rc, out, err = run_bounded([sys.executable, "-c", _MAIN_CHANGES])
    assert rc == 0 and out.strip() == "ok", err


_HOLDER = """
import os, sys, joblib
import sharedmp.joblib
from sharedmp.memory import cache
with joblib.parallel_config(backend="sharedmp", n_jobs=2):
    assert joblib.Parallel(timeout=60)(joblib.delayed(abs)(-i) for i in range(8)) == list(range(8))
cache._publish()
print(*cache.processes()["joblib-pool"]["pids"], flush=True)
sys.stdin.read()
"""


def test_doctor_shows_the_warm_pool():
    p = subprocess.Popen([sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(x) for x in p.stdout.readline().split()]
        assert len(pids) == 2 and alive(pids)
        [entry] = [e for e in doctor.survey_processes() if e["pid"] == p.pid]
        assert entry["processes"]["joblib-pool"] == {"pids": pids, "idle_s": 300.0}
        rc, out, err = run_bounded([sys.executable, "-m", "sharedmp", "doctor"])
        [line] = [x for x in out.splitlines() if f"pid {p.pid}:" in x]
        assert f"joblib-pool: 2 workers (pids {pids[0]}, {pids[1]}), released after 300 s idle" \
            in line, out
        assert "keep a pool of workers warm" in out
    finally:
        p.stdin.close()
        p.wait(TIMEOUT)
        p.stdout.close()
    assert p.returncode == 0 and gone(pids)                  # ended with the program


_AT_EXIT = """
import os, sys, joblib
import sharedmp.joblib
with joblib.parallel_config(backend="sharedmp", n_jobs=2, start_method=sys.argv[1]):
    pids = joblib.Parallel(timeout=60)(joblib.delayed(os.getpid)() for _ in range(20))
from sharedmp.memory import cache
print(*cache.processes()["joblib-pool"]["pids"], flush=True)
"""


def _dev_shm():
    """What joblib and loky left in /dev/shm: memmapping folders and semaphores whose maker
    (the pid in the name: joblib_memmapping_folder_<pid>_..., sem.loky-<pid>-...) is gone.
    Live makers' entries are in use: other tests of the run (the other pytest worker) or
    other programs make and remove their own meanwhile."""
    from sharedmp.cli.bench.driver import joblib_maker
    return {name for name in os.listdir("/dev/shm")
            if name.startswith(("joblib_memmapping_folder_", "sem.loky-"))
            and not ((pid := joblib_maker(name)) and os.path.exists(f"/proc/{pid}"))}


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_the_warm_pool_is_gone_at_exit(method):
    # SHAREDMP_KEEP_ORPHANS=1: the workers would outlive the program if it did not end them.
    before = _dev_shm() | shm_files()
    env = {**os.environ, "SHAREDMP_KEEP_ORPHANS": "1"}
    rc, out, err = run_bounded([sys.executable, "-c", _AT_EXIT, method], env=env)
    assert rc == 0 and "Traceback" not in err and "leaked" not in err, err
    pids = [int(x) for x in out.split()]
    assert len(pids) == 2 and gone(pids)
    assert not (_dev_shm() | shm_files()) - before


def test_pool_initializer():
    out = run((joblib.delayed(w.initialised)(i) for i in range(4)),
              initializer=w.init, initargs=("ready",))
    assert out == ["ready"] * 4


def test_file_system_strategy_leaves_nothing_in_shm(monkeypatch):
    monkeypatch.setenv(mp.strategy.ENV, "file_system")
    mp.strategy.reload_from_environment()
    before = shm_files()
    a = mp.zeros(1 << 20)                  # 8 MiB, a named segment
    assert isinstance(w.where(a)[0], str)           # named: sharedmp_<random>
    pids = run(joblib.delayed(w.fill_slot)(a, i) for i in range(8))
    assert a[:8].tolist() == [float(i + 1) for i in range(8)]
    out = run(joblib.delayed(w.make_block)(i, 1 << 18) for i in range(4))
    assert [float(b[0]) for b in out] == [0.0, 1.0, 2.0, 3.0] and all(map(mp.is_shared, out))
    smj.release_pool()
    assert gone(set(pids))
    del a, out
    gc.collect()
    mp.empty_cache()
    assert eventually(lambda: not (shm_files() - before), 5), \
        f"left in {named.shm_dir()}: {sorted(shm_files() - before)}"


# -- scikit-learn ----------------------------------------------------------------------------

def _shutdown_loky():
    from joblib.externals.loky import get_reusable_executor
    get_reusable_executor().shutdown(wait=True)


def test_sklearn_cross_val_score_and_random_forest_same_as_default_backend(monkeypatch):
    pytest.importorskip("sklearn")
    from sklearn.datasets import load_digits
    from sklearn.ensemble import RandomForestClassifier
    from sklearn.model_selection import cross_val_score

    X, y = load_digits(return_X_y=True)

    def scores_and_proba():
        forest = RandomForestClassifier(n_estimators=16, random_state=0, n_jobs=2)
        scores = cross_val_score(RandomForestClassifier(n_estimators=8, random_state=0),
                                 X, y, cv=3, n_jobs=2)
        return scores, forest.fit(X, y).predict_proba(X[:200])

    try:
        default_scores, default_proba = scores_and_proba()         # loky
    finally:
        _shutdown_loky()
    submitted = []                         # the tasks that went through the sharedmp pool
    prepare = smj.SharedmpBackend._prepare          # (submit, or apply_async before joblib 1.5)
    monkeypatch.setattr(smj.SharedmpBackend, "_prepare",
                        lambda self, func: submitted.append(len(func)) or prepare(self, func))
    with joblib.parallel_config(backend="sharedmp"):
        t = time.monotonic()
        scores, proba = scores_and_proba()
        assert time.monotonic() - t < TIMEOUT
    # cross_val_score: 3 folds; the forest's fit: 16 trees (its predict_proba asks joblib
    # for threads with require="sharedmem", which a process backend cannot give)
    assert sum(submitted) == 3 + 16
    np.testing.assert_array_equal(scores, default_scores)
    np.testing.assert_array_equal(proba, default_proba)
    assert scores.mean() > 0.85
    smj.release_pool()
    assert eventually(lambda: not mp.active_children())

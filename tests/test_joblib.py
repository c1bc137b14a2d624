"""The joblib backend "sharedmp" (src/sharedmp/joblib.py), with real processes and real joblib.

Shared arrays reach the workers as the same memory (the same memfd segment, no copy) and
the workers' in-place writes are the parent's; results come back shared; errors, n_jobs,
nesting and the pool's end behave as joblib's multiprocessing backend; scikit-learn's
n_jobs runs through it with the same results. Every call is bounded (Parallel's timeout,
pytest-timeout).
"""
import gc
import os
import subprocess
import sys
import time

import numpy as np
import pytest

joblib = pytest.importorskip("joblib")

import sharedmp as mp  # noqa: E402
import sharedmp.joblib as smj  # noqa: E402
from sharedmp.memory import segment  # noqa: E402

import _joblib_workers as w  # noqa: E402
from conftest import eventually, shm_files  # noqa: E402

pytestmark = pytest.mark.timeout(90)
TIMEOUT = 60            # Parallel(timeout=...): a stuck worker fails the test, never hangs it
METHODS = ["fork", "forkserver", "spawn"]


def run(tasks, n_jobs=2, **config):
    with joblib.parallel_config(backend="sharedmp", n_jobs=n_jobs, **config):
        return joblib.Parallel(timeout=TIMEOUT)(tasks)


def gone(pids, wait=5.0):
    """True once none of ``pids`` exists (the pool joins its workers: no zombie either)."""
    return eventually(lambda: not any(os.path.exists(f"/proc/{p}") for p in pids), wait)


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
    assert gone(set(pids)), "workers still exist after the Parallel call"
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
    # memmaps; below: a writable copy per message.
    big, small = np.arange(1 << 20, dtype=np.float64), np.arange(1000, dtype=np.float64)
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


def test_one_pool_per_call_and_managed_pool_reused():
    first = set(run(joblib.delayed(w.pid)(i) for i in range(8)))
    assert gone(first)
    with joblib.Parallel(n_jobs=2, backend="sharedmp", timeout=TIMEOUT) as parallel:
        pool = parallel._backend._pool
        workers = {p.pid for p in pool._pool}
        a = set(parallel(joblib.delayed(w.pid)(i) for i in range(8)))
        b = set(parallel(joblib.delayed(w.pid)(i) for i in range(8)))
        assert parallel._backend._pool is pool and a | b <= workers and len(workers) == 2
    assert gone(workers) and not mp.active_children()


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
    assert gone(set(pids))
    del a, out
    gc.collect()
    mp.empty_cache()
    assert eventually(lambda: not (shm_files() - before), 5), \
        f"left in {segment.shm_dir()}: {sorted(shm_files() - before)}"


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
    assert eventually(lambda: not mp.active_children())

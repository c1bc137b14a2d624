"""CPython's own tests of multiprocessing and concurrent.futures, with sharedmp's objects.

Each suite runs in a fresh interpreter (``_cpython_suite.py``, which says what it swaps),
bounded in time. The only failures allowed are the deliberate differences listed in
docs/reference.md ("Differences from multiprocessing, on purpose"): a listed test that ran
and passed fails here too (the table would be stale), and a listed test with a setting that
restores the standard behaviour is run again with it and must pass.
"""
import json
import multiprocessing
import os
import sys

import pytest

from conftest import dev_shm_alone, run_bounded

HERE = os.path.dirname(os.path.abspath(__file__))
RUNNER = os.path.join(HERE, "_cpython_suite.py")
sys.path.insert(0, HERE)
import _cpython_suite as suite  # noqa: E402  (its children find it the same way)

pytest.importorskip("test._test_multiprocessing", reason="this Python ships without its tests")

METHODS = [m for m in ("fork", "spawn", "forkserver")
           if m in multiprocessing.get_all_start_methods()]
# $SHAREDMP_CPYTHON_SUITES=default: the suites under this Python's default start method only
# (.ci/run on 3.11-3.13; 3.14 and 3.15 run every method: 4-5 min less each)
if os.environ.get("SHAREDMP_CPYTHON_SUITES") == "default":
    METHODS = [multiprocessing.get_all_start_methods()[0]]
try:
    import test.test_concurrent_futures.util  # noqa: F401  (a package from 3.12)
    FUTURES = True
except ImportError:
    FUTURES = False
# A suite takes 60-90 s on 2 CPUs (more beside other runs); CPython's own bound on a hung
# test is 5 min (ours 4: _cpython_suite.TEST_BOUND). Waiting for the bench test: up to 5 min.
SECONDS = 600
pytestmark = pytest.mark.timeout(SECONDS + 360)


def _run(args, tmp_path, env=None):
    environ = {**os.environ, **(env or {})}
    with dev_shm_alone(False):          # (not while the bench test checks /dev/shm)
        rc, out, err = run_bounded([sys.executable, RUNNER, *args], SECONDS, env=environ,
                                   cwd=str(tmp_path))   # (some tests write files in the cwd)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no result (exit {rc}):\n{out[-4000:]}\n{err[-16000:]}"   # (stacks)
    result = json.loads(lines[-1][len("RESULT "):])
    return rc, result, err


def _deliberate():
    return suite.deliberate_failures()


def _check(rc, result, err):
    assert not result["unexpected"], f"{result}\n{err[-12000:]}"
    assert not result["passed_deliberate"], (
        f"listed as deliberate differences in docs/reference.md, but they pass: {result}")
    assert rc == 0, f"{result}\n{err[-12000:]}"


@pytest.mark.parametrize("method", METHODS)
def test_multiprocessing_suite(method, tmp_path):
    with_settings = [name for name, env in _deliberate().items() if env]
    args = ["--start-method", method]
    for name in with_settings:          # run below with their setting (without: they hang)
        args += ["--skip", name]
    rc, result, err = _run(args, tmp_path)
    print(json.dumps(result))
    assert result["run"] > 150, result
    _check(rc, result, err)


@pytest.mark.parametrize("method", METHODS)
def test_deliberate_differences_pass_with_their_settings(method, tmp_path):
    for name, env in _deliberate().items():
        if env:
            rc, result, err = _run(["--start-method", method, "-k", name, "--strict"],
                                   tmp_path, env)
            assert result["run"] >= 1 and rc == 0 and not result["failed"], (
                f"{name} with {env}: {result}\n{err[-8000:]}")


@pytest.mark.skipif(not FUTURES, reason="test_concurrent_futures is a package from 3.12")
@pytest.mark.parametrize("method", METHODS)
def test_concurrent_futures_suite(method, tmp_path):
    rc, result, err = _run(["--futures", "--start-method", method], tmp_path)
    print(json.dumps(result))
    assert result["run"] > 30, result
    _check(rc, result, err)


def test_the_deliberate_differences_are_read_from_the_docs():
    found = _deliberate()
    assert found["test_parent_process"] == {"SHAREDMP_KEEP_ORPHANS": "1"}
    assert found["test_queue_feeder_donot_stop_onexc"] == {}


def test_tests_that_hang_by_a_cpython_bug_are_skipped_only_where_it_is_unfixed():
    for version in [(3, 12, 1), (3, 12, 7), (3, 13, 0), (3, 11, 9)]:
        hangs = suite.cpython_hangs(version)
        assert set(hangs) == {"test_shutdown_deadlock_pickle", "test_processes_terminate"}
        assert "gh-125451" in hangs["test_shutdown_deadlock_pickle"]
    for version in [(3, 12, 8), (3, 13, 1), (3, 14, 0)]:
        assert suite.cpython_hangs(version) == {}

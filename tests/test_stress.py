"""The stress run (``python -m sharedmp stress``): a short run, and its verdict logic.

The run itself (producers and consumers under random SIGKILLs, both strategies) goes in a
subprocess, bounded; everything it reports as a problem fails the test.
"""
import json
import subprocess
import sys

import numpy as np
import pytest

from sharedmp.cli import stress

SECONDS = 24            # two epochs of ~9 s: file_descriptor, then file_system
THREADED_SECONDS = 8    # two epochs of ~1 s of fork events beside threads


@pytest.mark.timeout(SECONDS + 2 * stress.GRACE + 120)
@pytest.mark.slow    # (.ci/run: 3.11 only)
def test_short_stress_run(tmp_path):
    out = tmp_path / "stress.json"
    proc = subprocess.run([sys.executable, "-m", "sharedmp", "stress", "--seconds", str(SECONDS),
                           "--json", str(out)], capture_output=True, text=True,
                          timeout=SECONDS + 2 * stress.GRACE + 90)
    assert out.exists(), proc.stdout + proc.stderr
    rep = json.loads(out.read_text())
    assert proc.returncode == 0 and rep["ok"], proc.stdout + proc.stderr
    t = rep["totals"]
    for k in ("corrupted", "lost", "duplicated", "receive_errors", "bad_channel_ends", "hung"):
        assert t[k] == 0, (k, t)
    assert t["leftovers"] == {"shm_files": 0, "segment_fds": 0, "processes": 0}
    assert t["kills_survived"] >= 2                          # at least one kill per epoch
    for strategy in ("file_descriptor", "file_system"):
        assert t["by_strategy"][strategy]["messages"] > 100, t["by_strategy"]
    assert t["bytes"] > 1 << 20
    assert "corrupted        0" in proc.stdout and "result           ok" in proc.stdout


@pytest.mark.slow       # (fork correctness on every Python: test_fork_holds.py)
@pytest.mark.timeout(4 + 2 * stress.GRACE + 120)
def test_fork_events_and_pattern_checks(tmp_path):
    """A few seconds: fork children keep arrays their parent dropped and made again (both
    strategies), and every array is checked against its pattern; none changed, none lost,
    nothing left."""
    out = tmp_path / "stress.json"
    proc = subprocess.run([sys.executable, "-m", "sharedmp", "stress", "--seconds", "4",
                           "--seed", "7", "--json", str(out)], capture_output=True, text=True,
                          timeout=4 + 2 * stress.GRACE + 90)
    assert out.exists(), proc.stdout + proc.stderr
    t = json.loads(out.read_text())["totals"]
    assert (t["corrupted"], t["lost"], t["left"]) == (0, 0, 0), proc.stdout
    assert t["fork_events"] > 0 and t["fork_unreported"] == 0, proc.stdout
    for strategy in ("file_descriptor", "file_system"):
        assert t["by_strategy"][strategy]["fork_events"] > 0, t["by_strategy"]
    # (each child of a fork event checks its arrays twice: but for the 2nd and later
    # children of an event beside threads, which inherit the threads' arrays only)
    assert t["fork_child_checks"] >= 2 * len(stress.FORK_CLASSES) * (t["fork_events"]
                                                                    - t["fork_threaded"])
    assert t["pattern_checks"] > t["fork_child_checks"]
    assert "fork events" in proc.stdout and "left             0" in proc.stdout


@pytest.mark.slow       # (the oracle with threads: test_lifetime.py)
@pytest.mark.timeout(THREADED_SECONDS + 2 * stress.GRACE + 120)
def test_fork_events_beside_threads(tmp_path):
    """A few seconds of fork events all beside the forker's helper threads (``--fork-threads
    always``: they make, drop and receive arrays while it forks): every child checks the
    threads' arrays it inherited (both strategies); none changed, nothing left."""
    out = tmp_path / "stress.json"
    proc = subprocess.run([sys.executable, "-m", "sharedmp", "stress", "--seconds",
                           str(THREADED_SECONDS), "--seed", "11", "--fork-threads", "always",
                           "--json", str(out)], capture_output=True, text=True,
                          timeout=THREADED_SECONDS + 2 * stress.GRACE + 90)
    assert out.exists(), proc.stdout + proc.stderr
    rep = json.loads(out.read_text())
    t = rep["totals"]
    assert rep["config"]["fork_threads"] == "always"
    assert (t["corrupted"], t["lost"], t["left"]) == (0, 0, 0), proc.stdout
    assert t["fork_thread_corrupted"] == 0 and t["fork_unreported"] == 0, proc.stdout
    assert t["fork_threaded"] == t["fork_events"] > 0, proc.stdout
    for strategy in ("file_descriptor", "file_system"):
        assert t["by_strategy"][strategy]["fork_threaded"] > 0, t["by_strategy"]
    assert t["fork_thread_arrays"] > 0 and t["fork_thread_checks"] > 0, proc.stdout
    assert proc.returncode == 0 and rep["ok"], proc.stdout + proc.stderr
    assert "beside threads" in proc.stdout


def test_which_fork_events_run_beside_threads():
    assert [stress.threaded(n, "alternate") for n in range(8)] == \
        [False, False, True, True] * 2              # an os.fork and a Process each
    assert all(stress.threaded(n, "always") for n in range(8))
    assert not any(stress.threaded(n, "never") for n in range(8))
    with pytest.raises(ValueError):
        stress.stress(1, fork_threads="sometimes")


def test_patterns_are_unique_and_survive_views():
    rng = np.random.default_rng(3)
    import sharedmp as mp
    for i in range(200):
        a, spec = stress.make_array(rng, mp, stress.pattern_id("t", i))
        assert stress.holds_pattern(a, spec)
        if a.nbytes >= 8:
            other = (stress.pattern_id("t", i + 1),) + spec[1:]
            assert not stress.holds_pattern(a, other)
            flat = a.reshape(-1)[:1].view(np.uint8)
            if a.flags.writeable and np.shares_memory(flat, a):     # (not a copy)
                flat[0] ^= 1
                assert not stress.holds_pattern(a, spec)


# -- the verdict: a pure function of the shared counters -------------------------------------

P, T, C = 2, 2, 2


def counters(sent, recv):
    """Counters where every stream (p, t, c) sent ``sent`` and received ``recv``."""
    a = np.zeros((P, T, C, 4), np.int64)
    a[..., stress.SENT], a[..., stress.RECV] = sent, recv
    return a, np.zeros((C, 4), np.int64), np.full((P, C), stress.EOF, np.int64)


def test_judge_clean_epoch():
    v = stress.judge(*counters(10, 10), set(), set())
    assert v["messages"] == P * T * C * 10
    assert all(v[k] == 0 for k in stress.VIOLATIONS)


def test_judge_counts_a_loss_between_live_processes():
    cnt, cstats, ends = counters(10, 10)
    cnt[1, 0, 1, stress.RECV] = 7
    v = stress.judge(cnt, cstats, ends, set(), set())
    assert v["lost"] == 3
    assert stress.problems(v) == ["lost = 3"]


def test_judge_killed_producer_may_have_one_message_on_its_way_but_lose_none():
    cnt, cstats, ends = counters(10, 10)
    cnt[0, 0, 0, stress.RECV] = 11             # sent, counter not yet raised when killed
    ends[0, 0] = stress.TRUNCATED              # the next one was cut in the middle
    v = stress.judge(cnt, cstats, ends, {0}, set())
    assert (v["lost"], v["duplicated"], v["in_transit_at_kill"], v["truncated_frames"]) \
        == (0, 0, 1, 1)
    cnt[0, 1, 1, stress.RECV] = 9              # but a message whose send() returned is lost
    assert stress.judge(cnt, cstats, ends, {0}, set())["lost"] == 1
    cnt[0, 1, 1, stress.RECV] = 12             # or two more than sent arrived
    assert stress.judge(cnt, cstats, ends, {0}, set())["duplicated"] == 1


def test_judge_messages_to_a_killed_consumer_are_counted_apart():
    cnt, cstats, ends = counters(10, 4)
    cnt[:, :, 1, stress.RECV] = 10
    ends[:, 0] = stress.OPEN
    v = stress.judge(cnt, cstats, ends, set(), {0})
    assert v["lost"] == 0 and v["lost_to_killed_consumers"] == P * T * 6
    assert v["bad_channel_ends"] == 0


def test_judge_truncated_frame_from_a_live_producer_is_a_problem():
    cnt, cstats, ends = counters(5, 5)
    ends[1, 1] = stress.TRUNCATED
    cstats[0, stress.CORRUPT] = 2
    v = stress.judge(cnt, cstats, ends, set(), set())
    assert v["bad_channel_ends"] == 1 and v["corrupted"] == 2


def test_digest_sees_bytes_dtype_shape_and_flags():
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    d = stress.digest(a)
    assert stress.digest(a.copy()) == d
    b = a.copy()
    b[2, 3] = 0
    ro = a.view()
    ro.flags.writeable = False
    for other in (b, a.astype(np.int64), a.reshape(4, 3), a.view(np.float32), ro, a.T.copy()):
        assert stress.digest(other) != d
    assert stress.digest({"x": 1}) == stress.digest({"x": 1}) != stress.digest({"x": 2})

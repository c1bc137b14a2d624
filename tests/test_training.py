"""Hogwild training (sharedmp.training): real runs with spawned workers on the digits data.

Runs are short (a tiny MLP, a few epochs) and bounded by ``timeout``; the leak fixture
checks that no worker, segment or fd outlives a test, failures included.
"""
import functools
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")

import sharedmp as mp  # noqa: E402
from sharedmp import training  # noqa: E402
import _training_workers as tw  # noqa: E402
from conftest import run_bounded  # noqa: E402

TIMEOUT = 60     # seconds for a whole training run, start-up included


@pytest.fixture(scope="module")
def digits():
    return training.load_digits()


def tiny(data):
    return training.mlp_factory(data, hidden=(32,))


def misbehaving(data, how, after=3):
    return functools.partial(tw.Misbehaving, data.n_features, data.n_classes, os.getpid(), how, after)


def test_digits_split_and_standardised(digits):
    assert digits.n_features == 64 and digits.n_classes == 10
    assert len(digits.y_train) + len(digits.y_test) == 1797
    assert digits.X_train.dtype == np.float32 and digits.y_train.dtype == np.int64
    assert abs(float(digits.X_train.mean())) < 1e-3      # standardised by the train part
    assert set(np.unique(digits.y_test)) == set(range(10))


def test_two_workers_learn_and_share_one_model(digits):
    factory = tiny(digits)
    torch.manual_seed(0)
    initial = training.checksum(factory())               # what train() starts from (same seed)
    r = training.train(factory, digits, workers=2, epochs=3, lr=0.1, seed=0, progress=False,
                       timeout=TIMEOUT)
    assert r.test_accuracy >= 0.85                        # chance is 0.10
    assert r.samples == 3 * len(digits.y_train)
    assert all(s > 0 for s in r.steps) and len(r.loss_curves) == 2
    assert all(len(c) > 0 and c[-1, 2] < c[0, 2] for c in r.loss_curves)   # each worker's loss fell
    # The parent never stepped, yet its model is trained: the workers wrote its memory.
    assert mp.is_shared(r.model)
    assert r.parent_checksum != initial
    # After training, each worker sees exactly the parent's weights. Workers that trained
    # copies on different shards would end with different weights.
    assert r.worker_checksums == [r.parent_checksum] * 2
    assert r.train_seconds > 0 and r.samples_per_s > 0
    assert r.accuracy_curve[0][0] == 0.0 and r.accuracy_curve[-1][1] == r.test_accuracy


def test_adam_state_is_shared_between_workers(digits):
    r = training.train(tiny(digits), digits, workers=2, epochs=2, optimizer="adam", lr=0.01,
                       progress=False, eval_interval=0, timeout=TIMEOUT)
    assert r.test_accuracy >= 0.85
    # One step counter for both workers (A3C style): it counted more steps than either
    # worker took. Concurrent increments may lose a few, never one worker's whole share.
    assert max(r.steps) < r.shared_step <= sum(r.steps)
    assert r.worker_checksums == [r.parent_checksum] * 2


def test_one_worker(digits):
    r = training.train(tiny(digits), digits, workers=1, epochs=1, progress=False, timeout=TIMEOUT)
    assert r.steps == [int(np.ceil(len(digits.y_train) / 64))]
    assert r.worker_checksums == [r.parent_checksum]


def test_worker_that_raises_stops_the_run_with_its_traceback(digits):
    with pytest.raises(mp.ProcessRaisedException) as info:
        training.train(misbehaving(digits, "raise"), digits, workers=2, epochs=50,
                       progress=False, timeout=TIMEOUT)
    message = str(info.value)
    assert "ValueError: deliberate failure in a worker's forward(), call 4" in message
    assert "Traceback" in message and "_training_workers.py" in message
    # the leak fixture checks that the other worker is gone too


def test_worker_killed_stops_the_run(digits):
    with pytest.raises(mp.ProcessExitedException):
        training.train(misbehaving(digits, "kill"), digits, workers=2, epochs=50,
                       progress=False, timeout=TIMEOUT)


def test_timeout_stops_the_workers(digits):
    with pytest.raises(TimeoutError, match="within 8"):
        training.train(misbehaving(digits, "sleep", after=0), digits, workers=2, epochs=50,
                       progress=False, timeout=8)


def test_workers_that_ignore_the_stop_are_killed(digits, monkeypatch):
    from sharedmp.hogwild import trainer
    monkeypatch.setattr(trainer, "STOP_GRACE", 1.0)
    with pytest.raises(TimeoutError, match="within 8"):
        training.train(misbehaving(digits, "hang", after=0), digits, workers=2, epochs=1,
                       progress=False, timeout=8)
    # the leak fixture checks that both workers are gone


@pytest.mark.parametrize("kwargs, match", [
    (dict(workers=0), "workers must be a positive integer"),
    (dict(epochs=1.5), "epochs must be a positive integer"),
    (dict(batch_size=-1), "batch_size must be a positive integer"),
    (dict(optimizer="rmsprop"), "unknown optimizer 'rmsprop'; choose one of sgd, adam"),
    (dict(lr=0.0), "lr must be positive"),
    (dict(workers=5000), "cannot be split among 5000 workers"),
])
def test_bad_settings_raise_before_starting(digits, kwargs, match):
    with pytest.raises(ValueError, match=match):
        training.train(tiny(digits), digits, progress=False, **kwargs)


@pytest.mark.parametrize("script, args, expected", [
    ("hogwild.py", [], "after 4 processes trained it (exit codes [0, 0, 0, 0])"),
    ("hogwild_numpy.py", ["--epochs", "1"], "weights written by the workers, read by the parent"),
])
def test_examples_run(script, args, expected):
    path = os.path.join(os.path.dirname(__file__), os.pardir, "examples", script)
    code, out, err = run_bounded([sys.executable, path, *args], TIMEOUT, what=script)
    assert code == 0, err
    assert expected in out

"""``python -m sharedmp demo``: arguments, ``--data`` validation, a real short run, Ctrl-C.

The end-to-end runs start the CLI as a subprocess in its own session (as a terminal
would), with a timeout; on failure the whole process group is killed.
"""
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

from sharedmp.cli import main  # noqa: E402
from conftest import as_from_a_terminal, group_gone, run_bounded, signal_state  # noqa: E402

TIMEOUT = 90           # seconds for a CLI subprocess
SHORT = ["--hidden", "32", "--epochs", "2"]


def run_cli(*args, timeout=TIMEOUT, env=None):
    """Run ``python -m sharedmp demo ARGS`` in its own session; kill the group on a timeout."""
    return run_bounded([sys.executable, "-m", "sharedmp", "demo", *args], timeout, env,
                       what=f"demo {' '.join(args)}")



# ----------------------------------------------------------------- --data: what is wrong

def save(path, **arrays):
    np.savez(path, **arrays)
    return str(path)


def blobs(n=60, classes=("cat", "dog", "owl")):
    """Easy data: one well separated cluster per class, string labels."""
    rng = np.random.default_rng(0)
    y = np.array(classes)[np.arange(n) % len(classes)]
    centers = {c: 5 * rng.standard_normal(4) for c in classes}
    X = np.stack([centers[c] for c in y]) + 0.3 * rng.standard_normal((n, 4))
    return X, y


def write(data):
    """A maker that writes raw bytes."""
    def make(path):
        path.write_bytes(data)
    return make


def npy(path):
    with open(path, "wb") as f:                   # np.save(path) would append ".npy"
        np.save(f, np.zeros((3, 2)))


def truncated(path):
    save(path, X=np.zeros((80, 2)), y=np.arange(80) % 2)
    path.write_bytes(path.read_bytes()[:200])


def arrays(**kw):
    """A maker that saves these arrays (object arrays included: savez pickles them)."""
    return lambda path: np.savez(path, **kw)


BAD_DATA = {                                      # case: (maker or None, what the error says)
    "no file": (None, "no such file"),
    "text": (write(b"X,y\n1,2\n"), "not a NumPy .npz file"),
    "empty": (write(b""), "not a NumPy .npz file"),
    "truncated": (truncated, "not a NumPy .npz file"),
    "npy": (npy, "holds a single array, not arrays named X and y"),
    "no y": (arrays(X=np.zeros((8, 2)), labels=np.zeros(8)), "no array named y (it has: X, labels)"),
    "neither": (arrays(a=np.zeros(3)), "no array named X or y"),
    "X 1-D": (arrays(X=np.zeros(8), y=np.arange(8) % 2), "X must be 2-D"),
    "X strings": (arrays(X=np.full((8, 2), "a"), y=np.arange(8) % 2), "X must be numeric"),
    "NaN": (arrays(X=np.array([[np.nan, 1.0]] * 8), y=np.arange(8) % 2), "NaN or infinite"),
    "lengths": (arrays(X=np.zeros((8, 2)), y=np.arange(7) % 2), "X has 8 samples but y has 7 labels"),
    "y 2-D": (arrays(X=np.zeros((8, 2)), y=np.zeros((8, 2))), "y must be 1-D"),
    "regression": (arrays(X=np.zeros((8, 2)), y=np.linspace(0, 1, 8)), "not continuous values"),
    "one class": (arrays(X=np.zeros((8, 2)), y=np.ones(8)), "single class"),
    "objects": (arrays(X=np.zeros((8, 2)), y=np.array([{}] * 8, dtype=object)), "plain numeric arrays"),
}


@pytest.mark.parametrize("case", BAD_DATA)
def test_malformed_data_file_says_what_is_wrong(tmp_path, capsys, case):
    make, expected = BAD_DATA[case]
    path = tmp_path / "data.npz"
    if make is not None:
        make(path)
    rc = main(["demo", "--data", str(path), "--workers", "2"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith(f"error: --data {path}")
    assert expected in err and "Traceback" not in err


@pytest.mark.parametrize("args, expected", [
    (["--workers", "0"], "--workers must be at least 1"),
    (["--epochs", "-2"], "--epochs must be at least 1"),
    (["--lr", "0"], "--lr must be positive"),
    (["--hidden", "64,x"], "--hidden takes positive widths"),
    (["--strategy", "shm"], "--strategy 'shm' is not one of"),
])
def test_bad_arguments(capsys, args, expected):
    assert main(["demo", *args]) == 2
    assert expected in capsys.readouterr().err


def test_own_data_trains_in_process(tmp_path, capsys):
    X, y = blobs()
    path = save(tmp_path / "blobs.npz", X=X, y=y)
    out_json = tmp_path / "out.json"
    rc = main(["demo", "--data", path, "--workers", "2", *SHORT, "--epochs", "5",
               "--batch-size", "8", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "blobs.npz: 45 train / 15 test samples, 4 features, 3 classes" in out
    report = json.loads(out_json.read_text())
    run, = report["runs"]
    assert run["workers"] == 2 and run["test_accuracy"] >= 0.9
    assert report["speedup"] is None and report["hidden"] == [32]


# ------------------------------------------------------------------ the real command

def test_demo_compare_plot_json(tmp_path):
    png, js = tmp_path / "demo.png", tmp_path / "demo.json"
    rc, out, err = run_cli("--workers", "2", *SHORT, "--compare", "--optimizer", "adam",
                           "--lr", "0.01", "--plot", str(png), "--json", str(js))
    assert rc == 0, err
    for row in ("dataset", "model", "workers", "optimizer", "strategy", "test accuracy",
                "samples/s", "speed-up", "elapsed"):
        assert f"\n{row} " in "\n" + out, (row, out)
    assert "MLP 64-32-10 (2,410 parameters)" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads(js.read_text())
    assert [r["workers"] for r in report["runs"]] == [2, 1]
    assert all(r["optimizer"] == "adam" and r["test_accuracy"] > 0.8 for r in report["runs"])
    assert report["speedup"] == pytest.approx(report["runs"][0]["samples_per_s"]
                                              / report["runs"][1]["samples_per_s"])
    assert len(report["runs"][0]["loss_curves"]) == 2


def test_ctrl_c_stops_everything(tmp_path):
    """SIGINT to the whole group, as a terminal's Ctrl-C: exit 130, no traceback, nothing left."""
    shm = tmp_path / "shm"
    shm.mkdir()
    env = dict(os.environ, SHAREDMP_SHM_DIR=str(shm))
    proc = subprocess.Popen(as_from_a_terminal(
                                [sys.executable, "-m", "sharedmp", "demo", "--workers", "2",
                                 "--hidden", "32", "--epochs", "100000", "--strategy", "file_system"]),
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, env=env)
    lines = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr],
                              daemon=True)
    reader.start()
    err = []
    try:
        # Without a terminal the progress is a line every 2 s of training: the first one
        # says the workers are training.
        while " samples (" not in (err[-1] if err else ""):
            err.append(lines.get(timeout=TIMEOUT))
        state = signal_state(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGABRT)            # its stacks, by faulthandler
            proc.wait(timeout=TIMEOUT)
            reader.join(timeout=TIMEOUT)
            while not lines.empty():
                err.append(lines.get())
            pytest.fail(f"still running 30 s after SIGINT (signals then: {state}; this "
                        f"process: {signal_state()}):\n{''.join(err)[-12000:]}", pytrace=False)
        reader.join(timeout=TIMEOUT)
        out = proc.stdout.read()
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    finally:
        proc.stdout.close()
        proc.stderr.close()
    while not lines.empty():
        err.append(lines.get())
    err = "".join(err)
    assert proc.returncode == 130, err
    assert "interrupted: the workers were stopped" in err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert group_gone(proc.pid)
    deadline = time.monotonic() + 5                  # the manager daemon unlinks a moment later
    while (left := [p for p in os.listdir(shm) if p.startswith("sharedmp_")]) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left



def test_failing_worker_exits_1_with_its_traceback(monkeypatch, capsys):
    """The real CLI path with a model whose forward() raises in the workers."""
    import functools

    import _training_workers as tw
    from sharedmp import training
    monkeypatch.setattr(training, "mlp_factory", lambda data, hidden: functools.partial(
        tw.Misbehaving, data.n_features, data.n_classes, os.getpid(), "raise"))
    rc = main(["demo", "--workers", "2", "--epochs", "50"])
    err = capsys.readouterr().err
    assert rc == 1
    # (the progress line of how far it got may come first: stderr is no terminal here)
    assert re.search(r"^error: a worker failed, training stopped:", err, re.M), err
    assert "Traceback" in err and "ValueError: deliberate failure in a worker's forward()" in err


@pytest.mark.parametrize("missing, extra", [("torch", "demo"), ("sklearn", "demo")])
def test_a_missing_extra_is_one_line_naming_it_and_exit_2(missing, extra):
    # As if it were not installed: the import of ``missing`` fails, as it would without it.
    code = (f"import sys; sys.modules[{missing!r}] = None\n"
            "from sharedmp.cli import main\n"
            "sys.exit(main(['demo', '--epochs', '1']))\n")
    rc, out, err = run_bounded([sys.executable, "-c", code], TIMEOUT)
    assert rc == 2, err
    assert err.strip().splitlines() == [f"error: `demo` needs {missing}, which is not installed: "
                                        f"pip install 'sharedmp[{extra}]'"]


def test_without_tqdm_the_demo_shows_its_progress_in_plain_lines():
    code = ("import sys; sys.modules['tqdm'] = None\n"
            "from sharedmp.cli import main\n"
            "sys.exit(main(['demo', '--epochs', '2', '--hidden', '32']))\n")
    rc, out, err = run_bounded([sys.executable, "-c", code], TIMEOUT)
    assert rc == 0, err
    lines = [line for line in err.splitlines() if " samples (" in line]
    assert lines, err
    final = re.fullmatch(r"2 workers: ([\d,]+)/([\d,]+) samples \(100%\), [\d,]+ samples/s, "
                         r"loss [\d.]+, test acc ([\d.]+)%", lines[-1])
    assert final, lines[-1]
    assert final.group(1) == final.group(2)
    # the bar's last accuracy is the final model's, as the summary prints it
    assert f"test accuracy   {final.group(3)}%" in out, out

"""`python -m sharedmp bench`: the real bench, at a tiny scale, in a subprocess.

No assertion on speed: only that every workload and system was measured, that the
figures are positive, that the JSON and the plot were written, and that the run left
nothing behind in /dev/shm.
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from sharedmp.cli import bench

TIMEOUT = 180
HAVE_TORCH = importlib.util.find_spec("torch") is not None
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs memfd and /proc")


def shm_entries():
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny run for the whole module: (completed process, report, plot path, /dev/shm before)."""
    tmp = tmp_path_factory.mktemp("bench")
    out_json, out_png = tmp / "bench.json", tmp / "bench.png"
    args = [sys.executable, "-m", "sharedmp", "bench", "--scale", "0.02", "--json", str(out_json)]
    if HAVE_MPL:
        args += ["--plot", str(out_png)]
    before = shm_entries()
    proc = subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT)
    assert out_json.exists(), f"no JSON written; rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    report = json.loads(out_json.read_text())
    return proc, report, out_png, before


@linux_only
def test_every_workload_and_system_measured(tiny_run):
    proc, report, _, _ = tiny_run
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    ids = [w["id"] for w in report["workloads"]]
    assert ids == ["W1", "W2", "W3", "W4", "W5", "W6"]
    systems = ["sharedmp", "stdlib"] + (["torch_fd", "torch_fs"] if HAVE_TORCH else [])
    for w in report["workloads"]:
        for system in systems:
            res = report["results"][w["id"]][system]
            assert res is not None and res["status"] == "ok", (w["id"], system, res)
            assert res["n"] >= 2
            assert res["seconds"] > 0
            for metric in w["metrics"]:
                if metric == "fds":
                    assert isinstance(res["fds"], int) and res["fds"] >= 0, (w["id"], system, res)
                else:
                    assert res[metric] > 0, (w["id"], system, metric, res)
    if not HAVE_TORCH:
        for w in report["workloads"]:
            assert report["results"][w["id"]]["torch_fd"] is None


@linux_only
def test_bounds_ratios_and_metadata(tiny_run):
    _, report, _, _ = tiny_run
    b = report["bounds"]
    assert b["status"] == "ok"
    for key in ("memcpy_gbps", "alloc_fill_gbps", "shm_alloc_fill_gbps", "pipe_roundtrips_per_s"):
        assert b[key] > 0, key
    assert b["foreign_modules"] == []          # the bounds worker imported neither sharedmp nor torch
    assert report["ratios"]["W1:msgs"]["vs_stdlib"] > 0
    assert report["ratios"]["W3:gbps"]["vs_alloc_fill_bound"] > 0
    assert {t["workload"] for t in report["targets"]} == {"W1", "W3", "W4", "W5", "W6"}
    assert report["versions"]["sharedmp"] and report["versions"]["numpy"]
    assert report["machine"]["cpus"] >= 1
    assert report["command"][1:6] == ["-m", "sharedmp", "bench", "--scale", "0.02"]
    assert report["problems"] == []


@linux_only
def test_table_on_stdout(tiny_run):
    proc, report, _, _ = tiny_run
    out = proc.stdout
    for w in ("W1", "W2", "W3", "W4", "W5", "W6"):
        assert f"\n{w} " in out
    for title in ("sharedmp", "torch fd", "torch fs", "stdlib", "smp/torch fd", "smp/stdlib", "smp/bound"):
        assert title in out
    assert "machine bounds" in out
    assert "/dev/shm after the run: clean" in out
    assert report["shm_left"] == []


@linux_only
def test_nothing_left_in_dev_shm(tiny_run):
    _, _, _, before = tiny_run
    # Files that some live process still maps or holds are not leftovers of the run (a
    # test suite running meanwhile may own them); unused new ones are.
    new = {os.path.join("/dev/shm", n) for n in shm_entries() - before
           if n.startswith(("torch_", "sharedmp_", "sem.mp-"))}
    assert not new - bench._in_use(new)


@linux_only
@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib is not installed (the bench extra)")
def test_plot_written(tiny_run):
    _, report, png, _ = tiny_run
    assert png.exists() and png.stat().st_size > 10_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["plot"] == str(png)


def test_stdlib_worker_never_imports_sharedmp():
    """The stdlib and torch columns are only honest if their processes lack sharedmp's reducers."""
    src = open(bench.__file__).read()
    top = src.split("\ndef ", 1)[0]
    imports = [line for line in top.splitlines() if line.startswith(("import ", "from "))]
    assert imports and all("sharedmp" not in line and not line.startswith("from .") for line in imports)


def test_plan_counts():
    plan = {w["id"]: w for w in bench.make_plan(1.0, 3)}
    assert [plan[k]["n"] for k in ("W1", "W2", "W3", "W4", "W5", "W6")] == [5000, 1000, 40, 20, 200, 5000]
    assert len(bench.state_dict_shapes()) == 200
    assert 2 * bench.MiB < plan["W4"]["bytes"] < 16 * bench.MiB
    assert bench._counts(plan["W5"], "stdlib", 3)[1] == 20            # stdlib: a tenth, by value
    assert bench._counts(plan["W6"], "torch_fd", 3) == [5000]         # W6: no warm-up round
    quick = {w["id"]: w for w in bench.make_plan(0.2, 1)}
    assert quick["W1"]["n"] == 1000 and quick["W3"]["n"] == 8


def test_plot_without_matplotlib_names_the_extra(tmp_path):
    """--plot with matplotlib missing fails at once, naming the extra."""
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from sharedmp.cli import main\n"
            f"sys.exit(main(['bench', '--scale', '0.02', '--plot', {str(tmp_path / 'x.png')!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "pip install 'sharedmp[bench]'" in proc.stderr


def test_help_lists_options():
    proc = subprocess.run([sys.executable, "-m", "sharedmp", "bench", "--help"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0
    for opt in ("--quick", "--json", "--plot"):
        assert opt in proc.stdout
    assert "--scale" not in proc.stdout          # hidden: for tests

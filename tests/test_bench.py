"""`python -m sharedmp bench`: the real bench, at a tiny scale, in a subprocess.

No assertion on speed: only that every workload and system was measured (the program rows
too: process start S1-S6, data frames F1-F3), that the figures are positive, that the JSON
and the plot were written, and that the run left nothing behind in /dev/shm.
"""
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from sharedmp.cli.bench import cuda, datasets, driver, plan, start, worker
from sharedmp.cli.bench import report as bench_report
from sharedmp import host
from sharedmp.memory import leftovers

from _helpers import eventually
from conftest import dev_shm_alone, run_bounded

TIMEOUT = 300
# The module's tiny run (30 s alone) shares the CPUs with the other pytest worker (./dev test
# -n 2): the first test's setup may take longer than the 120 s default.
pytestmark = pytest.mark.timeout(TIMEOUT + 60 + 660)     # (tiny_run may wait for a CPython suite)
HAVE_TORCH = importlib.util.find_spec("torch") is not None
HAVE_JOBLIB = importlib.util.find_spec("joblib") is not None
HAVE_PYARROW = importlib.util.find_spec("pyarrow") is not None
HAVE_PANDAS = importlib.util.find_spec("pandas") is not None
HAVE_POLARS = importlib.util.find_spec("polars") is not None
START_IDS = ["S1", "S2", "S3", "S4", "S5", "S6"]
FRAME_IDS = ["F1", "F2", "F3"]
SMALL_IDS = [f"L{i}" for i in range(1, 13)]
PROGRAM_IDS = START_IDS + FRAME_IDS + SMALL_IDS
# Whether each program row can run here (it is n/a, with the reason, where it cannot).
RUNNABLE = {"S5": HAVE_JOBLIB, "S6": HAVE_JOBLIB and HAVE_TORCH, "F1": HAVE_PYARROW,
            "F2": HAVE_PYARROW and HAVE_PANDAS, "F3": HAVE_PYARROW and HAVE_POLARS,
            "L9": HAVE_TORCH, "L10": HAVE_TORCH}
DATASET_IDS = ["D1", "D2", "D3", "D4", "D5", "D6"]
# The tiny run: every row but the dataset rows (36 fresh programs, spawned workers importing
# torch: minutes; test_dataset_row_real_run runs one pair of them).
NOT_DATASETS = ",".join([w["id"] for w in plan.WORKLOADS + plan.START_WORKLOADS]
                        + [c[0] for c in cuda.WORKLOADS])
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs memfd and /proc")


def shm_entries():
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


# What the bench's programs can leave in /dev/shm: torch's file_system segments, sharedmp's
# named segments, the standard library's semaphores. (A private directory of a test or tool
# running beside, such as the stress CLI's sharedmp-stress-*, is that one's to check.)
LEFTOVER_PREFIXES = ("torch_", "sharedmp_", "sem.mp-")


def left_in_dev_shm(before):
    """The new entries of /dev/shm the bench's programs could have made, that no live
    process maps or holds (a test suite running meanwhile may own those)."""
    new = {os.path.join("/dev/shm", n) for n in shm_entries() - before
           if n.startswith(LEFTOVER_PREFIXES)}
    return new - leftovers.in_use(new)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny run for the whole module: (completed process, report, plot path, what it left
    in /dev/shm). What is left is looked at as the run ends, not when a test asks: the
    suites of other Pythons running beside (CI) make and drop semaphores there meanwhile.
    A run's resource trackers unlink what its programs leaked just after they exit: a few
    seconds for them."""
    tmp = tmp_path_factory.mktemp("bench")
    out_json, out_png = tmp / "bench.json", tmp / "bench.png"
    # (--timeout: a program of the run that hangs is ended by the bench and named "timeout"
    # in the report, well before the run's own bound: 30 s here, minutes on a loaded CI)
    args = [sys.executable, "-m", "sharedmp", "bench", "--scale", "0.02", "--json", str(out_json),
            "--workloads", NOT_DATASETS, "--timeout", "240"]
    if HAVE_MPL:
        args += ["--plot", str(out_png)]
    with dev_shm_alone(True):        # no CPython suite meanwhile: /dev/shm as it was after
        before = shm_entries()
        rc, out, err = run_bounded(args, 3 * TIMEOUT, what="the tiny bench run")
        proc = subprocess.CompletedProcess(args, rc, out, err)
        deadline = time.monotonic() + 5
        while (left := left_in_dev_shm(before)) and time.monotonic() < deadline:
            time.sleep(0.1)
    assert out_json.exists(), f"no JSON written; rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    report = json.loads(out_json.read_text())
    return proc, report, out_png, left


@linux_only
@pytest.mark.slow    # (its tiny_run: 30 s; .ci/run: 3.11 only)
def test_every_workload_and_system_measured(tiny_run):
    proc, report, _, _ = tiny_run
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    ids = [w["id"] for w in report["workloads"]]
    assert ids == ["W1", "W2", "W3", "W4", "W5", "W6", "P1", "P2", "P3", "W7"]
    torch_systems = {"sharedmp_torch", "sharedmp_torch_fs", "torch_fd", "torch_fs", "torch_spawn"}
    loader_systems = ["sharedmp_torch", "torch_fd", "torch_spawn"] if HAVE_TORCH else []
    assert [w["systems"] for w in report["workloads"] if w["id"] == "W7"] == [
        ["sharedmp_torch", "torch_fd", "torch_spawn"]]
    for w in report["workloads"]:
        systems = [s for s in w["systems"] if HAVE_TORCH or s not in torch_systems]
        assert "sharedmp" in systems or "sharedmp_torch" in systems or not HAVE_TORCH, w
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
        for system in set(report["results"][w["id"]]) - set(systems):   # not run there: n/a
            assert report["results"][w["id"]][system] is None, (w["id"], system)
    if HAVE_TORCH:
        w7 = report["results"]["W7"]
        for system in loader_systems:
            assert all(s > 0 for s in w7[system]["startup_s"]), w7[system]


@linux_only
@pytest.mark.slow    # (its tiny_run: 30 s; .ci/run: 3.11 only)
def test_process_start_rows_measured(tiny_run):
    _, report, _, _ = tiny_run
    section = report["start"]
    assert [w["id"] for w in section["workloads"]] == PROGRAM_IDS
    for w in section["workloads"]:
        res = section["results"][w["id"]]
        assert set(res) == {"sharedmp", w["baseline"], *w.get("also", [])}
        if not RUNNABLE.get(w["id"], True):
            assert {r["status"] for r in res.values()} == {"n/a"}
            assert all(r["error"].startswith("needs ") for r in res.values())
            continue
        if "torch_mp" in res:             # (the L rows: torch.multiprocessing where torch is)
            assert (res["torch_mp"]["status"] == "ok") == HAVE_TORCH, res["torch_mp"]
            assert (section["vs"][w["id"]]["torch_mp"] is not None) == HAVE_TORCH
            if not HAVE_TORCH:
                assert res["torch_mp"]["error"] == "needs torch"
                res = {s: r for s, r in res.items() if s != "torch_mp"}
        for system, r in res.items():
            assert r["status"] == "ok", (w["id"], system, r)
            if w["kind"] == "import":          # the median of n runs, and the modules it adds
                assert r["ms"] > 0 and len(r["runs_ms"]) == w["n"] >= 3 and r["modules"] > 0
                assert r["heavy"] == []        # neither NumPy nor torch on import
            elif w["kind"] == "frame":         # ms per message, best of n messages per run
                assert r["ms"] > 0 and r["n"] == w["n"] >= 2 and w["rows"] == 100_000
                assert r["bytes"] > 9 * 8 * w["rows"]       # 8 float64 columns and strings
            elif w["kind"] == "small":         # us (the best of runs); p90 or rate
                assert r["us"] > 0 and r["n"] == w["n"] >= 200
                assert len(r["runs_us"]) == 1      # (a tiny run: one run of each)
                assert ("p90_us" in r) == (w["case"] in ("pingpong", "executor_one"))
                assert ("msgs" in r) == (w["case"] in ("stream", "stream4"))
            else:
                assert r["seconds"] > 0 and r["n"] == w["n"] >= 2
        assert section["ratios"][w["id"]] > 0
    modules = section["results"]["S1"]
    assert modules["sharedmp"]["modules"] > modules["stdlib"]["modules"]   # it imports multiprocessing


@linux_only
@pytest.mark.slow    # (its tiny_run: 30 s; .ci/run: 3.11 only)
def test_bounds_ratios_and_metadata(tiny_run):
    _, report, _, _ = tiny_run
    b = report["bounds"]
    assert b["status"] == "ok"
    for key in ("memcpy_gbps", "alloc_fill_gbps", "shm_alloc_fill_gbps", "pipe_roundtrips_per_s"):
        assert b[key] > 0, key
    assert b["foreign_modules"] == []          # the bounds worker imported neither sharedmp nor torch
    assert report["ratios"]["W1:msgs"]["vs_stdlib"] > 0
    assert report["ratios"]["W3:gbps"]["vs_alloc_fill_bound"] > 0
    assert {t["workload"] for t in report["targets"]} == {"W1", "W2", "W3", "W4", "W5", "W6", "W7",
                                                          "P1", "P2", "P3", *PROGRAM_IDS}
    if HAVE_TORCH:
        for key in ("W1:msgs", "W2:gbps", "W3:gbps", "W4:msgs", "W5:msgs"):
            assert report["ratios"][key]["torch_vs_numpy"] > 0, key
        assert report["ratios"]["W7:batches"]["vs_torch_fd"] > 0
        assert report["ratios"]["W7:batches"]["vs_torch_spawn"] > 0
        fds = [t for t in report["targets"] if t["kind"] == "compare"]
        assert [t["workload"] for t in fds] == ["W6"] and len(fds[0]["value"]) == 2
        assert all(t["met"] is not None for t in report["targets"])
    assert report["versions"]["sharedmp"] and report["versions"]["numpy"]
    assert report["machine"]["cpus"] >= 1
    assert report["command"][1:6] == ["-m", "sharedmp", "bench", "--scale", "0.02"]
    assert report["problems"] == []


@linux_only
@pytest.mark.slow    # (its tiny_run: 30 s; .ci/run: 3.11 only)
def test_table_on_stdout(tiny_run):
    proc, report, _, _ = tiny_run
    out = proc.stdout
    for w in ("W1", "W2", "W3", "W4", "W5", "W6", "W7"):
        assert f"\n{w} " in out
    for title in ("sharedmp", "sharedmp torch", "torch fd", "torch fs", "torch spawn", "stdlib",
                  "smp/torch fd", "smp/stdlib", "smp/bound", "smp torch/numpy",
                  "W1 torch >= 0.8x sharedmp NumPy", "W6 torch fds <= sharedmp NumPy fds",
                  "W7 >= 5x torch's default DataLoader", "torch's default DataLoader"):
        assert title in out
    assert "machine bounds" in out
    assert "\nprocess start " in out and "smp/base time" in out
    assert "\ndata frames, one message " in out and "smp/stdlib time" in out
    for w in PROGRAM_IDS:
        assert f"\n{w} " in out
    for title in ("S1 import time <= 2x multiprocessing's", "S2 spawn Pool time <= 1.3x stdlib's",
                  "S5 joblib tiny-call time <= 1x loky's",
                  "F1 pyarrow.Table time <= 0.2x stdlib's",
                  "F2 pandas DataFrame time <= 0.2x stdlib's",
                  "F3 Polars DataFrame time <= 0.2x stdlib's"):
        assert title in out
    assert "/dev/shm after the run: clean" in out
    assert report["shm_left"] == []


@linux_only
@pytest.mark.slow    # (its tiny_run: 30 s; .ci/run: 3.11 only)
def test_nothing_left_in_dev_shm(tiny_run):
    _, _, _, left = tiny_run
    assert not left


@linux_only
@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib is not installed (the bench extra)")
@pytest.mark.slow    # (its tiny_run: 30 s; .ci/run: 3.11 only)
def test_plot_written(tiny_run):
    _, report, png, _ = tiny_run
    assert png.exists() and png.stat().st_size > 10_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["plot"] == str(png)


def test_stdlib_worker_never_imports_sharedmp():
    """The stdlib and torch columns are only honest if their processes lack sharedmp's reducers."""
    src = open(worker.__file__).read()
    top = src.split("\ndef ", 1)[0]
    imports = [line for line in top.splitlines() if line.startswith(("import ", "from "))]
    assert imports and all("sharedmp" not in line and not line.startswith("from .") for line in imports)
    # Run as a script, it has no package: a relative import anywhere in it would fail there.
    assert not [line for line in src.splitlines() if line.strip().startswith("from .")]


def test_plan_counts():
    workloads = {w["id"]: w for w in plan.make_plan(1.0, 3)}
    assert [workloads[k]["n"] for k in ("W1", "W2", "W3", "W4", "W5", "W6", "W7")] == [5000, 1000, 40, 20, 200, 5000, 1000]
    assert workloads["W7"]["systems"] == ["sharedmp_torch", "torch_fd", "torch_spawn"]
    assert "torch_spawn" not in workloads["W1"]["systems"] and "sharedmp_torch" in workloads["W1"]["systems"]
    assert len(plan.state_dict_shapes()) == 200
    assert 2 * worker.MiB < workloads["W4"]["bytes"] < 16 * worker.MiB
    assert plan.counts(workloads["W5"], "stdlib", 3)[1] == 20            # stdlib: a tenth, by value
    assert plan.counts(workloads["W6"], "torch_fd", 3) == [5000]         # W6: no warm-up round
    quick = {w["id"]: w for w in plan.make_plan(0.2, 1)}
    assert quick["W1"]["n"] == 1000 and quick["W3"]["n"] == 8
    assert plan.make_plan(0.001, 1)[-1]["n"] == worker.W7_WORKERS + 2    # W7: batches past start-up


def test_start_plan_counts_and_targets_from_figures():
    full = {w["id"]: w for w in plan.make_start_plan(1.0)}
    assert [full[k]["n"] for k in PROGRAM_IDS] == [9, 100, 100, 100, 100, 10, 5, 5, 5, 2000,
                                                   2000, 1000, 2000, 2000, 5000, 5000, 50000,
                                                   5000, 50000, 50000, 50000]
    assert [k for k in SMALL_IDS if "torch_mp" in full[k].get("also", [])] == \
        [k for k in SMALL_IDS if k not in ("L6", "L10")]  # (L6: the stdlib's own Queue)
    assert [full[k].get("method") for k in ("S2", "S3", "S4")] == ["spawn", "fork", "forkserver"]
    assert [full[k]["rows"] for k in FRAME_IDS] == [1_000_000] * 3
    assert [full[k]["needs"] for k in FRAME_IDS] == [["pyarrow"], ["pyarrow", "pandas"],
                                                     ["pyarrow", "polars"]]
    tiny = {w["id"]: w for w in plan.make_start_plan(0.02)}
    assert tiny["S1"]["n"] == 3 and tiny["S2"]["n"] == 2 and tiny["S6"]["n"] == 2
    assert tiny["F1"]["n"] == 2 and tiny["F1"]["rows"] == 100_000    # data, not fixed costs
    assert tiny["L1"]["n"] == 200 and tiny["L8"]["n"] == 1000      # L rows: 200 items at least
    report = {"start": {"ratios": {"S1": 2.5, "S2": 1.2, "S5": None, "F1": 0.15, "F3": 0.3}}}
    got = {t["workload"]: (t["value"], t["met"]) for t in bench_report.check_start_targets(report)}
    assert got == {"S1": (2.5, False), "S2": (1.2, True), "S5": (None, None),
                   "F1": (0.15, True), "F3": (0.3, False)}


def test_a_row_whose_module_is_missing_says_so():
    """missing() names what a row needs and cannot import; nothing when all is there."""
    assert start.missing({"needs": ["json", "sharedmp_no_such_module"]}) == \
        "needs sharedmp_no_such_module"
    assert start.missing({"needs": ["json"]}) is None and start.missing({}) is None
    assert start.missing({}, "torch_mp") == (None if HAVE_TORCH else "needs torch")


@linux_only
def test_frame_row_without_its_library_is_skipped_with_the_reason(tmp_path):
    """F3 where polars cannot be imported (hidden in the bench's process): n/a for both
    systems, with the reason in its row; no figure, no ratio, the target n/a; not a failure."""
    out_json = tmp_path / "bench.json"
    code = ("import sys; sys.modules['polars'] = None   # import polars fails here\n"
            "from sharedmp.cli import main\n"
            "sys.exit(main(['bench', '--scale', '0.02', '--workloads', 'F3', '--json', "
            f"{str(out_json)!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    report = json.loads(out_json.read_text())
    assert report["start"]["results"]["F3"] == {
        s: {"status": "n/a", "error": "needs polars"} for s in ("sharedmp", "stdlib")}
    assert report["start"]["ratios"]["F3"] is None and report["problems"] == []
    assert [(t["workload"], t["value"], t["met"]) for t in report["targets"]] == [
        ("F3", None, None)]
    row = next(line for line in proc.stdout.splitlines() if line.startswith("F3 "))
    assert "[n/a: needs polars]" in row and row.split()[-3:] == ["n/a", "n/a", "-"]


@linux_only
def test_workloads_selects_process_start_rows_alone(tmp_path):
    """--workloads S1,S3: those rows only; no bounds, no queue table."""
    out_json = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "sharedmp", "bench", "--scale", "0.02",
                           "--workloads", "S1,S3", "--json", str(out_json)],
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    report = json.loads(out_json.read_text())
    assert report["workloads"] == [] and "bounds" not in report
    assert [w["id"] for w in report["start"]["workloads"]] == ["S1", "S3"]
    assert [t["workload"] for t in report["targets"]] == ["S1", "S3"]
    assert "machine bounds" not in proc.stdout and "\nS3 " in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "sharedmp", "bench", "--workloads", "S9"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown S9" in bad.stderr and "S1" in bad.stderr


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


def test_torch_targets_from_figures():
    """The torch targets: ratios of sharedmp torch to sharedmp NumPy, W6 compares fd counts, W7 is
    sharedmp torch against torch's default DataLoader (the torch fd column)."""
    ok = lambda **kw: dict(status="ok", **kw)  # noqa: E731
    results = {w: {s: None for s, _ in plan.SYSTEMS} for w in ("W1", "W6", "W7")}
    results["W1"].update(sharedmp=ok(msgs=100.0), sharedmp_torch=ok(msgs=70.0), torch_fd=ok(msgs=1.0))
    results["W6"].update(sharedmp=ok(fds=2), sharedmp_torch=ok(fds=3))
    results["W7"].update(sharedmp_torch=ok(batches=600.0), torch_fd=ok(batches=100.0))
    report = {"results": results, "bounds": {}, "workloads": [
        w for w in plan.make_plan(0.01, 1) if w["id"] in results]}
    got = {t["target"]: (t["value"], t["met"]) for t in bench_report.check_targets(report)}
    assert got["W1 torch >= 0.8x sharedmp NumPy"] == (0.7, False)
    assert got["W6 torch fds <= sharedmp NumPy fds"] == ([3, 2], False)
    assert got["W7 >= 5x torch's default DataLoader"] == (6.0, True)
    assert "W2 torch >= 0.8x sharedmp NumPy" not in got            # W2 not in the report
    ratios = bench_report.compute_ratios(report)
    assert ratios["W1:msgs"]["torch_vs_numpy"] == 0.7 and ratios["W7:batches"]["vs_torch_fd"] == 6.0
    assert "torch_vs_numpy" not in ratios["W6:fds"]


@linux_only
@pytest.mark.skipif(not HAVE_PYARROW, reason="pyarrow is not installed")
@pytest.mark.parametrize("module", ["sharedmp", "multiprocessing"])
def test_frame_program_whose_child_dies_fails_at_once_and_says_why(tmp_path, module):
    """The F rows' program with its child made to die on receipt (the one line changed): it
    stops at once, not after its 30 s wait, names the child's exit code, and leaves nothing."""
    script = tmp_path / "frames.py"
    text = open(start.scripts(str(tmp_path))[f"frames_{module}.py"]).read()
    line = "        del data                # let go of the message"
    assert text.count(line) == 1
    script.write_text(text.replace(line, "        import os; os._exit(3)  #"))

    with dev_shm_alone(True):        # (no CPython suite meanwhile: see tiny_run)
        before = shm_entries()
        proc = subprocess.Popen([sys.executable, str(script), "arrow", "1000", "2"], text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=25)
        finally:
            ended = host.end_group(proc, 5, first=None)  # its helpers (resource tracker) too
        # (a file no process holds may be another test's, a moment before its tracker
        # unlinks it: what stays 5 s is left)
        assert proc.returncode == 1 and "the child exited with code 3" in err, err
        assert worker.MARK not in out and ended
        assert eventually(lambda: not left_in_dev_shm(before)), left_in_dev_shm(before)


def test_dataset_plan_counts():
    full = {w["id"]: w for w in plan.make_dataset_plan(1.0)}
    assert list(full) == DATASET_IDS
    assert [full[k]["n"] for k in DATASET_IDS] == [1_000_000] * 3 + [65536] * 3
    assert [full[k]["epochs"] for k in DATASET_IDS] == [3, 3, 3, 1, 1, 1]
    assert [full[k]["method"] for k in DATASET_IDS] == ["fork", "spawn", "forkserver"] * 2
    assert [full[k]["batch"] for k in DATASET_IDS] == [1024] * 3 + [256] * 3
    assert all(w["workers"] == [1, 2, 4] and w["needs"] == ["torch"] for w in full.values())
    assert full["D4"]["bytes"] == 256 * worker.MiB and "256.0 MiB" in full["D4"]["title"]
    quick = {w["id"]: w for w in plan.make_dataset_plan(0.2, quick=True)}
    assert quick["D1"]["n"] == 200_000 and quick["D4"]["n"] == 13107
    assert all(w["workers"] == [1, 4] for w in quick.values())      # what the targets compare
    tiny = {w["id"]: w for w in plan.make_dataset_plan(0.001)}
    assert tiny["D1"]["n"] == 10_000 and tiny["D4"]["n"] == 1024    # above the threshold
    w = full["D2"]
    assert datasets.command(w, "shared", 4, "d.py", "py") == [
        "py", "d.py", "shared", "records", "spawn", "4", "1000000", "3", "1024"]


def _dataset_run_result(memory, epoch_s, **extra):
    return dict(status="ok", memory_mib=memory, epoch_s=epoch_s, **extra)


def test_dataset_targets_and_table_from_figures():
    """The targets of the dataset rows: 4 workers over 1 (shared MiB), shared over plain epoch
    time at every worker count (the worst checked; spawn and forkserver strictly below 1),
    and the records' form and build time from the medians of the records rows' shared runs."""
    r = _dataset_run_result
    build = dict(private_mib=200.0, form_mib=50.0, build_s=0.75, pickle_s=0.5)
    d1 = {"1": {"plain": r(400.0, 2.0), "shared": r(50.0, 1.0, **build)},
          "2": {"plain": r(600.0, 2.0), "shared": r(55.0, 2.2, **build)},
          "4": {"plain": r(900.0, 2.0), "shared": r(70.0, 2.0, **dict(build, build_s=2.0))}}
    d2 = {"1": {"plain": r(400.0, 2.0), "shared": r(50.0, 2.0)},
          "4": {"plain": {"status": "timeout"}, "shared": r(60.0, 1.0)}}
    d5 = {"1": {"plain": r(512.0, 4.0), "shared": r(256.0, 1.0)}}
    results = {"D1": d1, "D2": d2, "D5": d5}
    workloads = [w for w in plan.make_dataset_plan(1.0) if w["id"] in results]
    section = {"workloads": workloads, "results": results,
               "ratios": {w["id"]: datasets.ratios(results[w["id"]]) for w in workloads}}
    assert section["ratios"]["D1"]["2"] == {"memory": 55 / 600, "time": 1.1}
    assert section["ratios"]["D2"]["4"] == {"memory": None, "time": None}
    got = {t["target"]: (t["workload"], t["value"], t["met"])
           for t in bench_report.check_dataset_targets({"datasets": section})}
    assert got == {
        "D1 fork: shared MiB, 4 workers <= 1.25x 1": ("D1", 1.4, False),
        "D2 spawn: shared MiB, 4 workers <= 1.25x 1": ("D2", 1.2, True),
        "records: shared form <= 0.5x the list's Pss": ("D1", 0.25, True),
        "records: build <= 2x pickling each record": ("D1", 1.5, True),     # medians: 0.75 / 0.5
        "D1 fork: shared epoch time <= 1.2x plain": ("D1", 1.1, True),      # the worst: 2 workers
        "D2 spawn: shared epoch time < plain": ("D2", None, None),          # 4 workers timed out
        "D5 spawn: shared epoch time < plain": ("D5", 0.25, True)}
    d2["4"]["plain"] = r(500.0, 1.0)                                        # exactly 1: missed
    section["ratios"]["D2"] = datasets.ratios(d2)
    got = {t["target"]: t["met"] for t in bench_report.check_dataset_targets({"datasets": section})}
    assert got["D2 spawn: shared epoch time < plain"] is False
    table = bench_report.format_datasets({"datasets": section})
    lines = table.splitlines()
    assert lines[0].split()[:4] == ["datasets,", "DataLoader", "(persistent", "workers)"]
    assert lines[2].startswith("D1 1,000,000 records (int, str, float) in a list")
    assert lines[3].split() == ["D1", "2", "600", "55.0", "0.092x", "2.00", "2.20", "1.1x"]
    assert lines[-1].startswith("D1-D2 records, medians of the shared runs: the list 200.0 MiB")


def test_a_plain_dataset_run_that_imported_sharedmp_is_no_figure():
    line = worker.MARK + json.dumps({"sharedmp": True, "epoch_s": 1.0})
    assert datasets.parse("plain", line) is None
    assert datasets.parse("shared", "noise\n" + line) == {"sharedmp": True, "epoch_s": 1.0,
                                                           "status": "ok"}
    assert datasets.parse("shared", "no result") is None


@linux_only
@pytest.mark.skipif(not HAVE_TORCH, reason="the dataset rows need torch")
def test_dataset_row_real_run():
    """One pair of D2 (10,000 records, spawn, 2 workers), plain and shared, for real: the
    figures are there and sane, and the shared run made the records shared."""
    w = dict(next(w for w in plan.make_dataset_plan(0.001) if w["id"] == "D2"), workers=[2])
    report = {"problems": []}
    before = shm_entries()
    driver._measure_datasets(report, [w], timeout=60)
    assert report["problems"] == []
    pair = report["datasets"]["results"]["D2"]["2"]
    for variant, r in pair.items():
        assert r["status"] == "ok", (variant, r)
        assert r["n"] == 10_000 and len(r["epochs_s"]) == 3 and min(r["epochs_s"]) > 0
        assert r["epoch_s"] == pytest.approx(sum(r["epochs_s"]) / 3)
        assert r["processes"] >= 3                      # the program and its 2 workers at least
        assert r["pss_mib"] > r["base_mib"] - 100 and r["base_mib"] > 50      # (torch in each)
        assert abs(r["memory_mib"]) < 200
        assert r["sharedmp"] == (variant == "shared")
        assert r["private_mib"] > 0
    shared = pair["shared"]
    assert shared["pickle_s"] > 0 and shared["build_s"] > 0 and shared["form_mib"] >= 0
    assert "pickle_s" not in pair["plain"] and "build_s" not in pair["plain"]
    ratios = report["datasets"]["ratios"]["D2"]["2"]
    assert ratios["time"] > 0
    assert "D2 10,000 records" in bench_report.format_datasets(report)
    assert not left_in_dev_shm(before)

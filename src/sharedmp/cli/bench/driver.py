"""The parent side of ``python -m sharedmp bench``: runs the workers, collects the report.

Each (system, workloads) batch runs in a fresh worker process (``worker.py`` run as a
script, in a session of its own, so that what it leaves running can be killed as a
group); the bounds run first, in one more. The report is a JSON-able dict: the plan, every
figure, the machine and the versions, the ratios and the targets (``report.py``), and
what the run left in /dev/shm.
"""
import json
import os
import subprocess
import sys
import time

from ... import host
from ...memory import leftovers
from . import datasets
from . import worker
from . import start
from .plan import LONG_NAMES, METRIC_UNITS, SYSTEMS, WORKLOADS, counts, make_plan, scaled
from .plan import SMALL_RUNS, make_dataset_plan, make_start_plan, state_dict_shapes
from .report import check_dataset_targets, check_start_targets, check_targets, compute_ratios
from .report import fmt_num
from .worker import MARK, TORCH_SYSTEMS


def _worker_env():
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["MKL_NUM_THREADS"] = "1"
    env["SHAREDMP_SHARING_STRATEGY"] = "file_descriptor"   # the sharedmp column's strategy
    env.pop("SHAREDMP_KEEP_ORPHANS", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_program(cmd, timeout):
    """Run ``cmd`` in a session of its own; (stdout, status, stderr tail, seconds). What it
    leaves running (multiprocessing's resource tracker, which unlinks the semaphores of a
    worker that has exited) is given 10 s to finish, then its process group is killed."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_worker_env(), start_new_session=True)
    status = "ok"
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        status = "timeout"
        host.end_group(proc, 5)
        out, err = proc.communicate()
    else:
        host.end_group(proc, 10, first=None)   # whatever it started and left behind
        if proc.returncode != 0:
            status = "error"
    tail = "\n".join(err.strip().splitlines()[-15:])
    return out, status, tail, time.monotonic() - t0


def run_worker(spec, timeout):
    """Run one worker; (list of its result dicts, status, stderr tail, seconds)."""
    cmd = [sys.executable, os.path.abspath(worker.__file__), "--worker", json.dumps(spec)]
    out, status, tail, seconds = run_program(cmd, timeout)
    results = []
    for line in out.splitlines():
        if line.startswith(MARK):
            try:
                results.append(json.loads(line[len(MARK):]))
            except ValueError:
                pass
    return results, status, tail, seconds


def _shm_entries():
    """The paths in /dev/shm and in sharedmp's shared-memory directory ($SHAREDMP_SHM_DIR)."""
    from ...memory.named import shm_dir
    out = set()
    for d in {"/dev/shm", shm_dir()}:
        try:
            out.update(os.path.join(d, n) for n in os.listdir(d))
        except OSError:
            pass
    return out


def _clean_shm(new_paths):
    """Remove what the killed workers left in /dev/shm (ours: torch_* and sharedmp_*, unused)."""
    paths = {p for p in new_paths if os.path.basename(p).startswith(("torch_", "sharedmp_"))}
    removed = []
    for p in sorted(paths - leftovers.in_use(paths)):
        try:
            os.unlink(p)
            removed.append(p)
        except OSError:
            pass
    return removed


def _torch_available():
    import importlib.util
    return importlib.util.find_spec("torch") is not None


def machine_info():
    import platform
    info = {"platform": platform.platform(), "machine": platform.machine(),
            "python": platform.python_version(), "executable": sys.executable,
            "cpus": os.cpu_count()}
    try:
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    info["memory_gib"] = round(int(line.split()[1]) / (1 << 20), 1)
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            info["transparent_hugepages"] = f.read().strip()
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            info["shmem_hugepages"] = f.read().strip()
    except OSError:
        pass
    try:
        info["loadavg_start"] = os.getloadavg()
    except OSError:
        pass
    return info


def versions():
    from ... import __version__
    from .. import dist_version
    return {"sharedmp": __version__, "numpy": dist_version("numpy"),
            "torch": dist_version("torch"), "matplotlib": dist_version("matplotlib"),
            "python": sys.version.split()[0]}


# ---------------------------------------------------------------------------- run

def _log(msg):
    print(msg, file=sys.stderr, flush=True)



def _new_report(scale, rounds, quick, isolation, plan):
    report = {"command": [sys.executable, "-m", "sharedmp"] + sys.argv[1:] if sys.argv else [],
              "argv": sys.argv, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "quick": quick, "scale": scale, "rounds": rounds, "isolation": isolation,
              "machine": machine_info(), "versions": versions(),
              "systems": {s: LONG_NAMES[s] for s, _ in SYSTEMS},
              "workloads": [{k: v for k, v in w.items() if k != "shapes"} for w in plan],
              "results": {w["id"]: {s: None for s, _ in SYSTEMS} for w in plan},
              "workers": [], "problems": []}
    if any(w["kind"] == "state_dict" for w in plan):
        report["state_dict_shapes"] = [[list(s), d] for s, d in state_dict_shapes()]
    return report


def _measure_bounds(report, rounds, scale, timeout):
    loops = scaled(WORKLOADS[2]["n"], scale, minimum=4)
    spec = {"system": "bounds", "rounds": rounds, "loops": loops,
            "trips": scaled(20000, scale, 500)}
    _log("bounds ...")
    res, status, tail, secs = run_worker(spec, timeout)
    report["workers"].append({"system": "bounds", "status": status, "seconds": secs})
    report["bounds"] = res[0] if res else {"status": status, "error": tail}
    if res and res[0].get("foreign_modules"):
        report["problems"].append(f"the bounds worker imported {res[0]['foreign_modules']}")
    if not res:
        report["problems"].append(f"bounds: {status}: {tail}")


def _batches(plan, runnable, isolation):
    """[(system, workloads)]: what each fresh worker runs."""
    if isolation == "workload":
        return [(s, [w]) for w in plan for s in runnable if s in w["systems"]]
    # W6 first: it counts the fds a consumer gains, from processes that hold none yet
    ordered = sorted(plan, key=lambda w: not w.get("keep"))
    batches = [(s, [w for w in ordered if s in w["systems"]]) for s in runnable]
    return [(s, ws) for s, ws in batches if ws]


def _record(report, system, w, r, status, tail):
    """File the result ``r`` (None: the worker gave none) of workload ``w`` for ``system``."""
    if r is None:
        r = {"status": "timeout" if status == "timeout" else "error"}
        if status != "timeout":
            r["error"] = tail
    report["results"][w["id"]][system] = r
    if r.get("status") == "ok":
        shown = ", ".join(f"{fmt_num(r.get(m))} {METRIC_UNITS[m]}" for m in w["metrics"])
        _log(f"    {w['id']} {system}: {shown}")
    else:
        _log(f"    {w['id']} {system}: {r['status']} {r.get('error', '')}")
        report["problems"].append(
            f"{w['id']} {system}: {r['status']} {r.get('error', '')}".strip())


def _measure(report, system, ws, rounds, timeout):
    """Run the workloads ``ws`` of ``system`` in one fresh worker; its status."""
    plan = [{**w, "counts": counts(w, system, rounds)} for w in ws]
    spec = {"system": system, "plan": plan, "timeout": timeout}
    _log(f"{system:<14} {' '.join(w['id'] for w in ws)} ...")
    results, status, tail, secs = run_worker(spec, timeout)
    report["workers"].append({"system": system, "workloads": [w["id"] for w in ws],
                              "status": status, "seconds": secs})
    got = {r["workload"]: r for r in results}
    for w in ws:
        _record(report, system, w, got.get(w["id"]), status, tail)
    if status == "error" and tail and not any(r.get("status") != "ok" for r in results):
        report["problems"].append(f"{system}: exited with an error: {tail}")
    return status


def _start_runs(w, system, paths, runs, timeout):
    """The figures of ``runs`` runs of program row ``w`` for ``system`` (S1: one more run
    first, untimed), or the failed run's result."""
    figures = []
    limit = timeout or (60.0 if w["kind"] == "import" else 120.0 if w["kind"] == "small" else
                        60.0 + 2.0 * w["n"])
    if w["kind"] == "small" and system in ("sharedmp", w["baseline"]) and runs > 1:
        # (torch_mp, for reference: the runs asked for; a single run asked for (the tests'
        # tiny runs, --scale below 1) is one run, whatever the row)
        runs = max(runs, SMALL_RUNS)
    for k in range(1 + w["n"] if w["kind"] == "import" else runs):
        out, status, tail, _ = run_program(start.commands(w, system, paths, sys.executable),
                                           limit)
        got = start.parse(w, out) if status == "ok" else None
        if got is None:
            return {"status": "error" if status == "ok" else status, "error": tail}
        if w["kind"] != "import" or k > 0:
            figures.append(got)
    return figures


def _measure_start(report, plan, runs, timeout):
    """The program rows (``start.py``: process start, data frames): each run a fresh program;
    sharedmp's runs of a row, then its baseline's; a row whose modules are missing, n/a."""
    import tempfile
    section = report["start"] = {"workloads": plan, "runs": runs, "results": {}, "ratios": {},
                                 "vs": {}}
    with tempfile.TemporaryDirectory(prefix="sharedmp-bench-") as directory:
        paths = start.scripts(directory)
        for w in plan:
            systems = ["sharedmp", w["baseline"], *w.get("also", [])]
            _log(f"{w['id']:<14} {' '.join(systems)} ...")
            res = {}
            for s in systems:
                why = start.missing(w, s)
                r = {"status": "n/a", "error": why} if why else \
                    _start_runs(w, s, paths, runs, timeout)
                res[s] = r if isinstance(r, dict) else start.summary(w, r)
            section["results"][w["id"]] = res
            key = start.figure(w)
            mine = res["sharedmp"].get(key)
            vs = {s: mine / res[s][key] if mine and res[s].get(key) else None
                  for s in systems[1:]}
            section["ratios"][w["id"]] = vs[w["baseline"]]
            section["vs"][w["id"]] = vs
            for s in systems:
                r = res[s]
                shown = f"{fmt_num(r[key])} {w['unit']}" if r["status"] == "ok" else \
                    f"{r['status']} {r.get('error') or ''}"
                _log(f"    {w['id']} {s}: {shown}")
                if r["status"] not in ("ok", "n/a"):
                    report["problems"].append(f"{w['id']} {s}: {shown}".strip())


def _dataset_run(w, variant, workers, path, timeout):
    """One fresh program of dataset row ``w``: its figures, or the failed run's result."""
    limit = timeout or 120.0 + 240.0 * w["n"] / 1_000_000 * w["epochs"] / 3
    cmd = datasets.command(w, variant, workers, path, sys.executable)
    out, status, tail, seconds = run_program(cmd, limit)
    got = datasets.parse(variant, out) if status == "ok" else None
    if got is None:
        return {"status": "error" if status == "ok" else status, "wall_s": seconds,
                "error": tail or "no result line (or a plain run imported sharedmp)"}
    return dict(got, wall_s=seconds)


def _measure_datasets(report, plan, timeout):
    """The dataset rows (``datasets.py``): for each worker count, a fresh program of the plain
    dataset, then one of its shared form; a row whose modules are missing, n/a."""
    import tempfile
    section = report["datasets"] = {"workloads": plan, "results": {}, "ratios": {}}
    with tempfile.TemporaryDirectory(prefix="sharedmp-bench-") as directory:
        path = datasets.script(directory)
        for w in plan:
            _log(f"{w['id']:<14} {w['dataset']} {w['method']}, workers "
                 f"{','.join(map(str, w['workers']))} ...")
            why = start.missing(w)
            res = section["results"][w["id"]] = {}
            for k in w["workers"]:
                res[str(k)] = r = {}
                for variant in datasets.VARIANTS:
                    r[variant] = {"status": "n/a", "error": why} if why else \
                        _dataset_run(w, variant, k, path, timeout)
                    got = r[variant]
                    shown = (f"{fmt_num(got['memory_mib'])} MiB, {fmt_num(got['epoch_s'])} "
                             "s/epoch" if got["status"] == "ok" else
                             f"{got['status']} {got.get('error') or ''}")
                    which = f"{w['id']} {k} worker{'s' if k > 1 else ''} {variant}"
                    _log(f"    {which}: {shown}")
                    if got["status"] not in ("ok", "n/a"):
                        report["problems"].append(f"{which}: {shown}".strip())
            section["ratios"][w["id"]] = datasets.ratios(res)


def _survey_shm(report, shm_before, timed_out):
    """What the run left in /dev/shm, and what was removed of it after a timeout."""
    # Releases may trail the processes a moment (torch_shm_manager).
    deadline = time.monotonic() + 5
    while (new := _shm_entries() - shm_before) and time.monotonic() < deadline:
        time.sleep(0.1)
    report["shm_removed"] = _clean_shm(new) if timed_out and new else []
    # Left behind: new files that no live process maps or holds open (others' files, e.g.
    # of a test suite running meanwhile, are in use and not this run's to report).
    new = {p for p in _shm_entries() - shm_before if os.path.basename(p).startswith(_MADE_BY_RUNS)}
    report["shm_left"] = sorted(new - leftovers.in_use(new) - _of_live_joblib(new))


# What the systems the bench runs make in /dev/shm (sharedmp's segments, pool directories and
# ledgers; torch's; multiprocessing's semaphores and shared_memory; joblib's and loky's): the
# rest is another program's (a test suite starting meanwhile makes its own directory there).
_MADE_BY_RUNS = ("sharedmp_", ".sharedmp-", "torch_", "sem.", "psm_", "wnsm_",
                 "joblib_memmapping_folder_", "loky-")


def joblib_maker(name):
    """The pid in the name of a joblib memmapping folder or a loky semaphore
    (joblib_memmapping_folder_<pid>_..., sem.loky-<pid>-...), or None."""
    if not name.startswith(("joblib_memmapping_folder_", "sem.loky-")):
        return None
    pid = name.replace("-", "_").split("_")[3 if name.startswith("joblib") else 1]
    return int(pid) if pid.isdigit() else None


def _of_live_joblib(paths):
    """joblib's and loky's entries whose maker lives: a folder is in use by no mapping, but
    its maker removes it when done."""
    return {p for p in paths if (pid := joblib_maker(os.path.basename(p))) is not None
            and leftovers.proc_stat(pid) is not None}


def bench(scale, rounds, quick, timeout=None, systems=None, workloads=None, isolation=None):
    """Run everything; the report (a JSON-able dict)."""
    t_start = time.monotonic()
    shm_before = _shm_entries()
    plan, start_plan = make_plan(scale, rounds), make_start_plan(scale)
    dataset_plan = make_dataset_plan(scale, quick)
    if workloads:
        plan = [w for w in plan if w["id"] in workloads]
        start_plan = [w for w in start_plan if w["id"] in workloads]
        dataset_plan = [w for w in dataset_plan if w["id"] in workloads]
    have_torch = _torch_available()
    chosen = [s for s, _ in SYSTEMS if systems is None or s in systems]
    runnable = [s for s in chosen if have_torch or s not in TORCH_SYSTEMS]
    if isolation is None:
        isolation = "system" if quick or scale < 1 else "workload"
    report = _new_report(scale, rounds, quick, isolation, plan)

    def worker_timeout(ws):
        if timeout is not None:
            return timeout
        return max(60.0, 150.0 * scale * rounds * len(ws) / 3 + 30.0 * len(ws))

    if plan:
        _measure_bounds(report, rounds, scale, worker_timeout([1]))
    timed_out = False
    for system, ws in _batches(plan, runnable, isolation):
        if _measure(report, system, ws, rounds, worker_timeout(ws)) == "timeout":
            timed_out = True
    if start_plan:                     # best of 2 runs at most: a run is 100 pools
        _measure_start(report, start_plan, min(rounds, 2), timeout)
        timed_out = timed_out or any(r.get("status") == "timeout" for res in
                                     report["start"]["results"].values() for r in res.values())
    if dataset_plan:
        _measure_datasets(report, dataset_plan, timeout)
        timed_out = timed_out or any(r.get("status") == "timeout" for res in
                                     report["datasets"]["results"].values()
                                     for pair in res.values() for r in pair.values())
    report["ratios"] = compute_ratios(report)
    report["targets"] = (check_targets(report) + check_start_targets(report)
                         + check_dataset_targets(report))
    _survey_shm(report, shm_before, timed_out)
    try:
        report["machine"]["loadavg_end"] = os.getloadavg()
    except OSError:
        pass
    report["wall_s"] = time.monotonic() - t_start
    return report

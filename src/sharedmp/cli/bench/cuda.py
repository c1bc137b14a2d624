"""The CUDA rows of ``python -m sharedmp bench``: sharedmp against torch.multiprocessing's
CUDA sharing, in one run, when a GPU is there (skipped with the reason otherwise).

C1: 2,000 fresh float32[256] CUDA tensors, one per message. C2: 100 fresh 16 MiB CUDA
tensors, one per message. C3: 50 state_dicts of 100 fresh CUDA tensors each, 4 KiB to
4 MiB (about 60 MiB a message). C4: one 16 MiB CUDA tensor sent 200 times. Each system
runs as a consumer (this file run as a script, in a fresh process) and a spawned
producer; the consumer reads one element of a message's first and last tensor (a device
sync) and drops the message. The figure is the best of the timed rounds after a warm-up
round. The producer stays alive until the consumer is done (torch needs it).
C1e-C4e: the same with torch's expandable segments (``PYTORCH_CUDA_ALLOC_CONF=
expandable_segments:True``, set for the consumer and so its spawned producer): VMM memory,
which sharedmp carries as POSIX fds in the message and torch fetches with pidfd_getfd.
"""
import json
import os
import subprocess
import sys
import time

MARK = "@@sharedmp-bench-cuda@@ "
WORKLOADS = [("C1", 2000, 256, "fresh 1 KiB CUDA tensor each"),           # (id, n, numel, title)
             ("C2", 100, 4 << 20, "fresh 16 MiB CUDA tensor each"),
             ("C3", 50, None, "state_dict of 100 tensors, 4 KiB-4 MiB"),
             ("C4", 200, 4 << 20, "one 16 MiB tensor, sent again")]
# C3's tensors: 100 sizes from 1 Ki to 1 Mi float32, evenly spaced in log
C3_NUMELS = [int(1024 * 1024 ** (k / 99)) for k in range(100)]
SYSTEMS = [("sharedmp", "sharedmp"), ("torch", "torch.multiprocessing")]
EXPANDABLE = "expandable_segments:True"
ALLOCATORS = [("", None), ("e", EXPANDABLE)]          # (row suffix, allocator setting)


def _env(setting):
    """This environment with PYTORCH_CUDA_ALLOC_CONF's expandable_segments set to ``setting``
    (None: as it is)."""
    env = dict(os.environ)
    if setting is not None:
        parts = [p for p in env.get("PYTORCH_CUDA_ALLOC_CONF", "").split(",")
                 if p.strip() and not p.strip().startswith("expandable_segments")]
        env["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(parts + [setting])
    return env


def _probe():
    """None if a GPU and cuda-bindings are usable (checked in a child), else why not."""
    code = ("import sys, torch\n"
            "if not torch.cuda.is_available(): sys.exit('no CUDA GPU')\n"
            "from sharedmp.cuda import driver\n"
            "sys.exit(driver.available())\n")
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120)
    except (subprocess.TimeoutExpired, OSError) as e:
        return f"probe failed: {e}"
    if r.returncode == 0:
        return None
    return (r.stderr.strip().splitlines() or ["probe failed"])[-1]


def _producer(system, plan, q, go, done, timeout):
    import torch
    if system == "sharedmp":
        import sharedmp  # noqa: F401  (its reducers)
    same = torch.full((4 << 20,), 7.0, device="cuda")          # C4's one tensor
    for wid, n, numel, rounds in plan:
        for _ in range(rounds):
            if not go.acquire(timeout=timeout):
                return
            q.put("start")
            for i in range(n):
                if wid == "C3":
                    q.put({f"layer{k}.weight": torch.full((m,), float(i), device="cuda")
                           for k, m in enumerate(C3_NUMELS)})
                elif wid == "C4":
                    q.put(same)
                else:
                    q.put(torch.full((numel,), float(i), device="cuda"))
    done.wait(timeout)


def _check(wid, i, msg):
    """Read a message's first and last tensor (a device sync each)."""
    tensors = list(msg.values()) if isinstance(msg, dict) else [msg]
    want = 7.0 if wid == "C4" else float(i)
    for t in (tensors[0], tensors[-1]):
        if t[0].item() != want:
            raise RuntimeError(f"{wid}: message {i} reads {t[0].item()}, not {want}")


def _nbytes(wid, numel):
    return 4 * (sum(C3_NUMELS) if wid == "C3" else numel)


def _consumer(system, quick, timeout):
    import torch  # noqa: F401  (first: torch's own reducers, whatever the system)
    if system == "sharedmp":
        import sharedmp
        ctx = sharedmp.get_context("spawn")
    else:
        import torch.multiprocessing as tmp
        ctx = tmp.get_context("spawn")
    scale = 0.25 if quick else 1
    plan = [(wid, max(10, int(n * scale)), numel, 3) for wid, n, numel, _ in WORKLOADS]
    q, go, done = ctx.Queue(), ctx.Semaphore(0), ctx.Event()
    p = ctx.Process(target=_producer, args=(system, plan, q, go, done, timeout), daemon=True)
    p.start()
    try:
        for wid, n, numel, rounds in plan:
            times = []
            for r in range(rounds):
                go.release()
                assert q.get(timeout=timeout) == "start"
                t0 = time.perf_counter()
                for i in range(n):
                    msg = q.get(timeout=timeout)
                    _check(wid, i, msg)
                    del msg
                if r:
                    times.append(time.perf_counter() - t0)
            best = min(times)
            sys.stdout.write(MARK + json.dumps({"workload": wid, "n": n, "msgs": n / best,
                                                "gbps": n * _nbytes(wid, numel) / best / 1e9})
                             + "\n")
            sys.stdout.flush()
    finally:
        done.set()
        p.join(timeout)
        if p.is_alive():
            p.kill()


def run(quick, timeout=600, expandable=True):
    """{"skipped": reason} or {"rows": {workload: {system: figures}}}; workloads C1-C4, and
    C1e-C4e (expandable segments) unless ``expandable`` is false."""
    why = _probe()
    if why is not None:
        return {"skipped": why}
    rows = {}
    for suffix, setting in ALLOCATORS if expandable else ALLOCATORS[:1]:
        for system, _ in SYSTEMS:
            cmd = [sys.executable, os.path.abspath(__file__), system, "1" if quick else "0",
                   str(timeout)]
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                   env=_env(setting))
                out, err = r.stdout, r.stderr
            except subprocess.TimeoutExpired as e:
                out, err = e.stdout or "", "timeout"
            if isinstance(out, bytes):
                out = out.decode(errors="replace")
            got = [json.loads(line[len(MARK):]) for line in (out or "").splitlines()
                   if line.startswith(MARK)]
            for res in got:
                rows.setdefault(res["workload"] + suffix, {})[system] = res
            for wid, *_ in WORKLOADS:
                if system not in rows.setdefault(wid + suffix, {}):
                    last = (err or "").strip().splitlines()[-1:]
                    rows[wid + suffix][system] = {"error": last or ["no result"]}
    return {"rows": rows}


def format_rows(report):
    """The CUDA section of the table."""
    if "skipped" in report:
        return f"CUDA rows: skipped ({report['skipped']})"
    heads = {"": "CUDA (spawn)", "e": "CUDA, expandable_segments:True (spawn)"}
    lines = []
    for suffix, _ in ALLOCATORS:
        if not any(wid + suffix in report["rows"] for wid, *_ in WORKLOADS):
            continue
        if lines:
            lines.append("")
        lines.append(f"{heads[suffix]:<42} sharedmp msg/s   torch msg/s   ratio")
        for wid, _, _, title in WORKLOADS:
            row = report["rows"].get(wid + suffix, {})
            a, b = row.get("sharedmp", {}).get("msgs"), row.get("torch", {}).get("msgs")
            cell = lambda v: f"{v:>14,.0f}" if v else f"{'error':>14}"   # noqa: E731
            ratio = f"{a / b:>6.2f}x" if a and b else "   n/a"
            lines.append(f"{wid + suffix:<3} {title:<38} {cell(a)} {cell(b)}  {ratio}")
    return "\n".join(lines)


if __name__ == "__main__":
    # Run as a script, Python put this package's directory first on sys.path, where this very
    # file would shadow cuda-bindings' ``cuda`` package: drop it before anything imports that.
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or ".") == here:
        del sys.path[0]
    _consumer(sys.argv[1], sys.argv[2] == "1", float(sys.argv[3]))

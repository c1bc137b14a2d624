"""CPython's own multiprocessing and concurrent.futures suites, with sharedmp's objects and with
the standard library's, on the interpreter that runs this: one row of docs/reference.md's
table per suite and system ("CPython's suites, Python by Python").

    .venv/bin/python scripts/cpython_table.py [sharedmp|stdlib]   # every start method, futures
    .venv-3.13/bin/python scripts/cpython_table.py   # (made by PYTHON=3.13 ./dev test)
    scripts/sid-python run .venv-3.14/bin/python scripts/cpython_table.py   # 3.14, 3.15: in sid

Each suite runs in a fresh interpreter (tests/_cpython_suite.py), one at a time, bounded.
"""
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SUITE = os.path.join(os.path.dirname(HERE), "tests", "_cpython_suite.py")
BOUND = 900


def run(args):
    with tempfile.TemporaryDirectory() as cwd:     # (some tests write files in the cwd)
        t0 = time.monotonic()
        try:
            done = subprocess.run([sys.executable, SUITE, *args], cwd=cwd, capture_output=True,
                                  text=True, timeout=BOUND)
            out, err = done.stdout, done.stderr
        except subprocess.TimeoutExpired as e:
            out, err = (x.decode() if isinstance(x, bytes) else (x or "")
                        for x in (e.stdout, e.stderr))
        seconds = time.monotonic() - t0
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if not lines:
        print(f"{args}: no result; its output ends:\n{out[-2000:]}\n{err[-6000:]}",
              file=sys.stderr, flush=True)
        return None, seconds
    return json.loads(lines[-1][len("RESULT "):]), seconds


def main():
    systems = sys.argv[1:] or ["sharedmp", "stdlib"]     # (or one of them)
    sys.path.insert(0, os.path.dirname(SUITE))
    import _cpython_suite
    # Deliberate differences that a setting undoes hang without it (test_parent_process waits
    # 5 min for a grandchild that died with its parent): left out here, run with their setting
    # by tests/test_cpython.py
    hang = [n for n, env in _cpython_suite.deliberate_failures().items() if env]
    version = ".".join(map(str, sys.version_info[:3]))
    methods = [m for m in ("fork", "spawn", "forkserver")
               if m in multiprocessing.get_all_start_methods()]
    try:
        import test.test_concurrent_futures.util  # noqa: F401  (a package from 3.12)
        futures = True
    except ImportError:
        futures = False
    print("| Python | start method | suite | objects | passed | failed | skipped | failed tests "
          "| s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for method in methods:
        for suite in (["multiprocessing"] + ["concurrent.futures"] * futures):
            for system in systems:
                args = (["--start-method", method] + ["--futures"] * (suite != "multiprocessing")
                        + ["--stdlib"] * (system == "stdlib"))
                if system == "sharedmp":
                    args += [a for n in hang for a in ("--skip", n)]
                result, seconds = run(args)
                row = f"| {version} | {method} | {suite} | {system} |"
                if result is None:
                    print(f"{row} - | - | - | no result (bound {BOUND} s?) | {seconds:.0f} |",
                          flush=True)
                    continue
                failed = result["failed"]
                passed = result["run"] - len(failed) - result["skipped"]
                names = ", ".join(f"`{n}`" for n in failed) or "-"
                print(f"{row} {passed} | {len(failed)} | {result['skipped']} | {names} | "
                      f"{seconds:.0f} |", flush=True)

if __name__ == "__main__":
    main()

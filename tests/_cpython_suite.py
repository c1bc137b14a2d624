"""CPython's own multiprocessing tests, with sharedmp's objects in place of the standard ones.

    python tests/_cpython_suite.py [--start-method spawn|fork|forkserver] [--stdlib] [-k PATTERN]
    python tests/_cpython_suite.py --futures [--start-method M] [--stdlib] [-k PATTERN]

The first form runs every process-based class of ``test/_test_multiprocessing.py``, the
module the interpreter ships (nothing of it is copied here): its "processes" flavour
(``WithProcessesTest*``: Process, Queue, Lock, Pool, Connection, Listener, Barrier, Value,
SharedMemory, Finalize ...) and the classes that are not per flavour (start methods, wait,
EINTR, resource tracker ...). The test module's ``multiprocessing`` and the processes mixin
see sharedmp's ``Process``, ``Queue``, ``Pipe``, ``Pool``, contexts and the rest of its
multiprocessing surface. ``--futures`` runs ``test_concurrent_futures``' process-pool classes
(3.12+) with sharedmp's contexts. ``--stdlib`` runs the same tests unchanged, for comparison.

It prints one JSON line (``RESULT {...}``: counts, the failed tests) and exits 1 if a test
failed that is not a deliberate difference: those are listed once, in docs/reference.md's
section "Differences from multiprocessing, on purpose" (its last column), which this reads.
"""
import argparse
import faulthandler
import json
import os
import re
import sys
import time
import types
import unittest

import multiprocessing

HERE = os.path.dirname(os.path.abspath(__file__))
REFERENCE = os.path.join(os.path.dirname(HERE), "docs", "reference.md")
SECTION = "## Differences from multiprocessing, on purpose"


def deliberate_failures(path=REFERENCE):
    """{test name: the settings under which it passes ({} where none does)}, from the last
    column of the docs' table: "`test_x` (passes with `SHAREDMP_Y=1`)"."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]   # (header, rule)
    found = {}
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        for name, settings in re.findall(r"`(test_\w+)`(?: \(passes with ([^)]*)\))?", cells[-1]):
            found[name] = dict(re.findall(r"`(\w+)=([^`]*)`", settings))
    return found


def sharedmp_as_multiprocessing():
    """A module that is ``multiprocessing`` with sharedmp's public names laid over it."""
    import sharedmp
    proxy = types.ModuleType("multiprocessing")
    proxy.__dict__.update(vars(multiprocessing))
    for name in sharedmp.__all__:
        if hasattr(multiprocessing, name):
            setattr(proxy, name, getattr(sharedmp, name))

    def submodule(name):                 # (``multiprocessing.forkserver`` imported later)
        import importlib
        try:
            return importlib.import_module(f"multiprocessing.{name}")
        except ImportError:
            raise AttributeError(f"module 'multiprocessing' has no attribute {name!r}") from None
    proxy.__getattr__ = submodule
    return proxy


def _point_at_sharedmp(T):
    proxy = sharedmp_as_multiprocessing()
    for name, value in list(vars(T.ProcessesMixin).items()):
        if isinstance(value, staticmethod) and hasattr(proxy, name):
            setattr(T.ProcessesMixin, name, staticmethod(getattr(proxy, name)))
        elif isinstance(value, type) and name == "Process":
            T.ProcessesMixin.Process = proxy.Process
    T.multiprocessing = proxy


def install(stdlib, start_method):
    """The process-based classes, as unittest classes in this module (spawned children import
    this file as their main module and must find the same classes, patched the same way)."""
    import test._test_multiprocessing as T
    if not stdlib:
        _point_at_sharedmp(T)
    found = {"__name__": __name__}
    T.install_tests_in_module_dict(found, start_method)
    keep = {name: obj for name, obj in found.items() if isinstance(obj, type)
            and not name.startswith(("WithThreads", "WithManager"))}
    globals().update(keep)
    return keep, found["setUpModule"], found["tearDownModule"]


# Tests that hang by a CPython bug of the interpreter running them, whichever objects they use:
# {test name: (the bug, the first releases of each line that fix it)}. Skipped where unfixed
# (shown as skipped, with the bug's number), run where fixed.
CPYTHON_HANGS = {
    # gh-125451: ProcessPoolExecutor's manager thread holds _shutdown_lock while it joins the
    # queue's feeder thread, which waits for that lock to report a task that failed to pickle.
    # Seen here on 3.13.0 with the standard library's own context (tests/_cpython_suite.py
    # --futures --stdlib): a loop of the test's steps hangs within 20 rounds.
    "test_shutdown_deadlock_pickle": ("gh-125451", ((3, 12, 8), (3, 13, 1))),
    "test_processes_terminate": ("gh-125451", ((3, 12, 8), (3, 13, 1))),
}


def cpython_hangs(version=sys.version_info):
    """{test name: reason} for the tests that hang by a bug of this interpreter."""
    found = {}
    for name, (bug, fixed_in) in CPYTHON_HANGS.items():
        line = [v for v in fixed_in if v[:2] == tuple(version[:2])]
        if (line and tuple(version[:3]) < line[0]) or tuple(version[:2]) < min(fixed_in)[:2]:
            releases = ", ".join(".".join(map(str, v)) for v in fixed_in)
            found[name] = f"hangs by CPython {bug} (fixed in {releases})"
    return found


def install_futures(stdlib, start_method=None):
    """test_concurrent_futures' process-pool classes (a package from 3.12 on), those of one
    start method if given."""
    import importlib
    import pkgutil
    import test.test_concurrent_futures as pkg
    from test.test_concurrent_futures import util as U
    mixins = {U.ProcessPoolForkMixin: "fork", U.ProcessPoolSpawnMixin: "spawn",
              U.ProcessPoolForkserverMixin: "forkserver"}
    if not stdlib:
        import sharedmp
        for mixin, method in mixins.items():
            mixin.get_context = lambda self, m=method: sharedmp.get_context(m)
    keep = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.startswith("test_"):
            mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
            for name, obj in vars(mod).items():
                if isinstance(obj, type) and issubclass(obj, tuple(
                        m for m, method in mixins.items() if start_method in (None, method))):
                    keep[f"{info.name}.{name}"] = obj
                    for test, reason in cpython_hangs().items():
                        if hasattr(obj, test):
                            setattr(obj, test, unittest.skip(reason)(getattr(obj, test)))
    return keep, U.setup_module, lambda: None


# Spawned and forkserver children import this file as their main module (``__mp_main__``):
# the settings travel in the environment. (Imported by name, as test_cpython.py does to read
# the deliberate differences, it installs nothing.)
if __name__ == "__mp_main__":
    if os.environ.get("CPYTHON_SUITE_FUTURES") == "1":
        install_futures(os.environ.get("CPYTHON_SUITE_STDLIB") == "1",
                        os.environ.get("CPYTHON_SUITE_START_METHOD") or None)
    else:
        install(os.environ.get("CPYTHON_SUITE_STDLIB") == "1",
                os.environ.get("CPYTHON_SUITE_START_METHOD", "spawn"))


TEST_BOUND = 240     # s: a test still running then has hung (CPython's own bound is 5 min)


class _TimedResult(unittest.TextTestResult):
    """Records each test's seconds: the slowest are printed (a hang shows as one). A test
    that runs past TEST_BOUND ends the run with every thread's stack on stderr."""
    def startTest(self, test):
        self._t0 = time.monotonic()
        faulthandler.dump_traceback_later(TEST_BOUND, exit=True)
        super().startTest(test)

    def stopTest(self, test):
        faulthandler.cancel_dump_traceback_later()
        super().stopTest(test)
        self.seconds = getattr(self, "seconds", {})
        self.seconds[test.id().rsplit(".", 1)[-1]] = time.monotonic() - self._t0


def _settings(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--start-method", choices=["spawn", "fork", "forkserver"],
                   help="default: spawn; with --futures, all three")
    p.add_argument("--futures", action="store_true", help="test_concurrent_futures' process pools")
    p.add_argument("--stdlib", action="store_true", help="the standard library's objects")
    p.add_argument("-k", dest="pattern", help="run only tests whose name contains this")
    p.add_argument("--skip", action="append", default=[], metavar="NAME",
                   help="leave this test out (repeatable)")
    p.add_argument("--strict", action="store_true",
                   help="every failure counts, the deliberate ones too")
    return p.parse_args(argv)


def main(argv):
    # As from a terminal: a program started in the background by a shell without job control
    # (a CI script's `cmd &`) has SIGINT ignored, which its children inherit, and CPython's
    # tests that interrupt a child (test_wait_result, ..._ignores_sigint) then fail whichever
    # objects they use.
    import signal
    signal.signal(signal.SIGINT, signal.default_int_handler)
    args = _settings(argv)
    os.environ["CPYTHON_SUITE_START_METHOD"] = args.start_method or ""
    os.environ["CPYTHON_SUITE_STDLIB"] = "1" if args.stdlib else "0"
    os.environ["CPYTHON_SUITE_FUTURES"] = "1" if args.futures else "0"
    if args.futures:
        classes, set_up, tear_down = install_futures(args.stdlib, args.start_method)
    else:
        args.start_method = args.start_method or "spawn"
        classes, set_up, tear_down = install(args.stdlib, args.start_method)
    loader = unittest.TestLoader()
    if args.pattern:
        loader.testNamePatterns = [f"*{args.pattern}*"]
    suite = unittest.TestSuite()
    for _, cls in sorted(classes.items()):
        for test in loader.loadTestsFromTestCase(cls):
            if test.id().rsplit(".", 1)[-1] not in args.skip:
                suite.addTest(test)
    ran = {t.id().rsplit(".", 1)[-1] for t in _tests(suite)}   # (a run suite lets go of them)
    set_up()
    try:
        # (each test named as it starts: a suite stopped by its bound shows the one it was in)
        runner = unittest.TextTestRunner(verbosity=2,
                                         resultclass=_TimedResult)
        result = runner.run(suite)
    finally:
        tear_down()
    failed = sorted({t.id().rsplit(".", 1)[-1] for t, _ in result.failures + result.errors})
    allowed = {} if args.strict or args.stdlib else deliberate_failures()
    unexpected = [name for name in failed if name not in allowed]
    skipped = {t.id().rsplit(".", 1)[-1] for t, _ in result.skipped}
    print("\nRESULT " + json.dumps({          # (some suites print timings without a newline)
        "system": "stdlib" if args.stdlib else "sharedmp",
        "suite": (f"futures {args.start_method or ''}".strip() if args.futures
                  else args.start_method),
        "run": result.testsRun, "failed": failed, "skipped": len(result.skipped),
        "unexpected": unexpected,
        # deliberate differences that ran and passed: the docs' table is stale
        "passed_deliberate": sorted(n for n in allowed if n in ran - skipped - set(failed)),
        "slowest": sorted(((round(s, 1), n) for n, s in getattr(result, "seconds", {}).items()),
                          reverse=True)[:8]}), flush=True)
    return 1 if unexpected else 0


def _tests(suite):
    for t in suite:
        yield from (_tests(t) if isinstance(t, unittest.TestSuite) else (t,))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""CPython's own multiprocessing tests for the channel classes, pointed at sharedmp's.

    python scripts/cpython_channel_tests.py [--start-method spawn|fork|forkserver] [--stdlib] [-v]

Runs the test classes of ``test/_test_multiprocessing.py`` (shipped with the interpreter;
nothing of it is copied here) that exercise queues, pipes and pools, in their
"processes" flavour: _TestQueue, _TestPool, _TestPoolWorkerErrors,
_TestPoolWorkerLifetime, _TestConnection, _TestPoll, _TestPicklingConnections, TestWait,
TestIgnoreEINTR, TestSimpleQueue, TestInitializers. ``Queue``, ``JoinableQueue``,
``SimpleQueue``, ``Pipe`` and ``Pool`` of the test mixin and of the test module's
``multiprocessing`` are sharedmp's; ``--stdlib`` runs the same tests unchanged, for
comparison. Prints one line of counts and exits 1 if any test failed.
"""
import argparse
import sys
import types
import unittest

import multiprocessing

CLASSES = ["_TestQueue", "_TestPool", "_TestPoolWorkerErrors", "_TestPoolWorkerLifetime",
           "_TestConnection", "_TestPoll", "_TestPicklingConnections", "TestWait",
           "TestIgnoreEINTR", "TestSimpleQueue", "TestInitializers"]
CHANNELS = ["Queue", "JoinableQueue", "SimpleQueue", "Pipe", "Pool"]
# sharedmp's put() pickles in the caller and raises there (docs/reference.md, mp.Queue).
DELIBERATE = {"test_queue_feeder_donot_stop_onexc"}


def point_at_sharedmp(T):
    """Make the test module's channels sharedmp's (also in spawned children: see below)."""
    import sharedmp
    for name in CHANNELS:
        setattr(T.ProcessesMixin, name, staticmethod(getattr(sharedmp, name)))
    proxy = types.ModuleType("multiprocessing")
    proxy.__dict__.update(vars(multiprocessing))
    for name in CHANNELS:
        setattr(proxy, name, getattr(sharedmp, name))
    T.multiprocessing = proxy


def install(stdlib):
    """The selected tests, as unittest classes in this module (spawned children re-run this
    on import of the main module, so they find the same classes)."""
    import test._test_multiprocessing as T
    if not stdlib:
        point_at_sharedmp(T)
    found = {"__name__": __name__}
    T.install_tests_in_module_dict(found, START_METHOD)    # (3.10 has no only_type)
    keep = {}
    for name, obj in found.items():
        base = name.replace("WithProcesses", "_", 1) if name.startswith("WithProcesses") else name
        if base in CLASSES and isinstance(obj, type):
            keep[name] = obj
    globals().update(keep)
    return keep, found["setUpModule"], found["tearDownModule"]


def _settings(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--start-method", default="spawn", choices=["spawn", "fork", "forkserver"])
    p.add_argument("--stdlib", action="store_true", help="the standard library's channels")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("-k", dest="pattern", help="run only tests whose name contains this")
    return p.parse_args(argv)


# The children spawned by the tests import this file as their __main__ and need the same
# classes, patched the same way: the settings travel in the environment.
import os  # noqa: E402

START_METHOD = os.environ.setdefault("CPYTHON_TESTS_START_METHOD", "spawn")
STDLIB = os.environ.get("CPYTHON_TESTS_STDLIB") == "1"
if __name__ != "__main__":
    install(STDLIB)


def main(argv):
    args = _settings(argv)
    os.environ["CPYTHON_TESTS_START_METHOD"] = args.start_method
    os.environ["CPYTHON_TESTS_STDLIB"] = "1" if args.stdlib else "0"
    global START_METHOD
    START_METHOD = args.start_method
    classes, set_up, tear_down = install(args.stdlib)
    loader = unittest.TestLoader()
    if args.pattern:
        loader.testNamePatterns = [f"*{args.pattern}*"]
    suite = unittest.TestSuite(loader.loadTestsFromTestCase(c) for _, c in sorted(classes.items()))
    set_up()
    try:
        result = unittest.TextTestRunner(verbosity=2 if args.verbose else 1).run(suite)
    finally:
        tear_down()
    failed = [t.id().rsplit(".", 1)[-1] for t, _ in result.failures + result.errors]
    passed = result.testsRun - len(failed) - len(result.skipped)
    which = "stdlib" if args.stdlib else "sharedmp"
    print(f"{which} {args.start_method}: {result.testsRun} run, {passed} passed, "
          f"{len(failed)} failed {sorted(failed)}, {len(result.skipped)} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

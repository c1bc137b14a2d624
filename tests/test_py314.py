"""What Python 3.14 added to multiprocessing and concurrent.futures, with sharedmp's objects as
with the standard library's: ``Process.interrupt()``, ``ProcessPoolExecutor.terminate_workers()``
and ``kill_workers()``, ``Executor.map(..., buffersize=)``, and the default start method (3.14:
forkserver on Linux) followed by sharedmp's default context; 3.15's
``set_forkserver_preload(..., on_error=)`` kept when sharedmp adds its modules. Each case runs
with both, in the same test, and must come out the same. Every wait is bounded; children are
killed on failure.
"""
import concurrent.futures
import itertools
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import sharedmp as mp

import _py314_workers as w
from conftest import TIMEOUT, join_or_kill

pytestmark = pytest.mark.skipif(sys.version_info < (3, 14), reason="Python 3.14's API")


def _contexts(method):
    return {"stdlib": multiprocessing.get_context(method), "sharedmp": mp.get_context(method)}


def _interrupted(ctx, with_array):
    q, ready = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=w.wait_for_interrupt, args=(ready, q, with_array))
    p.start()
    try:
        assert ready.wait(TIMEOUT)
        p.interrupt()
        what, array = q.get(timeout=TIMEOUT)
        exitcode = join_or_kill(p)
        return what, exitcode, None if array is None else (array.sum(), mp.is_shared(array))
    finally:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)


def test_process_interrupt_raises_keyboardinterrupt_in_the_child(start_method):
    got = {name: _interrupted(ctx, with_array=name == "sharedmp")
           for name, ctx in _contexts(start_method).items()}
    assert got["stdlib"][:2] == got["sharedmp"][:2] == ("KeyboardInterrupt", 0), got
    assert got["sharedmp"][2] == (70_000.0, True)       # the array came back shared


def test_process_interrupt_of_a_child_that_does_not_handle_it(start_method):
    codes = {}
    for name, ctx in _contexts(start_method).items():
        ready = ctx.Event()
        p = ctx.Process(target=w.sleep_forever, args=(ready,))
        p.start()
        try:
            assert ready.wait(TIMEOUT)
            p.interrupt()
            codes[name] = join_or_kill(p)
        finally:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
    assert codes["stdlib"] == codes["sharedmp"] == 1, codes    # (KeyboardInterrupt's traceback)


@pytest.mark.parametrize("how", ["terminate_workers", "kill_workers"])
def test_executor_ends_its_workers(how):
    signals = {"terminate_workers": signal.SIGTERM, "kill_workers": signal.SIGKILL}
    seen = {}
    for name, ctx in _contexts("spawn").items():
        ex = concurrent.futures.ProcessPoolExecutor(max_workers=2, mp_context=ctx)
        pids = mp.zeros(1, dtype=np.int64)
        try:
            running = ex.submit(w.pid_then_sleep, pids)
            queued = [ex.submit(w.square, i) for i in range(4)]
            deadline = TIMEOUT
            while pids[0] == 0 and deadline > 0:      # (the worker writes into shared memory)
                concurrent.futures.wait([running], timeout=0.05)
                deadline -= 0.05
            assert pids[0] != 0
            workers = dict(ex._processes)
            getattr(ex, how)()
            # (not join(): the executor's manager thread waits for them too, and one of the
            # two reaps each; the exit code is set on the shared Process either way)
            deadline = time.monotonic() + TIMEOUT
            while any(p.exitcode is None for p in workers.values()):
                assert time.monotonic() < deadline, workers
                time.sleep(0.02)
            # (which exception the running task gets, and which queued tasks a worker took
            # before it died, varies with timing, for either library; so does a SIGTERM
            # among the SIGKILLs: the manager thread, seeing a worker killed, terminates the
            # others, racing kill_workers' own loop)
            codes = {p.exitcode for p in workers.values()}
            seen[name] = (-signals[how] in codes and codes <= {-signals[how], -signal.SIGTERM},
                          running.exception(timeout=TIMEOUT) is not None,
                          [f.cancelled() or f.done() for f in queued])
        finally:
            for p in list(getattr(ex, "_processes", None) or {}):
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
            ex.shutdown(wait=True, cancel_futures=True)
    assert seen["stdlib"] == seen["sharedmp"], seen
    assert seen["sharedmp"][0] is True, seen


def test_executor_map_with_a_buffer_reads_its_input_lazily():
    got = {}
    for name, ctx in _contexts("spawn").items():
        with concurrent.futures.ProcessPoolExecutor(max_workers=2, mp_context=ctx) as ex:
            arrays = (np.full(5_000, i, dtype=np.float64) for i in itertools.count())
            results = ex.map(w.square, arrays, buffersize=3, timeout=TIMEOUT)
            got[name] = [float(next(results)[0]) for _ in range(8)]   # (an endless input)
            results.close()
    assert got["stdlib"] == got["sharedmp"] == [float(i * i) for i in range(8)], got


def _program(code):
    """What a fresh interpreter running ``code`` prints (JSON), bounded."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=TIMEOUT, check=True).stdout
    return json.loads(out), out


def test_the_default_context_follows_the_interpreters_default_start_method():
    code = ("import json, multiprocessing, sharedmp as mp\n"
            "if __name__ == '__main__':\n"
            "    with mp.Pool(1) as pool:\n"
            "        a = pool.apply(mp.full, (10_000, 2.0))\n"
            "    print(json.dumps([multiprocessing.get_start_method(), "
            "mp.get_context().get_start_method(), float(a.sum()), mp.is_shared(a)]))\n")
    (std, ours, total, shared), out = _program(code)
    assert std == ours == multiprocessing.get_all_start_methods()[0], out
    assert (total, shared) == (20_000.0, True)
    if sys.platform == "linux":
        assert ours == "forkserver"


@pytest.mark.skipif(sys.version_info < (3, 15), reason="Python 3.15's on_error")
def test_sharedmps_forkserver_preload_keeps_the_programs_on_error():
    code = ("import multiprocessing, multiprocessing.forkserver as fs, sharedmp as mp, json\n"
            "if __name__ == '__main__':\n"
            "    multiprocessing.set_forkserver_preload(['json'], on_error='warn')\n"
            "    p = mp.get_context('forkserver').Process(target=json.dumps, args=(1,))\n"
            "    p.start(); p.join(60)\n"
            "    print(json.dumps([p.exitcode, fs._forkserver._preload_modules, "
            "fs._forkserver._preload_on_error]))\n")
    (exitcode, modules, on_error), out = _program(code)
    assert exitcode == 0 and on_error == "warn", out
    assert modules[0] == "json" and "sharedmp" in modules, out

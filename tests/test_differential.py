"""Differential test: what a receiver gets through sharedmp against what the standard library
alone gives (issue 40).

One corpus (``_differential_workers.corpus()``: every NumPy dtype kind in both byte orders, C
and F order, views, 0-d, empty, read-only and object arrays, containers with the same array
twice, sizes on both sides of the by-value limits, torch tensors, pandas and Arrow frames),
each object sent alone and in a 1-tuple through:
- sharedmp's Queue, SimpleQueue and Pipe, and a standard-library Queue and Pipe in this
  process (``import sharedmp`` done), to one spawned child; under each sharing strategy;
- the reference: a standard-library Queue and Pipe in a fresh interpreter that never imports
  sharedmp, to its own spawned child (run once, beside the rest).
Each receiver describes what it got (plain data); the descriptions must agree. The
differences allowed are those docs/API.md section 5 states, each one named in ``compare``.
"""
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

import sharedmp as mp
from sharedmp import host
from sharedmp.memory import cache, named, segment

import _differential_workers as dw
import _workers as w
from conftest import SHARING_STRATEGIES, TIMEOUT, eventually

HERE = os.path.dirname(os.path.abspath(__file__))
SHAREDMP_CHANNELS = ["sharedmp Queue", "sharedmp SimpleQueue", "sharedmp Pipe"]
STDLIB_CHANNELS = ["stdlib Queue", "stdlib Pipe"]


@pytest.fixture(scope="module")
def reference():
    """The reference run's descriptions (started once, at the first test that needs it, in
    a session of its own: killed whole if it does not finish)."""
    env = {**os.environ, "PYTHONPATH": HERE}
    env = {k: v for k, v in env.items() if not k.startswith("SHAREDMP_")}
    proc = subprocess.Popen([sys.executable, "-c", "import _differential_workers as dw; "
                             "dw.reference_main()"], cwd=HERE, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    result = []

    def get():
        if not result:
            try:
                out, err = proc.communicate(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                host.end_group(proc, 5)
                proc.communicate()
                pytest.fail(f"the reference run did not finish within {TIMEOUT} s", pytrace=False)
            assert proc.returncode == 0, f"the reference run failed:\n{err}"
            result.append(json.loads(out.splitlines()[-1]))
        return result[0]
    yield get
    if proc.poll() is None:
        host.end_group(proc, 5)
        proc.communicate()


@pytest.fixture
def shm_dir(monkeypatch):
    """Named segments (file_system) in a directory of this test's own, checked empty after."""
    base = named.shm_dir()
    d = tempfile.mkdtemp(prefix="differential-", dir=base if os.path.isdir(base) else None)
    monkeypatch.setenv(named.SHM_DIR_ENV, d)
    monkeypatch.setattr(cache, "_idle", 60.0)    # (kept segments stay until empty_cache)
    yield d
    segment.forget_recent()

    def empty():
        mp.empty_cache()
        return not [n for n in os.listdir(d) if n.startswith(named.PREFIX)]
    assert eventually(empty), os.listdir(d)
    shutil.rmtree(d, ignore_errors=True)


def through_sharedmp(strategy):
    """{channel: [(alone, wrapped) descriptions]} of one spawned child that received the
    corpus on each channel, sent from here under ``strategy``."""
    mp.set_sharing_strategy(strategy)
    if strategy == "file_system":
        mp.zeros(1)           # the manager daemon runs before the child starts: it inherits it
    ctx, std = mp.get_context("spawn"), multiprocessing.get_context("spawn")
    sr, sw = ctx.Pipe(duplex=False)
    tr, tw = std.Pipe(duplex=False)
    q, sq, tq = ctx.Queue(), ctx.SimpleQueue(), std.Queue()
    ends = [(SHAREDMP_CHANNELS[0], q, q), (SHAREDMP_CHANNELS[1], sq, sq),
            (SHAREDMP_CHANNELS[2], sr, sw), (STDLIB_CHANNELS[0], tq, tq),
            (STDLIB_CHANNELS[1], tr, tw)]
    p, back = w.start(ctx, dw.receive_all, [(label, r) for label, r, _ in ends])
    try:
        sr.close()
        tr.close()
        dw.send_all([(label, s) for label, _, s in ends])
        return w.result(p, back)
    finally:
        back.close()
        if p.is_alive():
            p.kill()
            p.join(5)
        for _, _, s in ends:
            s.close()
        tq.join_thread()
        q.join_thread()


def _sent(a):
    """What the sender's array says about itself, in the descriptions' terms."""
    f = a.flags
    return {"dtype": dw._dtype_text(a.dtype), "strides": list(a.strides), "C": f.c_contiguous,
            "F": f.f_contiguous, "W": f.writeable}


def compare(got, ref, sent, where, problems):
    """Append to ``problems`` how ``got`` (a sharedmp side's description) differs from the
    reference's ``ref`` beyond the documented differences; ``sent`` is the object sent."""
    def differ(key, want):
        if got.get(key) != want:
            problems.append(f"{where}: {key} {got.get(key)!r}, expected {want!r}")

    if not ref.get("values", True):
        problems.append(f"{where}: the reference itself got other values (the test is wrong)")
    differ("type", ref["type"])
    if got["type"] != ref["type"]:
        return
    if got["type"] == "ndarray":
        s = _sent(sent)
        differ("values", True)
        differ("shape", ref["shape"])
        # Documented (API.md section 5, "byte order"): sharedmp keeps it; NumPy's pickle of
        # protocol 4 (the standard library's default here) gives native order.
        differ("dtype", s["dtype"])
        if ref["dtype"] != s["dtype"]:
            differ("native", ref["native"])
        # Documented ("read-only flag"): kept; the standard library's copy is writable.
        differ("W", s["W"] if not s["W"] else ref["W"])
        # Documented (section 5, "Views survive": strides, also negative and
        # non-contiguous): an array in shared memory keeps the sender's layout. By value,
        # the receiver's array is the one NumPy's pickle makes (C, or F for F order).
        layout = s if got["shared"] else ref
        for key in ("strides", "C", "F"):
            differ(key, layout[key])
        return
    if got["type"] in ("list", "tuple"):
        differ("n", ref["n"])
        differ("same", ref["same"])            # identity within the message, as pickle's
        for i, (g, r) in enumerate(zip(got["items"], ref["items"])):
            compare(g, r, sent[i], f"{where}[{i}]", problems)
        return
    if got["type"] == "dict":
        differ("keys", ref["keys"])
        for k, r in ref["items"].items():
            if k in got["items"]:
                compare(got["items"][k], r, sent[k], f"{where}[{k!r}]", problems)
        return
    for key in ref:                              # tensors, frames: everything but sharing
        if key != "shared":
            differ(key, ref[key])


def check_all(descriptions, ref, labels):
    items = dw.corpus()
    problems = []
    for label in labels:
        assert len(descriptions[label]) == len(items)
        for (name, obj), (alone, wrapped), (r, _) in zip(items, descriptions[label], ref):
            compare(alone, r, obj, f"{label} / {name} (alone)", problems)
            compare(wrapped, r, obj, f"{label} / {name} (in a tuple)", problems)
    return problems


@pytest.mark.parametrize("strategy", SHARING_STRATEGIES)
def test_receivers_get_what_the_standard_library_gives(strategy, reference, shm_dir):
    got = through_sharedmp(strategy)
    assert got["sharedmp imported"]
    problems = check_all(got, reference()["Queue"], SHAREDMP_CHANNELS + STDLIB_CHANNELS)
    assert not problems, f"{len(problems)} differences:\n" + "\n".join(problems[:40])
    # the corpus reaches both sides of the by-value limits (section 5)
    names = [n for n, _ in dw.corpus()]
    shared = {label: {n for n, (a, _) in zip(names, got[label]) if a.get("shared")}
              for label in SHAREDMP_CHANNELS + STDLIB_CHANNELS}
    for label, names_shared in shared.items():
        assert "1 KiB" not in names_shared and "4104 KiB" in names_shared, label
    assert all("49 KiB" in shared[label] for label in SHAREDMP_CHANNELS)
    assert not any("127 KiB" in shared[label] for label in STDLIB_CHANNELS)
    assert all("129 KiB" in shared[label] for label in STDLIB_CHANNELS)


# (last: the reference run goes on beside the tests above, which start it)
def test_reference_is_the_standard_library_alone(reference):
    ref = reference()
    assert not ref["sharedmp imported"] and not ref["parent imported sharedmp"]
    assert ref["Queue"] == ref["Pipe"]
    assert all(a == b for a, b in ref["Queue"])            # alone and in a tuple alike
    names = [n for n, _ in dw.corpus()]
    unequal = [n for n, (a, _) in zip(names, ref["Queue"]) if not a.get("values", True)]
    assert not unequal, unequal

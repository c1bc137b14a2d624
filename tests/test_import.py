"""``import sharedmp`` stays light: no NumPy, no torch; their reducers come with them.

Whole programs in fresh interpreters (a test process has imported everything already).
"""
import json
import os
import sys

import pytest

from conftest import run_bounded

DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_light_driver.py")
HEAVY = ("numpy", "torch", "cupy")


def imported_by(statement):
    """The modules a fresh interpreter imports for ``statement`` (``-X importtime``)."""
    rc, _, err = run_bounded([sys.executable, "-X", "importtime", "-c", statement])
    assert rc == 0, err
    return {line.rsplit("|", 1)[1].strip() for line in err.splitlines()
            if line.startswith("import time:") and line.count("|") == 2} - {"package"}


def test_import_sharedmp_imports_neither_numpy_nor_torch():
    modules = imported_by("import sharedmp")
    assert "sharedmp" in modules and "multiprocessing" in modules
    heavy = sorted(m for m in modules if m.split(".")[0] in HEAVY)
    assert not heavy, f"import sharedmp imported {heavy[:10]}"


@pytest.mark.parametrize("first", ["frame", "pickle", "numpy-first"])
def test_arrays_travel_shared_in_a_program_that_imports_numpy_late(start_method, first):
    rc, out, err = run_bounded([sys.executable, DRIVER, start_method, first])
    assert rc == 0, err
    got = json.loads(out.splitlines()[-1])
    assert got["numpy_at_start"] is (first == "numpy-first")
    assert ("numpy" in got["waiting_at_start"]) is (first != "numpy-first")
    # Received in a process without NumPy: NumPy imported on the way, the arrays shared.
    assert got["a"] == [True, 7000.0]
    assert got["b"] == ["in a pickle", True, 30]
    assert got["back"] == [True, 45.0]          # sent once NumPy is in: shared memory
    assert "numpy" not in got["waiting_after"]
    assert "sharedmp.reductions.ndarray" not in got["waiting_after"]
    assert got["exitcode"] == 0

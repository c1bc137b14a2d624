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
    assert got["back"] == [True, 49995000.0]    # sent once NumPy is in: shared memory
    assert "numpy" not in got["waiting_after"]
    assert "sharedmp.reductions.ndarray" not in got["waiting_after"]
    assert got["exitcode"] == 0


FORKSERVER_PROGRAM = """
import sys
if __name__ == "__main__":
    import sharedmp as mp                 # (not at the top: the children would import it)
    ctx = mp.get_context("forkserver")
    for _ in range(3):
        p = ctx.Process(target=abs, args=(-1,))
        p.start()
        p.join(60)
        assert p.exitcode == 0, p.exitcode
    with ctx.Pool(2) as pool:
        assert pool.map(abs, range(-4, 0)) == [4, 3, 2, 1]
"""


def test_forkserver_children_find_sharedmp_imported_by_the_server(tmp_path):
    # Each child of a fork server imports what the server has not: sharedmp's Processes
    # add sharedmp to the server's preload list (CPython <3.14 never preloads __main__).
    script = tmp_path / "fs_children.py"
    script.write_text(FORKSERVER_PROGRAM)
    rc, _, err = run_bounded([sys.executable, "-X", "importtime", str(script)])
    assert rc == 0, err
    imports = [line.rsplit("|", 1)[1].strip() for line in err.splitlines()
               if line.startswith("import time:") and line.count("|") == 2]
    # The main process and the fork server; none of the 5 children.
    assert imports.count("sharedmp") == 2, imports.count("sharedmp")
    assert imports.count("sharedmp.channels.queues") == 2


FIRST_PROGRAM = """
import sys, warnings
warnings.simplefilter("error", RuntimeWarning)      # "NumPy support is off" fails the program
try:
    __import__(sys.argv[1])
except ModuleNotFoundError as e:
    if e.name.split(".")[0] == "sharedmp":
        raise
    print("needs", e.name)                          # (torch for hogwild, ...): not here
    raise SystemExit(0)
import numpy as np
import sharedmp as mp
from sharedmp.memory import views
a, b = mp.Pipe()
a.send(np.arange(1 << 17))                          # first array: a pickle
got = b.recv()
a.send(np.arange(1 << 17))                          # and then
again = b.recv()
print("shared", views.mapping_of(got)[1] is not None, views.mapping_of(again)[1] is not None,
      int(got.sum()), int(again.sum()))
"""


def _modules_importing_numpy():
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    for root, _, files in os.walk(os.path.join(src, "sharedmp")):
        for name in sorted(files):
            path = os.path.join(root, name)
            if name.endswith(".py") and "\nimport numpy as np\n" in open(path).read():
                rel = os.path.relpath(path, src)[:-3].replace(os.sep, ".")
                yield rel.removesuffix(".__init__")


def test_arrays_are_shared_whichever_sharedmp_module_brings_numpy_in(tmp_path):
    # A module that imports NumPy as it starts, imported first: NumPy comes in while that
    # module is half-made, and the reducers (which import it) must still be installed.
    modules = sorted(_modules_importing_numpy())
    assert "sharedmp.memory.views" in modules and "sharedmp.arrays" in modules, modules
    script = tmp_path / "first.py"
    script.write_text(FIRST_PROGRAM)
    for module in modules:
        rc, out, err = run_bounded([sys.executable, str(script), module])
        assert rc == 0, f"{module}: {err}"
        last = out.splitlines()[-1]
        total = (1 << 17) * ((1 << 17) - 1) // 2
        assert last.startswith("needs ") or last == f"shared True True {total} {total}", \
            (module, last)

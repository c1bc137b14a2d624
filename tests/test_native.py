"""Which path runs (sharedmp/native.py): the compiled core or its pure-Python twins."""
import os
import subprocess
import sys

import pytest

from sharedmp import native

REQUIRE = "SHAREDMP_REQUIRE_EXTENSIONS"     # set by CI: a compiler is there, so the build must be


def _status(**env):
    code = "import json, sharedmp.native as n; print(json.dumps(n.status()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    import json
    return json.loads(out.stdout)


def test_the_variable_selects_the_twins():
    status = _status(SHAREDMP_NO_EXTENSIONS="1")
    assert set(status) == set(native.NAMES)
    assert all(v.startswith("twin (SHAREDMP_NO_EXTENSIONS") for v in status.values()), status
    code = ("import sharedmp.native as n; print([n.load(m) for m in n.NAMES])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "SHAREDMP_NO_EXTENSIONS": "1"})
    assert out.stdout.strip() == "[None, None]" and out.stderr == "", out


def test_zero_or_empty_means_compiled_where_built():
    for value in ("0", ""):
        status = _status(SHAREDMP_NO_EXTENSIONS=value)
        assert not any("SHAREDMP_NO_EXTENSIONS" in v for v in status.values()), status


@pytest.mark.skipif(not os.environ.get(REQUIRE) or native.disabled(),
                    reason=f"{REQUIRE} not set (CI sets it: the compiled core must be built)")
def test_the_compiled_core_is_built_where_ci_asks_for_it():
    status = native.status()
    assert all(v == "compiled" for v in status.values()), status


def test_a_missing_build_is_said_once_and_the_twin_runs(tmp_path):
    # A copy of the package without its .so files: what an install without a compiler has.
    import shutil
    import sharedmp
    src = os.path.dirname(sharedmp.__file__)
    dst = tmp_path / "sharedmp"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    code = ("import sharedmp.native as n; print([n.load(m) for m in n.NAMES]); "
            "print([n.load(m) for m in n.NAMES]); print(n.status())")
    env = {k: v for k, v in os.environ.items() if k != "SHAREDMP_NO_EXTENSIONS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path, env={**env, "PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == lines[1] == "[None, None]", out.stdout
    assert "twin (not built" in lines[2]
    assert out.stderr.count("the compiled core is not installed") == 1, out.stderr

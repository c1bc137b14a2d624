"""The built wheel stands on its own: installed into a fresh venv with numpy only, it imports,
moves arrays between processes under both strategies, and the demo names its extra."""
import os
import subprocess
import sys
import venv

import pytest

from conftest import run_bounded

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ROUND_TRIP = """
import os, sys
import sharedmp as mp

def child(q, a):
    a += 1
    q.put(mp.full(1000, 7.0))

if __name__ == "__main__":
    assert "torch" not in sys.modules
    for strategy in ("file_descriptor", "file_system"):
        mp.set_sharing_strategy(strategy)
        ctx = mp.get_context("spawn")
        q, a = ctx.Queue(), mp.zeros(10)
        p = ctx.Process(target=child, args=(q, a))
        p.start()
        b = q.get(timeout=60)
        p.join(60)
        assert p.exitcode == 0 and (a == 1).all() and (b == 7).all() and mp.is_shared(b), strategy
    print("ok", sorted(os.listdir(os.path.dirname(mp.__file__)))[:3])
"""


@pytest.mark.timeout(600)
def test_the_wheel_in_a_fresh_venv_with_numpy_only(tmp_path):
    rc, out, err = run_bounded([sys.executable, "-m", "pip", "wheel", ROOT, "--no-deps", "-q",
                                "-w", str(tmp_path / "dist")], timeout=300, what="pip wheel")
    assert rc == 0, err[-3000:]
    [wheel] = os.listdir(tmp_path / "dist")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = str(env_dir / "bin" / "python")
    rc, out, err = run_bounded([py, "-m", "pip", "install", "-q", str(tmp_path / "dist" / wheel)],
                               timeout=300, what="pip install the wheel")
    assert rc == 0, err[-3000:]
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "SHAREDMP_MANAGER", "SHAREDMP_NO_EXTENSIONS")}
    script = tmp_path / "round_trip.py"
    script.write_text(ROUND_TRIP)
    rc, out, err = run_bounded([py, str(script)], timeout=120, env=env, what="the round trip")
    assert rc == 0 and out.startswith("ok"), err[-3000:]
    rc, out, err = run_bounded([py, "-c", "import importlib.util as u; print(u.find_spec('torch'))"],
                               env=env)
    assert out.strip() == "None"                       # numpy only: no torch in that venv
    rc, out, err = run_bounded([py, "-m", "sharedmp", "demo"], timeout=120, env=env, what="demo")
    assert rc == 2 and "pip install 'sharedmp[demo]'" in err, (rc, err[-2000:])
    rc, out, err = run_bounded([py, "-c", "import sharedmp, os; print(os.path.exists("
                                "os.path.join(os.path.dirname(sharedmp.__file__), 'py.typed')))"],
                               env=env)
    assert out.strip() == "True"
    # The compiled core (setup.py) is in the wheel where a compiler works: a platform wheel,
    # and the installed copy runs it.
    import shutil
    if shutil.which("gcc") or shutil.which("cc"):
        assert "-linux_" in wheel and "-py3-none-any" not in wheel, wheel
        rc, out, err = run_bounded([py, "-c", "import sharedmp.native as n; print(n.status())"],
                                   env=env)
        assert rc == 0 and out.count("'compiled'") == 2, (out, err[-2000:])


@pytest.mark.timeout(300)
def test_the_sdist_carries_the_c_sources_and_builds(tmp_path):
    """An sdist has what setup.py compiles, and a wheel builds from it (where a compiler is)."""
    import tarfile
    pytest.importorskip("setuptools", reason="making the sdist needs setuptools in this venv "
                        "(3.12's venvs have none; pip builds wheels in an isolated one)")
    rc, out, err = run_bounded([sys.executable, "setup.py", "-q", "sdist", "-d",
                                str(tmp_path / "sdist")], timeout=120, cwd=ROOT, what="sdist")
    assert rc == 0, err[-3000:]
    [sdist] = os.listdir(tmp_path / "sdist")
    with tarfile.open(tmp_path / "sdist" / sdist) as tar:
        names = tar.getnames()
    for c in ("cframe.c", "cring.c", "setup.py"):
        assert any(n.endswith(c) for n in names), (c, names)
    rc, out, err = run_bounded([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                                str(tmp_path / "wheel"), str(tmp_path / "sdist" / sdist)],
                               timeout=240, what="pip wheel from the sdist")
    assert rc == 0, err[-3000:]
    assert len(os.listdir(tmp_path / "wheel")) == 1

"""sharedmp's environment variables: read in one place, with one policy, as documented."""
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import sharedmp as mp
from sharedmp import settings
from sharedmp.memory import cache, recycle

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "sharedmp"


def _documented():
    """The variables of docs/reference.md's table, 'Environment variables'."""
    text = (ROOT / "docs" / "reference.md").read_text()
    table = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([A-Z_]+)` \|", table, re.M))


def test_the_documented_table_is_the_settings_table():
    assert _documented() == set(settings.VARIABLES)


def _reads_environment(tree):
    """Lines where a module reads (or writes) the environment."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "environb", "getenv",
                                                             "putenv", "unsetenv"):
            if isinstance(node.value, ast.Name) and node.value.id == "os":
                yield node.lineno
        if isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                a.name in ("environ", "getenv") for a in node.names):
            yield node.lineno


def test_only_the_settings_module_reads_the_environment():
    # The command line and the Hogwild trainer read variables of their own (a rank, a
    # terminal): they are applications on top of the library.
    readers = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(("cli/", "hogwild/")) or rel == "settings.py":
            continue
        lines = list(_reads_environment(ast.parse(path.read_text())))
        if lines:
            readers[rel] = lines
    assert readers == {}


@pytest.mark.parametrize("name, bad", [
    (settings.SHARING_STRATEGY, "shared"),
    (settings.CACHE_IDLE, "soon"),
    (settings.CACHE_IDLE, "-1"),
    (settings.JOBLIB_IDLE, "nan"),
    (settings.RECYCLE_BYTES, "1.5"),
    (settings.RECYCLE_BYTES, "-1"),
    (settings.WINDOW_BYTES, "0"),
    (settings.WINDOW_BYTES, "8M"),
    (settings.SPIN_US, "2e6"),
    (settings.KEEP_ORPHANS, "maybe"),
    (settings.CUDA_EXIT_TIMEOUT, "five"),     # (ignored before: one policy for all now)
    (settings.CUDA_EXIT_UNCLAIMED, "-2"),
])
def test_a_bad_value_names_the_variable_and_what_it_accepts(monkeypatch, name, bad):
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError) as e:
        settings.get(name)
    message = str(e.value)
    assert message.startswith(f"${name} must be {settings.VARIABLES[name].accepts}")
    assert repr(bad) in message


def test_unset_or_empty_means_the_default(monkeypatch):
    for name, var in settings.VARIABLES.items():
        monkeypatch.delenv(name, raising=False)
        assert settings.get(name) == var.default
        monkeypatch.setenv(name, "")
        assert settings.get(name) == var.default


def test_good_values_parse_to_their_kind(monkeypatch):
    for name, raw, value in [(settings.CACHE_IDLE, "2.5", 2.5), (settings.RECYCLE_BYTES, "0", 0),
                             (settings.WINDOW_BYTES, "65536", 65536),
                             (settings.KEEP_ORPHANS, " Yes ", True),
                             (settings.KEEP_ORPHANS, "off", False),
                             (settings.SHARING_STRATEGY, "file_system", "file_system")]:
        monkeypatch.setenv(name, raw)
        assert settings.get(name) == value


def test_export_refuses_what_children_could_not_read_back(monkeypatch):
    monkeypatch.delenv(settings.SHARING_STRATEGY, raising=False)
    with pytest.raises(ValueError):
        settings.export(settings.SHARING_STRATEGY, "bogus")
    assert settings.get(settings.SHARING_STRATEGY) == "file_descriptor"


def test_the_modules_that_keep_a_setting_raise_in_the_caller(monkeypatch):
    # cache.idle(), recycle.limit() and connection.spin_seconds() read once per process: in a
    # fresh one, a bad value raises where the first segment is made (or the first wait
    # starts), naming the variable.
    for name in (settings.CACHE_IDLE, settings.RECYCLE_BYTES, settings.SPIN_US):
        code = ("import numpy, sharedmp as mp\n"
                "a = mp.Pipe()\n"
                "a[1].poll(0.05); a[0].send(numpy.zeros(1 << 20)); a[1].recv()\n")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=60, env={**_env(), name: "bad"})
        assert proc.returncode != 0
        assert f"ValueError: ${name} must be" in proc.stderr, proc.stderr[-2000:]


def _env():
    import os
    return {k: v for k, v in os.environ.items() if not k.startswith("SHAREDMP_")}


def test_the_cached_readers_use_the_settings(monkeypatch):
    monkeypatch.setattr(cache, "_idle", None)
    monkeypatch.setattr(recycle, "_limit", None)
    monkeypatch.setenv(settings.CACHE_IDLE, "3")
    monkeypatch.setenv(settings.RECYCLE_BYTES, "4096")
    assert cache.idle() == 3.0
    assert recycle.limit() == 4096
    monkeypatch.setenv(settings.SHM_DIR, "/somewhere")
    assert mp.memory.named.shm_dir() == "/somewhere"

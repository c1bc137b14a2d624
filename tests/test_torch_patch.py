"""sharedmp's patch of torch.UntypedStorage: installed with the reducers, undone exactly.

Each check runs in a fresh interpreter, so that this test session's torch stays patched
(the other tests rely on it) and the state before sharedmp's import is torch's own.
"""
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from conftest import TIMEOUT  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TORCH_PACKAGE = ROOT / "src" / "sharedmp" / "reductions" / "torch"


def _run(code):
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


SNAPSHOT = (
    "import inspect, json, torch\n"
    "S = torch.UntypedStorage\n"
    "NAMES = ('share_memory_', 'is_shared', '_new_shared')\n"
    "def snap():\n"
    "    return {n: (id(inspect.getattr_static(S, n)), n in vars(S)) for n in NAMES}\n"
)


def test_uninstall_restores_torch_exactly():
    got = _run(SNAPSHOT + (
        "before = snap()\n"
        "import sharedmp\n"
        "from sharedmp.reductions.torch import patch\n"
        "t = torch.zeros(4)\n"
        "installed = (patch.installed(), snap() != before, t.untyped_storage().is_shared())\n"
        "sharedmp.share_memory_(t)\n"
        "seen_by_torch = t.untyped_storage().is_shared()\n"
        "patch.uninstall()\n"
        "restored = snap() == before\n"
        "patch.install()\n"
        "again = snap() != before and t.untyped_storage().is_shared()\n"
        "patch.uninstall()\n"
        "print(json.dumps([installed, seen_by_torch, restored, again, snap() == before]))\n"))
    installed, seen_by_torch, restored, again, restored_again = got
    assert installed == [True, True, False]   # patched; a plain storage is not shared
    assert seen_by_torch                       # torch's is_shared() knows sharedmp memory
    assert restored and restored_again         # the same objects, own or inherited, as before
    assert again


def test_new_shared_allocates_sharedmp_memory_while_installed():
    got = _run(SNAPSHOT + (
        "import sharedmp\n"
        "from sharedmp.reductions.torch import patch\n"
        "from sharedmp.memory import segment\n"
        "def ours(s):\n"
        "    return segment.containing(s.data_ptr(), s.nbytes())[0] is not None\n"
        "a = S._new_shared(64)\n"
        "patch.uninstall()\n"
        "b = S._new_shared(64)\n"
        "print(json.dumps([ours(a), ours(b), patch.probe()]))\n"))
    assert got == [True, False, {}]


def test_probe_names_a_new_shared_of_another_form():
    got = _run(SNAPSHOT + (
        "S._new_shared = classmethod(lambda cls, nbytes, device='cpu': None)\n"
        "before = snap()\n"
        "import sharedmp\n"
        "from sharedmp.reductions.torch import patch\n"
        "print(json.dumps([patch.probe(), snap()['_new_shared'] == before['_new_shared'],\n"
        "                  snap()['is_shared'] != before['is_shared']]))\n"))
    probe, new_shared_left, is_shared_patched = got
    assert list(probe) == ["_new_shared"] and "classmethod" in probe["_new_shared"]
    assert new_shared_left and is_shared_patched


def _defined_names():
    """Every name the sharedmp sources define (functions, classes, assigned names and
    attributes, import aliases): an ``obj._x`` with such a name is not torch's."""
    names = set()
    for path in (ROOT / "src" / "sharedmp").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name.split(".")[0])
    return names


def test_every_private_torch_api_used_is_listed():
    header = ast.get_docstring(ast.parse((TORCH_PACKAGE / "__init__.py").read_text()))
    sources = [*TORCH_PACKAGE.glob("*.py"), TORCH_PACKAGE.parent / "cuda.py"]
    used = set()
    for path in sources:
        text = path.read_text()
        used.update(re.findall(r"\.(_[a-z][a-z0-9_]*)", text))
        used.update(re.findall(r"""getattr\([^,]+,\s*["'](_[a-z][a-z0-9_]*)["']""", text))
    defined = _defined_names()
    private = sorted(n for n in used if n not in defined and not n.startswith("_sharedmp"))
    assert len(private) >= 20, private        # the scan finds them (it would find none if broken)
    missing = [n for n in private if f"{n}`" not in header]
    assert not missing, f"private torch API used but not listed in {TORCH_PACKAGE}/__init__.py: " \
                        f"{missing}"

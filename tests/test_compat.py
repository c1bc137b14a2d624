"""CPython's private multiprocessing names: used in sharedmp/_compat.py only, and still there.

The private names of multiprocessing are read off the running interpreter's own sources
(every ``_name`` defined, assigned or used in the package), so this runs on each Python the
suite runs on. A use elsewhere is an attribute ``x._name`` of one of those names that
sharedmp does not define itself (its own classes have ``_reader``, ``_after_fork``, ...), a
``super()._name`` (overriding a private method), or ``from multiprocessing... import _name``.
"""
import ast
import importlib
import inspect
import multiprocessing
import pkgutil
import sys
from pathlib import Path

import pytest

import sharedmp as mp
from sharedmp import _compat

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "sharedmp"
NOT_MULTIPROCESSING = {"os", "sys", "torch", "np", "numpy"}    # receivers of other libraries


def _private(name):
    return name.startswith("_") and not name.startswith("__")


def multiprocessing_private_names():
    names = set()
    for info in pkgutil.iter_modules(multiprocessing.__path__):
        try:
            module = importlib.import_module(f"multiprocessing.{info.name}")
        except ImportError:                # (platform modules: popen_spawn_win32, ...)
            continue
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and _private(node.name):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and _private(node.id):
                names.add(node.id)
    return names


def _trees(extra=()):
    """The package's modules, and ``extra`` (name, source) pairs read as if they were some."""
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text())
    for rel, source in extra:
        yield rel, ast.parse(source)


def sharedmp_own_names(extra=()):
    """Private names sharedmp defines: its functions, classes, module globals and the
    attributes it assigns on ``self``."""
    own = set()
    for _, tree in _trees(extra):
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id == "self"):
                own.add(node.attr)
    # _bootstrap is overridden in one place (a sharedmp def of it would hide uses elsewhere)
    return {n for n in own if _private(n)} - {"_bootstrap"}


def uses_outside_compat(extra=()):
    private = multiprocessing_private_names()
    foreign = private - sharedmp_own_names(extra)
    found = []
    for rel, tree in _trees(extra):
        if rel == "_compat.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "multiprocessing"):
                found += [f"{rel}:{node.lineno}: import {a.name}" for a in node.names
                          if _private(a.name)]
            elif isinstance(node, ast.FunctionDef) and node.name in private and node.name in (
                    "_bootstrap",):
                found.append(f"{rel}:{node.lineno}: def {node.name}")
            elif isinstance(node, ast.Attribute) and node.attr in private:
                receiver = node.value
                is_super = (isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Name)
                            and receiver.func.id == "super")
                if isinstance(receiver, ast.Name) and receiver.id in NOT_MULTIPROCESSING:
                    continue
                if is_super or node.attr in foreign:
                    found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_private_names_of_multiprocessing_are_used_in_compat_only():
    assert uses_outside_compat() == []


def test_the_rule_sees_each_kind_of_use():
    # The check itself: each form it must catch, in a module read as one of the package's.
    # (Not written into src/: ruff, run by test_architecture at the same time in another
    # worker, would find the probe's unused import there; seen in CI.)
    probe = ("from multiprocessing.forkserver import _forkserver\n"
             "def f(sem, pool):\n"
             "    return sem._semlock, pool._taskqueue\n"
             "class P:\n"
             "    def _bootstrap(self):\n"
             "        return super()._bootstrap()\n")
    found = {line.split(": ", 1)[1]
             for line in uses_outside_compat([("_probe_compat_rule.py", probe)])}
    assert {"import _forkserver", "sem._semlock", "pool._taskqueue", "def _bootstrap",
            "super()._bootstrap"} <= found


def test_what_compat_reaches_is_there_on_this_python():
    q = mp.get_context("spawn").Queue(3)
    q.put(1)
    assert _compat.semaphore_value(q._sem) == 2 and not _compat.semaphore_is_zero(q._sem)
    assert q.get(timeout=30) == 1
    q.close()
    from multiprocessing.reduction import ForkingPickler
    assert _compat.EXTRA_REDUCERS is ForkingPickler._extra_reducers  # the live dict
    assert isinstance(_compat.forkserver_preload(), list)
    assert _compat.start_method_of(mp.get_context("spawn").Process) == "spawn"
    from multiprocessing.process import BaseProcess
    assert "parent_sentinel" in inspect.signature(BaseProcess._bootstrap).parameters
    with mp.get_context("spawn").Pool(1) as pool:
        assert _compat.pool_running(pool)
        assert [p.pid for p in _compat.pool_workers(pool)] != [None]
    assert not _compat.pool_running(pool)
    assert sys.version_info[:2] in [tuple(map(int, v.split("."))) for v in _compat.CHECKED]


def test_pool_still_uses_the_queue_attributes_ours_provide():
    source = inspect.getsource(importlib.import_module("multiprocessing.pool"))
    for name in _compat.POOL_QUEUE_ATTRIBUTES:
        assert f"queue.{name}" in source, name      # (self._inqueue._writer, ...)
    q = mp.get_context("spawn").Queue()
    for name in _compat.POOL_QUEUE_ATTRIBUTES:
        assert hasattr(q, name)
    q.close()


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_child_start_hooks_run_in_the_child(method):
    # set in the child by the hooks: the strategy, under every start method
    ctx = mp.get_context(method)
    old = mp.get_sharing_strategy()
    # The fork server (one per program) keeps the environment it started with, which the
    # standard library's forkserver children use: started here before the switch, it never
    # has this test's strategy.
    first = ctx.Process(target=_report_strategy, args=(ctx.SimpleQueue(),))
    first.start()
    first.join(60)
    mp.set_sharing_strategy("file_system")
    p = None
    try:
        q = ctx.SimpleQueue()
        p = ctx.Process(target=_report_strategy, args=(q,))
        p.start()
        p.join(60)
        assert p.exitcode == 0
        assert q.get() == "file_system"
    finally:
        mp.set_sharing_strategy(old)
        if p is not None and p.is_alive():
            p.kill()


def _report_strategy(q):
    q.put(mp.get_sharing_strategy())

"""Types: mypy passes on the package (config in pyproject.toml: strict on the public modules),
and every public name sharedmp defines has annotations, so a new one without them fails here.
"""
import importlib
import inspect
import multiprocessing
import os
import subprocess
import sys
import time

import pytest

import sharedmp as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The modules mypy checks strictly (pyproject.toml, [[tool.mypy.overrides]]), but sharedmp itself.
PUBLIC_MODULES = [
    "sharedmp.arrays", "sharedmp.strategy", "sharedmp.errors", "sharedmp.processes.context",
    "sharedmp.channels.queues", "sharedmp.channels.connection", "sharedmp.processes.spawn",
    "sharedmp.memory.cache", "sharedmp.training", "sharedmp.distributed", "sharedmp.joblib",
]
NEEDS_TORCH = {"sharedmp.training", "sharedmp.distributed"}
# Dunder methods that are part of an API (the others are pickling and repr plumbing).
API_DUNDERS = {"__init__", "__call__", "__enter__", "__exit__"}


@pytest.mark.slow        # (.ci/run: 3.11 only; mypy checks as 3.11 whichever Python runs it)
@pytest.mark.timeout(600)
def test_mypy_passes():
    """`python -m mypy` from the repository root (its first run over torch's stubs takes a while)."""
    pytest.importorskip("mypy")
    t0 = time.monotonic()
    # The cache lives in .mypy_cache (ignored by git): later runs take a second. One per
    # interpreter: .ci/run runs the suites of several at once in one clone, each environment
    # with its own packages (torch in one), and a shared cache crashed mypy (INTERNAL ERROR).
    cache = os.path.join(ROOT, ".mypy_cache", "py%d%d" % sys.version_info[:2])
    try:
        done = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", cache], cwd=ROOT,
                              capture_output=True, text=True, timeout=540)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"mypy did not finish within {e.timeout} s:\n{e.stdout or ''}{e.stderr or ''}",
                    pytrace=False)
    assert done.returncode == 0, (f"mypy failed (exit status {done.returncode}, "
                                  f"{time.monotonic() - t0:.0f} s):\n{done.stdout}{done.stderr}")


def _missing(fn, skip_first=False):
    """The names of ``fn``'s parameters (and "return") that have no annotation."""
    try:
        sig = inspect.signature(fn)          # annotations as written: strings are not evaluated
    except (TypeError, ValueError):          # a builtin without a signature
        return []
    params = list(sig.parameters.values())
    if skip_first and params and params[0].name in ("self", "cls"):
        params = params[1:]
    missing = [p.name for p in params if p.annotation is inspect.Parameter.empty]
    if sig.return_annotation is inspect.Signature.empty:
        missing.append("return")
    return missing


def _ours(obj):
    return getattr(obj, "__module__", "").split(".")[0] == "sharedmp"


def _unannotated(name, obj):
    """'name: params' for ``obj`` (a function, or a class: its API methods) where annotations lack."""
    out = []
    if inspect.isclass(obj):
        for cls in obj.__mro__:
            if not _ours(cls):
                continue                     # multiprocessing's, object's, ...
            for attr, value in vars(cls).items():
                if attr.startswith("_") and attr not in API_DUNDERS:
                    continue
                if isinstance(value, (staticmethod, classmethod)):
                    missing = _missing(value.__func__, skip_first=isinstance(value, classmethod))
                elif isinstance(value, property):
                    missing = _missing(value.fget, skip_first=True)
                elif inspect.isfunction(value):
                    missing = _missing(value, skip_first=True)
                else:
                    continue                 # constants, nested classes (checked on their own)
                if missing:
                    out.append(f"{name}.{attr} ({cls.__qualname__}): {', '.join(missing)}")
    elif callable(obj):
        missing = _missing(obj)
        if missing:
            out.append(f"{name}: {', '.join(missing)}")
    return out


def test_public_names_are_annotated():
    """What ``sharedmp.__all__`` adds to multiprocessing's names (and sharedmp's own versions of
    multiprocessing's, such as Queue and Process), and the classes their results are."""
    names = {}
    for name in mp.__all__:
        obj = getattr(mp, name)
        if obj is getattr(multiprocessing, name, None) or not _ours(obj):
            continue                         # the standard object, re-exported as it is
        names[name] = obj
    # What mp.Queue(), mp.Pipe(), mp.get_context() return: public through them.
    from sharedmp.channels import connection, queues
    from sharedmp.processes import context
    for cls in (queues.Queue, queues.JoinableQueue, queues.SimpleQueue, connection.Connection,
                context.ForkContext, context.SpawnContext, context.ForkServerContext):
        names[f"{cls.__module__}.{cls.__qualname__}"] = cls
    assert {"Queue", "Pipe", "Process", "get_context", "zeros", "share", "spawn",
            "empty_cache"} <= set(names)
    problems = [p for name, obj in sorted(names.items()) for p in _unannotated(name, obj)]
    assert not problems, "public names without annotations:\n" + "\n".join(problems)


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_public_modules_are_annotated(module_name):
    """Every public function and class defined in the strictly checked modules."""
    if module_name in NEEDS_TORCH:
        pytest.importorskip("torch")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            pytest.skip(f"{module_name} does not exist (yet)")
        if e.name is not None and not e.name.startswith("sharedmp"):
            pytest.skip(f"{module_name} needs {e.name}")
        raise
    problems = []
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module_name:
            continue                         # private, or imported from elsewhere
        if inspect.isfunction(obj) or inspect.isclass(obj):
            problems += _unannotated(f"{module_name}.{name}", obj)
    assert not problems, "public names without annotations:\n" + "\n".join(problems)

"""Which path runs: the compiled core (``sharedmp._cframe``, ``sharedmp._cring``; plain C,
setup.py) or its pure-Python twins, the reference.

``SHAREDMP_NO_EXTENSIONS=1`` selects the twins (read when a module that has a twin is
imported), as multidict's and msgpack's variables do; so does an install where no compiler
worked (said once, on stderr, the first time a compiled module is looked for).
``status()`` is what ``doctor`` prints.
"""
from __future__ import annotations

import importlib
import sys
from types import ModuleType

from . import settings

ENV = settings.NO_EXTENSIONS
NAMES = ("_cframe", "_cring")
_loaded: dict[str, ModuleType | None] = {}
_said = False


def disabled() -> bool:
    """Whether the twins were asked for ($SHAREDMP_NO_EXTENSIONS; a bad value raises
    ValueError naming the variable)."""
    return bool(settings.get(ENV))


def load(name: str) -> ModuleType | None:
    """The compiled module ``sharedmp.<name>``, or None where the twin runs."""
    if name in _loaded:
        return _loaded[name]
    module = None
    if not disabled():
        try:
            module = importlib.import_module(f"sharedmp.{name}")
        except ImportError as e:
            _say_once(name, e)
    _loaded[name] = module
    return module


def _say_once(name: str, e: ImportError) -> None:
    global _said
    if not _said:
        _said = True
        print(f"sharedmp: the compiled core is not installed ({name}: {e}); the pure-Python "
              f"path runs (slower for small messages). Reinstall where a C compiler works, "
              f"or set {ENV}=1 to say this is intended.", file=sys.stderr)


def status() -> dict[str, str]:
    """name -> 'compiled', 'twin (SHAREDMP_NO_EXTENSIONS)' or 'twin (not built: why)'."""
    out = {}
    for name in NAMES:
        if disabled():
            out[name] = f"twin ({ENV})"
            continue
        try:
            importlib.import_module(f"sharedmp.{name}")
            out[name] = "compiled"
        except ImportError as e:
            out[name] = f"twin (not built: {e})"
    return out

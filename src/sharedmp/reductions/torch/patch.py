"""torch's own ``UntypedStorage.share_memory_`` / ``is_shared`` / ``_new_shared``, made
aware of sharedmp memory; ``install()`` once torch's reducers are replaced, ``uninstall()``
puts torch's own back exactly.

- ``share_memory_``: a storage that sharedmp shares is shared already. torch would copy it
  into its own shared memory on ``model.share_memory()``, silently cutting it off from the
  other processes.
- ``is_shared``: True for sharedmp memory too.
- ``_new_shared`` (where DataLoader workers collate each batch): torch's makes a
  shared-memory file per tensor (an fd to pass, a mapping to make and unmap at each end);
  sharedmp's carves it from an arena (one fd per arena per message).

Private torch API this module relies on, each probed by ``probe()`` before it is touched:
``UntypedStorage._new_shared`` (a classmethod taking ``(size, *, device)``). The rest of
the torch package's private uses are listed in ``reductions/torch/__init__.py``.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from ...memory import segment
from .storage import TORCH_SHARE_MEMORY_, is_cpu_storage, new_shared_storage, storage_is_shared

_Storage = torch.UntypedStorage
_NAMES = ("share_memory_", "is_shared", "_new_shared")
_saved: dict[str, Any] = {}          # name -> torch's own entry in UntypedStorage.__dict__
_torch_new_shared: Any = None        # the function of torch's _new_shared classmethod


def probe() -> dict[str, str]:
    """{name: why it cannot be patched} for the names of ``_NAMES`` this torch lacks or
    has in another form; the others are patched."""
    missing = {}
    for name in _NAMES:
        if name not in vars(_Storage) and not hasattr(_Storage, name):
            missing[name] = "torch.UntypedStorage has no such attribute"
    new_shared = inspect.getattr_static(_Storage, "_new_shared", None)
    if "_new_shared" not in missing:
        try:
            params = inspect.signature(new_shared.__func__).parameters
            ok = isinstance(new_shared, classmethod) and list(params)[:2] == ["cls", "size"] \
                and "device" in params and params["device"].kind is inspect.Parameter.KEYWORD_ONLY
        except (AttributeError, TypeError, ValueError):
            ok = False
        if not ok:
            missing["_new_shared"] = "not a classmethod (cls, size, *, device)"
    return missing


def _share_memory_(self: torch.UntypedStorage, *args: Any, **kwargs: Any) -> Any:
    if is_cpu_storage(self):
        nbytes = self.nbytes()
        if nbytes and segment.containing(self.data_ptr(), nbytes)[0] is not None:
            return self
    return TORCH_SHARE_MEMORY_(self, *args, **kwargs)


def _is_shared(self: torch.UntypedStorage) -> bool:
    """Whether the storage is in shared memory (torch's or sharedmp's)."""
    return storage_is_shared(self)


def _new_shared(cls: type, size: int, *, device: Any = "cpu") -> torch.UntypedStorage:
    if cls is torch.UntypedStorage and size > 0 and torch.device(device).type == "cpu":
        return new_shared_storage(size)
    storage: torch.UntypedStorage = _torch_new_shared(cls, size, device=device)
    return storage


def installed() -> bool:
    return bool(_saved)


def install() -> dict[str, str]:
    """Patch what ``probe()`` allows (once); returns what it left as torch has it, and why."""
    skipped = probe()
    if _saved:
        return skipped
    for name in _NAMES:
        if name not in skipped:
            _saved[name] = vars(_Storage).get(name, _MISSING)
    global _torch_new_shared
    if "share_memory_" in _saved:
        setattr(_Storage, "share_memory_",
                functools.wraps(getattr(_Storage, "share_memory_"))(_share_memory_))
    if "is_shared" in _saved:
        setattr(_Storage, "is_shared", _is_shared)
    if "_new_shared" in _saved:
        _torch_new_shared = inspect.getattr_static(_Storage, "_new_shared").__func__
        setattr(_Storage, "_new_shared",
                classmethod(functools.wraps(_torch_new_shared)(_new_shared)))
    return skipped


def uninstall() -> None:
    """Put torch's own attributes back, as they were before ``install()``."""
    for name, value in _saved.items():
        if value is _MISSING:
            delattr(_Storage, name)          # it was inherited: inherit it again
        else:
            setattr(_Storage, name, value)
    _saved.clear()


_MISSING = object()

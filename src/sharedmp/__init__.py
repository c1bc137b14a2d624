"""sharedmp: multiprocessing with arrays in shared memory, for every array library.

``import sharedmp as mp`` offers every name of ``multiprocessing`` with the same
meaning, plus the sharing strategies, shared NumPy allocation and torch-style helpers.
Importing it registers the reducers with ``ForkingPickler``; it imports neither NumPy nor
torch (their reducers are registered once they are imported: ``registry.py``), and the
array functions (``empty``, ``share``, ...: ``arrays.py``) import NumPy on first use.
"""
import importlib as _importlib
import multiprocessing as _multiprocessing
from multiprocessing import *  # noqa: F401,F403  -- the standard surface, unchanged
from typing import TYPE_CHECKING, Any

from . import cuda as _cuda  # noqa: F401  -- its fork hook: a child knows CUDA was initialised
from . import registry as _registry
# (mypy keeps multiprocessing's types for the names below, as torch.multiprocessing's users see
# them: ``q: mp.Queue`` stays a valid annotation; sharedmp's Queues are functions.)
from .processes.context import (  # type: ignore[assignment]
    JoinableQueue, Pipe, Pool, Process, Queue, SimpleQueue, get_context)
from .errors import CudaError, ManagerError, OutOfSharedMemory, ProtocolError, SegmentError
from .errors import ProcessException, ProcessExitedException, ProcessRaisedException
from .memory.cache import empty as empty_cache
from .strategy import get_all_sharing_strategies, get_sharing_strategy, set_sharing_strategy

__version__ = "0.1.0"

if TYPE_CHECKING:   # mypy reads multiprocessing's names from here (it cannot evaluate list())
    from multiprocessing import __all__ as __all__
else:
    __all__ = list(_multiprocessing.__all__)
__all__ += [
    "get_all_sharing_strategies", "get_sharing_strategy", "set_sharing_strategy",
    "empty", "zeros", "full", "empty_like", "zeros_like", "share", "share_memory_", "is_shared",
    "empty_cache", "SharedList", "SharedDict", "share_dataset",
    "OutOfSharedMemory", "SegmentError", "ProtocolError", "ManagerError", "CudaError",
    "spawn", "start_processes", "ProcessContext",
    "ProcessException", "ProcessRaisedException", "ProcessExitedException",
]

_registry.install()


def init_reductions() -> None:
    """torch.multiprocessing's name for registering the reducers: done on import already."""
    _registry.install()

# torch.multiprocessing's helpers that its own tests use; forwarded (torch imported on use).
_TORCH_HELPERS = ("_set_thread_name", "_get_thread_name")
# Imported on first use, so that `import sharedmp` stays light: {name: its module}. arrays.py
# imports NumPy; processes/spawn.py logging and concurrent.futures; datasets/ NumPy.
_LAZY = dict.fromkeys(("empty", "empty_like", "full", "is_shared", "share", "share_memory_",
                       "zeros", "zeros_like"), "arrays")
_LAZY.update(dict.fromkeys(("SharedList", "SharedDict", "share_dataset"), "datasets"))
_LAZY.update(dict.fromkeys(("spawn", "start_processes", "ProcessContext",
                            "SpawnContext",               # torch's old name (not in __all__)
                            "ENV_VAR_PARALLEL_START"),    # (not in __all__, as in torch)
                           "processes.spawn"))


if TYPE_CHECKING:
    # What __getattr__ forwards; mypy does not see __getattr__ (it would make any name of
    # sharedmp valid).
    from torch.multiprocessing import _get_thread_name as _get_thread_name
    from torch.multiprocessing import _set_thread_name as _set_thread_name

    from .arrays import (empty, empty_like, full, is_shared, share, share_memory_, zeros,
                         zeros_like)
    from .datasets import SharedDict, SharedList, share_dataset
    from .processes.spawn import ENV_VAR_PARALLEL_START as ENV_VAR_PARALLEL_START
    from .processes.spawn import ProcessContext, spawn, start_processes
    from .processes.spawn import SpawnContext as SpawnContext
else:
    def __getattr__(name: str) -> Any:
        if name in _LAZY.values():     # a module of lazy names is lazy too (``mp.arrays``)
            return _importlib.import_module(f"{__name__}.{name}")
        if name in _LAZY:
            module = _importlib.import_module(f"{__name__}.{_LAZY[name]}")
            for n, where in _LAZY.items():
                if where == _LAZY[name]:
                    globals()[n] = getattr(module, n)
            return globals()[name]
        if name in _TORCH_HELPERS:
            try:
                import torch.multiprocessing
            except ImportError:
                raise AttributeError(f"sharedmp.{name} is torch.multiprocessing's: install torch "
                                     "(pip install 'sharedmp[torch]')") from None
            return getattr(torch.multiprocessing, name)
        raise AttributeError(f"module 'sharedmp' has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*globals(), *_LAZY})

"""CUDA arrays across processes: whether CUDA is initialised here, and in a forked child,
whether it was in the parent at the fork.

The mechanism itself lives in submodules, imported only when a CUDA tensor or a CuPy
array is met: ``driver`` (every cuda-bindings call), ``lease`` (the sender keeps memory
alive until each receiver has let go), ``ipc`` (what an array becomes on the wire, the
sender's exports and the receiver's mappings). This module stays light (the stdlib
only): its fork hook runs before every fork.

Forking a process in which CUDA is initialised is allowed, as torch allows it: the model
on the GPU, CPU workers forked for data or environments, is an everyday pattern. Such a
child cannot use CUDA (the driver's state does not survive a fork), so sending or
receiving a CUDA array there raises ``RuntimeError`` naming spawn and forkserver, before
any CUDA call (``check_not_forked``), where CUDA itself would fail or hang.
"""
import os
import sys

from .. import forks, host

CUDA_ERROR_NOT_INITIALIZED = 3

# Modules other than torch (which says itself whether it has initialised CUDA) through which
# a process may have initialised CUDA: only with one of them imported does the fork hook probe
# the driver (it reads /proc/self/maps: 130 us in a process with torch). Without them (a CPU
# program, a torch program) it costs a dictionary lookup per name.
_CUDA_MODULES = ("cupy", "cuda", "numba", "pycuda", "jax", "tensorflow", "sharedmp.cuda.driver")

_FORKED_ERROR = ("CUDA arrays cannot be sent or received in this process: it was forked from "
                 "one in which CUDA was initialised ({}), and a forked child cannot use CUDA. "
                 "Start the processes that use CUDA with the 'spawn' or 'forkserver' start "
                 "method: mp.get_context('spawn').Process(...), or "
                 "mp.set_start_method('spawn') first thing in the program.")

_forked_from = None     # (in a forked child) who had initialised CUDA in the parent, else None
_at_fork = None         # (the forking process) what the child will inherit as _forked_from


def _driver_initialised():
    """Whether this process has called cuInit (libcuda loaded and answering)."""
    if sys.modules.get("sharedmp.cuda.driver") is not None \
            and sys.modules["sharedmp.cuda.driver"].initialised():
        return True
    # vLLM's probe (vllm#32611): libcuda mapped, and cuDeviceGetCount says anything but
    # NOT_INITIALIZED. It also catches CuPy, pynvml and anything else that called cuInit.
    # Loading the already-mapped library initialises nothing.
    try:
        if not any("libcuda.so" in line for line in host.maps_lines("self")):
            return False
        import ctypes          # (only where libcuda is loaded)
        lib = ctypes.CDLL("libcuda.so.1", mode=getattr(os, "RTLD_NOLOAD", 4))
    except OSError:
        return False
    count = ctypes.c_int(0)
    return lib.cuDeviceGetCount(ctypes.byref(count)) != CUDA_ERROR_NOT_INITIALIZED


def cuda_initialized() -> str | None:
    """Who initialised CUDA in this process ("torch", "cupy", "the CUDA driver"), or None."""
    if _torch_initialized():
        return "torch"
    if _driver_initialised():
        return "cupy" if "cupy" in sys.modules else "the CUDA driver"
    return None


def check_not_forked() -> None:
    """Raise RuntimeError if this process was forked from one that had initialised CUDA
    (or from such a child): called before any CUDA call of a send or a receive."""
    if _forked_from is not None:
        raise RuntimeError(_FORKED_ERROR.format(f"by {_forked_from}"))


def _torch_initialized() -> bool:
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        return cuda is not None and bool(cuda.is_initialized())
    except Exception:              # a half-imported torch: the driver probe decides
        return False


def _before_fork() -> None:
    global _at_fork
    _at_fork = _forked_from
    if _at_fork is None:
        if _torch_initialized():
            _at_fork = "torch"
        elif any(m in sys.modules for m in _CUDA_MODULES):
            _at_fork = cuda_initialized()


def _after_fork_in_child() -> None:
    global _forked_from
    _forked_from = _at_fork


forks.before(_before_fork)
forks.in_child(_after_fork_in_child)

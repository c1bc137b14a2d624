"""CUDA arrays across processes: the probe that says whether CUDA is initialised here.

The mechanism itself lives in submodules, imported only when a CUDA tensor or a CuPy
array is met: ``driver`` (every cuda-bindings call), ``lease`` (the sender keeps memory
alive until each receiver has let go), ``ipc`` (what an array becomes on the wire, the
sender's exports and the receiver's mappings). This module stays light (the stdlib
only): the fork contexts ask it before every fork.
"""
import os
import sys

CUDA_ERROR_NOT_INITIALIZED = 3

_FORK_ERROR = ("cannot fork a process in which CUDA is initialised ({}): a forked child "
               "cannot use CUDA and would fail or hang at its first CUDA call. Use the "
               "'spawn' or 'forkserver' start method: mp.get_context('spawn').")


def _driver_initialised():
    """Whether this process has called cuInit (libcuda loaded and answering)."""
    if sys.modules.get("sharedmp.cuda.driver") is not None \
            and sys.modules["sharedmp.cuda.driver"].initialised():
        return True
    # vLLM's probe (vllm#32611): libcuda mapped, and cuDeviceGetCount says anything but
    # NOT_INITIALIZED. It also catches CuPy, pynvml and anything else that called cuInit.
    # Loading the already-mapped library initialises nothing.
    try:
        with open("/proc/self/maps") as f:
            if "libcuda.so" not in f.read():
                return False
        import ctypes          # (only where libcuda is loaded)
        lib = ctypes.CDLL("libcuda.so.1", mode=getattr(os, "RTLD_NOLOAD", 4))
    except OSError:
        return False
    count = ctypes.c_int(0)
    return lib.cuDeviceGetCount(ctypes.byref(count)) != CUDA_ERROR_NOT_INITIALIZED


def cuda_initialized() -> str | None:
    """Who initialised CUDA in this process ("torch", "cupy", "the CUDA driver"), or None."""
    torch = sys.modules.get("torch")
    if torch is not None:
        cuda = getattr(torch, "cuda", None)
        try:
            if cuda is not None and cuda.is_initialized():
                return "torch"
        except Exception:          # a half-imported torch: fall through to the driver probe
            pass
    if _driver_initialised():
        return "cupy" if "cupy" in sys.modules else "the CUDA driver"
    return None


def check_fork() -> None:
    """Raise RuntimeError, before forking, if CUDA is initialised in this process."""
    who = cuda_initialized()
    if who is not None:
        raise RuntimeError(_FORK_ERROR.format(f"by {who}"))

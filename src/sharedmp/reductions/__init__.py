"""What a value becomes on the wire: reduce/rebuild pairs, one module per kind of value.

    segment.py   a segment's handle: its fd (in band or DupFd) or its name
    ndarray.py   NumPy arrays: pickled, or a fixed header for an array sent alone
    torch/       torch CPU tensors and storages (imported once torch is)
    cuda.py      torch CUDA tensors and CuPy arrays, by CUDA IPC
    polars.py    Polars frames and series, as Arrow (whose buffers go out of band: wire.py)

Nothing is registered here: ``sharedmp/registry.py`` holds the table and installs it.

torch.multiprocessing.reductions' own functions (``rebuild_cuda_tensor``, ``reduce_tensor``,
...) are forwarded to torch as ``mp.reductions.<name>``: code written for torch calls them
on torch's private tuples (``storage._share_cuda_()``), which only torch understands.
"""

# torch.multiprocessing.reductions' names besides reduce_* and rebuild_* that its users reach for.
_TORCH_NAMES = ("StorageWeakRef", "SharedCache", "shared_cache", "fd_id", "storage_from_cache")


def __getattr__(name):
    if name.startswith(("rebuild_", "reduce_")) or name in _TORCH_NAMES:
        try:
            import torch.multiprocessing.reductions as torch_reductions
        except ImportError:
            raise AttributeError(f"sharedmp.reductions.{name} is torch.multiprocessing's: "
                                 "install torch (pip install 'sharedmp[torch]')") from None
        if hasattr(torch_reductions, name):
            return getattr(torch_reductions, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

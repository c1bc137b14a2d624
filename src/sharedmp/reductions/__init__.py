"""What a value becomes on the wire: reduce/rebuild pairs, one module per kind of value.

    segment.py   a segment's handle: its fd (in band or DupFd) or its name
    ndarray.py   NumPy arrays: pickled, or a fixed header for an array sent alone
    torch/       torch CPU tensors and storages (imported once torch is)
    cuda.py      torch CUDA tensors and CuPy arrays, by CUDA IPC

Nothing is registered here: ``sharedmp/registry.py`` holds the table and installs it.
"""

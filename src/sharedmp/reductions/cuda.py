"""torch CUDA tensors and CuPy arrays on the wire, by CUDA IPC (``sharedmp.cuda``).

Imported only when one is met: ``reductions/torch/tensors.py`` hands CUDA tensors and
storages here; the registry (``sharedmp/registry.py``) installs ``reduce_cupy_array`` once
CuPy is imported. This module imports neither torch nor CuPy itself.

A torch tensor travels as its storage's region (``cuda.ipc.Descriptor``) plus dtype,
storage offset, shape, strides and autograd flags; a CuPy array as the region of its
memory (``arr.data.mem``) plus dtype, shape, byte strides (negative too) and the
array's byte offset in that memory. The receiver gets:

- a torch tensor over a storage made by ``torch.as_tensor`` from an owner whose
  ``__cuda_array_interface__`` is the region as ``|u1`` (torch keeps the owner until the
  storage dies), viewed with ``set_`` (so bf16 and every other dtype work);
- a CuPy array over ``UnownedMemory(ptr, nbytes, owner, device)``.

The owner keeps the ``Holder``, whose death releases the region to its sender. Received
again while alive: the same storage (torch) or memory (CuPy); received back in the
process that sent it: the original storage / memory; sent on: forwarded (``ipc``).
Without the ``cuda`` extra, torch CUDA tensors fall back to torch's own reducers (one
warning); CuPy arrays need it.

Every reduce and rebuild starts with ``check_not_forked()``: in a child forked from a
process that had initialised CUDA, it raises naming spawn, before any CUDA call.
"""
import warnings

from ..cuda import check_not_forked, ipc

_fallback_warned = False


def _export(ordinal, ptr, nbytes, stream, obj):
    """The wire descriptor of a region: forwarded if it was received here, else exported."""
    check_not_forked()
    imp = ipc._importer
    holder = imp.received(ordinal, ptr, nbytes) if imp is not None else None
    if holder is not None:
        return ipc.exporter().forward(holder, stream, imp.fds_of(holder)).encode()
    return ipc.exporter().export(ordinal, ptr, nbytes, stream, obj).encode()


def _home(d):
    """The original object if ``d`` came back to the process that exported it, else None."""
    check_not_forked()                    # (every receive passes here first)
    if d.owner != ipc.nonce():
        return None
    exp = ipc.exporter()
    obj = exp.home(d)
    if d.lease == exp.server.address:
        exp.release_own(d)                # never claimed: it never left this process
    else:                                 # forwarded back to us: release the forwarder's lease
        client = ipc.importer().client
        client.claim(d.lease, d.token)
        client.release(d.lease, d.token)
    if obj is None:
        raise RuntimeError("a CUDA array came back to the process that sent it, but that "
                           "memory is no longer held here: the message is stale or corrupt")
    return obj


# ---------------------------------------------------------------------------------------
# torch
# ---------------------------------------------------------------------------------------

def _torch_stream(ordinal):
    import torch
    return torch.cuda.current_stream(ordinal).cuda_stream


class _TorchOwner:
    """What ``torch.as_tensor`` keeps for the storage's life: the region as CUDA array
    interface."""

    __slots__ = ("holder", "__cuda_array_interface__")

    def __init__(self, holder, nbytes):
        self.holder = holder
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "version": 3,
                                         "data": (holder.ptr, False), "strides": None,
                                         "stream": None}


def _torch_fallback():
    """Whether torch's own reducers must be used (no cuda-bindings here; warns once)."""
    global _fallback_warned
    from ..cuda import driver
    if driver._cu is not None:
        return False
    if not _fallback_warned:
        _fallback_warned = True
        warnings.warn("sharedmp: CUDA tensors use torch's own sharing (the sender must keep them "
                      "alive until received and released): install sharedmp[cuda] (cuda-bindings) "
                      "for sharedmp's, which keeps them alive for you", RuntimeWarning,
                      stacklevel=3)
    return True


def _storage_wire(storage):
    nbytes = storage.nbytes()
    ordinal = storage.device.index
    if nbytes == 0:
        return ("empty", ordinal)
    return _export(ordinal, storage.data_ptr(), nbytes, _torch_stream(ordinal), storage)


def reduce_torch_tensor(t):
    """A strided CUDA tensor (autograd checks are done by ``reductions.torch``)."""
    import torch
    import torch.multiprocessing.reductions as torch_reductions

    from .torch.codes import dtype_code, flags_of
    check_not_forked()
    if _torch_fallback():
        return torch_reductions.reduce_tensor(t)
    cls = type(t)
    return rebuild_torch_cuda_tensor, (_storage_wire(t.untyped_storage()), dtype_code(t.dtype),
                                       t.storage_offset(), tuple(t.shape), t.stride(),
                                       flags_of(t, cls),
                                       None if cls in (torch.Tensor, torch.nn.Parameter) else cls)


def reduce_torch_storage(storage):
    import torch.multiprocessing.reductions as torch_reductions
    check_not_forked()
    if _torch_fallback():
        return torch_reductions.reduce_storage(storage)
    return rebuild_torch_cuda_storage, (_storage_wire(storage),)


def rebuild_torch_cuda_storage(wire):
    import torch
    check_not_forked()
    if type(wire) is tuple and len(wire) == 2 and wire[0] == "empty":
        return torch.UntypedStorage(0, device=torch.device("cuda", wire[1]))
    d = ipc.Descriptor.decode(wire)
    home = _home(d)
    if home is not None:
        return home
    imp = ipc.importer()
    storage = imp.cached(d, "torch")
    if storage is None:
        holder = imp.open(d, _torch_stream)
        t = torch.as_tensor(_TorchOwner(holder, d.nbytes),
                            device=torch.device("cuda", holder.ordinal))
        storage = t.untyped_storage()
        imp.remember(d, "torch", storage)
    return storage


def rebuild_torch_cuda_tensor(wire, dtype, storage_offset, size, stride, flags, cls):
    import torch

    from .torch.codes import dtype_of, finish
    storage = rebuild_torch_cuda_storage(wire)
    t = torch.empty((0,), dtype=dtype_of(dtype), device=storage.device)
    t.set_(storage, storage_offset, size, stride)
    return finish(t, flags, cls) if flags or cls else t


# ---------------------------------------------------------------------------------------
# CuPy
# ---------------------------------------------------------------------------------------

def _cupy_stream(ordinal):
    import cupy
    with cupy.cuda.Device(ordinal):
        return cupy.cuda.get_current_stream().ptr


def reduce_cupy_array(a):
    check_not_forked()
    mem = a.data.mem
    ordinal = a.device.id
    offset = a.data.ptr - mem.ptr
    if mem.size == 0 or mem.ptr == 0:
        return rebuild_cupy_empty, (a.shape, a.dtype, ordinal)
    return rebuild_cupy_array, (_export(ordinal, mem.ptr, mem.size, _cupy_stream(ordinal), mem),
                                a.dtype, a.shape, a.strides, offset)


def rebuild_cupy_empty(shape, dtype, ordinal):
    import cupy
    check_not_forked()
    with cupy.cuda.Device(ordinal):
        return cupy.empty(shape, dtype)


def rebuild_cupy_array(wire, dtype, shape, strides, offset):
    import cupy
    d = ipc.Descriptor.decode(wire)
    home = _home(d)
    if home is not None:
        mem = home
    else:
        imp = ipc.importer()
        holder = imp.cached(d, "cupy")
        if holder is None:
            holder = imp.open(d, _cupy_stream)
            imp.remember(d, "cupy", holder)
        mem = cupy.cuda.UnownedMemory(holder.ptr, d.nbytes, holder, holder.ordinal)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, offset), strides)

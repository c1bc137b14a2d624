"""PyTorch CPU tensors and storages on the wire, with torch.multiprocessing's semantics.

Imported only once torch is; the registry (``sharedmp/registry.py``) then installs
``reducers()`` and the tensor frame kind in ``ForkingPickler`` over torch's own, so that
every tensor pickled by sharedmp's channels or by the standard ones goes through sharedmp.

Where a CPU storage's bytes live decides how it travels:

=============================== ======================================================
sharedmp memory (data pointer   the segment (fd in band on sharedmp channels, DupFd
inside a sharedmp mapping)      elsewhere, or the name) + offset + nbytes; the receiver
                                views its mapping of the segment (``torch.frombuffer``)
shared by torch itself          torch's own handle, no copy: the fd of
(``Tensor.share_memory_()``,    ``_get_shared_fd()`` (in band / DupFd), rebuilt by
DataLoader workers' collate)    ``_new_shared_fd_cpu``; or the name of
                                ``_share_filename_cpu_()``, rebuilt by
                                ``_new_shared_filename_cpu``
anywhere else                   moved into sharedmp memory in place first
                                (``storage.py``), then as the first row
=============================== ======================================================

Autograd, as torch.multiprocessing: a ``Parameter`` stays a ``Parameter`` (an integer
one with ``requires_grad=False`` too), ``requires_grad`` is kept, ``.grad`` and hooks
are not sent (hooks warn, as torch does), a non-leaf tensor that requires grad raises.
Meta tensors travel by value, sparse tensors as their index and value tensors, nested
ones as their buffer and metadata tensors. Devices other than the CPU use torch's own
reducers, except CUDA tensors (by CUDA IPC, ``reductions/cuda.py``).
"""
import os
import struct
from multiprocessing.reduction import DupFd
from typing import Any, Callable

import torch
import torch.multiprocessing.reductions as _torch_reductions
from torch.nn.parameter import Parameter

from ... import wire
from ...errors import ProtocolError, SegmentError
from ...memory import segment
from .codes import (CONJ, DTYPE_CODE, DTYPES, NEG, NON_LEAF, PARAMETER, REQUIRES_GRAD,
                    dtype_code, dtype_of, finish, flags_of, sparse_parts)
from .storage import frombuffer, is_cpu_storage, place, recall, remember, tensor_over

_strided = torch.strided
_uint8 = torch.uint8

# ---------------------------------------------------------------------------------------
# Storages: reduce / rebuild pairs.
# ---------------------------------------------------------------------------------------

def reduce_storage(storage):
    if not is_cpu_storage(storage):
        if storage.device.type == "cuda":                  # by CUDA IPC, with leases
            from .. import cuda
            return cuda.reduce_torch_storage(storage)
        return _torch_reductions.reduce_storage(storage)   # meta & co: torch's (it refuses)
    nbytes = storage.nbytes()
    if nbytes == 0:
        return rebuild_storage_empty, ()
    where = place(storage, nbytes)
    if where is not None:
        seg, _, offset = where
        return rebuild_storage_in_segment, (seg, offset, nbytes)
    return _reduce_torch_shared(storage, nbytes)


def rebuild_storage_empty():
    return torch.UntypedStorage()


def rebuild_storage_in_segment(mm, offset, nbytes):
    key = (id(mm), offset, nbytes)
    storage = recall(key)
    if storage is None:
        _check_region(mm, offset, nbytes)
        storage = torch.frombuffer(mm, dtype=_uint8, count=nbytes, offset=offset).untyped_storage()
        remember(key, storage)
    return storage


def _check_region(mm, offset, nbytes):
    if not (type(offset) is int and type(nbytes) is int and 0 <= offset
            and 0 < nbytes <= len(mm) - offset):
        raise SegmentError(f"storage of {nbytes!r} bytes at offset {offset!r} does not fit in its "
                           f"segment of {len(mm)} bytes: the message is corrupt or hostile")


def _fd_key(fd):
    st = os.fstat(fd)
    return ("fd", st.st_dev, st.st_ino)


def _reduce_torch_shared(storage, nbytes):
    """A storage in torch's own shared memory: torch's handle, without a copy."""
    try:
        fd = storage._get_shared_fd()     # file_descriptor: the fd torch keeps for it
    except RuntimeError:
        fd = -1
    if fd >= 0:
        remember(_fd_key(fd), storage)
        oob = wire.current()
        if oob is not None:
            return rebuild_torch_fd_in_band, (oob.add(fd), nbytes)
        return rebuild_torch_fd_dup, (DupFd(fd), nbytes)
    # file_system: a name managed by torch_shm_manager. As torch does, the sender takes a
    # reference that the receiver drops once it has attached (the name lives until then).
    manager, handle, size = storage._share_filename_cpu_()
    remember(("file", handle), storage)
    storage._shared_incref()
    return rebuild_torch_filename, (manager, handle, size)


def _rebuild_torch_fd(fd, nbytes):
    key = _fd_key(fd)
    storage = recall(key)
    if storage is None:
        storage = torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)   # maps a dup of fd
        remember(key, storage)
    return storage


def rebuild_torch_fd_in_band(index, nbytes):
    oob = wire.current()
    if oob is None:
        raise RuntimeError("an in-band storage fd can only be unpickled by a sharedmp channel")
    return _rebuild_torch_fd(oob.get(index), nbytes)    # the channel closes what it received


def rebuild_torch_fd_dup(dupfd, nbytes):
    fd = dupfd.detach()
    try:
        return _rebuild_torch_fd(fd, nbytes)
    finally:
        os.close(fd)


def rebuild_torch_filename(manager, handle, size):
    key = ("file", handle)
    storage = recall(key)
    if storage is None:
        storage = torch.UntypedStorage._new_shared_filename_cpu(manager, handle, size)
        remember(key, storage)
    return storage._shared_decref()


def reduce_typed_storage(storage):                   # torch.TypedStorage
    return rebuild_typed_storage, (storage._untyped_storage, storage.dtype)


def rebuild_typed_storage(untyped, dtype):
    return torch.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)


def reduce_typed_storage_child(storage):             # torch.FloatStorage and the other legacy ones
    return rebuild_typed_storage_child, (storage._untyped_storage, type(storage))


def rebuild_typed_storage_child(untyped, storage_type):
    return storage_type(wrap_storage=untyped, _internal=True)


# ---------------------------------------------------------------------------------------
# Tensors: reduce / rebuild pairs.
# ---------------------------------------------------------------------------------------

def reduce_tensor(t):
    if t.requires_grad and not t.is_leaf:
        raise RuntimeError(NON_LEAF)
    if t.layout is not _strided or not t.is_cpu or t.is_nested or t.is_quantized:
        return _reduce_other_tensor(t)
    if t._backward_hooks:
        torch.utils.hooks.warn_if_has_hooks(t)       # hooks are not sent (torch warns too)
    cls = type(t)
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    where = place(storage, nbytes) if nbytes else None
    if where is None:                                 # empty, or in torch's shared memory
        return rebuild_tensor, (storage, dtype_code(t.dtype), t.storage_offset(), tuple(t.shape),
                                t.stride(), flags_of(t, cls), None if cls is torch.Tensor else cls)
    seg, _, offset = where
    _check_aligned(t, offset)
    if cls is torch.Tensor and not t.requires_grad and not t.is_conj() and not t.is_neg():
        return rebuild_tensor_in_segment, (seg, offset, nbytes, dtype_code(t.dtype),
                                           t.storage_offset(), tuple(t.shape), t.stride())
    return rebuild_tensor_in_segment, (seg, offset, nbytes, dtype_code(t.dtype),
                                       t.storage_offset(), tuple(t.shape), t.stride(),
                                       flags_of(t, cls),
                                       None if cls in (torch.Tensor, Parameter) else cls)


def _check_aligned(t, offset):
    # Receivers refuse a tensor whose elements are not aligned (torch's kernels may crash on
    # one: complex128 does). Only a view made by torch.from_numpy / frombuffer at an odd
    # byte offset can be; say so here, in the sender, rather than lose the message there.
    if offset % t.dtype.itemsize:
        raise ValueError(f"this {t.dtype} tensor's memory is not aligned to its "
                         f"{t.dtype.itemsize}-byte elements (a torch.from_numpy or "
                         "torch.frombuffer view at an odd byte offset): send an aligned copy, "
                         "t.clone()")


def rebuild_tensor_in_segment(mm, offset, nbytes, dtype, storage_offset, size, stride, flags=0,
                              cls=None):
    """A tensor over its storage in a sharedmp segment (the storage found again if known here)."""
    dtype = dtype_of(dtype)
    itemsize = dtype.itemsize
    if type(offset) is not int or offset % itemsize:
        raise SegmentError(f"a {dtype} tensor at byte {offset!r} of its segment is not aligned "
                           f"to its {itemsize}-byte elements: the message is corrupt or hostile")
    key = (id(mm), offset, nbytes)
    storage = recall(key)
    if storage is None:
        _check_region(mm, offset, nbytes)
        t = frombuffer(mm, dtype, nbytes // itemsize, offset) if nbytes % itemsize == 0 else None
        if t is not None:
            # One call makes the storage and (mostly: a whole 1-d storage) the tensor too.
            storage = t.untyped_storage()
            remember(key, storage)
            if not (storage_offset == 0 and len(size) == 1 and size[0] * itemsize == nbytes
                    and stride == (1,)):
                t.set_(storage, storage_offset, size, stride)
            return finish(t, flags, cls) if flags or cls else t
        storage = torch.frombuffer(mm, dtype=_uint8, count=nbytes, offset=offset).untyped_storage()
        remember(key, storage)
    t = tensor_over(storage, dtype, storage_offset, size, stride)
    return finish(t, flags, cls) if flags or cls else t


def rebuild_tensor(storage, dtype, storage_offset, size, stride, flags, cls):
    return finish(tensor_over(storage, dtype_of(dtype), storage_offset, size, stride), flags, cls)


# A message of one tensor alone skips pickle (frame flag ``FLAG_TENSOR``, as ``encode_array``
# for NumPy): a stream of small tensors would otherwise spend most of its time in pickle.
# Header: the storage's offset in the segment and its nbytes, the tensor's storage_offset,
# dtype code, flags (``_flags``), ndim; then ndim sizes and ndim strides (int64). The
# segment's fd is the frame's only one.
_THEAD = struct.Struct("<QQqBBB")
# header, sizes, strides: by ndim
_TFRAME = [struct.Struct(_THEAD.format + f"{2 * n}q") for n in range(256)]
_ALL_FLAGS = REQUIRES_GRAD | PARAMETER | CONJ | NEG


def encode_tensor(t, fds):
    """The frame payload of tensor ``t`` sent alone, its fd appended to ``fds``; None when it
    needs pickle (not a plain strided CPU tensor in sharedmp file_descriptor memory)."""
    cls = type(t)
    if (cls is not torch.Tensor and cls is not Parameter) or (t.requires_grad and not t.is_leaf) \
            or t.layout is not _strided or not t.is_cpu or t.is_nested or t.is_quantized \
            or t._backward_hooks:
        return None                       # the pickled path raises, warns or handles these
    code = DTYPE_CODE.get(t.dtype)
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    if code is None or not nbytes or t.dim() >= len(_TFRAME):
        return None
    where = place(storage, nbytes)
    if where is None or where[0].kind != "file_descriptor":   # torch's memory; named segments
        return None
    seg, mm, offset = where
    _check_aligned(t, offset)
    fds.keep.append(mm)                   # alive until sent, even if ``t`` dies first
    fds.append(seg.fd)
    n = t.dim()
    return _TFRAME[n].pack(offset, nbytes, t.storage_offset(), code, flags_of(t, cls), n,
                           *t.shape, *t.stride())


def decode_tensor(payload, fds):
    """The tensor of a frame made by ``encode_tensor`` (the caller closes ``fds``)."""
    if len(payload) < _THEAD.size:
        raise ProtocolError(f"malformed tensor frame ({len(payload)} bytes)")
    n = payload[_THEAD.size - 1]          # ndim: the header's last byte
    if len(payload) != _THEAD.size + 16 * n:
        raise ProtocolError(f"tensor frame of {len(payload)} bytes, its header says "
                            f"{_THEAD.size + 16 * n}")
    head = _TFRAME[n].unpack_from(payload)
    offset, nbytes, storage_offset, code, flags = head[:5]
    size, stride = head[6:6 + n], head[6 + n:]
    if len(fds) != 1:
        raise ProtocolError(f"tensor frame carries {len(fds)} fds instead of 1")
    dtype = DTYPES[code] if code < len(DTYPES) else None
    if dtype is None or flags & ~_ALL_FLAGS or (flags & (CONJ | NEG) and not (
            dtype.is_complex or (dtype.is_floating_point and not flags & CONJ))):
        raise SegmentError(f"malformed tensor header: dtype code {code} ({dtype}), flags "
                           f"{flags:#x}")
    mm = segment.attach_fd(fds[0])
    try:
        return rebuild_tensor_in_segment(mm, offset, nbytes, dtype, storage_offset, size, stride,
                                         flags)
    # torch's checks: sizes and strides vs the storage
    except (RuntimeError, ValueError, OverflowError) as e:
        raise SegmentError(f"malformed tensor header (sizes {size}, strides {stride}, storage "
                           f"offset {storage_offset}, storage of {nbytes} bytes): {e}") from None


def _reduce_other_tensor(t):
    device = t.device.type
    if device == "meta":                              # no data: by value
        return rebuild_meta_tensor, (type(t), tuple(t.shape), t.stride(), t.storage_offset(),
                                     t.dtype, t.untyped_storage().nbytes(), t.requires_grad)
    if device == "cuda" and t.layout is _strided and not t.is_nested and not t.is_quantized:
        # by CUDA IPC, with leases
        from .. import cuda
        return cuda.reduce_torch_tensor(t)
    if device != "cpu":                               # others: torch's own reducer
        return _torch_reductions.reduce_tensor(t)
    if t.is_nested:
        return rebuild_nested_tensor, (t.values(), t._nested_tensor_size(),
                                       t._nested_tensor_strides(),
                                       t._nested_tensor_storage_offsets())
    layout = t.layout
    if layout is torch.sparse_coo:
        return rebuild_sparse_coo_tensor, (t._indices(), t._values(), tuple(t.shape),
                                           t.is_coalesced(), t.requires_grad)
    parts = sparse_parts(t)
    if parts is not None:
        return rebuild_sparse_compressed_tensor, (*parts, tuple(t.shape), layout, t.requires_grad)
    if t.is_quantized:
        # torch's own pickling (scale, zero point, ...); its storage travels through
        # reduce_typed_storage and so through sharedmp memory.
        return t.__reduce_ex__(2)
    return _torch_reductions.reduce_tensor(t)         # other layouts (mkldnn): torch's


def rebuild_meta_tensor(cls, size, stride, storage_offset, dtype, nbytes, requires_grad):
    storage = torch.UntypedStorage(nbytes, device="meta")
    t = torch.empty((0,), dtype=dtype, device="meta").set_(storage, storage_offset, size, stride)
    if cls is Parameter:
        return Parameter(t, requires_grad=requires_grad)
    t.requires_grad_(requires_grad)
    return t


def rebuild_sparse_coo_tensor(indices, values, size, is_coalesced, requires_grad):
    return torch.sparse_coo_tensor(indices, values, size, is_coalesced=is_coalesced,
                                   requires_grad=requires_grad)


def rebuild_sparse_compressed_tensor(compressed, plain, values, size, layout, requires_grad):
    return torch.sparse_compressed_tensor(compressed, plain, values, size, layout=layout,
                                          requires_grad=requires_grad)


def rebuild_nested_tensor(buffer, sizes, strides, offsets):
    return torch._nested_view_from_buffer_copy(buffer, sizes, strides, offsets)


def reducers() -> list[tuple[type, Callable[[Any], Any]]]:
    """(class, reducer) for ForkingPickler: every storage and tensor class of torch, as
    torch's own ``init_reductions()`` lists them."""
    pairs: list[tuple[type, Callable[[Any], Any]]] = []
    for cls in torch._storage_classes:
        if cls is torch.UntypedStorage:
            pairs.append((cls, reduce_storage))
        elif cls is torch.TypedStorage:
            pairs.append((cls, reduce_typed_storage))
        else:
            pairs.append((cls, reduce_typed_storage_child))
    pairs.append((torch.TypedStorage, reduce_typed_storage))
    for tensor_cls in torch._tensor_classes:  # legacy FloatTensor & co, as torch does
        pairs.append((tensor_cls, reduce_tensor))
    pairs += [(torch.Tensor, reduce_tensor), (Parameter, reduce_tensor)]
    return pairs


# The frame kind of a tensor sent alone: (decode, {type: its reducer}, encode).
FRAME = (decode_tensor, {torch.Tensor: reduce_tensor, Parameter: reduce_tensor}, encode_tensor)

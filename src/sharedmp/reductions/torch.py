"""PyTorch CPU tensors and storages on the wire, with torch.multiprocessing's semantics.

Imported only once torch is (see ``sharedmp.reductions``); importing this module runs
``register()`` (its last line), which replaces torch's reducers in ``ForkingPickler``
with the ones below, so that every tensor pickled by sharedmp's channels or by the
standard ones goes through sharedmp.

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
anywhere else                   moved into sharedmp memory in place first (below), then
                                as the first row
=============================== ======================================================

Moving in place: a region of ``arena.allocate`` (small storages are packed into
arenas) becomes a storage, the bytes are copied, then ``UntypedStorage._swap_data_ptr_``
gives the original storage the shared memory (and the temporary one the old memory,
freed with it): every tensor and view of that storage now reads and writes the shared
memory. The storage keeps the mapping alive (see ``_probe_keep_by_attribute``: an
attribute of the storage object where torch keeps that object as long as the storage,
else the deleter of a ``torch.frombuffer`` storage). ``_swap_data_ptr_`` is private API
of torch >= 2.13 (pytorch#177449); with an older torch the storage is moved into
torch's own shared memory in place instead (``_share_fd_cpu_`` / ``_share_filename_cpu_``,
per the sharing strategy) and travels with torch's handle: the same semantics, one fd
per storage as with torch.multiprocessing.

torch's own ``UntypedStorage.share_memory_`` / ``is_shared`` are wrapped (``_patch_torch``)
so that they know sharedmp memory: ``model.share_memory()`` on a model sharedmp already
shares is a no-op instead of a copy into torch's memory that would cut it off from the
other processes, and ``t.is_shared()`` says True. ``UntypedStorage._new_shared`` (where
DataLoader workers collate their batches) allocates sharedmp memory.

Identity: ``_storages`` maps (mapping, offset, nbytes) -- or torch's fd identity / name
-- to a weak reference to the storage of this process over that memory, filled when a
storage is moved, sent or received. A storage received in the process that sent it is
that very storage; the same memory received twice is one storage.

Autograd, as torch.multiprocessing: a ``Parameter`` stays a ``Parameter`` (an integer
one with ``requires_grad=False`` too), ``requires_grad`` is kept, ``.grad`` and hooks
are not sent (hooks warn, as torch does), a non-leaf tensor that requires grad raises.
Meta tensors travel by value, sparse tensors as their index and value tensors, nested
ones as their buffer and metadata tensors. Devices other than the CPU (CUDA) use
torch's own reducers, unchanged.
"""
import ctypes
import functools
import os
import struct
import threading
import weakref
from multiprocessing.reduction import DupFd, ForkingPickler
from typing import Any, Sequence, TypeVar

import torch
import torch.multiprocessing.reductions as _torch_reductions
from torch.nn.parameter import Parameter

from ..channels import connection, fdpass
from ..errors import ProtocolError, SegmentError
from ..memory import arena, segment
from ..strategy import get_sharing_strategy

HAVE_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")
_C_IS_SHARED = torch._C.StorageBase.is_shared  # type: ignore[attr-defined]  # torch's own answer (its shared memory)
_strided = torch.strided
_uint8 = torch.uint8

# dtypes travel as small integers (pickling a torch.dtype is a global lookup each message)
_DTYPES = [d for d in (getattr(torch, n, None) for n in (
    "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
    "bool", "complex64", "complex128", "uint16", "uint32", "uint64", "complex32",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")) if isinstance(d, torch.dtype)]
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}


def _dtype_code(dtype):
    return _DTYPE_CODE.get(dtype, dtype)


def _dtype(code):
    return _DTYPES[code] if type(code) is int else code


# A tensor over an existing storage: ``template.new(storage)`` (legacy, as torch's own
# collate uses it) is a 1-d tensor of the whole storage in one call, 1.0 us against 2-4 us
# for ``torch.empty((0,), dtype=...).set_(storage, ...)``; ``template.new()`` is the
# cheapest empty tensor of the dtype. Probed, since older torch may lack ``new(UntypedStorage)``.
_templates: dict[torch.dtype, torch.Tensor] = {}


def _template(dtype):
    t = _templates.get(dtype)
    if t is None:
        t = _templates[dtype] = torch.empty((0,), dtype=dtype)
    return t


def _probe_new_over_storage():
    try:
        storage = torch.zeros(4, dtype=torch.float32).untyped_storage()
        t = _template(torch.float32).new(storage)
        return t.shape == (4,) and t.untyped_storage().data_ptr() == storage.data_ptr()
    except Exception:
        return False


_NEW_OVER_STORAGE = _probe_new_over_storage()


def _tensor_over(storage, dtype, storage_offset, size, stride):
    """A new tensor of ``dtype`` viewing ``storage`` (torch checks the bounds)."""
    if _NEW_OVER_STORAGE and storage_offset == 0 and stride == (1,) and len(size) == 1 \
            and size[0] * dtype.itemsize == storage.nbytes():
        return _template(dtype).new(storage)
    return _template(dtype).new().set_(storage, storage_offset, size, stride)


# ---------------------------------------------------------------------------------------
# Identity: (memory key) -> weak reference to this process's storage over that memory.
# Weak references to UntypedStorage objects follow the C++ storage (torch keeps the
# Python object of a storage alive as long as the storage is), so an entry dies with the
# storage. Dead entries are swept when the table has doubled, as torch's SharedCache does.
# ---------------------------------------------------------------------------------------

_storages: "dict[Any, weakref.ref[torch.UntypedStorage]]" = {}
_limit = 256
_lock = threading.Lock()


def _remember(key, storage):
    global _limit
    _storages[key] = weakref.ref(storage)
    if len(_storages) > _limit:
        with _lock:
            for k, ref in list(_storages.items()):
                if ref() is None and _storages.get(k) is ref:   # (not one set meanwhile)
                    del _storages[k]
            _limit = max(256, 2 * len(_storages))


def _recall(key):
    ref = _storages.get(key)
    return ref() if ref is not None else None


# ---------------------------------------------------------------------------------------
# Where a CPU storage lives; moving it into sharedmp memory in place.
# ---------------------------------------------------------------------------------------

def _in_sharedmp(storage, nbytes):
    """(segment, mapping, offset) of a storage whose bytes lie in sharedmp memory, else None."""
    ptr = storage.data_ptr()
    seg, mm = segment.containing(ptr, nbytes)
    if seg is None:
        return None
    offset = ptr - seg.address
    key = (id(mm), offset, nbytes)
    ref = _storages.get(key)
    if ref is None or ref() is None:     # first seen here (e.g. torch.from_numpy of mp.empty)
        _remember(key, storage)
    return seg, mm, offset


def _place(storage, nbytes):
    """Where a non-empty CPU storage is shared from, moving it first if it is not shared:
    (segment, mapping, offset) for sharedmp memory, None for torch's shared memory."""
    where = _in_sharedmp(storage, nbytes)
    if where is not None:
        return where
    if _C_IS_SHARED(storage):
        return None
    return _move(storage, nbytes, storage.data_ptr())


_move_lock = threading.Lock()


def _move(storage, nbytes, ptr):
    with _move_lock:                      # one move per storage, even from two threads
        if storage.data_ptr() != ptr:     # another thread moved it meanwhile
            return _in_sharedmp(storage, nbytes)
        if not HAVE_SWAP:
            # torch < 2.13 cannot swap a storage's memory from Python; its own share_memory_
            # moves in place (into torch's shared memory, one fd per storage).
            if get_sharing_strategy() == "file_system":
                storage._share_filename_cpu_()
            else:
                storage._share_fd_cpu_()
            return None
        mm, offset = arena.allocate(nbytes, get_sharing_strategy(), zero=False)   # memmove'd over
        seg = _segment_of(mm)
        shared = _storage_over(mm, seg.address, offset, nbytes)
        _memmove(seg.address + offset, ptr, nbytes)
        storage._swap_data_ptr_(shared)   # `shared` now owns the old bytes, freed with it
        if _KEEP_BY_ATTRIBUTE:
            storage._sharedmp_mapping = mm
        _remember((id(mm), offset, nbytes), storage)
        return seg, mm, offset


def _storage_over(mm, address, offset, nbytes):
    """A new UntypedStorage over ``nbytes`` of mapping ``mm`` (at ``address``) from ``offset``.
    With ``_KEEP_BY_ATTRIBUTE`` the caller sets ``_sharedmp_mapping`` on the storage that
    ends up owning the memory; otherwise the storage's deleter keeps ``mm``."""
    if _KEEP_BY_ATTRIBUTE:
        return _construct(address + offset, _cpu, nbytes)
    return torch.frombuffer(mm, dtype=_uint8, count=nbytes, offset=offset).untyped_storage()


def new_shared_storage(nbytes):
    """A zeroed UntypedStorage of ``nbytes`` > 0 in sharedmp memory."""
    mm, offset = arena.allocate(nbytes, get_sharing_strategy())
    storage = _storage_over(mm, _segment_of(mm).address, offset, nbytes)
    if _KEEP_BY_ATTRIBUTE:
        storage._sharedmp_mapping = mm
    _remember((id(mm), offset, nbytes), storage)
    return storage


_memmove = ctypes.memmove
_cpu = torch.device("cpu")
_last_segment = None                      # the Segment of the last allocation (it holds no mapping)


def _segment_of(mm):
    global _last_segment
    seg = _last_segment
    if seg is None or seg.mapping() is not mm:
        seg = _last_segment = segment.segment_of(mm)
    return seg


# How the moved storage keeps its mapping alive. torch.frombuffer's storage holds the
# mapping in its deleter, which travels with the memory (1.1 us a call). Cheaper (0.4 us):
# a storage that does not own its memory (_construct_storage_from_data_pointer) and the
# mapping as an attribute of the Python storage object, which torch keeps alive exactly as
# long as the C++ storage (PyObject preservation of storages). Used only where a probe at
# import shows both hold; the memory then must not be swapped into another storage later.
def _probe_keep_by_attribute():
    construct = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if construct is None or not HAVE_SWAP:
        return None
    try:
        class Keep:
            pass
        keep = Keep()
        alive = weakref.ref(keep)
        buf = torch.zeros(4, dtype=_uint8)
        t = torch.ones(4, dtype=_uint8)
        view = t[1:]
        other = construct(buf.data_ptr(), _cpu, 4)
        storage = t.untyped_storage()
        storage._swap_data_ptr_(other)
        storage._sharedmp_mapping = keep
        del storage, other, keep, t
        kept = alive() is not None and view.data_ptr() == buf.data_ptr() + 1
        del view
        return construct if kept and alive() is None else None
    except Exception:
        return None


_construct = _probe_keep_by_attribute()
_KEEP_BY_ATTRIBUTE = _construct is not None


def _is_cpu_storage(storage):
    return storage.device.type == "cpu"


def storage_is_shared(storage):
    """Whether a storage is in shared memory: sharedmp's or torch's (CUDA: always)."""
    if isinstance(storage, torch.TypedStorage):
        storage = storage._untyped_storage
    if not _is_cpu_storage(storage):
        return _C_IS_SHARED(storage)      # CUDA: True, as torch says
    nbytes = storage.nbytes()
    if nbytes and segment.containing(storage.data_ptr(), nbytes)[0] is not None:
        return True
    return _C_IS_SHARED(storage)


def _share_storage(storage):
    if isinstance(storage, torch.TypedStorage):
        storage = storage._untyped_storage
    if not _is_cpu_storage(storage):
        return                            # CUDA memory needs no move; meta has none
    nbytes = storage.nbytes()
    if nbytes == 0:
        _torch_share_memory_(storage)     # torch marks an empty storage as shared
    else:
        _place(storage, nbytes)


# ---------------------------------------------------------------------------------------
# The public side: mp.share_memory_ / mp.share / mp.is_shared / mp.empty_like for torch.
# ---------------------------------------------------------------------------------------

def _sparse_parts(t):
    layout = t.layout
    if layout is torch.sparse_coo:
        return [t._indices(), t._values()]
    if layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    if layout in (torch.sparse_csc, torch.sparse_bsc):
        return [t.ccol_indices(), t.row_indices(), t.values()]
    return None


def _share_tensor(t):
    parts = _sparse_parts(t) if t.layout is not _strided else None
    if parts is not None:
        for part in parts:
            _share_tensor(part)
    elif t.is_cpu:
        _share_storage(t.untyped_storage())
    else:
        t.share_memory_()                 # torch's: a no-op for CUDA


def tensor_is_shared(t):
    parts = _sparse_parts(t) if t.layout is not _strided else None
    if parts is not None:
        return all(tensor_is_shared(p) for p in parts)
    if t.device.type == "meta":
        return False
    return storage_is_shared(t.untyped_storage())


_T = TypeVar("_T")


def share_memory_(obj: _T) -> _T:
    """Move ``obj`` into shared memory in place; returns ``obj``.

    ``torch.Tensor`` (and Parameter), storages, ``torch.nn.Module`` (parameters, their
    ``.grad``, buffers) and ``torch.optim.Optimizer`` (its parameters and its state,
    initialised eagerly first: see ``_init_optimizer_state``).
    """
    if isinstance(obj, torch.Tensor):
        _share_tensor(obj)
    elif isinstance(obj, (torch.UntypedStorage, torch.TypedStorage)):
        _share_storage(obj)
    elif isinstance(obj, torch.nn.Module):
        for p in obj.parameters():
            _share_tensor(p)
            if p.grad is not None:
                _share_tensor(p.grad)
        for b in obj.buffers():
            _share_tensor(b)
    elif isinstance(obj, torch.optim.Optimizer):
        _init_optimizer_state(obj)
        for group in obj.param_groups:
            for p in group["params"]:
                _share_tensor(p)
                if p.grad is not None:
                    _share_tensor(p.grad)
        for state in obj.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    _share_tensor(value)
    else:
        raise TypeError("mp.share_memory_() takes a torch tensor, storage, module or optimizer, "
                        f"not {type(obj).__name__}")
    return obj


def is_shared(obj: object) -> bool:
    if isinstance(obj, torch.Tensor):
        return tensor_is_shared(obj)
    if isinstance(obj, (torch.UntypedStorage, torch.TypedStorage)):
        return storage_is_shared(obj)
    if isinstance(obj, torch.nn.Module):
        return all(tensor_is_shared(t) for t in (*obj.parameters(), *obj.buffers()))
    return False


def empty(shape: int | Sequence[int], dtype: torch.dtype | None = None) -> torch.Tensor:
    """A CPU tensor of ``shape`` in sharedmp memory (zeros: fresh memory is zero)."""
    dtype = torch.get_default_dtype() if dtype is None else dtype
    shape = torch.Size((shape,) if isinstance(shape, int) else shape)
    numel = shape.numel()
    nbytes = numel * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    mm, offset = arena.allocate(nbytes, get_sharing_strategy())
    t = _frombuffer(mm, dtype, numel, offset)
    if t is None:
        storage = torch.frombuffer(mm, dtype=_uint8, count=nbytes, offset=offset).untyped_storage()
        t = torch.empty((0,), dtype=dtype)
    else:
        storage = t.untyped_storage()
    _remember((id(mm), offset, nbytes), storage)
    return t if len(shape) == 1 and t.numel() == numel else t.set_(storage, 0, shape)


def empty_like(t: torch.Tensor, dtype: torch.dtype | None = None,
               shape: Sequence[int] | None = None) -> torch.Tensor:
    return empty(t.shape if shape is None else shape, t.dtype if dtype is None else dtype)


# ---------------------------------------------------------------------------------------
# Optimizers: state initialised eagerly, as each optimizer would at its first step, so
# that the state exists before Hogwild workers get the optimizer and can be shared.
# ---------------------------------------------------------------------------------------

def _scalar_dtype(is_fused=None):
    import importlib
    get = getattr(importlib.import_module("torch.optim.optimizer"), "_get_scalar_dtype", None)
    if get is not None:
        return get(is_fused) if is_fused else get()
    return torch.float32


def _zeros(p):
    return torch.zeros_like(p, memory_format=torch.preserve_format)


def _init_optimizer_state(opt):
    """Create the state of every parameter that has none yet, with its first-step values.

    Supported: Adam and AdamW (step, exp_avg, exp_avg_sq, max_exp_avg_sq with amsgrad),
    SGD (momentum_buffer when momentum != 0: zeros, so that the first step computes
    ``(1 - dampening) * grad`` where torch's lazy start takes ``grad``: the same for the
    default dampening=0), RMSprop (step, square_avg, momentum_buffer, grad_avg) and
    Adagrad (already eager in torch). Any other optimizer: every parameter must already
    have state (run one step before sharing), else TypeError.
    """
    optim = torch.optim
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state[p]
            if len(state) != 0:
                continue
            if isinstance(opt, optim.Adam):          # AdamW subclasses Adam
                fused = group.get("fused") or False
                if group.get("capturable") or fused:
                    state["step"] = torch.zeros((), dtype=_scalar_dtype(fused), device=p.device)
                else:
                    state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
                state["exp_avg"] = _zeros(p)
                state["exp_avg_sq"] = _zeros(p)
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = _zeros(p)
            elif isinstance(opt, optim.SGD):
                if group.get("momentum", 0) != 0:
                    state["momentum_buffer"] = _zeros(p)
                else:
                    del opt.state[p]                  # plain SGD keeps no state
            elif isinstance(opt, optim.RMSprop):
                device = p.device if group.get("capturable") else None
                state["step"] = torch.zeros((), dtype=_scalar_dtype(), device=device)
                state["square_avg"] = _zeros(p)
                if group.get("momentum", 0) > 0:
                    state["momentum_buffer"] = _zeros(p)
                if group.get("centered"):
                    state["grad_avg"] = _zeros(p)
            else:
                del opt.state[p]
                raise TypeError(
                    f"mp.share_memory_() cannot initialise the state of {type(opt).__name__} "
                    "eagerly (supported: Adam, AdamW, SGD, RMSprop, Adagrad); run one "
                    "optimizer step first, so that its state exists, then share it")


# ---------------------------------------------------------------------------------------
# Storages: reduce / rebuild pairs.
# ---------------------------------------------------------------------------------------

def reduce_storage(storage):
    if not _is_cpu_storage(storage):
        if storage.device.type == "cuda":                  # by CUDA IPC, with leases
            from . import cuda
            return cuda.reduce_torch_storage(storage)
        return _torch_reductions.reduce_storage(storage)   # meta & co: torch's (it refuses)
    nbytes = storage.nbytes()
    if nbytes == 0:
        return rebuild_storage_empty, ()
    where = _place(storage, nbytes)
    if where is not None:
        seg, _, offset = where
        return rebuild_storage_in_segment, (seg, offset, nbytes)
    return _reduce_torch_shared(storage, nbytes)


def rebuild_storage_empty():
    return torch.UntypedStorage()


def rebuild_storage_in_segment(mm, offset, nbytes):
    key = (id(mm), offset, nbytes)
    storage = _recall(key)
    if storage is None:
        _check_region(mm, offset, nbytes)
        storage = torch.frombuffer(mm, dtype=_uint8, count=nbytes, offset=offset).untyped_storage()
        _remember(key, storage)
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
        _remember(_fd_key(fd), storage)
        oob = fdpass.current()
        if oob is not None:
            return rebuild_torch_fd_in_band, (oob.add(fd), nbytes)
        return rebuild_torch_fd_dup, (DupFd(fd), nbytes)
    # file_system: a name managed by torch_shm_manager. As torch does, the sender takes a
    # reference that the receiver drops once it has attached (the name lives until then).
    manager, handle, size = storage._share_filename_cpu_()
    _remember(("file", handle), storage)
    storage._shared_incref()
    return rebuild_torch_filename, (manager, handle, size)


def _rebuild_torch_fd(fd, nbytes):
    key = _fd_key(fd)
    storage = _recall(key)
    if storage is None:
        storage = torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)   # maps a dup of fd
        _remember(key, storage)
    return storage


def rebuild_torch_fd_in_band(index, nbytes):
    oob = fdpass.current()
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
    storage = _recall(key)
    if storage is None:
        storage = torch.UntypedStorage._new_shared_filename_cpu(manager, handle, size)
        _remember(key, storage)
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

_REQUIRES_GRAD, _PARAMETER, _CONJ, _NEG = 1, 2, 4, 8

_NON_LEAF = ("Cowardly refusing to send a non-leaf tensor that requires_grad: autograd does not "
             "cross process boundaries. To send the data, call detach() on the tensor first "
             "(e.g. queue.put(t.detach())).")


def _flags(t, cls):
    flags = _REQUIRES_GRAD if t.requires_grad else 0
    if cls is Parameter:
        flags |= _PARAMETER
    if t.is_conj():
        flags |= _CONJ
    if t.is_neg():
        flags |= _NEG
    return flags


def _finish(t, flags, cls):
    if flags & _CONJ:
        torch._C._set_conj(t, True)
    if flags & _NEG:
        torch._C._set_neg(t, True)
    if flags & _PARAMETER:
        # requires_grad goes to the constructor: an integer Parameter must get False there
        return Parameter(t, requires_grad=bool(flags & _REQUIRES_GRAD))
    if flags & _REQUIRES_GRAD:
        t.requires_grad_(True)
    if cls is not None and cls is not torch.Tensor:
        t = t.as_subclass(cls)
    return t


def reduce_tensor(t):
    if t.requires_grad and not t.is_leaf:
        raise RuntimeError(_NON_LEAF)
    if t.layout is not _strided or not t.is_cpu or t.is_nested or t.is_quantized:
        return _reduce_other_tensor(t)
    if t._backward_hooks:
        torch.utils.hooks.warn_if_has_hooks(t)       # hooks are not sent (torch warns too)
    cls = type(t)
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    where = _place(storage, nbytes) if nbytes else None
    if where is None:                                 # empty, or in torch's shared memory
        return rebuild_tensor, (storage, _dtype_code(t.dtype), t.storage_offset(), tuple(t.shape),
                                t.stride(), _flags(t, cls), None if cls is torch.Tensor else cls)
    seg, _, offset = where
    _check_aligned(t, offset)
    if cls is torch.Tensor and not t.requires_grad and not t.is_conj() and not t.is_neg():
        return rebuild_tensor_in_segment, (seg, offset, nbytes, _dtype_code(t.dtype),
                                           t.storage_offset(), tuple(t.shape), t.stride())
    return rebuild_tensor_in_segment, (seg, offset, nbytes, _dtype_code(t.dtype), t.storage_offset(),
                                       tuple(t.shape), t.stride(), _flags(t, cls),
                                       None if cls in (torch.Tensor, Parameter) else cls)


def _check_aligned(t, offset):
    # Receivers refuse a tensor whose elements are not aligned (torch's kernels may crash on
    # one: complex128 does). Only a view made by torch.from_numpy / frombuffer at an odd
    # byte offset can be; say so here, in the sender, rather than lose the message there.
    if offset % t.dtype.itemsize:
        raise ValueError(f"this {t.dtype} tensor's memory is not aligned to its {t.dtype.itemsize}-byte "
                         "elements (a torch.from_numpy or torch.frombuffer view at an odd byte offset): "
                         "send an aligned copy, t.clone()")


def rebuild_tensor_in_segment(mm, offset, nbytes, dtype, storage_offset, size, stride, flags=0, cls=None):
    """A tensor over its storage in a sharedmp segment (the storage found again if known here)."""
    dtype = _dtype(dtype)
    itemsize = dtype.itemsize
    if type(offset) is not int or offset % itemsize:
        raise SegmentError(f"a {dtype} tensor at byte {offset!r} of its segment is not aligned to its "
                           f"{itemsize}-byte elements: the message is corrupt or hostile")
    key = (id(mm), offset, nbytes)
    storage = _recall(key)
    if storage is None:
        _check_region(mm, offset, nbytes)
        t = _frombuffer(mm, dtype, nbytes // itemsize, offset) if nbytes % itemsize == 0 else None
        if t is not None:
            # One call makes the storage and (mostly: a whole 1-d storage) the tensor too.
            storage = t.untyped_storage()
            _remember(key, storage)
            if not (storage_offset == 0 and len(size) == 1 and size[0] * itemsize == nbytes
                    and stride == (1,)):
                t.set_(storage, storage_offset, size, stride)
            return _finish(t, flags, cls) if flags or cls else t
        storage = torch.frombuffer(mm, dtype=_uint8, count=nbytes, offset=offset).untyped_storage()
        _remember(key, storage)
    t = _tensor_over(storage, dtype, storage_offset, size, stride)
    return _finish(t, flags, cls) if flags or cls else t


def _frombuffer(mm, dtype, count, offset):
    try:
        return torch.frombuffer(mm, dtype=dtype, count=count, offset=offset)
    except (TypeError, ValueError, RuntimeError):    # a dtype frombuffer does not take
        return None


def rebuild_tensor(storage, dtype, storage_offset, size, stride, flags, cls):
    return _finish(_tensor_over(storage, _dtype(dtype), storage_offset, size, stride), flags, cls)


# A message of one tensor alone skips pickle (frame flag ``FLAG_TENSOR``, as ``encode_array``
# for NumPy): a stream of small tensors would otherwise spend most of its time in pickle.
# Header: the storage's offset in the segment and its nbytes, the tensor's storage_offset,
# dtype code, flags (``_flags``), ndim; then ndim sizes and ndim strides (int64). The
# segment's fd is the frame's only one.
_THEAD = struct.Struct("<QQqBBB")
_TFRAME = [struct.Struct(_THEAD.format + f"{2 * n}q") for n in range(256)]   # header, sizes, strides: by ndim
_ALL_FLAGS = _REQUIRES_GRAD | _PARAMETER | _CONJ | _NEG


def encode_tensor(t, fds):
    """The frame payload of tensor ``t`` sent alone, its fd appended to ``fds``; None when it
    needs pickle (not a plain strided CPU tensor in sharedmp file_descriptor memory)."""
    cls = type(t)
    if (cls is not torch.Tensor and cls is not Parameter) or (t.requires_grad and not t.is_leaf) \
            or t.layout is not _strided or not t.is_cpu or t.is_nested or t.is_quantized \
            or t._backward_hooks:
        return None                       # the pickled path raises, warns or handles these
    code = _DTYPE_CODE.get(t.dtype)
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    if code is None or not nbytes or t.dim() >= len(_TFRAME):
        return None
    where = _place(storage, nbytes)
    if where is None or where[0].kind != "file_descriptor":   # torch's memory; named segments
        return None
    seg, mm, offset = where
    _check_aligned(t, offset)
    fds.keep.append(mm)                   # alive until sent, even if ``t`` dies first
    fds.append(seg.fd)
    n = t.dim()
    return _TFRAME[n].pack(offset, nbytes, t.storage_offset(), code, _flags(t, cls), n, *t.shape, *t.stride())


def decode_tensor(payload, fds):
    """The tensor of a frame made by ``encode_tensor`` (the caller closes ``fds``)."""
    if len(payload) < _THEAD.size:
        raise ProtocolError(f"malformed tensor frame ({len(payload)} bytes)")
    n = payload[_THEAD.size - 1]          # ndim: the header's last byte
    if len(payload) != _THEAD.size + 16 * n:
        raise ProtocolError(f"tensor frame of {len(payload)} bytes, its header says {_THEAD.size + 16 * n}")
    head = _TFRAME[n].unpack_from(payload)
    offset, nbytes, storage_offset, code, flags = head[:5]
    size, stride = head[6:6 + n], head[6 + n:]
    if len(fds) != 1:
        raise ProtocolError(f"tensor frame carries {len(fds)} fds instead of 1")
    dtype = _DTYPES[code] if code < len(_DTYPES) else None
    if dtype is None or flags & ~_ALL_FLAGS or (flags & (_CONJ | _NEG) and not (
            dtype.is_complex or (dtype.is_floating_point and not flags & _CONJ))):
        raise SegmentError(f"malformed tensor header: dtype code {code} ({dtype}), flags {flags:#x}")
    mm = segment.attach_fd(fds[0])
    try:
        return rebuild_tensor_in_segment(mm, offset, nbytes, dtype, storage_offset, size, stride, flags)
    except (RuntimeError, ValueError, OverflowError) as e:   # torch's checks: sizes and strides vs the storage
        raise SegmentError(f"malformed tensor header (sizes {size}, strides {stride}, storage "
                           f"offset {storage_offset}, storage of {nbytes} bytes): {e}") from None


def _reduce_other_tensor(t):
    device = t.device.type
    if device == "meta":                              # no data: by value
        return rebuild_meta_tensor, (type(t), tuple(t.shape), t.stride(), t.storage_offset(),
                                     t.dtype, t.untyped_storage().nbytes(), t.requires_grad)
    if device == "cuda" and t.layout is _strided and not t.is_nested and not t.is_quantized:
        # by CUDA IPC, with leases
        from . import cuda
        return cuda.reduce_torch_tensor(t)
    if device != "cpu":                               # others: torch's own reducer
        return _torch_reductions.reduce_tensor(t)
    if t.is_nested:
        return rebuild_nested_tensor, (t.values(), t._nested_tensor_size(),
                                       t._nested_tensor_strides(), t._nested_tensor_storage_offsets())
    layout = t.layout
    if layout is torch.sparse_coo:
        return rebuild_sparse_coo_tensor, (t._indices(), t._values(), tuple(t.shape),
                                           t.is_coalesced(), t.requires_grad)
    parts = _sparse_parts(t)
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


# ---------------------------------------------------------------------------------------
# torch's own share_memory_ / is_shared, made aware of sharedmp memory: a storage that
# sharedmp shares is shared (torch would otherwise copy it into its own shared memory on
# `model.share_memory()`, silently cutting it off from the other processes).
# ---------------------------------------------------------------------------------------

_torch_share_memory_ = torch.UntypedStorage.share_memory_
_torch_new_shared = torch.UntypedStorage._new_shared.__func__  # type: ignore[attr-defined]  # (a classmethod)


def _patch_torch():
    if getattr(torch.UntypedStorage, "_sharedmp_patched", False):
        return

    @functools.wraps(_torch_share_memory_)
    def share_memory_(self, *args, **kwargs):
        if _is_cpu_storage(self):
            nbytes = self.nbytes()
            if nbytes and segment.containing(self.data_ptr(), nbytes)[0] is not None:
                return self
        return _torch_share_memory_(self, *args, **kwargs)

    def is_shared(self):
        """Whether the storage is in shared memory (torch's or sharedmp's)."""
        return storage_is_shared(self)

    # DataLoader workers collate each batch into a storage made by _new_shared: torch's
    # makes a shared-memory file per tensor (an fd to pass, a mapping to make and unmap at
    # each end); sharedmp's carves it from an arena (one fd per arena per message).
    def _new_shared(cls, size, *, device="cpu"):
        if cls is torch.UntypedStorage and size > 0 and torch.device(device).type == "cpu":
            return new_shared_storage(size)
        return _torch_new_shared(cls, size, device=device)

    torch.UntypedStorage.share_memory_ = share_memory_
    torch.UntypedStorage.is_shared = is_shared
    torch.UntypedStorage._new_shared = classmethod(functools.wraps(_torch_new_shared)(_new_shared))
    torch.UntypedStorage._sharedmp_patched = True


# ---------------------------------------------------------------------------------------

def register():
    """Install the reducers above in ForkingPickler, over torch's (after torch's own: this
    module imports torch first, and runs this when it is imported)."""
    reg = ForkingPickler.register
    for cls in torch._storage_classes:
        if cls is torch.UntypedStorage:
            reg(cls, reduce_storage)
        elif cls is torch.TypedStorage:
            reg(cls, reduce_typed_storage)
        else:
            reg(cls, reduce_typed_storage_child)
    reg(torch.TypedStorage, reduce_typed_storage)
    for cls in torch._tensor_classes:                 # legacy torch.FloatTensor & co, as torch does
        reg(cls, reduce_tensor)
    reg(torch.Tensor, reduce_tensor)
    reg(Parameter, reduce_tensor)
    connection.reducers_changed()        # ours replace torch's: same count, new table
    connection.frame_kind(connection.FLAG_TENSOR, decode_tensor,
                          {torch.Tensor: reduce_tensor, Parameter: reduce_tensor}, encode_tensor)
    _patch_torch()


def _after_fork_in_child():
    global _lock, _move_lock
    _lock = threading.Lock()
    _move_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
register()

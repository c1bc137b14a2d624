"""The public side for torch: ``mp.share_memory_`` / ``mp.share`` / ``mp.is_shared`` /
``mp.empty_like`` of tensors, storages, modules and optimizers (whose state is
initialised eagerly, so that it exists before Hogwild workers get the optimizer)."""
from typing import Sequence, TypeVar

import torch

from ...memory import arena
from ...strategy import get_sharing_strategy
from .codes import sparse_parts
from .storage import frombuffer, remember, share_storage, storage_is_shared

_strided = torch.strided
_uint8 = torch.uint8

def _share_tensor(t):
    parts = sparse_parts(t) if t.layout is not _strided else None
    if parts is not None:
        for part in parts:
            _share_tensor(part)
    elif t.is_cpu:
        share_storage(t.untyped_storage())
    else:
        t.share_memory_()                 # torch's: a no-op for CUDA


def tensor_is_shared(t):
    parts = sparse_parts(t) if t.layout is not _strided else None
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
        share_storage(obj)
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
    size = torch.Size((shape,) if isinstance(shape, int) else shape)
    numel = size.numel()
    nbytes = numel * dtype.itemsize
    if nbytes == 0:
        return torch.empty(size, dtype=dtype)
    mm, offset = arena.allocate(nbytes, get_sharing_strategy())
    t = frombuffer(mm, dtype, numel, offset)
    if t is None:
        storage = torch.frombuffer(mm, dtype=_uint8, count=nbytes, offset=offset).untyped_storage()
        t = torch.empty((0,), dtype=dtype)
    else:
        storage = t.untyped_storage()
    remember((id(mm), offset, nbytes), storage)
    return t if len(size) == 1 and t.numel() == numel else t.set_(storage, 0, size)


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



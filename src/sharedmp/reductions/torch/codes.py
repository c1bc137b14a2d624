"""What a tensor is made of on the wire, beside its bytes: dtype codes, flags, sparse parts.

Shared by the CPU reducers (``tensors.py``) and the CUDA ones (``reductions/cuda.py``).
"""
import torch
from torch.nn.parameter import Parameter

# dtypes travel as small integers (pickling a torch.dtype is a global lookup each message)
DTYPES = [d for d in (getattr(torch, n, None) for n in (
    "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
    "bool", "complex64", "complex128", "uint16", "uint32", "uint64", "complex32",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"))
    if isinstance(d, torch.dtype)]
DTYPE_CODE = {d: i for i, d in enumerate(DTYPES)}


def dtype_code(dtype):
    return DTYPE_CODE.get(dtype, dtype)


def dtype_of(code):
    return DTYPES[code] if type(code) is int else code




REQUIRES_GRAD, PARAMETER, CONJ, NEG = 1, 2, 4, 8

NON_LEAF = ("Cowardly refusing to send a non-leaf tensor that requires_grad: autograd does not "
             "cross process boundaries. To send the data, call detach() on the tensor first "
             "(e.g. queue.put(t.detach())).")


def flags_of(t, cls):
    flags = REQUIRES_GRAD if t.requires_grad else 0
    if cls is Parameter:
        flags |= PARAMETER
    if t.is_conj():
        flags |= CONJ
    if t.is_neg():
        flags |= NEG
    return flags


def finish(t, flags, cls):
    if flags & CONJ:
        torch._C._set_conj(t, True)
    if flags & NEG:
        torch._C._set_neg(t, True)
    if flags & PARAMETER:
        # requires_grad goes to the constructor: an integer Parameter must get False there
        return Parameter(t, requires_grad=bool(flags & REQUIRES_GRAD))
    if flags & REQUIRES_GRAD:
        t.requires_grad_(True)
    if cls is not None and cls is not torch.Tensor:
        t = t.as_subclass(cls)
    return t




def sparse_parts(t):
    layout = t.layout
    if layout is torch.sparse_coo:
        return [t._indices(), t._values()]
    if layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    if layout in (torch.sparse_csc, torch.sparse_bsc):
        return [t.ccol_indices(), t.row_indices(), t.values()]
    return None

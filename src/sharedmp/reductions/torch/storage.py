"""Where a CPU storage's bytes live, and moving them into sharedmp memory in place.

Moving in place: a region of ``arena.allocate`` (small storages are packed into arenas)
becomes a storage, the bytes are copied, then ``UntypedStorage._swap_data_ptr_`` gives the
original storage the shared memory (and the temporary one the old memory, freed with it):
every tensor and view of that storage now reads and writes the shared memory. The storage
keeps the mapping alive (see ``_probe_keep_by_attribute``: an attribute of the storage
object where torch keeps that object as long as the storage, else the deleter of a
``torch.frombuffer`` storage). ``_swap_data_ptr_`` is private API of torch >= 2.13
(pytorch#177449); with an older torch the storage is moved into torch's own shared memory
in place instead (``_share_fd_cpu_`` / ``_share_filename_cpu_``, per the sharing strategy)
and travels with torch's handle: the same semantics, one fd per storage as with
torch.multiprocessing.

Identity: ``_storages`` maps (mapping, offset, nbytes) -- or torch's fd identity / name --
to a weak reference to the storage of this process over that memory, filled when a storage
is moved, sent or received. A storage received in the process that sent it is that very
storage; the same memory received twice is one storage.
"""
import ctypes
import threading
import weakref
from typing import Any

import torch

from ... import forks
from ...memory import arena, segment
from ...strategy import get_sharing_strategy

HAVE_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")
# torch's own answers, kept before patch.py wraps them: whether a storage is in torch's
# shared memory, and how torch moves one there.
C_IS_SHARED = torch._C.StorageBase.is_shared  # type: ignore[attr-defined]
TORCH_SHARE_MEMORY_ = torch.UntypedStorage.share_memory_
_uint8 = torch.uint8

# A tensor over an existing storage: ``template.new(storage)`` (legacy, as torch's own
# collate uses it) is a 1-d tensor of the whole storage in one call, cheaper than
# ``torch.empty((0,), dtype=...).set_(storage, ...)``; ``template.new()`` is the
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


NEW_OVER_STORAGE = _probe_new_over_storage()


def tensor_over(storage, dtype, storage_offset, size, stride):
    """A new tensor of ``dtype`` viewing ``storage`` (torch checks the bounds)."""
    if NEW_OVER_STORAGE and storage_offset == 0 and stride == (1,) and len(size) == 1 \
            and size[0] * dtype.itemsize == storage.nbytes():
        return _template(dtype).new(storage)
    return _template(dtype).new().set_(storage, storage_offset, size, stride)




def frombuffer(mm, dtype, count, offset):
    try:
        return torch.frombuffer(mm, dtype=dtype, count=count, offset=offset)
    except (TypeError, ValueError, RuntimeError):    # a dtype frombuffer does not take
        return None




# ---------------------------------------------------------------------------------------
# Identity: (memory key) -> weak reference to this process's storage over that memory.
# Weak references to UntypedStorage objects follow the C++ storage (torch keeps the
# Python object of a storage alive as long as the storage is), so an entry dies with the
# storage. Dead entries are swept when the table has doubled, as torch's SharedCache does.
# ---------------------------------------------------------------------------------------

_storages: "dict[Any, weakref.ref[torch.UntypedStorage]]" = {}
_limit = 256
_lock = threading.Lock()


def remember(key, storage):
    global _limit
    _storages[key] = weakref.ref(storage)
    if len(_storages) > _limit:
        with _lock:
            for k, ref in list(_storages.items()):
                if ref() is None and _storages.get(k) is ref:   # (not one set meanwhile)
                    del _storages[k]
            _limit = max(256, 2 * len(_storages))


def recall(key):
    ref = _storages.get(key)
    return ref() if ref is not None else None


# ---------------------------------------------------------------------------------------
# Where a CPU storage lives; moving it into sharedmp memory in place.
# ---------------------------------------------------------------------------------------

def in_sharedmp(storage, nbytes):
    """(segment, mapping, offset) of a storage whose bytes lie in sharedmp memory, else None."""
    ptr = storage.data_ptr()
    seg, mm = segment.containing(ptr, nbytes)
    if seg is None:
        return None
    offset = ptr - seg.address
    key = (id(mm), offset, nbytes)
    ref = _storages.get(key)
    if ref is None or ref() is None:     # first seen here (e.g. torch.from_numpy of mp.empty)
        remember(key, storage)
    return seg, mm, offset


def place(storage, nbytes):
    """Where a non-empty CPU storage is shared from, moving it first if it is not shared:
    (segment, mapping, offset) for sharedmp memory, None for torch's shared memory."""
    where = in_sharedmp(storage, nbytes)
    if where is not None:
        return where
    if C_IS_SHARED(storage):
        return None
    return _move(storage, nbytes, storage.data_ptr())


_move_lock = threading.Lock()


def _move(storage, nbytes, ptr):
    with _move_lock:                      # one move per storage, even from two threads
        if storage.data_ptr() != ptr:     # another thread moved it meanwhile
            return in_sharedmp(storage, nbytes)
        if not HAVE_SWAP:
            # torch < 2.13 cannot swap a storage's memory from Python; its own share_memory_
            # moves in place (into torch's shared memory, one fd per storage).
            if get_sharing_strategy() == "file_system":
                storage._share_filename_cpu_()
            else:
                storage._share_fd_cpu_()
            return None
        mm, offset = arena.allocate(nbytes, get_sharing_strategy(), zero=False)   # memmove'd over
        seg = segment_of_mapping(mm)
        shared = storage_over(mm, seg.address, offset, nbytes)
        _memmove(seg.address + offset, ptr, nbytes)
        storage._swap_data_ptr_(shared)   # `shared` now owns the old bytes, freed with it
        if KEEP_BY_ATTRIBUTE:
            storage._sharedmp_mapping = mm
        remember((id(mm), offset, nbytes), storage)
        return seg, mm, offset


def storage_over(mm, address, offset, nbytes):
    """A new UntypedStorage over ``nbytes`` of mapping ``mm`` (at ``address``) from ``offset``.
    With ``KEEP_BY_ATTRIBUTE`` the caller sets ``_sharedmp_mapping`` on the storage that
    ends up owning the memory; otherwise the storage's deleter keeps ``mm``."""
    if KEEP_BY_ATTRIBUTE:
        return _construct(address + offset, _cpu, nbytes)
    return torch.frombuffer(mm, dtype=_uint8, count=nbytes, offset=offset).untyped_storage()


def new_shared_storage(nbytes: int) -> torch.UntypedStorage:
    """A zeroed UntypedStorage of ``nbytes`` > 0 in sharedmp memory."""
    mm, offset = arena.allocate(nbytes, get_sharing_strategy())
    storage = storage_over(mm, segment_of_mapping(mm).address, offset, nbytes)
    if KEEP_BY_ATTRIBUTE:
        storage._sharedmp_mapping = mm
    remember((id(mm), offset, nbytes), storage)
    return storage


_memmove = ctypes.memmove
_cpu = torch.device("cpu")
# the Segment of the last allocation (it holds no mapping)
_last_segment = None


def segment_of_mapping(mm):
    global _last_segment
    seg = _last_segment
    if seg is None or seg.mapping() is not mm:
        seg = _last_segment = segment.segment_of(mm)
    return seg


# How the moved storage keeps its mapping alive. torch.frombuffer's storage holds the
# mapping in its deleter, which travels with the memory (a cost on every call). Cheaper:
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
KEEP_BY_ATTRIBUTE = _construct is not None


def is_cpu_storage(storage: Any) -> bool:
    return storage.device.type == "cpu"


def storage_is_shared(storage: Any) -> bool:
    """Whether a storage is in shared memory: sharedmp's or torch's (CUDA: always)."""
    if isinstance(storage, torch.TypedStorage):
        storage = storage._untyped_storage
    if not is_cpu_storage(storage):
        return C_IS_SHARED(storage)      # CUDA: True, as torch says
    nbytes = storage.nbytes()
    if nbytes and segment.containing(storage.data_ptr(), nbytes)[0] is not None:
        return True
    return C_IS_SHARED(storage)


def share_storage(storage):
    if isinstance(storage, torch.TypedStorage):
        storage = storage._untyped_storage
    if not is_cpu_storage(storage):
        return                            # CUDA memory needs no move; meta has none
    nbytes = storage.nbytes()
    if nbytes == 0:
        TORCH_SHARE_MEMORY_(storage)     # torch marks an empty storage as shared
    else:
        place(storage, nbytes)


forks.renew_locks(globals(), "_lock", "_move_lock")

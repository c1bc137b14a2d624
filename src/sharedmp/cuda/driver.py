"""Every CUDA driver call of sharedmp, through NVIDIA's cuda-bindings (``cuda.bindings.driver``).

A narrow interface over device ordinals, ints (pointers, streams) and bytes (handles),
so that the bookkeeping above it (``ipc``, ``lease``) never sees a driver object and is
tested on machines without a GPU with a stand-in of this class.

Facts this relies on (cuda-bindings 12.9 / 13.x):
- every call returns a tuple: a ``CUresult``, then its outputs;
- handle objects cannot be pickled and have no stable attribute for their bytes: the
  64 bytes (``CU_IPC_HANDLE_SIZE``) are copied through ``getPtr()`` with ctypes;
- ``cuIpcOpenMemHandle`` needs ``CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`` and opens a handle
  once per context and device in each process (a second open in the same context only
  counts a reference): we always open in the device's primary context, which torch and
  CuPy use too;
- interprocess events need ``CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING``;
- memory of the virtual memory management API (``cuMemCreate``/``cuMemMap``: torch's
  ``expandable_segments:True``) is not legacy-IPC capable; its physical allocations travel
  as POSIX fds (``cuMemExportToShareableHandle``), see the ``vmm_*`` methods.
Calls run in the device's primary context: where it is already current on the calling
thread (torch's and CuPy's threads once they have used the device) as is, elsewhere
pushed and popped again, so that they work from any thread (the lease and release
threads too) and leave the caller's context stack as it was.
"""
import ctypes
import fcntl
import os
import threading
from contextlib import contextmanager

from .. import forks
from ..errors import CudaError

try:
    from cuda.bindings import driver as _cu
except ImportError as e:          # the `cuda` extra is not installed
    _cu = None
    # (kept for its message only: its traceback would keep alive every frame of the code
    # that imported this module, with all their locals, for the life of the process)
    IMPORT_ERROR: ImportError | None = e.with_traceback(None)
else:
    IMPORT_ERROR = None

_initialised = False


def initialised():
    """Whether this process has called cuInit through sharedmp."""
    return _initialised


def available():
    """None if the driver can be used here, else why not (text)."""
    if _cu is None:
        return f"cuda-bindings is not installed (pip install 'sharedmp[cuda]'): {IMPORT_ERROR}"
    try:
        get()
    except Exception as e:
        return f"the CUDA driver cannot be initialised: {e}"
    return None


def _check(result, what):
    """The outputs of a driver call (result tuple), or CudaError naming the call and error."""
    err = result[0]
    if err != _cu.CUresult.CUDA_SUCCESS:
        name = _cu.cuGetErrorName(err)
        name = name[1].decode() if name[0] == _cu.CUresult.CUDA_SUCCESS else repr(err)
        raise CudaError(f"{what} failed: {name}")
    return result[1] if len(result) == 2 else result[1:]


def _bytes_of(handle, size):
    return ctypes.string_at(handle.getPtr(), size)


def _address(handle):
    """The pointer a handle object (CUcontext, ...) holds (0 for NULL), read as its bytes are."""
    return ctypes.c_void_p.from_address(handle.getPtr()).value or 0


def _handle(cls, data):
    h = cls()
    ctypes.memmove(h.getPtr(), bytes(data), len(data))
    return h


def _ok(result):
    """The outputs of a driver call that may fail (result tuple), or None if it failed."""
    if result[0] != _cu.CUresult.CUDA_SUCCESS:
        return None
    return result[1] if len(result) == 2 else result[1:]


def _handle_types(prop):
    """``requestedHandleTypes`` of a CUmemAllocationProp as an int (a bit mask). cuda-bindings
    reads the field as a CUmemAllocationHandleType enum, which raises ValueError for a mask of
    several types (POSIX fd | fabric, as NCCL requests): then the int is read from the C struct
    (``CUmemAllocationType type`` then ``CUmemAllocationHandleType requestedHandleTypes``,
    both 4-byte enums: offset 4)."""
    try:
        return int(prop.requestedHandleTypes)
    except ValueError:
        return ctypes.c_uint.from_address(prop.getPtr() + 4).value


_UNSHAREABLE = "this CUDA memory cannot be shared with another process: "


class Driver:
    """The CUDA driver, initialised once per process; see the module docstring."""

    HANDLE_SIZE = 64

    def __init__(self):
        global _initialised
        _check(_cu.cuInit(0), "cuInit")
        _initialised = True
        self.HANDLE_SIZE = int(getattr(_cu, "CU_IPC_HANDLE_SIZE", 64))
        self.version = _check(_cu.cuDriverGetVersion(), "cuDriverGetVersion")
        n = _check(_cu.cuDeviceGetCount(), "cuDeviceGetCount")
        self._devices = [_check(_cu.cuDeviceGet(i), "cuDeviceGet") for i in range(n)]
        self._uuids = [_check(_cu.cuDeviceGetUuid(d), "cuDeviceGetUuid").bytes
                       for d in self._devices]
        self._contexts = {}
        self._granularity = {}        # ordinal -> minimum VMM granularity (bytes)
        self._vmm_maps = {}           # base of a vmm_import range -> (its size, chunk sizes)
        self._marks = {}              # ordinal -> [plain events of mark(), ready for reuse]
        self._lock = threading.Lock()
        attr = _cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED
        self._ipc_events = [bool(_check(_cu.cuDeviceGetAttribute(attr, d), "cuDeviceGetAttribute"))
                            for d in self._devices]

    # -- devices and contexts ------------------------------------------------------------

    def device_uuid(self, ordinal):
        return self._uuids[ordinal]

    def local_ordinal(self, uuid):
        """The ordinal of the device with ``uuid`` here, or None (not visible here)."""
        try:
            return self._uuids.index(uuid)
        except ValueError:
            return None

    def ipc_events_supported(self, ordinal):
        return self._ipc_events[ordinal]

    @contextmanager
    def _on(self, ordinal):
        ctx = self._contexts.get(ordinal)
        if ctx is None:
            with self._lock:
                ctx = self._contexts.get(ordinal)
                if ctx is None:       # retained once, for the life of the process
                    ctx = _check(_cu.cuDevicePrimaryCtxRetain(self._devices[ordinal]),
                                 "cuDevicePrimaryCtxRetain")
                    self._contexts[ordinal] = ctx
        if _address(_check(_cu.cuCtxGetCurrent(), "cuCtxGetCurrent")) == _address(ctx):
            yield                     # (one call instead of a push and a pop)
            return
        _check(_cu.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
        try:
            yield
        finally:
            _check(_cu.cuCtxPopCurrent(), "cuCtxPopCurrent")

    # -- producer ------------------------------------------------------------------------

    def buffer_id(self, ordinal, ptr):
        """The allocation's id (never reused in this process), to cache its export."""
        with self._on(ordinal):
            return int(_check(_cu.cuPointerGetAttribute(
                _cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_BUFFER_ID, ptr),
                "cuPointerGetAttribute"))

    def export(self, ordinal, ptr):
        """(base, size, handle bytes) of the allocation (cudaMalloc block) holding ``ptr``."""
        with self._on(ordinal):
            capable = _check(_cu.cuPointerGetAttribute(
                _cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, ptr),
                "cuPointerGetAttribute(IS_LEGACY_CUDA_IPC_CAPABLE)")
            if not capable:
                raise CudaError(
                    "this CUDA memory cannot be shared by CUDA IPC (cuIpcGetMemHandle): it was "
                    "not allocated by cudaMalloc. With torch, set PYTORCH_CUDA_ALLOC_CONF="
                    "expandable_segments:False and do not use backend:cudaMallocAsync; with "
                    "CuPy, use the default memory pool (not MemoryAsyncPool or managed memory)")
            base, size = _check(_cu.cuMemGetAddressRange(ptr), "cuMemGetAddressRange")
            handle = _check(_cu.cuIpcGetMemHandle(base), "cuIpcGetMemHandle")
        return int(base), int(size), _bytes_of(handle, self.HANDLE_SIZE)

    # -- VMM memory (cuMemCreate/cuMemMap), carried as POSIX fds --------------------------

    def memory_kind(self, ordinal, ptr):
        """"legacy" (cudaMalloc memory: ``export``/``open``), "vmm" (mapped VMM memory whose
        allocation can be exported as a POSIX fd: ``vmm_*``), else CudaError saying what the
        memory is and which setting would make it shareable. Asked once per allocation, so
        that ``put()`` fails in the caller, naming the fix, rather than in the receiver."""
        attr = _cu.CUpointer_attribute
        with self._on(ordinal):
            if _check(_cu.cuPointerGetAttribute(
                    attr.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, ptr),
                    "cuPointerGetAttribute(IS_LEGACY_CUDA_IPC_CAPABLE)"):
                return "legacy"
            if _ok(_cu.cuPointerGetAttribute(attr.CU_POINTER_ATTRIBUTE_IS_MANAGED, ptr)):
                raise CudaError(
                    _UNSHAREABLE + "it is managed (unified) memory. Allocate it with cudaMalloc "
                    "/ torch's default allocator, not managed memory (with CuPy, use the "
                    "default memory pool, not ManagedMemory)")
            # VMM memory: the physical allocation mapped at ptr, if any (fails elsewhere)
            handle = _ok(_cu.cuMemRetainAllocationHandle(ptr))
            types = None
            if handle is not None:
                try:
                    prop = _check(_cu.cuMemGetAllocationPropertiesFromHandle(handle),
                                  "cuMemGetAllocationPropertiesFromHandle")
                    types = _handle_types(prop)
                finally:
                    _check(_cu.cuMemRelease(handle), "cuMemRelease")
                if types & int(_posix_fd()):
                    return "vmm"
            pool = _ok(_cu.cuPointerGetAttribute(attr.CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, ptr))
            if pool is not None and _address(pool):
                raise CudaError(
                    _UNSHAREABLE + "it comes from a stream-ordered memory pool (cudaMallocAsync) "
                    "whose allocations cannot be exported as POSIX fds. With torch, do not use "
                    "PYTORCH_CUDA_ALLOC_CONF backend:cudaMallocAsync, or create the pool with "
                    "POSIX fd handles (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR); with CuPy, "
                    "use the default memory pool (not MemoryAsyncPool)")
            if handle is not None:
                fabric = int(_cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC)
                raise CudaError(
                    _UNSHAREABLE + "it is virtual memory management memory (cuMemCreate/"
                    f"cuMemMap) created without the POSIX fd handle type (handle types "
                    f"{types:#x}). torch sets it with expandable_segments:True; for your own "
                    "cuMemCreate, request CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR in "
                    "requestedHandleTypes"
                    + (" (this allocation has fabric handles only: torch chooses them for "
                       "expandable segments where the system supports them, IMEX; sharedmp "
                       "carries POSIX fds)" if types & fabric else ""))
            raise CudaError(
                _UNSHAREABLE + "it was not allocated by cudaMalloc (CUDA IPC) and is not "
                "mapped virtual memory management memory with POSIX fd handles. With torch, "
                "use the default allocator (PYTORCH_CUDA_ALLOC_CONF without "
                "backend:cudaMallocAsync); with CuPy, use the default memory pool (not "
                "MemoryAsyncPool or managed memory)")

    def _vmm_prop(self, ordinal):
        """A CUmemAllocationProp for pinned device memory on ``ordinal`` with POSIX fd handles
        (what torch's expandable segments create): for the granularity."""
        prop = _cu.CUmemAllocationProp()
        prop.type = _cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = _cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = ordinal
        prop.requestedHandleTypes = _posix_fd()
        return prop

    def _vmm_granularity(self, ordinal):
        """(in the context) The minimum granularity of VMM mappings on ``ordinal``: every
        cuMemMap's address, size and offset are multiples of it (2 MiB on current GPUs)."""
        g = self._granularity.get(ordinal)
        if g is None:
            g = int(_check(_cu.cuMemGetAllocationGranularity(
                self._vmm_prop(ordinal),
                _cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                "cuMemGetAllocationGranularity"))
            self._granularity[ordinal] = g
        return g

    @staticmethod
    def _handle_at(addr):
        """(in the context) The value of the allocation handle mapped at ``addr`` (the one
        cuMemMap was given: cuMemRetainAllocationHandle returns that same value), or None
        where nothing is mapped; the retained reference is released at once."""
        handle = _ok(_cu.cuMemRetainAllocationHandle(addr))
        if handle is None:
            return None
        value = int(handle)
        _check(_cu.cuMemRelease(handle), "cuMemRelease")
        return value

    def _vmm_chunk(self, addr, gran):
        """(in the context) (base, size, handle value) of the one cuMemMap mapping that holds
        ``addr``.

        cuMemGetAddressRange on VMM memory answers the mapping, not the reservation (the
        driver's documentation of CU_POINTER_ATTRIBUTE_RANGE_SIZE points to it for "the size
        of the mapped region"; libfabric and UCX found that for several allocations mapped
        side by side, as torch's expandable segments map their 2 MiB / 20 MiB pages, it gives
        the one allocation holding the pointer). That is checked: the same handle mapped at
        the range's first and last byte, base and size multiples of the granularity. Where
        it does not hold, the mapping is found by walking granularity steps down and up from
        ``addr`` while the same handle is mapped there (the allocation's size cannot be read
        from its handle: CUmemAllocationProp has no size)."""
        value = self._handle_at(addr)
        if value is None:
            raise CudaError(f"cuMemRetainAllocationHandle failed: no VMM allocation is "
                            f"mapped at {addr:#x}")
        found = _ok(_cu.cuMemGetAddressRange(addr))
        if found is not None:
            base, size = int(found[0]), int(found[1])
            if (size > 0 and base <= addr < base + size and base % gran == 0
                    and size % gran == 0 and self._handle_at(base) == value
                    and self._handle_at(base + size - 1) == value):
                return base, size, value
        lo = addr - addr % gran
        while lo >= gran and self._handle_at(lo - gran) == value:
            lo -= gran
        hi = addr - addr % gran + gran
        while self._handle_at(hi) == value:
            hi += gran
        return lo, hi - lo, value

    def vmm_chunks(self, ordinal, ptr, nbytes):
        """The physical allocations under [ptr, ptr + nbytes) (the one at ``ptr`` if nbytes is
        0), in address order, as (base, size, key): each is exported and mapped whole, and
        ``key`` (an int: the allocation handle's value, with the mapping's buffer id above
        its 64 bits where the driver gives one, so that a handle value reused for a later
        allocation at the same place gives another key) lets the caller cache exports. A
        tensor of torch's expandable segments may span several of its pages."""
        with self._on(ordinal):
            gran = self._vmm_granularity(ordinal)
            chunks, addr, end = [], ptr, ptr + max(int(nbytes), 1)
            while addr < end:
                base, size, value = self._vmm_chunk(addr, gran)
                bid = _ok(_cu.cuPointerGetAttribute(
                    _cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_BUFFER_ID, base))
                key = value if bid is None else (int(bid) << 64) | value
                chunks.append((base, size, key))
                addr = base + size
            return chunks

    def vmm_export(self, ordinal, base):
        """A new POSIX fd (O_CLOEXEC; the caller's to close) for the physical allocation mapped
        at ``base``: what crosses to the receiver in the message (SCM_RIGHTS), which needs no
        ptrace permission over this process, unlike torch's pidfd_getfd."""
        with self._on(ordinal):
            handle = _check(_cu.cuMemRetainAllocationHandle(base), "cuMemRetainAllocationHandle")
            try:
                fd = int(_check(_cu.cuMemExportToShareableHandle(handle, _posix_fd(), 0),
                                "cuMemExportToShareableHandle"))
            finally:
                _check(_cu.cuMemRelease(handle), "cuMemRelease")
        try:                          # (the driver's fd would leak into exec'd children)
            flags = fcntl.fcntl(fd, fcntl.F_GETFD)
            if not flags & fcntl.FD_CLOEXEC:
                fcntl.fcntl(fd, fcntl.F_SETFD, flags | fcntl.FD_CLOEXEC)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def vmm_import(self, ordinal, chunks):
        """Map the allocations ``chunks`` ([(fd, size)], in order; the fds stay the caller's)
        side by side into one new virtual range of this process, read/write for the device
        ``ordinal``; its base address. The range is only as large as the chunks (not the
        sender's whole reservation, which for torch is about the GPU's memory); the imported
        handles are released at once (the mapping keeps the memory until ``vmm_unmap``).
        On failure everything done is undone before the error is raised."""
        sizes = [int(size) for _, size in chunks]
        total = sum(sizes)
        with self._on(ordinal):
            gran = self._vmm_granularity(ordinal)
            if not chunks or any(s <= 0 or s % gran for s in sizes):
                raise CudaError(f"vmm_import: chunk sizes {sizes} are not positive multiples "
                                f"of the device's granularity {gran}")
            handles, mapped, base = [], [], None
            try:
                for fd, _ in chunks:
                    handles.append(_check(_cu.cuMemImportFromShareableHandle(int(fd), _posix_fd()),
                                          "cuMemImportFromShareableHandle"))
                base = int(_check(_cu.cuMemAddressReserve(total, gran, 0, 0),
                                  "cuMemAddressReserve"))
                offset = 0
                for handle, size in zip(handles, sizes):
                    _check(_cu.cuMemMap(base + offset, size, 0, handle, 0), "cuMemMap")
                    mapped.append((base + offset, size))
                    offset += size
                access = _cu.CUmemAccessDesc()
                access.location.type = _cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                access.location.id = ordinal
                access.flags = _cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                _check(_cu.cuMemSetAccess(base, total, [access], 1), "cuMemSetAccess")
            except BaseException:
                for addr, size in mapped:
                    _cu.cuMemUnmap(addr, size)
                if base is not None:
                    _cu.cuMemAddressFree(base, total)
                for handle in handles:
                    _cu.cuMemRelease(handle)
                raise
            failed = [r for r in (_cu.cuMemRelease(h) for h in handles)
                      if r[0] != _cu.CUresult.CUDA_SUCCESS]
            if failed:
                self._unmap(base, total, sizes)
                _check(failed[0], "cuMemRelease")
        self._vmm_maps[base] = (total, sizes)
        return base

    def vmm_unmap(self, ordinal, ptr, size):
        """Unmap a ``vmm_import`` range and free it (the memory goes once no other mapping,
        handle or fd holds it)."""
        layout = self._vmm_maps.pop(ptr, None)
        sizes = layout[1] if layout is not None and layout[0] == size else None
        with self._on(ordinal):
            self._unmap(ptr, size, sizes)

    @staticmethod
    def _unmap(ptr, size, sizes):
        """(in the context) cuMemUnmap of the whole range (NVIDIA's samples unmap a range of
        several cuMemMap mappings in one call), else of each mapping in turn (the documented
        unit: "the entire contiguous address range that was mapped"); then cuMemAddressFree."""
        try:
            _check(_cu.cuMemUnmap(ptr, size), "cuMemUnmap")
        except CudaError:
            if not sizes or len(sizes) < 2:
                raise
            offset = 0
            for s in sizes:
                _check(_cu.cuMemUnmap(ptr + offset, s), "cuMemUnmap")
                offset += s
        _check(_cu.cuMemAddressFree(ptr, size), "cuMemAddressFree")

    def new_event(self, ordinal):
        """(event, its 64 handle bytes): an interprocess event for ``record``."""
        flags = (_cu.CUevent_flags.CU_EVENT_INTERPROCESS
                 | _cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        with self._on(ordinal):
            ev = _check(_cu.cuEventCreate(int(flags)), "cuEventCreate")
            handle = _check(_cu.cuIpcGetEventHandle(ev), "cuIpcGetEventHandle")
        return ev, _bytes_of(handle, self.HANDLE_SIZE)

    def record(self, ordinal, event, stream):
        with self._on(ordinal):
            _check(_cu.cuEventRecord(event, _cu.CUstream(stream)), "cuEventRecord")

    def sync_stream(self, ordinal, stream):
        with self._on(ordinal):
            _check(_cu.cuStreamSynchronize(_cu.CUstream(stream)), "cuStreamSynchronize")

    def destroy_event(self, ordinal, event):
        with self._on(ordinal):
            _check(_cu.cuEventDestroy(event), "cuEventDestroy")

    # -- receiver ------------------------------------------------------------------------

    def open(self, ordinal, handle):
        """The local pointer of the producer's block ``handle`` (bytes), in the primary context."""
        h = _handle(_cu.CUipcMemHandle, handle)
        flags = int(_cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        with self._on(ordinal):
            return int(_check(_cu.cuIpcOpenMemHandle(h, flags), "cuIpcOpenMemHandle"))

    def close(self, ordinal, ptr):
        with self._on(ordinal):
            _check(_cu.cuIpcCloseMemHandle(_cu.CUdeviceptr(ptr)), "cuIpcCloseMemHandle")

    def open_event(self, ordinal, handle):
        """The producer's interprocess event ``handle`` (bytes), opened here (``wait`` on it
        as often as needed, then ``close_event``)."""
        h = _handle(_cu.CUipcEventHandle, handle)
        with self._on(ordinal):
            return _check(_cu.cuIpcOpenEventHandle(h), "cuIpcOpenEventHandle")

    def wait(self, ordinal, event, stream):
        """Make ``stream`` wait for the last record of an opened producer's event."""
        with self._on(ordinal):
            _check(_cu.cuStreamWaitEvent(_cu.CUstream(stream), event, 0), "cuStreamWaitEvent")

    def close_event(self, ordinal, event):
        with self._on(ordinal):
            _check(_cu.cuEventDestroy(event), "cuEventDestroy")

    def mark(self, ordinal, stream):
        """A plain event recorded on ``stream`` now (the receiver's work on released memory),
        from a pool: ``finish`` gives it back."""
        with self._lock:
            free = self._marks.setdefault(ordinal, [])
            ev = free.pop() if free else None
        with self._on(ordinal):
            if ev is None:
                ev = _check(_cu.cuEventCreate(int(_cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)),
                            "cuEventCreate")
            _check(_cu.cuEventRecord(ev, _cu.CUstream(stream)), "cuEventRecord")
        return ev

    def finish(self, ordinal, event):
        """Wait for a ``mark`` event; it goes back to the pool (destroyed past 64 there)."""
        with self._on(ordinal):
            try:
                _check(_cu.cuEventSynchronize(event), "cuEventSynchronize")
            except CudaError:
                _check(_cu.cuEventDestroy(event), "cuEventDestroy")
                raise
            with self._lock:
                free = self._marks.setdefault(ordinal, [])
                if len(free) < 64:
                    free.append(event)
                    return
            _check(_cu.cuEventDestroy(event), "cuEventDestroy")


def _posix_fd():
    """CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (a function: cuda-bindings may be absent)."""
    return _cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


_driver = None
_get_lock = threading.Lock()


def get():
    """The process's Driver (cuInit on first use); CudaError/RuntimeError if there is none."""
    global _driver
    if _driver is None:
        if _cu is None:
            raise RuntimeError("sharing CUDA arrays needs NVIDIA's cuda-bindings: "
                               f"pip install 'sharedmp[cuda]' ({IMPORT_ERROR})")
        with _get_lock:
            if _driver is None:
                _driver = Driver()
    return _driver


# CUDA cannot be used in a forked child of a CUDA process (the fork guard refuses such
# forks); the lock only must not stay held by a thread that is not there.
forks.renew_locks(globals(), "_get_lock")

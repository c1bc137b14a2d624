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
- interprocess events need ``CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING``.
Calls run in the device's primary context: where it is already current on the calling
thread (torch's and CuPy's threads once they have used the device) as is, elsewhere
pushed and popped again, so that they work from any thread (the lease and release
threads too) and leave the caller's context stack as it was.
"""
import ctypes
import threading
from contextlib import contextmanager

from .. import forks

try:
    from cuda.bindings import driver as _cu
except ImportError as e:          # the `cuda` extra is not installed
    _cu = None
    IMPORT_ERROR: ImportError | None = e
else:
    IMPORT_ERROR = None

_initialised = False


def initialised():
    """Whether this process has called cuInit through sharedmp."""
    return _initialised


class CudaError(RuntimeError):
    """A CUDA driver call failed."""


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

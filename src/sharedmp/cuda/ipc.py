"""CUDA memory on the wire: the descriptor, the sender's exports, the receiver's mappings.

Framework-neutral: regions are (device ordinal, pointer, nbytes); ``reductions/cuda.py``
turns torch tensors and CuPy arrays into regions and back. The driver is passed in
(``driver.Driver`` in real use), so this bookkeeping runs on CPU with a stand-in.

Sender (``Exporter.export``): the allocation (cudaMalloc block) holding the region, its
IPC handle (cached by the allocation's BUFFER_ID, never reused), the region's offset in
it, an interprocess event recorded on the current stream (one per stream per message;
past ``MAX_EVENTS`` live events, or where the device has no IPC events, the stream is
synchronised instead and no event is sent), and a lease holding the sender's object
and the event until the receiver releases it (``lease``).

Receiver (``Importer.open``): CLAIM the lease first (a sender that has exited fails
here, before any CUDA call), map the device UUID to a local device, open each block
once per process (CUDA allows one context per device per other process to open it;
every array over it shares that mapping, counted), make the current stream wait for
the event (once per event and stream in a message). The framework object keeps a
*holder*; when the holder dies, its finalizer hands (lease, stream) to a releaser thread,
which records one event per stream for all it has been handed so far, waits for it (the
receiver's work on those arrays is done), and RELEASEs their leases in one write per
sender. Finalizers at interpreter shutdown make no CUDA call.

What the receiver keeps (a cache, under ``memory/cache.py``'s rules: let go after
``$SHAREDMP_CACHE_IDLE`` seconds unused, by the ``sharedmp-cache`` timer thread, which runs
while it keeps something; shown by doctor as "cuda", dropped by ``mp.empty_cache()``):
blocks whose last holder has died stay open (at most ``MAX_IDLE_BLOCKS``), so that the
next message over the same allocation (a caching allocator hands the same blocks out again
and again) opens nothing; and the senders' event handles, opened once (a sender reuses its
events). The memory of an idle block stays allocated for its sender until it is let go.

Driver calls in steady state (``README``: the counts, checked by a test with the stand-in
driver): sender, per array: the allocation's buffer id; per message and stream: one event
record. Receiver, per message: one stream wait per event. Release, per batch of arrays
let go together: one event record and one wait per stream.

VMM memory (``cuMemCreate``/``cuMemMap``: torch's expandable segments), which CUDA IPC
cannot export, is the descriptor kind "vmm-fd" (``VmmDescriptor``): the sender exports each
physical allocation under the region as a POSIX fd once (kept in ``Exporter._fds`` while
used) and puts the fds in the message (the channel's out-of-band fds: SCM_RIGHTS, no
ptrace permission needed, unlike torch's pidfd_getfd); the receiver imports and maps them
side by side into one range of its own, keeps dups of them with the mapping (to send the
memory on) and unmaps at the last holder (or, idle, when the cache lets go). Over anything
but a sharedmp channel there are no fds: such memory raises, naming the channels.

Forwarding: a receiver may send what it received on (a chain of processes). The
descriptor keeps the owner's block handle; the lease is the forwarder's, holding its
own mapping (which holds its lease with the owner). Received back in the owner's own
process, the region is the owner's original object (a process cannot open its own
handle).
"""
import os
import queue
import secrets
import sys
import threading
import time
import warnings
import weakref

from .. import fds as _fds
from .. import forks
from .. import wire
from ..memory import cache
from ..errors import ProtocolError
from . import lease as _lease

VERSION = 1
KIND = "legacy-ipc"               # cudaMalloc memory: a CUDA IPC handle
KIND_VMM = "vmm-fd"               # VMM memory (expandable segments): POSIX fds in the message
MAX_CHUNKS = 4096                 # physical allocations under one region, at most
MAX_EVENTS = 1000                 # live interprocess events per sender (torch's cap too)
MAX_IDLE_BLOCKS = 64              # received blocks kept open after their last holder died
MAX_OPEN_EVENTS = 4096            # senders' event handles kept open by a receiver
_ADDRESS_PREFIX = b"\0sharedmp-cuda-"
_nonce = secrets.token_bytes(16)  # this process, in descriptors (pids are reused)


def nonce():
    return _nonce


# ---------------------------------------------------------------------------------------
# The descriptor: one region of one block, as a tuple of plain values on the wire.
# ---------------------------------------------------------------------------------------

class Descriptor:
    """Where a region lives (owner, device, block handle, offset) and its lease: memory of
    cudaMalloc, by its CUDA IPC handle (kind "legacy-ipc")."""

    __slots__ = ("owner_pid", "owner", "lease", "token", "uuid", "ordinal", "handle",
                 "block_size", "offset", "nbytes", "event")
    FIELDS: tuple[str, ...] = __slots__
    KIND = KIND

    def __init__(self, owner_pid, owner, lease, token, uuid, ordinal, handle, block_size,
                 offset, nbytes, event):
        self.owner_pid, self.owner, self.lease, self.token = owner_pid, owner, lease, token
        self.uuid, self.ordinal, self.handle, self.block_size = uuid, ordinal, handle, block_size
        self.offset, self.nbytes, self.event = offset, nbytes, event

    def encode(self):
        """The wire form: (version, kind, fields...)."""
        return (VERSION, self.KIND) + tuple(getattr(self, f) for f in self.FIELDS)

    @staticmethod
    def decode(form):
        """A Descriptor (or VmmDescriptor) from its wire form; ProtocolError naming what is
        wrong."""
        if not isinstance(form, tuple) or len(form) < 2:
            raise ProtocolError("a CUDA array descriptor must be a tuple, got "
                                f"{type(form).__name__}")
        cls = _KINDS.get(form[1]) if form[0] == VERSION and type(form[1]) is str else None
        if cls is None:
            kinds = " or ".join(map(repr, _KINDS))
            raise ProtocolError(f"CUDA array descriptor {form[:2]!r} not understood (this "
                                f"sharedmp reads version {VERSION}, {kinds}): run the same "
                                "sharedmp version in every process")
        if len(form) != 2 + len(cls.FIELDS):
            raise ProtocolError(f"a CUDA array descriptor has {len(cls.FIELDS)} fields, got "
                                f"{len(form) - 2}")
        d = cls(*form[2:])
        d._check()
        return d

    def _bad(self, field, want):
        raise ProtocolError(f"CUDA array descriptor: {field} must be {want}, got "
                            f"{getattr(self, field)!r:.80}: the message is corrupt or hostile")

    def _check_common(self):
        for f in ("owner_pid", "ordinal", "offset", "nbytes"):
            if type(getattr(self, f)) is not int or getattr(self, f) < 0:
                self._bad(f, "an int >= 0")
        for f in ("owner", "token", "uuid"):
            if type(getattr(self, f)) is not bytes or len(getattr(self, f)) != 16:
                self._bad(f, "16 bytes")
        if self.event is not None and (type(self.event) is not bytes or len(self.event) != 64):
            self._bad("event", "None or 64 bytes")
        if type(self.lease) is not bytes or not self.lease.startswith(_ADDRESS_PREFIX) \
                or len(self.lease) > 108:
            self._bad("lease", "a sharedmp lease server address")

    def _check(self):
        self._check_common()
        if type(self.handle) is not bytes or len(self.handle) != 64:
            self._bad("handle", "64 bytes")
        if type(self.block_size) is not int or self.block_size < 0:
            self._bad("block_size", "an int >= 0")
        if self.nbytes == 0 or self.offset + self.nbytes > self.block_size:
            self._bad("nbytes", f"> 0 and fit in the block of {self.block_size} bytes from "
                                f"offset {self.offset}")


class VmmDescriptor(Descriptor):
    """A region of VMM memory (kind "vmm-fd"): the physical allocations under it, in address
    order, as ``chunks`` ((key, size, fd index), ...), each fd in the same message (the
    channel's out-of-band fds); ``offset`` from the first chunk's start. ``handle`` (not on the
    wire) is the chunks' keys: the region's block, for the caches, as a legacy handle is."""

    __slots__ = ("chunks",)
    FIELDS = ("owner_pid", "owner", "lease", "token", "uuid", "ordinal", "chunks", "offset",
              "nbytes", "event")
    KIND = KIND_VMM

    def __init__(self, owner_pid, owner, lease, token, uuid, ordinal, chunks, offset, nbytes,
                 event):
        self.owner_pid, self.owner, self.lease, self.token = owner_pid, owner, lease, token
        self.uuid, self.ordinal, self.chunks = uuid, ordinal, chunks
        self.offset, self.nbytes, self.event = offset, nbytes, event
        self.handle = self.block_size = None

    def _check(self):
        self._check_common()
        chunks = self.chunks
        if (type(chunks) is not tuple or not 0 < len(chunks) <= MAX_CHUNKS
                or not all(type(c) is tuple and len(c) == 3 and all(type(x) is int for x in c)
                           and c[0] >= 0 and c[1] > 0 and c[2] >= 0 for c in chunks)):
            self._bad("chunks", f"1 to {MAX_CHUNKS} (key, size > 0, fd index) of ints >= 0")
        if len({c[2] for c in chunks}) != len(chunks):
            self._bad("chunks", "of distinct fds")
        self.handle = tuple(c[0] for c in chunks)
        self.block_size = sum(c[1] for c in chunks)
        if self.nbytes == 0 or self.offset + self.nbytes > self.block_size:
            self._bad("nbytes", f"> 0 and fit in the chunks' {self.block_size} bytes from "
                                f"offset {self.offset}")


_KINDS = {KIND: Descriptor, KIND_VMM: VmmDescriptor}
_NO_CHANNEL = ("this CUDA memory is VMM memory (torch's expandable_segments:True, or "
               "cuMemCreate), which travels as file descriptors inside the message: only "
               "sharedmp's channels carry them (mp.Queue, mp.SimpleQueue, mp.Pipe, mp.Pool). "
               "Send it through one of those, not a standard-library pipe or spawn "
               "arguments, or allocate it with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False")


# ---------------------------------------------------------------------------------------
# Sender
# ---------------------------------------------------------------------------------------

class _Event:
    """An interprocess event and how many outstanding leases were sent with it."""

    __slots__ = ("ordinal", "event", "handle", "users")

    def __init__(self, ordinal, event, handle):
        self.ordinal, self.event, self.handle, self.users = ordinal, event, handle, 0


_VMM = "vmm"                      # (Exporter._blocks) an allocation of VMM memory


def _none():
    return None                       # (a dead weak reference)


class _PerMessage:
    """What was done for the message this thread is pickling or unpickling
    (``wire.current()``), by key, so that it is done once per message: a dict, new for each
    message (and a throwaway one outside sharedmp's channels). The message is held weakly:
    its OutOfBand keeps what it sends (fds) until it is sent, no longer."""

    __slots__ = ("_message", "_done")

    def __init__(self):
        self._message, self._done = _none, {}

    def done(self):
        oob = wire.current()
        if oob is None:
            return {}
        if self._message() is not oob:
            self._message, self._done = weakref.ref(oob), {}
        return self._done


class Exporter:
    """The sender's side: regions -> descriptors, each with a lease on ``server``."""

    def __init__(self, driver, server):
        self.driver = driver
        self.server = server
        server.on_release = self._released
        self._blocks = {}             # (ordinal, buffer id) -> (base, size, handle), or _VMM
        self._fds = {}                # (ordinal, base, size, key) -> [Fd, last use]: VMM exports
        self._home = {}               # (handle, offset, nbytes) -> [object, leases]
        self._free = {}               # ordinal -> [_Event] ready to be recorded again
        self.live_events = 0          # created and not destroyed
        self._memo = _PerMessage()     # (ordinal, stream) -> _Event recorded for the message
        self._lock = threading.Lock()

    def _block(self, ordinal, ptr):
        """(base, size, handle) of the cudaMalloc block holding ``ptr``, or _VMM; the kind of
        memory is asked once per allocation (CudaError, naming the fix, for memory that
        neither kind can carry)."""
        try:
            key = (ordinal, self.driver.buffer_id(ordinal, ptr))
        except Exception:
            # (no buffer id for this memory: VMM memory needs none, asked each time)
            if self.driver.memory_kind(ordinal, ptr) == "vmm":
                return _VMM
            raise
        block = self._blocks.get(key)
        if block is None:
            if len(self._blocks) >= 4096:      # ids are never reused: old ones only go stale
                self._blocks.clear()
            if self.driver.memory_kind(ordinal, ptr) == "vmm":
                block = _VMM
            else:
                block = self.driver.export(ordinal, ptr)
            self._blocks[key] = block
        return block

    def _vmm_chunks(self, ordinal, ptr, nbytes, oob):
        """The chunks of a VMM region, ((key, size, fd index), ...), their fds added to the
        message ``oob``; each allocation exported once (kept in ``_fds`` while used)."""
        if oob is None:
            raise RuntimeError(_NO_CHANNEL)
        found = self.driver.vmm_chunks(ordinal, ptr, nbytes)
        if not found or ptr < found[0][0] or ptr + nbytes > found[-1][0] + found[-1][1]:
            raise RuntimeError(f"CUDA region {ptr:#x}+{nbytes} is not inside the VMM "
                               f"allocations the driver found under it: {found!r:.200}")
        now, chunks = time.monotonic(), []
        for base, size, key in found:
            entry = self._fds.get((ordinal, base, size, key))
            if entry is None:
                if len(self._fds) >= MAX_IDLE_BLOCKS * 4:    # the oldest go first
                    for old in sorted(self._fds, key=lambda k: self._fds[k][1])[:MAX_IDLE_BLOCKS]:
                        del self._fds[old]
                entry = self._fds[ordinal, base, size, key] = [
                    _fds.Fd(self.driver.vmm_export(ordinal, base)), now]
            entry[1] = now
            oob.keep_alive(entry[0])          # open until the message is sent
            chunks.append((key, size, oob.add(entry[0].fd)))
        cache.start(thread=True)               # (lets the exports go once unused)
        return found[0][0], tuple(chunks)

    def expire(self, cutoff):
        """Close the VMM exports unused since ``cutoff`` (all: None); whether any is left.
        (An fd a message not yet sent carries stays open until it is.)"""
        with self._lock:
            for k in [k for k, e in self._fds.items() if cutoff is None or e[1] < cutoff]:
                del self._fds[k]
            return bool(self._fds)

    def _event(self, ordinal, stream):
        """The event recorded for this message on (ordinal, stream), or None after a sync."""
        memo = self._memo.done()
        if (ordinal, stream) in memo:
            return memo[ordinal, stream]
        free = self._free.get(ordinal)
        if free:
            ev = free.pop()
        elif self.live_events < MAX_EVENTS and self.driver.ipc_events_supported(ordinal):
            ev = _Event(ordinal, *self.driver.new_event(ordinal))
            self.live_events += 1
        else:
            self.driver.sync_stream(ordinal, stream)     # everything before put() is done
            memo[ordinal, stream] = None
            return None
        self.driver.record(ordinal, ev.event, stream)
        memo[ordinal, stream] = ev
        return ev

    def export(self, ordinal, ptr, nbytes, stream, obj):
        """The Descriptor of ``nbytes`` at device pointer ``ptr``; ``obj`` (what keeps that
        memory alive here) is held until the receiver releases it."""
        with self._lock:
            block, chunks = self._block(ordinal, ptr), None
            if block is _VMM:
                base, chunks = self._vmm_chunks(ordinal, ptr, nbytes, wire.current())
                handle, size = tuple(c[0] for c in chunks), sum(c[1] for c in chunks)
            else:
                base, size, handle = block
            offset = ptr - base
            if not 0 <= offset <= size - nbytes:
                raise RuntimeError(f"CUDA region {ptr:#x}+{nbytes} is not inside its allocation "
                                   f"{base:#x}+{size}")
            home = self._home.setdefault((handle, offset, nbytes), [obj, 0])
            home[1] += 1
            token, event = self._new_lease(ordinal, stream, obj, (handle, offset, nbytes))
        return self._descriptor(os.getpid(), _nonce, token, self.driver.device_uuid(ordinal),
                                ordinal, chunks, handle, size, offset, nbytes, event)

    def _new_lease(self, ordinal, stream, obj, home):
        """(lock held) A new lease holding ``obj`` and the message's event on ``stream``:
        (its token, the event's handle or None)."""
        ev = self._event(ordinal, stream)
        if ev is not None:
            ev.users += 1
        token = _lease.new_token()
        self.server.add(token, (obj, ev, home))
        return token, None if ev is None else ev.handle

    def _descriptor(self, owner_pid, owner, token, uuid, ordinal, chunks, handle, size, offset,
                    nbytes, event):
        """A VmmDescriptor of ``chunks``, or (None) a Descriptor of the block ``handle``."""
        if chunks is not None:
            d = VmmDescriptor(owner_pid, owner, self.server.address, token, uuid, ordinal,
                              chunks, offset, nbytes, event)
            d._check()                         # (sets its handle and block_size)
            return d
        return Descriptor(owner_pid, owner, self.server.address, token, uuid, ordinal, handle,
                          size, offset, nbytes, event)

    def forward(self, holder, stream, fds=None):
        """A received region sent on: the owner's block, with our event (our writes) and a
        lease of ours holding ``holder`` (so our mapping, and our lease with the owner).
        VMM memory: ``fds``, the Fd holders its mapping keeps, go in the message again."""
        d, chunks = holder.descriptor, None
        if isinstance(d, VmmDescriptor):
            oob = wire.current()
            if oob is None:
                raise RuntimeError(_NO_CHANNEL)
            for f in fds:
                oob.keep_alive(f)
            chunks = tuple((key, size, oob.add(f.fd)) for (key, size, _), f in zip(d.chunks, fds))
        with self._lock:
            token, event = self._new_lease(holder.ordinal, stream, holder, None)
        return self._descriptor(d.owner_pid, d.owner, token, d.uuid, d.ordinal, chunks, d.handle,
                                d.block_size, d.offset, d.nbytes, event)

    def release_own(self, d):
        """Drop the lease of a descriptor that came back to this process unclaimed."""
        return self.server.drop(d.token)

    def home(self, d):
        """The original object of a region this process exported, or None."""
        with self._lock:
            entry = self._home.get((d.handle, d.offset, d.nbytes))
        return None if entry is None else entry[0]

    def _released(self, holds):
        obj, ev, key = holds
        with self._lock:
            if key is not None:
                entry = self._home.get(key)
                if entry is not None:
                    entry[1] -= 1
                    if entry[1] == 0:
                        del self._home[key]
            if ev is not None:
                ev.users -= 1
                if ev.users == 0:
                    self._free.setdefault(ev.ordinal, []).append(ev)
        del obj                          # the sender's reference: the memory may go now


# ---------------------------------------------------------------------------------------
# Receiver
# ---------------------------------------------------------------------------------------

class _Mapping:
    __slots__ = ("ordinal", "ptr", "size", "holders", "idle_since", "fds")

    def __init__(self, ordinal, ptr, size, fds=None):
        self.ordinal, self.ptr, self.size, self.holders = ordinal, ptr, size, 0
        self.idle_since = 0.0
        self.fds = fds                # VMM memory: the Fd holders it came with (to send it on)


class Holder:
    """Kept alive by the framework objects over one received region; its death releases it."""

    __slots__ = ("descriptor", "ptr", "ordinal", "__weakref__")

    def __init__(self, descriptor, ptr, ordinal):
        self.descriptor, self.ptr, self.ordinal = descriptor, ptr, ordinal


class Importer:
    """The receiver's side: descriptors -> holders over blocks opened once, released by GC."""

    def __init__(self, driver, client):
        self.driver = driver
        self.client = client
        self._maps = {}               # (owner nonce, handle) -> _Mapping (idle: no holder)
        self._idle = 0                # how many of them are idle
        self._events = {}             # (owner nonce, event handle) -> [opened event, last use]
        self._memo = _PerMessage()     # (ordinal, event, stream) waited for in the message
        self._views = {}              # (owner, handle, offset, nbytes, kind) -> weakref
        self._lock = threading.Lock()
        self._regions = {}            # (ordinal, ptr, nbytes) -> weakref to its Holder
        self._releases = queue.SimpleQueue()
        self._thread = None
        self.opened = 0               # blocks opened (cuIpcOpenMemHandle) so far

    def cached(self, d, kind):
        """The live object remembered for this region and kind (identity), or None; on a hit
        the new lease is released at once."""
        ref = self._views.get((d.owner, d.handle, d.offset, d.nbytes, kind))
        obj = ref() if ref is not None else None
        if obj is not None:
            self.client.claim(d.lease, d.token)
            self.client.release(d.lease, d.token)
        return obj

    def remember(self, d, kind, obj):
        key = (d.owner, d.handle, d.offset, d.nbytes, kind)
        self._views[key] = weakref.ref(obj, lambda _, key=key: self._views.pop(key, None))

    def open(self, d, stream_of):
        """A Holder over the region of ``d``, ready to use on the stream ``stream_of(ordinal)``
        returns; its death (every object over it gone) releases the region."""
        self.client.claim(d.lease, d.token)          # fails first if the sender is gone
        try:
            ordinal = self.driver.local_ordinal(d.uuid)
            if ordinal is None:
                raise RuntimeError(f"a CUDA array arrived from device {d.uuid.hex()} (ordinal "
                                   f"{d.ordinal} in process {d.owner_pid}), which is not visible "
                                   "here: check CUDA_VISIBLE_DEVICES of both processes")
            key = (d.owner, d.handle)
            with self._lock:
                m = self._maps.get(key)
                if m is None:
                    if isinstance(d, VmmDescriptor):
                        m = self._import_vmm(d, ordinal)
                    else:
                        m = _Mapping(ordinal, self.driver.open(ordinal, d.handle), d.block_size)
                    self._maps[key] = m
                    self.opened += 1
                elif m.holders == 0:
                    self._idle -= 1                   # an idle block in use again
                m.holders += 1
            try:
                if d.event is not None:
                    self._wait(d, ordinal, stream_of(ordinal))
            except BaseException:
                self._unmap(key)
                raise
        except BaseException:
            self.client.release(d.lease, d.token)
            raise
        holder = Holder(d, m.ptr + d.offset, ordinal)
        region = (ordinal, holder.ptr, d.nbytes)
        self._regions[region] = weakref.ref(holder)
        f = weakref.finalize(holder, self._finalized, d, key, ordinal, stream_of, region)
        f.atexit = False                              # no CUDA calls at interpreter shutdown
        return holder

    def _import_vmm(self, d, ordinal):
        """(under the lock) The mapping of a VMM region: its chunks' fds, which came in this
        message, imported and mapped into one range of this process; dups of them kept with
        it (to send it on; closed with it). The fds that came are the channel's to close."""
        oob = wire.current()
        if oob is None:
            raise ProtocolError("a CUDA array of VMM memory arrived outside a sharedmp channel: "
                                "its fds cannot have come with it")
        fds = [oob.get(i) for _, _, i in d.chunks]    # ProtocolError: not in this message
        kept = [_fds.Fd(os.dup(fd)) for fd in fds]
        ptr = self.driver.vmm_import(ordinal, [(fd, size) for fd, (_, size, _) in
                                               zip(fds, d.chunks)])
        return _Mapping(ordinal, ptr, d.block_size, kept)

    def fds_of(self, holder):
        """The Fd holders of the VMM mapping under ``holder`` (None for legacy memory)."""
        d = holder.descriptor
        with self._lock:
            m = self._maps.get((d.owner, d.handle))
            return None if m is None else m.fds

    def _wait(self, d, ordinal, stream):
        """Make ``stream`` wait for the sender's event of ``d``: once per message, event and
        stream; the event handle opened once (the sender reuses its events)."""
        memo = self._memo.done()
        if (ordinal, d.event, stream) in memo:
            return
        key = (d.owner, d.event)
        with self._lock:
            entry = self._events.get(key)
            if entry is None:
                if len(self._events) >= MAX_OPEN_EVENTS:
                    self._close_events(sorted(self._events, key=lambda k: self._events[k][1])
                                       [:MAX_OPEN_EVENTS // 4])
                ev = self.driver.open_event(ordinal, d.event)
                entry = self._events[key] = [ev, 0.0, ordinal]
            entry[1] = time.monotonic()
            self.driver.wait(ordinal, entry[0], stream)   # (not closed meanwhile: the lock)
        memo[ordinal, d.event, stream] = True
        cache.start(thread=True)                      # (lets the handle go once idle)

    def received(self, ordinal, ptr, nbytes):
        """The live Holder of a region received here (to forward it), or None."""
        ref = self._regions.get((ordinal, ptr, nbytes))
        return ref() if ref is not None else None

    def _finalized(self, d, key, ordinal, stream_of, region):
        # Runs where the last view died (any thread): no CUDA call here, only the stream
        # this thread uses now (torch's current stream is per thread).
        ref = self._regions.get(region)
        if ref is not None and ref() is None:
            self._regions.pop(region, None)
        if sys.is_finalizing():
            return
        try:
            stream = stream_of(ordinal)
        except Exception:
            stream = None                             # (a dead context: release anyway)
        self._releases.put((d, key, ordinal, stream))
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._releaser, daemon=True,
                                                    name="sharedmp-cuda-release")
                    self._thread.start()

    def _releaser(self):
        while True:
            batch = [self._releases.get()]
            while True:                               # everything let go since: one batch
                try:
                    batch.append(self._releases.get_nowait())
                except queue.Empty:
                    break
            self._release(batch)
            del batch

    def _release(self, batch):
        """Wait for the receiver's work on the arrays of ``batch`` (one event per stream:
        recorded now, it follows all the work queued there when they died), then let the
        blocks go idle and RELEASE the leases, one write per sender."""
        marks = {}
        for _, _, ordinal, stream in batch:
            if stream is not None and (ordinal, stream) not in marks:
                try:
                    marks[ordinal, stream] = self.driver.mark(ordinal, stream)
                except Exception:
                    marks[ordinal, stream] = None
        for (ordinal, _), ev in marks.items():
            try:
                if ev is not None:
                    self.driver.finish(ordinal, ev)   # our work on that memory is done
            except Exception as e:
                warnings.warn(f"sharedmp: waiting for work on a received CUDA array failed: {e!r}",
                              RuntimeWarning)
        tokens = {}
        for d, key, _, _ in batch:
            self._unmap(key)
            tokens.setdefault(d.lease, []).append(d.token)
        for address, those in tokens.items():
            self.client.release(address, *those)

    def _unmap(self, key):
        """One holder fewer on a block; at the last, the block goes idle (kept open)."""
        with self._lock:
            m = self._maps[key]
            m.holders -= 1
            if m.holders:
                return
            m.idle_since = time.monotonic()
            self._idle += 1
            oldest = None
            if self._idle > MAX_IDLE_BLOCKS:
                oldest = min((k for k, x in self._maps.items() if not x.holders),
                             key=lambda k: self._maps[k].idle_since)
        if oldest is not None:
            self._close_blocks([oldest])
        cache.start(thread=True)                      # (lets the block go once idle)

    def _close_blocks(self, keys):
        """Close the idle blocks ``keys`` (those still idle)."""
        closing = []
        with self._lock:
            for k in keys:
                m = self._maps.get(k)
                if m is not None and not m.holders:
                    del self._maps[k]
                    self._idle -= 1
                    closing.append(m)
        for m in closing:
            try:
                if m.fds is not None:
                    m.fds = None                      # (closed once no message carries them)
                    self.driver.vmm_unmap(m.ordinal, m.ptr, m.size)
                else:
                    self.driver.close(m.ordinal, m.ptr)
            except Exception as e:
                warnings.warn(f"sharedmp: closing a received CUDA block failed: {e!r}",
                              RuntimeWarning)

    def _close_events(self, keys):
        """(under the lock) Close the opened event handles ``keys``."""
        for k in keys:
            ev, _, ordinal = self._events.pop(k)
            try:
                self.driver.close_event(ordinal, ev)
            except Exception:
                pass                                  # (its sender has exited)

    def expire(self, cutoff):
        """Let go of idle blocks and event handles unused since ``cutoff`` (all: None);
        whether any is left."""
        with self._lock:
            blocks = [k for k, m in self._maps.items()
                      if not m.holders and (cutoff is None or m.idle_since < cutoff)]
        self._close_blocks(blocks)
        with self._lock:
            self._close_events([k for k, e in self._events.items()
                                if cutoff is None or e[1] < cutoff])
            return bool(self._idle or self._events)

    def held(self):
        """(bytes of the senders' memory kept open while idle, fds kept with VMM mappings)."""
        with self._lock:
            idle = [m for m in self._maps.values() if not m.holders]
            return (sum(m.size for m in idle),
                    sum(len(m.fds) for m in self._maps.values() if m.fds is not None))

    def mappings(self):
        """{(owner, handle): holders} of the blocks in use now (idle ones are not listed)."""
        with self._lock:
            return {k: m.holders for k, m in self._maps.items() if m.holders}


# ---------------------------------------------------------------------------------------
# The process's exporter and importer, over the real driver.
# ---------------------------------------------------------------------------------------

_exporter = _importer = None
_lock = threading.Lock()


def exporter():
    global _exporter
    if _exporter is None:
        from . import driver
        with _lock:
            if _exporter is None:
                _exporter = Exporter(driver.get(), _lease.server())
    return _exporter


def importer():
    global _importer
    if _importer is None:
        from . import driver
        with _lock:
            if _importer is None:
                _importer = Importer(driver.get(), _lease.client())
    return _importer


def _expire(cutoff):
    exp, imp = _exporter, _importer
    left = exp.expire(cutoff) if exp is not None else False
    return (imp.expire(cutoff) if imp is not None else False) or left


def _held():
    """(bytes of the senders' memory kept open, fds: VMM exports and imports kept)."""
    exp, imp = _exporter, _importer
    nbytes, fds = imp.held() if imp is not None else (0, 0)
    return nbytes, fds + (len(exp._fds) if exp is not None else 0)


# (a thread of its own: CUDA calls, from no thread but the timer's; the driver runs threads)
cache.register(5, "cuda", _expire, _held, thread=True)


@forks.in_child
def _after_fork_in_child() -> None:
    global _exporter, _importer, _nonce
    if _exporter is not None:       # (CUDA is not usable in a forked child: its exports go)
        for entry in _exporter._fds.values():
            entry[0].close_inherited()
    _exporter = _importer = None
    _nonce = secrets.token_bytes(16)


forks.renew_locks(globals(), "_lock")

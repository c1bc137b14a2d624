"""What a message is, below the channels that carry it and the reducers that fill it.

Sending: ``dumps(obj)`` pickles ``obj`` with ForkingPickler's reducers while an
``OutOfBand`` is current; each segment reducer puts its segment's fd into it once and
pickles only the fd's index. A message of one array or tensor alone skips pickle: a
*frame kind* (registered by ``frame_kind``) encodes it as a fixed binary header. The
result, (payload, fds, kind), is a record that a channel sends with its fds.

Receiving: ``loads(payload, fds, kind)`` decodes the header, or unpickles with
``OutOfBand(fds)`` current so that the rebuild functions find the fds by index; the
received fds are closed afterwards whatever happens (a rebuilt array holds its own
mapping).

Out-of-band buffers (pickle protocol 5, PEP 574). A library that hands its buffers to
pickle as ``PickleBuffer`` (pyarrow, NumPy, pandas through them; any type whose
``__reduce_ex__(5)`` does) gets them moved without a copy into the pickle: each one is
copied once into the sender's shared memory (the arenas, flow control counting it) and
received as a memoryview of that mapping, read-only if it was, alive as long as any
object over it (the mapping goes with its last view). Buffers stay in band while the
message's in-band buffers total at most ``INBAND_MAX`` bytes: a message that fits one
record is faster so (measured, README). Such a message is the frame kind
``FLAG_BUFFERS``: a 4-byte length, a pickle of the buffers' places ``[(segment, offset,
nbytes, readonly)]`` (the segments travel as every segment does: fd or name), then the
message's own pickle.

Outside a sharedmp channel no ``OutOfBand`` is current (``current()`` is None) and the
reducers fall back to multiprocessing's ``DupFd``. Reducers import this module, never the
channels; the channels import it and ``fdpass`` (which moves the records and fds).
"""
from __future__ import annotations

import copyreg
import importlib
import io
import os
import pickle
import struct
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Union

from . import native
from ._compat import EXTRA_REDUCERS as _EXTRA_REDUCERS
from .errors import ProtocolError
from .memory import manager

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

_local = threading.local()


class Fds(list[int]):
    """The fds of a message being sent, and (``keep``) the objects that own them until then."""

    __slots__ = ("keep", "flight")

    # (list's own __init__ has nothing to do for an empty list)
    def __init__(self) -> None:
        self.keep: list[object] = []
        self.flight = 0                   # bytes copied into shared memory for this message


class OutOfBand:
    """The fds of one message: collected while pickling, looked up while unpickling; the
    paths of the named segments it carries (``manager.Tokens`` keeps them in flight); and
    the places of its out-of-band buffers."""

    __slots__ = ("fds", "_index", "names", "buffers", "inband", "__weakref__")

    def __init__(self, fds: list[int] | None = None) -> None:
        # (a list given: the fds received, only looked up; an Fds is what a sender fills)
        self.fds: Fds = Fds() if fds is None else fds  # type: ignore[assignment]
        self._index: dict[int, int] = {}
        self.names: list[str] = []
        # (made by the first buffer sent out of band: most messages have none)
        self.buffers: list[tuple[Any, int, int, bool]] | None = None
        self.inband = 0                   # bytes of the PickleBuffers left in band

    def buffer(self, pb: pickle.PickleBuffer) -> bool:
        """(pickle's ``buffer_callback``) Whether ``pb`` stays in band: while the message's
        in-band buffers stay within ``INBAND_MAX`` bytes, or if it is not contiguous, it
        does; else it is copied into shared memory and its place recorded (False: pickle
        writes only a reference to it)."""
        try:
            raw = pb.raw()
        except BufferError:            # not contiguous: pickle copies it in band
            return True
        if self.inband_room(raw.nbytes):
            return True
        from .memory import arena, segment
        from .strategy import get_sharing_strategy
        mapping, offset = arena.allocate(raw.nbytes, get_sharing_strategy(), zero=False)
        mapping[offset:offset + raw.nbytes] = raw
        self.keep_alive(mapping)
        self.fds.flight += raw.nbytes          # made for this message (channels/flow.py)
        if self.buffers is None:
            self.buffers = []
        self.buffers.append((segment.segment_of(mapping), offset, raw.nbytes, raw.readonly))
        return False

    def inband_room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit in the message's in-band budget (taking them if so):
        a small array not yet shared then travels by value (reductions/ndarray.py)."""
        if self.inband + nbytes <= INBAND_MAX:
            self.inband += nbytes
            return True
        return False

    def keep_alive(self, owner: object) -> None:
        """Keep ``owner`` (a mapping whose fd this message carries) alive as long as ``fds``:
        the caller holds ``fds`` until they are sent (or dup'ed)."""
        self.fds.keep.append(owner)

    def add(self, fd: int) -> int:
        """The index of ``fd`` in this message, adding it once."""
        i = self._index.get(fd)
        if i is None:
            i = self._index[fd] = len(self.fds)
            self.fds.append(fd)
        return i

    def get(self, i: int) -> int:
        if not isinstance(i, int) or not 0 <= i < len(self.fds):
            raise ProtocolError(f"message refers to fd #{i!r} but carried {len(self.fds)} fds")
        return self.fds[i]


def current() -> OutOfBand | None:
    """The OutOfBand of the message this thread is pickling or unpickling, or None."""
    return getattr(_local, "oob", None)


def swap(oob: OutOfBand | None) -> OutOfBand | None:
    """Make ``oob`` current; returns the previous one, to be restored with swap(prev)."""
    prev = getattr(_local, "oob", None)
    _local.oob = oob
    return prev


def close_all(fds: Iterable[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class _Pickler(pickle.Pickler):
    """ForkingPickler's reducers without copying its dispatch table for every message."""

    _source: tuple[int, int] | None = None
    version = 0                       # of the table: a pickler made before a change is stale

    @classmethod
    def refresh(cls) -> None:
        # ForkingPickler copies copyreg's table and its registrations on every __init__;
        # reuse the merged table until either changes.
        extra = _EXTRA_REDUCERS
        source = (len(copyreg.dispatch_table), len(extra))
        if cls._source != source:
            table = dict(copyreg.dispatch_table)
            table.update(extra)
            cls.dispatch_table, cls._source = table, source
            cls.version += 1


def reducers_changed() -> None:
    """Call after replacing a ForkingPickler registration (the count alone would not tell)."""
    _Pickler._source = None


class _Reused:
    """A thread's pickler and its buffer, reused message after message: making a pickler
    costs more than pickling a small message (0.5 of 0.75 us for an int). Its memo is
    cleared after each message (it would keep the objects alive, and refer to them in the
    next); its buffer callback goes to the message's OutOfBand."""

    __slots__ = ("buf", "pickler", "version", "oob", "busy")

    def __init__(self) -> None:
        self.buf = io.BytesIO()
        self.pickler = _Pickler(self.buf, 5, buffer_callback=self._buffer)
        self.version = _Pickler.version
        self.oob: OutOfBand | None = None
        self.busy = False

    def _buffer(self, pb: pickle.PickleBuffer) -> bool:
        return self.oob.buffer(pb)  # type: ignore[union-attr]


def _reused() -> _Reused | None:
    """This thread's pickler if it is free and current, else None (pickle with a new one: a
    reducer that sends a message of its own while its message is pickled)."""
    r = getattr(_local, "reused", None)
    if r is None or r.version != _Pickler.version:
        r = _local.reused = _Reused()
    return None if r.busy else r


# ---------------------------------------------------------------------------------------
# Frame kinds: a message of one object of a registered type alone skips pickle.
# The kind travels in the frame's flags (fdpass.KIND); 0 is a pickle.
# ---------------------------------------------------------------------------------------

FLAG_ARRAY = 1     # the payload is ``reductions.ndarray.encode_array``'s header
FLAG_TENSOR = 2    # the payload is ``reductions.torch.tensors.encode_tensor``'s header
FLAG_BUFFERS = 3   # a pickle with out-of-band buffers (the module's docstring)
# PickleBuffers in band per message, at most. Measured with lone pyarrow arrays: up to 48
# KiB in band is 1.3-1.7x faster; at 64 KiB the pickle passes a record (fdpass.RECORD) and
# goes through a memfd, and out of band is 2.2x faster.
INBAND_MAX = 48 << 10
_LENGTH = struct.Struct("<I")
_KEEP_BUFFER = 64 << 10          # a reused pickler's buffer is copied out up to this size

Reducer = Callable[[Any], Any]
Encoder = Callable[[Any, Fds], Optional[bytes]]                 # None: pickle it instead
Decoder = Callable[[Union[bytes, bytearray], list[int]], Any]
# type -> (the reducer it has while sharedmp's is registered, encode, kind); kind -> decode.
# A user's own ForkingPickler registration for the type turns its encoder off.
_encoders: dict[type[Any], tuple[Reducer, Encoder, int]] = {}
_decoders: dict[int, Decoder] = {}
_lazy: dict[int, tuple[str, str]] = {}      # kind -> (module that registers it, what it needs)


def frame_kind(kind: int, decode: Decoder, reducers: dict[type[Any], Reducer],
               encode: Encoder) -> None:
    """Register a binary frame: ``decode`` for ``kind``; ``encode`` for each type of
    ``reducers`` (type -> its sharedmp reducer)."""
    _decoders[kind] = decode
    for cls, reducer in reducers.items():
        _encoders[cls] = (reducer, encode, kind)


def lazy_frame_kind(kind: int, module: str, needs: str) -> None:
    """Frames of ``kind`` are decoded once ``module`` (which registers it, and imports
    ``needs``) is imported: a receiver imports it on its first such frame."""
    _lazy[kind] = (module, needs)


def dumps(obj: Any, tokens: manager.Tokens | None = None) -> tuple[ReadableBuffer, Fds, int]:
    """(payload, fds, kind) of ``obj``: its bytes (a pickle, or for an array or a tensor
    alone a fixed header), the fds it references (borrowed) and its frame kind.

    ``tokens``: the sending channel's (``manager.Tokens``); named segments in ``obj`` are
    then in flight until this message can no longer be received."""
    encoder = _encoders.get(type(obj))
    extra = _EXTRA_REDUCERS
    if encoder is not None and extra.get(type(obj)) is encoder[0]:
        fds = Fds()
        payload = encoder[1](obj, fds)
        if payload is not None:
            return payload, fds, encoder[2]
    plain = _dumps_plain(obj)
    if plain is not None:
        return plain, Fds(), 0
    oob = OutOfBand()
    prev = swap(oob)
    kind = 0
    try:
        body = _pickle(obj, oob)
        if oob.buffers:              # their places first: [length][places][the pickle]
            buf = io.BytesIO()
            buf.write(b"\0" * _LENGTH.size)
            _Pickler(buf, 5).dump(oob.buffers)
            _LENGTH.pack_into(buf.getbuffer(), 0, buf.tell() - _LENGTH.size)
            buf.write(body)
            del body
            body, kind = buf.getbuffer(), FLAG_BUFFERS
    finally:
        swap(prev)
    if oob.names:
        fd, owner = (tokens or manager.Tokens()).carry(oob.names)
        oob.fds.append(fd)
        oob.fds.keep.append(owner)
    return body, oob.fds, kind


# Builtin atoms: pickle writes them itself, before it looks at any reducer or dispatch table.
_ATOMS = frozenset({int, float, str, bytes, bool, type(None)})


def _dumps_plain_py(obj: Any) -> bytes | None:
    """The pickle of ``obj`` if it is a builtin atom or a tuple of them, else None: no
    reducer runs, so it needs no OutOfBand, and any pickler writes these same bytes (a
    message of an int costs 3x as much through the reused pickler's steps). The twin of
    ``_cframe.dumps_plain``."""
    t = type(obj)
    if t in _ATOMS or t is tuple and all(type(x) in _ATOMS for x in obj):
        return pickle.dumps(obj, 5)
    return None


def _pickle(obj: Any, oob: OutOfBand) -> ReadableBuffer:
    """The pickle of ``obj`` (protocol 5, out-of-band buffers to ``oob``), by this thread's
    reused pickler when it is free."""
    _Pickler.refresh()
    reused = _reused()
    if reused is None:
        buf = io.BytesIO()
        _Pickler(buf, 5, buffer_callback=oob.buffer).dump(obj)
        return buf.getbuffer()
    buf, reused.oob, reused.busy = reused.buf, oob, True
    try:
        reused.pickler.dump(obj)
        if buf.tell() > _KEEP_BUFFER:      # a large pickle keeps its buffer: a new one here
            _local.reused = None
            return buf.getbuffer()
        return buf.getvalue()              # a copy of a small one; the buffer stays
    finally:
        reused.pickler.clear_memo()
        reused.oob, reused.busy = None, False
        if _local.reused is reused:
            buf.seek(0)
            buf.truncate()


def _decoder(kind: int) -> Decoder:
    decode = _decoders.get(kind)
    if decode is None and kind in _lazy:
        module, needs = _lazy[kind]
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ProtocolError(f"a frame of flags {kind:#x} needs {needs}, which this process "
                                f"cannot import ({e}): install it here too") from None
        decode = _decoders.get(kind)
    if decode is None:
        raise ProtocolError(f"frame with unknown flags {kind:#x}: the peer is a newer or "
                            "another program, or the stream is corrupt")
    return decode


def _loads_py(payload: bytes | bytearray, fds: list[int], kind: int = 0) -> Any:
    """The object of a received frame; closes the received fds whatever happens. The twin
    of ``_cframe.loads`` (which hands it every kind but a pickle's)."""
    if kind and kind != FLAG_BUFFERS:
        try:
            return _decoder(kind)(payload, fds)
        finally:
            close_all(fds)
    prev = swap(OutOfBand(fds))
    try:
        if kind == FLAG_BUFFERS:
            return _loads_with_buffers(memoryview(payload))
        return pickle.loads(payload)
    except EOFError as e:         # pickle's "Ran out of input": not the end of the channel
        raise ProtocolError(f"a frame's payload ends before its pickle does ({len(payload)} "
                            "bytes; the peer sent raw bytes to recv(), or the stream is "
                            "corrupt)") from e
    finally:
        swap(prev)
        close_all(fds)


# The compiled twins (_c/cframe.c) where built, else these (sharedmp/native.py).
_dumps_plain, loads = _dumps_plain_py, _loads_py
_c = native.load("_cframe")
if _c is not None:
    _c.setup_wire(pickle.dumps, pickle.loads, OutOfBand, _local, _loads_py)
    _dumps_plain, loads = _c.dumps_plain, _c.loads


def _loads_with_buffers(payload: memoryview) -> Any:
    """(``OutOfBand`` current) A ``FLAG_BUFFERS`` frame: the places, then the pickle over
    views of them."""
    if len(payload) < _LENGTH.size:
        raise ProtocolError("a frame of out-of-band buffers is shorter than its header")
    (n,) = _LENGTH.unpack_from(payload)
    if n > len(payload) - _LENGTH.size:
        raise ProtocolError(f"a frame of out-of-band buffers says {n} bytes of places, but "
                            f"has {len(payload) - _LENGTH.size}")
    try:
        places = pickle.loads(payload[_LENGTH.size:_LENGTH.size + n])
    except OSError:                    # (a segment that cannot be attached says why)
        raise
    except Exception as e:
        raise ProtocolError(f"a frame's out-of-band places do not unpickle ({e!r:.100}): the "
                            "stream is corrupt or the peer hostile") from None
    if type(places) is not list:
        raise ProtocolError("a frame's out-of-band buffers must be a list of places")
    views = [_view(place) for place in places]
    return pickle.loads(payload[_LENGTH.size + n:], buffers=views)


def _view(place: Any) -> memoryview:
    """The view of one out-of-band buffer: (mapping, offset, nbytes, readonly), checked."""
    from .memory import segment
    if (type(place) is not tuple or len(place) != 4 or segment.segment_of(place[0]) is None
            or type(place[1]) is not int or type(place[2]) is not int
            or type(place[3]) is not bool):
        raise ProtocolError(f"an out-of-band buffer's place must be (segment, offset, nbytes, "
                            f"readonly), got {place!r:.100}: the message is corrupt or hostile")
    mapping, offset, nbytes, readonly = place
    if not 0 <= offset <= offset + nbytes <= len(mapping) or nbytes < 0:
        raise ProtocolError(f"an out-of-band buffer of {nbytes} bytes at {offset} does not fit "
                            f"its segment of {len(mapping)} bytes")
    view = memoryview(mapping)[offset:offset + nbytes]
    return view.toreadonly() if readonly else view

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
import threading
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Union

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
    """The fds of one message: collected while pickling, looked up while unpickling; and
    the paths of the named segments it carries (``manager.Tokens`` keeps them in flight)."""

    __slots__ = ("fds", "_index", "names")

    def __init__(self, fds: list[int] | None = None) -> None:
        # (a list given: the fds received, only looked up; an Fds is what a sender fills)
        self.fds: Fds = Fds() if fds is None else fds  # type: ignore[assignment]
        self._index: dict[int, int] = {}
        self.names: list[str] = []

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

    @classmethod
    def refresh(cls) -> None:
        # ForkingPickler copies copyreg's table and its registrations on every __init__;
        # reuse the merged table until either changes.
        extra = ForkingPickler._extra_reducers  # type: ignore[attr-defined]
        source = (len(copyreg.dispatch_table), len(extra))
        if cls._source != source:
            table = dict(copyreg.dispatch_table)
            table.update(extra)
            cls.dispatch_table, cls._source = table, source


def reducers_changed() -> None:
    """Call after replacing a ForkingPickler registration (the count alone would not tell)."""
    _Pickler._source = None


# ---------------------------------------------------------------------------------------
# Frame kinds: a message of one object of a registered type alone skips pickle.
# The kind travels in the frame's flags (fdpass.KIND); 0 is a pickle.
# ---------------------------------------------------------------------------------------

FLAG_ARRAY = 1     # the payload is ``reductions.ndarray.encode_array``'s header
FLAG_TENSOR = 2    # the payload is ``reductions.torch.tensors.encode_tensor``'s header

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
    extra = ForkingPickler._extra_reducers  # type: ignore[attr-defined]
    if encoder is not None and extra.get(type(obj)) is encoder[0]:
        fds = Fds()
        payload = encoder[1](obj, fds)
        if payload is not None:
            return payload, fds, encoder[2]
    oob = OutOfBand()
    prev = swap(oob)
    try:
        buf = io.BytesIO()
        _Pickler.refresh()
        _Pickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    finally:
        swap(prev)
    if oob.names:
        fd, owner = (tokens or manager.Tokens()).carry(oob.names)
        oob.fds.append(fd)
        oob.fds.keep.append(owner)
    return buf.getbuffer(), oob.fds, 0


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


def loads(payload: bytes | bytearray, fds: list[int], kind: int = 0) -> Any:
    """The object of a received frame; closes the received fds whatever happens."""
    if kind:
        try:
            return _decoder(kind)(payload, fds)
        finally:
            close_all(fds)
    prev = swap(OutOfBand(fds))
    try:
        return pickle.loads(payload)
    except EOFError as e:         # pickle's "Ran out of input": not the end of the channel
        raise ProtocolError(f"a frame's payload ends before its pickle does ({len(payload)} "
                            "bytes; the peer sent raw bytes to recv(), or the stream is "
                            "corrupt)") from e
    finally:
        swap(prev)
        close_all(fds)

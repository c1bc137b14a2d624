"""Arrow buffers already in sharedmp memory travel as its handle; pandas' Arrow columns too.

pyarrow pickles a ``Buffer`` as its bytes: in band through the standard library's pickler
(process arguments under spawn and forkserver, the standard library's queues), out of band
on sharedmp's channels, where ``wire.py`` copies them into fresh shared memory. Either way,
a buffer sent to N workers costs N copies. A buffer that lies in sharedmp memory already (a
frame ``mp.share_dataset`` rebuilt over shared memory, a record of a ``SharedList``, one
received from another process) is sent here as its segment's handle and offset instead:
sending it again, or to more workers, adds no memory. Any other buffer is pickled as pyarrow
pickles it.

pandas pickles an Arrow column (``ArrowExtensionArray`` and its subclasses, among them
``ArrowStringArray``: pandas 3's default strings) as its chunks combined into new memory, a
copy at each pickling. A column whose chunks all lie in sharedmp memory is pickled as those
chunks (pandas' ``__setstate__`` takes a list of chunks as they are), so that their buffers
go through the reducer above; any other column as pandas pickles it.

Installed by the registry once pyarrow (pandas) is imported; neither is imported here.
"""
from __future__ import annotations

import copyreg
import importlib
from typing import Any, SupportsIndex

from ..errors import ProtocolError
from ..memory import segment


def reduce_arrow_buffer(buf: Any) -> tuple[Any, ...]:
    if buf.is_cpu and buf.size:
        seg, _ = segment.containing(buf.address, buf.size)
        if seg is not None:
            return rebuild_arrow_buffer, (seg, buf.address - seg.address, buf.size)
    return _same, (_ByValue(buf),)


def rebuild_arrow_buffer(mapping: Any, offset: int, size: int) -> Any:
    pa = importlib.import_module("pyarrow")      # (a spawned worker may not have it yet)
    if not (type(offset) is int and type(size) is int and 0 <= offset
            and 0 < size <= len(mapping) - offset):
        raise ProtocolError(f"an Arrow buffer of {size!r} bytes at {offset!r} lies outside "
                            f"its segment of {len(mapping)} bytes")
    return pa.py_buffer(memoryview(mapping)[offset:offset + size].toreadonly())


def reduce_pandas_arrow(arr: Any) -> tuple[Any, ...]:
    chunked = getattr(arr, "_pa_array", None)
    if chunked is not None and chunked.num_chunks and _in_sharedmp(chunked):
        state = dict(arr.__dict__)
        state["_pa_array"] = chunked.chunks        # (pa.chunked_array() of them on the way in)
        state["_cache"] = {}
        return copyreg.__newobj__, (type(arr),), state  # type: ignore[attr-defined]
    # As pandas pickles it (its __getstate__; the same for every protocol from 2). Not through
    # _ByValue: pickle checks that a __newobj__ reduction names the class of what it saves.
    return arr.__reduce_ex__(2)


def pandas_arrow_classes(pd: Any) -> list[type]:
    """pandas' Arrow column classes (``ArrowExtensionArray`` and its subclasses), or []."""
    base = getattr(getattr(pd, "arrays", None), "ArrowExtensionArray", None)
    classes = [base] if base is not None else []
    for cls in classes:                # (grows as it goes: subclasses of subclasses)
        classes.extend(c for c in cls.__subclasses__() if c not in classes)
    return classes


def _in_sharedmp(chunked: Any) -> bool:
    """Whether every buffer of a pyarrow ChunkedArray lies in sharedmp memory."""
    for chunk in chunked.chunks:
        for buf in chunk.buffers():
            if buf is not None and buf.size and (
                    not buf.is_cpu or segment.containing(buf.address, buf.size)[0] is None):
                return False
    return True


class _ByValue:
    """An object pickled as its own type pickles it, for the protocol of the pickler (a
    reducer in a dispatch table is not told the protocol: this object's __reduce_ex__ is)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        return self.obj.__reduce_ex__(protocol)


def _same(x: Any) -> Any:
    return x

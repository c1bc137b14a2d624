"""How a segment travels: its fd (in band on sharedmp channels, DupFd elsewhere) or its name
(with a reference in flight at the manager daemon, see ``memory/daemon.py``).

Pickling a ``Segment`` yields the receiver's mapping of it. Every array of a message that
views one segment refers to the same Segment object, so pickle's memo sends it once.
"""
import os

from multiprocessing.reduction import DupFd

from .. import wire
from ..memory import manager, named, segment


def reduce_segment(seg):
    oob = wire.current()
    if seg.kind == "file_system":
        # A reference in flight, told to the daemon before the message can leave: the name
        # stays valid after the sender drops it or exits, until a receiver attaches. On a
        # sharedmp channel the message's token holds it (see manager.py), elsewhere a count.
        if oob is not None:
            oob.names.append(seg.path)
            return rebuild_name_in_band, (seg.name,)
        manager.sent(seg.path)
        return rebuild_name, (seg.name, manager.address())
    if oob is not None:
        return rebuild_fd_in_band, (oob.add(seg.fd),)
    return rebuild_fd_dup, (DupFd(seg.fd),)


def rebuild_name(name, daemon):
    # (a standard library channel) The receiver may not have talked to a daemon yet (a child
    # sent it to a parent that never needed one): it uses the sender's, which counts the
    # reference in flight.
    manager.adopt(daemon)
    return named.attach_name(name)


def rebuild_name_in_band(name):
    # The message's token holds the reference in flight: this process holds the name now.
    # (The token is the message's last fd: named with a new mapping, its reference ends.)
    oob = wire.current()
    return named.attach_name(name, consume=False, token=oob.fds[-1] if oob and oob.fds else -1)


def rebuild_fd_in_band(index):
    oob = wire.current()
    if oob is None:
        raise RuntimeError("an in-band segment fd can only be unpickled by a sharedmp channel")
    return segment.attach_fd(oob.get(index))  # the channel closes the fds it received


def rebuild_fd_dup(dupfd):
    fd = dupfd.detach()
    try:
        return segment.attach_fd(fd)
    finally:
        os.close(fd)

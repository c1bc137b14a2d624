"""Owned fds (sharedmp/fds.py): closed once, by their holder, in the process that owns them."""
import gc
import os

import numpy as np
import pytest

import sharedmp as mp
from sharedmp import fds
from sharedmp.channels import flow
from sharedmp.memory import manager, recycle
from sharedmp.memory.views import mapping_of

from conftest import fork_and_wait


def is_open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def held_read_end():
    """An Fd holding a pipe's read end (the write end closed), and its number."""
    r, w = os.pipe()
    os.close(w)
    return fds.Fd(r), r


def test_close_is_once_and_leaves_minus_one():
    h, r = held_read_end()
    h.close()
    assert h.fd == -1 and not is_open(r)
    other = os.open(os.devnull, os.O_RDONLY)     # may reuse r's number
    try:
        h.close()                                 # a second close closes nothing
        del h
        gc.collect()
        assert is_open(other)
    finally:
        os.close(other)


def test_the_holder_going_closes_its_fd():
    h, r = held_read_end()
    del h
    gc.collect()
    assert not is_open(r)


def test_a_forked_childs_copy_never_closes_the_parents_number():
    h, r = held_read_end()

    def child():
        os.close(r)                               # (as the forks.in_child hooks do)
        other = os.open(os.devnull, os.O_RDONLY)
        os.dup2(other, r)                         # another file under the same number
        h.close()                                 # the parent's holder, copied: closes nothing
        return is_open(r)

    assert fork_and_wait(child) == 0
    assert is_open(r)                             # the parent's own is untouched
    h.close()
    assert not is_open(r)


def test_take_hands_the_fd_over():
    h, r = held_read_end()
    assert h.take() == r and h.fd == -1
    del h
    gc.collect()
    assert is_open(r)                             # the new owner's now
    os.close(r)


def test_close_inherited_closes_the_childs_copy_only():
    h, r = held_read_end()

    def child():
        h.close_inherited()
        return h.fd == -1 and not is_open(r)

    assert fork_and_wait(child) == 0
    assert is_open(r) and h.fd == r
    h.close()


def test_a_queues_held_dups_are_owned_and_a_forked_child_closes_its_copies():
    q = mp.get_context("fork").Queue()
    a = mp.zeros(10)                              # an arena's fd, as put() holds it
    held = q._held.take([mapping_of(a)[1].fd])
    dup = held[0][0]
    assert isinstance(dup, fds.Fd) and is_open(dup.fd)
    number = dup.fd
    assert fork_and_wait(lambda: not is_open(number) and not q._held._held and dup.fd == -1) == 0
    assert is_open(number) and dup.fd == number   # the parent's untouched
    q._held.release(held)
    assert dup.fd == -1 and not is_open(number)
    q.close()


def test_the_pools_private_fds_are_owned_and_a_forked_child_closes_its_copies(pool_stays):
    if not recycle.limit():
        pytest.skip("recycling is off ($SHAREDMP_RECYCLE_BYTES=0)")
    recycle.clear()
    a = mp.empty(4 << 20, dtype=np.uint8)        # a segment of its own, not an arena's
    if mapping_of(a)[1].kind != "file_descriptor":
        pytest.skip("needs the file_descriptor strategy")
    del a
    gc.collect()
    entries = [e for e in list(recycle._entries) if e[4] is None]
    assert entries and all(isinstance(e[2], fds.Fd) for e in entries)
    numbers = [e[2].fd for e in entries]
    assert fork_and_wait(lambda: recycle.kept() == (0, 0)
                      and not any(is_open(n) for n in numbers)) == 0
    assert all(is_open(n) for n in numbers)       # the parent's pool keeps its own
    recycle.clear()
    assert not any(is_open(n) for n in numbers)


def test_token_pipes_end_when_every_write_end_is_closed():
    r, w = fds.pipe()
    w2 = os.dup(w)
    assert fds.ended([r]) == []
    os.close(w)
    assert fds.ended([r]) == []
    os.close(w2)
    assert fds.ended([r]) == [r]
    assert fds.ended([r], wait=True) == [r]
    os.close(r)


def test_a_window_dropped_with_tokens_open_closes_their_read_ends():
    assert not hasattr(flow.Window, "__del__")    # closed by fds.own, not __del__
    w = flow.Window()
    w.limit, w.step = 1 << 20, 1
    r, wr = w.open(100)
    os.close(wr)                                  # (the message was "sent": its copy gone)
    assert is_open(r)
    del w
    gc.collect()
    assert not is_open(r)


def test_the_manager_and_flow_share_one_token_mechanism():
    assert not hasattr(manager, "ended") and not hasattr(manager, "_close_unless_forked")
    with pytest.raises(AttributeError):
        flow.manager                               # flow control needs no daemon client


def test_a_forked_child_closes_its_copies_of_cudas_exported_fds():
    from sharedmp.cuda import ipc                 # (no GPU needed: the hook's fds are pipes)
    h, r = held_read_end()
    exporter = ipc.Exporter.__new__(ipc.Exporter)
    exporter._fds = {(0, 0, 1, 0): [h, 0.0]}
    del h
    saved, ipc._exporter = ipc._exporter, exporter
    try:
        assert fork_and_wait(lambda: ipc._exporter is None and not is_open(r)) == 0
        assert is_open(r)
    finally:
        ipc._exporter = saved
        exporter._fds.clear()
    gc.collect()
    assert not is_open(r)

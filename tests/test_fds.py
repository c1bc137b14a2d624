"""Owned fds (sharedmp/fds.py): closed once, by their holder, in the process that owns them."""
import gc
import os

import pytest

from sharedmp import fds
from sharedmp.channels import flow
from sharedmp.memory import manager


def is_open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def test_close_is_once_and_leaves_minus_one():
    r, w = os.pipe()
    os.close(w)
    h = fds.Fd(r)
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
    r, w = os.pipe()
    os.close(w)
    h = fds.Fd(r)
    del h
    gc.collect()
    assert not is_open(r)


def test_a_forked_childs_copy_never_closes_the_parents_number():
    r, w = os.pipe()
    os.close(w)
    h = fds.Fd(r)
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            os.close(r)                           # (as the forks.in_child hooks do)
            other = os.open(os.devnull, os.O_RDONLY)
            os.dup2(other, r)                     # another file under the same number
            h.close()                             # the parent's holder, copied: closes nothing
            code = 0 if is_open(r) else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert is_open(r)                             # the parent's own is untouched
    h.close()
    assert not is_open(r)


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

"""CUDA arrays across processes: what runs without a GPU, and the GPU tests (skipped here).

Without a GPU the CUDA driver is the one stand-in (``_cuda_workers.FakeDriver``); the
descriptor, the sender's and receiver's bookkeeping, forwarding, the lease servers and
clients, sockets and processes are real. The GPU itself is checked by
``scripts/gpu_check.py`` and by the tests marked ``needs_gpu`` below.
"""
import json
import os
import signal
import subprocess
import sys
import time
import warnings

import pytest

import sharedmp as mp
from sharedmp.cuda import ipc, lease
from sharedmp.errors import ProtocolError

import _cuda_workers as cw
import _workers as w
from conftest import TIMEOUT, join_or_kill

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")


def _gpu_probe():
    """Why CUDA tests cannot run here, or None. Probed in a child: cuInit in the test
    process would forbid the fork tests that follow."""
    code = ("import sys\n"
            "try:\n"
            "    import torch\n"
            "except ImportError:\n"
            "    sys.exit('torch is not installed')\n"
            "if not torch.cuda.is_available(): sys.exit('torch sees no CUDA GPU')\n"
            "from sharedmp.cuda import driver\n"
            "why = driver.available()\n"
            "sys.exit(why)\n")
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "the GPU probe timed out"
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["probe failed"])[-1]


NO_GPU = _gpu_probe()
needs_gpu = pytest.mark.skipif(NO_GPU is not None, reason=f"no usable CUDA GPU: {NO_GPU}")


def descriptor(**kw):
    fields = dict(owner_pid=123, owner=b"o" * 16, lease=b"\0sharedmp-cuda-123-abc", token=b"t" * 16,
                  uuid=b"u" * 16, ordinal=0, handle=b"h" * 64, block_size=2 << 20, offset=512,
                  nbytes=1024, event=b"e" * 64)
    fields.update(kw)
    return ipc.Descriptor(**fields)


# -- the descriptor ----------------------------------------------------------------------

def test_descriptor_round_trip():
    d = descriptor()
    wire = d.encode()
    assert wire[:2] == (ipc.VERSION, ipc.KIND)
    back = ipc.Descriptor.decode(wire)
    assert [getattr(back, f) for f in ipc.Descriptor.FIELDS] == [getattr(d, f) for f in ipc.Descriptor.FIELDS]
    assert ipc.Descriptor.decode(descriptor(event=None).encode()).event is None


@pytest.mark.parametrize("wire, words", [
    ("not a tuple", "must be a tuple"),
    ((2, ipc.KIND) + descriptor().encode()[2:], "same sharedmp version"),
    ((1, "vmm-dmabuf") + descriptor().encode()[2:], "same sharedmp version"),
    ((1, ["a list"]) + descriptor().encode()[2:], "same sharedmp version"),
    ((1, "vmm-fd") + descriptor().encode()[2:], "has 10 fields, got 11"),
    (descriptor().encode()[:-1], "fields"),
    (descriptor(handle=b"h" * 63).encode(), "handle must be 64 bytes"),
    (descriptor(token="t" * 16).encode(), "token must be 16 bytes"),
    (descriptor(offset=-1).encode(), "offset must be an int >= 0"),
    (descriptor(nbytes=1.5).encode(), "nbytes must be an int"),
    (descriptor(nbytes=0).encode(), "nbytes must be > 0"),
    (descriptor(offset=(2 << 20) - 8).encode(), "fit in the block"),
    (descriptor(event=b"e" * 8).encode(), "event must be None or 64 bytes"),
    (descriptor(lease=b"/tmp/sock").encode(), "lease must be a sharedmp lease server address"),
    (descriptor(ordinal=True).encode(), "ordinal must be an int"),
])
def test_malformed_descriptors_raise_protocol_error(wire, words):
    with pytest.raises(ProtocolError, match=words):
        ipc.Descriptor.decode(wire)


# -- the lease server, with real sockets -----------------------------------------------

@pytest.fixture
def server():
    released = []
    s = lease.LeaseServer(on_release=released.append)
    s.released = released
    yield s
    s.close()


def until(cond, timeout=10):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_claim_release_double_release_and_foreign_release(server):
    t1, t2 = lease.new_token(), lease.new_token()
    server.add(t1, "one")
    server.add(t2, "two")
    a, b = lease.LeaseClient(), lease.LeaseClient()
    try:
        a.claim(server.address, t1)
        b.release(server.address, t1)            # not b's claim: ignored
        assert until(lambda: server.ignored == 1)
        assert server.outstanding() == 2 and server.released == []
        a.release(server.address, t1)
        assert until(lambda: server.released == ["one"])
        a.release(server.address, t1)            # twice: ignored, frees nothing else
        a.claim(server.address, t1)              # a released token cannot be claimed again
        assert until(lambda: server.ignored == 3)
        assert server.outstanding() == 1 and server.released == ["one"]
        assert [t for t, _ in server.pending()] == [t2]
        assert server.drop(t2) and server.released == ["one", "two"]
        assert not server.drop(t2) and server.wait_idle(1)
    finally:
        a.close()
        b.close()


def test_claimed_lease_cannot_be_dropped_and_eof_frees_it(server):
    t = lease.new_token()
    server.add(t, "held")
    c = lease.LeaseClient()
    c.claim(server.address, t)
    assert until(lambda: server.claimed_by() == {os.getpid(): 1})
    assert not server.drop(t) and server.outstanding() == 1
    c.close()                                    # the receiver goes away: EOF
    assert until(lambda: server.released == ["held"])
    assert server.pending() == []


def test_malformed_record_closes_that_connection_and_frees_its_leases(server):
    import socket
    t = lease.new_token()
    server.add(t, "x")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(server.address)
    try:
        s.sendall(lease.CLAIM + t + b"Z" * lease.RECORD)
        assert until(lambda: server.released == ["x"])
        assert s.recv(1) == b""                  # the server closed it
    finally:
        s.close()


def test_claim_to_an_exited_sender_raises_and_release_warns_once():
    s = lease.LeaseServer()
    t = lease.new_token()
    s.add(t, "x")
    address = s.address
    s.close()
    c = lease.LeaseClient()
    with pytest.raises(RuntimeError, match="exited"):
        c.claim(address, t)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c.release(address, t)                    # known dead: silently dropped


def test_a_receiver_sigkilled_frees_its_leases(server):
    ctx = mp.get_context("spawn")
    tokens = [lease.new_token() for _ in range(100)]
    for i, t in enumerate(tokens):
        server.add(t, i)
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=cw.claim_and_die, args=(child, server.address, tokens))
    p.start()
    child.close()
    try:
        assert parent.poll(TIMEOUT) and parent.recv() == "claimed"
        assert join_or_kill(p) == -signal.SIGKILL
        assert until(lambda: server.outstanding() == 0, TIMEOUT)
        assert sorted(server.released) == list(range(100))
    finally:
        parent.close()


def _sender(timeout):
    env = dict(os.environ, SHAREDMP_CUDA_EXIT_TIMEOUT=str(timeout),
               PYTHONPATH=os.pathsep.join([HERE, SRC, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "_cuda_workers.py")], env=env,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    address, token = p.stdout.readline().split()
    return p, bytes.fromhex(address), bytes.fromhex(token)


def test_sender_exit_waits_bounded_and_warns_while_a_receiver_holds():
    p, address, token = _sender(1)
    c = lease.LeaseClient()
    try:
        c.claim(address, token)
        t0 = time.monotonic()
        _, err = p.communicate("exit\n", timeout=TIMEOUT)
        waited = time.monotonic() - t0
    finally:
        c.close()
        p.kill()
    assert p.returncode == 0
    assert "still in use by other processes" in err and "waiting up to 1 s" in err
    assert "exiting with 1 CUDA array(s) still held" in err
    assert waited >= 0.9                         # a lower bound: it did wait


def test_sender_exit_ends_its_wait_when_the_receiver_releases():
    p, address, token = _sender(TIMEOUT)
    c = lease.LeaseClient()
    try:
        c.claim(address, token)
        p.stdin.write("exit\n")
        p.stdin.flush()
        time.sleep(0.3)
        c.release(address, token)
        _, err = p.communicate(timeout=TIMEOUT)  # far less than TIMEOUT: it would fail the test
    finally:
        c.close()
        p.kill()
    assert p.returncode == 0
    assert "exiting with" not in err


def test_the_exit_rule_stops_waiting_for_unclaimed_leases_sooner():
    server = lease.LeaseServer()
    try:
        server.add(b"p" * 16, "pending")
        t0 = time.monotonic()
        assert not server.wait_idle(TIMEOUT, unclaimed=0.2)   # only pending: 0.2 s
        assert time.monotonic() - t0 < TIMEOUT / 2
        c = lease.LeaseClient()
        try:
            c.claim(server.address, b"p" * 16)
            assert until(lambda: server.claimed_by(), TIMEOUT)
            t0 = time.monotonic()
            assert not server.wait_idle(0.5, unclaimed=0.0)   # claimed: the full timeout
            assert time.monotonic() - t0 >= 0.45
        finally:
            c.close()
    finally:
        server.close()


def test_cuda_ipc_deadlock_learner_exits_with_a_message_nobody_takes(monkeypatch):
    # torch's test_cuda_ipc_deadlock: both processes gone within join(10). Here even with
    # a 60 s exit timeout: what nobody claimed holds the learner only the unclaimed wait.
    monkeypatch.setenv("SHAREDMP_CUDA_EXIT_TIMEOUT", "60")
    ctx = mp.get_context("spawn")
    q = ctx.Queue(1)
    procs = [ctx.Process(target=cw.deadlock_actor, args=(q, 100)),
             ctx.Process(target=cw.deadlock_learner, args=(q, 100, 1.5))]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(10)
        assert [p.is_alive() for p in procs] == [False, False]
        assert [p.exitcode for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)


def test_a_sender_that_returns_at_once_still_delivers_to_a_late_receiver():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    parent, child = ctx.Pipe()
    receiver = ctx.Process(target=cw.take_late, args=(child, q, 1.0))
    sender = ctx.Process(target=cw.put_one_and_return, args=(q,))
    receiver.start()
    sender.start()
    try:
        ok, info = parent.recv() if parent.poll(TIMEOUT) else (False, "no report")
        assert ok, info
        assert info == {"nbytes": 128, "opens": 1, "unmapped": True}
        assert join_or_kill(sender) == 0 and join_or_kill(receiver) == 0
    finally:
        for p in (sender, receiver):
            if p.is_alive():
                p.kill()


# -- VMM memory (expandable segments): fds in the message -----------------------------------

def vmm_descriptor(**kw):
    fields = dict(owner_pid=123, owner=b"o" * 16, lease=b"\0sharedmp-cuda-123-abc", token=b"t" * 16,
                  uuid=b"u" * 16, ordinal=0, chunks=((7, 2 << 20, 0), (8, 2 << 20, 1)),
                  offset=512, nbytes=3 << 20, event=b"e" * 64)
    fields.update(kw)
    return ipc.VmmDescriptor(**fields)


def test_vmm_descriptor_round_trip():
    wire = vmm_descriptor().encode()
    assert wire[:2] == (ipc.VERSION, ipc.KIND_VMM)
    back = ipc.Descriptor.decode(wire)
    assert type(back) is ipc.VmmDescriptor and back.encode() == wire
    assert back.handle == (7, 8) and back.block_size == 4 << 20


@pytest.mark.parametrize("bad, words", [
    (dict(chunks=()), "chunks must be 1 to"),
    (dict(chunks=[(7, 2 << 20, 0)]), "chunks must be 1 to"),
    (dict(chunks=((7, 0, 0),)), "chunks must be 1 to"),
    (dict(chunks=((7, 2 << 20, -1),)), "chunks must be 1 to"),
    (dict(chunks=((7, 2 << 20),)), "chunks must be 1 to"),
    (dict(chunks=((7, 2 << 20, 0), (8, 2 << 20, 0))), "distinct fds"),
    (dict(chunks=((1, 1, 0),) * (ipc.MAX_CHUNKS + 1)), "chunks must be 1 to"),
    (dict(offset=3 << 20), "nbytes must be > 0 and fit"),
    (dict(nbytes=0), "nbytes must be > 0 and fit"),
    (dict(event=b"e"), "event must be None or 64 bytes"),
])
def test_malformed_vmm_descriptors_raise_protocol_error(bad, words):
    with pytest.raises(ProtocolError, match=words):
        ipc.Descriptor.decode(vmm_descriptor(**bad).encode())


def test_vmm_chunks_whose_fds_did_not_come_are_a_protocol_error_and_nothing_leaks():
    from sharedmp import wire
    imp = ipc.Importer(cw.FakeDriver(), lease.LeaseClient())
    d = ipc.Descriptor.decode(vmm_descriptor(chunks=((7, cw.CHUNK, 0), (8, cw.CHUNK, 5))).encode())
    fd = os.memfd_create("fake-vmm-0", os.MFD_CLOEXEC)
    prev = wire.swap(wire.OutOfBand([fd]))
    try:
        with pytest.raises(ProtocolError, match="refers to fd #5 but carried 1 fds"):
            imp._import_vmm(d, 0)
    finally:
        wire.swap(prev)
        os.close(fd)
    assert cw.vmm_fds() == 0 and imp.driver.calls["vmm_import"] == 0


def test_vmm_memory_travels_as_fds_which_are_closed_after_release():
    ctx = mp.get_context("spawn")
    q, go = ctx.Queue(), ctx.Event()
    sent, got = _sender_and_receiver(ctx, cw.vmm_sender, (q, go), cw.vmm_receiver, (q,), go)
    # The sender exported chunks 0, 1 and 2 once each; the receiver imported what each array
    # lies on (a: chunks 0 and 1 in one range; b: chunk 2), kept dups of them (to send them
    # on) and closed them with its mappings; the legacy array went as a handle.
    assert got["kinds"] == ["VmmDescriptor", "VmmDescriptor", "Descriptor"]
    assert got["imported"] == [0, 2 * cw.MiB, 4 * cw.MiB]
    assert got["mapped"] == [2 * cw.MiB, 4 * cw.MiB] and got["vmm_fds_held"] == 3
    assert got["unmapped"] and got["fds_left"] == 0 and got["mapped_left"] == 0
    assert sent == {"fds_while_sent": 3, "released": True, "fds_left": 0}


def test_vmm_receiver_killed_while_holding_frees_the_senders_leases_and_fds():
    ctx = mp.get_context("spawn")
    q, go = ctx.Queue(), ctx.Event()
    prod, pconn = _start(ctx, cw.vmm_sender, q, go)
    cons, cconn = _start(ctx, cw.vmm_receiver, q, True)
    try:
        status, info = w.recv(cons, cconn)
        assert status == "holding" and info["vmm_fds_held"] == 3
        os.kill(cons.pid, signal.SIGKILL)
        assert join_or_kill(cons) == -signal.SIGKILL
        go.set()
        sent = w.result(prod, pconn)
    finally:
        pconn.close()
        cconn.close()
    assert sent == {"fds_while_sent": 3, "released": True, "fds_left": 0}


def test_vmm_sender_killed_the_receiver_still_lets_go_of_everything():
    ctx = mp.get_context("spawn")
    q, go, received, died = ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Event()
    prod, pconn = _start(ctx, cw.vmm_sender, q, go, received)
    cons, cconn = _start(ctx, cw.vmm_receiver, q, False, received, died)
    try:
        assert w.recv(prod, pconn)[0] == "sent"
        assert join_or_kill(prod) == -signal.SIGKILL
        died.set()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = w.result(cons, cconn)
    finally:
        pconn.close()
        cconn.close()
    assert got["unmapped"] and got["fds_left"] == 0 and got["mapped_left"] == 0


def _chain(producer, end, owner_pid=False):
    """(first, middle, last, first's pid): what ``producer`` (q, go), ``forward`` and ``end``
    (q, and the first's pid if ``owner_pid``) report, the arrays sent along them."""
    ctx = mp.get_context("spawn")
    q1, q2, go, done = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
    prod, pconn = _start(ctx, producer, q1, go)
    mid, mconn = _start(ctx, cw.forward, q1, q2, done)
    end, econn = _start(ctx, end, q2, *((prod.pid,) if owner_pid else ()))
    try:
        last = w.result(end, econn)
        done.set()
        middle = w.result(mid, mconn)
        go.set()
        first = w.result(prod, pconn)
    finally:
        for c in (pconn, mconn, econn):
            c.close()
    return first, middle, last, prod.pid


def test_vmm_memory_forwarded_along_a_chain_carries_the_owners_fds():
    first, middle, last, _ = _chain(cw.vmm_sender, cw.vmm_receiver)
    # the end imported the owner's chunks (the middle sent its dups of the owner's fds)
    assert last["kinds"] == ["VmmDescriptor", "VmmDescriptor", "Descriptor"]
    assert last["imported"] == [0, 2 * cw.MiB, 4 * cw.MiB] and last["fds_left"] == 0
    assert middle["unmapped"] and middle["outstanding"] == 0
    assert first == {"fds_while_sent": 3, "released": True, "fds_left": 0}


def test_memory_neither_kind_carries_raises_in_put_and_vmm_needs_a_channel():
    got = w.run(mp.get_context("spawn"), cw.vmm_refusals)
    assert got["managed"].startswith("CudaError") and "not managed memory" in got["managed"]
    assert got["outside"].startswith("RuntimeError")
    assert "only sharedmp's channels carry them" in got["outside"]
    assert "expandable_segments:False" in got["outside"]
    assert got["legacy_outside"] == "DevArray" and got["fds_left"] == 0


# -- the whole path with the stand-in driver, real processes and queues -------------------

def _sender_and_receiver(ctx, sender, sender_args, receiver, receiver_args, then=None):
    """(what ``sender`` reports, what ``receiver`` reports), each run in a child of ``ctx``:
    the receiver's report first, then ``then`` (an Event the sender waits on) is set."""
    prod, pconn = _start(ctx, sender, *sender_args)
    cons, cconn = _start(ctx, receiver, *receiver_args)
    try:
        got = w.result(cons, cconn)
        if then is not None:
            then.set()
        return w.result(prod, pconn), got
    finally:
        pconn.close()
        cconn.close()


def _start(ctx, target, *args):
    return w.start(ctx, target, *args)


def test_send_receive_release_with_one_mapping_per_block():
    ctx = mp.get_context("spawn")
    q, go, done = ctx.Queue(), ctx.Event(), ctx.Event()
    sent, info = _sender_and_receiver(ctx, cw.produce, (q, go), cw.consume, (q, done), go)
    # a and b share a block: two blocks opened once each; a's and b's pointers keep their
    # distance; one event for the message, waited for once; released, the blocks stay open
    # (idle, counted in the "cuda" cache) until mp.empty_cache()
    assert info["opens"] == 2 and info["b_minus_a"] == 4096 - 256
    assert info["same_holder_block"] == [1, 2] and info["waits"] == 1
    assert info["unmapped"] and info["closes_while_idle"] == 0
    assert info["idle_bytes"] == 2 * cw.MiB and info["closes"] == 2
    assert sent == {"sent": 3, "pending": 0, "exports": 2, "events": 1, "records": 1, "released": True,
                    "ignored": 0, "home_left": 0, "free_events": 1}


@pytest.mark.parametrize("memory", ["legacy", "vmm"])
@pytest.mark.parametrize("per_msg", [1, 100])
def test_driver_calls_per_message_in_steady_state(per_msg, memory):
    # The counts the README states. The first message asks what the memory is, exports the
    # block, opens it and the event and creates the event; from then on nothing a cache could
    # avoid (VMM memory: where the allocations under each array lie, asked per array).
    ctx = mp.get_context("spawn")
    q, acks = ctx.Queue(), ctx.Queue()
    n = 6
    base = 5 * cw.MiB if memory == "legacy" else cw.VMM + 4 * cw.MiB
    sent, got = _sender_and_receiver(ctx, cw.steady_sender, (q, acks, n, per_msg, base),
                                     cw.steady_receiver, (q, acks, n))
    if memory == "legacy":
        assert sent[0] == {"buffer_id": per_msg, "memory_kind": 1, "export": 1, "new_event": 1,
                           "record": 1}
        assert got[0]["open"] == 1 and got[0]["open_event"] == 1
        steady = {"buffer_id": per_msg, "record": 1}
    else:
        assert sent[0] == {"buffer_id": per_msg, "memory_kind": 1, "vmm_chunks": per_msg,
                           "vmm_export": 1, "new_event": 1, "record": 1}
        assert got[0]["vmm_import"] == 1 and got[0]["open_event"] == 1
        steady = {"buffer_id": per_msg, "vmm_chunks": per_msg, "record": 1}
    for s, r in zip(sent[1:], got[1:]):
        assert s == steady                                       # sender, per message
        assert r["wait"] == 1                                    # receiver: one stream wait
        assert set(r) == {"wait", "mark", "finish"}              # release: no unmap, no open
        assert r["mark"] == r["finish"] <= per_msg               # one per release batch
    if per_msg == 1:
        assert all(r == {"wait": 1, "mark": 1, "finish": 1} for r in got[1:])


def test_idle_received_blocks_are_bounded_and_let_go_when_idle(monkeypatch):
    monkeypatch.setenv("SHAREDMP_CACHE_IDLE", "0.3")
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    sent, info = _sender_and_receiver(ctx, cw.send_blocks, (q, 5, done), cw.idle_blocks, (q, 2),
                                      done)
    assert sent is True
    # five blocks, at most two kept open once released, both let go after the idle time
    assert info == {"opens": 5, "unmapped": True, "closed_at_release": 3,
                    "idle_bytes": 2 * cw.MiB, "let_go_when_idle": True, "closes": 5}


def test_a_receiver_killed_while_holding_frees_the_senders_memory():
    ctx = mp.get_context("spawn")
    q, go, done, counted = ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Event()
    prod, pconn = _start(ctx, cw.produce, q, go, 50, counted)
    cons, cconn = _start(ctx, cw.consume, q, done, True)
    try:
        assert cconn.poll(TIMEOUT)
        status, info = cconn.recv()
        assert status == "holding" and info["opens"] == 2
        # (the sender counts its leases before the receiver dies: 3 held, 50 pending)
        assert counted.wait(TIMEOUT)
        os.kill(cons.pid, signal.SIGKILL)
        join_or_kill(cons)
        go.set()
        sent = w.result(prod, pconn)
    finally:
        pconn.close()
        cconn.close()
    # the three claimed arrays are freed by the receiver's death; the 50 extra ones were
    # never received: they stay pending until dropped
    assert sent["sent"] == 53 and sent["released"] and sent["pending"] == 50


def test_chain_of_three_processes_forwards_and_releases_back():
    first, middle, last, _ = _chain(cw.produce, cw.end_of_chain, owner_pid=True)
    # (the middle's one event for the message, waited for once)
    assert last == {"owner_is_first": True, "lease_is_owner": False, "opens": 2,
                    "events_waited": 1, "unmapped": True}
    assert middle == {"opens": 2, "unmapped": True, "outstanding": 0}
    assert first["released"] and first["home_left"] == 0


def test_received_back_home_is_the_original_object():
    ctx = mp.get_context("spawn")
    cw.install()
    try:
        q_out, q_back, done = ctx.Queue(), ctx.Queue(), ctx.Event()
        p, conn = _start(ctx, cw.send_back, q_out, q_back, done)
        a = cw.DevArray(11 * cw.MiB + 128, 256)
        try:
            q_out.put(a)
            back = q_back.get(timeout=TIMEOUT)
            assert back is a
            done.set()
            assert w.result(p, conn)             # the child's forwarding lease was released
        finally:
            conn.close()
        server = ipc.exporter().server
        assert until(lambda: server.outstanding() == 0, TIMEOUT)
        # put and get in the same process: the original, its lease dropped unclaimed
        local = mp.get_context("spawn").Queue()
        local.put(a)
        assert local.get(timeout=TIMEOUT) is a
        assert until(lambda: server.outstanding() == 0, TIMEOUT)
        assert not ipc.exporter()._home
        local.close()
        local.join_thread()
    finally:
        ipc.exporter().server.close()
        ipc._exporter = ipc._importer = None
        lease._server = lease._client = None


def test_received_twice_is_one_holder_and_the_second_lease_goes_at_once():
    ctx = mp.get_context("spawn")
    q, q2, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    cons, cconn = _start(ctx, cw.consume, q, done, False, q2)
    driver = cw.install()
    try:
        a = cw.DevArray(13 * cw.MiB, 256)
        q.put([a, cw.DevArray(13 * cw.MiB + 256, 8), cw.DevArray(14 * cw.MiB, 8)])
        q2.put(a)
        info = w.result(cons, cconn)
        server = ipc.exporter().server
        assert until(lambda: server.outstanding() == 0, TIMEOUT)
        assert info["twice_same_holder"] and info["opens"] == 2 and driver.exports == 2
    finally:
        cconn.close()
        ipc.exporter().server.close()
        ipc._exporter = ipc._importer = None
        lease._server = lease._client = None


def test_an_array_from_a_sender_that_died_raises_on_receipt():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=cw.produce_and_die, args=(q,))
    p.start()
    assert join_or_kill(p) == 0
    cw.install()
    try:
        with pytest.raises(RuntimeError, match="exited"):
            q.get(timeout=TIMEOUT)
    finally:
        ipc._exporter = ipc._importer = None
        lease._server = lease._client = None


# -- fork: allowed, as torch allows it; CUDA refused in the forked child -------------------

def test_no_cuda_here_and_a_fork_child_is_not_marked():
    import sharedmp.cuda as c
    assert c.cuda_initialized() is None          # torch CPU, no libcuda mapped here
    assert _mark_in_a_fork_child() == "None"


def _mark_in_a_fork_child():
    """``sharedmp.cuda._forked_from`` as a child forked now sees it (repr)."""
    import sharedmp.cuda as c
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(w, repr(c._forked_from).encode())
        finally:
            os._exit(0)
    os.close(w)
    try:
        return os.read(r, 100).decode()
    finally:
        os.close(r)
        os.waitpid(pid, 0)


def _simulate_cuda_parent(monkeypatch, who):
    """As in a process where ``who`` initialised CUDA (no GPU here: the probe says so)."""
    import sharedmp.cuda as c
    monkeypatch.setattr(c, "cuda_initialized", lambda: who)
    monkeypatch.setattr(c, "_CUDA_MODULES", ("os",))     # as if a CUDA library were imported


@pytest.mark.parametrize("who", ["torch", "cupy", "the CUDA driver"])
def test_fork_of_a_cuda_parent_runs_and_refuses_cuda_in_the_child(monkeypatch, who):
    _simulate_cuda_parent(monkeypatch, who)
    ctx = mp.get_context("fork")
    wire = descriptor(owner=b"x" * 16).encode()
    parent, child = ctx.Pipe()
    p = ctx.Process(target=cw.forked_from_cuda, args=(child, wire))
    p.start()                                    # no error, no warning
    try:
        ok, info = parent.recv() if parent.poll(TIMEOUT) else (False, "no report")
    finally:
        assert join_or_kill(p) == 0
    assert ok, info
    assert info["forked_from"] == who and info["cpu"] == 45
    for what in ("send", "receive"):
        assert f"forked from one in which CUDA was initialised (by {who})" in info[what]
        assert "'spawn' or 'forkserver'" in info[what]
    assert info["driver_calls"] == 0             # refused before any CUDA call
    assert info["grandchild"] == repr(who)       # a fork of the fork cannot use CUDA either
    with ctx.Pool(2) as pool:                    # CPU workers forked from the CUDA parent
        assert pool.map(abs, range(-3, 0)) == [3, 2, 1]
    import sharedmp.cuda as c
    assert c._forked_from is None                # the parent itself is not marked


def test_the_fork_mark_sees_sharedmps_own_cuinit(monkeypatch):
    import sharedmp.cuda as c
    from sharedmp.cuda import driver
    monkeypatch.setattr(driver, "_initialised", True)   # as after Driver() ran cuInit
    assert c.cuda_initialized() == "the CUDA driver"
    assert _mark_in_a_fork_child() == "'the CUDA driver'"


# -- torch's reductions module, for code written against torch.multiprocessing ------------

def test_mp_reductions_forwards_torchs_functions_which_work():
    torch = pytest.importorskip("torch")
    import torch.multiprocessing.reductions as torch_reductions
    # torch's test_rebuild_cuda_tensor calls this on storage._share_cuda_()'s private tuple.
    assert mp.reductions.rebuild_cuda_tensor is torch_reductions.rebuild_cuda_tensor
    assert mp.reductions.StorageWeakRef is torch_reductions.StorageWeakRef
    rebuild, args = mp.reductions.reduce_tensor(torch.arange(4.0))
    assert torch.equal(rebuild(*args), torch.arange(4.0))
    with pytest.raises(AttributeError, match="no attribute 'rebuild_nothing'"):
        mp.reductions.rebuild_nothing


# -- lightness, registration, clean skips ---------------------------------------------------

def _run(code, **env):
    e = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    e.update(env)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=e)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_import_sharedmp_loads_no_gpu_library():
    got = _run("import sys, json, sharedmp, numpy as np\n"
               "q = sharedmp.get_context('spawn').SimpleQueue(); q.put(sharedmp.zeros(3)); q.get()\n"
               "print(json.dumps([m for m in ('torch', 'cupy', 'cuda', 'cuda.bindings',\n"
               "                  'sharedmp.cuda.driver', 'sharedmp.cuda.ipc', 'sharedmp.reductions.cuda')\n"
               "                  if m in sys.modules]))")
    assert got == []


def test_cupy_reducer_registers_when_cupy_is_imported(tmp_path):
    # A module named cupy with an ndarray type: enough for the import hook, which is what
    # is tested (CuPy itself needs a GPU and a multi-GB install).
    (tmp_path / "cupy").mkdir()
    (tmp_path / "cupy" / "__init__.py").write_text("class ndarray:\n    pass\n")
    got = _run("import json, sharedmp, sys\n"
               "from multiprocessing.reduction import ForkingPickler as P\n"
               "before = 'sharedmp.reductions.cuda' in sys.modules\n"
               "import cupy\n"
               "from sharedmp.reductions import cuda\n"
               "print(json.dumps([before, P._extra_reducers.get(cupy.ndarray) is cuda.reduce_cupy_array,"
               " 'torch' in sys.modules]))",
               PYTHONPATH=os.pathsep.join([str(tmp_path), SRC]))
    assert got == [False, True, False]


def test_without_the_cuda_extra_the_reason_names_it():
    from sharedmp.cuda import driver
    why = driver.available()
    if driver._cu is not None:
        pytest.skip("cuda-bindings is installed here")
    assert "pip install 'sharedmp[cuda]'" in why
    with pytest.raises(RuntimeError, match=r"sharedmp\[cuda\]"):
        driver.get()


# -- on a GPU (skipped here, with the reason) ---------------------------------------------

@needs_gpu
def test_gpu_check_script_passes():
    script = os.path.join(os.path.dirname(HERE), "scripts", "gpu_check.py")
    r = subprocess.run([sys.executable, script, "--quick"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "FAIL" not in r.stdout, r.stdout + r.stderr

"""A queue's rings (channels/board.py): every path a message can take, in order.

Each producer's messages must arrive in the order it sent them whichever path each took
(its ring, the socket with fds, the socket for a large or overflowing one); a message put
after another was put (a producer joined, then the sentinels) must arrive after it; a
producer killed mid-stream leaves nothing half-sent and frees its slot; more producers than
slots still deliver; the mapping a peer could corrupt is checked by both implementations.
Every wait is bounded."""
import errno
import multiprocessing.connection
import mmap
import os
import queue
import signal
import socket
import struct
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import sharedmp as mp
from sharedmp.channels import board, fdpass, ring
from sharedmp.errors import ProtocolError

import _channel_workers as cw
from conftest import TIMEOUT, fork_and_wait, join_or_kill, start_process

IMPLS = ["compiled", "twin"] if ring.Compiled is not None else ["twin"]


@pytest.fixture(autouse=True)
def rings_on(monkeypatch):
    """(experimental, off by default) queues made here, and in spawned children, have rings"""
    monkeypatch.setenv("SHAREDMP_QUEUE_RINGS", "1")


@pytest.fixture(params=IMPLS)
def impl(request, monkeypatch):
    """This process's board functions and writer ring, and its spawned children's."""
    if request.param == "twin":
        monkeypatch.setattr(board, "_first", board._first_py)
        monkeypatch.setattr(board, "_pop", board._pop_py)
        monkeypatch.setattr(board, "_take", board._take_py)
        monkeypatch.setattr(ring, "Ring", ring.Twin)
        monkeypatch.setenv("SHAREDMP_NO_EXTENSIONS", "1")
    return request.param


def board_of(q):
    return q._reader._board


def in_order(got):
    """Each producer's seqs, as one consumer saw them, only grow."""
    last = {}
    for producer, seq, _ in got:
        assert seq > last.get(producer, -1), f"producer {producer}: {seq} after {last[producer]}"
        last[producer] = seq


def run_mixed(ctx, nprod, ncons, n, together=False):
    q, out, hold = ctx.Queue(), ctx.Queue(), ctx.Event()
    consumers = [start_process(ctx, cw.consume_mixed, q, out) for _ in range(ncons)]
    producers = [start_process(ctx, cw.produce_mixed, q, pid, n, 0, hold if together else None)
                 for pid in range(nprod)]
    try:
        if together:                            # (each has put its first item: all claimed)
            b = board_of(q)
            deadline = time.monotonic() + TIMEOUT
            while b._u32[board.O_USED // 4] < board.SLOTS or not b._u32[board.O_XSENT // 4]:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            hold.set()
        for p in producers:
            assert join_or_kill(p) == 0
        for _ in range(ncons):                  # after every item: they must come after them
            q.put(None)
        reports = [out.get(timeout=TIMEOUT) for _ in range(ncons)]
        for p in consumers:
            assert join_or_kill(p) == 0
    finally:
        for p in producers + consumers:
            join_or_kill(p, 5)
    everything = []
    for status, got in reports:
        assert status == "ok", got
        in_order(got)
        assert all(ok for _, _, ok in got)
        everything += [(p, s) for p, s, _ in got]
    assert sorted(everything) == [(p, s) for p in range(nprod) for s in range(n)]
    return q


def test_every_path_in_order_across_processes(impl):
    q = run_mixed(mp.get_context("spawn"), nprod=3, ncons=2, n=150)
    b = board_of(q)
    assert b._u32[board.O_USED // 4] >= 1                  # (rings were used)


def test_more_producers_than_slots():
    q = run_mixed(mp.get_context("fork"), nprod=board.SLOTS + 3, ncons=1, n=40, together=True)
    b = board_of(q)
    assert b._u32[board.O_USED // 4] == board.SLOTS
    assert b._u32[board.O_XSENT // 4] > 0                  # some sent without a slot


def test_one_process_every_path(impl):
    for kind in ("Queue", "SimpleQueue"):
        q = getattr(mp, kind)()
        items = [cw.mixed_item(0, seq) for seq in range(60)]
        for item in items:
            q.put(item)
        for seq in range(60):
            assert q._reader.poll(TIMEOUT)
            item = q.get()
            assert item[1] == seq and cw.mixed_ok(item)
        q.close()


def test_a_killed_producer_leaves_a_gapless_stream_and_its_slot():
    ctx = mp.get_context("fork")
    q, ready = ctx.Queue(), ctx.Event()
    p = start_process(ctx, cw.produce_forever, q, ready)
    try:
        assert ready.wait(TIMEOUT)
        os.kill(p.pid, signal.SIGKILL)
        join_or_kill(p)
    finally:
        join_or_kill(p, 5)
    seq = 0
    while True:
        try:
            got, a = q.get(timeout=0.5)
        except Exception:
            break
        assert got == seq and (a == seq).all()
        seq += 1
    assert seq > 100
    b = board_of(q)
    assert b._u32[board.O_USED // 4] == 1
    p = start_process(ctx, cw.produce_mixed, q, 7, 20)     # its slot is free again
    assert join_or_kill(p) == 0
    assert [q.get(timeout=TIMEOUT)[1] for _ in range(20)] == list(range(20))
    assert b._u32[board.O_USED // 4] == 1


def test_forked_child_takes_a_slot_of_its_own():
    q = mp.Queue()
    q._creator = -1                              # (put() synchronous here, as in a child)
    q.put((0, 0, 0))
    b = board_of(q)
    mine = b._slot
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for seq in range(30):
                q.put(cw.mixed_item(1, seq))
            code = 0 if b._slot not in (-1, mine) else 2
        finally:
            os._exit(code)
    for seq in range(1, 30):
        q.put(cw.mixed_item(0, seq))
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    got = [q.get(timeout=TIMEOUT) for _ in range(60)]
    assert all(cw.mixed_ok(item) for item in got)
    in_order([(p, s, None) for p, s, _ in got])
    assert b._slot == mine


def test_memory_is_reserved_a_ring_per_producer_that_takes_one():
    """The header page when the queue is made, a ring when a producer takes a slot; a
    producer whose ring cannot be reserved sends by the socket, its messages in order with
    the others'. (The shortage is made up in the child: the memfd is at its full size
    already, so neither RLIMIT_FSIZE nor anything else a test can set here makes shmem's
    fallocate fail.)"""
    q = mp.Queue()
    q._creator = -1                              # (put() synchronous here, as in a child)
    b = board_of(q)
    ring_bytes = ring.HEADER + board.CAPACITY

    def reserved():
        return os.fstat(b._memfd.fd).st_blocks * 512

    assert reserved() == board.RINGS
    q.put(cw.mixed_item(0, 0))
    one = reserved()
    assert board.RINGS + ring_bytes <= one <= board.RINGS + ring_bytes + mmap.PAGESIZE

    def limited():
        def no_space(*args):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        os.posix_fallocate = no_space
        q.put(cw.mixed_item(1, 0))
        q.put(cw.mixed_item(1, 1))
        return b._slot == -2 and b._writer is None

    assert fork_and_wait(limited) == 0
    assert reserved() == one and b._u32[board.O_USED // 4] == 1
    assert fork_and_wait(lambda: q.put(cw.mixed_item(2, 0)) or b._slot == 1) == 0
    assert one + ring_bytes - mmap.PAGESIZE <= reserved() <= one + ring_bytes + mmap.PAGESIZE
    got = [q.get(timeout=TIMEOUT) for _ in range(4)]
    assert all(cw.mixed_ok(item) for item in got)
    assert [(p, s) for p, s, _ in got] == [(0, 0), (1, 0), (1, 1), (2, 0)]


def test_a_consumer_that_stops_leaves_what_it_did_not_return():
    """A record stamped before the socket's head frame but published while a consumer takes
    that frame (the race is made here: the record is put from inside the consumer's read)
    goes first; the frame must stay for the next consumer, not go with one that stops after
    one get (a consumer that read the frame and kept it for itself lost it on exit)."""
    q = mp.Queue()
    q._creator = -1                              # (put() synchronous here, as in a child)
    q.put(cw.mixed_item(0, 2))                   # a shared array: fds, by the socket

    def consume_once():
        real_recv, real_stamp = fdpass.recv_frame, board._stamp

        def racing(*args, **kwargs):
            fdpass.recv_frame, board._stamp = real_recv, lambda: 1
            try:
                q.put(cw.mixed_item(1, 0))       # a tuple: this child's ring, stamped first
            finally:
                board._stamp = real_stamp
            return real_recv(*args, **kwargs)

        fdpass.recv_frame = racing
        got = q.get(timeout=TIMEOUT)
        return cw.mixed_ok(got) and fdpass.recv_frame is real_recv

    assert fork_and_wait(consume_once) == 0
    left = q.get(timeout=TIMEOUT)
    assert cw.mixed_ok(left)
    assert board_of(q)._u32[board.O_USED // 4] >= 1


def test_several_sleeping_consumers_take_every_message():
    """Four consumers asleep in get(); a producer that pauses: a lost wake-up leaves a
    message unread while they sleep (their gets time out: nothing is lost either way)."""
    ctx = mp.get_context("fork")
    q, out = ctx.Queue(), ctx.Queue()
    consumers = [start_process(ctx, cw.consume_mixed, q, out) for _ in range(4)]
    try:
        p = start_process(ctx, cw.produce_mixed, q, 0, 300, 7)
        assert join_or_kill(p) == 0
        for _ in consumers:
            q.put(None)
        reports = [out.get(timeout=TIMEOUT) for _ in consumers]
    finally:
        for c in consumers:
            join_or_kill(c, 5)
    got = sorted(s for status, items in reports for _, s, ok in items if status == "ok" and ok)
    assert got == list(range(300))


def test_connection_wait_wakes_for_a_ring_message():
    from multiprocessing.connection import wait
    ctx = mp.get_context("fork")
    q = ctx.SimpleQueue()
    assert wait([q._reader], 0.2) == []
    p = start_process(ctx, cw.produce_mixed, q, 0, 2)
    try:
        assert wait([q._reader], TIMEOUT) == [q._reader]
        assert q._reader.recv() == cw.mixed_item(0, 0)
        assert wait([q._reader], TIMEOUT) == [q._reader]
        assert cw.mixed_ok(q.get())
    finally:
        assert join_or_kill(p) == 0
    assert wait([q._reader], 0.1) == []


def test_rings_off_sends_everything_by_the_socket(monkeypatch):
    monkeypatch.setenv("SHAREDMP_QUEUE_RINGS", "0")
    q = mp.Queue()
    assert board_of(q) is None
    q.put(1)
    assert q.get(timeout=TIMEOUT) == 1


# -- what a hostile peer can write ------------------------------------------------------

def fake_board(slots=2, cap=4096):
    size = board._size(slots, cap)
    mm = mmap.mmap(-1, size)
    mv = memoryview(mm)
    struct.pack_into("<IIII", mv, 0, board.MAGIC, board.VERSION, slots, cap)
    return mm, mv


def put_record(mv, s, cap, payload, kind=0, stamp=1):
    r = board.RINGS + s * (ring.HEADER + cap)
    tail = struct.unpack_from("<Q", mv, r + ring.O_TAIL)[0]
    p = tail & (cap - 1)
    rec = board._REC.pack(kind, stamp) + payload
    struct.pack_into("<I", mv, r + ring.HEADER + p, len(rec))
    mv[r + ring.HEADER + p + 4:r + ring.HEADER + p + 4 + len(rec)] = rec
    struct.pack_into("<Q", mv, r + ring.O_TAIL, tail + ((4 + len(rec) + 7) & ~7))


def impls():
    fns = [(board._first_py, board._pop_py)]
    module = board.native.load("_cring")
    if module is not None:
        fns.append((module.board_first, module.board_pop))
    return fns


@pytest.mark.parametrize("fns", impls(), ids=lambda f: f[0].__module__)
def test_the_smallest_stamp_goes_first(fns):
    first, pop = fns
    mm, mv = fake_board()
    struct.pack_into("<I", mv, board.O_USED, 2)
    put_record(mv, 0, 4096, b"late", stamp=20)
    put_record(mv, 1, 4096, b"early", stamp=10)
    put_record(mv, 1, 4096, b"later", stamp=30)
    assert first(mm, 2, 4096) == (1, 10, False)
    assert pop(mm, 2, 4096, 1) == (0, b"early")
    assert first(mm, 2, 4096)[:2] == (0, 20)
    assert pop(mm, 2, 4096, 0) == (0, b"late")
    assert pop(mm, 2, 4096, 1) == (0, b"later")
    assert first(mm, 2, 4096) == (-1, 0, False)
    struct.pack_into("<I", mv, board.O_TABLE + 16, 3)       # slot 1 sent 3 frames
    assert first(mm, 2, 4096)[2] is True
    del mv
    mm.close()


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_hostile_boards_raise_and_both_agree(data):
    """Random bytes over the counters and records: a ProtocolError (or a record within
    bounds), the same from both implementations, each on its own copy; never a crash."""
    base_mm, base = fake_board()
    struct.pack_into("<I", base, board.O_USED, 2)
    put_record(base, 0, 4096, b"x" * 30)
    for _ in range(data.draw(st.integers(1, 6))):
        where = data.draw(st.sampled_from([
            board.O_USED, board.RINGS + ring.O_HEAD, board.RINGS + ring.O_TAIL,
            board.RINGS + ring.HEADER, board.RINGS + ring.HEADER + 4,
            board.RINGS + ring.HEADER + 4096 - 8, board.RINGS + ring.HEADER + ring.O_TAIL]))
        base[where:where + 8] = data.draw(st.binary(min_size=8, max_size=8))
    results = []
    for first, pop in impls():
        mm = mmap.mmap(-1, len(base))
        mm[:] = bytes(base)
        try:
            s, _, _ = first(mm, 2, 4096)
            results.append(("ok", None if s < 0 else pop(mm, 2, 4096, s)))
        except ProtocolError:
            results.append(("lie", None))
        except (ValueError, RuntimeError) as e:
            results.append(("refused", type(e)))
        mm.close()
    assert len(set(map(repr, results))) == 1, results
    del base
    base_mm.close()


def takes():
    fns = [board._take_py]
    module = board.native.load("_cring")
    if module is not None:
        fns.append(module.board_take)
    return fns


def socket_with_head(head, stamp):
    """A queue's socket (both ends) whose head is ``head``: nothing, a tagged frame stamped
    ``stamp``, an untagged one, the end, a record shorter than a header, or a header that
    says its tag lies in a memfd."""
    import socket as socket_module
    r, w = socket_module.socketpair(socket_module.AF_UNIX, fdpass.SOCK_TYPE)
    r.setblocking(False)
    if head == "tagged":
        fdpass.send_frame(w, board._TAG.pack(1, stamp) + b"frame", [], fdpass.TAGGED | 1)
    elif head == "untagged":
        fdpass.send_frame(w, b"plain", [], 1)
    elif head == "end":
        w.close()
    elif head == "short":
        w.send(b"SM")
    elif head == "in memfd":
        w.send(fdpass.HEADER.pack(fdpass.MAGIC, fdpass.VERSION,
                                  fdpass.TAGGED | fdpass.PAYLOAD_IN_MEMFD, 0, 100) + bytes(16))
    return r, w


@pytest.mark.parametrize("take", takes(), ids=lambda f: f.__module__)
@pytest.mark.parametrize("frame_stamp, first", [(5, "frame"), (10, "frame"), (20, "record")])
def test_take_takes_the_oldest_and_leaves_the_rest(take, frame_stamp, first):
    """A record stamped 10 and a frame: the older first (a tie: the frame), the other left
    where it is; then the other; then nothing; the socket's end only once the rings are
    empty."""
    mm, mv = fake_board()
    struct.pack_into("<I", mv, board.O_USED, 1)
    put_record(mv, 0, 4096, b"record", stamp=10)
    struct.pack_into("<I", mv, board.O_TABLE, 1)
    r, w = socket_with_head("tagged", frame_stamp)
    try:
        order = []
        for _ in range(2):
            got = take(mm, 1, 4096, r, fdpass.recv_frame)
            order.append("frame" if got[0] == b"frame" else "record")
        assert order[0] == first and set(order) == {"frame", "record"}
        assert struct.unpack_from("<I", mv, board.O_TAKEN)[0] == 1
        assert take(mm, 1, 4096, r, fdpass.recv_frame) is None
        put_record(mv, 0, 4096, b"last", stamp=30)
        w.close()
        assert take(mm, 1, 4096, r, fdpass.recv_frame)[0] == b"last"
        with pytest.raises(EOFError):
            take(mm, 1, 4096, r, fdpass.recv_frame)
    finally:
        r.close()
        w.close()
        del mv
        mm.close()


@pytest.mark.parametrize("seed", range(60))
def test_take_differential(seed):
    """board_take and its twin, given the same board (records, frames counted waiting, now
    and then a corruption) and the same socket head: the same answer, the same counts, and
    the frame left in the socket unless taken."""
    import random
    rnd = random.Random(seed)
    base_mm, base = fake_board()
    struct.pack_into("<I", base, board.O_USED, 2)
    for i in range(rnd.randint(0, 3)):
        put_record(base, rnd.randint(0, 1), 4096, bytes(rnd.randint(0, 50)), stamp=rnd.randint(1, 9))
    if rnd.random() < 0.6:
        struct.pack_into("<I", base, board.O_TABLE, 1)       # a frame counted sent
    if rnd.random() < 0.2:
        where = rnd.choice([board.O_USED, board.RINGS + ring.O_HEAD, board.RINGS + ring.O_TAIL,
                            board.RINGS + ring.HEADER + 4])
        base[where:where + 8] = rnd.randbytes(8)
    head = rnd.choice(["none", "tagged", "untagged", "end", "short", "in memfd"])
    stamp = rnd.randint(0, 12)
    answers = []
    for take in takes():
        mm = mmap.mmap(-1, len(base))
        mm[:] = bytes(base)
        r, w = socket_with_head(head, stamp)
        try:
            got = take(mm, 2, 4096, r, fdpass.recv_frame)
            if isinstance(got, tuple):
                fdpass.close_all(got[1])
                got = (bytes(got[0]), len(got[1]), got[2])
            try:
                left = len(r.recv(64, socket.MSG_PEEK | socket.MSG_DONTWAIT))
            except BlockingIOError:
                left = None
            answers.append((got, struct.unpack_from("<I", mm, board.O_TAKEN)[0], left))
        except Exception as e:
            answers.append(type(e).__name__)
        finally:
            r.close()
            w.close()
            mm.close()
    assert len(set(map(repr, answers))) == 1, (head, stamp, answers)
    del base
    base_mm.close()


@pytest.mark.parametrize("seed", range(40))
def test_hostile_boards_differential(seed):
    """The same random corruption given to both implementations (each on its own copy):
    the same answer."""
    import random
    rnd = random.Random(seed)
    base_mm, base = fake_board()
    struct.pack_into("<I", base, board.O_USED, 2)
    for i in range(rnd.randint(0, 5)):
        put_record(base, rnd.randint(0, 1), 4096, bytes(rnd.randint(0, 200)), stamp=rnd.randint(1, 9))
    for _ in range(rnd.randint(1, 4)):
        where = rnd.randrange(0, len(base) - 8)
        if rnd.random() < 0.7:           # mostly where it matters
            where = rnd.choice([board.O_USED, board.RINGS + ring.O_HEAD, board.RINGS + ring.O_TAIL,
                                board.RINGS + ring.HEADER, board.RINGS + ring.HEADER + 4])
        base[where:where + 8] = rnd.randbytes(8)
    answers = []
    for first, pop in impls():
        mm = mmap.mmap(-1, len(base))
        mm[:] = bytes(base)
        try:
            s, stamp, waiting = first(mm, 2, 4096)
            answers.append((s, stamp, waiting, None if s < 0 else pop(mm, 2, 4096, s)))
        except ProtocolError:
            answers.append("lie")
        mm.close()
    assert len(set(map(repr, answers))) == 1, answers
    del base
    base_mm.close()


def test_attach_refuses_what_is_not_a_board(tmp_path):
    efd = os.eventfd(0)
    fd = os.memfd_create("x", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, board._size(2, 4096))
    with pytest.raises(ProtocolError, match="sealed"):
        board.Board.attach(os.dup(fd), os.dup(efd))
    import fcntl
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    with pytest.raises(ProtocolError, match="not a board"):
        board.Board.attach(os.dup(fd), os.dup(efd))
    r, w = os.pipe()
    with pytest.raises(ProtocolError, match="eventfd"):
        board.Board.attach(os.dup(fd), r)
    for x in (fd, efd, w):
        os.close(x)


# -- one process, every operation: a model -------------------------------------------------

class QueueModel(RuleBasedStateMachine):
    """puts of every path (and bursts that overflow the ring) from this thread, another
    thread and a forked child (each finished before the next step), gets, get on empty:
    each get returns exactly the oldest item put (a put that finished before another began
    comes out first), with its bytes."""

    def __init__(self):
        super().__init__()
        self.q = mp.Queue()          # (the creator's puts: straight in, or by the feeder)
        self.model = []
        self.seqs = [0, 0, 0]

    def _items(self, producer, n):
        first = self.seqs[producer]
        self.seqs[producer] += n
        self.model += [(producer, seq) for seq in range(first, first + n)]
        return [cw.mixed_item(producer, seq) for seq in range(first, first + n)]

    # (at most ~150 items waiting: their flight, 40 of 200 KB, stays within a send window,
    # so that this process's feeder can always send what it holds)
    @precondition(lambda self: len(self.model) < 60)
    @rule(n=st.integers(1, 90))
    def put(self, n):
        for item in self._items(0, n):
            self.q.put(item)

    @precondition(lambda self: len(self.model) < 60)
    @rule(n=st.integers(1, 40))
    def put_from_a_thread(self, n):
        items = self._items(1, n)
        t = threading.Thread(target=lambda: [self.q.put(item) for item in items])
        t.start()
        t.join(TIMEOUT)
        assert not t.is_alive()

    @precondition(lambda self: len(self.model) < 60)
    @rule(n=st.integers(1, 20))
    def put_from_a_child(self, n):
        # (this process's puts are sent by its feeder thread after put() returns, as
        # multiprocessing's: finished, for the child's to come after them)
        deadline = time.monotonic() + TIMEOUT
        while self.q._buffer:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        items = self._items(2, n)
        assert fork_and_wait(lambda: [self.q.put(item) for item in items]) == 0

    @rule(n=st.integers(1, 90))
    def get(self, n):
        for _ in range(min(n, len(self.model))):
            item = self.q.get(timeout=TIMEOUT)
            assert (item[0], item[1]) == self.model.pop(0) and cw.mixed_ok(item)

    @rule()
    def get_empty(self):
        if not self.model:
            with pytest.raises(queue.Empty):
                self.q.get(timeout=0.01)

    @invariant()
    def empty_agrees(self):
        if not self.model:
            assert self.q.empty()

    def teardown(self):
        while self.model:
            item = self.q.get(timeout=TIMEOUT)
            assert (item[0], item[1]) == self.model.pop(0)
        self.q.close()
        self.q.join_thread()


@pytest.mark.parametrize("kind", IMPLS)
def test_queue_model(kind, monkeypatch):
    if kind == "twin":
        monkeypatch.setattr(board, "_first", board._first_py)
        monkeypatch.setattr(board, "_pop", board._pop_py)
        monkeypatch.setattr(board, "_take", board._take_py)
        monkeypatch.setattr(ring, "Ring", ring.Twin)
    QueueModel.TestCase.settings = settings(max_examples=25, stateful_step_count=12,
                                            deadline=None)
    QueueModel.TestCase().runTest()


def test_the_socket_ends_after_the_rings(impl):
    q = mp.SimpleQueue()
    for seq in range(5):
        q.put(cw.mixed_item(0, seq))
    q._writer.close()                     # (the only writer: the socket ends)
    assert [q._reader.recv()[1] for _ in range(5)] == list(range(5))
    with pytest.raises(EOFError):
        q._reader.recv()
    q.close()


def test_a_stale_wake_does_not_make_the_reader_ready():
    """A producer writes the board's eventfd after its record; one delayed between the two
    writes it after the record was taken, while the consumer waits again (a thread writes
    that stale wake here, into a wait under way): multiprocessing.connection.wait does not
    return the reader for it (concurrent.futures' manager thread would then recv() for ever,
    CPython's test_gh105829 hung so on CI), and returns it for the next message."""
    q = mp.get_context("fork").SimpleQueue()
    r = q._reader
    try:
        q.put(1)
        assert multiprocessing.connection.wait([r], timeout=TIMEOUT) == [r]
        assert r.recv() == 1
        late = threading.Timer(0.1, os.eventfd_write, (r._board._efd.fd, 1))
        late.start()
        t0 = time.monotonic()
        assert multiprocessing.connection.wait([r], timeout=0.5) == []
        assert time.monotonic() - t0 >= 0.5
        late.join(TIMEOUT)
        q.put(2)
        assert multiprocessing.connection.wait([r], timeout=TIMEOUT) == [r]
        assert r.recv() == 2
    finally:
        q.close()

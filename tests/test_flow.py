"""Flow control: a sender is never further ahead of its receivers than its window.

The memory a connection's messages make for the flight (payloads over one record, plain
arrays copied into shared memory at send) counts until a receiver has taken the message;
``send``/``send_bytes`` (and put() outside the queue's creating process) block once that
passes ``$SHAREDMP_WINDOW_BYTES``. In the creating process an unbounded Queue's put()
never blocks: its feeder waits. Every wait here is bounded; children are killed by the
leak fixture if a test fails.
"""
import json
import os
import sys
import time

import numpy as np
import pytest

import sharedmp as mp
from sharedmp.channels import flow
import _flow_workers as fw
from conftest import TIMEOUT, eventually, join_or_kill, run_bounded

MiB = 1 << 20


def stays(predicate, seconds=1.0):
    """True if ``predicate`` holds throughout ``seconds`` (checking that nothing happens)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not predicate():
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def window(monkeypatch):
    def set_window(nbytes):
        monkeypatch.setenv(flow.ENV, str(nbytes))
        return nbytes
    return set_window


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_pipe_sender_blocks_once_its_window_is_full(window, method):
    limit = window(32 * MiB)
    ctx = mp.get_context(method)
    r, w = ctx.Pipe(duplex=False)
    sent = ctx.Value("i", 0)
    p = ctx.Process(target=fw.send_payloads, args=(w, 8, 16 * MiB, sent, limit))
    p.start()
    w.close()
    # Two 16 MiB payloads fill 32 MiB; the third goes out and its send_bytes waits.
    assert eventually(lambda: sent.value == 2, TIMEOUT), sent.value
    assert stays(lambda: sent.value == 2), f"the sender went on to {sent.value} with no reader"
    assert r.poll(0)                             # the third is on its way, not refused
    for i in range(8):
        got = r.recv_bytes()
        assert len(got) == 16 * MiB and got[0] == got[-1] == i, (i, got[:1], got[-1:])
    assert join_or_kill(p) == 0 and sent.value == 8
    r.close()


def test_a_payload_larger_than_the_window_returns_once_received(window):
    window(8 * MiB)
    ctx = mp.get_context("spawn")
    r, w = ctx.Pipe(duplex=False)
    sent = ctx.Value("i", 0)
    p = ctx.Process(target=fw.send_payloads, args=(w, 1, 16 * MiB, sent))
    p.start()
    w.close()
    assert eventually(lambda: r.poll(0), TIMEOUT)
    assert stays(lambda: sent.value == 0, 0.5), "a send larger than the window returned unread"
    assert len(r.recv_bytes()) == 16 * MiB
    assert join_or_kill(p) == 0 and sent.value == 1
    r.close()


def test_shared_arrays_the_sender_keeps_are_not_flight(window):
    window(4 * MiB)
    r, w = mp.Pipe(duplex=False)
    a = mp.zeros(16 * MiB // 8)                  # already shared: the sender's own memory
    for _ in range(20):                          # no reader yet: none of these may block
        w.send(a)
    got = [r.recv() for _ in range(20)]
    assert all(np.shares_memory(g, got[0]) for g in got)
    r.close()
    w.close()


def test_a_receiver_that_keeps_what_it_got_does_not_stop_the_sender(window):
    window(16 * MiB)                             # received is received: kept arrays are not flight
    ctx = mp.get_context("spawn")
    r, w = ctx.Pipe(duplex=False)
    p = ctx.Process(target=fw.send_and_exit, args=(w, 40, 4 * MiB))
    p.start()
    w.close()
    kept = [r.recv() for _ in range(40)]         # 160 MiB kept, 10 windows' worth
    assert [int(k[0]) for k in kept] == list(range(40))
    assert join_or_kill(p) == 0
    del kept
    r.close()


def test_put_on_an_unbounded_queue_never_blocks_in_its_creator(window):
    window(16 * MiB)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    start = time.monotonic()
    for i in range(12):                          # 96 MiB, no reader: the feeder waits, not put()
        q.put(np.full(MiB, i, dtype=np.int64))
    assert time.monotonic() - start < TIMEOUT
    assert [int(q.get(timeout=TIMEOUT)[0]) for _ in range(12)] == list(range(12))
    q.close()
    q.join_thread()


def test_put_in_another_process_blocks_once_the_window_is_full(window):
    window(16 * MiB)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    sent = ctx.Value("i", 0)
    p = ctx.Process(target=fw.put_arrays, args=(q, 6, 8 * MiB, sent))
    p.start()
    assert eventually(lambda: sent.value == 2, TIMEOUT), sent.value
    assert stays(lambda: sent.value == 2), f"put() went on to {sent.value} with no reader"
    assert [int(q.get(timeout=TIMEOUT)[0]) for _ in range(6)] == list(range(6))
    assert join_or_kill(p) == 0 and sent.value == 6
    q.close()


@pytest.mark.timeout(120)
@pytest.mark.slow    # (.ci/run: 3.11 only)
def test_a_fast_producer_stays_within_its_window_of_a_slow_consumer(window):
    limit = window(64 * MiB)
    size = 4 * MiB
    ctx = mp.get_context("spawn")
    r, w = ctx.Pipe(duplex=False)
    baseline, sent = ctx.Value("q", 0), ctx.Value("q", 0)
    p = ctx.Process(target=fw.flood, args=(w, size, 10.0, baseline, sent))
    p.start()
    w.close()
    ahead, grown, received = 0, 0, 0
    while True:
        a = r.recv()
        if a is None:
            break
        assert int(a[0]) == received and int(a[-1]) == received
        received += 1
        del a
        time.sleep(0.02)                         # the slow consumer
        # Counted, not read from the machine's Shmem (which a suite run beside this one
        # moves by 100+ MiB): the messages sent and not yet received. The one being sent
        # went out before its send() returned: one more.
        ahead = max(ahead, sent.value + 1 - received)
        rss = fw.rss_bytes(p.pid)
        if baseline.value and rss is not None:
            grown = max(grown, rss - baseline.value)
    assert join_or_kill(p) == 0
    r.close()
    assert received > 100
    # A send returns with the counted flight within the window; at most a step (an eighth)
    # goes uncounted. Nor does the producer hold messages in its own memory instead.
    print(f"{received} received; at worst {ahead} messages of {size // MiB} MiB ahead of the "
          f"reader for a window of {limit // MiB} MiB; the producer grew by {grown / MiB:.0f} MiB")
    assert ahead * size <= limit + limit // 8 + size, (ahead, limit // MiB)
    assert grown < 32 * MiB, grown / MiB


@pytest.mark.timeout(180)
def test_cpython_ignore_eintr_passes_under_forkserver(tmp_path):
    """CPython's TestIgnoreEINTR relies on a 16 MiB send blocking until it is read (a
    message larger than the window). Its forkserver child used to exit before the test
    signalled it."""
    pytest.importorskip("test._test_multiprocessing")
    script = os.path.join(os.path.dirname(__file__), "_cpython_suite.py")
    env = {k: v for k, v in os.environ.items() if k != flow.ENV}
    rc, out, err = run_bounded([sys.executable, script, "--start-method", "forkserver",
                                "-k", "IgnoreEINTR", "--strict"], 150, env=env)
    assert rc == 0, out + err
    result = json.loads(out.split("\nRESULT ", 1)[1])
    assert result["run"] == 2 and not result["failed"] and not result["skipped"], result


# A fresh interpreter (the window's setting is read once per connection): with a bad
# $SHAREDMP_WINDOW_BYTES, each channel's first send raises in its caller; then, with the
# environment fixed, only the next message arrives (nothing of the first was queued, the
# queues' counts are whole).
_BAD_WINDOW = r'''
import json, os, queue
import numpy as np
import sharedmp as mp

ctx = mp.get_context("spawn")
big = [np.zeros(10) for _ in range(1000)]       # over one record, and flight
q, jq, sq = ctx.Queue(), ctx.JoinableQueue(), ctx.SimpleQueue()
a, b = ctx.Pipe()
senders = {"Queue": q.put, "JoinableQueue": jq.put, "SimpleQueue": sq.put, "Pipe": a.send}
errors = {}
for name, send in senders.items():
    try:
        send(big)
        errors[name] = None
    except ValueError as e:
        errors[name] = str(e)
del os.environ["SHAREDMP_WINDOW_BYTES"]
for send in senders.values():
    send("after")


def drain(get, ready):
    got = []
    while ready():
        got.append(get())
    return [x if isinstance(x, str) else "big" for x in got]


received = {
    "Queue": drain(lambda: q.get(timeout=5), lambda: q._reader.poll(1)),
    "JoinableQueue": drain(lambda: jq.get(timeout=5), lambda: jq._reader.poll(1)),
    "SimpleQueue": drain(sq.get, lambda: sq._reader.poll(1)),
    "Pipe": drain(b.recv, lambda: b.poll(1)),
}
jq.task_done()
try:
    jq.task_done()                              # one message counted, not two
    extra_task = True
except ValueError:
    extra_task = False
print(json.dumps({"errors": errors, "received": received, "qsize": [q.qsize(), jq.qsize()],
                  "extra_task": extra_task}))
'''


def test_a_bad_window_setting_raises_in_the_sender_and_drops_nothing():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHAREDMP_")}
    rc, out, err = run_bounded([sys.executable, "-c", _BAD_WINDOW], 60,
                               env={**env, flow.ENV: "bogus"})
    assert rc == 0, err[-3000:]
    res = json.loads(out.splitlines()[-1])
    for name, message in res["errors"].items():
        assert message is not None, f"{name}: the first send returned ({err[-2000:]})"
        assert message.startswith("$SHAREDMP_WINDOW_BYTES must be") and "'bogus'" in message
    assert res["received"] == {name: ["after"] for name in res["errors"]}
    assert res["qsize"] == [0, 0] and not res["extra_task"]
    assert "Traceback" not in err                 # no feeder thread printed anything


def test_a_message_the_feeder_cannot_send_is_reported_not_silently_lost():
    # put() has returned by then: the feeder says on stderr what it dropped and why, and the
    # queue's count gives the message back (every reader closed: EPIPE).
    code = ("import time, numpy as np, sharedmp as mp\n"
            "q = mp.get_context('spawn').Queue()\n"
            "q._reader.close()\n"
            "q.put([np.zeros(10) for _ in range(1000)])     # over one record: the feeder\n"
            "deadline = time.monotonic() + 30\n"
            "while q._buffer and time.monotonic() < deadline:\n"
            "    time.sleep(0.01)\n"
            "print(q.qsize())\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHAREDMP_")}
    rc, out, err = run_bounded([sys.executable, "-c", code], 60, env=env)
    assert rc == 0, err[-3000:]
    assert out.split() == ["0"]
    assert "feeder thread could not send a message and dropped it: BrokenPipeError" in err

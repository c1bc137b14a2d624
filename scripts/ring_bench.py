#!/usr/bin/env python3
"""The shared-memory ring (sharedmp/channels/ring.py) against a multiprocessing Pipe.

    .venv/bin/python scripts/ring_bench.py [--n 50000] [--rounds 2] [--sizes 1024,64]

Each figure comes from a fresh pair of interpreters: a consumer (started by this script)
that makes the channel and starts a producer (a second fresh interpreter, fds passed at
exec). The producer puts N records of SIZE bytes as fast as it can; the consumer times from
the first record to the last: records/s. Then a ping-pong: the consumer sends 64 bytes, the
producer sends them back, 20,000 times: the median and 90th percentile of a round trip.
Kinds: `compiled` (sharedmp._cring), `twin` (the pure-Python ring), `pipe`
(multiprocessing.Pipe, send_bytes/recv_bytes). The kinds alternate, ROUNDS times, so that a
noisy machine shows as spread rather than as a difference between kinds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

KINDS = ("compiled", "twin", "pipe")
PINGS = 20000


def _ring_cls(kind):
    from sharedmp.channels import ring
    cls = ring.Compiled if kind == "compiled" else ring.Twin
    if cls is None:
        sys.exit("the compiled ring is not built")
    return cls


def _pin(cpu):
    """$RING_BENCH_PIN=1: the consumer on CPU 0, the producer on CPU 1 (a cross-CPU figure)."""
    if os.environ.get("RING_BENCH_PIN") == "1" and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {cpu})


def producer(kind, mode, n, size, fds):
    _pin(1)
    data = b"x" * size
    if kind == "pipe":
        from multiprocessing.connection import Connection
        out = Connection(fds[0])
        back = Connection(fds[1]) if mode == "ping" else None
        if mode == "stream":
            for _ in range(n):
                out.send_bytes(data)
        else:
            for _ in range(n):
                out.send_bytes(back.recv_bytes())
        return
    cls = _ring_cls(kind)
    out = cls.attach(*fds[:3], side="writer")
    if mode == "stream":
        put = out.put
        for _ in range(n):
            put(data)
    else:
        back = cls.attach(*fds[3:6], side="reader")
        put, get = out.put, back.get
        for _ in range(n):
            put(get())
    out.close()


def consumer(kind, mode, n, size):
    _pin(0)
    me = os.path.abspath(__file__)
    if kind == "pipe":
        import multiprocessing
        rd, wr = multiprocessing.Pipe(duplex=False)
        rd2, wr2 = multiprocessing.Pipe(duplex=False)
        mine, theirs = (rd, wr2), [wr.fileno(), rd2.fileno()]
    else:
        cls = _ring_cls(kind)
        inbound = cls.create(1 << 20, side="reader")
        outbound = cls.create(1 << 20, side="writer")
        mine, theirs = (inbound, outbound), [*inbound.fds(), *outbound.fds()]
    child = subprocess.Popen([sys.executable, me, "--producer", kind, mode, str(n), str(size),
                              *map(str, theirs)], pass_fds=theirs)
    try:
        if kind == "pipe":
            recv, send = mine[0].recv_bytes, mine[1].send_bytes
        else:
            recv, send = mine[0].get, mine[1].put
        if mode == "stream":
            recv()
            t = time.perf_counter()
            for _ in range(n - 1):
                recv()
            dt = time.perf_counter() - t
            print(f"{(n - 1) / dt:.0f}")
        else:
            data = b"p" * 64
            times = []
            clock = time.perf_counter
            for _ in range(n):
                t = clock()
                send(data)
                recv()
                times.append(clock() - t)
            times.sort()
            print(f"{times[len(times) // 2] * 1e6:.1f} {times[len(times) * 9 // 10] * 1e6:.1f}")
        if child.wait(60) != 0:
            sys.exit(f"producer failed: {child.returncode}")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def run_one(kind, mode, n, size):
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--consumer", kind, mode,
                          str(n), str(size)], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"{kind} {mode} failed: {out.stderr[-2000:]}")
    return out.stdout.split()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=50000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sizes", default="1024,64")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--producer", nargs="+")
    ap.add_argument("--consumer", nargs=4)
    args = ap.parse_args()
    if args.producer:
        kind, mode, n, size, *fds = args.producer
        return producer(kind, mode, int(n), int(size), [int(f) for f in fds])
    if args.consumer:
        kind, mode, n, size = args.consumer
        return consumer(kind, mode, int(n), int(size))
    kinds = args.kinds.split(",")
    sizes = [int(s) for s in args.sizes.split(",")]
    rates = {(k, s): [] for k in kinds for s in sizes}
    pings = {k: [] for k in kinds}
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
          f"SHAREDMP_SPIN_US={os.environ.get('SHAREDMP_SPIN_US', '(default 50)')}, "
          f"RING_BENCH_PIN={os.environ.get('RING_BENCH_PIN', '0')}")
    for rnd in range(args.rounds):
        for size in sizes:
            for kind in kinds:
                rate = float(run_one(kind, "stream", args.n, size)[0])
                rates[kind, size].append(rate)
                print(f"round {rnd + 1}: {kind:8} {args.n} x {size:5} B: "
                      f"{rate / 1e3:8.0f}k records/s", flush=True)
        for kind in kinds:
            med, p90 = map(float, run_one(kind, "ping", PINGS, 64))
            pings[kind].append((med, p90))
            print(f"round {rnd + 1}: {kind:8} ping-pong 64 B: median {med:.1f} us, "
                  f"p90 {p90:.1f} us", flush=True)
    print("\nsummary (each figure: round 1 / round 2 / ...)")
    for size in sizes:
        for kind in kinds:
            print(f"  {kind:8} {size:5} B  " +
                  " / ".join(f"{r / 1e3:.0f}k" for r in rates[kind, size]) + " records/s")
    for kind in kinds:
        print(f"  {kind:8} ping-pong  " +
              " / ".join(f"{m:.1f} (p90 {p:.1f})" for m, p in pings[kind]) + " us round trip")
    if "compiled" in kinds and "pipe" in kinds:
        for size in sizes:
            ratio = (statistics.median(rates["compiled", size])
                     / statistics.median(rates["pipe", size]))
            print(f"  compiled / pipe at {size} B: {ratio:.1f}x")


if __name__ == "__main__":
    main()

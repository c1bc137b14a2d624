"""Issue 40's case, round after round: a child that holds arrays keeps reading its own bytes
while the parent drops them and allocates new ones of the same size (recycling).

    .venv/bin/python scripts/fork_rounds.py STRATEGY METHOD [ROUNDS]

STRATEGY: file_descriptor or file_system; METHOD: os.fork (the parent holds four 4 MiB
arrays, forks, drops them and allocates four more before the child reads), or fork, spawn,
forkserver (two children of a sharedmp context each get a 4 MiB array as an argument, the
parent drops it at once). Prints one line: rounds whose child read foreign bytes, and what
the private shm directory still lists after ``empty_cache()``. Exits 1 if any round was bad.
"""
import gc
import os
import shutil
import sys
import tempfile
import time

# (before sharedmp is imported, and once: spawn children run this module again)
if not os.environ.get("SHAREDMP_SHM_DIR"):
    os.environ["SHAREDMP_SHM_DIR"] = tempfile.mkdtemp(prefix="fork-rounds-", dir="/dev/shm")
SHM = os.environ["SHAREDMP_SHM_DIR"]

import sharedmp as mp  # noqa: E402

BIG = 1 << 19          # float64: 4 MiB, a segment of its own


def report(a, tag, q):
    time.sleep(0.3)
    q.put((tag, float(a[0]), float(a[-1])))


def raw_fork_round():
    """Whether the os.fork child read foreign bytes."""
    held = []
    for t in range(1, 5):
        a = mp.zeros(BIG)
        a[:] = t
        held.append(a)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        time.sleep(0.3)
        bad = sum(float(a[0]) != t or float(a[-1]) != t for t, a in enumerate(held, 1))
        os.write(w, bytes([bad]))
        os._exit(0)
    os.close(w)
    held = a = None
    gc.collect()
    new = [mp.full(BIG, -t) for t in range(1, 5)]
    try:
        return os.read(r, 1)[0] > 0
    finally:
        os.close(r)
        os.waitpid(pid, 0)
        del new


def context_round(ctx):
    """Whether a child of ``ctx`` read foreign bytes."""
    q, procs = ctx.Queue(), []
    for tag in (1, 2):
        a = mp.zeros(BIG)
        a[:] = tag
        p = ctx.Process(target=report, args=(a, tag, q))
        p.start()
        procs.append(p)
        del a
    try:
        got = [q.get(timeout=60) for _ in procs]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return any(first != tag or last != tag for tag, first, last in got)


def main(strategy, method, rounds):
    mp.set_sharing_strategy(strategy)
    bad = 0
    for _ in range(rounds):
        bad += raw_fork_round() if method == "os.fork" else context_round(mp.get_context(method))
    mp.empty_cache()
    left = [n for n in os.listdir(SHM) if n.startswith("sharedmp_")]
    shutil.rmtree(SHM, ignore_errors=True)
    print(f"{strategy} {method}: {bad} of {rounds} rounds read foreign bytes; "
          f"left after empty_cache(): {left}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 100))

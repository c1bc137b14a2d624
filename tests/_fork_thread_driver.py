"""A program that forks beside a thread that makes and drops shared arrays (issue 46).

``python _fork_thread_driver.py MODE FORKS SHM_DIR [WIDEN_MS]``; MODE: ``raw`` (os.fork) or
``context`` (the fork context's Process). Under file_system, in SHM_DIR. A thread makes a
1 MiB array (a segment of its own) and an 8 KiB one (carved from an arena) per step, each
filled with the step's tag, keeps the last four steps and drops the rest; the main thread
forks. Each child waits while the parent goes on dropping and reusing, then checks that
every array it inherited still holds its tag. Prints ``wrong <n> of <forks>``.

``WIDEN_MS``: a fork hook, registered before sharedmp's (so run after it, just before the
fork itself), sleeps that long: the moment between the parent's hold for the child and the
fork, which a loaded machine stretches as much, is then wide enough that the thread makes
segments in it at nearly every fork.
"""
import os
import sys
import threading
import time

MODE, FORKS, SHM_DIR = sys.argv[1], int(sys.argv[2]), sys.argv[3]
WIDEN = float(sys.argv[4]) / 1000 if len(sys.argv) > 4 else 0.0
if WIDEN:
    os.register_at_fork(before=lambda: time.sleep(WIDEN))
os.environ["SHAREDMP_SHM_DIR"] = SHM_DIR

import numpy as np  # noqa: E402

import sharedmp as mp  # noqa: E402

kept: list = []
stop = threading.Event()
CHILD_WAIT = 0.05             # the parent drops and reuses meanwhile


def churn():
    tag = 1
    while not stop.is_set():
        big = mp.full(1 << 18, tag, dtype=np.float32)
        small = mp.full(2048, tag, dtype=np.float32)
        kept.append((tag, big, small))
        del kept[:-4]
        tag += 1


def wrong(snapshot):
    time.sleep(CHILD_WAIT)
    return sum(not ((big == tag).all() and (small == tag).all()) for tag, big, small in snapshot)


def report(conn):
    conn.send(wrong(list(kept)))


def main():
    mp.set_sharing_strategy("file_system")
    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    time.sleep(0.2)
    ctx, bad = mp.get_context("fork"), 0
    for _ in range(FORKS):
        if MODE == "raw":
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                try:
                    os.close(r)
                    os.write(w, bytes([min(wrong(list(kept)), 255)]))
                finally:
                    os._exit(0)
            os.close(w)
            with os.fdopen(r, "rb") as f:
                data = f.read(1)
            os.waitpid(pid, 0)
            bad += not data or data[0] > 0
        else:
            a, b = ctx.Pipe(duplex=False)
            p = ctx.Process(target=report, args=(b,))
            p.start()
            b.close()
            bad += not a.poll(30) or a.recv() > 0
            p.join(30)
            if p.exitcode is None:
                p.kill()
                p.join()
            a.close()
    stop.set()
    thread.join(10)
    kept.clear()
    print(f"wrong {bad} of {FORKS}", flush=True)


if __name__ == "__main__":
    main()

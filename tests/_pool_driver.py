"""Pools terminated with tasks pending, round after round, run as a script by test_queues.py.

    _pool_driver.py METHOD ROUNDS ROUND_LIMIT

Each round: a ``Pool(2)`` of sharedmp's context ``METHOD``, a few hundred tiny tasks
submitted, and ``terminate()`` while its workers still take them: the parent then drains
the task queue under its ``_rlock`` (``Pool._help_stuff_finish``) while the workers read it.
A round that takes more than ROUND_LIMIT s dumps every thread's stack on stderr and exits
(faulthandler): a hang is a failure, with the place where it hung. Prints "ok ROUNDS".
"""
import faulthandler
import sys

import sharedmp as mp


def main(method, rounds, limit):
    ctx = mp.get_context(method)
    for i in range(rounds):
        faulthandler.dump_traceback_later(limit, exit=True)
        pool = ctx.Pool(2)
        pool.map_async(abs, range(-300, 0), chunksize=1)
        if i % 2:
            pool.apply_async(abs, (-1,)).get(60)      # workers surely started and reading
        pool.terminate()
        pool.join()
        faulthandler.cancel_dump_traceback_later()
    print("ok", rounds, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))

"""A main process that imports sharedmp without NumPy, run as a script by test_import.py.

    _light_driver.py METHOD FIRST

FIRST: "frame" (the first array to arrive comes alone: a binary frame), "pickle" (inside
a tuple: a pickle that names sharedmp's rebuild function) or "numpy-first" (NumPy imported
before sharedmp; the reducers are installed at once). A child of start method METHOD
imports NumPy and sends shared arrays; this process, which never imported NumPy, gets
them, then sends back an array it makes once it has. Prints one JSON line.
"""
import json
import sys

if sys.argv[2] == "numpy-first":
    import numpy  # noqa: F401

import sharedmp as mp


def child(q, back):
    import numpy as np
    a = mp.full(1000, 7.0)
    pair = ("in a pickle", mp.full(10, 3, dtype=np.int32))
    for item in ([pair, a] if sys.argv[2] == "pickle" else [a, pair]):
        q.put(item)
    b = back.get(timeout=60)
    q.put((mp.is_shared(b), float(b.sum())))


def _waiting():
    return sorted(f.name for f in sys.meta_path if type(f).__name__ == "_AfterImport")


def main(method):
    ctx = mp.get_context(method)
    out = {"numpy_at_start": "numpy" in sys.modules, "waiting_at_start": _waiting()}
    q, back = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(q, back))
    p.start()
    got = [q.get(timeout=60), q.get(timeout=60)]
    a = next(x for x in got if type(x) is not tuple)
    label, b = next(x for x in got if type(x) is tuple)
    out.update(numpy_after=type(a).__module__, a=[mp.is_shared(a), float(a.sum())],
               b=[label, mp.is_shared(b), int(b.sum())], waiting_after=_waiting())
    import numpy as np
    back.put(np.arange(10_000.0))                  # not shared here: copied once on put()
    #                                              (80 KB: a smaller one travels by value)
    out["back"] = list(q.get(timeout=60))
    p.join(60)
    out["exitcode"] = p.exitcode
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])

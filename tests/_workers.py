"""Functions that run in child processes of the tests.

They live here, not in the test modules, so that a spawned child imports only
numpy and sharedmp (not pytest and the test module). Each one reports through a
standard ``multiprocessing`` Pipe end (``conn``) and waits on Events with a timeout,
so that a child never outlives a failed test for long.
"""
import gc
import os
import sys
import traceback

import numpy as np

import sharedmp as mp
from sharedmp.arrays import mapping_of
from sharedmp.memory import segment

TIMEOUT = 60


def _guard(conn, fn, *args):
    """Run fn; send ("ok", result) or ("error", traceback) through conn."""
    try:
        result = fn(*args)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise
    conn.send(("ok", result))


# -- description of arrays, the same on both sides ------------------------------------

def describe(a):
    """Everything a round trip must keep: shape, strides, dtype (with byte order), flags, bytes."""
    f = a.flags
    return {
        "shape": a.shape,
        "strides": a.strides,
        "dtype": a.dtype,
        "dtype_str": a.dtype.str,
        "descr": a.dtype.descr,
        "flags": (f.c_contiguous, f.f_contiguous, f.writeable, f.aligned),
        "bytes": a.tobytes(order="A"),
        "type": type(a).__name__,
    }


def poke_value(dtype, k):
    """One element of ``dtype`` made of the byte k (1 for bool)."""
    b = 1 if dtype == np.bool_ else k
    return np.frombuffer(bytes([b]) * dtype.itemsize, dtype=dtype)[0]


def poke_all(views):
    """Write one distinct element at index 0 of every writable non-empty view, in order."""
    for i, v in enumerate(views):
        if v.flags.writeable and v.size:
            v[(0,) * v.ndim] = poke_value(v.dtype, 10 + i)


# -- process targets ---------------------------------------------------------------------

def fill(arrays, value):
    """Write ``value`` into every array (Process argument)."""
    for a in arrays:
        a[...] = value


def alloc_and_send(conn, received, written, shape, dtype):
    """Allocate with mp.zeros here, send it to the parent, write after the parent has it."""
    def run():
        a = mp.zeros(shape, dtype)
        a[...] = 1
        conn.send(a)                      # DupFd: this process serves the fd until received
        if not received.wait(TIMEOUT):
            raise TimeoutError("parent did not receive")
        a[...] = 2                        # a later write; the parent must see it
        written.set()
        return mp.get_sharing_strategy()
    _guard(conn, run)


def report_shared(conn, a):
    _guard(conn, lambda: (mp.is_shared(a), describe(a)))


def report_strategy(conn):
    _guard(conn, mp.get_sharing_strategy)


def describe_views(conn, bases, cases):
    """cases: [(base_key, view)]. Describe each view, check aliasing, then poke them all."""
    def run():
        out = []
        for key, v in cases:
            base = bases[key]
            out.append({
                **describe(v),
                "shared": mp.is_shared(v),
                "aliases_base": bool(v.size) and np.shares_memory(v, base),
                "offset_in_base": v.__array_interface__["data"][0] - base.__array_interface__["data"][0],
            })
        poke_all([v for _, v in cases])
        return out
    _guard(conn, run)


def echo(conn, done, n):
    """Receive n arrays by conn, report their data pointers, send each one back."""
    def run():
        got = [conn.recv() for _ in range(n)]
        ptrs = [a.__array_interface__["data"][0] for a in got]
        conn.send(("ptrs", ptrs))
        for a in got:
            conn.send(a)
        if not done.wait(TIMEOUT):        # serve the DupFds until the parent has them
            raise TimeoutError("parent did not finish")
        return None
    _guard(conn, run)


def keep_many(conn, nofile, messages):
    """Lower RLIMIT_NOFILE, receive ``messages`` lists of arrays, keep them all, count fds."""
    import resource

    def run():
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, min(hard, max(nofile, soft))))
        conn.send(("ready", None))
        kept = []
        for _ in range(messages):
            kept.extend(conn.recv())
        gc.collect()
        ok = all(int(a[0]) == i and mp.is_shared(a) for i, a in enumerate(kept))
        nfds = len(os.listdir("/proc/self/fd"))
        return {"count": len(kept), "values_ok": ok, "fds": nfds,
                "segments": len(segment.live_segments()),
                "limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0]}
    _guard(conn, run)


def attach_and_exit(conn, a, value):
    """Attach a named segment (Process argument), write, drop it, exit normally."""
    def run():
        a[...] = value
        seg = mapping_of(a)[1]
        return {"name": seg.name, "owner": seg.owner_pid}
    _guard(conn, run)


def exhaust(conn, kind):
    """Allocate more shared memory than can be had; report what was raised (exit 0)."""
    def run():
        held, texts = [], []
        if kind == "tmpfs":
            try:                                   # (1) one array bigger than the tmpfs
                mp.empty(16 << 20, np.uint8)
                texts.append(None)
            except mp.OutOfSharedMemory as e:
                texts.append(str(e))
            try:                                   # (2) many small ones until it is full
                for _ in range(100_000):
                    a = mp.zeros(8192, np.uint8)
                    held.append(a)
                texts.append(None)
            except mp.OutOfSharedMemory as e:
                texts.append(str(e))
            for i, a in enumerate(held):           # what was handed out is real memory
                a[...] = i % 251
            ok = all(int(a[-1]) == i % 251 for i, a in enumerate(held))
            return {"texts": texts, "held": len(held), "touched_ok": ok}
        try:
            mp.empty(10 << 40, np.uint8)           # 10 TiB
            texts.append(None)
        except mp.OutOfSharedMemory as e:
            texts.append(str(e))
        a = mp.zeros(1 << 20, np.uint8)            # still usable afterwards
        a[...] = 7
        return {"texts": texts, "held": 1, "touched_ok": bool((a == 7).all())}
    _guard(conn, run)


def fork_alloc(conn, received, checked, parent_key):
    """(fork child) allocate; report the segment; keep checking it after the parent allocated."""
    def run():
        c = mp.zeros(16)
        c[...] = 7
        seg = mapping_of(c)[1]
        conn.send((seg.key, c))
        if not received.wait(TIMEOUT):
            raise TimeoutError("parent did not receive")
        if not checked.wait(TIMEOUT):
            raise TimeoutError("parent did not allocate")
        return {"child_key": seg.key, "differs": seg.key != parent_key,
                "still_7": bool((c == 7).all())}
    _guard(conn, run)


# -- parent side -------------------------------------------------------------------------

def start(ctx, target, *args, duplex=False):
    """Start ``target(conn, *args)`` in a daemon child; returns (process, parent's conn end)."""
    mine, theirs = ctx.Pipe(duplex=duplex)
    p = ctx.Process(target=target, args=(theirs, *args), daemon=True)
    p.start()
    theirs.close()
    return p, mine


def recv(p, conn, timeout=TIMEOUT):
    """The next message from the child; kill it and fail on timeout or EOF."""
    import pytest
    from conftest import join_or_kill
    try:
        ready = conn.poll(timeout)
        msg = conn.recv() if ready else None
    except EOFError:
        ready, msg = False, None
    if not ready:
        code = join_or_kill(p, 5)
        pytest.fail(f"no message from child {p.pid} (exit code {code})", pytrace=False)
    return msg


def result(p, conn, timeout=TIMEOUT):
    """The child's ("ok", value) result; joins it and checks its exit code."""
    import pytest
    from conftest import join_or_kill
    status, value = recv(p, conn, timeout)
    code = join_or_kill(p)
    if status != "ok":
        pytest.fail(f"child failed:\n{value}", pytrace=False)
    assert code == 0, f"child exited with {code}"
    return value


def run(ctx, target, *args, duplex=False):
    """Start target in a child and return its result."""
    p, conn = start(ctx, target, *args, duplex=duplex)
    try:
        return result(p, conn)
    finally:
        conn.close()
        if p.is_alive():
            p.kill()
            p.join(5)


if __name__ == "__main__":
    sys.exit("not a script")

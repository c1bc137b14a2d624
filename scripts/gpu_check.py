"""The GPU check of sharedmp's CUDA path: one run, under 5 minutes, on one GPU.

    PYTHONPATH=src timeout 300 python scripts/gpu_check.py [--quick] [--json FILE]

Prints one ``PASS``/``FAIL``/``SKIP`` line per check with its figures, then the CUDA
bench rows. Every check runs in spawned processes with timeouts; a check that hangs
is killed and reported FAIL. Results are appended to ``--json`` as they come, so a
killed run keeps what it had. Exit status 1 if any check failed.

The ``es_*`` checks run the same checks again with torch's expandable segments
(``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``: VMM memory, carried as POSIX fds in
the message), each in a fresh process started with that environment (its spawned children
inherit it); ``es_nondumpable_sender``: a sender that made itself non-dumpable
(``prctl(PR_SET_DUMPABLE, 0)``), which denies torch's ``pidfd_getfd``, not sharedmp's fds.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

T = 60                                    # seconds for any get/join in a check
EXPANDABLE = "expandable_segments:True"
MARK = "@@gpu_check@@ "                   # a --one run's result line


def _with_expandable(conf):
    """PYTORCH_CUDA_ALLOC_CONF ``conf`` (or None) with expandable segments on."""
    parts = [p for p in (conf or "").split(",")
             if p.strip() and not p.strip().startswith("expandable_segments")]
    return ",".join(parts + [EXPANDABLE])


def _es_env():
    """This process's environment with expandable segments on, for a child process."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path),
                PYTORCH_CUDA_ALLOC_CONF=_with_expandable(os.environ.get("PYTORCH_CUDA_ALLOC_CONF")))


def _va_range(ptr):
    """(start, size) of the virtual address range holding ``ptr`` (for VMM memory: the
    cuMemAddressReserve range, not only what is mapped), or None. Torch's context current."""
    try:
        from sharedmp.cuda import driver
        cu = driver._cu
        attr = cu.CUpointer_attribute
        e1, start = cu.cuPointerGetAttribute(attr.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, ptr)
        e2, size = cu.cuPointerGetAttribute(attr.CU_POINTER_ATTRIBUTE_RANGE_SIZE, ptr)
        if e1 != cu.CUresult.CUDA_SUCCESS or e2 != cu.CUresult.CUDA_SUCCESS:
            return None
        return int(start), int(size)
    except Exception:
        return None


# ---------------------------------------------------------------------------- child targets

def _roundtrip_child(q_in, q_out):
    import torch
    xs = q_in.get(timeout=T)
    with torch.no_grad():                 # writes visible in the sender
        for x in xs:
            if x.numel() and x.dtype != torch.bool and x.is_contiguous():
                x.view(-1)[0:1].fill_(7)
    torch.cuda.synchronize()
    q_out.put([x.data_ptr() for x in xs] + [xs[0].untyped_storage().data_ptr(),
                                            _va_range(xs[0].data_ptr())])
    q_out.put(xs[0])                       # sent back: the sender's own storage
    q_in.get(timeout=T)


def _cupy_child(q_in, q_out):
    import cupy
    import sharedmp  # noqa: F401
    a, b = q_in.get(timeout=T)
    a[0] = 42
    cupy.cuda.get_current_stream().synchronize()
    q_out.put((float(b.sum()), b.strides, a.data.ptr != 0))
    q_in.get(timeout=T)


def _chain_middle(q_in, q_out, n_msgs):
    import sharedmp  # noqa: F401
    for _ in range(n_msgs):
        q_out.put(q_in.get(timeout=T))


def _chain_end(q_in, q_out, n_msgs):
    import torch
    import sharedmp  # noqa: F401
    total = 0.0
    for _ in range(n_msgs):
        batch = q_in.get(timeout=T)
        total += float(sum(t.sum() for t in batch))
        del batch
    q_out.put(total)


def _event_child(q_in, q_out):
    import torch
    import sharedmp  # noqa: F401
    t = q_in.get(timeout=T)
    q_out.put(float(t.sum()))             # no host sync before: the event orders it
    del t
    q_in.get(timeout=T)


def _early_exit_child(q, kill):
    import os
    import signal
    import torch
    import sharedmp  # noqa: F401
    t = torch.ones(1024, device="cuda")
    q.put(t)
    if kill:
        os.kill(os.getpid(), signal.SIGKILL)
    del t                                 # exit normally: waits for the receiver (bounded)


# ---------------------------------------------------------------------------- checks

def check_env(r):
    import torch
    from sharedmp.cuda import driver
    out = {"python": platform.python_version(), "kernel": platform.release(),
           "torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
           "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    try:
        out["nvidia-smi"] = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                           timeout=20).stdout.strip()
    except Exception as e:
        out["nvidia-smi"] = repr(e)
    try:
        import cupy
        out["cupy"] = cupy.__version__
    except ImportError:
        out["cupy"] = None
    why = driver.available()
    out["driver"] = why or f"ok, version {driver.get().version}"
    if why is None:
        d = driver.get()
        out["ipc_events"] = [d.ipc_events_supported(i) for i in range(len(d._uuids))]
    r.update(out)
    return why is None and torch.cuda.is_available()


def check_torch_roundtrip(r):
    import torch
    import sharedmp as mp
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    base = torch.zeros(64, 4, device="cuda")
    xs = [base, base[:, 1], torch.zeros(8, dtype=torch.bfloat16, device="cuda"),
          torch.zeros(8, dtype=torch.int8, device="cuda"), torch.zeros(8, dtype=torch.bool, device="cuda"),
          torch.zeros(4, dtype=torch.complex64, device="cuda"), torch.tensor(3.0, device="cuda"),
          torch.empty(0, device="cuda"), torch.nn.Parameter(torch.zeros(5, device="cuda"))]
    p = ctx.Process(target=_roundtrip_child, args=(q_in, q_out))
    p.start()
    try:
        q_in.put(xs)
        ptrs = q_out.get(timeout=T)
        back = q_out.get(timeout=T)
        torch.cuda.synchronize()
        r["child_ptrs_differ"] = ptrs[0] != base.data_ptr()
        r["write_seen"] = float(base[0, 0]) == 7.0 and float(xs[2][0]) == 7.0
        r["back_same_storage"] = back.untyped_storage() is base.untyped_storage()
        vmm = _vmm_reserve(r, base, ptrs[-1])
        q_in.put("done")
        p.join(T)
        return (r["write_seen"] and r["back_same_storage"] and p.exitcode == 0
                and vmm is not False)
    finally:
        if p.is_alive():
            p.kill()


def _vmm_reserve(r, t, child_range):
    """For VMM memory: the receiver's reserved range for ``t`` must be no larger than the
    allocations (torch's 2 MiB / 20 MiB pages) under it, not the sender's whole reservation
    (about the GPU's memory for torch, which torch's own import reserves). None (not VMM
    memory), else whether it held."""
    from sharedmp.cuda import driver
    d = driver.get()
    if d.memory_kind(0, t.data_ptr()) != "vmm":
        return None
    chunks = d.vmm_chunks(0, t.data_ptr(), t.untyped_storage().nbytes())
    r["sender_chunks"] = [size for _, size, _ in chunks]
    r["sender_reserved"] = (_va_range(t.data_ptr()) or (0, None))[1]
    r["receiver_reserved"] = child_range[1] if child_range else None
    return r["receiver_reserved"] is not None and \
        r["receiver_reserved"] <= sum(r["sender_chunks"])


def check_cupy_roundtrip(r):
    try:
        import cupy
    except ImportError:
        r["skip"] = "cupy not installed"
        return None
    import sharedmp as mp
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    a = cupy.zeros(16, dtype=cupy.float32)
    b = cupy.arange(10, dtype=cupy.float64)[::-1]           # negative strides
    p = ctx.Process(target=_cupy_child, args=(q_in, q_out))
    p.start()
    try:
        q_in.put((a, b))
        total, strides, _ = q_out.get(timeout=T)
        r["sum"], r["strides"], r["write_seen"] = total, strides, float(a[0]) == 42.0
        q_in.put("done")
        p.join(T)
        return total == 45.0 and strides == b.strides and r["write_seen"]
    finally:
        if p.is_alive():
            p.kill()


def check_one_block_mixed(r):
    import torch
    import sharedmp as mp
    from sharedmp.cuda import driver
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    dtypes = [torch.float32, torch.int64, torch.float16, torch.uint8]
    ts = [torch.full((17 + i,), i, dtype=dtypes[i % 4], device="cuda") for i in range(64)]
    d = driver.get()
    if d.memory_kind(0, ts[0].data_ptr()) == "vmm":   # (expandable segments) its pages
        bases = {key for t in ts for _, _, key in d.vmm_chunks(0, t.data_ptr(), t.nbytes)}
    else:
        bases = {d.export(0, t.data_ptr())[0] for t in ts}
    r["blocks"] = len(bases)
    p = ctx.Process(target=_chain_end, args=(q_in, q_out, 1))
    p.start()
    try:
        q_in.put(ts)
        total = q_out.get(timeout=T)
        r["sum"] = total
        want = float(sum(i * (17 + i) for i in range(64)))
        p.join(T)
        return total == want
    finally:
        if p.is_alive():
            p.kill()


def check_chain_many(r, n_total):
    import torch
    import sharedmp as mp
    from sharedmp.cuda import ipc
    ctx = mp.get_context("spawn")
    q1, q2, q3 = ctx.Queue(), ctx.Queue(), ctx.Queue()
    n_msgs = 10
    per = n_total // n_msgs
    mid = ctx.Process(target=_chain_middle, args=(q1, q2, n_msgs))
    end = ctx.Process(target=_chain_end, args=(q2, q3, n_msgs))
    mid.start()
    end.start()
    before = torch.cuda.memory_allocated()
    try:
        t0 = time.perf_counter()
        want = 0.0
        for m in range(n_msgs):
            batch = [torch.full((16,), float(m * per + i), device="cuda") for i in range(per)]
            want += 16.0 * sum(m * per + i for i in range(per))
            q1.put(batch)
            del batch
        total = q3.get(timeout=T * 2)
        r["seconds"] = time.perf_counter() - t0
        r["tensors_per_s"] = n_total / r["seconds"]
        r["sum_ok"] = total == want
        mid.join(T)
        end.join(T)
        exp = ipc.exporter()
        r["live_events"] = exp.live_events
        deadline = time.monotonic() + 10
        while exp.server.outstanding() and time.monotonic() < deadline:
            time.sleep(0.05)
        r["leases_left"] = exp.server.outstanding()
        torch.cuda.empty_cache()
        r["memory_back"] = torch.cuda.memory_allocated() <= before
        return r["sum_ok"] and r["leases_left"] == 0 and r["live_events"] <= ipc.MAX_EVENTS
    finally:
        for p in (mid, end):
            if p.is_alive():
                p.kill()


def check_event_order(r):
    import torch
    import sharedmp as mp
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_event_child, args=(q_in, q_out))
    p.start()
    try:
        n = 1 << 20
        t = torch.zeros(n, device="cuda")
        torch.cuda._sleep(2_000_000_000)          # about a second of GPU time, queued first
        t.fill_(42)                               # then the write, on the same stream
        q_in.put(t)                               # no synchronize: only the event orders it
        total = q_out.get(timeout=T)
        r["sum"], r["want"] = total, 42.0 * n
        q_in.put("done")
        p.join(T)
        return total == 42.0 * n
    finally:
        if p.is_alive():
            p.kill()


def check_sender_exits(r):
    import sharedmp as mp
    ctx = mp.get_context("spawn")
    out = {}
    for kill in (False, True):
        q = ctx.Queue()
        env_before = os.environ.get("SHAREDMP_CUDA_EXIT_TIMEOUT")
        os.environ["SHAREDMP_CUDA_EXIT_TIMEOUT"] = "3"
        p = ctx.Process(target=_early_exit_child, args=(q, kill))
        p.start()
        try:
            t0 = time.monotonic()
            try:
                t = q.get(timeout=T)
                got = float(t.sum())
                out[f"kill={kill}"] = f"received, sum {got}"
                del t
            except Exception as e:
                out[f"kill={kill}"] = f"raised {type(e).__name__}: {e}"[:200]
            p.join(T)
            out[f"kill={kill} seconds"] = round(time.monotonic() - t0, 2)
        finally:
            if env_before is None:
                os.environ.pop("SHAREDMP_CUDA_EXIT_TIMEOUT", None)
            else:
                os.environ["SHAREDMP_CUDA_EXIT_TIMEOUT"] = env_before
            if p.is_alive():
                p.kill()
    r.update(out)
    return out["kill=False"] == "received, sum 1024.0"


_FORK_CODE = """
import sys, torch, sharedmp as mp
LIB = sys.argv[1]
if LIB == "cupy":
    import cupy
    cupy.zeros(1)                                  # CUDA initialised by CuPy
else:
    torch.zeros(1, device="cuda")                  # CUDA initialised by torch

def cpu_child(q):
    q.put(float(torch.ones(3).sum()))              # CPU only: runs in a forked child

def cuda_receiver(q, out):
    try:
        q.get(timeout=60)
        out.put("received (should have raised)")
    except RuntimeError as e:
        out.put("raised: " + str(e))

if __name__ == "__main__":
    ctx = mp.get_context("fork")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=cpu_child, args=(q,))
    p.start()
    got = q.get(timeout=60)
    p.join(60)
    print("cpu child:", got, "exit", p.exitcode)
    p = ctx.Process(target=cuda_receiver, args=(q, out))
    p.start()
    q.put(cupy.ones(4) if LIB == "cupy" else torch.ones(4, device="cuda"))
    got = out.get(timeout=60)
    p.join(60)
    print("cuda receive in the fork child:", got[:200], "exit",
          p.exitcode)
"""


def check_fork(r):
    """A CUDA parent forks: a CPU-only child runs; a CUDA receive in the child raises naming
    spawn (torch and CuPy)."""
    ok = True
    for lib in ("torch", "cupy"):
        if lib == "cupy":
            try:
                import cupy  # noqa: F401
            except ImportError:
                r["cupy"] = "not installed"
                continue
        out = subprocess.run([sys.executable, "-c", _FORK_CODE, lib], capture_output=True,
                             text=True, timeout=T * 3,
                             env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
        r[lib] = (out.stdout.strip() or out.stderr.strip()[-300:])[:400]
        ok = ok and ("cpu child: 3.0 exit 0" in out.stdout
                     and "raised:" in out.stdout and "'spawn'" in out.stdout)
    return ok


def _deadlock_actor(queue, iterations):
    import sharedmp  # noqa: F401
    for _ in range(iterations):
        if not queue.empty():
            queue.get()
        time.sleep(0.01)


def _deadlock_learner(queue, iterations):
    import copy

    import torch
    import sharedmp  # noqa: F401
    net = torch.nn.LSTM(1, 1).cuda()
    for _ in range(iterations):
        if not queue.full():
            queue.put(copy.deepcopy(net.state_dict()))
        time.sleep(0.01)


def check_cuda_ipc_deadlock(r):
    """torch's test_cuda_ipc_deadlock: the learner exits with a message nobody takes."""
    import sharedmp as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue(1)
    procs = {"actor": ctx.Process(target=_deadlock_actor, args=(queue, 100)),
             "learner": ctx.Process(target=_deadlock_learner, args=(queue, 100))}
    t0 = time.monotonic()
    for p in procs.values():
        p.start()
    try:
        for name, p in procs.items():
            p.join(10)
            r[name] = "alive after join(10)" if p.is_alive() else \
                f"exit {p.exitcode} at {time.monotonic() - t0:.1f} s"
        return not any(p.is_alive() for p in procs.values())
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()


_NONDUMPABLE_CODE = """
import ctypes, sys, torch

def sender(q, done, lib):
    if lib == "sharedmp":
        import sharedmp  # noqa: F401
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.prctl(4, 0, 0, 0, 0)                 # PR_SET_DUMPABLE, 0
    t = torch.full((1 << 20,), 3.0, device="cuda")
    expandable = any(s.get("is_expandable") for s in torch.cuda.memory_snapshot())
    kind = None
    if lib == "sharedmp":
        from sharedmp.cuda import driver
        kind = driver.get().memory_kind(0, t.data_ptr())
    dumpable = libc.prctl(3, 0, 0, 0, 0)           # PR_GET_DUMPABLE
    q.put((rc, dumpable, expandable, kind))
    q.put(t)
    done.wait(60)

def cap_sys_ptrace():
    for line in open("/proc/thread-self/status"):
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> 19 & 1)

def drop_cap_sys_ptrace():
    # root has CAP_SYS_PTRACE, which lets pidfd_getfd past a non-dumpable process; containers
    # (docker's default) do not: drop it from this thread's effective set to be like them
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]
    libc = ctypes.CDLL(None, use_errno=True)
    header, data = Header(0x20080522, 0), (Data * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        return "capget failed"
    data[0].effective &= ~(1 << 19)
    return "dropped" if libc.capset(ctypes.byref(header), data) == 0 else "capset failed"

if __name__ == "__main__":
    LIB = sys.argv[1]
    if LIB == "torch":
        import torch.multiprocessing as mp
    else:
        import sharedmp as mp
    torch.zeros(1, device="cuda")
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=sender, args=(q, done, LIB))
    p.start()
    had = cap_sys_ptrace()
    dropped = drop_cap_sys_ptrace() if had else "not held"
    print("receiver CAP_SYS_PTRACE:", had, "->", dropped, cap_sys_ptrace(), flush=True)
    rc, dumpable, expandable, kind = q.get(timeout=60)
    print("sender prctl rc", rc, "dumpable", dumpable, "expandable segment", expandable,
          "memory kind", kind, flush=True)
    try:
        t = q.get(timeout=60)
        print("RESULT received, sum", float(t.sum()), flush=True)
        del t
    except Exception as e:
        print("RESULT raised", type(e).__name__ + ":", str(e)[:300], flush=True)
    done.set()
    p.join(60)
"""


def check_nondumpable_sender(r):
    """A non-dumpable sender (prctl(PR_SET_DUMPABLE, 0)) sends an expandable-segments tensor:
    sharedmp's receive must work (fds in the message); torch's outcome (pidfd_getfd) is
    reported only."""
    env = _es_env()
    ok = False
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "nondumpable.py")   # a file: spawn re-imports its main
        with open(script, "w") as f:
            f.write(_NONDUMPABLE_CODE)
        for lib in ("sharedmp", "torch"):
            try:
                out = subprocess.run([sys.executable, script, lib], capture_output=True,
                                     text=True, timeout=T * 2, env=env)
                text = out.stdout.strip()
                if "RESULT" not in text:
                    text += " | stderr: " + out.stderr.strip()[-400:]
            except subprocess.TimeoutExpired as e:
                text = f"timed out: {(e.stdout or b'')[-300:]!r}"
            r[lib] = text[-800:]
            if lib == "sharedmp":
                ok = ("RESULT received, sum 3145728.0" in text and "dumpable 0" in text
                      and "memory kind vmm" in text)
    return ok


def check_vmm_driver(r):
    """(with expandable segments) The driver's VMM calls alone, in this process: the chunks
    under a tensor that spans torch's pages (and what cuMemGetAddressRange answers there), an
    export imported and mapped again here (same bytes, a range of the chunks' size only),
    unmapped; and whether a chunk's key changes when torch frees its page and maps a new one
    at the same place (else the export caches would hand out the old memory)."""
    import ctypes

    import torch
    from sharedmp.cuda import driver
    d, cu = driver.get(), driver._cu
    probe = torch.ones(1, device="cuda")
    if d.memory_kind(0, probe.data_ptr()) != "vmm":
        r["skip"] = "not VMM memory"
        return False
    n = 24 << 20                                        # spans two of the 20 MiB pages
    t = torch.arange(n // 4, dtype=torch.float32, device="cuda")
    ptr = t.data_ptr()
    chunks = d.vmm_chunks(0, ptr, n)
    r["chunks"] = [(b - chunks[0][0], s) for b, s, _ in chunks]
    e, base, size = cu.cuMemGetAddressRange(ptr)
    r["cuMemGetAddressRange"] = (str(e), int(base) - chunks[0][0], int(size))
    r["reservation"] = _va_range(ptr)[1] if _va_range(ptr) else None
    covered = chunks[0][0] <= ptr and ptr + n <= chunks[-1][0] + chunks[-1][1] and all(
        a[0] + a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    fds = [d.vmm_export(0, b) for b, _, _ in chunks]
    try:
        r["fds_cloexec"] = all(os.get_inheritable(fd) is False for fd in fds)
        mapped = d.vmm_import(0, [(fd, s) for fd, (_, s, _) in zip(fds, chunks)])
    finally:
        for fd in fds:
            os.close(fd)
    try:
        torch.cuda.synchronize()
        got = (ctypes.c_float * 4)()
        off = ptr - chunks[0][0] + n - 16            # the tensor's last 4 floats
        e = cu.cuMemcpyDtoH(ctypes.addressof(got), mapped + off, 16)[0]
        r["read_back"] = (str(e), list(got))
        read_ok = list(got) == [float(n // 4 - 4 + i) for i in range(4)]
        r["import_reserved"] = _va_range(mapped)[1] if _va_range(mapped) else None
    finally:
        d.vmm_unmap(0, mapped, sum(s for _, s, _ in chunks))
    keys = [k for _, _, k in chunks]
    del t
    torch.cuda.synchronize()
    torch.cuda.empty_cache()                          # torch unmaps and releases its pages
    t2 = torch.empty(n // 4, dtype=torch.float32, device="cuda")
    again = d.vmm_chunks(0, t2.data_ptr(), n)
    r["same_place_again"] = t2.data_ptr() == ptr
    r["handle_value_reused"] = bool({k & (2 ** 64 - 1) for k in keys}
                                    & {k & (2 ** 64 - 1) for _, _, k in again})
    r["key_reused"] = bool(set(keys) & {k for _, _, k in again})
    return (covered and read_ok and r["fds_cloexec"] and not r["key_reused"]
            and r["import_reserved"] == sum(s for _, s, _ in chunks))


def check_expandable(r, name, quick):
    """The check ``name`` again in a fresh process with expandable segments on (its spawned
    children inherit the environment); the memory must really be VMM there."""
    env = _es_env()
    cmd = [sys.executable, os.path.abspath(__file__), "--one", name]
    cmd += ["--quick"] if quick else []
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=T * 3, env=env)
    except subprocess.TimeoutExpired as e:
        r["error"] = f"timed out after {T * 3} s: {(e.stderr or b'')[-500:]!r}"
        return False
    got = [json.loads(line[len(MARK):]) for line in out.stdout.splitlines()
           if line.startswith(MARK)]
    if not got:
        r["error"] = (out.stderr.strip() or out.stdout.strip())[-1500:]
        return False
    r.update(got[-1]["r"])
    return got[-1]["ok"] and r.get("memory_kind") == "vmm"


def run_one(name, quick):
    """(--one) Run the check ``name`` here, print its result after MARK."""
    import torch
    from sharedmp.cuda import driver
    r = {"alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    try:
        probe = torch.ones(1 << 18, device="cuda")             # 1 MiB
        r["memory_kind"] = driver.get().memory_kind(0, probe.data_ptr())
        del probe
        ok = dict(_checks(quick), vmm_driver=check_vmm_driver)[name](r)
    except Exception:
        ok, r["error"] = False, traceback.format_exc()[-1500:]
    print(MARK + json.dumps({"ok": ok, "r": r}, default=str), flush=True)
    return 0 if ok else 1


def check_bench(r, quick):
    from sharedmp.cli.bench import cuda as bench_cuda
    rep = bench_cuda.run(quick, timeout=120)
    r["table"] = bench_cuda.format_rows(rep)
    r.update(rep)
    if "rows" not in rep:
        return False
    # torch's rows with expandable segments (pidfd_getfd) are reported, not required
    return all("msgs" in s for wid, row in rep["rows"].items() for system, s in row.items()
               if system == "sharedmp" or not wid.endswith("e"))


def _checks(quick):
    """{name: check(r)} in the order they run."""
    checks = {"env": check_env, "torch_roundtrip": check_torch_roundtrip,
              "cupy_roundtrip": check_cupy_roundtrip, "one_block_mixed": check_one_block_mixed,
              "chain_of_three": lambda r: check_chain_many(r, 1000 if quick else 10000),
              "event_order": check_event_order, "sender_exits": check_sender_exits,
              "cuda_ipc_deadlock": check_cuda_ipc_deadlock, "fork": check_fork,
              "vmm_driver": check_vmm_driver}
    for name in ("vmm_driver", "torch_roundtrip", "one_block_mixed", "chain_of_three",
                 "event_order"):
        checks["es_" + name] = lambda r, name=name: check_expandable(r, name, quick)
    del checks["vmm_driver"]                          # (only with expandable segments)
    checks["es_nondumpable_sender"] = check_nondumpable_sender
    checks["bench"] = lambda r: check_bench(r, quick)
    return checks


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1,000 tensors in the chain, small bench")
    ap.add_argument("--json", default=None, help="append one JSON line per check to this file")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)   # (check_expandable)
    args = ap.parse_args()
    if args.one:
        return run_one(args.one, args.quick)
    checks = _checks(args.quick)
    failed = False
    for name, fn in checks.items():
        r, t0 = {}, time.monotonic()
        try:
            ok = fn(r)
        except Exception:
            ok, r["error"] = False, traceback.format_exc()[-1500:]
        r["seconds"] = round(time.monotonic() - t0, 2)
        status = "SKIP" if ok is None else "PASS" if ok else "FAIL"
        failed |= status == "FAIL"
        table = r.pop("table", None)
        print(f"{status} {name}: {json.dumps(r, default=str)[:1500]}", flush=True)
        if table:
            print(table, flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({"check": name, "status": status, **r}, default=str) + "\n")
        if name == "env" and not ok:
            print("FAIL: no usable GPU; the other checks need one", flush=True)
            return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

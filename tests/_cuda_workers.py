"""Child-process side of the CUDA tests that run without a GPU.

No GPU here, so the driver is a stand-in (``FakeDriver``: pointers are ints, handles
encode the owner's pid and block) -- the one fake of the suite. Everything else is
real: sharedmp's Exporter/Importer bookkeeping and ``reductions/cuda`` forwarding and
homecoming logic, the lease servers and clients on real sockets, real processes and
queues. ``DevArray`` stands in for a framework's array over device memory, with a
reducer that goes through ``reductions.cuda._export`` / ``_home`` like torch and CuPy.
"""
import collections
import gc
import os
import signal
import struct
import sys
import time
from multiprocessing.reduction import ForkingPickler

import sharedmp as mp
from sharedmp import wire
from sharedmp.cuda import ipc, lease
from sharedmp.reductions import cuda as rc

from _workers import TIMEOUT, _guard

MiB = 1 << 20
UUID0 = b"GPU-fake-uuid-0\x00"
STREAM = 7
# Fake device addresses: legacy (cudaMalloc) memory below MANAGED, managed memory (neither
# kind can carry it) below VMM, VMM memory (expandable segments) in 2 MiB chunks above.
MANAGED = 0x4000_0000_0000
VMM = 0x5000_0000_0000
CHUNK = 2 * MiB


class FakeDriver:
    """The driver interface of ``sharedmp.cuda.driver.Driver``, with counters instead of a GPU."""

    HANDLE_SIZE = 64
    # The methods that call the driver in the real Driver (the others read what it cached).
    DRIVER_CALLS = frozenset({"buffer_id", "export", "new_event", "record", "sync_stream",
                              "destroy_event", "open", "close", "open_event", "wait",
                              "close_event", "mark", "finish", "memory_kind", "vmm_chunks",
                              "vmm_export", "vmm_import", "vmm_unmap"})

    def __getattribute__(self, name):
        if name in FakeDriver.DRIVER_CALLS:
            object.__getattribute__(self, "calls")[name] += 1
        return object.__getattribute__(self, name)

    def __init__(self):
        self.calls = collections.Counter()   # driver calls by method
        self.exports = 0          # cuIpcGetMemHandle calls
        self.events = 0           # interprocess events created
        self.records = 0
        self.syncs = 0
        self.waits = 0
        self.open_handles = {}    # handle -> ptr (open now)
        self.imported = []        # VMM chunks imported (the base each fd stood for)
        self.vmm_mapped = {}      # VMM ranges mapped now: ptr -> size
        self.opens = 0
        self.closes = 0
        self._next = 0x7F00_0000_0000

    # -- VMM memory: real fds (memfds naming the chunk they stand for) travel in the messages

    def memory_kind(self, ordinal, ptr):
        from sharedmp.cuda.driver import CudaError
        if ptr >= VMM:
            return "vmm"
        if ptr >= MANAGED:
            raise CudaError("this CUDA memory is managed memory, which CUDA cannot share "
                            "between processes: allocate it with cudaMalloc / torch's default "
                            "allocator, not managed memory")
        return "legacy"

    def vmm_chunks(self, ordinal, ptr, nbytes):
        first = ptr - (ptr - VMM) % CHUNK
        return [(base, CHUNK, base // CHUNK) for base in range(first, ptr + nbytes, CHUNK)]

    def vmm_export(self, ordinal, base):
        fd = os.memfd_create(f"fake-vmm-{base:x}", os.MFD_CLOEXEC)
        os.write(fd, struct.pack("<qQ", os.getpid(), base))
        return fd

    def vmm_import(self, ordinal, chunks):
        """Check that each fd is the chunk it claims (its memfd says which), as the driver
        would refuse an fd that is no allocation; a fake address for the range."""
        for fd, size in chunks:
            pid, base = struct.unpack("<qQ", os.pread(fd, 16, 0))
            if size != CHUNK or base % CHUNK:
                raise RuntimeError(f"cuMemImportFromShareableHandle: fd {fd} is not a chunk")
            self.imported.append(base)
        self._next += 64 * MiB
        self.vmm_mapped[self._next] = sum(size for _, size in chunks)
        return self._next

    def vmm_unmap(self, ordinal, ptr, size):
        if self.vmm_mapped.pop(ptr, None) != size:
            raise RuntimeError("cuMemUnmap of a range that is not mapped")

    def device_uuid(self, ordinal):
        return UUID0[:-1] + bytes([ordinal])

    def local_ordinal(self, uuid):
        return uuid[-1] if uuid[:-1] == UUID0[:-1] else None

    def ipc_events_supported(self, ordinal):
        return True

    def buffer_id(self, ordinal, ptr):
        return ptr // MiB                             # blocks of 1 MiB

    def export(self, ordinal, ptr):
        self.exports += 1
        base = ptr - ptr % MiB
        return base, MiB, struct.pack("<qQQ", os.getpid(), base, MiB).ljust(64, b"\0")

    def new_event(self, ordinal):
        self.events += 1
        return object(), struct.pack("<qQ", os.getpid(), self.events).ljust(64, b"E")

    def record(self, ordinal, event, stream):
        self.records += 1

    def sync_stream(self, ordinal, stream):
        self.syncs += 1

    def destroy_event(self, ordinal, event):
        pass

    def open(self, ordinal, handle):
        pid = struct.unpack_from("<q", handle)[0]
        if pid == os.getpid():
            raise RuntimeError("cuIpcOpenMemHandle failed: CUDA_ERROR_INVALID_CONTEXT (own handle)")
        if handle in self.open_handles:               # sharedmp must open each block once
            raise RuntimeError("cuIpcOpenMemHandle: handle opened twice in this process")
        self.opens += 1
        self._next += 16 * MiB
        self.open_handles[handle] = self._next
        return self._next

    def close(self, ordinal, ptr):
        for h, p in list(self.open_handles.items()):
            if p == ptr:
                del self.open_handles[h]
                self.closes += 1
                return
        raise RuntimeError("cuIpcCloseMemHandle of a pointer that is not open")

    def open_event(self, ordinal, handle):
        return ("event", handle)

    def wait(self, ordinal, event, stream):
        assert event[0] == "event"
        self.waits += 1

    def close_event(self, ordinal, event):
        pass

    def mark(self, ordinal, stream):
        return "mark"

    def finish(self, ordinal, event):
        pass


class DevArray:
    """A stand-in array over device memory [ptr, ptr + nbytes)."""

    def __init__(self, ptr, nbytes, holder=None):
        self.ptr, self.nbytes, self.holder = ptr, nbytes, holder


def reduce_dev(a):
    return rebuild_dev, (rc._export(0, a.ptr, a.nbytes, STREAM, a),)


def rebuild_dev(wire):
    d = ipc.Descriptor.decode(wire)
    home = rc._home(d)
    if home is not None:
        return home
    imp = ipc.importer()
    holder = imp.cached(d, "dev")
    if holder is None:
        holder = imp.open(d, lambda ordinal: STREAM)
        imp.remember(d, "dev", holder)
    return DevArray(holder.ptr, d.nbytes, holder)


def install():
    """Use the fake driver in this process (real lease server and client)."""
    driver = FakeDriver()
    ipc._exporter = ipc.Exporter(driver, lease.server())
    ipc._importer = ipc.Importer(driver, lease.client())
    ForkingPickler.register(DevArray, reduce_dev)
    wire.reducers_changed()
    return driver


def wait_until(cond, timeout=TIMEOUT):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        gc.collect()
        time.sleep(0.02)
    return True


def _wait(event, what):
    if not event.wait(TIMEOUT):
        raise TimeoutError(f"did not {what}")


# -- process targets ---------------------------------------------------------------------

def produce(conn, q, go, n_extra=0, counted=None):
    """Send [a, b, c] (a and b in one block), then report lease counts until all are released.

    counted (an Event) is set once the leases sent are counted: a test that kills the
    receiver waits for it, or the receiver's death could release [a, b, c] first."""
    def run():
        driver = install()
        a = DevArray(5 * MiB + 256, 1024)
        b = DevArray(5 * MiB + 4096, 512)             # the same block as a
        c = DevArray(9 * MiB, 2048)
        q.put([a, b, c])
        for i in range(n_extra):
            q.put(DevArray(20 * MiB + 64 * i, 64))
        server = ipc.exporter().server
        sent = server.outstanding()
        if counted is not None:
            counted.set()
        _wait(go, "get go")
        # the n_extra arrays are never received in the tests: they stay pending
        released = wait_until(lambda: server.outstanding() == n_extra)
        pending = len(server.pending())
        for token, _ in server.pending():
            server.drop(token)                        # explicitly, so that exit need not wait
        return {"sent": sent, "pending": pending, "exports": driver.exports, "events": driver.events,
                "records": driver.records, "released": released, "ignored": server.ignored,
                "home_left": len(ipc.exporter()._home), "free_events": sum(map(len, ipc.exporter()._free.values()))}
    _guard(conn, run)


def consume(conn, q, done, hold=False, twice_q=None):
    """Get [a, b, c]; report the mappings; drop them (or hold them until killed)."""
    def run():
        driver = install()
        a, b, c = q.get(timeout=TIMEOUT)
        imp = ipc.importer()
        info = {"opens": driver.opens, "waits": driver.waits, "b_minus_a": b.ptr - a.ptr,
                "same_holder_block": imp.mappings()}
        info["same_holder_block"] = sorted(info["same_holder_block"].values())
        if twice_q is not None:
            a2 = twice_q.get(timeout=TIMEOUT)
            info["twice_same_holder"] = a2.holder is a.holder
            del a2
        if hold:
            conn.send(("holding", info))
            time.sleep(TIMEOUT)                       # killed by the test
        del a, b, c
        info["unmapped"] = wait_until(lambda: not imp.mappings())
        info["closes_while_idle"] = driver.closes     # the two blocks stay open, idle
        info["idle_bytes"] = ipc._held()[0]
        mp.empty_cache()                              # lets them go
        info["closes"] = driver.closes
        return info
    _guard(conn, run)


def forward(conn, q_in, q_out, done):
    """The middle of a chain: get arrays, send them on, drop ours, stay until ``done``."""
    def run():
        driver = install()
        got = q_in.get(timeout=TIMEOUT)
        q_out.put(got)
        info = {"opens": driver.opens}
        del got
        gc.collect()
        _wait(done, "get done")
        info["unmapped"] = wait_until(lambda: not ipc.importer().mappings())
        info["outstanding"] = ipc.exporter().server.outstanding()
        return info
    _guard(conn, run)


def end_of_chain(conn, q, owner_pid):
    """The end of a chain: the arrays' owner is the first process, the lease the middle one's."""
    def run():
        driver = install()
        got = q.get(timeout=TIMEOUT)
        d = got[0].holder.descriptor
        info = {"owner_is_first": d.owner_pid == owner_pid, "lease_is_owner": d.owner_pid == os.getpid(),
                "opens": driver.opens, "events_waited": driver.waits}
        del got, d
        info["unmapped"] = wait_until(lambda: not ipc.importer().mappings())
        return info
    _guard(conn, run)


def send_back(conn, q_in, q_out, done):
    """Get an array and send it back to its owner."""
    def run():
        install()
        a = q_in.get(timeout=TIMEOUT)
        q_out.put(a)
        del a
        _wait(done, "get done")
        return wait_until(lambda: ipc.exporter().server.outstanding() == 0)
    _guard(conn, run)


def produce_and_die(q):
    """Put an array, then die at once (no exit handlers): its lease server goes with it."""
    install()
    q.put(DevArray(3 * MiB, 128))
    os._exit(0)


def claim_and_die(conn, address, tokens):
    """CLAIM every token on a real connection, say so, then SIGKILL ourselves."""
    client = lease.LeaseClient()
    for t in tokens:
        client.claim(address, t)
    conn.send("claimed")
    conn.close()
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    # The sender-exit check: a plain interpreter (exit handlers run as for any program).
    server = lease.server()
    token = lease.new_token()
    server.add(token, object())
    sys.stdout.write(server.address.hex() + " " + token.hex() + "\n")
    sys.stdout.flush()
    sys.stdin.readline()                              # the test has claimed it


def forked_from_cuda(conn, wire_bytes):
    """(a fork child of a parent where CUDA counts as initialised) CPU work runs; a CUDA send
    and a CUDA receive raise before any driver call; a grandchild is marked too."""
    def run():
        import sharedmp.cuda as c
        driver = install()
        info = {"forked_from": c._forked_from, "cpu": sum(range(10))}
        for what, call in (("send", lambda: ForkingPickler.dumps(DevArray(3 * MiB, 128))),
                           ("receive", lambda: rebuild_dev(wire_bytes))):
            try:
                call()
                info[what] = "no error"
            except RuntimeError as e:
                info[what] = str(e)
        info["driver_calls"] = driver.exports + driver.events + driver.opens + driver.records
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(w, repr(c._forked_from).encode())
            os._exit(0)
        os.close(w)
        info["grandchild"] = os.read(r, 100).decode()
        os.close(r)
        os.waitpid(pid, 0)
        return info
    _guard(conn, run)


# torch's test_cuda_ipc_deadlock, with the stand-in driver: the learner puts a message of
# four arrays whenever the Queue(1) has room, the actor takes what it finds; the last
# message is never taken (on a GPU the learner starts CUDA while the actor is already done).
def deadlock_actor(q, iterations):
    install()
    for _ in range(iterations):
        if not q.empty():
            q.get(timeout=TIMEOUT)
        time.sleep(0.01)


def deadlock_learner(q, iterations, start_delay):
    install()
    time.sleep(start_delay)           # torch's learner makes its LSTM on the GPU first
    for i in range(iterations):
        if not q.full():
            q.put([DevArray(i * 4 * MiB + k * 4096, 1024) for k in range(4)])
        time.sleep(0.01)


def put_one_and_return(q):
    """Send one array and return at once: the exit rule must let it be delivered."""
    install()
    q.put(DevArray(3 * MiB, 128))


def take_late(conn, q, delay):
    def run():
        driver = install()
        time.sleep(delay)
        a = q.get(timeout=TIMEOUT)
        info = {"nbytes": a.nbytes, "opens": driver.opens}
        del a
        info["unmapped"] = wait_until(lambda: not ipc.importer().mappings())
        return info
    _guard(conn, run)


# Driver calls per message in steady state: a ping-pong, so that each message is counted
# alone, over one block that the sender hands out again and again (as a caching allocator
# does) and events that come back to its pool once released.
def steady_sender(conn, q, acks, n, per_msg, base=5 * MiB):
    def run():
        driver = install()
        server = ipc.exporter().server
        counts = []
        for i in range(n):
            before = collections.Counter(driver.calls)
            q.put([DevArray(base + (i % 8) * 8192 + k * 64, 64) for k in range(per_msg)])
            counts.append(dict(driver.calls - before))
            if acks.get(timeout=TIMEOUT) != i or not wait_until(lambda: not server.outstanding()):
                raise RuntimeError(f"message {i} was not released")
        return counts
    _guard(conn, run)


def steady_receiver(conn, q, acks, n):
    def run():
        driver = install()
        imp = ipc.importer()
        counts = []
        for i in range(n):
            before = collections.Counter(driver.calls)
            got = q.get(timeout=TIMEOUT)
            del got                                   # released by the releaser thread
            if not wait_until(lambda: not imp.mappings()):
                raise RuntimeError(f"message {i} was not released here")
            counts.append(dict(driver.calls - before))
            acks.put(i)
        return counts
    _guard(conn, run)


def send_blocks(conn, q, n, done):
    """Send one array in each of ``n`` blocks; stay until ``done`` (the receiver's blocks
    stay open after release: they are the sender's memory)."""
    def run():
        install()
        q.put([DevArray((10 + k) * MiB + 64, 64) for k in range(n)])
        _wait(done, "get done")
        return wait_until(lambda: not ipc.exporter().server.outstanding())
    _guard(conn, run)


def idle_blocks(conn, q, keep):
    """Receive arrays over several blocks with at most ``keep`` idle blocks kept open; report
    what stays open after release, then after the cache's idle time ($SHAREDMP_CACHE_IDLE)."""
    def run():
        ipc.MAX_IDLE_BLOCKS = keep
        driver = install()
        got = q.get(timeout=TIMEOUT)
        info = {"opens": driver.opens}
        del got
        imp = ipc.importer()
        info["unmapped"] = wait_until(lambda: not imp.mappings())
        info["closed_at_release"] = driver.closes
        info["idle_bytes"] = imp.held()[0]
        info["let_go_when_idle"] = wait_until(lambda: imp.held() == (0, 0))
        info["closes"] = driver.closes
        return info
    _guard(conn, run)


# -- VMM memory (expandable segments): fds in the messages ---------------------------------

def vmm_fds():
    """How many fds of this process are the stand-in's VMM exports (or dups of them)."""
    n = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:fake-vmm-")
        except OSError:
            pass
    return n


def vmm_arrays():
    """a over chunks 0 and 1, b in chunk 2 (VMM); c legacy memory, in the same message."""
    return [DevArray(VMM + 1 * MiB, 2 * MiB), DevArray(VMM + 4 * MiB + 64, 1024),
            DevArray(9 * MiB, 2048)]


def vmm_sender(conn, q, go, received=None):
    """Send vmm_arrays(); report the fds kept; once ``go``: wait for the releases and report
    the fds left after the cache let go. ``received`` (an Event): SIGKILL ourselves once the
    receiver has the arrays."""
    def run():
        install()
        q.put(vmm_arrays())
        info = {"fds_while_sent": vmm_fds()}
        if received is not None:
            _wait(received, "hear that the arrays arrived")
            conn.send(("sent", info))
            os.kill(os.getpid(), signal.SIGKILL)
        _wait(go, "get go")
        info["released"] = wait_until(lambda: not ipc.exporter().server.outstanding())
        mp.empty_cache()
        info["fds_left"] = vmm_fds()
        return info
    _guard(conn, run)


def vmm_receiver(conn, q, hold=False, received=None, after_sender_died=None):
    """Get vmm_arrays(): report what arrived; hold them (to be killed) or let go and report
    the fds and mappings left."""
    def run():
        driver = install()
        got = q.get(timeout=TIMEOUT)
        if received is not None:
            received.set()
        info = {"kinds": [type(x.holder.descriptor).__name__ for x in got],
                "imported": sorted(b - VMM for b in driver.imported),
                "vmm_fds_held": vmm_fds(), "mapped": sorted(driver.vmm_mapped.values())}
        if hold:
            conn.send(("holding", info))
            time.sleep(TIMEOUT)                       # killed by the test
        if after_sender_died is not None:
            _wait(after_sender_died, "hear that the sender died")
        del got
        imp = ipc.importer()
        info["unmapped"] = wait_until(lambda: not imp.mappings())
        mp.empty_cache()
        info["fds_left"] = vmm_fds()
        info["mapped_left"] = len(driver.vmm_mapped)
        return info
    _guard(conn, run)


def vmm_refusals(conn):
    """What put() says of memory neither kind carries, and of VMM memory outside a channel."""
    def run():
        import pickle
        install()
        out = {}
        assert ipc.exporter()                         # (its lease server: started before)
        try:
            mp.SimpleQueue().put(DevArray(MANAGED + MiB, 64))
        except Exception as e:
            out["managed"] = f"{type(e).__name__}: {e}"
        try:
            ForkingPickler.dumps(DevArray(VMM, 64))   # as a standard-library pipe does
        except Exception as e:
            out["outside"] = f"{type(e).__name__}: {e}"
        out["legacy_outside"] = type(pickle.loads(ForkingPickler.dumps(DevArray(7 * MiB, 64))))
        out["legacy_outside"] = out["legacy_outside"].__name__
        out["fds_left"] = vmm_fds()
        return out
    _guard(conn, run)

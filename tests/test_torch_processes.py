"""torch tensors between real processes: sharedmp's Queue/Pipe/Pool, standard spawn
arguments, fork inheritance, autograd, Hogwild, DataLoader workers.

Every child is bounded (timeouts on gets, joins and Events). A spawned child imports
torch (about a second), so the tests start few of them.
"""
import copy
import multiprocessing
import os
import time

import pytest

torch = pytest.importorskip("torch")

import sharedmp as mp                                    # noqa: E402
from sharedmp.memory import segment                      # noqa: E402

import _torch_workers as tw                              # noqa: E402
import _workers as w                                     # noqa: E402
from conftest import TIMEOUT                              # noqa: E402

STRATEGIES = ["file_descriptor", "file_system"]


@pytest.fixture(params=STRATEGIES)
def strategy(request):
    mp.set_sharing_strategy(request.param)
    return request.param


def in_sharedmp(t):
    s = t.untyped_storage()
    return segment.containing(s.data_ptr(), s.nbytes())[0] is not None


@pytest.mark.parametrize("alone", [False, True], ids=["one message", "a message each"])
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_child_fills_tensors_received_through_a_queue(method, strategy, alone):
    ctx = mp.get_context(method)
    q = ctx.Queue()
    x = torch.zeros(4, 3)
    y = torch.zeros(5, dtype=torch.int64)
    p, conn = w.start(ctx, tw.fill_received, q, 7, alone)
    try:
        for message in ([x, x[:, 1], y],) if not alone else (x, x[:, 1], y):
            q.put(message)
        info = w.result(p, conn)
    finally:
        conn.close()
    assert info == {"shared": [True, True, True], "same_storage": True, "col": ((4,), (3,), 1)}
    assert (x[:, 1] == 7).all() and (x[:, 0] == 0).all() and (x[:, 2] == 0).all()
    assert (y == 7).all() and in_sharedmp(x)


def test_same_tensor_sent_twice_is_one_storage(strategy):
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    p, conn = w.start(ctx, tw.send_twice, q, done)
    try:
        a, b = q.get(timeout=TIMEOUT), q.get(timeout=TIMEOUT)
        done.set()
        assert w.result(p, conn) == strategy
    finally:
        conn.close()
    assert a.untyped_storage() is b.untyped_storage() and a.data_ptr() == b.data_ptr()
    assert torch.equal(a, torch.ones(4, 5)) and mp.is_shared(a)


def test_identity_round_trip_through_another_process():
    ctx = mp.get_context("spawn")
    inq, outq, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    x = torch.arange(20.0).reshape(4, 5)
    p, conn = w.start(ctx, tw.echo, inq, outq, done)
    try:
        inq.put([x.untyped_storage(), x, x[2], x[:, 1]])
        got = outq.get(timeout=TIMEOUT)
        done.set()
        info = w.result(p, conn)
    finally:
        conn.close()
    assert info == {"one_storage": True, "storage_too": True}
    storage = x.untyped_storage()
    assert got[0] is storage and all(g.untyped_storage() is storage for g in got[1:])
    assert torch.equal(got[3], x[:, 1]) and got[3].stride() == (5,)


def test_pool_map_workers_fill_arguments_and_return_new_tensors(strategy):
    ctx = mp.get_context("spawn")
    args = [torch.zeros(n) for n in (1, 2, 3, 4)]
    pool = ctx.Pool(2)
    try:
        out = pool.map(tw.fill_and_make, args, chunksize=1)
        # close + join, not terminate (the `with` block): a worker killed by SIGTERM cannot
        # unlink the named (file_system) arena it made for its results
        pool.close()
        pool.join()
    finally:
        pool.terminate()
    assert all((a == a.numel()).all() for a in args)                 # written in place by workers
    assert all(torch.equal(o, torch.full((3,), float(n))) for o, n in zip(out, (1, 2, 3, 4)))
    assert all(mp.is_shared(o) for o in out)


def test_spawn_pool_workers_run_autograd():
    ctx = mp.get_context("spawn")
    wt = mp.share(torch.tensor([1.0, 2.0, 3.0]))
    xs = [torch.full((3,), float(k)) for k in (1, 2)]
    pool = ctx.Pool(2)
    try:
        grads = pool.map(tw.grad_of, [(wt, x) for x in xs])
        pool.close()
        pool.join()
    finally:
        pool.terminate()
    for g, x in zip(grads, xs):
        assert torch.allclose(g, 2 * wt * x * x)


def test_autograd_sharing_both_ways(strategy):
    ctx = mp.get_context("spawn")
    q, changed, done = ctx.Queue(), ctx.Event(), ctx.Event()
    param = torch.nn.Parameter(torch.ones(4))
    param.grad = torch.ones(4)                       # not sent
    ip = torch.nn.Parameter(torch.arange(3), requires_grad=False)
    plain = torch.zeros(2, requires_grad=True)
    p, conn = w.start(ctx, tw.autograd_child, q, changed, done)
    try:
        q.put((param, ip, plain))
        status, info = w.recv(p, conn)
        assert status == "received", info
        assert info == {"types": ["Parameter", "Parameter", "Tensor"],
                        "requires_grad": [True, False, True], "grad_none": True, "shared": True}
        param.data.fill_(2)                          # the child sees the parent's change
        changed.set()
        status, back = w.recv(p, conn)
        assert status == "back", back
        assert (param.detach() == 6).all()           # ... and the parent the child's write
        assert [type(b) for b in back] == [torch.nn.Parameter] * 2
        assert [b.requires_grad for b in back] == [False, True] and back[0].grad is None
        done.set()
        info = w.result(p, conn)
    finally:
        conn.close()
    assert info["saw_parent"] and info["grad_ok"]
    assert param.grad is not None and (param.grad == 1).all()   # the parent's own grad untouched


def test_integer_parameter_as_spawn_argument():
    ctx = multiprocessing.get_context("spawn")       # the standard context: ForkingPickler at spawn
    ip = torch.nn.Parameter(torch.tensor([1, 2, 3], dtype=torch.int32), requires_grad=False)
    info = w.run(ctx, tw.describe_param, ip)
    assert info == {"type": "Parameter", "dtype": "torch.int32", "requires_grad": False,
                    "values": [1, 2, 3], "shared": True}


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_standard_process_arguments(method):
    ctx = multiprocessing.get_context(method)
    a, b = torch.zeros(3), torch.zeros(2, 2)
    mp.share_memory_(b)
    shared = w.run(ctx, tw.fill_args, [a, b[1]], 4.0)
    if method == "spawn":                            # moved into shared memory when sent
        assert shared == [True, True] and (a == 4).all()
    else:                                            # fork: inherited; only the shared one is common
        assert shared == [False, True] and (a == 0).all()
    assert (b[1] == 4).all() and (b[0] == 0).all()


def test_torch_shared_tensor_is_inherited_by_a_fork_child():
    t = torch.zeros(5)
    t.share_memory_()                                # torch's, before the fork
    ctx = multiprocessing.get_context("fork")
    p, conn = w.start(ctx, tw.fill_args, [t], 3.0)
    assert w.result(p, conn) == [True]
    assert (t == 3).all()


def test_torch_shared_storage_forwarded_through_a_queue():
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    t = torch.zeros(6)
    t.share_memory_()                                # torch's own shared memory, an fd
    fd, ptr = t.untyped_storage()._get_shared_fd(), t.data_ptr()
    p, conn = w.start(ctx, tw.forward_torch_shared, q, done)
    try:
        q.put(t)
        end = time.monotonic() + TIMEOUT
        while not (t == 5).all() and time.monotonic() < end:
            time.sleep(0.01)
        done.set()
        torch_own = w.result(p, conn)
    finally:
        conn.close()
    assert (t == 5).all() and torch_own is True      # rebuilt from torch's own handle
    assert t.data_ptr() == ptr and t.untyped_storage()._get_shared_fd() == fd and not in_sharedmp(t)


def test_hogwild_workers_share_parameters_and_optimizer_state():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    initial = copy.deepcopy(model)
    mp.share_memory_(model)
    mp.share_memory_(opt)
    before = model.weight.detach().clone()
    ctx = mp.get_context("spawn")
    workers = [w.start(ctx, tw.hogwild, model, opt, 20, seed) for seed in (1, 2)]
    infos = []
    for p, conn in workers:
        try:
            infos.append(w.result(p, conn))
        finally:
            conn.close()
    assert all(i["shared"] for i in infos)
    step = float(opt.state[model.weight]["step"])
    # Both workers advanced the one shared counter. Hogwild takes no lock: Adam's
    # ``step += 1`` is a read-modify-write of shared memory, and two workers that read it at
    # the same instant lose one increment (seen under load: 39).
    assert 20 < step <= 40
    assert max(i["step"] for i in infos) == step
    assert not torch.equal(model.weight.detach(), before)
    x = torch.randn(64, 4)
    y = x.sum(dim=1, keepdim=True)
    with torch.no_grad():
        assert torch.nn.functional.mse_loss(model(x), y) < torch.nn.functional.mse_loss(initial(x), y)


def test_dataloader_with_sharedmp_spawn_context():
    loader = torch.utils.data.DataLoader(
        tw.DictDataset(40), batch_size=8, num_workers=2, timeout=TIMEOUT,
        multiprocessing_context=mp.get_context("spawn"))
    seen, pids = [], set()
    for batch in loader:
        ids = batch["y"].tolist()
        seen.extend(ids)
        assert torch.equal(batch["x"], torch.tensor(ids, dtype=torch.float32)[:, None].expand(-1, 8))
        assert torch.equal(batch["z"], torch.arange(3, dtype=torch.int32)[None] + batch["y"][:, None].int())
        pids.update(batch["pid"].tolist())
        assert all(mp.is_shared(t) for t in batch.values())
        # collated by the workers into sharedmp arenas (_new_shared), not a torch file per tensor
        assert all(segment.containing(t.data_ptr(), 1)[0] is not None for t in batch.values())
    assert seen == list(range(40))
    assert len(pids) == 2 and os.getpid() not in pids
    del loader, batch

"""torch in one process: registration, moving storages in place, reducers, identity, autograd.

Round trips use a sharedmp Pipe (fds in band) and ForkingPickler + pickle.loads
(the standard channels' path: DupFd); processes are in test_torch_processes.py.
"""
import gc
import os
import pickle
import subprocess
import sys
import warnings
from multiprocessing.reduction import ForkingPickler

import pytest

torch = pytest.importorskip("torch")

import sharedmp as mp                                    # noqa: E402
from sharedmp.memory import arena, segment               # noqa: E402
from sharedmp.reductions.torch import tensors as R       # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def pipe():
    a, b = mp.Pipe()
    yield lambda obj: (a.send(obj), b.recv())[1]
    a.close()
    b.close()


def std_roundtrip(obj):
    """What the standard channels do: ForkingPickler, DupFd for fds."""
    return pickle.loads(ForkingPickler.dumps(obj))


ROUNDTRIPS = ["sharedmp", "standard"]


@pytest.fixture(params=ROUNDTRIPS)
def roundtrip(request, pipe):
    return pipe if request.param == "sharedmp" else std_roundtrip


def seg_of(t):
    s = t.untyped_storage()
    return segment.containing(s.data_ptr(), s.nbytes())[0]


# -- registration ------------------------------------------------------------------------

def _python(code):
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout


CHECK = """
import sys
from multiprocessing.reduction import ForkingPickler as FP
import torch
from torch.nn.parameter import Parameter
import sharedmp.reductions.torch.tensors as R
ours = all(FP._extra_reducers[c] is R.reduce_tensor for c in (torch.Tensor, Parameter))
ours &= FP._extra_reducers[torch.UntypedStorage] is R.reduce_storage
ours &= FP._extra_reducers[torch.FloatStorage] is R.reduce_typed_storage_child
waiting = [f for f in sys.meta_path if type(f).__name__ == '_AfterImport' and f.name.startswith('torch')]
print(ours, bool(waiting), type(torch.__loader__).__name__, type(torch.__spec__.loader).__name__)
"""


def test_import_sharedmp_does_not_import_torch():
    out = _python("import sys, sharedmp; print('torch' in sys.modules, "
                  "[type(f).__name__ for f in sys.meta_path][0])")
    assert out.split() == ["False", "_AfterImport"]


@pytest.mark.parametrize("first", ["sharedmp", "torch"])
def test_reducers_registered_after_torchs_whichever_comes_first(first):
    other = "torch" if first == "sharedmp" else "sharedmp"
    out = _python(f"import {first}, {other}\n" + CHECK)
    assert out.split() == ["True", "False", "SourceFileLoader", "SourceFileLoader"]


def test_asking_whether_torch_is_installed_does_not_lose_the_registration():
    # importlib.util.find_spec("torch") (libraries' is_torch_available()) goes through the
    # waiting finder; its spec is thrown away: the finder must wait for the real import.
    out = _python("import importlib.util, sharedmp\n"
                  "assert importlib.util.find_spec('torch') is not None\n" + CHECK)
    assert out.split() == ["True", "False", "SourceFileLoader", "SourceFileLoader"]


def test_torch_first_imported_by_unpickling_a_tensor():
    # A spawned child whose first contact with torch is the tensor it unpickles: the
    # rebuild function's module imports torch, which registers sharedmp's reducers.
    mp.set_sharing_strategy("file_system")      # a name travels: no fd to hand over
    t = torch.arange(5.0)
    data = ForkingPickler.dumps(t)
    code = ("import sys, pickle, sharedmp\n"
            "assert 'torch' not in sys.modules\n"
            f"t = pickle.loads({bytes(data)!r})\n" + CHECK +
            "print(t.tolist(), sharedmp.is_shared(t))\n")
    out = _python(code).split("\n")
    assert out[0].split() == ["True", "False", "SourceFileLoader", "SourceFileLoader"]
    assert out[1] == "[0.0, 1.0, 2.0, 3.0, 4.0] True"


# -- moving in place ---------------------------------------------------------------------

def test_share_memory_moves_in_place_and_views_follow():
    x = torch.arange(20.0).reshape(4, 5)
    view, col = x[1:3], x[:, 1]
    storage = x.untyped_storage()
    assert not mp.is_shared(x)
    assert mp.share_memory_(x) is x
    assert x.untyped_storage() is storage and view.untyped_storage() is storage
    seg, mm = segment.containing(x.data_ptr(), 80)
    assert seg is not None and mp.is_shared(x) and mp.is_shared(view) and x.is_shared()
    assert torch.equal(x, torch.arange(20.0).reshape(4, 5))
    # every view reads and writes the shared memory
    import numpy as np
    np.frombuffer(mm, np.float32, 20, x.data_ptr() - seg.address)[6] = -1
    assert view[0, 1] == -1 and col[1] == -1
    col.fill_(9)
    assert x[3, 1] == 9
    assert not x.untyped_storage().resizable()       # shared memory does not grow


def test_small_storages_are_packed_into_arenas():
    ts = [mp.share(torch.ones(16) * i) for i in range(50)]
    segs = {seg_of(t).key for t in ts}
    assert len(segs) <= 2
    big = mp.share(torch.ones(arena.SMALL_LIMIT // 4 + 1))
    assert seg_of(big).size >= big.untyped_storage().nbytes() and seg_of(big).key not in segs
    assert all(t[0] == i for i, t in enumerate(ts))


def test_share_returns_the_tensor_and_storages_typed_storages_move_too():
    t = torch.ones(3)
    assert mp.share(t) is t and mp.is_shared(t)
    s = torch.zeros(8).untyped_storage()
    assert mp.share_memory_(s) is s and mp.is_shared(s) and s.is_shared()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fs = torch.FloatStorage(4)
    mp.share_memory_(fs)
    assert mp.is_shared(fs) and mp.is_shared(fs._untyped_storage)


def test_empty_like_gives_shared_tensors():
    z = mp.zeros_like(torch.ones(2, 3, dtype=torch.float64))
    assert z.shape == (2, 3) and z.dtype == torch.float64 and mp.is_shared(z)
    assert torch.equal(z, torch.zeros(2, 3, dtype=torch.float64)) and z.is_contiguous()
    b = mp.empty_like(torch.ones(5), dtype=torch.bool, shape=(5,))
    assert b.dtype == torch.bool and mp.is_shared(b)
    assert mp.empty_like(torch.ones(0, 3)).shape == (0, 3)


def test_new_shared_storages_are_sharedmp_memory():
    # where DataLoader workers collate their batches (torch.utils.data._utils.collate)
    s = torch.UntypedStorage._new_shared(1000)
    assert isinstance(s, torch.UntypedStorage) and s.nbytes() == 1000
    assert segment.containing(s.data_ptr(), 1000)[0] is not None and s.is_shared()
    assert bytes(s) == bytes(1000)                     # zeroed, as torch's fresh shared memory
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        typed = torch.ones(2)._typed_storage()._new_shared(6)
    assert typed.dtype == torch.float32 and seg_of(torch.empty(0).set_(typed)) is not None
    assert torch.UntypedStorage._new_shared(0).nbytes() == 0
    assert torch.UntypedStorage._new_shared(8, device="meta").device.type == "meta"


def test_torchs_own_share_memory_keeps_sharedmp_memory():
    model = torch.nn.Linear(3, 2)
    mp.share_memory_(model)
    ptr = model.weight.data_ptr()
    model.share_memory()                 # torch's: must not copy it out of sharedmp memory
    assert model.weight.data_ptr() == ptr and model.weight.is_shared()


def test_share_memory_of_module_covers_parameters_buffers_and_grads():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    model(torch.randn(5, 4)).sum().backward()
    mp.share_memory_(model)
    tensors = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters())]
    assert all(mp.is_shared(t) for t in tensors) and mp.is_shared(model)
    assert model[1].num_batches_tracked.is_shared()


@pytest.mark.parametrize("make, keys", [
    (lambda ps: torch.optim.Adam(ps, amsgrad=True), {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
    (lambda ps: torch.optim.AdamW(ps), {"step", "exp_avg", "exp_avg_sq"}),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), {"momentum_buffer"}),
    (lambda ps: torch.optim.RMSprop(ps, momentum=0.5, centered=True),
     {"step", "square_avg", "momentum_buffer", "grad_avg"}),
    (lambda ps: torch.optim.Adagrad(ps), {"step", "sum"}),
])
def test_share_memory_of_optimizer_initialises_state_eagerly(make, keys):
    model = torch.nn.Linear(3, 2)
    opt = make(model.parameters())
    mp.share_memory_(opt)
    for p in model.parameters():
        assert mp.is_shared(p)
        assert set(opt.state[p]) == keys
        assert all(mp.is_shared(v) for v in opt.state[p].values())
    before = {k: v.clone() for k, v in opt.state[model.weight].items()}
    ptrs = {k: v.data_ptr() for k, v in opt.state[model.weight].items()}
    model(torch.randn(4, 3)).sum().backward()
    opt.step()                           # the optimizer uses (and updates) the shared state in place
    state = opt.state[model.weight]
    assert {k: v.data_ptr() for k, v in state.items()} == ptrs
    assert any(not torch.equal(before[k], state[k]) for k in keys)


def test_eager_state_matches_torchs_lazy_state_after_a_step():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    oa, ob = torch.optim.Adam(a.parameters(), lr=0.1), torch.optim.Adam(b.parameters(), lr=0.1)
    mp.share_memory_(ob)
    x = torch.randn(4, 3)
    for m, o in ((a, oa), (b, ob)):
        for _ in range(3):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            o.step()
    assert all(torch.allclose(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_share_memory_of_unsupported_optimizer_needs_a_step_first():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adamax(model.parameters())
    with pytest.raises(TypeError, match="run one optimizer step first"):
        mp.share_memory_(opt)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    mp.share_memory_(opt)
    assert all(mp.is_shared(v) for s in opt.state.values() for v in s.values())


def test_share_memory_rejects_other_objects():
    with pytest.raises(TypeError, match="mp.share"):
        mp.share_memory_(mp.zeros(3))
    with pytest.raises(TypeError, match="torch tensor"):
        mp.share_memory_([1, 2])


# -- reducers ----------------------------------------------------------------------------

def test_unshared_tensor_moves_when_sent_and_arrives_shared(roundtrip):
    x = torch.arange(12, dtype=torch.int16).reshape(3, 4)
    view = x[1]
    y = roundtrip(x)
    assert mp.is_shared(x) and mp.is_shared(view) and mp.is_shared(y)
    assert y.untyped_storage() is x.untyped_storage()          # same process: the same storage
    assert torch.equal(y, x) and y.dtype == torch.int16


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                   torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool,
                                   torch.complex64, torch.complex128])
def test_dtypes_and_views_survive(dtype, pipe):
    base = (torch.arange(60) % 7).to(dtype).reshape(3, 4, 5)
    views = [base, base[1], base[:, 1], base[..., ::2], base.transpose(0, 2), base[2, 3, 4],
             base.t() if base.dim() == 2 else base.permute(2, 0, 1), base[1:, 2:]]
    got = pipe(views)
    for v, g in zip(views, got):
        assert g.dtype == v.dtype and g.shape == v.shape and g.stride() == v.stride()
        assert g.storage_offset() == v.storage_offset() and torch.equal(g, v)
        assert g.untyped_storage() is base.untyped_storage()


def test_identity_round_trip_in_the_sending_process(roundtrip):
    x = torch.arange(20.0).reshape(4, 5)
    got = roundtrip([x.untyped_storage(), x, x[2], x[:, 1]])
    storage = x.untyped_storage()
    assert got[0] is storage
    assert all(g.untyped_storage() is storage for g in got[1:])
    assert len({storage._cdata} | {g.untyped_storage()._cdata for g in got[1:]}) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        typed = roundtrip(x.storage())
    assert typed._untyped_storage is storage


def test_same_memory_received_twice_is_one_storage(pipe):
    x = mp.share(torch.ones(6))
    storage = x.untyped_storage()
    first = pipe(x)
    del x, first, storage
    gc.collect()                         # the sender's storage is gone; the memory is not
    a, b = pipe(mp.empty_like(torch.ones(4))), None
    b = pipe(a)
    assert a.untyped_storage() is b.untyped_storage()


def test_storages_and_typed_storages_travel(roundtrip):
    s = torch.ones(10).untyped_storage()
    got = roundtrip(s)
    assert got is s and mp.is_shared(s)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        legacy = torch.DoubleStorage(3)
        typed = torch.TypedStorage(5, dtype=torch.int32)
        got_legacy, got_typed = roundtrip([legacy, typed])
    # (torch.DoubleStorage(...) is a TypedStorage of float64 that passes isinstance)
    assert isinstance(got_legacy, torch.DoubleStorage) and got_legacy.dtype == torch.float64
    assert got_legacy._untyped_storage is legacy._untyped_storage
    assert type(got_typed) is torch.TypedStorage and got_typed.dtype == torch.int32
    assert roundtrip(torch.UntypedStorage()).nbytes() == 0


def test_parameter_and_requires_grad_are_kept_grad_is_not_sent(roundtrip):
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    ip = torch.nn.Parameter(torch.arange(3), requires_grad=False)       # integer: must be False
    leaf = torch.zeros(2, requires_grad=True)
    gp, gf, gi, gl = roundtrip([p, frozen, ip, leaf])
    assert type(gp) is torch.nn.Parameter and gp.requires_grad
    assert type(gf) is torch.nn.Parameter and not gf.requires_grad
    assert type(gi) is torch.nn.Parameter and gi.dtype == torch.int64 and not gi.requires_grad
    assert type(gl) is torch.Tensor and gl.requires_grad and gl.is_leaf
    # in the same process, Parameter wraps the very same storage
    assert gp.untyped_storage() is p.untyped_storage()


def test_grad_is_not_sent_to_another_process_view(roundtrip):
    p = torch.nn.Parameter(torch.ones(3))
    (p * 2).sum().backward()
    got = roundtrip(p)
    assert got is not p and got.grad is None


def test_non_leaf_that_requires_grad_raises(pipe):
    y = torch.ones(3, requires_grad=True) * 2
    with pytest.raises(RuntimeError, match=r"requires_grad.*detach\(\)"):
        pipe(y)
    with pytest.raises(RuntimeError, match=r"requires_grad.*detach\(\)"):
        ForkingPickler.dumps(y)
    got = pipe(y.detach())
    assert not got.requires_grad and torch.equal(got, torch.full((3,), 2.0))


def test_hooks_are_not_sent_and_warn():
    p = torch.ones(3, requires_grad=True)
    p.register_hook(lambda g: g)
    with pytest.warns(UserWarning, match="hook"):
        got = std_roundtrip(p)
    assert not got._backward_hooks


@pytest.mark.filterwarnings("ignore:Sparse")
def test_empty_meta_and_sparse_tensors(roundtrip):
    empty = torch.empty(0, 3, dtype=torch.float64)
    meta = torch.empty(3, 4, device="meta").t()
    coo = torch.sparse_coo_tensor(torch.tensor([[0, 1, 1], [2, 0, 2]]), torch.tensor([3.0, 4.0, 5.0]),
                                  (2, 3)).coalesce()
    csr = torch.tensor([[1.0, 0, 2], [0, 0, 3]]).to_sparse_csr()
    meta_param = torch.nn.Parameter(torch.empty(2, device="meta"))
    ge, gm, gcoo, gcsr, gmp = roundtrip([empty, meta, coo, csr, meta_param])
    assert ge.shape == (0, 3) and ge.dtype == torch.float64
    assert gm.device.type == "meta" and gm.shape == (4, 3) and gm.stride() == meta.stride()
    assert type(gmp) is torch.nn.Parameter and gmp.device.type == "meta" and gmp.requires_grad
    assert gcoo.layout == torch.sparse_coo and gcoo.is_coalesced() and torch.equal(gcoo.to_dense(), coo.to_dense())
    assert gcsr.layout == torch.sparse_csr and torch.equal(gcsr.to_dense(), csr.to_dense())
    # the parts travelled as shared tensors: the received values are the sender's memory
    assert mp.is_shared(coo) and mp.is_shared(csr)
    gcoo._values()[0] = 30
    assert coo._values()[0] == 30


@pytest.mark.filterwarnings("ignore")
def test_nested_and_quantized_tensors(pipe):
    nt = torch.nested.nested_tensor([torch.ones(2), torch.arange(3.0)])
    q = torch.quantize_per_tensor(torch.tensor([1.0, 2.0, 3.0]), 0.5, 1, torch.quint8)
    gnt, gq = pipe([nt, q])
    assert gnt.is_nested and [t.tolist() for t in gnt.unbind()] == [[1.0, 1.0], [0.0, 1.0, 2.0]]
    assert gq.dtype == torch.quint8 and gq.q_scale() == 0.5 and torch.equal(gq.dequantize(), q.dequantize())
    assert mp.is_shared(q)               # its storage travelled through sharedmp memory


def test_conjugate_and_negative_views(roundtrip):
    z = torch.tensor([1 + 2j, 3 - 4j])
    c = z.conj()
    n = c.imag                                           # a view with the negative bit
    gc_, gn = roundtrip([c, n])
    assert gc_.is_conj() and torch.equal(gc_, c)
    assert gn.is_neg() and torch.equal(gn, n)


class Tagged(torch.Tensor):
    pass


def test_tensor_subclass_keeps_type_and_memory(roundtrip):
    t = torch.ones(4).as_subclass(Tagged)
    t.tag = "hello"
    got = roundtrip(t)
    assert type(got) is Tagged and got.tag == "hello" and torch.equal(got, t)
    assert mp.is_shared(t) and got.untyped_storage() is t.untyped_storage()


def test_tensor_shared_by_torch_is_forwarded_without_copy(roundtrip):
    t = torch.arange(6.0)
    t.share_memory_()                    # torch's own shared memory (file_descriptor)
    fd, ptr = t.untyped_storage()._get_shared_fd(), t.data_ptr()
    got = roundtrip([t, t[2:]])
    assert t.data_ptr() == ptr and t.untyped_storage()._get_shared_fd() == fd   # not moved
    assert seg_of(t) is None
    assert got[0].untyped_storage() is t.untyped_storage()
    assert got[1].storage_offset() == 2 and torch.equal(got[1], t[2:])


def test_tensor_shared_by_torch_file_system_is_forwarded():
    import torch.multiprocessing as tmp
    old = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        t = torch.arange(6.0)
        t.share_memory_()
        ptr = t.data_ptr()
        got = std_roundtrip(t)
        assert t.data_ptr() == ptr and got.untyped_storage() is t.untyped_storage()
    finally:
        tmp.set_sharing_strategy(old)


def test_without_swap_data_ptr_tensors_move_into_torchs_shared_memory(monkeypatch, pipe):
    # what an older torch (no UntypedStorage._swap_data_ptr_) gets: torch's own in-place move
    from sharedmp.reductions.torch import storage
    monkeypatch.setattr(storage, "HAVE_SWAP", False)
    x = torch.arange(8.0)
    view = x[3:]
    got = pipe([x, view])
    assert x.untyped_storage().is_shared() and seg_of(x) is None
    assert torch._C.StorageBase.is_shared(x.untyped_storage())
    assert got[0].untyped_storage() is x.untyped_storage() and torch.equal(got[1], view)


# -- a tensor alone: a binary frame, no pickle ------------------------------------------

def test_a_tensor_alone_travels_in_a_tensor_frame(pipe):
    from sharedmp import wire
    x = torch.arange(24.0).reshape(4, 6)
    p = torch.nn.Parameter(torch.ones(3))
    cases = [x, x[1], x[:, 2], x.t(), x[2, 3], x[1:, ::2], p, torch.nn.Parameter(torch.arange(3), requires_grad=False),
             torch.zeros(2, requires_grad=True), torch.arange(5, dtype=torch.int16), torch.ones(2, 2, dtype=torch.bool),
             torch.complex(x, -x).conj(), torch.complex(x, -x).conj().imag]      # (conj and neg bits)
    for t in cases:
        payload, fds, flags = wire.dumps(t)
        assert flags == wire.FLAG_TENSOR and len(fds) == 1 and len(payload) == 27 + 16 * t.dim()
        got = pipe(t)
        assert type(got) is type(t) and got.requires_grad == t.requires_grad and got.dtype == t.dtype
        assert (got.shape, got.stride(), got.storage_offset()) == (t.shape, t.stride(), t.storage_offset())
        assert got.untyped_storage() is t.untyped_storage() and torch.equal(got.detach(), t.detach())
        assert (got.is_conj(), got.is_neg()) == (t.is_conj(), t.is_neg())
    assert p.grad is None and pipe(p).grad is None


def test_a_received_tensor_is_a_leaf_of_its_own_over_the_storage(pipe):
    from sharedmp.reductions.torch import storage
    assert storage.NEW_OVER_STORAGE            # this torch makes one with template.new(storage)
    x = mp.share(torch.arange(6.0))
    for t in (x, x[2:], x.view(2, 3), x.view(2, 3).t()):
        got = pipe(t)
        assert got._base is None and got.is_leaf and got.untyped_storage() is x.untyped_storage()
        assert (got.shape, got.stride(), got.storage_offset()) == (t.shape, t.stride(), t.storage_offset())
    r, w = mp.Pipe()                      # and over memory this process did not have yet
    w.send(mp.share(torch.ones(4, dtype=torch.float64)))
    got = r.recv()
    assert got.dtype == torch.float64 and got._base is None and torch.equal(got, torch.ones(4, dtype=torch.float64))


def test_what_the_tensor_frame_does_not_carry_goes_through_pickle(pipe, monkeypatch):
    from sharedmp import wire
    x = mp.share(torch.arange(4.0))
    others = [x.as_subclass(Tagged), torch.ones(0), torch.ones(2, device="meta"),
              torch.ones(3).to_sparse(), [x], torch.ones(2).share_memory_()]
    for t in others:
        assert wire.dumps(t)[2] == 0, t
        got = pipe(t)
        assert type(got) is type(t)
    with pytest.raises(RuntimeError, match="requires_grad"):      # a non-leaf: pickle's error
        pipe(torch.ones(2, requires_grad=True) * 2)
    # a reducer of the user's own for tensors wins over the frame
    own = lambda t: (torch.tensor, (t.tolist(),))                  # noqa: E731
    monkeypatch.setitem(ForkingPickler._extra_reducers, torch.Tensor, own)
    wire.reducers_changed()
    try:
        assert wire.dumps(x)[2] == 0
        got = pipe(x)
        assert torch.equal(got, x) and not mp.is_shared(got)
    finally:
        monkeypatch.undo()
        wire.reducers_changed()
    assert wire.dumps(x)[2] == wire.FLAG_TENSOR


def test_a_misaligned_view_is_refused_by_the_sender(pipe):
    import numpy as np
    raw = mp.empty(80, dtype=np.uint8)
    t = torch.from_numpy(raw[3:67].view(np.float64))       # elements at an odd byte offset
    for send in (pipe, lambda obj: pipe([obj])):           # the frame, and pickle
        with pytest.raises(ValueError, match=r"not aligned.*clone\(\)"):
            send(t)
    assert torch.equal(pipe(t.clone()), t)


def test_hostile_offsets_are_refused():
    from sharedmp.errors import SegmentError
    mm, off = arena.allocate(64, mp.get_sharing_strategy())
    with pytest.raises(SegmentError):
        R.rebuild_tensor_in_segment(mm, len(mm) - 8, 64, 0, 0, (16,), (1,))
    with pytest.raises(SegmentError):
        R.rebuild_storage_in_segment(mm, -64, 64)
    with pytest.raises(RuntimeError):                    # the view does not fit in its storage
        R.rebuild_tensor_in_segment(mm, off, 64, 0, 10, (16,), (1,))


def test_file_system_strategy(pipe):
    mp.set_sharing_strategy("file_system")
    x = torch.ones(100)
    y = pipe(x)
    seg = seg_of(x)
    assert seg.kind == "file_system" and y.untyped_storage() is x.untyped_storage()
    assert os.path.exists(seg.path)


# -- drop-in names -----------------------------------------------------------------------

# The private helpers of torch.multiprocessing that its own test suite calls.
TORCH_TEST_HELPERS = {"_set_thread_name", "_get_thread_name"}


def torch_public_names():
    """torch.multiprocessing's names: __all__, its other public names (spawn, ProcessContext,
    init_reductions, ...) but not the modules it imports, and the helpers its tests use."""
    import types

    import torch.multiprocessing as tmp
    public = {n for n in dir(tmp) if not n.startswith("_")
              and not isinstance(getattr(tmp, n), types.ModuleType)}
    return tmp, public | set(tmp.__all__) | TORCH_TEST_HELPERS


def test_every_torch_multiprocessing_name_is_there():
    tmp, names = torch_public_names()
    missing = sorted(n for n in names if not hasattr(mp, n))
    assert not missing, f"sharedmp lacks torch.multiprocessing's {missing}"
    assert set(tmp.__all__) <= set(mp.__all__)
    for name in TORCH_TEST_HELPERS:
        assert getattr(mp, name) is getattr(tmp, name)
    assert mp.ENV_VAR_PARALLEL_START == tmp.ENV_VAR_PARALLEL_START


def test_torch_compatibility_aliases():
    mp.init_reductions()                  # torch's name for registering the reducers: idempotent
    t = torch.arange(4.0)
    assert torch.equal(std_roundtrip(t), t) and t.is_shared()
    assert issubclass(mp.SpawnContext, mp.ProcessContext)
    with pytest.warns(UserWarning, match="renamed to ProcessContext"):
        ctx = mp.SpawnContext([], [])      # torch's old name, with torch's warning
    assert ctx.pids() == []

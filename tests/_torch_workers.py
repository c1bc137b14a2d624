"""Functions that run in child processes of the torch tests.

They live here, not in the test modules, so that a spawned child imports only torch,
numpy and sharedmp. Each reports through ``conn`` ("ok", result) or ("error", traceback)
(``_workers._guard``) and waits on Events with a timeout, so that a child never outlives
a failed test for long.
"""
import os
import sys

import torch

import sharedmp as mp
from _workers import TIMEOUT, _guard

torch.set_num_threads(1)


def _wait(event, what):
    if not event.wait(TIMEOUT):
        raise TimeoutError(f"parent did not {what}")


def storage_ids(tensors):
    return [t.untyped_storage()._cdata for t in tensors]


# -- Queue / Pipe ------------------------------------------------------------------------

def fill_received(conn, q, value, alone=False):
    """Get [x, x[:, 1], y] from q (``alone``: as three messages, each a tensor frame), write
    ``value`` into the view and y, report what arrived."""
    def run():
        if alone:
            x, col, y = (q.get(timeout=TIMEOUT) for _ in range(3))
        else:
            x, col, y = q.get(timeout=TIMEOUT)
        col.fill_(value)
        y.fill_(value)
        return {"shared": [mp.is_shared(t) for t in (x, col, y)],
                "same_storage": x.untyped_storage()._cdata == col.untyped_storage()._cdata,
                "col": (tuple(col.shape), col.stride(), col.storage_offset())}
    _guard(conn, run)


def send_twice(conn, q, done):
    """Put the same tensor twice; keep it alive until the parent has both."""
    def run():
        t = torch.ones(4, 5)
        q.put(t)
        q.put(t)
        _wait(done, "receive both")
        return mp.get_sharing_strategy()
    _guard(conn, run)


def echo(conn, inq, outq, done):
    """Receive one object from inq, report its storages, send it back through outq."""
    def run():
        obj = inq.get(timeout=TIMEOUT)
        tensors = [o for o in obj if isinstance(o, torch.Tensor)]
        ids = storage_ids(tensors)
        outq.put(obj)
        _wait(done, "receive the echo")
        return {"one_storage": len(set(ids)) == 1,
                "storage_too": obj[0]._cdata == ids[0]}
    _guard(conn, run)


# -- autograd ----------------------------------------------------------------------------

def autograd_child(conn, q, changed, done):
    """Receive (Parameter, integer Parameter, plain tensor), check types and grads, see
    the parent's change to .data, write into the Parameter, send a new one back."""
    def run():
        p, ip, t = q.get(timeout=TIMEOUT)
        info = {"types": [type(o).__name__ for o in (p, ip, t)],
                "requires_grad": [o.requires_grad for o in (p, ip, t)],
                "grad_none": p.grad is None,
                "shared": mp.is_shared(p)}
        conn.send(("received", info))
        _wait(changed, "change .data")
        info["saw_parent"] = bool((p.data == 2).all())
        with torch.no_grad():
            p.mul_(3)                      # 6 everywhere: the parent must see it
        loss = (p * p).sum()               # autograd works here on the shared Parameter
        loss.backward()
        info["grad_ok"] = bool(torch.equal(p.grad, 2 * p.detach()))
        back = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
        q2 = torch.nn.Parameter(torch.ones(3))
        conn.send(("back", [back, q2]))
        _wait(done, "receive what was sent back")
        return info
    _guard(conn, run)


def describe_param(conn, p):
    """(spawn argument) an integer Parameter with requires_grad=False."""
    _guard(conn, lambda: {"type": type(p).__name__, "dtype": str(p.dtype),
                          "requires_grad": p.requires_grad, "values": p.tolist(),
                          "shared": mp.is_shared(p)})


# -- processes ---------------------------------------------------------------------------

def fill_args(conn, tensors, value):
    """(Process arguments) write ``value`` into every tensor."""
    def run():
        for t in tensors:
            t.fill_(value)
        return [mp.is_shared(t) for t in tensors]
    _guard(conn, run)


def fill_and_make(t):
    """(Pool.map) fill the argument in place, return a new tensor."""
    t.fill_(float(t.numel()))
    return torch.full((3,), float(t.numel()))


def grad_of(args):
    """(Pool.map) run autograd in a worker: d/dw sum((w * x)^2) for a shared w."""
    w, x = args
    w = w.detach().requires_grad_(True)
    loss = ((w * x) ** 2).sum()
    loss.backward()
    return w.grad


def forward_torch_shared(conn, q, done):
    """Receive a storage torch shared itself, write into it, report whether it still is torch's."""
    def run():
        t = q.get(timeout=TIMEOUT)
        t.fill_(5)
        torch_own = torch._C.StorageBase.is_shared(t.untyped_storage())
        _wait(done, "check")
        return torch_own
    _guard(conn, run)


# -- Hogwild -----------------------------------------------------------------------------

def hogwild(conn, model, opt, steps, seed):
    """Train the shared model with the shared optimizer for ``steps`` steps."""
    def run():
        torch.manual_seed(seed)
        for _ in range(steps):
            x = torch.randn(16, 4)
            y = x.sum(dim=1, keepdim=True)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        state = opt.state[model.weight]
        return {"shared": mp.is_shared(model) and all(mp.is_shared(v) for v in state.values()),
                "step": float(state["step"])}
    _guard(conn, run)


# -- DataLoader --------------------------------------------------------------------------

class DictDataset(torch.utils.data.Dataset):
    """Item i: a dict of small tensors whose values say i."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": torch.full((8,), float(i)), "y": torch.tensor(i),
                "z": torch.arange(3, dtype=torch.int32) + i, "pid": torch.tensor(os.getpid())}


if __name__ == "__main__":
    sys.exit("not a script")

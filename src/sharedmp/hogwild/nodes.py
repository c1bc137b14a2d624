"""Beyond one machine: Hogwild inside each node, periodic averaging across nodes (local SGD).

Inside a node, one leader process owns the shared model and its Hogwild workers
(``trainer.py``). Across nodes, the leaders form a ``torch.distributed`` process
group (gloo; NCCL for GPUs) and every K steps of each worker they average the shared
parameters with one ``all_reduce``:

    worker: after each K-th step, wait on the board for round r to be released
    leader: once every local worker waits (or is done): pause -> all_reduce(parameters,
            "still training" flag) -> divide by the node count -> copy into the shared
            parameters -> checksum -> release round r

Every node calls ``all_reduce`` once per round, so the nodes count rounds alike; a node
whose workers are done keeps joining rounds (flag 0) until the flag sums to 0, so the last
round averages the final models and every node ends with the same weights. Only the
parameters are averaged: the optimizer state (Adam's moments) stays per node, as in local
SGD. Rank 0's parameters are broadcast before training, so every node starts alike.

Launch: ``torchrun`` starts one leader per node (``--nproc-per-node 1``) and sets
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, which
``NodeEnv.from_env`` reads; ``python -m sharedmp demo --nodes N`` starts N leaders on this
machine with the same variables on loopback (simulated nodes).

Failure: a collective that fails (gloo raises at once when a peer's connection closes, as
when its process dies; a peer that hangs or whose machine vanishes without closing its
connections is noticed after the group's timeout) raises ``NodeLost``, which names the
node(s) and the fix; the leader then stops its workers as for any other error.

This module imports torch; ``import sharedmp`` never imports it.
"""
from __future__ import annotations

import datetime
import functools
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NoReturn, TypeVar

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
DEFAULT_EVERY = 50        # steps of each worker between two averaging rounds
DEFAULT_TIMEOUT = 60.0    # seconds: joining the group, and any one collective
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_T = TypeVar("_T")
HOW_TO_LAUNCH = ("start one leader per node with torchrun --nnodes N --nproc-per-node 1 "
                 "--node-rank R --master-addr A --master-port P -m sharedmp demo ..., "
                 "or simulate N nodes on this machine with python -m sharedmp demo --nodes N")


__all__ = ["Node", "NodeEnv", "NodeLost"]


class NodeLost(RuntimeError):
    """Another node died, hangs or cannot be reached; the message names it and the fix."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.at = time.time()                 # when it was seen (before the workers are stopped)


@dataclass(frozen=True)
class NodeEnv:
    """Where this leader stands: torchrun's variables."""
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> NodeEnv:
        """Read torchrun's variables; ``ValueError`` naming what is missing or wrong."""
        missing = [k for k in LAUNCH_ENV if not environ.get(k)]
        if missing:
            verb = "is" if len(missing) == 1 else "are"
            raise ValueError(f"{', '.join(missing)} {verb} not set: {HOW_TO_LAUNCH}")
        values: dict[str, int] = {}
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
            text = environ.get(key, "0")
            try:
                values[key] = int(text)
            except ValueError:
                raise ValueError(f"{key}={text!r} is not an integer: {HOW_TO_LAUNCH}") from None
        rank, world = values["RANK"], values["WORLD_SIZE"]
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"RANK={rank} with WORLD_SIZE={world}: the rank must be in "
                             f"[0, WORLD_SIZE); {HOW_TO_LAUNCH}")
        if not 0 < values["MASTER_PORT"] < 65536:
            raise ValueError(f"MASTER_PORT={values['MASTER_PORT']} is not a TCP port (1-65535)")
        return cls(rank, world, values["LOCAL_RANK"], environ["MASTER_ADDR"],
                   values["MASTER_PORT"])


class Node:
    """This node's leader in the group of leaders: start alike, average every ``every`` steps."""

    def __init__(self, env: NodeEnv, backend: str = "gloo", every: int = DEFAULT_EVERY,
                 timeout: float = DEFAULT_TIMEOUT) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose gloo (CPU) or nccl (GPUs)")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("the nccl backend needs a CUDA GPU on every node; use gloo")
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every (steps between averaging rounds) must be a positive integer, "
                             f"not {every!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive seconds, not {timeout!r}")
        self.env, self.backend, self.every, self.timeout = env, backend, every, float(timeout)
        self.rank, self.world_size = env.rank, env.world_size
        # NCCL reduces tensors in GPU memory: the CPU parameters travel through this node's GPU.
        self.device = torch.device("cuda", env.local_rank) if backend == "nccl" \
            else torch.device("cpu")
        self.rounds = 0
        self.peers: list[Any] = [None] * self.world_size      # (host, pid) of each rank's leader
        if backend == "nccl":
            torch.cuda.set_device(self.device)    # NCCL's collectives use the current device
        t0 = time.monotonic()
        try:
            # env:// reads MASTER_ADDR/MASTER_PORT, or uses torchrun's agent store when it runs us.
            dist.init_process_group(backend, init_method="env://", rank=self.rank,
                                    world_size=self.world_size,
                                    timeout=datetime.timedelta(seconds=self.timeout))
        except (RuntimeError, ValueError) as e:   # DistStoreError (a timeout) is a RuntimeError
            raise NodeLost(
                f"node {self.rank} of {self.world_size} could not join the other nodes at "
                f"{env.master_addr}:{env.master_port} within {time.monotonic() - t0:.0f} s "
                f"({_first_line(e)}). Start every node within {self.timeout:.0f} s of each other "
                f"with the same --nnodes, --master-addr and --master-port, and check that node 0 "
                f"is reachable there (or raise --dist-timeout)") from None
        try:
            self.peers = self._call("exchanging names", lambda: _all_gather(
                (socket.gethostname(), os.getpid())))
        except NodeLost:
            self.close()
            raise

    def start(self, model: torch.nn.Module) -> None:
        """Give every node rank 0's parameters (also waits until every node is ready)."""
        flat = self._flatten(model)
        self._call("the start (broadcast of rank 0's parameters)",
                   lambda: dist.broadcast(flat, src=0))
        self._unflatten(model, flat)

    def average(self, model: torch.nn.Module, training: bool) -> bool:
        """One round: average the parameters across nodes; True while some node still trains.

        The caller has paused every writer of ``model``'s parameters.
        """
        self.rounds += 1
        params = self._flatten(model, extra=1.0 if training else 0.0)
        self._call(f"averaging round {self.rounds}",
                   lambda: dist.all_reduce(params, op=dist.ReduceOp.SUM))
        still = bool(params[-1].item() > 0)     # nodes still training, summed
        params /= self.world_size
        self._unflatten(model, params)
        return still

    def gather(self, obj: Any) -> list[Any]:
        """Every node's ``obj`` (picklable), in rank order."""
        return self._call("gathering the figures", lambda: _all_gather(obj))

    def close(self) -> None:
        """Leave the group (harmless if it is already broken)."""
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:                    # a broken group: nothing left to tear down
                pass

    def describe(self) -> str:
        return (f"{self.world_size} nodes, torch.distributed {self.backend} via "
                f"{self.env.master_addr}:{self.env.master_port}; parameters averaged every "
                f"{self.every} steps of each worker")

    # ------------------------------------------------------------------------- internals

    def _flatten(self, model: torch.nn.Module, extra: float | None = None) -> torch.Tensor:
        """The parameters as one flat tensor on ``self.device``: one collective, not one per
        tensor."""
        params = list(model.parameters())
        dtype = functools.reduce(torch.promote_types, (p.dtype for p in params), torch.float32)
        with torch.no_grad():
            parts = [p.detach().reshape(-1).to(dtype) for p in params]
            if extra is not None:
                parts.append(torch.tensor([extra], dtype=dtype))
            return torch.cat(parts).to(self.device)

    def _unflatten(self, model: torch.nn.Module, flat: torch.Tensor) -> None:
        """Copy ``flat`` into the parameters in place: they stay in the shared memory that the
        workers map."""
        flat = flat.cpu()
        offset = 0
        with torch.no_grad():
            for p in model.parameters():
                n = p.numel()
                p.copy_(flat[offset:offset + n].view_as(p))
                offset += n

    def _call(self, what: str, fn: Callable[[], _T]) -> _T:
        """Run a collective; its failure becomes ``NodeLost``, naming the other nodes and the
        fix."""
        t0 = time.monotonic()
        try:
            return fn()
        except RuntimeError as e:                # DistBackendError, gloo's "Connection closed ..."
            raise NodeLost(self._lost_message(what, time.monotonic() - t0, e)) from None

    def _lost_message(self, what: str, seconds: float, error: BaseException) -> str:
        others = [r for r in range(self.world_size) if r != self.rank]
        names = [f"rank {r}" + (f" (host {self.peers[r][0]}, pid {self.peers[r][1]})"
                                if self.peers[r] else "") for r in others]
        # gloo does not say which rank it lost; with two nodes it can only be the other one.
        who = f"node {names[0]}" if len(others) == 1 \
            else f"one of the other nodes ({', '.join(names)})"
        return (f"node {self.rank} of {self.world_size} lost contact with {who} during {what}, "
                f"after {seconds:.1f} s: {_first_line(error)}. That node died, hangs, or its "
                f"network failed: read its output for the cause, then restart every node "
                f"(torchrun --max-restarts N does that by itself); if the nodes are only slow, "
                f"raise --dist-timeout (now {self.timeout:.0f} s)")


def exit_now(code: int) -> NoReturn:
    """End this leader process with ``code`` at once: flush stdout/stderr, then ``os._exit``.

    Hazard (torch 2.13, gloo): in a leader that has run ``train``, the process
    group outlives ``destroy_process_group()`` (its gloo threads keep running; we did not
    find what holds it), and a gloo thread that drops the last collective's tensors while
    the interpreter shuts down calls into Python, which ends the thread; the C++ unwinding
    then hits ``std::terminate``: SIGABRT, about 1 run in 10 on a loaded machine, and under
    torchrun the other node's agent then waits in its exit barrier. So a leader skips the
    interpreter's shutdown: its workers are joined and its shared memory goes with the
    process (memfd) or with the file_system daemon's count of live processes.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _all_gather(obj: Any) -> list[Any]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__

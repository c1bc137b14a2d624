"""A node leader for tests/test_distributed.py: ``sharedmp.distributed.Node`` + ``training.train``.

Run as ``python tests/_distributed_leader.py VICTIM HOW AFTER TIMEOUT`` with torchrun's
variables set. In the workers of node ``VICTIM`` the model misbehaves at forward() call
``AFTER``: ``kill`` SIGKILLs the node's whole process group (leader and workers), ``hang``
never returns. Exit status: 0 trained, 3 ``NodeLost``, 4 ``TimeoutError``; the error is
printed on stderr.
"""
import functools
import os
import signal
import sys
import time

import torch

from sharedmp import distributed, training


class Victim(torch.nn.Module):
    """A small MLP whose forward() in a worker of node ``victim`` kills the node or hangs."""

    def __init__(self, n_in, n_out, rank, victim, how, after):
        super().__init__()
        self.net = training.mlp(n_in, n_out, (16,))
        self.leader, self.rank, self.victim, self.how, self.after = os.getpid(), rank, victim, how, after
        self.calls = 0            # per process: a worker starts from the pickled 0

    def forward(self, x):
        if self.rank == self.victim and os.getpid() != self.leader:
            self.calls += 1
            if self.calls > self.after:
                if self.how == "kill":
                    os.killpg(os.getpgid(0), signal.SIGKILL)
                if self.how == "hang":
                    time.sleep(3600)
        return self.net(x)


def main(victim, how, after, timeout):
    from _distributed_leader import Victim   # by module name, for the spawned workers to unpickle
    env = distributed.NodeEnv.from_env()
    data = training.load_digits()
    factory = functools.partial(Victim, data.n_features, data.n_classes, env.rank, victim, how, after)
    try:
        node = distributed.Node(env, "gloo", every=2, timeout=timeout)
        try:
            training.train(factory, data, workers=2, epochs=10_000, lr=0.1, progress=False,
                           eval_interval=0, node=node)
        finally:
            node.close()
    except distributed.NodeLost as e:
        print(f"NodeLost at {e.at:.3f}, stopped at {time.time():.3f}: {e}", file=sys.stderr, flush=True)
        return 3
    except TimeoutError as e:
        print(f"TimeoutError: {e}", file=sys.stderr, flush=True)
        return 4
    return 0


if __name__ == "__main__":
    distributed.exit_now(main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])))

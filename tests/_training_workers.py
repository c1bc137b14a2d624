"""Models for the training tests that misbehave inside a worker process.

They live here, not in the test modules, so that a spawned worker can unpickle them by
importing only torch and sharedmp. The parent (whose pid the model keeps) evaluates the
model without trouble; in a worker, forward() misbehaves after ``after`` calls.
"""
import os
import signal
import time

import torch

from sharedmp.training import mlp


class Misbehaving(torch.nn.Module):
    """A small MLP whose forward() in a worker raises, dies by SIGKILL, sleeps or hangs."""

    def __init__(self, n_in, n_out, parent_pid, how, after=3):
        super().__init__()
        self.net = mlp(n_in, n_out, (16,))
        self.parent_pid, self.how, self.after = parent_pid, how, after
        self.calls = 0            # per process: a worker starts from the pickled 0

    def forward(self, x):
        if os.getpid() != self.parent_pid:
            self.calls += 1
            if self.calls > self.after:
                if self.how == "raise":
                    raise ValueError(f"deliberate failure in a worker's forward(), call {self.calls}")
                if self.how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if self.how == "sleep":
                    time.sleep(0.2)
                if self.how == "hang":            # never looks at the stop flag again
                    time.sleep(3600)
        return self.net(x)

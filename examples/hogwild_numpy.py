"""Hogwild! without torch: sparse logistic regression in NumPy on one shared weight vector.

As in the Hogwild! paper (Niu, Recht, Re, Wright, 2011): each sample touches a few of
many features, so processes that update the weights without any lock rarely collide.
The weights are ``mp.zeros(d)``: every worker writes the same memory, and the parent
reads the result without anything being sent back. The core of sharedmp knows nothing
of torch; this example imports only NumPy and sharedmp.

    python examples/hogwild_numpy.py [--workers N] [--epochs E]

It trains with 1 worker, then with N, and prints samples/s and test accuracy for each.
"""
import argparse
import math
import time

import numpy as np

import sharedmp as mp


def make_data(n=40_000, d=2_000, k=10, noise=0.05, seed=0):
    """Samples with ``k`` non-zero features out of ``d``; labels +-1 from a hidden weight vector."""
    rng = np.random.default_rng(seed)
    w_true = rng.standard_normal(d)
    index = np.stack([rng.choice(d, k, replace=False) for _ in range(n)])
    value = rng.standard_normal((n, k))
    y = np.sign((w_true[index] * value).sum(axis=1))
    y[rng.random(n) < noise] *= -1                       # label noise: no perfect fit
    return index, value, y


def worker(rank, workers, index, value, y, w, epochs, lr, times, start):
    """SGD over shard ``rank``: for each sample, update only the weights of its features."""
    start.wait(timeout=60)                               # all start together: a fair clock
    times[rank, 0] = time.monotonic()
    rng = np.random.default_rng(rank)
    shard = np.arange(rank, len(y), workers)
    for epoch in range(epochs):
        step = lr / (1 + epoch)
        for i in shard[rng.permutation(len(shard))]:
            idx, v, label = index[i], value[i], y[i]
            margin = label * (w[idx] @ v)
            # gradient of log(1 + exp(-margin)) w.r.t. w[idx]; no lock (Hogwild)
            w[idx] += step * label * v / (1 + math.exp(min(margin, 50.0)))
    times[rank, 1] = time.monotonic()


def train(workers, index, value, y, epochs, lr):
    """Train a fresh shared weight vector with ``workers`` processes; return (w, samples/s)."""
    w = mp.zeros(index.max() + 1)
    times = mp.zeros((workers, 2))
    start = mp.get_context("spawn").Barrier(workers)
    mp.start_processes(worker, args=(workers, index, value, y, w, epochs, lr, times, start),
                       nprocs=workers)
    seconds = times[:, 1].max() - times[:, 0].min()     # from the first start to the last end
    return w, epochs * len(y) / seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.2)
    args = parser.parse_args()
    index, value, y = make_data()
    n_test = len(y) // 5
    test = slice(0, n_test)
    train_part = slice(n_test, None)
    # One shared copy of the training data; every worker reads it without a copy.
    shared = [mp.share(a[train_part]) for a in (index, value, y)]
    print(f"sparse logistic regression: {len(shared[2]):,} train / {n_test:,} test samples, "
          f"{index.max() + 1:,} features, {index.shape[1]} non-zero per sample")
    rates = {}
    for n in sorted({1, args.workers}):
        w, rates[n] = train(n, *shared, args.epochs, args.lr)
        accuracy = (np.sign((w[index[test]] * value[test]).sum(axis=1)) == y[test]).mean()
        print(f"{n} worker{'s' * (n > 1)}: {rates[n]:,.0f} samples/s, test accuracy {accuracy:.1%} "
              f"({np.count_nonzero(w):,} weights written by the workers, read by the parent)")
    if args.workers != 1:
        print(f"speed-up: {rates[args.workers] / rates[1]:.2f}x with {args.workers} workers")


if __name__ == "__main__":
    main()

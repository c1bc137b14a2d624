"""A DataLoader whose workers share one dataset instead of each holding a copy.

    python examples/shared_dataset.py [--workers 4] [--records 1000000] [--start-method spawn]

The Dataset class below knows nothing of sharedmp. Run plainly, each worker gets its own
copy of the records (pickled into it under spawn and forkserver; copied page by page under
fork, as reading a Python object writes its reference count). After ``mp.share_dataset``
the records lie once in shared memory and every worker reads the same pages. The program
prints the memory of the parent and of its workers (the sum of their Pss, Linux: shared
pages counted once in all) for both, after one shuffled epoch.
"""
import argparse
import os
import time

import torch
from torch.utils.data import DataLoader, Dataset

import sharedmp as mp


class Records(Dataset):
    """A list of (int, str, float) records, as an annotation file loaded in memory is."""

    def __init__(self, n):
        self.records = [(i, f"image-{i:08d}.jpg", i * 0.5) for i in range(n)]

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        index, name, weight = self.records[i]
        return index, weight


def pss_mib(pids):
    """The sum of the Pss of ``pids``, MiB (shared pages counted once in all)."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            total += sum(int(line.split()[1]) for line in f if line.startswith("Pss:"))
    return total / 1024


def epoch(dataset, workers, start_method):
    loader = DataLoader(dataset, batch_size=256, shuffle=True, num_workers=workers,
                        persistent_workers=True,
                        multiprocessing_context=mp.get_context(start_method))
    t0 = time.perf_counter()
    seen = sum(len(batch[0]) for batch in loader)
    seconds = time.perf_counter() - t0
    workers = pss_mib([w.pid for w in loader._iterator._workers])
    parent = pss_mib([os.getpid()])
    del loader
    assert seen == len(dataset)
    return parent, workers, seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--start-method", default="spawn",
                        choices=mp.get_all_start_methods())
    args = parser.parse_args()
    torch.set_num_threads(1)

    print(f"{args.records:,} records, {args.workers} workers, {args.start_method}; "
          "Pss in MiB (each worker also holds torch itself, about 100-200 MiB)")
    plain = Records(args.records)
    parent, workers, seconds = epoch(plain, args.workers, args.start_method)
    print(f"  plain list:    parent {parent:6.0f}, workers {workers:6.0f}; epoch {seconds:.1f} s")
    del plain

    shared = Records(args.records)
    print("  " + str(mp.share_dataset(shared, report=True)).replace("\n", "\n  "))
    parent, workers, seconds = epoch(shared, args.workers, args.start_method)
    print(f"  share_dataset: parent {parent:6.0f}, workers {workers:6.0f}; epoch {seconds:.1f} s")


if __name__ == "__main__":
    main()

"""A torch ``Dataset`` that knows nothing of sharedmp, for ``mp.share_dataset``'s tests, and
what DataLoader workers report of it (their ``collate_fn``). Imports torch: only the tests
about torch, and their children, import this module.
"""
import os

import numpy as np
from torch.utils.data import Dataset, get_worker_info

import sharedmp as mp
from sharedmp.memory import segment


def make_records(n):
    return [(i, f"record-{i}", i * 0.25) for i in range(n)]


class PlainDataset(Dataset):
    """Records in a list, features in a NumPy array, names in a pandas frame (``frame``)."""

    def __init__(self, n, frame=True):
        self.records = make_records(n)
        self.features = np.arange(n * 8, dtype=np.float32).reshape(n, 8)
        self.frame = None
        if frame:
            import pandas as pd
            self.frame = pd.DataFrame({"id": np.arange(n),
                                       "name": [f"name-{i}" for i in range(n)]})
        self.root = "/data"

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        return self.records[i], float(self.features[i, 1])


def in_segment(address, nbytes):
    """Whether the ``nbytes`` bytes at ``address`` lie in a sharedmp mapping of this process."""
    return segment.containing(address, nbytes)[0] is not None


def frame_facts(frame):
    """Whether each column of a pandas frame lies in sharedmp memory (NumPy data, or every
    buffer of its Arrow chunks)."""
    out = {}
    for name in frame.columns:
        array = frame[name].array
        chunked = getattr(array, "_pa_array", None)
        if chunked is None:
            data = np.asarray(array)
            out[name] = in_segment(data.__array_interface__["data"][0], data.nbytes)
        else:
            out[name] = all(in_segment(b.address, b.size) for c in chunked.chunks
                            for b in c.buffers() if b is not None and b.size)
    return out


def worker_facts(dataset):
    """What a worker sees of the dataset it was given."""
    f = dataset.features
    facts = {"pid": os.getpid(), "records": type(dataset.records).__name__,
             "features_shared": mp.is_shared(f),
             "features_in_segment": in_segment(f.__array_interface__["data"][0], f.nbytes),
             "features_equal": bool((f[:, 0] == np.arange(len(f)) * 8).all())}
    if dataset.frame is not None:
        facts["frame"] = frame_facts(dataset.frame)
        facts["frame_equal"] = dataset.frame["name"].iloc[-1] == f"name-{len(f) - 1}"
    return facts


def collate(batch):
    """DataLoader collate_fn: the samples as they are, and what this worker sees."""
    return list(batch), worker_facts(get_worker_info().dataset)


"""Datasets that worker processes share instead of copying: ``SharedList``, ``SharedDict``,
and ``share_dataset``, which puts an existing dataset object's attributes in shared forms.

A dataset of Python records (a list of tuples, a dict of annotations) held by a DataLoader's
``Dataset`` is copied into every worker: pickled into each one under spawn and forkserver,
and under fork copied page by page, as the workers' reads write the records' reference
counts. Here the records are pickled once (protocol 5) into one block of shared memory and
unpickled on each read: no object a reader touches belongs to the dataset.

What is shared is sealed once made (a memfd sealed against writes): no process, of this
program or another of the user, can change what readers unpickle; each process maps it
copy-on-write, so that what it writes into an array stays its own, as with a plain dataset.

    block.py       the block's format: records pickled (objects several share, stored once),
                   written and sealed, attached and checked, read one at a time
    keys.py        a SharedDict's key index: hashes the same in every process
    containers.py  SharedList, SharedDict
    copies.py      arrays (views kept views) and frames copied once into a sealed block
    share.py       share_dataset and its report
"""
from .block import live
from .containers import SharedDict, SharedList
from .share import DEFAULT_THRESHOLD, Entry, ShareReport, share_dataset

__all__ = ["SharedDict", "SharedList", "share_dataset", "ShareReport", "Entry",
           "DEFAULT_THRESHOLD", "live"]

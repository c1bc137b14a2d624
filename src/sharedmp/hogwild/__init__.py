"""Hogwild training, the application built on sharedmp: worker processes update one model
whose parameters live in shared memory, without locks (Niu et al. 2011).

It uses the library only through ``import sharedmp as mp``. Its parts:

    data.py      the data sets: digits, a user's .npz, the train/test split
    model.py     the MLP, its optimizer, accuracy and checksum
    board.py     the shared arrays through which workers report and the parent steers
    worker.py    one worker: its shard, its steps, its waits
    progress.py  the parent's progress bar (tqdm, or plain lines)
    trainer.py   the parent: share, start, watch, evaluate, stop; ``train``
    nodes.py     several nodes: leaders averaging over torch.distributed

Its public names are ``sharedmp.training`` and ``sharedmp.distributed``; ``python -m
sharedmp demo`` is its command line. It imports torch; ``import sharedmp`` never does.
"""

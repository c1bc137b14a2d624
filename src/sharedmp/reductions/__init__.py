"""What a value becomes on the wire. ``register()`` installs every reducer, once.

Reducers go into ``multiprocessing.reduction.ForkingPickler``, which sharedmp's
channels use and so do the standard ones (Process arguments under spawn and
forkserver, Manager connections): arrays travel through shared memory on both.
"""
import numpy as np
from multiprocessing.reduction import ForkingPickler

from ..memory.segment import Segment
from .ndarray import reduce_ndarray
from .segment import reduce_segment

_done = False


def register():
    global _done
    if _done:
        return
    ForkingPickler.register(Segment, reduce_segment)
    ForkingPickler.register(np.ndarray, reduce_ndarray)
    _done = True

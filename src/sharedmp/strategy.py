"""Sharing strategies, named as in torch.multiprocessing.

``file_descriptor``: anonymous memfd segments whose fds travel with the messages.
``file_system``: named segments in a tmpfs directory (``/dev/shm`` by default).

The choice is kept in ``SHAREDMP_SHARING_STRATEGY`` too, so that children started
later (spawn, forkserver started afterwards, fork) inherit it; sharedmp's own
``Process`` also carries it explicitly (a forkserver may predate the choice).
"""
import os

from .memory.segment import HAVE_MEMFD

ENV = "SHAREDMP_SHARING_STRATEGY"
_ALL = ("file_descriptor", "file_system") if HAVE_MEMFD else ("file_system",)
_DEFAULT = _ALL[0]


def get_all_sharing_strategies():
    """The strategies this platform supports."""
    return set(_ALL)


def _check(name, where):
    if name not in _ALL:
        raise ValueError(
            f"unknown sharing strategy {name!r}{where}; valid strategies: "
            + ", ".join(repr(s) for s in _ALL))
    return name


def get_sharing_strategy():
    """The current strategy: set_sharing_strategy(), else $SHAREDMP_SHARING_STRATEGY, else the default."""
    name = os.environ.get(ENV)
    return _DEFAULT if not name else _check(name, f" in ${ENV}")


def set_sharing_strategy(name):
    """Choose the strategy for new shared memory here and in children started afterwards."""
    os.environ[ENV] = _check(name, "")

"""Sharing strategies, named as in torch.multiprocessing.

``file_descriptor``: anonymous memfd segments whose fds travel with the messages.
``file_system``: named segments in a tmpfs directory (``/dev/shm`` by default).

The environment variable is read once, when sharedmp first needs the strategy; the
choice is written back to ``SHAREDMP_SHARING_STRATEGY``, so that children started
later (spawn, forkserver started afterwards, fork) inherit it; sharedmp's own
``Process`` also carries it explicitly (a forkserver may predate the choice).
"""

from . import settings
from .host import HAVE_MEMFD

ENV = settings.SHARING_STRATEGY
_ALL = ("file_descriptor", "file_system") if HAVE_MEMFD else ("file_system",)
_DEFAULT = _ALL[0]


def get_all_sharing_strategies() -> set[str]:
    """The strategies this platform supports."""
    return set(_ALL)


def _check(name: str, where: str) -> str:
    if name not in _ALL:
        raise ValueError(
            f"unknown sharing strategy {name!r}{where}; valid strategies: "
            + ", ".join(repr(s) for s in _ALL))
    return name


_current: str | None = None   # cached: reading the environment on every allocation is not free


def get_sharing_strategy() -> str:
    """The current strategy: set_sharing_strategy(), else $SHAREDMP_SHARING_STRATEGY, else the
    default."""
    global _current
    if _current is None:
        _current = _check(settings.get(ENV), "")
    return _current


def set_sharing_strategy(name: str) -> None:
    """Choose the strategy for new shared memory here and in children started afterwards."""
    global _current
    settings.export(ENV, _check(name, ""))
    _current = name


def reload_from_environment() -> None:
    """Forget the cached choice; the next get_sharing_strategy() reads the environment."""
    global _current
    _current = None

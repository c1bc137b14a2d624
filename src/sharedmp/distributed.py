"""Beyond one machine: Hogwild inside each node, periodic averaging across nodes (local SGD).

The public names of ``sharedmp.hogwild.nodes``, whose module doc tells the protocol: one
leader per node (``torchrun --nproc-per-node 1``, or ``python -m sharedmp demo --nodes N``
on loopback) owns the shared model and its workers; every K steps of each worker the
leaders average the shared parameters with one ``all_reduce``. A lost node raises
``NodeLost``, naming it and the fix.

This module imports torch; ``import sharedmp`` never imports it.
"""
from .hogwild.nodes import Node, NodeEnv, NodeLost
from .hogwild.nodes import exit_now as exit_now     # for a leader's own main (see its doc)

__all__ = ["Node", "NodeEnv", "NodeLost"]

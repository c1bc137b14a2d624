"""Processes: the contexts whose Process, Pool and channels are sharedmp's (``context``),
children that die with their parent (``pdeath``), and torch's ``spawn()``.

The folder sits above the channels (a context hands out sharedmp's queues and pipes); the
channels never import it. This file imports nothing.
"""

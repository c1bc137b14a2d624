"""Processes: children that die with their parent (``pdeath``), and torch's ``spawn()``.

``pdeath`` sits below the channels (the contexts' Process uses it); ``spawn`` sits above
them (it starts its children through a sharedmp context). This file imports neither.
"""

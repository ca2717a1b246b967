"""Crowdtrain's ML core: the model graph format, its PyTorch interpreter, FLOP counting, tensor
codecs, server-side aggregation/optimizers and model presets.

Plain Python + torch only: the Django server and the workers import this, never the other way round.
Submodules are imported explicitly (``from engine.graph import load_graph``) so importing ``engine``
stays cheap.
"""

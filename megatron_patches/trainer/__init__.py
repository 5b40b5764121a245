"""Reusable pieces of ``train.py``: arguments and presets, data, checkpoints, progress and
logging, and the SLURM/torchrun environment. ``train.py`` reads top to bottom; everything it
would otherwise repeat lives here. Importing this package does not import megatron.core.
"""

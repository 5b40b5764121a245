"""sp_train: the trainer behind ``train.py`` — DP × CP × TP training of Megatron-Core GPT
models with the library's context-parallel attention (arguments and presets, data, the model
and its memory estimate, loss, optimizer, checkpoints, progress and logging, the
SLURM/torchrun launch). ``train.py`` reads top to bottom; everything it would otherwise repeat
lives here (see sp_train/README.md).

Floors: ``sp_attention`` (the attention library) ← ``megatron_patches`` / ``models`` (the
framework adapters) ← ``sp_train`` ← ``train.py``. ``reduce`` and ``memory`` need only torch
(no Megatron, no transformers). Importing this package imports nothing.
"""

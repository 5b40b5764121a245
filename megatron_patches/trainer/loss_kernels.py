"""Moved to :mod:`sp_train.loss_kernels` (this path warns, and goes in the next release)."""
from megatron_patches.trainer import _alias

_alias(__spec__.name, "sp_train.loss_kernels", as_main=__name__ == "__main__")

"""Moved to :mod:`sp_train.launch` (this path warns, and goes in the next release)."""
from megatron_patches.trainer import _alias

_alias(__spec__.name, "sp_train.launch", as_main=__name__ == "__main__")

"""Moved to :mod:`sp_train.data` (this path warns, and goes in the next release)."""
from megatron_patches.trainer import _alias

_alias(__spec__.name, "sp_train.data", as_main=__name__ == "__main__")

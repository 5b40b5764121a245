"""Moved to :mod:`sp_train.memory` (the trainer's package); this path warns, and goes in the
next release."""
import importlib
import sys
import warnings

warnings.warn("sp_attention.memory moved to sp_train.memory; the old path will be removed in the next "
              "release", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = importlib.import_module("sp_train.memory")

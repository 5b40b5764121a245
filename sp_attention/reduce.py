"""Moved to :mod:`sp_train.reduce` (the trainer's package); this path warns, and goes in the
next release."""
import importlib
import sys
import warnings

warnings.warn("sp_attention.reduce moved to sp_train.reduce; the old path will be removed in the next "
              "release", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = importlib.import_module("sp_train.reduce")

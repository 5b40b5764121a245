"""Moved: train.py's pieces are the top-level package :mod:`sp_train`.

``megatron_patches.trainer.<module>`` still imports (it *is* ``sp_train.<module>``, with a
``DeprecationWarning``) for one release, and ``python -m megatron_patches.trainer.torchrun`` /
``.plot`` still run; import ``sp_train.<module>`` instead.
"""
from __future__ import annotations

import importlib
import runpy
import sys
import warnings

__all__: list = []


def _alias(old: str, new: str, as_main: bool) -> None:
    """Make module ``old`` the module ``new`` (run as ``__main__`` when ``as_main``), warning
    once at the importer's line."""
    # the line that imports the old path; run as a script: the script itself (__main__, whose
    # DeprecationWarnings Python shows by default)
    warnings.warn(f"{old} moved to {new}; the old path will be removed in the next release",
                  DeprecationWarning, stacklevel=2 if as_main else 3)
    if as_main:
        runpy.run_module(new, run_name="__main__", alter_sys=True)
    else:
        sys.modules[old] = importlib.import_module(new)

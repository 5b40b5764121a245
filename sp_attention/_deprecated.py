"""Old import paths of moved modules: each old path is a two-line module that calls
:func:`moved`, which makes the old name the new module itself (one module object: its names,
caches and monkeypatches are shared) and warns once per process. They last one release (see
the changelog in the top README.md)."""
from __future__ import annotations

import importlib
import sys
import warnings

__all__ = ["moved"]


def moved(old: str, new: str) -> None:
    """Alias module ``old`` to module ``new`` and emit one ``DeprecationWarning``."""
    module = importlib.import_module(new)
    warnings.warn(f"{old} moved to {new}; import it from there ({old} goes in the next "
                  "release)", DeprecationWarning, stacklevel=3)
    sys.modules[old] = module

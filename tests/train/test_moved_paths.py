"""The trainer moved to ``sp_train`` (with ``sp_attention.memory`` and ``sp_attention.reduce``):
the old import paths still work for one release — they are the new modules — and warn."""
import importlib
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MOVED = [(f"megatron_patches.trainer.{m}", f"sp_train.{m}")
         for m in ("args", "checkpoint", "data", "launch", "loss", "optim", "plot", "progress",
                   "recompute", "setup", "torchrun")] + [
    ("sp_attention.memory", "sp_train.memory"), ("sp_attention.reduce", "sp_train.reduce")]


@pytest.mark.parametrize("old, new", MOVED, ids=[m[0] for m in MOVED])
def test_old_import_paths_warn_and_are_the_new_modules(old, new, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    parent, _, name = old.rpartition(".")           # ``from megatron_patches.trainer import args``
    assert getattr(importlib.import_module(parent), name) is module


def test_old_module_paths_still_run():
    """``python -m megatron_patches.trainer.plot`` (and ``.torchrun``) run the moved module."""
    out = subprocess.run([sys.executable, "-m", "megatron_patches.trainer.plot", "--help"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0 and "usage:" in out.stdout, out.stdout + out.stderr
    assert "megatron_patches.trainer.plot moved to sp_train.plot" in out.stderr

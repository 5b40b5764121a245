"""Atomic checkpoints with ``torch.distributed.checkpoint`` (DCP).

Layout of a ``--save`` directory::

    iter_0000040/          complete checkpoints (DCP shards + .metadata + meta.json)
    iter_0000050.tmp/      a save in progress (or one killed mid-way: ignored, removed later)
    latest                 the step of the newest complete checkpoint, written last

A save writes into ``iter_N.tmp``, waits for every rank, then rank 0 writes ``meta.json``,
renames the directory to ``iter_N`` and replaces ``latest`` (write-then-``os.replace``). A crash
at any point leaves the previous complete checkpoint and ``latest`` untouched.

Keys carry the TP rank (``tp1/model.decoder…``): TP ranks hold different slices under the same
parameter name, while CP and DP replicas are identical and DCP stores them once. A checkpoint
therefore loads under any CP/DP layout; a different TP size is refused by
:func:`check_compatible` with a message naming both layouts (before any collective).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

__all__ = ["save_checkpoint", "load_checkpoint", "find_latest", "check_compatible",
           "read_meta"]

_ITER = re.compile(r"^iter_(\d{7})$")
# Test hook (tests/train): every rank SIGKILLs itself inside the save of this step, after the
# shards are written and before the rename — a crash mid-save.
_DIE_IN_SAVE = "SP_TRAIN_TEST_DIE_IN_SAVE"


def _iter_dir(root: str, step: int) -> str:
    return os.path.join(root, f"iter_{step:07d}")


def _complete(path: str) -> bool:
    return (os.path.isfile(os.path.join(path, ".metadata"))
            and os.path.isfile(os.path.join(path, "meta.json")))


def find_latest(root: Optional[str]) -> Optional[str]:
    """Path of the newest complete checkpoint under ``root`` (None if there is none).

    Trusts ``latest`` when it names a complete checkpoint, else falls back to the highest
    complete ``iter_*`` directory; ``*.tmp`` directories (saves that never finished) are
    never used."""
    if not root or not os.path.isdir(root):
        return None
    pointer = os.path.join(root, "latest")
    if os.path.isfile(pointer):
        try:
            path = _iter_dir(root, int(open(pointer).read().strip()))
            if _complete(path):
                return path
        except ValueError:
            pass
    steps = sorted(int(m.group(1)) for m in map(_ITER.match, os.listdir(root)) if m)
    for step in reversed(steps):
        if _complete(_iter_dir(root, step)):
            return _iter_dir(root, step)
    return None


def read_meta(path: str) -> dict:
    with open(os.path.join(path, "meta.json")) as f:
        return json.load(f)


def check_compatible(meta: dict, path: str, *, tp: int, cp: int, dp: int, model: dict) -> None:
    """Refuse a checkpoint this run cannot load (pure: call it on every rank before any
    collective). CP and DP may change freely; TP and the model's shape may not."""
    here = f"TP{tp}·CP{cp}·DP{dp}"
    there = f"TP{meta['tp']}·CP{meta['cp']}·DP{meta['dp']}"
    if meta["tp"] != tp:
        raise ValueError(f"checkpoint {path} was saved with layout {there}; this run is {here}. "
                         "Parameters are split by TP, so relaunch with "
                         f"--tensor-model-parallel-size {meta['tp']} (CP and DP may differ)")
    diff = {k: (meta["model"].get(k), v) for k, v in model.items() if meta["model"].get(k) != v}
    if diff:
        detail = ", ".join(f"{k}: checkpoint {a!r} vs run {b!r}" for k, (a, b) in diff.items())
        raise ValueError(f"checkpoint {path} holds a different model ({detail}); pass the same "
                         "model flags or a different --load directory")


def _state(model: torch.nn.Module, optimizer, tp_rank: int) -> dict:
    pre = f"tp{tp_rank}/"
    state = {pre + "model." + k: v for k, v in model.state_dict().items()
             if isinstance(v, torch.Tensor)}
    state.update({pre + "optim." + k: v for k, v in optimizer.state_tensors().items()})
    return state


def _barrier(group) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def save_checkpoint(root: str, step: int, model, optimizer, *, tp_rank: int, meta: dict,
                    group: Optional[dist.ProcessGroup]) -> str:
    """Collective over ``group`` (None: every rank of the job; also runs without
    torch.distributed): save ``step`` atomically; returns the checkpoint's path."""
    final = _iter_dir(root, step)
    tmp = final + ".tmp"
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)   # a save of this step that died earlier
    _barrier(group)
    dcp.save(_state(model, optimizer, tp_rank), checkpoint_id=tmp, process_group=group)
    if os.environ.get(_DIE_IN_SAVE) == str(step):
        os.kill(os.getpid(), signal.SIGKILL)
    _barrier(group)
    if rank == 0:
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(dict(meta, step=step), f, indent=1)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_pointer(root, step)
        for name in os.listdir(root):      # leftovers of saves that were killed
            if name.endswith(".tmp") and name != os.path.basename(tmp):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    _barrier(group)
    return final


def _write_pointer(root: str, step: int) -> None:
    tmp = os.path.join(root, "latest.tmp")
    with open(tmp, "w") as f:
        f.write(f"{step}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, "latest"))


def load_checkpoint(path: str, model, optimizer, *, tp_rank: int,
                    group: Optional[dist.ProcessGroup]) -> int:
    """Load ``path`` in place into ``model`` and ``optimizer``; returns the saved step."""
    optimizer.init_state()
    state = _state(model, optimizer, tp_rank)
    dcp.load(state, checkpoint_id=path, process_group=group)
    with torch.no_grad():
        own = model.state_dict()
        for k, v in state.items():        # dcp loads in place; copy back anything it replaced
            name = k.split("/", 1)[1]
            if name.startswith("model.") and own[name[6:]] is not v:
                own[name[6:]].copy_(v)
        for m, p in zip(optimizer.master, optimizer.params):
            if m is not p:
                p.copy_(m)
    return int(read_meta(path)["step"])

"""Atomic checkpoints with ``torch.distributed.checkpoint`` (DCP).

Layout of a ``--save`` directory::

    iter_0000040/          complete checkpoints (DCP shards + .metadata + meta.json)
    iter_0000050.tmp/      a save in progress (or one killed mid-way: ignored, removed later)
    latest                 the step of the newest complete checkpoint, written last

A save writes into ``iter_N.tmp``, waits for every rank, then rank 0 writes ``meta.json``,
renames the directory to ``iter_N`` and replaces ``latest`` (write-then-``os.replace``). A crash
at any point leaves the previous complete checkpoint and ``latest`` untouched.

Integrity: ``meta.json`` records every file of the checkpoint with its size and CRC-32 (each
rank hashes the shards it wrote, ``__{rank}_*.distcp``, while the others hash theirs; rank 0
gathers the records and hashes what is left, DCP's ``.metadata``). Before a load,
:func:`verify_checkpoint` (pure: every rank, before any collective) reads ``meta.json`` and
checks that every recorded file exists with its size, and :func:`verify_checksums` (one
all-gather) re-reads the files, split over the ranks by size, and compares the CRC-32s. Any
damage raises one :class:`CheckpointError` naming the checkpoint, the file and how to resume
from the previous complete checkpoint (``--ckpt-step``); the newest checkpoint is never skipped
silently. Cost: one read of each file plus CRC-32 (~2.4 GB/s per core with zlib) at save and
at load, spread over the ranks; ``--no-checkpoint-checksums`` skips both (sizes stay).

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
import zlib
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

__all__ = ["save_checkpoint", "load_checkpoint", "find_latest", "resume_path",
           "require_checkpoint",
           "check_compatible", "read_meta", "verify_checkpoint", "verify_checksums",
           "CheckpointError"]

_ITER = re.compile(r"^iter_(\d{7})$")
_CHUNK = 8 << 20            # bytes read at a time while hashing


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: damaged, missing, or not the one asked for. The message
    names the checkpoint directory, the file, and how to resume instead."""


def _iter_dir(root: str, step: int) -> str:
    return os.path.join(root, f"iter_{step:07d}")


def _complete(path: str) -> bool:
    return (os.path.isfile(os.path.join(path, ".metadata"))
            and os.path.isfile(os.path.join(path, "meta.json")))


def find_latest(root: Optional[str]) -> Optional[str]:
    """Path of the newest checkpoint under ``root`` (None if there is none).

    The newest ``iter_*`` directory (``latest`` names it unless a crash came between the rename
    and the pointer). ``*.tmp`` directories (saves that never finished) are never used. A
    directory that lacks its ``.metadata`` or ``meta.json`` is still returned: saves are atomic,
    so it is damaged, and :func:`verify_checkpoint` says so instead of loading an older one."""
    steps = _steps(root)
    return _iter_dir(root, steps[-1]) if steps else None


def _steps(root: Optional[str]) -> list[int]:
    if not root or not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for m in map(_ITER.match, os.listdir(root)) if m)


def resume_path(load: Optional[str], step: Optional[int] = None) -> Optional[str]:
    """The checkpoint ``--load`` (and ``--ckpt-step``) name: ``load`` itself when it is a
    checkpoint directory (``ckpt/iter_0000040``), else step ``step`` under it, else the newest;
    None when ``load`` holds no checkpoint yet (a fresh start). Pure: call it on every rank."""
    if not load:
        return None
    if _ITER.match(os.path.basename(os.path.normpath(load))) or _complete(load):
        if step is not None:
            raise CheckpointError(f"--load {load} is a checkpoint directory and --ckpt-step "
                                  f"{step} picks a step: give one of them")
        return load
    if step is None:
        return find_latest(load)
    path = _iter_dir(load, step)
    if not os.path.isdir(path):
        have = ", ".join(map(str, _steps(load))) or "none"
        raise CheckpointError(f"--ckpt-step {step}: there is no {path} (steps in {load}: "
                              f"{have})")
    return path


def require_checkpoint(load: Optional[str], save: Optional[str], found: Optional[str]) -> None:
    """``--load`` must find a checkpoint, unless it is also ``--save`` (a job's first run,
    requeue-friendly: it starts fresh and saves there). Raises :class:`CheckpointError`
    naming ``--load`` and what it looked for."""
    if load is None or found is not None:
        return
    if save is not None and os.path.abspath(load) == os.path.abspath(save):
        return
    what = ("it does not exist" if not os.path.exists(load) else
            f"it holds {', '.join(sorted(os.listdir(load))[:6]) or 'nothing'}")
    raise CheckpointError(
        f"--load {load} holds no checkpoint: looked for {os.path.join(load, 'iter_NNNNNNN')}/ "
        f"directories (a train.py --save directory) or a checkpoint directory itself, and "
        f"{what}. Point --load at an earlier run's --save directory; to start fresh and save "
        f"there, give the same directory as --save (a requeued job's command line)")


def _damaged(path: str, what: str) -> CheckpointError:
    """The error for a damaged checkpoint, with the way back to the previous complete one."""
    root, name = os.path.split(os.path.normpath(path))
    m = _ITER.match(name)
    older = [s for s in _steps(root) if m and s < int(m.group(1))
             and _complete(_iter_dir(root, s))]
    if older:
        fix = (f"resume from the previous complete checkpoint with --ckpt-step {older[-1]} "
               f"({_iter_dir(root, older[-1])}), or move {path} away (e.g. to "
               f"{path}.damaged) so that --load {root} finds it")
    else:
        fix = (f"there is no earlier checkpoint in {root or '.'}: move {path} away to start "
               "fresh, or point --load elsewhere")
    return CheckpointError(f"checkpoint {path} is damaged: {what}. To continue, {fix}")


def read_meta(path: str) -> dict:
    """``meta.json`` of checkpoint ``path`` (a damaged or missing one raises CheckpointError)."""
    name = os.path.join(path, "meta.json")
    try:
        with open(name) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise _damaged(path, "meta.json is missing") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise _damaged(path, f"meta.json is not valid JSON ({e})") from None
    if not isinstance(meta, dict) or "step" not in meta:
        raise _damaged(path, "meta.json holds no step")
    return meta


def verify_checkpoint(path: str) -> dict:
    """Read ``meta.json`` and check that every file it records exists with its recorded size;
    returns the meta. Pure (stat calls only): run it on every rank before any collective.
    Checkpoints saved before files were recorded are checked for ``.metadata`` only."""
    meta = read_meta(path)
    files = meta.get("files")
    if files is None:
        if not os.path.isfile(os.path.join(path, ".metadata")):
            raise _damaged(path, ".metadata (DCP's index of the shards) is missing")
        return meta
    for name, rec in sorted(files.items()):
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            raise _damaged(path, f"{name} is missing")
        size = os.path.getsize(full)
        if size != rec["bytes"]:
            raise _damaged(path, f"{name} has {size:,} bytes, the save wrote {rec['bytes']:,}"
                           " (truncated or overwritten)")
    return meta


def _crc32(path: str) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _share(files: dict, rank: int, world: int) -> list[str]:
    """The files rank ``rank`` of ``world`` re-hashes: largest first, each to the least loaded
    rank (every rank computes the same split)."""
    load = [0] * world
    mine = []
    for name in sorted(files, key=lambda n: (-files[n]["bytes"], n)):
        r = load.index(min(load))
        load[r] += files[name]["bytes"] + 1
        if r == rank:
            mine.append(name)
    return mine


def verify_checksums(path: str, meta: dict, group: Optional[dist.ProcessGroup] = None) -> None:
    """Collective over ``group`` (None: every rank; also runs without torch.distributed):
    re-hash the checkpoint's files, split over the ranks by size, and raise CheckpointError on
    every rank if any differs from the CRC-32 recorded at save. Costs one read of the whole
    checkpoint divided by the ranks (CRC-32 ~2.4 GB/s per core)."""
    files = {k: v for k, v in (meta.get("files") or {}).items() if "crc32" in v}
    multi = dist.is_initialized()
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if multi else (0, 1)
    bad = [f"{n} does not match its checksum (crc32 {got}, saved {files[n]['crc32']})"
           for n in _share(files, rank, world) if (got := _crc32(os.path.join(path, n)))
           != files[n]["crc32"]]
    if multi and world > 1:
        everyone: list = [None] * world
        dist.all_gather_object(everyone, bad, group=group)
        bad = sorted(x for b in everyone for x in b)
    if bad:
        raise _damaged(path, "; ".join(bad))


def _record_files(tmp: str, rank: int, group, checksums: bool) -> Optional[dict]:
    """Size (and CRC-32) of every file of the save in ``tmp``: each rank hashes its own shards,
    rank 0 gathers them and adds the rest. Returns the records on rank 0, None elsewhere."""
    prefix = f"__{dist.get_rank(group) if dist.is_initialized() else 0}_"

    def record(name: str) -> dict:
        full = os.path.join(tmp, name)
        rec = {"bytes": os.path.getsize(full)}
        if checksums:
            rec["crc32"] = _crc32(full)
        return rec

    own = {n: record(n) for n in sorted(os.listdir(tmp)) if n.startswith(prefix)}
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, own, group=group)     # a few bytes per file
    else:
        everyone = [own]
    if rank != 0:
        return None
    files = {k: v for part in everyone for k, v in part.items()}
    for name in sorted(os.listdir(tmp)):        # DCP's .metadata; anything not claimed
        if name not in files and name != "meta.json" and os.path.isfile(
                os.path.join(tmp, name)):
            files[name] = record(name)
    return files


def check_compatible(meta: dict, path: str, *, tp: int, cp: int, dp: int, model: dict) -> None:
    """Refuse a checkpoint this run cannot load (pure: call it on every rank before any
    collective; :class:`CheckpointError`, which train.py prints once). CP and DP may change
    freely; TP and the model's shape may not."""
    here = f"TP{tp}·CP{cp}·DP{dp}"
    there = f"TP{meta['tp']}·CP{meta['cp']}·DP{meta['dp']}"
    if meta["tp"] != tp:
        raise CheckpointError(f"checkpoint {path} was saved with layout {there}; this run is {here}. "
                         "Parameters are split by TP, so relaunch with "
                         f"--tensor-model-parallel-size {meta['tp']} (CP and DP may differ)")
    diff = {k: (meta["model"].get(k), v) for k, v in model.items() if meta["model"].get(k) != v}
    if diff:
        detail = ", ".join(f"{k}: checkpoint {a!r} vs run {b!r}" for k, (a, b) in diff.items())
        raise CheckpointError(f"checkpoint {path} holds a different model ({detail}); pass the "
                              "same model flags or a different --load directory")


def _state(model: torch.nn.Module, optim_state: dict, tp_rank: int) -> dict:
    """The checkpoint's keys: ``tp<r>/model.<name>`` and ``tp<r>/optim.<param>.<what>``
    (``optim_state``: the optimizer's ``checkpoint_state()`` on save, its
    ``checkpoint_targets()`` on load; a sharded optimizer gives each rank its own part)."""
    pre = f"tp{tp_rank}/"
    state = {pre + "model." + k: v for k, v in model.state_dict().items()
             if isinstance(v, torch.Tensor)}
    state.update({pre + "optim." + k: v for k, v in optim_state.items()})
    return state


def _barrier(group) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def save_checkpoint(root: str, step: int, model, optimizer, *, tp_rank: int, meta: dict,
                    group: Optional[dist.ProcessGroup], checksums: bool = True,
                    after_write: Optional[Callable[[int, str], None]] = None) -> str:
    """Collective over ``group`` (None: every rank of the job; also runs without
    torch.distributed): save ``step`` atomically; returns the checkpoint's path. ``meta.json``
    records every file's size and, with ``checksums``, its CRC-32. ``after_write(step,
    tmp_path)``: called once the shards are written, before they are recorded and renamed
    (:class:`~sp_train.launch.TrainHooks`)."""
    final = _iter_dir(root, step)
    tmp = final + ".tmp"
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)   # a save of this step that died earlier
    _barrier(group)
    dcp.save(_state(model, optimizer.checkpoint_state(), tp_rank), checkpoint_id=tmp,
             process_group=group)
    if after_write is not None:
        after_write(step, tmp)
    files = _record_files(tmp, rank, group, checksums)     # also the barrier after the write
    if rank == 0:
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(dict(meta, step=step, files=files), f, indent=1)
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
    optim = optimizer.checkpoint_targets()
    state = _state(model, optim, tp_rank)
    try:
        dcp.load(state, checkpoint_id=path, process_group=group)
    except (Exception, dcp.CheckpointException) as e:  # (a BaseException) alike on every rank
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise _damaged(path, f"reading it failed ({type(e).__name__}: {first[:300]})") from e
    pre = f"tp{tp_rank}/optim."
    with torch.no_grad():
        own = model.state_dict()
        for k, v in state.items():        # dcp loads in place; copy back anything it replaced
            name = k.split("/", 1)[1]
            if name.startswith("model.") and own[name[6:]] is not v:
                own[name[6:]].copy_(v)
    optimizer.finish_load({k[len(pre):]: v for k, v in state.items() if k.startswith(pre)})
    return int(read_meta(path)["step"])

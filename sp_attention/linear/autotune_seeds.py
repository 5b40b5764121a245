"""Shipped autotune results for fla's kernels, so a fresh GPU machine's first step takes seconds.

fla-core autotunes every Triton kernel of the chunk recurrence over dozens of configs the first
time it sees a (dtype, head dim) key, and caches the winner in Triton's on-disk cache
(``TRITON_CACHE_DIR``, default ``~/.triton/cache``). On a machine with an empty cache that costs
minutes: measured on one H200 (2026-11-23, ``benchmarks/first_call.py``), 237 s before the first
bf16 K = V = 128 fwd+bwd finished; with the results below in the cache, 11 s (44 s for all eight
dtype × head-dim × layout cases).

``tuned/sm90_triton<T>_fla<F>.tgz`` holds those ``*.autotune.json`` files, measured on Hopper
(sm_90: H100/H200) for bf16 and fp32 with K = V ∈ {64, 128} (fla's keys do not depend on the
sequence length or head count); since 2026-11-24 also fla's gated and varlen (packed
documents) kernels and our own gated kernels at K = V = 64, and the varlen kernels at 128;
since 2026-11-26 the keys train.py's 1B models met on a fresh 2 × H100 machine (the packed
path's K = 64 recurrences and output kernel, the linear and gated models' dv and dq/dk): its
first step at CP 2 and 32K went from over 140 s to 29–43 s (softmax, linear, gated, hybrid
with packed documents; ``benchmarks/train_scaling.py --fresh-triton-cache``); since 2026-11-27
the keys of the HF example's linear model (K = V = 32, fixed rates, eight kernels), whose first
step at CP 4 on a fresh 4 × H200 came after 112 s of autotuning and compiling; since the eighth
session of 2026-11-27 our dv kernel and the dq/dk kernel's fixed-rate mode (the backward's
arriving gradient in-kernel) at the benchmark's K = V = 128 and the 1B models' 64, and the HF
example's gated model's fla keys (K = V = 32). H100 and H200
are both sm_90: Triton keys its cache by the architecture, so one archive serves both (the
configs were timed on whichever ran; a config tuned on one is a good one on the other).
Triton names each cache entry by a hash of its own version, the
GPU target, the kernel source and the tuning key, so an entry can only ever be read by the
exact Triton + fla + GPU it was made on; we still unpack only when those match. Existing files
are never overwritten (a cache the user already tuned wins). Set
``SP_ATTENTION_AUTOTUNE_SEEDS=0`` to skip it. Where: Triton's cache folder, and while
``TRITON_CACHE_DIR`` is unset also the per-device folder torch's Inductor switches the process
to on its first compiled kernel (:func:`_cache_dirs`; without it a fresh 4 × H200's first
train.py step autotuned ~90 s of shipped keys).

An archive may also hold **compiled kernels** (the first step's other cost on a fresh machine
is compiling: ptxas on every rank at once; 55–125 s to the first training step measured on
fresh 4-GPU machines): per cache entry its metadata ``<name>.json``, its ``<name>.cubin`` and
Triton's group file ``__grp__<name>.json``, whose paths name the machine it was made on — they
are rewritten to this cache and to the files shipped (Triton loads a kernel from its metadata
and binary alone). Content-addressed like the autotune results: a different Triton, kernel
source, option or GPU target never reads them. The shipped archive holds the kernels of
the 1B models' first steps at CP 1, 2 and 4 (``bash scripts/device_train.sh first_step``
harvests a run's cache): a fresh 4 × H200 reached every first step in 29–45 s with it
(``benchmarks/results/2026-11-28_h200x4_first_step.jsonl``; without compiled kernels
55–125 s).
"""
from __future__ import annotations

import functools
import json
import os
import tarfile
from pathlib import Path
from typing import Optional

import torch

__all__ = ["install_autotune_seeds", "install_once"]

_TUNED = Path(__file__).with_name("tuned")


def _seed_file() -> Optional[Path]:
    """The shipped archive for this GPU, Triton and fla, or None."""
    if os.environ.get("SP_ATTENTION_AUTOTUNE_SEEDS", "1") == "0" or not torch.cuda.is_available():
        return None
    try:
        import fla
        import triton
    except ImportError:
        return None
    major, minor = torch.cuda.get_device_capability()
    path = _TUNED / f"sm{major}{minor}_triton{triton.__version__}_fla{fla.__version__}.tgz"
    return path if path.is_file() else None


def _cache_dir() -> Path:
    env = os.environ.get("TRITON_CACHE_DIR")
    if env:
        return Path(env)
    try:
        import triton
        return Path(triton.knobs.cache.dir)
    except (ImportError, AttributeError):
        return Path.home() / ".triton" / "cache"


def _cache_dirs() -> list[Path]:
    """Every Triton cache this process may read from: Triton's (``TRITON_CACHE_DIR``, or its
    default), and, while ``TRITON_CACHE_DIR`` is unset, the per-device folder torch's Inductor
    sets it to when the process loads its first compiled kernel (e.g. Megatron's
    ``torch.compile``'d fusions; ``/tmp/torchinductor_<user>/triton/<device>``): from then on
    fla's and our kernels look their results up there. Measured on a fresh 4 × H200 (call 75):
    with the results installed only in Triton's default folder, train.py's first step autotuned
    fla's chunk-state kernels for ~37 s each and missed the shipped kernels."""
    dirs = [_cache_dir()]
    if not os.environ.get("TRITON_CACHE_DIR"):
        before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        try:
            from torch._inductor.runtime.cache_dir_utils import triton_cache_dir
            index = torch.cuda.current_device() if torch.cuda.is_available() else 0
            dirs.append(Path(triton_cache_dir(index)))
        except (ImportError, AttributeError, RuntimeError):
            pass
        finally:        # torch's lookup also sets the variable: leave the environment as it was
            if before is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    return list(dict.fromkeys(dirs))


@functools.lru_cache(maxsize=1)
def install_once() -> int:
    """:func:`install_autotune_seeds` for this machine, once per process (the fla path calls
    it before its first kernel; train.py at its start on GPUs)."""
    return install_autotune_seeds()


def _shipped(name: Path) -> bool:
    """Whether an archive member is a cache file we install: ``<hash>/<file>`` with an
    autotune result, a compiled kernel's metadata or binary, or its group file."""
    if name.is_absolute() or ".." in name.parts or len(name.parts) != 2:
        return False
    return name.suffix in (".json", ".cubin")


def _write(dest: Path, data: bytes) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, dest)        # atomic: another rank may write the same file


def _group(data: bytes, entry: Path, present: set) -> bytes:
    """A Triton group file (``{"child_paths": {file: path}}``) pointing into ``entry`` (this
    cache's directory of the kernel) and listing only the files ``present`` there."""
    children = json.loads(data)["child_paths"]
    keep = {c: str(entry / c) for c in children if c in present}
    return json.dumps({"child_paths": keep}).encode()


def install_autotune_seeds(archive: Optional[Path] = None,
                           cache_dir: Optional[Path] = None) -> int:
    """Unpack ``archive`` (default: the shipped one matching this GPU, Triton and fla) into
    ``cache_dir`` (default: every cache of :func:`_cache_dirs`); returns the number of files
    written (0 when nothing matches this machine or every file was present). Group files of
    compiled kernels are written last, pointing into the cache they are in."""
    path = _seed_file() if archive is None else Path(archive)
    if path is None:
        return 0
    roots = _cache_dirs() if cache_dir is None else [Path(cache_dir)]
    return sum(_install(path, root) for root in roots)


def _install(path: Path, root: Path) -> int:
    written = 0
    try:
        with tarfile.open(path) as tar:
            members = [m for m in tar.getmembers() if m.isfile() and _shipped(Path(m.name))]
            groups = [m for m in members if Path(m.name).name.startswith("__grp__")]
            for member in members:
                name = Path(member.name)
                if member in groups or (root / name).exists():
                    continue
                _write(root / name, tar.extractfile(member).read())
                written += 1
            for member in groups:       # once the files they name are in place
                dest = root / member.name
                if dest.exists():
                    continue
                present = {p.name for p in dest.parent.iterdir()}
                _write(dest, _group(tar.extractfile(member).read(), dest.parent, present))
                written += 1
    except (OSError, ValueError, KeyError):
        # a read-only or full cache, or a group file we cannot read, only costs the tuning
        # and compiling it would save
        return written
    return written

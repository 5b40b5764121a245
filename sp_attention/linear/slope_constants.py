"""Small tensors derived from a slopes tensor, made once per slopes tensor and version.

Rebuilding them on every call costs a handful of kernel launches each, and the CP step is
launch-bound at short T_local; reading slope values on the host (the value check) would sync a
CUDA device on every call. Each derived constant has a named function here; the cache behind
them is keyed by ``id(slopes)`` with a weak reference to the tensor and its ``_version``: an
in-place change of the slopes drops the entry, and a finalizer drops it with the tensor.
Nothing is attached to the tensor itself (saving it saves only values). A WeakKeyDictionary
would compare tensors with ``==``, which is elementwise.
"""
from __future__ import annotations

import math
import weakref
from typing import Callable

import torch

from ..caches import LRU

__all__ = ["fla_g_gamma", "decay_weights", "leaf_transition", "check_slope_values",
           "check_gate_values", "cached_constants", "num_cached_slopes"]

# id(slopes) -> (weakref to it, its _version, LRU {(constant name, *args): derived value}).
# One entry per live slopes tensor (a finalizer drops it with the tensor); within an entry at
# most _PER_SLOPES constants, least recently used dropped first: a model meets a few shapes
# (about six constants per local length), but variable lengths would otherwise grow it for as
# long as the slopes live (a model buffer: the whole run).
_CACHE: dict = {}
_PER_SLOPES = 32


def _cached(slopes: torch.Tensor, key: tuple, make: Callable):
    entry = _CACHE.get(id(slopes))
    if entry is None or entry[0]() is not slopes or entry[1] != slopes._version:
        try:
            ref = weakref.ref(slopes)
        except TypeError:                       # not weak-referenceable: no caching
            return make()
        if entry is None or entry[0]() is not slopes:
            weakref.finalize(slopes, _CACHE.pop, id(slopes), None)
        entry = _CACHE[id(slopes)] = (ref, slopes._version, LRU(_PER_SLOPES))
    return entry[2].get(key, make)


def fla_g_gamma(slopes: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``[H]`` fp32 ``−s / ln 2`` on ``device``: the natural-log decay in log2 units, because
    fla's kernels (and ours) form decays with exp2 (see :mod:`.fla_ops`)."""
    return _cached(slopes, ("fla_g_gamma", device), lambda: (
        -slopes.to(device=device, dtype=torch.float32) / math.log(2.0)).contiguous())


def decay_weights(slopes: torch.Tensor, n: int, base: int, step: int, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """``[H, n]`` weights ``λ^(base + step·t)`` as ``exp(−s·(base + step·t))`` in ``dtype``."""
    return _cached(slopes, ("decay_weights", n, base, step, dtype, device), lambda: torch.exp(
        -slopes.to(device=device, dtype=dtype)[:, None]
        * (base + step * torch.arange(n, device=device, dtype=dtype))[None, :]))


def leaf_transition(slopes: torch.Tensor, leaf_len: int, batch: int, dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """``[batch, H]`` scan transition ``A = λ^C`` of a leaf of ``C = leaf_len`` tokens."""
    return _cached(slopes, ("leaf_transition", leaf_len, batch, dtype, device), lambda: torch.exp(
        -slopes.to(device=device, dtype=dtype) * leaf_len).reshape(1, -1).expand(batch, -1)
        .contiguous())


def check_slope_values(slopes: torch.Tensor) -> None:
    """Raise ``ValueError`` unless every slope is finite and >= 0; checked once per tensor and
    version (reading values on the host syncs a CUDA device)."""
    def check() -> bool:
        if not torch.isfinite(slopes).all() or (slopes < 0).any():
            raise ValueError("slopes must be finite and >= 0 (decay exp(-slope) in (0, 1]); "
                             f"got min {slopes.min().item()}")
        return True
    _cached(slopes, ("check_slope_values",), check)


def check_gate_values(g: torch.Tensor) -> bool:
    """Raise ``ValueError`` unless every gate is finite and <= 0; checked once per tensor and
    version (the same cache as the slopes' constants). Reading the values on the host is one
    device sync on CUDA: gates are activations, a new tensor every step, so a training step
    pays it once per gated layer call (``LinearTuning(check_gate_values=False)`` skips it).
    Returns True when the check ran now (False: this tensor version was checked before, or a
    CUDA graph is being captured, which cannot read values: a replayed layer's gates are
    checked in the eager calls before its capture only)."""
    if g.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    ran = []

    def check() -> bool:
        ran.append(True)
        if bool((~torch.isfinite(g)).any() | (g > 0).any()):
            bad = g[~torch.isfinite(g) | (g > 0)]
            raise ValueError(
                f"g must be finite and <= 0 (a log-decay per token: exp(g) in (0, 1]); got "
                f"{bad.numel()} values like {bad.flatten()[0].item()}. Make it non-positive by "
                "construction, e.g. g = -softplus(x) * exp(A_log) (Mamba2) or logsigmoid(x); "
                "for document starts pass cu_seqlens instead of a -inf gate")
        return True
    _cached(g, ("check_gate_values",), check)
    return bool(ran)


def cached_constants(slopes: torch.Tensor) -> tuple[str, ...]:
    """Names of the constants cached for this slopes tensor at its current version."""
    entry = _CACHE.get(id(slopes))
    if entry is None or entry[0]() is not slopes or entry[1] != slopes._version:
        return ()
    return tuple(sorted({key[0] for key in entry[2].keys()}))


def num_cached_slopes() -> int:
    """Entries in the cache, one per slopes tensor with cached constants (a finalizer drops
    the entry when its tensor dies)."""
    return len(_CACHE)

"""The decay of one call, fixed per-head rates or per-token gates, and what the local ops need
from it: one object, so that every path (leaf rows, packed pieces, the scans) takes either.

``Decay(slopes=s)``: ``S_t = exp(−s)·S_{t−1} + k_tᵀ v_t`` (fla's ``g_gamma = −s``);
``Decay(g=g)``: ``S_t = exp(g_t)·S_{t−1} + k_tᵀ v_t`` with ``g [B, T, H]`` (fla's ``g``).
Fixed slopes are the case ``g_t = −s``: the torch path keeps its exact form for them (powers
``exp(−s·n)``) and the fla path fla's ``g_gamma`` kernels, so their numbers and speed are
today's; gates take the gated kernels (fla's, and ours where fla's cannot run).

Every gate is clamped at :data:`.gates.GATE_FLOOR` of the dtype it is summed in, where it
enters a sum (:func:`.gates.clamp_gates`): the torch forms here and in
:func:`.torch_ops.chunked_gated_core`, and the kernels' sums (:attr:`Decay.sums`,
:meth:`Decay.fla_kw`), so every consumer sees clamped values; ``g`` itself is kept as given
(the torch backward differentiates through the clamp: no gradient below the floor).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Union

import torch

from ..planning.schedules import CHUNK
from ..precision import acc_dtype
from .gates import GateSums, chunk_local_sums, clamp_gates, sums_from_local
from .slope_constants import fla_g_gamma, leaf_transition
from .torch_ops import chunked_core, chunked_gated_core

__all__ = ["Decay", "as_decay"]


@dataclass(frozen=True)
class Decay:
    """Fixed rates ``slopes [H]`` or gates ``g [B, T, H]`` (natural log, ≤ 0) of the tokens
    this object describes (a row of leaves, a piece of a shard)."""

    slopes: Optional[torch.Tensor] = None
    g: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if (self.slopes is None) == (self.g is None):
            raise ValueError("Decay takes exactly one of slopes and g")

    @property
    def gated(self) -> bool:
        return self.g is not None

    def tokens(self, start: int, stop: int) -> "Decay":
        """The decay of tokens ``[start, stop)`` of every row."""
        return self if not self.gated else Decay(g=self.g[:, start:stop])

    def rows(self, n: int) -> "Decay":
        """``[B, n·C, H]`` gates as ``[B·n, C, H]``: one row per leaf (as q, k, v)."""
        if not self.gated or n == 1:
            return self
        g = self.g
        return Decay(g=g.reshape(g.shape[0] * n, g.shape[1] // n, g.shape[2]))

    # ----------------------------------------------------------------- the scan's transition
    def transition(self, batch: int, length: int, dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
        """``[batch, H]`` transition ``A`` over ``length`` tokens (contiguous, ``dtype``):
        ``exp(Σ g)`` summed in ``dtype`` (fp32 at least; gates clamped), or ``λ^C`` (cached
        per slopes)."""
        if not self.gated:
            return leaf_transition(self.slopes, length, batch, dtype, device)
        return clamp_gates(self.g, dtype).sum(1).exp().to(dtype).contiguous()

    # --------------------------------------------------------------------------- torch path
    def core(self, q, k, v, scale: float, S_in: Optional[torch.Tensor], chunk: int = CHUNK):
        """The torch backend's chunked form: ``(o, S_end)`` in fp32/fp64, differentiable
        (in g too)."""
        if self.gated:
            return chunked_gated_core(q, k, v, self.g, scale, S_in, chunk)
        return chunked_core(q, k, v, self.slopes, scale, S_in, chunk)

    def weights(self, T: int, end_state: bool, dtype: torch.dtype, device) -> torch.Tensor:
        """Per-token weights of a piece's state sums, ``[B or 1, T, H]`` in ``dtype``:
        ``exp(G_t)`` (G inclusive from the first token: the state-gradient contribution) or,
        ``end_state``, ``exp(Σ_{s > t} g_s)`` (the end state from zero). Sums of g are taken
        directly (an exclusive suffix sum, never a difference of two long sums), of the
        clamped gates."""
        if not self.gated:
            s = self.slopes.to(device=device, dtype=dtype)
            n = torch.arange(T, device=device, dtype=dtype)
            n = (T - 1 - n) if end_state else n + 1
            return torch.exp(-s[None, :] * n[:, None])[None]
        g = clamp_gates(self.g, dtype).to(dtype)
        if end_state:
            suffix = g.flip(1).cumsum(1).flip(1)                      # Σ_{s ≥ t}
            return torch.nn.functional.pad(suffix[:, 1:], (0, 0, 0, 1)).exp()   # Σ_{s > t}
        return g.cumsum(1).exp()

    # ----------------------------------------------------------------------------- fla path
    @functools.cached_property
    def _local(self) -> tuple:
        return chunk_local_sums(self.g, CHUNK)

    @functools.cached_property
    def sums(self) -> GateSums:
        """The gates in the kernels' units (chunks of 64, clamped): the chunk-local log2 sums
        (one launch, all fla's kernels need), then their prefixes over chunks and the row's
        total (one cumulative sum; the multi-leaf path's carry and transition)."""
        return sums_from_local(*self._local)

    def fla_kw(self, device: torch.device) -> dict:
        """fla's decay keywords: ``g`` = the chunk-local log2 sums (clamped gates), or
        ``g_gamma``."""
        if self.gated:
            return {"g": self._local[0], "g_gamma": None}
        return {"g": None, "g_gamma": fla_g_gamma(self.slopes, device)}

    def fla_transition(self, batch: int, length: int, dtype: torch.dtype,
                       device: torch.device) -> torch.Tensor:
        """``[batch, H]`` transition of the fla path in the states' ``dtype`` (gates: ``exp2``
        of the kernels' gate sums, fp32 on a GPU)."""
        if not self.gated:
            return leaf_transition(self.slopes, length, batch, dtype, device)
        return torch.exp2(self.sums.total).to(dtype).contiguous()


def as_decay(x: Union[torch.Tensor, Decay]) -> Decay:
    """A :class:`Decay` as it is, a tensor as fixed slopes (the leaf ops' old argument)."""
    return x if isinstance(x, Decay) else Decay(slopes=x)

"""The decay of one call, fixed per-head rates or per-token gates, and what the local ops need
from it: one object, so that every path (leaf rows, packed pieces, the scans) takes either.

``Decay(slopes=s)``: ``S_t = exp(−s)·S_{t−1} + k_tᵀ v_t`` (fla's ``g_gamma = −s``);
``Decay(g=g)``: ``S_t = exp(g_t)·S_{t−1} + k_tᵀ v_t`` with ``g [B, T, H]`` (fla's ``g``).
Fixed slopes are the case ``g_t = −s``: the torch path runs its own exact form for them (powers
``exp(−s·n)``), the fla path fla's ``g_gamma`` kernels, so their numbers and speed are today's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..precision import acc_dtype

__all__ = ["Decay"]


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

    def log_transition(self, batch: int, length: int, dtype: torch.dtype) -> torch.Tensor:
        """``[batch, H]``: the log of ``A`` over ``length`` tokens, ``Σ g`` (summed in
        ``dtype``) or ``−s·length``."""
        if self.gated:
            return self.g.to(dtype).sum(1)
        s = self.slopes.to(dtype)
        return (-s * length).reshape(1, -1).expand(batch, -1)

    def transition(self, batch: int, length: int, dtype: torch.dtype) -> torch.Tensor:
        """``[batch, H]`` scan transition ``A = exp(Σ g)`` / ``λ^C`` (contiguous)."""
        return self.log_transition(batch, length, dtype).exp().contiguous()

    def core(self, q, k, v, scale: float, S_in: Optional[torch.Tensor], chunk: int = 64):
        """The torch backend's chunked form: ``(o, S_end)`` in fp32/fp64, differentiable
        (in g too)."""
        if self.gated:
            from .gated_naive import chunked_gated_core
            return chunked_gated_core(q, k, v, self.g, scale, S_in, chunk)
        from .torch_ops import chunked_core
        return chunked_core(q, k, v, self.slopes, scale, S_in, chunk)

    def state_grad(self, q: torch.Tensor, do: torch.Tensor, scale: float) -> torch.Tensor:
        """``scale Σ_i exp(G_i) q_iᵀ dO_i`` (G inclusive from the first token) in pure torch,
        fp32/fp64: the piece's gradient on its incoming state through its own outputs."""
        dt = acc_dtype(q, do, self.g)
        if self.gated:
            w = self.g.to(dt).cumsum(1).exp()                                  # [B, T, H]
            xw = q.to(dt) * w[..., None]
        else:
            n = torch.arange(1, q.shape[1] + 1, device=q.device, dtype=dt)
            w = torch.exp(-self.slopes.to(device=q.device, dtype=dt)[:, None] * n)   # [H, T]
            xw = q.to(dt) * w.t()[None, :, :, None]
        return scale * torch.einsum("bthk,bthv->bhkv", xw, do.to(dt))

"""The Mamba2-style decay gate of gated linear-attention layers (Megatron's and HF's adapters
build their gated layers from this one home):

    g_t = −exp(A_log) · softplus(x_t · W + dt_bias)        (per head; g_t ≤ 0 by construction)

``x_t · W`` is the layer input's projection to one value per head, ``A_log`` and ``dt_bias``
one value per head. Initialisation as Mamba2's: ``A = U(1, 16)``, ``dt = exp(U(ln 0.001,
ln 0.1))`` floored at 1e-4, ``dt_bias = dt + ln(1 − e^{−dt})`` (the inverse softplus), so a
fresh layer's decay per token ``A·dt`` spans ~0.001 (long memory) to ~1.6 (a few tokens).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from ..precision import acc_dtype

__all__ = ["A_INIT_RANGE", "DT_INIT_RANGE", "DT_INIT_FLOOR", "mamba2_gate_init",
           "gate_log_decay"]

A_INIT_RANGE = (1.0, 16.0)          # A = exp(A_log), uniform
DT_INIT_RANGE = (1e-3, 1e-1)        # dt, log-uniform
DT_INIT_FLOOR = 1e-4


def mamba2_gate_init(heads: int, generator: Optional[torch.Generator] = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A_log [heads], dt_bias [heads])`` fp32, Mamba2's initialisation (draws from
    ``generator``, else torch's global RNG)."""
    a = torch.empty(heads, dtype=torch.float32).uniform_(*A_INIT_RANGE, generator=generator)
    lo, hi = (math.log(x) for x in DT_INIT_RANGE)
    dt = torch.exp(torch.empty(heads, dtype=torch.float32).uniform_(lo, hi, generator=generator))
    dt = dt.clamp(min=DT_INIT_FLOOR)
    return torch.log(a), dt + torch.log(-torch.expm1(-dt))


def gate_log_decay(logits: torch.Tensor, a_log: torch.Tensor,
                   dt_bias: torch.Tensor) -> torch.Tensor:
    """``g = −exp(A_log) · softplus(logits + dt_bias)`` in fp32 (fp64 for fp64 logits;
    ``logits [..., H]``, the projection ``x·W``; ``a_log``, ``dt_bias`` ``[H]``): what
    ``lightning_attention(g=)`` takes."""
    dt = acc_dtype(logits)
    return -torch.exp(a_log.to(dt)) * F.softplus(logits.to(dt) + dt_bias.to(dt))

"""Per-head decay rates (slopes) for models built on linear attention with decay.

One home for the schedules the Megatron and HF models use. A slope ``s ≥ 0`` gives the head the
decay ``λ = exp(−s)``: a token ``n`` positions back is weighted ``λ^n``, so ``1/s`` is the head's
memory length in tokens and ``s = 0`` never forgets.

- ``"lightning"``: Lightning Attention / TransNormerLLM — ALiBi's geometric slopes
  ``2^(−8(i+1)/H)`` scaled by ``1 − (l−1)/(L−1) + 1e−5`` for layer ``l`` of ``L``, so early layers
  decay fast and the last layer barely decays.
- ``"long_range"``: geometric from 1/16 down to 1/256 over the first ``H−1`` heads and one head
  with no decay (``H = 4``: 1/16, 1/64, 1/256, 0). Tasks that must carry information across a
  whole long sequence (train.py's copy task) learn with these; the lightning schedule's fast
  heads forget within a few tokens and stayed near chance there.

Under tensor parallelism a rank holding heads ``[a, b)`` uses ``decay_slopes(H, ...)[a:b]``.
"""
from __future__ import annotations

import torch

__all__ = ["SLOPE_SCHEDULES", "DEFAULT_SLOPE_SCHEDULE", "decay_slopes"]

SLOPE_SCHEDULES = ("long_range", "lightning")
# The one default decay schedule of models (the adapters' and train.py's default).
DEFAULT_SLOPE_SCHEDULE = "long_range"


def decay_slopes(num_heads: int, schedule: str = DEFAULT_SLOPE_SCHEDULE, *,
                 layer_number: int = 1, num_layers: int = 1) -> torch.Tensor:
    """``[num_heads]`` fp32 CPU tensor of decay rates for one layer (see the module docstring).

    ``layer_number`` is 1-based (Megatron's convention) and only used by ``"lightning"``.
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    if schedule not in SLOPE_SCHEDULES:
        raise ValueError(f"unknown slope schedule {schedule!r}; use one of {SLOPE_SCHEDULES}")
    if not 1 <= layer_number <= num_layers:
        raise ValueError(f"layer_number {layer_number} must be in [1, num_layers={num_layers}]")
    H = num_heads
    if schedule == "lightning":
        base = [2.0 ** (-8.0 * (i + 1) / H) for i in range(H)]
        factor = 1.0 - (layer_number - 1) / (num_layers - 1) + 1e-5 if num_layers > 1 else 1.0
        return torch.tensor([b * factor for b in base], dtype=torch.float32)
    if H == 1:
        return torch.zeros(1, dtype=torch.float32)
    steps = max(H - 2, 1)
    return torch.tensor([2.0 ** (-4.0 - 4.0 * i / steps) for i in range(H - 1)] + [0.0],
                        dtype=torch.float32)

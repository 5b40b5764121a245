"""The K/V ring buffers both ring schedules (:mod:`.fwd_ring`, :mod:`.bwd_ring`) pass around."""
from __future__ import annotations

import torch

from ..context import SPContext

__all__ = ["pack_kv"]


def pack_kv(k: torch.Tensor, v: torch.Tensor, ctx: SPContext) -> list[torch.Tensor]:
    """``[2, B, T, Hkv, D]`` ring buffers (two when P > 1: the block in use and the one being
    received), the first holding this rank's K and V: one message per hop."""
    bufs = [torch.empty((2,) + tuple(k.shape), dtype=k.dtype, device=k.device)
            for _ in range(2 if ctx.world_size > 1 else 1)]
    bufs[0][0].copy_(k)
    bufs[0][1].copy_(v)
    return bufs

"""All-gather forward: gather K/V a few KV heads at a time, attend once per query chunk.

For head stride i (KV heads ``[h0, h0 + s)``) every rank all-gathers those heads' K and V
(packed in one buffer: one collective per stride), arranges the gathered chunks so that each
local query chunk's visible keys are one prefix with its own chunk last (:func:`.plan.
gather_plan`) and makes one bottom-right causal kernel call per chunk for the matching query
heads ``[h0·G, (h0 + s)·G)``. Every query row sees all its keys in one call, so the output and
LSE are exactly single-device attention: no LSE merge.

Overlap: stride i + 1's gather is issued before stride i computes (double buffer), so only
the first gather is exposed. Traffic per stride: each rank receives ``(P − 1)·B·T_local·2·s·D``
elements of the input dtype.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..context import SPContext
from ..planning.softmax_plan import gather_plan
from ..precision import acc_dtype
from .gather import KVGather, Unit, arrange_keys, max_unit_numel
from .backends import KernelBackend

__all__ = ["allgather_forward"]


def allgather_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: SPContext,
                      backend: KernelBackend, *, causal: bool, scale: Optional[float],
                      heads_k_stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward by head-strided K/V all-gathers.

    Args:
        q: ``[B, T_local, H, D]``; k, v: ``[B, T_local, Hkv, D]`` (local shards, ctx's layout).
        heads_k_stride: KV heads per gather; must divide ``Hkv``.

    Returns ``(out [B, T_local, H, D] in q.dtype, lse [B, H, T_local] fp32 (fp64 for fp64))``.
    """
    b, t, h, d = q.shape
    hkv = k.shape[2]
    if hkv % heads_k_stride:
        raise ValueError(f"heads_k_stride={heads_k_stride} does not divide the {hkv} local KV "
                         "heads")
    group = h // hkv
    n_chunks = len(ctx.leaves)
    ls = t // n_chunks
    plan = gather_plan(ctx.rank, ctx.world_size, ctx.layout, 1, 0, n_chunks, bool(causal))
    units = [Unit(h0, h0 + heads_k_stride, 0, n_chunks) for h0 in range(0, hkv, heads_k_stride)]
    numel = max_unit_numel(units, b, ls, d)
    gather = KVGather(k, v, ctx, ls, numel)
    scratch = torch.empty(ctx.world_size * numel, dtype=k.dtype, device=k.device)
    out = torch.empty((b, t, h, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, t), dtype=acc_dtype(q.dtype), device=q.device)

    gather.start(0, units[0])
    for i, u in enumerate(units):
        recv = gather.wait(i)                                   # [P, B, T_local, 2, s, D]
        if i + 1 < len(units):
            gather.start(i + 1, units[i + 1])                   # overlaps this stride's compute
        kk, vv = arrange_keys(recv, plan, ls, scratch)          # [B, L, s, D] each
        heads = slice(u.h0 * group, u.h1 * group)
        for c in plan.calls:
            rows = slice(c.q_start * ls, c.q_stop * ls)
            n_keys = c.keys * ls
            o, l = backend.forward(q[:, rows, heads], kk[:, :n_keys], vv[:, :n_keys], c.causal,
                                   scale)
            out[:, rows, heads].copy_(o)
            lse[:, heads, rows].copy_(l)
    return out, lse

"""Packed documents in :func:`~sp_attention.softmax.context_parallel_attention`: the autograd
Function of the packed schedules and the checks of ``cu_seqlens``.

``cu_seqlens`` (a tensor or a :class:`~sp_attention.PackingPlan`) resolves to the batch's plan
(:func:`sp_attention.planning.packing.resolve_plan`: cached, no device sync for a tensor seen before);
its digest joins the op's cross-rank call signature, so ranks that disagree on the boundaries
all raise. A trivial plan (one document laid out as the unpacked layout) takes the unpacked
path; any other runs :mod:`.packed_ring` / :mod:`.packed_allgather`, every fwd × bwd pair.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..context import SPContext
from ..planning.packing import PackingPlan, resolve_plan
from ..planning.softmax_packed import CallPolicy
from ..validation import autocast_off
from .packed_allgather import packed_allgather_backward, packed_allgather_forward
from .packed_ring import packed_ring_backward, packed_ring_forward

__all__ = ["PackedConfig", "PackedAttention", "packed_plan_for"]


def packed_plan_for(cu_seqlens, q: torch.Tensor, ctx: SPContext,
                    causal: bool) -> Optional[PackingPlan]:
    """The plan of ``cu_seqlens`` for this call (None: unpacked), or a ``ValueError`` /
    ``TypeError`` naming the fix."""
    if cu_seqlens is None:
        return None
    if not isinstance(cu_seqlens, (torch.Tensor, PackingPlan)):
        raise TypeError("cu_seqlens must be an int32/int64 tensor [N+1] of the global row's "
                        "document boundaries or a PackingPlan (sp_attention.plan_packing), got "
                        f"{type(cu_seqlens).__name__}")
    if causal is not True:
        raise ValueError("packed documents (cu_seqlens) need causal=True: each token attends to "
                         "earlier tokens of its own document")
    return resolve_plan(cu_seqlens, ctx, q.shape[1], device=q.device)


@dataclass(frozen=True)
class PackedConfig:
    """Everything the packed Function needs (built by the public function after its checks)."""

    ctx: SPContext
    plan: PackingPlan
    fwd: str
    bwd: str
    scale: float
    backend: object
    stride: int
    first: Optional[int]
    last: Optional[int]
    return_lse: bool
    pack_kv: bool
    policy: CallPolicy


class PackedAttention(torch.autograd.Function):
    """Packed causal attention; saves ``q, k, v, out, lse`` (any forward pairs with any
    backward, as unpacked)."""

    @staticmethod
    def forward(fctx, q, k, v, cfg: PackedConfig):
        if cfg.fwd == "ring":
            out, lse = packed_ring_forward(q, k, v, cfg.ctx, cfg.plan, cfg.backend,
                                           scale=cfg.scale, policy=cfg.policy,
                                           pack_kv=cfg.pack_kv)
        else:
            out, lse = packed_allgather_forward(q, k, v, cfg.ctx, cfg.plan, cfg.backend,
                                                scale=cfg.scale, heads_k_stride=cfg.stride,
                                                policy=cfg.policy)
        fctx.save_for_backward(q, k, v, out, lse)
        fctx.cfg = cfg
        if cfg.return_lse:
            fctx.mark_non_differentiable(lse)
            return out, lse
        return out

    @staticmethod
    def backward(fctx, dout, *unused):
        q, k, v, out, lse = fctx.saved_tensors
        cfg: PackedConfig = fctx.cfg
        with autocast_off(q.device):    # a backward called inside an autocast region
            if cfg.bwd == "ring":
                dq, dk, dv = packed_ring_backward(dout, q, k, v, out, lse, cfg.ctx, cfg.plan,
                                                  cfg.backend, scale=cfg.scale,
                                                  policy=cfg.policy, pack_kv=cfg.pack_kv)
            else:
                dq, dk, dv = packed_allgather_backward(
                    dout, q, k, v, out, lse, cfg.ctx, cfg.plan, cfg.backend, scale=cfg.scale,
                    heads_k_stride=cfg.stride, policy=cfg.policy, first=cfg.first,
                    last=cfg.last)
        return dq, dk, dv, None

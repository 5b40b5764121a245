"""Ring forward: K/V blocks travel one hop per step; each block's result is merged by LSE.

Step ``s`` (0 … P−1) holds the K/V shard of rank ``(rank − s) mod P`` (local KV heads only,
never expanded to the query heads). Before computing on it, the block is posted to the next
rank (:class:`~sp_attention.comm.RingComm`), so the hop overlaps the kernel calls. Which local
query chunk meets which key chunk follows from global chunk indices (:func:`.plan.ring_calls`):
with zigzag every rank does the same work per step; fully masked pairs are skipped.

Step 0 is the rank's own block: the local query and key pieces are both in ascending global
order, so the square causal mask over the local shard *is* the global mask, and one kernel call
(:func:`.plan.ring_calls`) gives every row its first result, which becomes the accumulator,
upcast once to fp32 (fp64 for fp64 inputs). Later blocks are merged by LSE with
:func:`.merge.merge_blocks_` (one Triton pass on CUDA); the result is rounded to the input
dtype once at the end. With P = 2 the single merge goes straight into step 0's output (fp32
math, one rounding: the same numbers as an fp32 accumulator rounded at the end, two passes
fewer).
Traffic: P − 1 hops of ``B·T_local·2·Hkv·D`` input-dtype elements.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..context import SPContext
from ..planning.layout import ring_source
from ..planning.softmax_plan import ring_calls
from ..precision import acc_dtype
from .backends import KernelBackend
from .merge import merge_blocks_
from .ring_buffers import KVRing

__all__ = ["ring_forward"]


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: SPContext,
                 backend: KernelBackend, *, causal: bool, scale: Optional[float],
                 pack_kv: bool = False, keep_last: bool = False):
    """Forward by ring exchange of K/V.

    Args:
        q: ``[B, T_local, H, D]``; k, v: ``[B, T_local, Hkv, D]`` (local shards, ctx's layout).

    ``pack_kv``: K and V travel packed in one buffer (:class:`.ring_buffers.KVRing`).
    ``keep_last``: also return the K/V block of the last step (rank ``rank + 1``'s, views of
    its receive buffer: no copy), where the own-block-last ring backward starts.

    Returns ``(out [B, T_local, H, D] in q.dtype, lse [B, H, T_local] fp32 (fp64 for fp64))``,
    with ``keep_last`` ``(out, lse, (k_block, v_block))`` (P = 1: None for the block).
    """
    world, rank = ctx.world_size, ctx.rank
    ls = q.shape[1] // len(ctx.leaves)
    acc = acc_dtype(q.dtype)
    if world == 1:            # the own block alone: one call (plan.ring_calls), no ring
        o, l = backend.forward(q, k, v, bool(causal), scale)
        return (o.to(q.dtype), l.to(acc)) + ((None,) if keep_last else ())
    kv = KVRing(k, v, ctx, pack_kv)
    out = lse = None
    for step in range(world):
        if step + 1 < world:
            kv.post(step)                               # the hop overlaps this step's calls
        block = kv.block(step)
        src = ring_source(rank, world, step)
        for c in ring_calls(rank, src, world, ctx.layout, bool(causal)):
            rows = slice(c.q_start * ls, c.q_stop * ls)
            n_keys = c.keys * ls
            o, l = backend.forward(q[:, rows], block[0][:, :n_keys], block[1][:, :n_keys],
                                   c.causal, scale)
            if step == 0:      # the own block: one call over every row (plan.ring_calls)
                # With one merge to come (P = 2) it goes straight into the kernel's output: the
                # merge computes in fp32 and rounds once, exactly as an fp32 accumulator
                # rounded at the end would. Otherwise an fp32 running result.
                out = o if world == 2 else o.to(acc)
                lse = l.to(acc)
            else:
                merge_blocks_(out[:, rows], lse[:, :, rows], o, l)
        if step + 1 < world:
            kv.wait()
    return (out.to(q.dtype), lse) + ((kv.block(world - 1),) if keep_last else ())

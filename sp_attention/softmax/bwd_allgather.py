"""All-gather backward: per head stride, gather K/V again, compute dq and dK/dV of every gathered
key, and reduce-scatter dK/dV asynchronously in fp32 while the next stride computes.

Unit ``i`` (KV heads ``[h0, h1)``, all key pieces):

    1. wait for unit i's K/V gather; launch unit i + 1's (double buffer)
    2. arrange the keys as in the forward (:func:`.plan.gather_plan`); one kernel backward per
       local query chunk with the saved ``out`` and the *global* ``lse``: dq of those rows and
       heads (written once: each (row, head) belongs to one call), dK/dV of the key prefix
    3. take the fp32 slot ``i % 2`` (:class:`~sp_attention.comm.AsyncReduceScatter`; this waits
       for unit i − 2's reduce-scatter, enqueued two kernels ago), zero it and add every call's
       dK/dV at the world-major place of its keys (block r = the keys rank r owns, in its shard
       order; dK and dV packed: one collective)
    4. launch the reduce-scatter of the slot into this rank's fp32 dK/dV accumulator

``bwd_head_first_stride`` / ``bwd_head_last_stride`` split the first and last stride into
narrower units (:func:`.plan.stride_widths`) so the exposed first gather and last
reduce-scatter shrink. With one local KV head there is nothing to stride over: the units are
then pieces of the sequence (each rank's zigzag chunk, or each half of a contiguous shard):
unit ``p`` gathers piece ``p`` of every rank, runs every local query piece against those keys
(dq accumulates in fp32) and reduce-scatters their dK/dV while unit ``p + 1`` computes. The
bytes moved are the same as one big unit; only the last piece's reduce-scatter is exposed.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..comm import AsyncReduceScatter
from ..context import SPContext
from ..planning.softmax_plan import gather_plan, stride_widths
from ..precision import acc_dtype
from .gather import KVGather, Unit, arrange_keys, max_unit_numel, scatter_key_grads
from .backends import KernelBackend

__all__ = ["allgather_backward", "backward_units"]


def backward_units(kv_heads: int, n_chunks: int, local_len: int, stride: int,
                   first: Optional[int], last: Optional[int]) -> tuple[list[Unit], int]:
    """``(units, split)``: the pipeline steps and the pieces per layout chunk.

    Several KV heads: head-stride units over all key pieces (``split`` 1). One KV head: one unit
    per sequence piece (zigzag: its two chunks; contiguous: two halves of the shard when its
    length is even, else a single unit).
    """
    if kv_heads > 1:
        units, h0 = [], 0
        for w in stride_widths(kv_heads, stride, first, last):
            units.append(Unit(h0, h0 + w, 0, n_chunks))
            h0 += w
        return units, 1
    split = 2 if n_chunks == 1 and local_len % 2 == 0 else 1
    pieces = n_chunks * split
    return [Unit(0, 1, p, p + 1) for p in range(pieces)], split


def allgather_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, ctx: SPContext,
                       backend: KernelBackend, *, causal: bool, scale: Optional[float],
                       heads_k_stride: int, first: Optional[int] = None,
                       last: Optional[int] = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward by head-strided K/V all-gathers and async fp32 dK/dV reduce-scatters.

    Args:
        dout, q, out: ``[B, T_local, H, D]``; k, v: ``[B, T_local, Hkv, D]``;
        lse: ``[B, H, T_local]``, the global LSE of the forward.
        heads_k_stride, first, last: see :func:`.plan.stride_widths` (checked by the caller).

    Returns ``(dq, dk, dv)`` in the dtypes of q, k, v.
    """
    b, t, h, d = q.shape
    hkv = k.shape[2]
    group = h // hkv
    n_chunks = len(ctx.leaves)
    units, split = backward_units(hkv, n_chunks, t, heads_k_stride, first, last)
    ls = t // (n_chunks * split)
    seq_pipeline = units[0].pieces < n_chunks * split
    acc = acc_dtype(q.dtype)
    # dq: each (row, head) is written by exactly one call per unit; across sequence units a
    # row gets several key pieces' contributions, accumulated in fp32.
    dq = (torch.zeros(q.shape, dtype=acc, device=q.device) if seq_pipeline
          else torch.empty(q.shape, dtype=q.dtype, device=q.device))
    dkv = torch.zeros((b, t, 2, hkv, d), dtype=acc, device=q.device)   # reduce-scatter sums
    numel = max_unit_numel(units, b, ls, d)
    gather = KVGather(k, v, ctx, ls, numel)
    scratch = torch.empty(ctx.world_size * numel, dtype=k.dtype, device=k.device)
    rs = AsyncReduceScatter(ctx, num_slots=2, dtype=acc)

    gather.start(0, units[0])
    for i, u in enumerate(units):
        recv = gather.wait(i)                                   # [P, B, n·Ls, 2, s, D]
        if i + 1 < len(units):
            gather.start(i + 1, units[i + 1])
        plan = gather_plan(ctx.rank, ctx.world_size, ctx.layout, split, u.p0, u.p1,
                           bool(causal))
        kk, vv = arrange_keys(recv, plan, ls, scratch)          # [B, L, s, D] each
        heads = slice(u.h0 * group, u.h1 * group)
        parts = []
        for c in plan.calls:
            rows = slice(c.q_start * ls, c.q_stop * ls)
            n_keys = c.keys * ls
            dq_c, dk_c, dv_c = backend.backward(
                dout[:, rows, heads], q[:, rows, heads], kk[:, :n_keys], vv[:, :n_keys],
                out[:, rows, heads], lse[:, heads, rows], c.causal, scale)
            if seq_pipeline:
                dq[:, rows, heads].add_(dq_c)
            else:
                dq[:, rows, heads].copy_(dq_c)
            parts.append((c.keys, dk_c, dv_c))
        shape = gather.shape(u)                                 # [B, n·Ls, 2, s, D]
        slot = rs.buffer(i % 2, shape, q.device)                # waits for unit i - 2's RS
        slot.zero_()
        for n_pieces, dk_c, dv_c in parts:
            scatter_key_grads(slot, plan, ls, n_pieces, dk_c, dv_c)
        dest = dkv[:, u.p0 * ls:u.p1 * ls, :, u.h0:u.h1]
        rs.launch(i % 2, shape, q.device, dest)
    rs.drain_all()
    return dq.to(q.dtype), dkv[:, :, 0].to(k.dtype), dkv[:, :, 1].to(v.dtype)

"""All-gather schedules for packed documents: per head stride, gather every rank's travel
window of K/V; backward reduce-scatters the windows' dK/dV asynchronously in fp32.

Arithmetic: :mod:`.packed_plan`; buffers: :class:`.gather.KVGather` (double-buffered gathers
of a few KV heads, here of each rank's travel window) and
:class:`~sp_attention.comm.AsyncReduceScatter` (two fp32 slots). The own block (all heads) is
computed while the first gather is in flight. Then per unit (KV heads ``[h0, h1)``, the
strides with the optional first/last splits of :func:`.plan.stride_widths`): the calls of each
source rank with pairs against its gathered window, for the unit's query heads.

Unlike the unpacked all-gather forward (one call per query chunk, no merge), a packed row's
query of a crossing document sees keys of several ranks, each its own call: results merge by
LSE in fp32 as in the ring. Backward: dq accumulates in fp32; each source's dK/dV lands in its
block of the world-major slot, and the slot's reduce-scatter brings every rank the sum for its
own window while the next unit computes.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..comm import AsyncReduceScatter
from ..context import SPContext
from ..planning.packing import PackingPlan
from ..planning.softmax_packed import CallPolicy, cross_rows, step_calls, travel
from ..planning.softmax_plan import stride_widths
from ..precision import acc_dtype
from .gather import KVGather, Unit, max_unit_numel
from .merge import merge_blocks_
from .packed_ring import RowWindow, accumulator_dtype, own_backward, own_forward
from .varlen import call_backward, call_forward

__all__ = ["packed_allgather_forward", "packed_allgather_backward"]


def _sources(plan: PackingPlan, rank: int, policy: CallPolicy) -> list[tuple[int, tuple]]:
    return [(src, calls) for src in range(plan.world_size) if src != rank
            for calls in (step_calls(plan, rank, src, policy),) if calls]


def _units(hkv: int, stride: int, first, last) -> list[Unit]:
    units, h0 = [], 0
    for w in (stride_widths(hkv, stride, first, last) if hkv > 1 else [1]):
        units.append(Unit(h0, h0 + w, 0, 1))
        h0 += w
    return units


def packed_allgather_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             ctx: SPContext, plan: PackingPlan, backend, *,
                             scale: Optional[float], heads_k_stride: int, policy: CallPolicy
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed causal attention by head-strided all-gathers of the travel windows.

    Args: as :func:`.packed_ring.packed_ring_forward`; ``heads_k_stride`` divides ``Hkv``.
    """
    rank = ctx.rank
    b, t, h, d = q.shape
    hkv = k.shape[2]
    group = h // hkv
    tr = travel(plan)
    if ctx.world_size == 1 or tr.length == 0:
        return own_forward(q, k, v, plan, rank, backend, scale, policy, q.dtype)
    ts = tr.starts[rank]
    units = _units(hkv, heads_k_stride, None, None)
    gather = KVGather(k[:, ts:ts + tr.length], v[:, ts:ts + tr.length], ctx, tr.length,
                      max_unit_numel(units, b, tr.length, d))
    sources = _sources(plan, rank, policy)
    gather.start(0, units[0])
    out, lse = own_forward(q, k, v, plan, rank, backend, scale, policy, q.dtype)
    acc = RowWindow(out, *cross_rows(plan, rank, policy),
                    accumulator_dtype(q.dtype, ctx.world_size))
    for i, u in enumerate(units):
        recv = gather.wait(i)                                   # [P, B, TL, 2, s, D]
        if i + 1 < len(units):
            gather.start(i + 1, units[i + 1])
        heads = slice(u.h0 * group, u.h1 * group)
        for src, calls in sources:
            kb, vb = recv[src, :, :, 0], recv[src, :, :, 1]    # [B, TL, s, D]
            for c in calls:
                rows, keys = slice(c.q_start, c.q_stop), slice(c.k_start, c.k_stop)
                o, l = call_forward(backend, q[:, rows, heads], kb[:, keys], vb[:, keys], c,
                                    scale)
                merge_blocks_(acc.acc[:, acc.rows(c.q_start, c.q_stop), heads],
                              lse[:, heads, rows], o, l)
    return acc.done(), lse


def packed_allgather_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                              ctx: SPContext, plan: PackingPlan, backend, *,
                              scale: Optional[float], heads_k_stride: int, policy: CallPolicy,
                              first: Optional[int] = None, last: Optional[int] = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of the packed schedules by head-strided gathers and async fp32 dK/dV
    reduce-scatters; ``first`` / ``last`` split the first / last stride."""
    rank = ctx.rank
    b, t, h, d = q.shape
    hkv = k.shape[2]
    group = h // hkv
    acc = acc_dtype(q.dtype)
    tr = travel(plan)
    if ctx.world_size == 1 or tr.length == 0:
        return own_backward(dout, q, k, v, out, lse, plan, rank, backend, scale, policy,
                            (q.dtype, k.dtype, v.dtype))
    ts, tl = tr.starts[rank], tr.length
    units = _units(hkv, heads_k_stride, first, last)
    gather = KVGather(k[:, ts:ts + tl], v[:, ts:ts + tl], ctx, tl,
                      max_unit_numel(units, b, tl, d))
    rs = AsyncReduceScatter(ctx, num_slots=2, dtype=acc)
    dkv = torch.zeros((b, tl, 2, hkv, d), dtype=acc, device=k.device)   # RS destination
    sources = _sources(plan, rank, policy)
    gather.start(0, units[0])
    dq, dk, dv = own_backward(dout, q, k, v, out, lse, plan, rank, backend, scale, policy,
                              (q.dtype, k.dtype, v.dtype))
    dq_w = RowWindow(dq, *cross_rows(plan, rank, policy),
                     accumulator_dtype(q.dtype, ctx.world_size))
    for i, u in enumerate(units):
        recv = gather.wait(i)
        if i + 1 < len(units):
            gather.start(i + 1, units[i + 1])
        heads = slice(u.h0 * group, u.h1 * group)
        shape = gather.shape(u)                                 # [B, TL, 2, s, D]
        slot = rs.buffer(i % 2, shape, q.device)                # waits for unit i - 2's RS
        slot.zero_()
        for src, calls in sources:
            kb, vb = recv[src, :, :, 0], recv[src, :, :, 1]
            for c in calls:
                rows, keys = slice(c.q_start, c.q_stop), slice(c.k_start, c.k_stop)
                g = call_backward(backend, dout[:, rows, heads], q[:, rows, heads],
                                  kb[:, keys], vb[:, keys], out[:, rows, heads],
                                  lse[:, heads, rows], c, scale)
                dq_w.acc[:, dq_w.rows(c.q_start, c.q_stop), heads].add_(g[0])
                slot[src, :, keys, 0].add_(g[1])
                slot[src, :, keys, 1].add_(g[2])
        rs.launch(i % 2, shape, q.device, dkv[:, :, :, u.h0:u.h1])
    rs.drain_all()
    for x, i in ((dk, 0), (dv, 1)):     # the window's sum over ranks, added in fp32
        w = RowWindow(x, ts, ts + tl, acc)
        w.acc.add_(dkv[:, :, i])
        w.done()
    return dq_w.done(), dk, dv

"""Ring schedules for packed documents: forward (K/V windows travel, LSE merge) and backward
(K/V windows travel again, each block's dK/dV goes straight home).

Arithmetic: :mod:`.packed_plan`. Step 0 is the own block: the rank's document groups as one
varlen causal problem (dense calls for long documents), computed while the first hop is in
flight. Only each rank's **travel window** moves (the keys of crossing documents that a query
elsewhere can see; a fixed length for all ranks, padded), and the ring stops after the last
step any rank has work in (:func:`.packed_plan.active_steps`): a plan whose documents cross
only neighbouring ranks makes one hop. Step ``s`` holds the window of rank ``(r − s) mod P``;
its calls are full (non-causal) blocks, merged by LSE in fp32 (:func:`.merge.merge_blocks_`).

Accumulators: the own block's results are written in the input dtype, as on one GPU; only the
rows that take more — the queries of cross-rank calls (:func:`.packed_plan.cross_rows`, a short
prefix of a zigzag shard) for out and dq, the travel window for dK/dV — are accumulated in fp32
(:class:`RowWindow`) and rounded once at the end. The numbers are those of fp32 accumulators
over the whole shard (a row with one contribution is that contribution, rounded once either
way), without their passes: at 32K tokens per GPU with Llama-3-8B heads, ~2.5 GiB of fp32
copies and casts a forward + backward.

Backward: the same hops; at step ``s`` the rank's dK/dV for the block it holds (fp32, the
window's rows, one ``[2, …]`` message) is sent directly to the block's owner ``r − s`` while it
receives its own window's from ``r + s`` — one exchange per step, skipped on both ends when the plan says the
sender has no pair with that block. dq accumulates locally in fp32.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..comm import p2p_exchange
from ..context import SPContext
from ..planning.packing import PackingPlan
from ..planning.softmax_packed import (CallPolicy, active_steps, cross_rows, own_calls,
                                       step_calls, step_pairs, travel)
from ..precision import acc_dtype
from .merge import merge_blocks_
from .ring_buffers import KVRing
from .varlen import call_backward, call_forward

__all__ = ["packed_ring_forward", "packed_ring_backward", "own_forward", "own_backward",
           "accumulator_dtype", "RowWindow"]


def _whole(calls: tuple, t: int) -> bool:
    """One call over the whole shard (no padding): its results are the own block's."""
    return len(calls) == 1 and calls[0].q_start == 0 and calls[0].q_stop == t


def _adopt(x: torch.Tensor, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A kernel's fresh result (never an input's storage) as a contiguous ``shape`` buffer of
    ``dtype``: itself when it is one already, else converted."""
    return x.reshape(shape).to(dtype).contiguous()


def own_forward(q, k, v, plan: PackingPlan, rank: int, backend, scale, policy: CallPolicy,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The own block: fresh ``(out in dtype, lse fp32/fp64)``, padding rows 0 / −inf. The
    own calls cover every other row exactly once (the document groups tile them); one call
    over the whole shard hands over its results as they are (no copies)."""
    b, t, h, d = q.shape
    calls = own_calls(plan, rank, policy)
    if _whole(calls, t):
        o, l = call_forward(backend, q, k, v, calls[0], scale)
        return _adopt(o, (b, t, h, d), dtype), _adopt(l, (b, h, t), acc_dtype(q.dtype))
    out = torch.empty((b, t, h, d), dtype=dtype, device=q.device)
    lse = torch.empty((b, h, t), dtype=acc_dtype(q.dtype), device=q.device)
    n = plan.real_len(rank)
    out[:, n:].zero_()
    lse[:, :, n:].fill_(float("-inf"))
    for c in calls:
        rows = slice(c.q_start, c.q_stop)
        o, l = call_forward(backend, q[:, rows], k[:, rows], v[:, rows], c, scale)
        out[:, rows].copy_(o)
        lse[:, :, rows].copy_(l)
    return out, lse


def own_backward(dout, q, k, v, out, lse, plan: PackingPlan, rank: int, backend, scale,
                 policy: CallPolicy, dtypes: tuple) -> tuple[torch.Tensor, ...]:
    """The own block's fresh ``(dq, dk, dv)`` in ``dtypes``, zero at padding (the own calls
    cover every other query row and key exactly once; one call over the whole shard hands over
    its results as they are)."""
    calls = own_calls(plan, rank, policy)
    if _whole(calls, q.shape[1]):
        res = call_backward(backend, dout, q, k, v, out, lse, calls[0], scale)
        return tuple(_adopt(r, x.shape, dt) for r, x, dt in zip(res, (q, k, v), dtypes))
    n = plan.real_len(rank)
    grads = []
    for x, dt in zip((q, k, v), dtypes):
        g = torch.empty(x.shape, dtype=dt, device=x.device)
        g[:, n:].zero_()
        grads.append(g)
    for c in calls:
        rows = slice(c.q_start, c.q_stop)
        res = call_backward(backend, dout[:, rows], q[:, rows], k[:, rows], v[:, rows],
                            out[:, rows], lse[:, :, rows], c, scale)
        for g, r in zip(grads, res):
            g[:, rows].copy_(r)
    return tuple(grads)


def accumulator_dtype(dtype: torch.dtype, world: int) -> torch.dtype:
    """Accumulators of the packed schedules: with P = 2 a row (key) gets at most one
    contribution besides its own block's, added in fp32 arithmetic into the input dtype and
    rounded once (the numbers of an fp32 accumulator rounded at the end, without its passes);
    beyond, fp32 (fp64 for fp64)."""
    return dtype if world == 2 else acc_dtype(dtype)


class RowWindow:
    """Rows ``[lo, hi)`` of ``x [B, T, ...]`` accumulated in ``dtype``: a view of ``x`` when the
    dtypes agree, else a copy in ``dtype`` that :meth:`done` rounds back into ``x`` once.
    Index it with :meth:`rows` (a slice of ``x``'s rows inside the window)."""

    def __init__(self, x: torch.Tensor, lo: int, hi: int, dtype: torch.dtype):
        self.x, self.lo, self.hi = x, lo, hi
        view = x[:, lo:hi]
        self.acc = view if view.dtype == dtype else view.to(dtype)

    def rows(self, start: int, stop: int) -> slice:
        if not self.lo <= start <= stop <= self.hi:
            raise AssertionError(f"rows [{start}, {stop}) outside the window [{self.lo}, "
                                 f"{self.hi})")
        return slice(start - self.lo, stop - self.lo)

    def done(self) -> torch.Tensor:
        if self.acc.dtype != self.x.dtype and self.hi > self.lo:
            self.x[:, self.lo:self.hi].copy_(self.acc)
        return self.x


def _window(x: torch.Tensor, start: int, length: int) -> torch.Tensor:
    return x[:, start:start + length]


def packed_ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: SPContext,
                        plan: PackingPlan, backend, *, scale: Optional[float],
                        policy: CallPolicy, pack_kv: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed causal attention by ring exchange of the travel windows.

    Args: q ``[B, L, H, D]``, k, v ``[B, L, Hkv, D]``: this rank's shard as ``plan`` placed it.
    Returns ``(out [B, L, H, D] in q.dtype, lse [B, H, L] fp32/fp64)``; padding rows 0 / −inf.
    """
    world, rank = ctx.world_size, ctx.rank
    steps = active_steps(plan) if world > 1 else 0
    if steps == 0:            # no document crosses ranks: the own block is the result
        return own_forward(q, k, v, plan, rank, backend, scale, policy, q.dtype)
    tr = travel(plan)
    kv = KVRing(_window(k, tr.starts[rank], tr.length), _window(v, tr.starts[rank], tr.length),
                ctx, pack_kv)
    kv.post(0)                                      # the first hop overlaps the own block
    out, lse = own_forward(q, k, v, plan, rank, backend, scale, policy, q.dtype)
    acc = RowWindow(out, *cross_rows(plan, rank, policy), accumulator_dtype(q.dtype, world))
    kv.wait()
    for step in range(1, steps + 1):
        if step < steps:
            kv.post(step)
        kb, vb = kv.block(step)
        for c in step_calls(plan, rank, (rank - step) % world, policy):
            rows, keys = slice(c.q_start, c.q_stop), slice(c.k_start, c.k_stop)
            o, l = call_forward(backend, q[:, rows], kb[:, keys], vb[:, keys], c, scale)
            merge_blocks_(acc.acc[:, acc.rows(c.q_start, c.q_stop)], lse[:, :, rows], o, l)
        if step < steps:
            kv.wait()
    return acc.done(), lse


def packed_ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                         ctx: SPContext, plan: PackingPlan, backend, *,
                         scale: Optional[float], policy: CallPolicy, pack_kv: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`packed_ring_forward` (global ``out`` and ``lse``); gradients in the
    dtypes of q, k, v, zero at padding."""
    world, rank = ctx.world_size, ctx.rank
    acc = acc_dtype(q.dtype)
    steps = active_steps(plan) if world > 1 else 0
    if steps == 0:
        return own_backward(dout, q, k, v, out, lse, plan, rank, backend, scale, policy,
                            (q.dtype, k.dtype, v.dtype))
    tr = travel(plan)
    ts = tr.starts[rank]
    kv = KVRing(_window(k, ts, tr.length), _window(v, ts, tr.length), ctx, pack_kv)
    kv.post(0)
    dq, dk, dv = own_backward(dout, q, k, v, out, lse, plan, rank, backend, scale, policy,
                              (q.dtype, k.dtype, v.dtype))
    dq_w = RowWindow(dq, *cross_rows(plan, rank, policy), accumulator_dtype(q.dtype, world))
    dk_w, dv_w = (RowWindow(x, ts, ts + tr.length, accumulator_dtype(x.dtype, world))
                  for x in (dk, dv))
    kv.wait()
    shape = (k.shape[0], tr.length) + tuple(k.shape[2:])
    pending: list = []                    # (works, received, sent) of the previous step
    for step in range(1, steps + 1):
        if step < steps:
            kv.post(step)
        kb, vb = kv.block(step)
        src, dst = (rank - step) % world, (rank + step) % world
        send = None
        calls = step_calls(plan, rank, src, policy)
        if calls:                         # dK and dV of the held window as one message
            send = torch.zeros((2,) + shape, dtype=acc, device=k.device)
        for c in calls:
            rows, keys = slice(c.q_start, c.q_stop), slice(c.k_start, c.k_stop)
            g = call_backward(backend, dout[:, rows], q[:, rows], kb[:, keys], vb[:, keys],
                              out[:, rows], lse[:, :, rows], c, scale)
            dq_w.acc[:, dq_w.rows(c.q_start, c.q_stop)].add_(g[0])
            send[0][:, keys].add_(g[1])
            send[1][:, keys].add_(g[2])
        _land(pending, dk_w.acc, dv_w.acc)   # the previous step's arrivals, behind these kernels
        recv = None
        if step_pairs(plan, dst, rank):   # rank dst had work on our window at this step
            recv = torch.empty((2,) + shape, dtype=acc, device=k.device)
        works = p2p_exchange([] if send is None else [(send, src)],
                             [] if recv is None else [(recv, dst)], ctx)
        pending = [(works, recv, send)]   # send stays alive until its hop is done
        if step < steps:
            kv.wait()
    _land(pending, dk_w.acc, dv_w.acc)
    return dq_w.done(), dk_w.done(), dv_w.done()


def _land(pending: list, dk: torch.Tensor, dv: torch.Tensor) -> None:
    """Wait for the pending exchanges and add what arrived for this rank's travel window
    (``dk``, ``dv``: the window's accumulators)."""
    for works, recv, _ in pending:
        for w in works:
            w.wait()
        if recv is not None:
            dk.add_(recv[0])
            dv.add_(recv[1])
    pending.clear()

"""Ring backward: K/V travel as in the ring forward, and fp32 dK/dV accumulators travel with
them (ring-flash-attention's scheme).

At step ``s`` a rank holds the K/V block of rank ``(rank − s) mod P`` and the dK/dV
accumulator of that same block, which the previous rank filled at step ``s − 1``. It adds its
own contribution and passes the accumulator on; after the last step one more hop brings every
accumulator home (P hops of ``B·T_local·2·Hkv·D`` fp32; K/V take P − 1 hops). The K/V hop of
the next step and the accumulator hop of this step overlap the kernel calls. dq stays local
and accumulates in fp32. The kernel backward uses the forward's final ``out`` and global
``lse`` for every block, which makes each block's gradient exact on its own.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..comm import RingComm
from ..context import SPContext
from .fwd_ring import pack_kv
from .kernels import KernelBackend
from .merge import acc_dtype
from .plan import ring_calls

__all__ = ["ring_backward"]


def ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, ctx: SPContext, backend: KernelBackend,
                  *, causal: bool, scale: Optional[float]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward by ring exchange of K/V and of fp32 dK/dV accumulators.

    Args:
        dout, q, out: ``[B, T_local, H, D]``; k, v: ``[B, T_local, Hkv, D]``;
        lse: ``[B, H, T_local]``, the global LSE of the forward.

    Returns ``(dq, dk, dv)`` in the dtypes of q, k, v.
    """
    world, rank = ctx.world_size, ctx.rank
    ls = q.shape[1] // len(ctx.leaves)
    acc = acc_dtype(q.dtype)
    # Step 0 (own block) writes every query row exactly once (plan.ring_calls): no zero fill.
    dq = torch.empty(q.shape, dtype=acc, device=q.device)
    kv_ring = RingComm(ctx) if world > 1 else None
    dkv_ring = RingComm(ctx) if world > 1 else None
    kv_bufs = pack_kv(k, v, ctx) if world > 1 else []
    block = (kv_bufs[0][0], kv_bufs[0][1]) if world > 1 else (k, v)
    # [2, B, T_local, Hkv, D]: accumulator of the block held now, and the one arriving
    dkv_bufs = [torch.empty((2,) + tuple(k.shape), dtype=acc, device=k.device)
                for _ in range(2 if world > 1 else 1)]
    dkv = dkv_bufs[0].zero_()
    nxt = dkv_in = None
    for step in range(world):
        if step + 1 < world:
            nxt = kv_ring.send_recv(kv_bufs[step % 2], kv_bufs[(step + 1) % 2])
            kv_ring.commit()
        parts = []
        src = (rank - step) % world
        for c in ring_calls(rank, src, world, ctx.layout, bool(causal)):
            rows = slice(c.q_start * ls, c.q_stop * ls)
            n_keys = c.keys * ls
            dq_c, dk_c, dv_c = backend.backward(
                dout[:, rows], q[:, rows], block[0][:, :n_keys], block[1][:, :n_keys],
                out[:, rows], lse[:, :, rows], c.causal, scale)
            if step == 0:
                dq[:, rows].copy_(dq_c)
            else:
                dq[:, rows].add_(dq_c)
            parts.append((n_keys, dk_c, dv_c))
        if step > 0:
            dkv_ring.wait()                      # the accumulator of the block we hold
            dkv = dkv_in
        for n_keys, dk_c, dv_c in parts:
            dkv[0, :, :n_keys].add_(dk_c)
            dkv[1, :, :n_keys].add_(dv_c)
        if step + 1 < world:
            kv_ring.wait()
            block = (nxt[0], nxt[1])
        if world > 1:
            dkv_in = dkv_ring.send_recv(dkv, dkv_bufs[(step + 1) % 2])
            dkv_ring.commit()
    if world > 1:
        dkv_ring.wait()                          # our own block's sum is home
        dkv = dkv_in
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)

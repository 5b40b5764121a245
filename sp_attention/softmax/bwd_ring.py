"""Ring backward: K/V travel as in the ring forward, and fp32 dK/dV accumulators travel with
them (ring-flash-attention's scheme).

At step ``s`` a rank holds the K/V block of rank ``(rank − s) mod P`` and the dK/dV
accumulator of that same block, which the previous rank filled at step ``s − 1``. It adds its
own contribution and passes the accumulator on; after the last step one more hop brings every
accumulator home (P hops of ``B·T_local·2·Hkv·D`` fp32; K/V take P − 1 hops). The K/V hop of
the next step and the accumulator hop of this step overlap the kernel calls.

The last hop would be exposed: nothing is left to compute behind it. So the accumulators are
kept grouped by KV-head group (``[G, 2, B, T, Hkv/G, D]``, each group contiguous), the last
step runs its calls one head group at a time, and group ``g`` travels home while group
``g + 1`` computes; only the last group's hop (1/G of the bytes) is exposed.

Step 0 is the own block as one square causal call (:func:`.plan.ring_calls`), whose dq, dk, dv
start the accumulators without a zero fill. dq stays local: with P = 2 every (row, head) gets
exactly one more contribution, added in fp32 and rounded once into the input dtype; with
P > 2 it accumulates in fp32. The kernel backward uses the forward's final ``out`` and global
``lse`` for every block, which makes each block's gradient exact on its own.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..comm import RingComm, p2p_exchange
from ..context import SPContext
from .fwd_ring import pack_kv
from .kernels import KernelBackend
from .merge import acc_dtype
from .plan import ring_calls

__all__ = ["ring_backward", "last_step_groups"]

# At most this many head groups in the last step: 1/G of the final hop is exposed, while each
# group's calls keep H/G query heads (8 of Llama-3-8B's 32): still enough tiles for the GPU.
_LAST_STEP_GROUPS = 4


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
    if world == 1:            # the own block alone: one call (plan.ring_calls), no ring
        dq, dk, dv = backend.backward(dout, q, k, v, out, lse, bool(causal), scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    b, t, hkv, d = k.shape
    groups = last_step_groups(hkv)
    hg, hq = hkv // groups, q.shape[2] // groups
    kv_ring, dkv_ring = RingComm(ctx), RingComm(ctx)
    kv_bufs = pack_kv(k, v, ctx)
    block = (kv_bufs[0][0], kv_bufs[0][1])
    # the accumulator of the block held now, and the one arriving; [G, 2, B, T, Hkv/G, D]
    dkv_bufs = [torch.empty((groups, 2, b, t, hg, d), dtype=acc, device=k.device)
                for _ in range(2)]

    def heads(x: torch.Tensor) -> torch.Tensor:     # [2, B, T, G, Hkv/G, D] view
        return x.permute(1, 2, 3, 0, 4, 5)

    def by_group(x: torch.Tensor) -> torch.Tensor:  # [B, T, Hkv, D] -> [B, T, G, Hkv/G, D]
        return x.unflatten(2, (groups, hg))

    dq = dkv = dkv_in = nxt = None
    for step in range(world):
        src = (rank - step) % world
        calls = ring_calls(rank, src, world, ctx.layout, bool(causal))
        if step == world - 1:
            break                                   # the last step runs by head group below
        kv_ring.send_recv(kv_bufs[step % 2], kv_bufs[(step + 1) % 2])
        nxt = kv_bufs[(step + 1) % 2]
        kv_ring.commit()
        parts = []
        for c in calls:
            rows = slice(c.q_start * ls, c.q_stop * ls)
            n_keys = c.keys * ls
            dq_c, dk_c, dv_c = backend.backward(
                dout[:, rows], q[:, rows], block[0][:, :n_keys], block[1][:, :n_keys],
                out[:, rows], lse[:, :, rows], c.causal, scale)
            if step == 0:      # the own block: one call over every row and key
                dq = dq_c.to(acc) if world > 2 else dq_c
                dkv = dkv_bufs[0]
                heads(dkv)[0].copy_(by_group(dk_c))
                heads(dkv)[1].copy_(by_group(dv_c))
            else:
                dq[:, rows].add_(dq_c)
                parts.append((n_keys, dk_c, dv_c))
        if step > 0:
            dkv_ring.wait()                         # the accumulator of the block we hold
            dkv = dkv_in
            for n_keys, dk_c, dv_c in parts:
                heads(dkv)[0][:, :n_keys].add_(by_group(dk_c))
                heads(dkv)[1][:, :n_keys].add_(by_group(dv_c))
        kv_ring.wait()
        block = (nxt[0], nxt[1])
        dkv_in = dkv_ring.send_recv(dkv, dkv_bufs[(step + 1) % 2])
        dkv_ring.commit()
    # Last step: block of rank + 1, whose accumulator then goes home to it, one head group at
    # a time behind the next group's kernels.
    home = dkv_bufs[world % 2]
    works = []
    for g in range(groups):
        hs, ks = slice(g * hq, (g + 1) * hq), slice(g * hg, (g + 1) * hg)
        grads = []
        for c in calls:
            rows = slice(c.q_start * ls, c.q_stop * ls)
            n_keys = c.keys * ls
            grads.append((rows, n_keys) + tuple(backend.backward(
                dout[:, rows, hs], q[:, rows, hs], block[0][:, :n_keys, ks],
                block[1][:, :n_keys, ks], out[:, rows, hs], lse[:, hs, rows], c.causal,
                scale)))
        if g == 0:
            dkv_ring.wait()                         # enqueued after group 0's kernels
            dkv = dkv_in
        for rows, n_keys, dq_c, dk_c, dv_c in grads:
            dq[:, rows, hs].add_(dq_c)
            dkv[g, 0, :, :n_keys].add_(dk_c)
            dkv[g, 1, :, :n_keys].add_(dv_c)
        works += p2p_exchange([(dkv[g], (rank + 1) % world)], [(home[g], (rank - 1) % world)],
                              ctx)
    for w in works:
        w.wait()                                    # our own block's sums are home
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    by_group(dk).copy_(heads(home)[0])
    by_group(dv).copy_(heads(home)[1])
    return dq.to(q.dtype), dk, dv


def last_step_groups(kv_heads: int, most: int = _LAST_STEP_GROUPS) -> int:
    """Number of KV-head groups the last ring step is split into: the largest divisor of
    ``kv_heads`` up to ``most`` (only the last group's accumulator hop stays exposed)."""
    return max(g for g in range(1, min(most, kv_heads) + 1) if kv_heads % g == 0)

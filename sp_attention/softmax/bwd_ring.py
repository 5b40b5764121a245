"""Ring backward: K/V travel as in the ring forward; the dK/dV accumulator of each block travels
with it from its first visitor to its owner.

At step ``s`` a rank holds the K/V block of rank ``src = (rank − s) mod P``. Step 0 is its own
block: one square causal call, whose dK/dV **stay home**. From step 1 on, a rank's contribution
to block ``src`` joins that block's accumulator: the first visitor (step 1) creates it, every
later visitor receives it from the previous rank, adds its contribution and passes it on, and
the last visitor (step P − 1, rank ``src − 1``) sends it home, where it is added to the owner's
own contribution in fp32 arithmetic and rounded once. Every send goes to the next rank and
every receive comes from the previous one (ring-flash-attention's pattern), with P − 1
accumulator hops instead of P: the owner's contribution never travels.

Precision: an accumulator holding exactly one kernel output (the first visitor's, when its
step is one kernel call) travels in the kernel's dtype, which is lossless: the kernel rounded
it to that dtype and it is upcast wherever it is summed. An accumulator holding a sum travels
in fp32 (fp64 for fp64 inputs). Which dtype each hop carries is pure rank arithmetic
(:func:`hop_dtypes`), so both ends of a hop agree without a message. With P = 2 the only
accumulator hop is a block's first: the owner receives the peer's contribution in the input
dtype, a quarter of the bytes of the previous scheme (an fp32 accumulator out and back).

The last hop has nothing left to hide behind. Splitting the last step by KV-head group (so each
group's accumulator goes home behind the next group's kernels) was measured on 2× H200
(2026-11-23, `benchmarks/softmax_pieces.py`): the smaller calls cost 0.2–0.8 ms per step, more
than the 16-bit hop they would hide, so the step runs whole.

dq stays local: with P = 2 every (row, head) gets exactly one more contribution, added in fp32
arithmetic and rounded once into the input dtype; with P > 2 it accumulates in fp32. The kernel
backward uses the forward's final ``out`` and global ``lse`` for every block, which makes each
block's gradient exact on its own.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch

from ..comm import RingComm, p2p_exchange
from ..context import SPContext
from ..layout import ring_neighbors, ring_source
from .backends import KernelBackend
from ..precision import acc_dtype
from .plan import ring_calls
from .ring_buffers import pack_kv

__all__ = ["ring_backward", "hop_dtypes"]


@lru_cache(maxsize=None)
def _single_output_hops(world: int, layout: str, causal: bool) -> tuple[tuple[bool, ...], ...]:
    """``single[r][s - 1]``: whether the accumulator rank ``r`` sends after step ``s`` holds at
    most one kernel output (created at step 1 from zero or one call, or passed on untouched)."""
    single: dict = {}
    for s in range(1, world):
        for r in range(world):
            n = len(ring_calls(r, ring_source(r, world, s), world, layout, causal))
            prev = ring_neighbors(r, world)[0]
            single[r, s] = n <= 1 if s == 1 else (single[prev, s - 1] and n == 0)
    return tuple(tuple(single[r, s] for s in range(1, world)) for r in range(world))


def hop_dtypes(rank: int, world: int, layout: str, causal: bool, kernel_dtype: torch.dtype,
               acc: torch.dtype) -> tuple[list[torch.dtype], list[torch.dtype]]:
    """``(sent, got)``: ``sent[s - 1]`` is the dtype of the accumulator this rank sends after
    step ``s`` (1 … P−1), ``got[s - 1]`` the dtype of the one the previous rank sends after its
    step ``s`` (received before this rank's step ``s + 1``, or, for ``s = P − 1``, this rank's
    own block coming home). ``kernel_dtype`` for one kernel output, ``acc`` for a sum."""
    single = _single_output_hops(world, layout, causal)
    sent = [kernel_dtype if x else acc for x in single[rank]]
    got = [kernel_dtype if x else acc for x in single[ring_neighbors(rank, world)[0]]]
    return sent, got


def kernel_grad_dtype(backend: KernelBackend, dtype: torch.dtype) -> torch.dtype:
    """The dtype of a backend's dK/dV for one non-causal call (every ring step after the
    first): the input dtype for the CUDA kernels with native GQA (one kernel, no partial
    sums inside the backend); fp32 (fp64) for the math backend."""
    if backend.name != "math" and backend.native_gqa:
        return dtype
    return acc_dtype(dtype)


def ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, ctx: SPContext, backend: KernelBackend,
                  *, causal: bool, scale: Optional[float]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward by ring exchange of K/V and of the blocks' dK/dV accumulators.

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
    sent, got = hop_dtypes(rank, world, ctx.layout, bool(causal),
                           kernel_grad_dtype(backend, q.dtype), acc)
    kv_ring, acc_ring = RingComm(ctx), RingComm(ctx)
    prev_rank, next_rank = ring_neighbors(rank, world)
    kv_bufs = pack_kv(k, v, ctx)

    def new_acc(dtype: torch.dtype) -> torch.Tensor:     # [2, B, T, Hkv, D]: dK and dV
        return torch.empty((2,) + tuple(k.shape), dtype=dtype, device=k.device)

    # Step 0: the own block, one square causal call; its dK/dV stay home.
    nxt = kv_ring.send_recv(kv_bufs[0], kv_bufs[1])
    kv_ring.commit()
    dq, dk_home, dv_home = backend.backward(dout, q, k, v, out, lse, bool(causal), scale)
    if world > 2:
        dq = dq.to(acc)
    kv_ring.wait()
    block, carry, works = (nxt[0], nxt[1]), None, []
    for step in range(1, world):
        src = ring_source(rank, world, step)
        last = step == world - 1
        if not last:          # the next block travels while this one computes
            nxt = kv_ring.send_recv(kv_bufs[step % 2], kv_bufs[(step + 1) % 2])
            kv_ring.commit()
        grads = []
        for c in ring_calls(rank, src, world, ctx.layout, bool(causal)):
            rows = slice(c.q_start * ls, c.q_stop * ls)
            n_keys = c.keys * ls
            dq_c, dk_c, dv_c = backend.backward(
                dout[:, rows], q[:, rows], block[0][:, :n_keys], block[1][:, :n_keys],
                out[:, rows], lse[:, :, rows], c.causal, scale)
            dq[:, rows].add_(dq_c)
            grads.append((n_keys, dk_c, dv_c))
        if step >= 2:
            acc_ring.wait()                         # enqueued behind this step's kernels
        acc_buf = _join(carry, grads, sent[step - 1], acc, new_acc)
        if last:              # the block's accumulator goes home; ours arrives
            home = new_acc(got[-1])
            works = p2p_exchange([(acc_buf, next_rank)], [(home, prev_rank)], ctx)
        else:
            carry = acc_ring.send_recv(acc_buf, new_acc(got[step - 1]))
            acc_ring.commit()
            kv_ring.wait()
            block = (nxt[0], nxt[1])
    for w in works:
        w.wait()
    # the owner's contribution plus everyone else's: fp32 arithmetic (an in-place add computes
    # in the promoted dtype), one kernel per tensor, rounded once into the kernel's dtype
    dk = dk_home.add_(home[0]).to(k.dtype)
    dv = dv_home.add_(home[1]).to(v.dtype)
    return dq.to(q.dtype), dk, dv


def _join(carry: Optional[torch.Tensor], grads: list, dtype: torch.dtype, acc: torch.dtype,
          new_acc) -> torch.Tensor:
    """The accumulator this step sends on, in ``dtype`` (from :func:`hop_dtypes`): the received
    one passed on untouched when this rank adds nothing; a new one holding this step's single
    kernel output as it is (zero past the keys it covers); else the ``acc``-dtype sum."""
    if not grads:
        return carry if carry is not None else new_acc(dtype).zero_()
    if carry is None and len(grads) == 1 and dtype != acc:
        n_keys, dk_c, dv_c = grads[0]
        buf = new_acc(dtype)
        buf[0, :, :n_keys].copy_(dk_c)
        buf[1, :, :n_keys].copy_(dv_c)
        if n_keys < buf.shape[2]:
            buf[:, :, n_keys:].zero_()
        return buf
    buf = new_acc(acc).zero_() if carry is None else carry.to(acc)
    for n_keys, dk_c, dv_c in grads:
        buf[0, :, :n_keys].add_(dk_c)
        buf[1, :, :n_keys].add_(dv_c)
    return buf

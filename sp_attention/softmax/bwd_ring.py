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

What travels: ``(dK, dV)`` as two messages, covering only the block's leading key rows that
some visitor touched (every call reads a prefix of the block's keys, :func:`hop_chunks`), so
zeros never travel and a hop nobody contributed to is skipped (contiguous causal: the
accumulator of the last rank's block at step 1). A single kernel output is sent as the kernel
wrote it, with no copy into a buffer.

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

from ..comm import p2p_exchange
from ..context import SPContext
from ..planning.layout import ring_neighbors, ring_source
from ..planning.softmax_plan import ring_calls
from ..precision import acc_dtype
from .backends import KernelBackend
from .ring_buffers import KVRing

__all__ = ["ring_backward", "hop_dtypes", "hop_chunks"]


@lru_cache(maxsize=256)     # per (group size, layout, causal) a process meets
def _acc_hops(world: int, layout: str, causal: bool) -> tuple[tuple[tuple[bool, int], ...], ...]:
    """``hops[r][s - 1] = (single, chunks)`` of the accumulator rank ``r`` sends after step
    ``s``: whether it holds at most one kernel output (this rank's one call on a block nobody
    has sent anything for yet, or one passed on untouched), and how many of the block's leading
    key chunks it covers. Every call reads a prefix of the block's keys, so what a block's
    visitors have touched is a prefix; the rest is zero and does not travel. ``chunks == 0``:
    nothing to send, both ends skip the hop."""
    hops: dict = {}
    for s in range(1, world):
        for r in range(world):
            calls = ring_calls(r, ring_source(r, world, s), world, layout, causal)
            keys = max((c.keys for c in calls), default=0)
            p_single, p_chunks = hops[ring_neighbors(r, world)[0], s - 1] if s > 1 else (True, 0)
            single = (p_single and not calls) or (p_chunks == 0 and len(calls) <= 1)
            hops[r, s] = (single, max(p_chunks, keys))
    return tuple(tuple(hops[r, s] for s in range(1, world)) for r in range(world))


def hop_dtypes(rank: int, world: int, layout: str, causal: bool, kernel_dtype: torch.dtype,
               acc: torch.dtype) -> tuple[list[torch.dtype], list[torch.dtype]]:
    """``(sent, got)``: ``sent[s - 1]`` is the dtype of the accumulator this rank sends after
    step ``s`` (1 … P−1), ``got[s - 1]`` the dtype of the one the previous rank sends after its
    step ``s`` (received before this rank's step ``s + 1``, or, for ``s = P − 1``, this rank's
    own block coming home). ``kernel_dtype`` for one kernel output, ``acc`` for a sum."""
    hops = _acc_hops(world, layout, causal)
    sent = [kernel_dtype if x else acc for x, _ in hops[rank]]
    got = [kernel_dtype if x else acc for x, _ in hops[ring_neighbors(rank, world)[0]]]
    return sent, got


def hop_chunks(rank: int, world: int, layout: str, causal: bool) -> tuple[list[int], list[int]]:
    """``(sent, got)`` as :func:`hop_dtypes`, in leading key chunks of the block the accumulator
    covers (its ``chunks · T_local / leaves`` rows travel; 0: no message)."""
    hops = _acc_hops(world, layout, causal)
    return ([n for _, n in hops[rank]],
            [n for _, n in hops[ring_neighbors(rank, world)[0]]])


def kernel_grad_dtype(backend: KernelBackend, dtype: torch.dtype) -> torch.dtype:
    """The dtype of a backend's dK/dV for one non-causal call (every ring step after the
    first): the input dtype for the CUDA kernels with native GQA (one kernel, no partial
    sums inside the backend); fp32 (fp64) for the math backend."""
    if backend.name != "math" and backend.native_gqa:
        return dtype
    return acc_dtype(dtype)


def ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, ctx: SPContext, backend: KernelBackend,
                  *, causal: bool, scale: Optional[float], pack_kv: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward by ring exchange of K/V and of the blocks' dK/dV accumulators.

    Args:
        dout, q, out: ``[B, T_local, H, D]``; k, v: ``[B, T_local, Hkv, D]``;
        lse: ``[B, H, T_local]``, the global LSE of the forward.

    ``pack_kv``: K and V travel packed in one buffer (:class:`.ring_buffers.KVRing`).

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
    sent_n, got_n = hop_chunks(rank, world, ctx.layout, bool(causal))
    kv = KVRing(k, v, ctx, pack_kv)
    prev_rank, next_rank = ring_neighbors(rank, world)

    def new_pair(dtype: torch.dtype, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (k.shape[0], rows) + tuple(k.shape[2:])       # dK, dV of a block's first rows
        return (torch.empty(shape, dtype=dtype, device=k.device),
                torch.empty(shape, dtype=dtype, device=k.device))

    # Step 0: the own block, one square causal call; its dK/dV stay home.
    kv.post(0)
    dq, dk_home, dv_home = backend.backward(dout, q, k, v, out, lse, bool(causal), scale)
    if world > 2:
        dq = dq.to(acc)
    kv.wait()
    carry, works = None, []
    for step in range(1, world):
        src = ring_source(rank, world, step)
        last = step == world - 1
        if not last:          # the next block travels while this one computes
            kv.post(step)
        block = kv.block(step)
        grads = []
        for c in ring_calls(rank, src, world, ctx.layout, bool(causal)):
            rows = slice(c.q_start * ls, c.q_stop * ls)
            n_keys = c.keys * ls
            dq_c, dk_c, dv_c = backend.backward(
                dout[:, rows], q[:, rows], block[0][:, :n_keys], block[1][:, :n_keys],
                out[:, rows], lse[:, :, rows], c.causal, scale)
            dq[:, rows].add_(dq_c)
            grads.append((n_keys, dk_c, dv_c))
        for w in works:       # the previous hop, enqueued behind this step's kernels
            w.wait()
        send = _join(carry, grads, sent[step - 1], acc, sent_n[step - 1] * ls, new_pair)
        # after the last step the accumulator goes home and ours arrives
        carry = new_pair(got[step - 1], got_n[step - 1] * ls) if got_n[step - 1] else None
        works = p2p_exchange([(t.contiguous(), next_rank) for t in send or ()],
                             [(t, prev_rank) for t in carry or ()], ctx)
        if not last:
            kv.wait()
    for w in works:
        w.wait()
    if carry is not None:     # everyone else's contribution to the own block's leading keys
        # fp32 arithmetic (an in-place add computes in the promoted dtype), one kernel per
        # tensor, rounded once into the kernel's dtype
        n = carry[0].shape[1]
        dk_home[:, :n].add_(carry[0])
        dv_home[:, :n].add_(carry[1])
    return dq.to(q.dtype), dk_home.to(k.dtype), dv_home.to(v.dtype)


def _join(carry: Optional[tuple], grads: list, dtype: torch.dtype, acc: torch.dtype, rows: int,
          new_pair) -> Optional[tuple]:
    """The accumulator this step sends on, ``(dK, dV)`` of the block's first ``rows`` keys in
    ``dtype`` (from :func:`hop_dtypes` / :func:`hop_chunks`), or None (nothing to send): the
    received one passed on untouched when this rank adds nothing; this step's single kernel
    output as it is when nothing was received; else the ``acc``-dtype sum."""
    if not grads:
        return carry
    if carry is None and len(grads) == 1 and dtype != acc:
        return grads[0][1], grads[0][2]
    if carry is not None and carry[0].shape[1] == rows:
        buf = tuple(c.to(acc) for c in carry)
    else:                     # zeros past what was received (an exact upcast of it)
        buf = tuple(t.zero_() for t in new_pair(acc, rows))
        for b, c in zip(buf, carry or ()):
            b[:, :c.shape[1]].copy_(c)
    for n_keys, dk_c, dv_c in grads:
        buf[0][:, :n_keys].add_(dk_c)
        buf[1][:, :n_keys].add_(dv_c)
    return buf

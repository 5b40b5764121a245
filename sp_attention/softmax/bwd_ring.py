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

With ``kept`` (``SoftmaxTuning.ring_backward_order = "own_last"``) the order turns round: the
backward starts on the block the forward held last (rank ``rank + 1``'s, steps ``P − 1 … 1``),
blocks and accumulators travel from the next rank to the previous one, and the own block runs
last, so the last accumulator hop home travels while the largest call computes. The hop
tables take the order (:func:`visit_steps`); with P = 2 no K/V travels at all.

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

__all__ = ["ring_backward", "hop_dtypes", "hop_chunks", "visit_steps"]


def visit_steps(world: int, own_last: bool) -> tuple[int, ...]:
    """The ring steps (``s``: the block of rank ``rank − s``) a backward visits before or after
    its own block, in order: ``1 … P−1`` (own block first), or ``P−1 … 1`` (own block last:
    the blocks come from the next rank and the accumulators go to the previous one)."""
    steps = tuple(range(1, world))
    return steps[::-1] if own_last else steps


@lru_cache(maxsize=256)     # per (group size, layout, causal, order) a process meets
def _acc_hops(world: int, layout: str, causal: bool,
              own_last: bool = False) -> tuple[tuple[tuple[bool, int], ...], ...]:
    """``hops[r][i] = (single, chunks)`` of the accumulator rank ``r`` sends after its ``i``-th
    remote block (:func:`visit_steps`): whether it holds at most one kernel output (this rank's
    one call on a block nobody has sent anything for yet, or one passed on untouched), and how
    many of the block's leading key chunks it covers. Every call reads a prefix of the block's
    keys, so what a block's visitors have touched is a prefix; the rest is zero and does not
    travel. ``chunks == 0``: nothing to send, both ends skip the hop. The block's previous
    visitor is the previous rank (own block first) or the next one (own block last)."""
    hops: dict = {}
    for i, s in enumerate(visit_steps(world, own_last)):
        for r in range(world):
            calls = ring_calls(r, ring_source(r, world, s), world, layout, causal)
            keys = max((c.keys for c in calls), default=0)
            p_single, p_chunks = hops[_sender(r, world, own_last), i - 1] if i else (True, 0)
            single = (p_single and not calls) or (p_chunks == 0 and len(calls) <= 1)
            hops[r, i] = (single, max(p_chunks, keys))
    return tuple(tuple(hops[r, i] for i in range(world - 1)) for r in range(world))


def _sender(rank: int, world: int, own_last: bool) -> int:
    """The rank whose accumulators this rank receives: the previous visitor of every block it
    visits."""
    prev_rank, next_rank = ring_neighbors(rank, world)
    return next_rank if own_last else prev_rank


def hop_dtypes(rank: int, world: int, layout: str, causal: bool, kernel_dtype: torch.dtype,
               acc: torch.dtype, own_last: bool = False
               ) -> tuple[list[torch.dtype], list[torch.dtype]]:
    """``(sent, got)``: ``sent[i]`` is the dtype of the accumulator this rank sends after its
    ``i``-th remote block (:func:`visit_steps`), ``got[i]`` the dtype of the one its sender
    (the previous rank; own block last: the next) sends then (received before this rank's next
    block, or, after the last, this rank's own block coming home). ``kernel_dtype`` for one
    kernel output, ``acc`` for a sum."""
    hops = _acc_hops(world, layout, causal, own_last)
    sent = [kernel_dtype if x else acc for x, _ in hops[rank]]
    got = [kernel_dtype if x else acc for x, _ in hops[_sender(rank, world, own_last)]]
    return sent, got


def hop_chunks(rank: int, world: int, layout: str, causal: bool,
               own_last: bool = False) -> tuple[list[int], list[int]]:
    """``(sent, got)`` as :func:`hop_dtypes`, in leading key chunks of the block the accumulator
    covers (its ``chunks · T_local / leaves`` rows travel; 0: no message)."""
    hops = _acc_hops(world, layout, causal, own_last)
    return ([n for _, n in hops[rank]],
            [n for _, n in hops[_sender(rank, world, own_last)]])


def kernel_grad_dtype(backend: KernelBackend, dtype: torch.dtype) -> torch.dtype:
    """The dtype of a backend's dK/dV for one non-causal call (every ring step after the
    first): the input dtype for the CUDA kernels with native GQA (one kernel, no partial
    sums inside the backend); fp32 (fp64) for the math backend."""
    if backend.name != "math" and backend.native_gqa:
        return dtype
    return acc_dtype(dtype)


def ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, ctx: SPContext, backend: KernelBackend,
                  *, causal: bool, scale: Optional[float], pack_kv: bool = False,
                  kept: Optional[tuple[torch.Tensor, torch.Tensor]] = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward by ring exchange of K/V and of the blocks' dK/dV accumulators.

    Args:
        dout, q, out: ``[B, T_local, H, D]``; k, v: ``[B, T_local, Hkv, D]``;
        lse: ``[B, H, T_local]``, the global LSE of the forward.

    ``pack_kv``: K and V travel packed in one buffer (:class:`.ring_buffers.KVRing`).
    ``kept``: the K/V block the ring forward held last (rank ``rank + 1``'s, ``ring_forward(…,
    keep_last=True)``): given, the own block runs **last** (``SoftmaxTuning.ring_backward_order
    = "own_last"``) — the remote blocks from ``kept`` on, travelling from the next rank to the
    previous one (none with P = 2), and the accumulators' last hop home hides behind the own
    block's kernel instead of being waited for after it.

    Returns ``(dq, dk, dv)`` in the dtypes of q, k, v.
    """
    world, rank = ctx.world_size, ctx.rank
    ls = q.shape[1] // len(ctx.leaves)
    acc = acc_dtype(q.dtype)
    if world == 1:            # the own block alone: one call (plan.ring_calls), no ring
        dq, dk, dv = backend.backward(dout, q, k, v, out, lse, bool(causal), scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    own_last = kept is not None
    sent, got = hop_dtypes(rank, world, ctx.layout, bool(causal),
                           kernel_grad_dtype(backend, q.dtype), acc, own_last)
    sent_n, got_n = hop_chunks(rank, world, ctx.layout, bool(causal), own_last)
    prev_rank, next_rank = ring_neighbors(rank, world)
    to, frm = (prev_rank, next_rank) if own_last else (next_rank, prev_rank)

    def new_pair(dtype: torch.dtype, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (k.shape[0], rows) + tuple(k.shape[2:])       # dK, dV of a block's first rows
        return (torch.empty(shape, dtype=dtype, device=k.device),
                torch.empty(shape, dtype=dtype, device=k.device))

    def own_block():          # one square causal call; its dK/dV stay home
        return backend.backward(dout, q, k, v, out, lse, bool(causal), scale)

    if own_last:              # slot i holds the i-th remote block: kept, then from the next rank
        kv = KVRing(kept[0], kept[1], ctx, pack_kv, reverse=True)
        # dq of the remote blocks: with P = 2 kept apart and added to the own block's once
        # (the same fp32 sum and rounding as the own block first); beyond, an fp32 sum
        dq, parts = (None, []) if world == 2 else (torch.zeros(q.shape, dtype=acc,
                                                               device=q.device), None)
    else:                     # the own block first, while the first remote block travels
        kv = KVRing(k, v, ctx, pack_kv)
        kv.post(0)
        dq, dk_home, dv_home = own_block()
        if world > 2:
            dq = dq.to(acc)
        kv.wait()
    carry, works = None, []
    for i, step in enumerate(visit_steps(world, own_last)):
        src = ring_source(rank, world, step)
        slot = i if own_last else step
        last = i == world - 2
        if not last:          # the next block travels while this one computes
            kv.post(slot)
        block = kv.block(slot)
        grads = []
        for c in ring_calls(rank, src, world, ctx.layout, bool(causal)):
            rows = slice(c.q_start * ls, c.q_stop * ls)
            n_keys = c.keys * ls
            dq_c, dk_c, dv_c = backend.backward(
                dout[:, rows], q[:, rows], block[0][:, :n_keys], block[1][:, :n_keys],
                out[:, rows], lse[:, :, rows], c.causal, scale)
            if dq is None:
                parts.append((rows, dq_c))
            else:
                dq[:, rows].add_(dq_c)
            grads.append((n_keys, dk_c, dv_c))
        for w in works:       # the previous hop, enqueued behind this step's kernels
            w.wait()
        send = _join(carry, grads, sent[i], acc, sent_n[i] * ls, new_pair)
        # after the last remote block the accumulator goes home and ours arrives
        carry = new_pair(got[i], got_n[i] * ls) if got_n[i] else None
        works = p2p_exchange([(t.contiguous(), to) for t in send or ()],
                             [(t, frm) for t in carry or ()], ctx)
        if not last:
            kv.wait()
    if own_last:              # the last hop travels while the own block computes
        dq_own, dk_home, dv_home = own_block()
        if dq is None:
            dq = dq_own
            for rows, dq_c in parts:
                dq[:, rows].add_(dq_c)
        else:
            dq.add_(dq_own)
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

"""All-to-all schedules: Ulysses (``preset="a2a"``) and all-to-all × ring (``"a2a_ring"``,
USP / TransformerEngine's ``a2a+p2p``), forward, backward and their autograd Function.

Inside an all-to-all group of ``U`` consecutive CP ranks (``U = P`` for ``a2a``), one
fixed-shape all-to-all re-shards K/V and one re-shards Q from sequence shards
``[B, T_local, H, D]`` to head shards ``[B, U·T_local, H/U, D]`` (position ``u`` takes query
heads ``[u·H/U, (u+1)·H/U)`` and the KV heads they use: :mod:`sp_attention.planning.softmax_a2a`); the tokens are put
in the order of a CP rank of the ``R = P / U`` groups (with ``R = 1`` the global order, so the
kernel's plain causal mask is the global one) by the same copy that unpacks the receive
buffer. Then the **inner** schedule runs on the head shard: the local kernel on the whole
sequence (``R = 1``) or today's ring forward / backward across the groups (``R > 1``; the
group is one ring rank, :func:`a2a_split`); packed documents run the
packed ring (own-block varlen calls when ``R = 1``) on the groups' plan
(:func:`sp_attention.planning.softmax_a2a.grouped_plan`). The output (and the LSE when asked) goes back by the inverse
exchange.

Backward: ``dout`` goes to head shards the same way; the inner backward uses the head-sharded
``q, k, v, out, lse`` saved by the forward (no exchange of them again); ``dq`` goes back like
the output, dK/dV like K/V in reverse, summed in fp32 over the positions that received a
replicated KV head.

``SoftmaxTuning.a2a_direct`` (B = 1, no packed documents): each run of a position's tokens is
its own point-to-point message, received straight into its place in the head shard and sent
back straight from it (:func:`_direct_in`, :func:`_direct_back`): no index gathers.

No process group of its own: with ``U = P`` the all-to-all is ``all_to_all_single`` on the CP
group; with ``U < P`` it is the same exchange as grouped point-to-point messages among the
group's ``U`` ranks (``batch_isend_irecv`` on the CP group: NCCL runs its all-to-all exactly
so), and the ring across groups is point-to-point too. So ``a2a_ring`` needs no sub-group
and nothing to set up: any U dividing P and the local query heads works on any CP group.

Overlap: the heads run in ``C`` chunks (``SoftmaxTuning.a2a_head_chunks``; chunk ``c``: KV
heads ``[c·Hkv/C, (c+1)·Hkv/C)`` and their query heads), each its own exchanges and inner
schedule: chunk ``c + 1``'s inputs are sent before chunk ``c``'s kernel is launched, and chunk
``c``'s output is sent back while chunk ``c + 1``'s kernel runs, so with ``C > 1`` only the first
chunk's inputs and the last chunk's output wait in the open (the backward alike with ``dout``
and the gradients). Within a chunk K/V's exchange is issued first, then Q is packed and its
exchange issued, and K/V are unpacked while Q travels; backward issues dK/dV's exchange before
dq's. Every head's numbers are the same for any ``C``: a head's kernel sees the same tokens.

Bytes per rank and direction (forward; the backward alike): ``(U−1)/U · B·T_local·D ·
(2·H + 2·Hkv)`` elements when ``Hkv % U == 0`` (Q, K+V, out), plus the ring's across groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ..caches import LRU, to_device
from ..comm import all_to_all_flat, p2p_exchange
from ..context import SPContext
from ..peer_copy import peer_exchange
from ..planning.packing import PackingPlan
from ..precision import acc_dtype
from ..validation import autocast_off
from ..planning.softmax_a2a import HeadSplit, arrival_order, grouped_plan, head_split
from .backend_common import KernelBackend
from .bwd_ring import ring_backward
from .fwd_ring import ring_forward
from ..planning.softmax_packed import CallPolicy
from .packed_ring import packed_ring_backward, packed_ring_forward

__all__ = ["A2AConfig", "A2AAttention", "a2a_forward", "a2a_backward", "a2a_split"]

# Index tensors per (token order, sizes, device): built once, host time only.
_INDEX = LRU(256)


@dataclass(frozen=True)
class A2AConfig:
    """Everything the all-to-all Function needs (built by the public function after its
    checks). ``size``: U (``ctx.world_size`` for ``a2a``); ``plan``: packed documents (a
    non-trivial plan) or None; ``chunks``: head chunks pipelined
    (:func:`sp_attention.planning.softmax_a2a.head_chunks`, checked by the public function);
    ``direct``: ``SoftmaxTuning.a2a_direct`` (:func:`_direct_runs` says where it applies);
    ``transport``: ``SoftmaxTuning.a2a_transport`` (``"copy_engine"``:
    :mod:`sp_attention.peer_copy`, the direct exchange not used)."""

    ctx: SPContext
    size: int
    causal: bool
    scale: float
    backend: KernelBackend
    return_lse: bool
    pack_kv: bool
    plan: Optional[PackingPlan] = None
    policy: Optional[CallPolicy] = None
    chunks: int = 1
    direct: bool = False
    transport: str = "nccl"


def a2a_split(ctx: SPContext, size: int) -> tuple[SPContext, SPContext]:
    """``(intra, inter)``: the all-to-all group of ``size`` = U consecutive ranks holding this
    one (rank = position ``u = rank % U``) and the ring of the ``P / U`` ranks with the same
    position (rank = group index ``g = rank // U``), in ``ctx.layout``. Both address their
    peers through ``ctx.group`` and their global ranks: with ``1 < U < P`` they are **for
    point-to-point messages only** (their group is the whole CP group); U = P gives ``ctx``
    itself and a single rank, U = 1 the reverse."""
    P, U = ctx.world_size, size
    if U < 1 or P % U:
        raise ValueError(f"a2a_size={U!r} must be a positive divisor of the CP group size {P}")
    u, g = ctx.rank % U, ctx.rank // U
    one = SPContext(None, 0, 1, (ctx.global_ranks[ctx.rank],), ctx.layout)
    if U == P:
        return ctx, one
    if U == 1:
        return one, ctx
    return (SPContext(ctx.group, u, U, ctx.global_ranks[g * U:(g + 1) * U], ctx.layout),
            SPContext(ctx.group, g, P // U, ctx.global_ranks[u::U], ctx.layout))


# ------------------------------------------------------------------------------ token order
def _positions(cfg: A2AConfig, L: int) -> tuple[tuple, Optional[list]]:
    """``(key, runs)``: the inner order as runs ``(arrival start, length)`` of arrival
    positions (``u·L + t``), or None when it is the arrival order itself; ``key`` names it."""
    U, g = cfg.size, cfg.ctx.rank // cfg.size
    if cfg.plan is not None:
        gp = grouped_plan(cfg.plan, U)
        key: tuple = ("packed", gp, g)
        runs = list(gp.runs[g])
    elif not cfg.causal:           # full attention: any order of the keys gives the same rows
        return ("arrival",), None
    else:
        order = arrival_order(cfg.ctx.layout, cfg.ctx.world_size, U, g)
        c = L // len(cfg.ctx.leaves)
        key = ("chunks", order, c)
        runs = [(i * c, c) for i in order]
    done = 0
    for a, n in runs:
        if a != done:
            return key, runs
        done += n
    return ("arrival",), None


def _rows(pos: Optional[Tensor], U: int, L: int, B: int, S: int, slot: int,
          device) -> Optional[Tensor]:
    """Flat row of every token ``(b, i)`` (inner order) in an arrival buffer ``[U, S, B, L]``
    (source-major): ``[B·U·L]``; None when the buffer already is ``[B, U·L]`` in inner order."""
    if pos is None and S == 1 and B == 1:
        return None
    p = torch.arange(U * L, device=device) if pos is None else pos
    u, t = p // L, p % L
    b = torch.arange(B, device=device)[:, None]
    return (((u * S + slot)[None, :] * B + b) * L + t[None, :]).reshape(-1)


def _return_rows(pos: Optional[Tensor], U: int, L: int, B: int, device) -> Optional[Tensor]:
    """Flat row (in ``[B·U·L]``, inner order) of every entry of a send-back buffer
    ``[U, B, L]`` (destination-major); None when that is a view."""
    if pos is None and B == 1:
        return None
    T = U * L
    inv = torch.arange(T, device=device) if pos is None else torch.argsort(pos)
    u = torch.arange(U, device=device)[:, None, None]
    b = torch.arange(B, device=device)[None, :, None]
    t = torch.arange(L, device=device)[None, None, :]
    return (b * T + inv[u * L + t]).reshape(-1)


class _Order:
    """The index tensors of one call's token order (cached per order, sizes and device):
    ``rows[S][slot]`` for arrival buffers of ``S`` slots, ``back`` for send-back buffers;
    ``runs``: the direct exchanges' pieces (:func:`_direct_runs`), or None."""

    def __init__(self, cfg: A2AConfig, B: int, L: int, device):
        self.U, self.B, self.L = cfg.size, B, L
        key, runs = _positions(cfg, L)
        self.runs = _direct_runs(cfg, B, L, runs)
        if self.runs is not None:      # no index tensors: the exchanges place every piece
            self.rows = self.back = None
            return

        def make():
            pos = None if runs is None else to_device(torch.cat(
                [torch.arange(a, a + n) for a, n in runs]), device)
            rows = {s: [_rows(pos, self.U, L, B, s, i, device) for i in range(s)]
                    for s in (1, 2)}
            return rows, _return_rows(pos, self.U, L, B, device)
        self.rows, self.back = _INDEX.get(key + (self.U, B, L, str(device)), make)


def _direct_runs(cfg: A2AConfig, B: int, L: int, runs: Optional[list]) -> Optional[tuple]:
    """The pieces of the direct exchanges (``SoftmaxTuning.a2a_direct``), or None where they do
    not apply: ``((position u, its local token start, inner start, length), ...)`` in inner
    order, one per run of consecutive tokens of one position (zigzag: two per position,
    contiguous: one). Only with one sequence per micro-batch (B = 1: a piece of ``[L, n, D]``
    is contiguous) and without packed documents (their runs can be many and short)."""
    if not cfg.direct or B != 1 or cfg.plan is not None or cfg.transport != "nccl":
        return None
    U = cfg.size
    pieces, o = [], 0
    for a, n in (runs if runs is not None else [(u * L, L) for u in range(U)]):
        u, t = divmod(a, L)
        pieces.append((u, t, o, n))
        o += n
    return tuple(pieces)


# ------------------------------------------------------------------------------ exchanges
def _direct_in(send: Tensor, runs: tuple, intra: SPContext):
    """:func:`_exchange` with each piece received straight into its place: ``send [U, S, 1,
    L, n, D]`` (destination-major) -> ``(S tensors [1, U·L, n, D] in inner order, pending)``.
    Every message is a contiguous piece; a pair of ranks posts its pieces in one agreed order
    (slot, then inner order), this rank's own piece is a local copy."""
    U, S, _, L, n, D = send.shape
    me = intra.rank
    outs = [torch.empty((1, U * L, n, D), dtype=send.dtype, device=send.device)
            for _ in range(S)]
    sends, recvs = [], []
    for s in range(S):
        for u, t, o, m in runs:
            if u == me:
                outs[s][0, o:o + m].copy_(send[me, s, 0, t:t + m])
                sends += [(send[w, s, 0, t:t + m], w) for w in range(U) if w != me]
            else:
                recvs.append((outs[s][0, o:o + m], u))
    return outs, (send, p2p_exchange(sends, recvs, intra))


def _direct_back(xs: tuple, runs: tuple, intra: SPContext):
    """:func:`_exchange` of :func:`_send_back` without the send-back buffer: each position's
    pieces of ``xs [1, U·L, h, D]`` (inner order) go to it straight from their place; ->
    ``(arrival buffer [U, S, 1, L, h, D] source-major, pending)``."""
    S, (T, h, D) = len(xs), xs[0].shape[1:]
    U, me = intra.world_size, intra.rank
    L = T // U
    recv = torch.empty((U, S, 1, L, h, D), dtype=xs[0].dtype, device=xs[0].device)
    sends, recvs = [], []
    for s, x in enumerate(xs):
        for u, t, o, m in runs:
            if u == me:
                recv[me, s, 0, t:t + m].copy_(x[0, o:o + m])
                recvs += [(recv[w, s, 0, t:t + m], w) for w in range(U) if w != me]
            else:
                sends.append((x[0, o:o + m], u))
    return recv, (xs, p2p_exchange(sends, recvs, intra))


def _exchange(send: Tensor, intra: SPContext, whole: bool):
    """Start the all-to-all of ``send`` ``[U, ...]`` (destination-major) inside ``intra``;
    ``(receive buffer [U, ...] source-major, pending)``. ``whole``: ``intra`` is the CP group
    itself (one ``all_to_all_single``); else grouped sends and receives to its other ranks."""
    send = send.contiguous()
    recv = torch.empty(send.shape, dtype=send.dtype, device=send.device)
    if whole:
        return recv, (send, [all_to_all_flat(recv, send, intra, async_op=True)])
    u = intra.rank
    recv[u].copy_(send[u])
    peers = [j for j in range(intra.world_size) if j != u]
    works = p2p_exchange([(send[j], j) for j in peers], [(recv[j], j) for j in peers], intra)
    return recv, (send, works)


def _wait(pending) -> None:
    """Wait for an exchange (its send buffer stays referenced until then)."""
    for w in pending[1]:
        if w is not None:
            w.wait()


def _send_heads(xs: tuple, U: int, sel: Optional[Tensor]) -> Tensor:
    """Send buffer ``[U, S, B, L, n, D]``: for destination ``u`` the heads ``sel[u]`` (None: the
    ``u``-th of ``U`` equal blocks) of each ``x [B, L, h, D]`` of ``xs``."""
    B, L, h, D = xs[0].shape
    n = h // U if sel is None else sel.shape[1]
    buf = torch.empty((U, len(xs), B, L, n, D), dtype=xs[0].dtype, device=xs[0].device)
    for s, x in enumerate(xs):
        src = x.unflatten(2, (U, n)) if sel is None else x[:, :, sel]      # [B, L, U, n, D]
        buf[:, s].copy_(src.permute(2, 0, 1, 3, 4))
    return buf


class _Arrival:
    """One slot of an exchanged arrival buffer, gathered into inner order (:func:`_arrived`)
    once the exchange is waited for."""

    def __init__(self, recv: Tensor, rows: Optional[Tensor]):
        self.recv, self.rows = recv, rows

    def value(self) -> Tensor:
        return _arrived(self.recv, self.rows)


def _take(x) -> Tensor:
    """An arrival in inner order: a direct exchange's tensor as it is, else gathered."""
    return x.value() if isinstance(x, _Arrival) else x


def _arrived(recv: Tensor, rows: Optional[Tensor]) -> Tensor:
    """One slot of an arrival buffer ``[U, S, B, L, n, D]`` as ``[B, U·L, n, D]`` in inner
    order (``rows`` from :func:`_rows`)."""
    U, _, B, L, n, D = recv.shape
    if rows is None:
        return recv.view(1, U * L, n, D)
    return recv.view(-1, n, D).index_select(0, rows).view(B, U * L, n, D)


def _send_back(xs: tuple, order: _Order) -> Tensor:
    """Send-back buffer ``[U, S, B, L, h, D]`` of ``xs [B, U·L, h, D]`` (inner order): for
    destination ``u`` the rows of its shard, in its order."""
    U, B, L = order.U, order.B, order.L
    h, D = xs[0].shape[2:]
    if order.back is None and len(xs) == 1:
        return xs[0].reshape(U, 1, B, L, h, D)
    buf = torch.empty((U, len(xs), B, L, h, D), dtype=xs[0].dtype, device=xs[0].device)
    for s, x in enumerate(xs):
        flat = x.reshape(B * U * L, h, D)
        if order.back is None:
            buf[:, s].copy_(flat.view(U, B, L, h, D))
        elif len(xs) == 1:
            torch.index_select(flat, 0, order.back, out=buf.view(U * B * L, h, D))
        else:
            buf[:, s].copy_(flat.index_select(0, order.back).view(U, B, L, h, D))
    return buf


def _heads_home(recv: Tensor, slot: int = 0) -> Tensor:
    """An arrival buffer ``[U, S, B, L, h, D]`` of head shards as ``[B, L, U·h, D]``."""
    U, _, B, L, h, D = recv.shape
    return recv[:, slot].permute(1, 2, 0, 3, 4).reshape(B, L, U * h, D)


def _heads_into(dst: Tensor, recv: Tensor, slot: int = 0) -> None:
    """Copy an arrival buffer ``[U, S, B, L, h, D]`` of head shards into ``dst [B, L, U·h,
    D]`` (a view: one chunk's heads of the call's output), converting its dtype."""
    U, h = recv.shape[0], recv.shape[4]
    dst.unflatten(2, (U, h)).copy_(recv[:, slot].permute(1, 2, 0, 3, 4))


def _index(kind: str, split: HeadSplit, u: int, device) -> Tensor:
    def make():
        if kind == "sel":           # [U, n]: the KV head in each slot of every position
            return torch.tensor(split.kv_heads_of, dtype=torch.int64)
        if kind == "q2s":           # [a]: the slot each of position u's query heads reads
            return torch.tensor(split.q_to_slot[u], dtype=torch.int64)
        real = [(w, j) for w in range(split.size) for j in range(split.kv_count[w])]
        if kind == "real":          # real slots of the [U·n] arrivals
            return torch.tensor([w * split.kv_slots + j for w, j in real], dtype=torch.int64)
        return torch.tensor([split.kv_heads_of[w][j] for w, j in real], dtype=torch.int64)
    return _INDEX.get((kind, split, u, str(device)),
                      lambda: to_device(make(), device))


def _kv_into(dk: Tensor, dv: Tensor, recv: Tensor, split: HeadSplit) -> None:
    """dK, dV (views ``[B, L, Hkv_chunk, D]`` of the call's gradients) from the arrivals
    ``[U, 2, B, L, n, D]``: a copy when every KV head had one position, else the positions'
    parts summed in fp32 and rounded once."""
    if split.disjoint:
        _heads_into(dk, recv, 0), _heads_into(dv, recv, 1)
        return
    U, _, B, L, n, D = recv.shape
    acc = acc_dtype(dk.dtype)
    real, heads = (_index(k, split, 0, recv.device) for k in ("real", "heads"))
    for s, dst in ((0, dk), (1, dv)):
        parts = _heads_home(recv, s).index_select(2, real).to(acc)
        total = torch.zeros((B, L, split.kv_heads, D), dtype=acc, device=recv.device)
        dst.copy_(total.index_add_(2, heads, parts))


def _expand(k: Tensor, v: Tensor, split: HeadSplit, u: int) -> tuple[Tensor, Tensor]:
    """K/V slots as the kernel takes them: as they are (native GQA) or one per query head."""
    if split.native:
        return k, v
    q2s = _index("q2s", split, u, k.device)
    return k.index_select(2, q2s), v.index_select(2, q2s)


def _fold(dk: Tensor, dv: Tensor, split: HeadSplit, u: int) -> tuple[Tensor, Tensor]:
    """Inverse of :func:`_expand` for gradients: per-query-head dK/dV summed into the slots
    (fp32)."""
    if split.native:
        return dk, dv
    q2s = _index("q2s", split, u, dk.device)
    acc = acc_dtype(dk.dtype)
    out = []
    for g in (dk, dv):
        shape = g.shape[:2] + (split.kv_slots, g.shape[3])
        out.append(torch.zeros(shape, dtype=acc, device=g.device).index_add_(2, q2s, g.to(acc)))
    return out[0], out[1]


# ------------------------------------------------------------------------------ schedules
class _Groups:
    """The all-to-all group, the ring across groups and the heads of one chunk of a call."""

    def __init__(self, cfg: A2AConfig, heads: int, kv_heads: int):
        self.intra, self.inter = a2a_split(cfg.ctx, cfg.size)
        self.whole = cfg.size == cfg.ctx.world_size
        self.split = head_split(heads // cfg.chunks, kv_heads // cfg.chunks, cfg.size)
        self.cfg = cfg

    def exchange(self, send: Tensor):
        if self.cfg.transport == "copy_engine":     # pulls from the peers' symmetric memory
            recv, pending = peer_exchange(self.cfg.ctx, send.device).exchange(send,
                                                                              self.cfg.size)
            return recv, (send, [pending])
        return _exchange(send, self.intra, self.whole)

    def arrive(self, send: Tensor, order: "_Order"):
        """Send ``send [U, S, B, L, n, D]`` to head shards: ``(S arrivals [B, U·L, n, D] in
        inner order, pending)``, their contents valid after ``_wait(pending)``."""
        if order.runs is not None:
            return _direct_in(send.contiguous(), order.runs, self.intra)
        recv, pending = self.exchange(send)
        return [_Arrival(recv, order.rows[send.shape[1]][s]) for s in range(send.shape[1])], \
            pending

    def back(self, xs: tuple, order: "_Order"):
        """Send ``xs [B, U·L, h, D]`` (inner order) home: ``(arrival buffer [U, S, B, L, h,
        D] source-major, pending)``."""
        if order.runs is not None:
            return _direct_back(tuple(x.contiguous() for x in xs), order.runs, self.intra)
        return self.exchange(_send_back(xs, order))


def _chunk(x: Tensor, c: int, chunks: int, dim: int = 2) -> Tensor:
    """Head chunk ``c`` of ``chunks`` of ``x`` along ``dim`` (a view)."""
    n = x.shape[dim] // chunks
    return x.narrow(dim, c * n, n)


def _inner_plan(cfg: A2AConfig) -> PackingPlan:
    """The packed plan the inner schedule runs on: the groups' (U = 1: the batch's own)."""
    return cfg.plan if cfg.size == 1 else grouped_plan(cfg.plan, cfg.size)


def _inner_forward(qh: Tensor, kh: Tensor, vh: Tensor, gr: _Groups, cfg: A2AConfig):
    ke, ve = _expand(kh, vh, gr.split, gr.intra.rank)
    if cfg.plan is None:
        return ring_forward(qh, ke, ve, gr.inter, cfg.backend, causal=cfg.causal,
                            scale=cfg.scale, pack_kv=cfg.pack_kv)
    return packed_ring_forward(qh, ke, ve, gr.inter, _inner_plan(cfg), cfg.backend,
                               scale=cfg.scale, policy=cfg.policy, pack_kv=cfg.pack_kv)


def _inner_backward(doh: Tensor, saved: tuple, gr: _Groups, cfg: A2AConfig):
    qh, kh, vh, outh, lseh = saved
    ke, ve = _expand(kh, vh, gr.split, gr.intra.rank)
    if cfg.plan is None:
        dqh, dkh, dvh = ring_backward(doh, qh, ke, ve, outh, lseh, gr.inter, cfg.backend,
                                      causal=cfg.causal, scale=cfg.scale, pack_kv=cfg.pack_kv)
    else:
        dqh, dkh, dvh = packed_ring_backward(doh, qh, ke, ve, outh, lseh, gr.inter,
                                             _inner_plan(cfg), cfg.backend, scale=cfg.scale,
                                             policy=cfg.policy, pack_kv=cfg.pack_kv)
    dkh, dvh = _fold(dkh, dvh, gr.split, gr.intra.rank)
    return dqh, dkh, dvh


def a2a_forward(q: Tensor, k: Tensor, v: Tensor, cfg: A2AConfig
                ) -> tuple[Tensor, Optional[Tensor], tuple]:
    """Forward: ``(out [B, L, H, D], lse [B, H, L] or None, saved)``; ``saved`` = the
    head-sharded ``(q, k, v, out, lse)`` of every head chunk in turn, which the backward
    reads (module doc). Chunk ``c + 1``'s exchanges are issued before chunk ``c``'s kernel,
    chunk ``c``'s output goes back while chunk ``c + 1``'s kernel runs."""
    gr = _Groups(cfg, q.shape[2], k.shape[2])
    U, C, (B, L), split = cfg.size, cfg.chunks, q.shape[:2], gr.split
    if U == 1:                             # no exchange: the inner schedule on the shard
        outh, lseh = _inner_forward(q, k, v, gr, cfg)
        return outh, lseh if cfg.return_lse else None, (q, k, v, outh, lseh)
    order = _Order(cfg, B, L, q.device)
    sel = None if split.disjoint else _index("sel", split, 0, q.device)

    def send(c):                           # K/V first: unpacked while Q travels
        kv = gr.arrive(_send_heads((_chunk(k, c, C), _chunk(v, c, C)), U, sel), order)
        return kv, gr.arrive(_send_heads((_chunk(q, c, C),), U, None), order)

    out, lse = torch.empty(q.shape, dtype=q.dtype, device=q.device), None
    saved, back, pending = [], [], send(0)
    for c in range(C):
        (kv_in, kv_work), (q_in, q_work) = pending
        if c + 1 < C:
            pending = send(c + 1)
        _wait(kv_work)
        kh, vh = (_take(x) for x in kv_in)
        _wait(q_work)
        qh = _take(q_in[0])
        outh, lseh = _inner_forward(qh, kh, vh, gr, cfg)
        saved += [qh, kh, vh, outh, lseh]
        back.append((_chunk(out, c, C), gr.back((outh,), order)))
        if cfg.return_lse:         # [B, a, T] -> rows [B, T, a, 1] -> home [B, L, H/C, 1]
            if lse is None:
                lse = torch.empty((B, q.shape[2], L), dtype=lseh.dtype, device=q.device)
            back.append((_chunk(lse.transpose(1, 2), c, C).unsqueeze(3), gr.back(
                (lseh.transpose(1, 2).unsqueeze(3),), order)))
    for dst, (recv, work) in back:
        _wait(work)
        _heads_into(dst, recv)
    return out, lse, tuple(saved)


def a2a_backward(dout: Tensor, saved: tuple, cfg: A2AConfig,
                 kv_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of :func:`a2a_forward` from its ``saved`` head shards (``kv_heads``: Hkv of
    the call's k): ``(dq, dk, dv)`` in the dtypes of q, k, v. Chunk ``c + 1``'s ``dout``
    travels while chunk ``c``'s kernel runs; chunk ``c``'s gradients go back during chunk
    ``c + 1``'s."""
    gr = _Groups(cfg, dout.shape[2], kv_heads)
    U, C, (B, L), split = cfg.size, cfg.chunks, dout.shape[:2], gr.split
    q_t, k_t = saved[0], saved[1]
    if U == 1:
        dqh, dkh, dvh = _inner_backward(dout, saved, gr, cfg)
        return dqh, dkh.to(k_t.dtype), dvh.to(saved[2].dtype)
    order = _Order(cfg, B, L, dout.device)

    def send(c):
        return gr.arrive(_send_heads((_chunk(dout, c, C),), U, None), order)

    dq = torch.empty((B, L) + dout.shape[2:], dtype=q_t.dtype, device=dout.device)
    dk, dv = (torch.empty((B, L, kv_heads, dout.shape[3]), dtype=t.dtype, device=dout.device)
              for t in (k_t, saved[2]))
    back, pending = [], send(0)
    for c in range(C):
        do_in, work = pending
        if c + 1 < C:
            pending = send(c + 1)
        _wait(work)
        doh = _take(do_in[0])
        dqh, dkh, dvh = _inner_backward(doh, saved[5 * c:5 * c + 5], gr, cfg)
        kv_back = gr.back((dkh, dvh), order)                        # dK/dV first
        back.append((c, kv_back, gr.back((dqh,), order)))
    for c, (kv_recv, kv_work), (dq_recv, dq_work) in back:
        _wait(kv_work)                     # sum dK/dV while dq travels
        _kv_into(_chunk(dk, c, C), _chunk(dv, c, C), kv_recv, split)
        _wait(dq_work)
        _heads_into(_chunk(dq, c, C), dq_recv)
    return dq, dk, dv


class A2AAttention(torch.autograd.Function):
    """The all-to-all schedules; saves the head-sharded ``q, k, v, out, lse``."""

    @staticmethod
    def forward(fctx, q, k, v, cfg: A2AConfig):
        out, lse, saved = a2a_forward(q, k, v, cfg)
        fctx.save_for_backward(*saved)
        fctx.cfg, fctx.kv_heads = cfg, k.shape[2]
        if cfg.return_lse:
            fctx.mark_non_differentiable(lse)
            return out, lse
        return out

    @staticmethod
    def backward(fctx, dout, *unused):
        with autocast_off(dout.device):
            dq, dk, dv = a2a_backward(dout, fctx.saved_tensors, fctx.cfg, fctx.kv_heads)
        return dq, dk, dv, None

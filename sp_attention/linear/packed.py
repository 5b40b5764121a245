"""Packed documents in linear attention on one rank: the local sequences of the plan, the scan
over crossing segments, and the autograd Function (the math and data flow:
``sp_attention/linear/README.md``, the arithmetic: :mod:`.packed_plan`).

Forward, per rank: each crossing segment's element (``A`` = 0 if it starts its document, else
``exp(Σ g)``; ``b`` its end state from zero, one pass over k, v); the scan gives each crossing
segment the state entering it; then every local sequence (crossing segments from their
incoming state, whole documents from zero) in one varlen call (fla) or one chunked call per
sequence (torch). Backward: each crossing segment's state-gradient contribution ``d`` (0 if it
starts its document), the reverse scan gives the gradient arriving at its end; then one
varlen backward with the incoming states and arriving gradients. Padding (after the last
sequence of the shard) gets zero outputs and gradients. Only the incoming state of each
crossing segment is saved for backward.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from ..planning.linear_packed import LinearPacking
from ..planning.schedules import CHUNK
from ..precision import acc_dtype
from ..triton_launch import device_guard
from .decay import Decay
from .gates import chunk_local_sums
from .local import Sequences, local_backward, local_output
from .state_sum import decayed_sum
from .leaves import state_dtype
from .slope_constants import fla_g_gamma
from .varlen import chunk_indices, chunk_offsets, chunk_offsets_tensor, cu_seqlens_tensor

__all__ = ["packed_output", "packed_grads", "varlen_layout"]


def _piece(x: Optional[torch.Tensor], p) -> Optional[torch.Tensor]:
    return None if x is None else x[:, p.local_start:p.local_stop]


def _dtype(q, k, v, decay: Decay, kern) -> torch.dtype:
    """The dtype of the scanned states and transitions (the same on every rank)."""
    return state_dtype(q, decay, kern is not None)


def _transitions(q, decay: Decay, lp: LinearPacking, dt) -> list:
    """``A [B, H]`` of this rank's crossing segments: 0 where a segment starts its document."""
    out = []
    for p in lp.crossing:
        a = decay.tokens(p.local_start, p.local_stop).transition(q.shape[0], p.length, dt,
                                                                 q.device)
        out.append(torch.zeros_like(a) if p.first else a)
    return out


def _segment_sums(x, y, decay: Decay, segments: list, step: int, scale: float, kern,
                  dt) -> list:
    """The one-pass state sum over each of ``segments`` (``step < 0``: its end state from
    zero; ``step > 0``: its state-gradient contribution), in ``dt``: one call for all of them
    (one kernel launch with fixed rates on the GPU)."""
    if not segments:
        return []
    state_sum = decayed_sum if kern is None else kern.state_sum
    out = state_sum(x, y, decay, 1, step, scale,
                    pieces=tuple((p.local_start, p.length) for p in segments))
    return [out[:, j].to(dt) for j in range(len(segments))]


def crossing_elements(q, k, v, decay: Decay, lp: LinearPacking, kern) -> tuple[list, list]:
    """``(A, b)`` of this rank's crossing segments (fp32/fp64), scan order: ``b`` by the
    one-pass state sum over each segment (one kernel launch for 16-bit CUDA inputs)."""
    dt = _dtype(q, k, v, decay, kern)
    return _transitions(q, decay, lp, dt), _segment_sums(k, v, decay, lp.crossing, -1, 1.0,
                                                         kern, dt)


def _scan(A: list, x: list, lp: LinearPacking, scan: Callable, reverse: bool, like):
    """The scan over the group's crossing segments (every rank calls it when any exists)."""
    if lp.num_elements == 0:
        return []
    return scan(A, x, reverse=reverse, holders=lp.holders, like=like)


def packed_output(q, k, v, decay: Decay, scale: float, lp: LinearPacking, scan: Callable,
                  kern=None) -> tuple[torch.Tensor, list]:
    """``(o [B, T, H, V], S_in per crossing segment)`` of one rank's shard. ``scan(A, b,
    reverse=, holders=, like=)``: the cross-rank scan. ``kern``: the fla kernel set (None:
    torch)."""
    B, T, H, _ = q.shape
    V = v.shape[-1]
    A, b = crossing_elements(q, k, v, decay, lp, kern)
    like = q.new_zeros(B, H, q.shape[-1], V, dtype=_dtype(q, k, v, decay, kern))
    S_in = _scan(A, b, lp, scan, False, like)
    entering = {p.position: s for p, s in zip(lp.crossing, S_in) if not p.first}
    if kern is not None:
        return _fla_output(q, k, v, decay, scale, lp, entering, kern), S_in
    o = q.new_zeros(B, T, H, V, dtype=acc_dtype(q, k, v, decay.g))
    for p in lp.pieces:
        dp = decay.tokens(p.local_start, p.local_stop)
        o[:, p.local_start:p.local_stop] = dp.core(_piece(q, p), _piece(k, p), _piece(v, p),
                                                   scale, entering.get(p.position), CHUNK)[0]
    return o, S_in


def packed_grads(q, k, v, decay: Decay, scale: float, lp: LinearPacking, S_in: list, do,
                 scan: Callable, kern=None) -> tuple:
    """``(dq, dk, dv, dg or None)`` of one rank's shard entered with ``S_in`` (per crossing
    segment, as :func:`packed_output` returned it)."""
    B, T, H, K = q.shape
    dt = _dtype(q, k, v, decay, kern)
    A = _transitions(q, decay, lp, dt)
    # a segment that starts its document sends nothing back: zeros, not computed
    sent = iter(_segment_sums(q, do.to(q.dtype), decay, [p for p in lp.crossing if not p.first],
                              1, scale, kern, dt))
    d = [q.new_zeros(B, H, K, do.shape[-1], dtype=dt) if p.first else next(sent)
         for p in lp.crossing]
    G = _scan(A, d, lp, scan, True, q.new_zeros(B, H, K, do.shape[-1], dtype=dt))
    entering = {p.position: s for p, s in zip(lp.crossing, S_in) if not p.first}
    arriving = {p.position: g for p, g in zip(lp.crossing, G)}
    if kern is not None:
        return _fla_grads(q, k, v, decay, scale, lp, entering, arriving, do, kern)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dg = torch.zeros_like(decay.g) if decay.gated else None
    with torch.enable_grad():
        for p in lp.pieces:
            xs = [t.detach().to(acc_dtype(q, k, v, decay.g)).requires_grad_(True)
                  for t in (_piece(q, p), _piece(k, p), _piece(v, p))]
            gp = decay.tokens(p.local_start, p.local_stop)
            if gp.gated:
                xs.append(gp.g.detach().to(xs[0].dtype).requires_grad_(True))
                gp = Decay(g=xs[-1])
            o, S_end = gp.core(*xs[:3], scale, entering.get(p.position), CHUNK)
            outs, seeds = [o], [_piece(do, p).to(o.dtype)]
            if p.position in arriving:
                outs.append(S_end)
                seeds.append(arriving[p.position].to(o.dtype))
            grads = torch.autograd.grad(outs, xs, seeds)
            sl = slice(p.local_start, p.local_stop)
            for out, gr in zip((dq, dk, dv, dg), grads):
                out[:, sl] = gr.to(out.dtype)
    return dq, dk, dv, dg


# ---------------------------------------------------------------------------------- fla path

@functools.lru_cache(maxsize=64)
def varlen_layout(lp: LinearPacking, batch: int) -> tuple:
    """Boundaries of the local sequences of ``batch`` rows flattened into one row (fla's
    varlen layout; each row's padding, if any, is one more sequence) and, per (row, piece),
    the sequence index: ``(cu, seq_of)`` with ``seq_of[(b, position)]`` for crossing
    pieces. Cached per (rank's view of the plan, batch): every layer of a batch shares it."""
    cu, seq_of = [0], {}
    for b in range(batch):
        off = b * lp.local_len
        for p in lp.pieces:
            if p.crossing:
                seq_of[(b, p.position)] = len(cu) - 1
            cu.append(off + p.local_stop)
        if lp.real_len < lp.local_len:
            cu.append(off + lp.local_len)
    return tuple(cu), seq_of


def _states(per_piece: dict, lp: LinearPacking, batch: int, n_seq: int, like: torch.Tensor):
    """``[N, H, K, V]`` per local sequence: the given states of crossing pieces, zeros
    elsewhere (None when none is given)."""
    if not per_piece:
        return None
    _, seq_of = varlen_layout(lp, batch)
    dt = next(iter(per_piece.values())).dtype          # fp32 (fp64 only for fp64 inputs)
    out = like.new_zeros(n_seq, *like.shape[1:], dtype=dt)
    for pos, s in per_piece.items():
        for b in range(batch):
            out[seq_of[(b, pos)]] = s[b]
    return out


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(1, x.shape[0] * x.shape[1], *x.shape[2:]).contiguous()


def _varlen_args(q, decay: Decay, lp: LinearPacking, kern):
    B = q.shape[0]
    cu, _ = varlen_layout(lp, B)
    seqs = Sequences(cu_seqlens_tensor(cu, q.device), chunk_indices(cu, CHUNK, q.device),
                     chunk_offsets_tensor(cu, CHUNK, q.device), chunk_offsets(cu, CHUNK)[-1])
    if decay.gated:
        gates = dict(g=chunk_local_sums(_flat(decay.g), CHUNK, cu)[0], g_gamma=None)
    else:
        gates = dict(g=None, g_gamma=fla_g_gamma(decay.slopes, q.device))
    return cu, seqs, gates


def _zero_padding(lp: LinearPacking, *xs) -> None:
    for x in xs:
        if x is not None and lp.real_len < lp.local_len:
            x[:, lp.real_len:] = 0


def _fla_output(q, k, v, decay, scale, lp, entering, kern) -> torch.Tensor:
    B, T = q.shape[:2]
    cu, seqs, gates = _varlen_args(q, decay, lp, kern)
    qf, kf, vf = _flat(q), _flat(k), _flat(v)
    h0 = _states(entering, lp, B, len(cu) - 1, qf.new_zeros(1, q.shape[2], q.shape[3],
                                                          v.shape[3]))
    with device_guard(q):
        o = local_output(kern, qf, kf, vf, gates, scale, h0, seqs)
    o = o.view(B, T, *o.shape[2:])
    _zero_padding(lp, o)
    return o


def _fla_grads(q, k, v, decay, scale, lp, entering, arriving, do, kern) -> tuple:
    B, T = q.shape[:2]
    cu, seqs, gates = _varlen_args(q, decay, lp, kern)
    qf, kf, vf, dof = _flat(q), _flat(k), _flat(v), _flat(do.to(v.dtype))
    like = qf.new_zeros(1, q.shape[2], q.shape[3], v.shape[3])
    h0 = _states(entering, lp, B, len(cu) - 1, like)
    dht = _states(arriving, lp, B, len(cu) - 1, like)
    with device_guard(q):
        dq, dk, dv, dg = local_backward(kern, qf, kf, vf, dof, gates, scale, h0, dht, seqs)
    dq, dk, dv = (x.view(B, T, *x.shape[2:]) for x in (dq, dk, dv))
    dg = None if dg is None else dg.view(B, T, -1)
    _zero_padding(lp, dq, dk, dv, dg)
    return dq, dk, dv, dg


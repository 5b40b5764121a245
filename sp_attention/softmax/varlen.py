"""Kernel calls of packed documents: one :class:`.packed_plan.PackedCall` on a query span and a
key span, forward ``(out, lse)`` and backward ``(dq, dk, dv)``.

Contract (every path): query rows of the span in no pair get ``out = 0``, ``lse = −inf`` and
``dq = 0``; keys in no pair get ``dk = dv = 0``; inside a pair the rows see the pair's keys
(bottom-right causal when the call is causal). Shapes as the kernel backends
(:mod:`.backends`): q, dout, out ``[B, Tq, H, D]``; k, v ``[B, Tk, Hkv, D]``; lse
``[B, H, Tq]`` fp32 (fp64 for fp64). The backward uses the final ``out`` and the global
``lse`` (each block's gradient is then exact on its own, as in the unpacked schedules).

Paths:

* **dense** (one pair covering both spans): the backend's own forward / backward (cuDNN on
  Hopper), the fastest kernels for long documents.
* **math varlen** (``backend.name == "math"``, CPU / fp64): the math backend
  (:func:`.backend_math.math_forward`) with the pairs' block-diagonal (causal) mask.
* **flash varlen** (CUDA backends): FlashAttention-2 inside torch
  (:func:`.backend_cuda.flash_varlen_fwd`: the kernels of
  ``torch.nn.attention.varlen.varlen_attn``, here with native GQA and a backward taking the
  merged LSE). Rows or keys between pairs become sequences with no keys / no queries; the
  kernel writes ``out = 0`` and ``lse = +inf`` for a query without keys, which is set to
  ``−inf`` here, and zero dK/dV for keys without queries.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..caches import LRU
from ..planning.softmax_packed import PackedCall, Pair
from .backend_common import default_scale
from .backend_cuda import flash_varlen_bwd, flash_varlen_fwd
from .backend_math import math_backward, math_forward

__all__ = ["call_forward", "call_backward", "pair_mask", "varlen_sequences"]


# --------------------------------------------------------------------------------------------
# Which query meets which key
# --------------------------------------------------------------------------------------------

def pair_mask(pairs: tuple[Pair, ...], tq: int, tk: int, causal: bool, device=None) -> Tensor:
    """Bool ``[tq, tk]``: True where query row i sees key j (pairs relative to the spans)."""
    rows = torch.full((tq,), -1, dtype=torch.int64)
    cols = torch.full((tk,), -2, dtype=torch.int64)
    q0 = torch.zeros(max(len(pairs), 1), dtype=torch.int64)
    k0 = torch.zeros_like(q0)
    shift = torch.zeros_like(q0)
    for n, p in enumerate(pairs):
        rows[p.q_start:p.q_stop] = n
        cols[p.k_start:p.k_stop] = n
        q0[n], k0[n], shift[n] = p.q_start, p.k_start, p.k_len - p.q_len
    allowed = rows.unsqueeze(1) == cols.unsqueeze(0)
    if causal:
        r = rows.clamp(min=0)
        i = torch.arange(tq) - q0[r]
        j = torch.arange(tk).unsqueeze(0) - k0[r].unsqueeze(1)
        allowed &= j <= (i + shift[r]).unsqueeze(1)
    return allowed.to(device)


def varlen_sequences(pairs: tuple[Pair, ...]) -> tuple[list[int], list[int], bool]:
    """``(seq_q, seq_k, q_gaps)``: lengths of the varlen sequences tiling both spans — the
    pairs, with rows between them as sequences without keys and keys between them as
    sequences without queries — and whether any row has no key."""
    seq_q, seq_k = [], []
    pq = pk = 0
    q_gaps = False
    for p in pairs:
        if p.q_start > pq:
            seq_q.append(p.q_start - pq)
            seq_k.append(0)
            q_gaps = True
        if p.k_start > pk:
            seq_q.append(0)
            seq_k.append(p.k_start - pk)
        seq_q.append(p.q_len)
        seq_k.append(p.k_len)
        pq, pk = p.q_stop, p.k_stop
    return seq_q, seq_k, q_gaps


# --------------------------------------------------------------------------------------------
# flash varlen (CUDA)
# --------------------------------------------------------------------------------------------

# Device cu_seqlens per (call object, batch, device): a host-to-device copy saved per call.
_CU = LRU(4096)


def _cu(call: PackedCall, batch: int, device) -> tuple:
    """Device ``cu_seqlens_q/k`` (int32) of ``call`` repeated over the batch, max lengths,
    whether rows without keys exist."""
    def make():
        seq_q, seq_k, q_gaps = varlen_sequences(call.relative())
        seq_q, seq_k = seq_q * batch, seq_k * batch
        cq, ck = [0], [0]
        for a, b in zip(seq_q, seq_k):
            cq.append(cq[-1] + a)
            ck.append(ck[-1] + b)
        return (call, torch.tensor(cq, dtype=torch.int32).to(device, non_blocking=True),
                torch.tensor(ck, dtype=torch.int32).to(device, non_blocking=True),
                max(seq_q), max(seq_k), q_gaps)
    hit = _CU.get((id(call), batch, str(device)), make)
    if hit[0] is not call:                 # an id reused by another call object
        hit = make()
        _CU.put((id(call), batch, str(device)), hit)
    return hit[1:]


def _flat(x: Tensor) -> Tensor:
    """[B, T, h, D] -> [B·T, h, D] (a view for B = 1)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    return x[0] if x.shape[0] == 1 else x.reshape(-1, x.shape[2], x.shape[3])


def _flash_forward(q: Tensor, k: Tensor, v: Tensor, call: PackedCall,
                   scale: float) -> tuple[Tensor, Tensor]:
    b, tq, h, d = q.shape
    cu_q, cu_k, max_q, max_k, q_gaps = _cu(call, b, q.device)
    out, lse = flash_varlen_fwd(_flat(q), _flat(k), _flat(v), cu_q, cu_k, max_q, max_k,
                                call.causal, scale)
    lse = lse.view(h, b, tq).transpose(0, 1)                       # [B, H, Tq]
    if q_gaps:                      # rows with no key: the kernel's +inf, our -inf
        lse = lse.masked_fill(torch.isposinf(lse), float("-inf"))
    return out.reshape(b, tq, h, d), lse


def _flash_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    call: PackedCall, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    b, tq, h, d = q.shape
    cu_q, cu_k, max_q, max_k, _ = _cu(call, b, q.device)
    lse_h = lse.float().transpose(0, 1).reshape(h, b * tq).contiguous()
    dq, dk, dv = flash_varlen_bwd(
        _flat(dout.to(q.dtype)).contiguous(), _flat(q), _flat(k), _flat(v),
        _flat(out.to(q.dtype)).contiguous(), lse_h, cu_q, cu_k, max_q, max_k, call.causal,
        scale)
    return (dq.reshape(b, tq, h, d), dk.reshape(b, k.shape[1], *k.shape[2:]),
            dv.reshape(b, v.shape[1], *v.shape[2:]))


# --------------------------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------------------------

def call_forward(backend, q: Tensor, k: Tensor, v: Tensor, call: PackedCall,
                 scale: Optional[float]) -> tuple[Tensor, Tensor]:
    """Forward of one packed call on the spans ``q = q_all[:, call.q_start:call.q_stop]``,
    ``k, v = block[:, call.k_start:call.k_stop]`` (module doc)."""
    scale = default_scale(scale, q)
    if call.dense:
        return backend.forward(q, k, v, call.causal, scale)
    if backend.name == "math":
        allowed = pair_mask(call.relative(), q.shape[1], k.shape[1], call.causal, q.device)
        return math_forward(q, k, v, False, scale, allowed=allowed)
    return _flash_forward(q, k, v, call, scale)


def call_backward(backend, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                  lse: Tensor, call: PackedCall,
                  scale: Optional[float]) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of :func:`call_forward` with the final ``out`` and global ``lse`` of the
    span's rows."""
    scale = default_scale(scale, q)
    if call.dense:
        return backend.backward(dout, q, k, v, out, lse, call.causal, scale)
    if backend.name == "math":
        allowed = pair_mask(call.relative(), q.shape[1], k.shape[1], call.causal, q.device)
        return math_backward(dout, q, k, v, out, lse, False, scale, allowed=allowed)
    return _flash_backward(dout, q, k, v, out, lse, call, scale)

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
* **math varlen** (``backend.name == "math"``, CPU / fp64): the math backend's formulas with
  a block-diagonal (causal) mask built from the pairs.
* **flash varlen** (CUDA backends): FlashAttention-2 inside torch
  (``aten._flash_attention_forward`` / ``_backward`` with ``cum_seq_q/k``: the kernels of
  ``torch.nn.attention.varlen.varlen_attn``, here with native GQA and the backward taking the
  merged LSE). Rows or keys between pairs become sequences with no keys / no queries; the
  kernel writes ``out = 0`` and ``lse = +inf`` for a query without keys, which is set to
  ``−inf`` here, and zero dK/dV for keys without queries.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..precision import acc_dtype
from .packed_plan import PackedCall, Pair

__all__ = ["call_forward", "call_backward", "pair_mask", "varlen_sequences",
           "masked_math_forward", "masked_math_backward", "flash_varlen_forward",
           "flash_varlen_backward"]


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
# math: masked block attention (the reference and the CPU path)
# --------------------------------------------------------------------------------------------

def _grouped(x: Tensor, kv_heads: int, dt: torch.dtype) -> Tensor:
    """[B, T, H, D] -> [B, Hkv, G, T, D] (head h = hkv·G + g)."""
    b, t, h, d = x.shape
    return x.to(dt).reshape(b, t, kv_heads, h // kv_heads, d).permute(0, 2, 3, 1, 4)


def _ungroup(x: Tensor) -> Tensor:
    b, hkv, g, t, d = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(b, t, hkv * g, d)


def _kv(x: Tensor, dt: torch.dtype) -> Tensor:
    return x.to(dt).permute(0, 2, 1, 3).unsqueeze(2)               # [B, Hkv, 1, T, D]


def _probs(s: Tensor, lse: Tensor) -> Tensor:
    return torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0.0).unsqueeze(-1))


def masked_math_forward(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor,
                        scale: float) -> tuple[Tensor, Tensor]:
    """Attention of q over k restricted to ``allowed [Tq, Tk]``; rows with no key: 0, −inf."""
    dt = acc_dtype(q.dtype)
    b, tq, h, _ = q.shape
    hkv = k.shape[2]
    s = (_grouped(q, hkv, dt) @ _kv(k, dt).transpose(-1, -2)) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                # [B, Hkv, G, Tq]
    out = _probs(s, lse) @ _kv(v, dt)
    return _ungroup(out).to(q.dtype), lse.reshape(b, h, tq)


def masked_math_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                         lse: Tensor, allowed: Tensor, scale: float
                         ) -> tuple[Tensor, Tensor, Tensor]:
    """Analytic backward of :func:`masked_math_forward` (the math backend's formulas)."""
    dt = acc_dtype(q.dtype)
    b, tq, h, _ = q.shape
    hkv = k.shape[2]
    qg, kg, vg = _grouped(q, hkv, dt), _kv(k, dt), _kv(v, dt)
    dog, og = _grouped(dout, hkv, dt), _grouped(out, hkv, dt)
    s = ((qg @ kg.transpose(-1, -2)) * scale).masked_fill(~allowed, float("-inf"))
    p = _probs(s, lse.to(dt).reshape(b, hkv, h // hkv, tq))
    delta = (dog * og).sum(dim=-1, keepdim=True)
    ds = p * (dog @ vg.transpose(-1, -2) - delta)
    dq = _ungroup((ds @ kg) * scale)
    dk = ((ds.transpose(-1, -2) @ qg) * scale).sum(dim=2).permute(0, 2, 1, 3)
    dv = (p.transpose(-1, -2) @ dog).sum(dim=2).permute(0, 2, 1, 3)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------
# flash varlen (CUDA)
# --------------------------------------------------------------------------------------------

_CU_CACHE: dict = {}


def _cu(call: PackedCall, batch: int, device) -> tuple:
    """Device ``cu_seqlens_q/k`` (int32) of ``call`` repeated over the batch, max lengths,
    whether rows without keys exist; cached per call object and device."""
    key = (id(call), batch, str(device))
    hit = _CU_CACHE.get(key)
    if hit is not None and hit[0] is call:
        return hit[1]
    seq_q, seq_k, q_gaps = varlen_sequences(call.relative())
    seq_q, seq_k = seq_q * batch, seq_k * batch
    cq, ck = [0], [0]
    for a, b in zip(seq_q, seq_k):
        cq.append(cq[-1] + a)
        ck.append(ck[-1] + b)
    val = (torch.tensor(cq, dtype=torch.int32).to(device, non_blocking=True),
           torch.tensor(ck, dtype=torch.int32).to(device, non_blocking=True),
           max(seq_q), max(seq_k), q_gaps)
    if len(_CU_CACHE) > 4096:
        _CU_CACHE.clear()
    _CU_CACHE[key] = (call, val)
    return val


def _flat(x: Tensor) -> Tensor:
    """[B, T, h, D] -> [B·T, h, D] (a view for B = 1)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    return x[0] if x.shape[0] == 1 else x.reshape(-1, x.shape[2], x.shape[3])


def flash_varlen_forward(q: Tensor, k: Tensor, v: Tensor, call: PackedCall,
                         scale: float) -> tuple[Tensor, Tensor]:
    b, tq, h, d = q.shape
    cu_q, cu_k, max_q, max_k, q_gaps = _cu(call, b, q.device)
    res = torch.ops.aten._flash_attention_forward(
        _flat(q), _flat(k), _flat(v), cu_q, cu_k, max_q, max_k, 0.0, call.causal, False,
        scale=scale)
    out, lse = res[0], res[1]                                       # [B·Tq, H, D], [H, B·Tq]
    if lse.dim() != 2:
        raise RuntimeError(f"this torch's varlen flash kernel returned an lse of shape "
                           f"{tuple(lse.shape)}; the packed path needs [H, total_q] (torch >= "
                           "2.5); pass SoftmaxTuning(packed_dense_min=1) to use dense calls only")
    lse = lse[:, :b * tq].float().view(h, b, tq).transpose(0, 1)
    if q_gaps:                      # rows with no key: the kernel's +inf, our -inf
        lse = lse.masked_fill(torch.isposinf(lse), float("-inf"))
    return out.reshape(b, tq, h, d), lse


def flash_varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                          lse: Tensor, call: PackedCall,
                          scale: float) -> tuple[Tensor, Tensor, Tensor]:
    b, tq, h, d = q.shape
    cu_q, cu_k, max_q, max_k, _ = _cu(call, b, q.device)
    seed = torch.empty((2,), dtype=torch.uint64, device=q.device)
    offset = torch.empty((), dtype=torch.uint64, device=q.device)
    lse_h = lse.float().transpose(0, 1).reshape(h, b * tq).contiguous()
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        _flat(dout.to(q.dtype)).contiguous(), _flat(q), _flat(k), _flat(v),
        _flat(out.to(q.dtype)).contiguous(), lse_h, cu_q, cu_k, max_q, max_k, 0.0,
        call.causal, seed, offset, scale=scale)
    return (dq.reshape(b, tq, h, d), dk.reshape(b, k.shape[1], *k.shape[2:]),
            dv.reshape(b, v.shape[1], *v.shape[2:]))


# --------------------------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------------------------

def _scale(scale: Optional[float], q: Tensor) -> float:
    return q.shape[-1] ** -0.5 if scale is None else float(scale)


def call_forward(backend, q: Tensor, k: Tensor, v: Tensor, call: PackedCall,
                 scale: Optional[float]) -> tuple[Tensor, Tensor]:
    """Forward of one packed call on the spans ``q = q_all[:, call.q_start:call.q_stop]``,
    ``k, v = block[:, call.k_start:call.k_stop]`` (module doc)."""
    scale = _scale(scale, q)
    if call.dense:
        return backend.forward(q, k, v, call.causal, scale)
    if backend.name == "math":
        allowed = pair_mask(call.relative(), q.shape[1], k.shape[1], call.causal, q.device)
        return masked_math_forward(q, k, v, allowed, scale)
    return flash_varlen_forward(q, k, v, call, scale)


def call_backward(backend, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                  lse: Tensor, call: PackedCall,
                  scale: Optional[float]) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of :func:`call_forward` with the final ``out`` and global ``lse`` of the
    span's rows."""
    scale = _scale(scale, q)
    if call.dense:
        return backend.backward(dout, q, k, v, out, lse, call.causal, scale)
    if backend.name == "math":
        allowed = pair_mask(call.relative(), q.shape[1], k.shape[1], call.causal, q.device)
        return masked_math_backward(dout, q, k, v, out, lse, allowed, scale)
    return flash_varlen_backward(dout, q, k, v, out, lse, call, scale)

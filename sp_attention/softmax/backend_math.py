"""The ``math`` softmax backend: block attention in pure torch (any device and float dtype,
fp64 for the CPU tests), an analytic backward (no autograd), GQA by broadcasting (no copies).

The reference the kernel backends are tested against, and the backend of every CPU run.
Interface and shapes: :mod:`.backend_common`. ``lse`` and the gradients are fp32 (fp64 for
fp64 inputs); ``out`` is in q.dtype.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..precision import acc_dtype
from .backend_common import KernelBackend, check_shapes, default_scale

__all__ = ["math_forward", "math_backward", "MATH"]


def _causal_allowed(tq: int, tk: int, top_left: bool, device) -> Tensor:
    """[tq, tk] bool, True where query i may see key j."""
    i = torch.arange(tq, device=device).unsqueeze(1)
    j = torch.arange(tk, device=device).unsqueeze(0)
    return j <= (i if top_left else i + (tk - tq))


def _grouped_q(x: Tensor, kv_heads: int, dt: torch.dtype) -> Tensor:
    """[B, T, H, D] -> [B, Hkv, G, T, D]; head h = hkv * G + g, matching h // G = hkv."""
    b, t, h, d = x.shape
    return x.to(dt).reshape(b, t, kv_heads, h // kv_heads, d).permute(0, 2, 3, 1, 4)


def _grouped_kv(x: Tensor, dt: torch.dtype) -> Tensor:
    """[B, T, Hkv, D] -> [B, Hkv, 1, T, D], broadcast over the group without copies."""
    return x.to(dt).permute(0, 2, 1, 3).unsqueeze(2)


def _ungroup(x: Tensor) -> Tensor:
    """[B, Hkv, G, T, D] -> [B, T, H, D]."""
    b, hkv, g, t, d = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(b, t, hkv * g, d)


def _math_scores(qg: Tensor, kg: Tensor, causal: bool, scale: float, top_left: bool,
                 allowed: Optional[Tensor] = None) -> Tensor:
    s = (qg @ kg.transpose(-1, -2)) * scale                    # [B, Hkv, G, Tq, Tk]
    if causal:
        s = s.masked_fill(~_causal_allowed(s.shape[-2], s.shape[-1], top_left, s.device),
                          float("-inf"))
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    return s


def _probs(s: Tensor, lse: Tensor) -> Tensor:
    # A fully masked row has lse = -inf; shifting it by 0 makes its probabilities exp(-inf) =
    # 0 instead of NaN, so out and every gradient of that row are 0.
    return torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0.0).unsqueeze(-1))


def math_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: Optional[float] = None,
                 *, top_left: bool = False,
                 allowed: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Pure-torch block attention ``(out in q.dtype, lse [B, H, Tq])`` in fp32 (fp64 for fp64).

    ``top_left=True`` switches the causal mask to torch SDPA's top-left alignment (j <= i); it
    exists to test :func:`.causal_split.bottom_right_causal_forward` and is not used by the
    library.
    ``allowed`` (bool ``[Tq, Tk]``): only these (query, key) pairs take part, on top of the
    causal mask (packed documents: :mod:`.varlen`). Rows with no visible key (Tq > Tk, or an
    ``allowed`` row without keys) give out 0 and lse -inf.
    """
    check_shapes(q, k, v)
    scale = default_scale(scale, q)
    dt = acc_dtype(q.dtype)
    b, tq, h, _ = q.shape
    qg = _grouped_q(q, k.shape[2], dt)
    s = _math_scores(qg, _grouped_kv(k, dt), causal, scale, top_left, allowed)
    lse = torch.logsumexp(s, dim=-1)                            # [B, Hkv, G, Tq]
    out = _probs(s, lse) @ _grouped_kv(v, dt)                   # [B, Hkv, G, Tq, D]
    return _ungroup(out).to(q.dtype), lse.reshape(b, h, tq)


def math_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                  causal: bool, scale: Optional[float] = None, *, top_left: bool = False,
                  allowed: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Analytic backward of :func:`math_forward` from (q, k, v, out, lse, dout); no autograd.

    With P = exp(S - lse), dP = dout v^T and D_i = rowsum(dout * out):
    dS = P (dP - D), dq = scale dS k, dk = scale dS^T q, dv = P^T dout; dk/dv are summed over
    each GQA group by the broadcast matmul. Returns fp32 gradients (fp64 for fp64 inputs).
    """
    check_shapes(q, k, v)
    scale = default_scale(scale, q)
    dt = acc_dtype(q.dtype)
    b, tq, h, _ = q.shape
    hkv = k.shape[2]
    qg, kg, vg = _grouped_q(q, hkv, dt), _grouped_kv(k, dt), _grouped_kv(v, dt)
    dog, og = _grouped_q(dout, hkv, dt), _grouped_q(out, hkv, dt)
    lse_g = lse.to(dt).reshape(b, hkv, h // hkv, tq)
    p = _probs(_math_scores(qg, kg, causal, scale, top_left, allowed), lse_g)  # [B,Hkv,G,Tq,Tk]
    delta = (dog * og).sum(dim=-1, keepdim=True)                        # [B, Hkv, G, Tq, 1]
    ds = p * (dog @ vg.transpose(-1, -2) - delta)
    dq = _ungroup((ds @ kg) * scale)
    dk = ((ds.transpose(-1, -2) @ qg) * scale).sum(dim=2).permute(0, 2, 1, 3)
    dv = (p.transpose(-1, -2) @ dog).sum(dim=2).permute(0, 2, 1, 3)
    return dq, dk, dv


def _why_not_math(device: torch.device, dtype: torch.dtype,
                  head_dim: Optional[int]) -> Optional[str]:
    return None if dtype.is_floating_point else f"needs a floating dtype, got {dtype}"


# The math backend (registered by :mod:`.backends`).
MATH = KernelBackend("math", math_forward, math_backward, _why_not_math)

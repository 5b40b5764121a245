"""Pure-torch reference for softmax attention with GQA and bottom-right causal alignment.

For query i of Tq and key j of Tk (per batch b, query head h, kv head g = h // (H / Hkv)):

    s_ij = scale * q_i . k_j                   masked to -inf where causal and j > i + (Tk - Tq)
    lse_i = log sum_j exp(s_ij)                (natural log; -inf for a fully masked row)
    o_i  = sum_j exp(s_ij - lse_i) v_j         (0 for a fully masked row)

Bottom-right alignment is what context parallelism needs: a query chunk attends to the prefix
of keys that ends at its own position, so the last query row sees every key. With Tq == Tk it
is the usual causal mask.

Shapes: q [B, Tq, H, D]; k, v [B, Tk, Hkv, D]; out [B, Tq, H, D] in q.dtype; lse [B, H, Tq].
Math runs in fp32 (fp64 for fp64 inputs) and lse stays in that dtype, so fp64 tests stay
exact. K/V heads are expanded locally with repeat_interleave (the reference favours clarity
over memory). Differentiable with autograd.
"""
from __future__ import annotations

import torch

from ..precision import acc_dtype

__all__ = ["attention_reference", "bottom_right_causal_mask", "packed_attention_reference"]


def bottom_right_causal_mask(tq: int, tk: int, device=None) -> torch.Tensor:
    """Boolean [tq, tk] mask, True where query i may see key j (j <= i + tk - tq)."""
    i = torch.arange(tq, device=device).unsqueeze(1)
    j = torch.arange(tk, device=device).unsqueeze(0)
    return j <= i + (tk - tq)


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                        softmax_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention ``(out [B, Tq, H, D] in q.dtype, lse [B, H, Tq])`` (see module doc)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be [B, T, heads, D]")
    heads, kv_heads = q.shape[2], k.shape[2]
    if heads % kv_heads != 0:
        raise ValueError(f"query heads {heads} not a multiple of kv heads {kv_heads}")
    group = heads // kv_heads
    cdt = acc_dtype(q)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    qh = q.to(cdt).transpose(1, 2)                                       # [B, H, Tq, D]
    kh = k.to(cdt).repeat_interleave(group, dim=2).transpose(1, 2)       # [B, H, Tk, D]
    vh = v.to(cdt).repeat_interleave(group, dim=2).transpose(1, 2)
    s = (qh @ kh.transpose(-1, -2)) * scale                              # [B, H, Tq, Tk]
    if causal:
        allowed = bottom_right_causal_mask(q.shape[1], k.shape[1], device=q.device)
        s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                     # [B, H, Tq]
    # A fully masked row has lse = -inf; shifting by 0 instead makes its weights exp(-inf) = 0.
    shift = lse.masked_fill(torch.isneginf(lse), 0.0)
    p = torch.exp(s - shift.unsqueeze(-1))
    out = (p @ vh).transpose(1, 2).to(q.dtype)                           # [B, Tq, H, D]
    return out, lse


def packed_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               cu_seqlens, *, softmax_scale: float | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed documents on the GLOBAL row: every document alone through
    :func:`attention_reference` (causal), the results concatenated; tokens after
    ``cu_seqlens[-1]`` (padding) get out 0 and lse −inf. Shapes as :func:`attention_reference`
    (``T`` = the row, documents then padding); differentiable."""
    cu = [int(x) for x in cu_seqlens]
    outs, lses = [], []
    for a, b in zip(cu[:-1], cu[1:]):
        o, l = attention_reference(q[:, a:b], k[:, a:b], v[:, a:b], causal=True,
                                   softmax_scale=softmax_scale)
        outs.append(o)
        lses.append(l)
    pad = q.shape[1] - cu[-1]
    if pad:
        outs.append(q[:, cu[-1]:] * 0)
        lses.append(torch.full((q.shape[0], q.shape[2], pad), float("-inf"),
                               dtype=lses[0].dtype if lses else acc_dtype(q), device=q.device))
    return torch.cat(outs, 1), torch.cat(lses, 2)

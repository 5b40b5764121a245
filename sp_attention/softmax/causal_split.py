"""Bottom-right causal attention from a kernel whose causal flag is top-left: an exact
two-call split.

Causal alignment in this package is **bottom-right**: query i sees key j iff j <= i + (Tk - Tq),
the alignment a query chunk needs against the prefix of keys ending at its own position. Causal
calls need Tq <= Tk (no query row is then fully masked). A kernel whose causal flag is top-left
(torch SDPA's ``is_causal``; cuDNN's ``set_causal_mask``) is made bottom-right here: a
non-causal call on keys [0, Tk - Tq) and a square causal call on the last Tq keys (where both
alignments agree), merged exactly by LSE (:mod:`.merge`).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..precision import acc_dtype
from .backend_common import BackwardFn, ForwardFn
from .merge import merge_blocks_

__all__ = ["bottom_right_causal_forward", "bottom_right_causal_backward"]


def bottom_right_causal_forward(forward: ForwardFn, q: Tensor, k: Tensor, v: Tensor,
                                scale: float) -> tuple[Tensor, Tensor]:
    """Bottom-right causal attention from any ``forward(q, k, v, causal, scale)``.

    Only square causal calls are made, where top-left and bottom-right agree, so the result
    does not depend on the kernel's alignment: keys [0, Tk - Tq) are visible to every query
    (non-causal call), the last Tq keys form a square causal block; the two are merged in
    fp32 by LSE. Returns ``(out in q.dtype, lse fp32)``.
    """
    tq, tk = q.shape[1], k.shape[1]
    if tq > tk:
        raise ValueError(f"bottom-right causal needs Tq <= Tk, got Tq={tq}, Tk={tk}")
    if tq == tk:
        return forward(q, k, v, True, scale)
    p = tk - tq
    out_a, lse_a = forward(q, k[:, :p], v[:, :p], False, scale)
    out_b, lse_b = forward(q, k[:, p:], v[:, p:], True, scale)
    dt = acc_dtype(q.dtype)
    out = out_a.to(dt, copy=True)
    lse = lse_a.to(dt, copy=True)
    merge_blocks_(out, lse, out_b, lse_b)
    return out.to(q.dtype), lse


def bottom_right_causal_backward(backward: BackwardFn, dout: Tensor, q: Tensor, k: Tensor,
                                 v: Tensor, out: Tensor, lse: Tensor,
                                 scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of :func:`bottom_right_causal_forward` from any ``backward`` kernel.

    Exact per part: each part's backward recomputes P = exp(S - lse) and D = rowsum(dout*out)
    from the *merged* (global) out and lse, which are the true softmax probabilities and
    row terms of the whole block. dq adds the two parts; dk/dv are the concatenation along
    keys. Gradients come back in fp32 (fp64 for fp64 inputs).
    """
    tq, tk = q.shape[1], k.shape[1]
    if tq > tk:
        raise ValueError(f"bottom-right causal needs Tq <= Tk, got Tq={tq}, Tk={tk}")
    if tq == tk:
        return backward(dout, q, k, v, out, lse, True, scale)
    p = tk - tq
    dq_a, dk_a, dv_a = backward(dout, q, k[:, :p], v[:, :p], out, lse, False, scale)
    dq_b, dk_b, dv_b = backward(dout, q, k[:, p:], v[:, p:], out, lse, True, scale)
    dt = acc_dtype(q.dtype)
    dq = dq_a.to(dt, copy=True).add_(dq_b)
    dk = torch.empty(k.shape, dtype=dt, device=k.device)
    dv = torch.empty(v.shape, dtype=dt, device=v.device)
    dk[:, :p].copy_(dk_a)
    dk[:, p:].copy_(dk_b)
    dv[:, :p].copy_(dv_a)
    dv[:, p:].copy_(dv_b)
    return dq, dk, dv

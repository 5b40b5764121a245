"""Exact merge of two partial softmax-attention results by their log-sum-exp.

If (out, lse) attends to one set of keys and (out_b, lse_b) to a disjoint set, attention to
the union is

    lse' = log(exp(lse) + exp(lse_b))  = lse - logsigmoid(lse - lse_b)
    out' = (exp(lse) out + exp(lse_b) out_b) / exp(lse')
         = out - sigmoid(lse_b - lse) (out - out_b)

The sigmoid form (DESIGN §5, as in ring-flash-attention and torch's context parallel) never
exponentiates an lse, so it cannot overflow. Rows whose lse is -inf (no key seen yet, e.g. an
accumulator initialised to (0, -inf)) are handled exactly: merging into them copies the other
block, merging an empty block leaves the accumulator unchanged, and no NaN is produced.

Layouts: out, out_b [B, Tq, H, D]; lse, lse_b [B, H, Tq] (note the transposed head/token
order). Accumulators are fp32, or fp64 for fp64 inputs (see :func:`acc_dtype`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["acc_dtype", "merge_blocks", "merge_blocks_"]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulator dtype for inputs of ``dtype``: fp64 stays fp64, everything else is fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor,
           lse_b: torch.Tensor) -> None:
    if out.dim() != 4 or lse.dim() != 3:
        raise ValueError(f"expected out [B, Tq, H, D] and lse [B, H, Tq], got "
                         f"{tuple(out.shape)} and {tuple(lse.shape)}")
    b, t, h, _ = out.shape
    if tuple(lse.shape) != (b, h, t) or tuple(lse_b.shape) != (b, h, t):
        raise ValueError(f"lse shapes {tuple(lse.shape)}, {tuple(lse_b.shape)} do not match "
                         f"out {tuple(out.shape)} (want [B, H, Tq] = {(b, h, t)})")
    if tuple(out_b.shape) != tuple(out.shape):
        raise ValueError(f"out_b shape {tuple(out_b.shape)} != out shape {tuple(out.shape)}")
    if out.dtype not in (torch.float32, torch.float64) or lse.dtype != out.dtype:
        raise ValueError(f"accumulators must be fp32 (or fp64) and share a dtype, got out "
                         f"{out.dtype}, lse {lse.dtype}; allocate them with acc_dtype()")


def merge_blocks_(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor,
                  lse_b: torch.Tensor) -> None:
    """Merge block (out_b, lse_b) into the accumulators (out, lse) in place.

    ``out`` must be finite where ``lse`` is -inf (initialise it with zeros); out_b and lse_b
    may be in any float dtype and are upcast.
    """
    _check(out, lse, out_b, lse_b)
    lse_b = lse_b.to(lse.dtype)
    # Block b's share of the merged softmax mass. Forced to 0 where block b saw no key: this
    # also covers rows where both are -inf and lse_b - lse would be NaN.
    w = torch.sigmoid(lse_b - lse).masked_fill_(torch.isneginf(lse_b), 0.0)   # [B, H, Tq]
    # (1 - w) out + w out_b: w = 1 on rows the accumulator has not seen, so out_b is copied.
    # Two in-place passes, out_b upcast inside addcmul_ (no fp32 temporaries): this merge is
    # memory-bound and runs once per ring step on [B, Tq, H, D].
    w4 = w.transpose(1, 2).unsqueeze(-1)                                      # [B, Tq, H, 1]
    if torch.promote_types(out_b.dtype, out.dtype) != out.dtype:   # e.g. fp64 into fp32
        out_b = out_b.to(out.dtype)
    out.mul_(1.0 - w4).addcmul_(out_b, w4)
    # lse - logsigmoid(lse - lse_b) is -inf - (-inf) = NaN on unseen rows; take lse_b there.
    merged = lse - F.logsigmoid(lse - lse_b)
    lse.copy_(torch.where(torch.isneginf(lse), lse_b, merged))


def merge_blocks(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor,
                 lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the merge of (out, lse) and (out_b, lse_b) as new accumulator tensors.

    Inputs may be in any float dtype; the result is in :func:`acc_dtype` of ``out.dtype``
    (fp32, or fp64 for fp64). Shapes: out [B, Tq, H, D], lse [B, H, Tq].
    """
    dt = acc_dtype(out.dtype)
    acc_out = out.to(dt, copy=True)
    acc_lse = lse.to(dt, copy=True)
    merge_blocks_(acc_out, acc_lse, out_b, lse_b)
    return acc_out, acc_lse

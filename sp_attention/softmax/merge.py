"""Exact merge of two partial softmax-attention results by their log-sum-exp.

If (out, lse) attends to one set of keys and (out_b, lse_b) to a disjoint set, attention to
the union is

    lse' = log(exp(lse) + exp(lse_b))  = lse - logsigmoid(lse - lse_b)
    out' = (exp(lse) out + exp(lse_b) out_b) / exp(lse')
         = out - sigmoid(lse_b - lse) (out - out_b)

The sigmoid form (as in ring-flash-attention and torch's context parallel) never
exponentiates an lse, so it cannot overflow. Rows whose lse is -inf (no key seen yet, e.g. an
accumulator initialised to (0, -inf)) are handled exactly: merging into them copies the other
block, merging an empty block (lse_b = -inf) leaves the accumulator unchanged, and no NaN is
produced (also where both sides are -inf).

Layouts: out, out_b [B, Tq, H, D]; lse, lse_b [B, H, Tq] (note the transposed head/token
order). Any strides: views of bigger buffers (``out[:, rows]``, ``lse[:, :, rows]``, head
slices) are updated in place.

Precision: the math is fp32, or fp64 when out or lse is fp64 (:func:`sp_attention.precision.acc_dtype`). ``lse``
must be fp32/fp64; ``out`` may be any float dtype (e.g. a bf16 kernel output used directly as
the accumulator) and is rounded to its own dtype once per merge.

Cost: the pure-torch form makes about ten elementwise passes over [B, Tq, H, D] (≈0.27 ms for
an fp32 [1, 8192, 32, 128] accumulator on an H200; a bf16 ``out`` adds an upcast and a copy
back, ≈0.48 ms; 6 % of a ring step at T_local 8K). On CUDA with fp32 / 16-bit tensors the merge
runs as one Triton kernel (:mod:`.merge_kernel`: one read of each block, one write), same math
in fp32; fp64 and CPU tensors take the torch form, which is also the reference the kernel is
tested against (Triton's CPU interpreter, and on the GPU elementwise, incl. the bf16
[1, 8192, 32, 128] case where an earlier fused kernel of 2026-11-22 went wrong).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..precision import acc_dtype

__all__ = ["merge_blocks", "merge_blocks_"]

_LSE_DTYPES = (torch.float32, torch.float64)


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
    if lse.dtype not in _LSE_DTYPES:
        raise ValueError(f"the lse accumulator must be fp32 (or fp64), got {lse.dtype}; "
                         f"allocate it with acc_dtype()")
    for name, x in (("out", out), ("out_b", out_b), ("lse_b", lse_b)):
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    devices = {x.device for x in (out, lse, out_b, lse_b)}
    if len(devices) != 1:
        raise ValueError(f"out, lse, out_b, lse_b must be on one device, got "
                         f"{[str(x.device) for x in (out, lse, out_b, lse_b)]}")


def merge_blocks_(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor,
                  lse_b: torch.Tensor) -> None:
    """Merge block (out_b, lse_b) into the accumulators (out, lse) in place.

    Shapes: out, out_b [B, Tq, H, D]; lse, lse_b [B, H, Tq]; any strides. ``out`` may be any
    float dtype, ``lse`` fp32 or fp64 (ValueError otherwise); out_b and lse_b may be in any
    float dtype and are upcast. Math in fp32 (fp64 if out or lse is fp64), rounded into
    ``out``'s dtype once. ``out`` must be finite where ``lse`` is -inf (initialise it with
    zeros) and ``out_b`` finite everywhere.
    """
    _check(out, lse, out_b, lse_b)
    if _use_kernel(out, lse, out_b, lse_b):
        from .merge_kernel import merge_blocks_triton
        merge_blocks_triton(out, lse, out_b, lse_b.float())
        return
    dt = acc_dtype(out, lse)
    acc_out = out if out.dtype == dt else out.to(dt)
    acc_lse = lse if lse.dtype == dt else lse.to(dt)
    _merge_inplace(acc_out, acc_lse, out_b, lse_b.to(dt))
    if acc_out is not out:
        out.copy_(acc_out)
    if acc_lse is not lse:
        lse.copy_(acc_lse)


_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _use_kernel(out, lse, out_b, lse_b) -> bool:
    """The one-pass Triton merge runs CUDA tensors of fp32/16-bit with fp32 LSEs and unit
    stride in D (everything the schedules pass); anything else takes the torch form."""
    return (out.is_cuda and out.dtype in _KERNEL_DTYPES and out_b.dtype in _KERNEL_DTYPES
            and lse.dtype == torch.float32 and lse_b.dtype in _KERNEL_DTYPES
            and out.stride(-1) == 1 and out_b.stride(-1) == 1 and _triton_available())


@functools.lru_cache(maxsize=1)
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # not installed, or no usable driver
        return False
    return True


def _merge_inplace(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> None:
    """The merge on accumulators out, lse of one dtype (fp32/fp64); lse_b in that dtype."""
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

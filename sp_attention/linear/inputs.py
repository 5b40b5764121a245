"""The input checks of :func:`sp_attention.lightning_attention` (run on every rank before the op
communicates; their errors reach every rank through the call check) and the call signature
every rank must share."""
from __future__ import annotations

from typing import Optional

import torch

from ..call_check import plan_identity
from ..context import SPContext
from ..tuning import LinearTuning
from ..validation import check_local_length, check_tensors, sdpa_hint
from .slope_constants import check_gate_values, check_slope_values

__all__ = ["check_inputs", "call_signature"]


def _check_qkv(q, k, v) -> None:
    check_tensors(q=q, k=k, v=v)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [B, T, H, K/V]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        hint = ""
        if q.shape[0] == k.shape[0] and q.shape[2:] == k.shape[2:] and k.shape[1] \
                and q.shape[1] % k.shape[1] == 0:
            hint = (" They look like [B, H, T, D] (the SDPA / HF layout: dim 1 holds the "
                    f"{q.shape[1]} query and {k.shape[1]} KV heads); this op takes "
                    "[B, T_local, H, K]: pass q, k, v .transpose(1, 2) and transpose the "
                    "output back.")
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must have the same shape "
                         "but for k's heads (B, T, K equal; k may have fewer, grouped "
                         f"heads).{hint}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v {tuple(v.shape)} must match q {tuple(q.shape)} in B, T and k "
                         f"{tuple(k.shape)} in its heads")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads {q.shape[2]} must be a multiple of the KV heads "
                         f"{k.shape[2]} (GQA: query head h uses KV head h // (H / Hkv))")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them "
                         "to one dtype (under torch.autocast the op casts them to the autocast "
                         "dtype itself, as SDPA does)")
    if not (q.device == k.device == v.device):
        raise ValueError("q, k, v are on different devices")


def _check_slopes(q, slopes) -> None:
    check_tensors(slopes=slopes)
    H = q.shape[2]
    if slopes.dim() != 1 or slopes.shape[0] != H:
        hint = sdpa_hint(q, slopes.shape[0] if slopes.dim() == 1 else None)
        raise ValueError(f"slopes must be [H] = [{H}] (one decay rate per head), got "
                         f"{tuple(slopes.shape)}.{hint}")
    if slopes.requires_grad:
        raise ValueError("slopes are fixed decay rates here (no gradient is computed for them); "
                         "pass slopes.detach() or a buffer, or per-token gates as g=")
    check_slope_values(slopes)


def _check_gates(q, g, tuning: LinearTuning) -> bool:
    check_tensors(g=g)
    want = tuple(q.shape[:3])
    if tuple(g.shape) != want:
        hint = ""
        if g.dim() == 3 and tuple(g.shape) == (want[0], want[2], want[1]):
            hint = " It looks like [B, H, T]: pass g.transpose(1, 2)."
        elif g.dim() == 4 and g.shape[-1] == 1:
            hint = " Drop its trailing dimension (g.squeeze(-1))."
        raise ValueError(f"g must be [B, T_local, H] = {list(want)} (one log-decay per token "
                         f"and query head), got {list(g.shape)}.{hint}")
    if not g.is_floating_point():
        raise ValueError(f"g must be a floating tensor (fp32 recommended), got {g.dtype}")
    if g.device != q.device:
        raise ValueError(f"g is on {g.device} but q is on {q.device}; move it with "
                         "g.to(q.device) (it is an activation of the layer, like q)")
    return tuning.check_gate_values and check_gate_values(g)


def check_inputs(q, k, v, slopes, g, ctx: SPContext, scale,
                 tuning: LinearTuning) -> bool:
    """Raise ``TypeError``/``ValueError`` naming the fix for a bad call; returns whether gate
    values were read now (then every rank agrees on the outcome in this call's exchange)."""
    _check_qkv(q, k, v)
    if (slopes is None) == (g is None):
        raise ValueError("pass exactly one of slopes (fixed per-head rates [H]) and g= "
                         "(per-token log-decays [B, T_local, H])")
    checked = False
    if slopes is not None:
        _check_slopes(q, slopes)
    else:
        checked = _check_gates(q, g, tuning)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be a positive float, got {scale!r}")
    check_local_length(q, ctx)
    return checked


def _shape(x) -> object:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


def call_signature(q, k, v, slopes, g, impl, scale, backend, kernels, tuning,
                   ctx: SPContext, plan: Optional[object]) -> tuple:
    """What every rank must pass alike (checked across ranks once per new signature): shapes,
    dtypes, options, the decay kind and the packing plan's digest."""
    tensors = tuple((n, _shape(x), getattr(x, "dtype", None)) for n, x in
                    (("q", q), ("k", k), ("v", v), ("slopes", slopes), ("g", g)))
    dev = q.device.type if isinstance(q, torch.Tensor) else None
    kind = backend if backend is None or isinstance(backend, str) else type(backend).__name__
    if kernels is not None:
        kind = f"kernels {type(kernels).__name__}"
    return (("tensors", tensors), ("device", dev), ("layout", ctx.layout), ("impl", impl),
            ("scale", scale), ("backend", kind), ("tuning", tuning),
            ("packing", plan_identity(ctx, plan)))

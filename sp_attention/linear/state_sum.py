"""The one-pass decayed state sum ``scale · Σ_t w_t x_tᵀ y_t`` of linear attention with decay: a
leaf's end state from zero (``x = k, y = v``) and its state-gradient contribution (``x = q,
y = dO``), over a whole piece or several token ranges at once (packed documents' crossing
segments). 16-bit CUDA inputs take our one-pass Triton kernel (:mod:`.kernels`), everything
else a compute-dtype einsum (fp64 capable) with the weights cached per slopes version.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from ..precision import acc_dtype
from ..validation import autocast_off
from .decay import Decay, as_decay
from .fla_ops import fla_import_error
from .gates import GateSums
from .slope_constants import decay_weights, fla_g_gamma

__all__ = ["decayed_sum"]

DecayLike = Union[torch.Tensor, Decay]


def decayed_sum(x: torch.Tensor, y: torch.Tensor, decay: DecayLike, base: int, step: int,
                scale: float = 1.0, gates: Optional[GateSums] = None,
                pieces: Optional[tuple] = None) -> torch.Tensor:
    """``scale · Σ_t λ^(base + step·t) x_tᵀ y_t`` -> [B, H, K, V], fp32 (fp64 for fp64).

    Gates: the weights are ``exp(G_t)`` (``step > 0``, G inclusive from the first token: a
    leaf's state-gradient contribution) or ``exp(Σ_{s>t} g_s)`` (``step < 0``: its end state
    from zero); ``gates``: the kernel's sums of these rows if already made (e.g. strided views
    of a batch of leaves' sums).
    16-bit CUDA inputs take the one-pass Triton kernel (fp32 accumulation, the weighted x
    rounded to the input dtype as the chunk kernels round their operands); everything else the
    compute-dtype einsum with the weights cached per slopes version.

    ``pieces``: ``((start, length), ...)`` token ranges, each summed on its own (``step < 0``:
    each piece's end state, its own ``base = length − 1``) -> ``[B, len(pieces), H, K, V]``;
    fixed rates on the kernel path take one launch for all of them (the packed path's
    crossing segments).
    """
    decay = as_decay(decay)
    if pieces is not None:
        return _piece_sums(x, y, decay, base, step, scale, tuple(pieces))
    if _kernel_path(x, y):
        from .kernels import decayed_state_sum
        if decay.gated:
            return decayed_state_sum(_rows(x), _rows(y), None, base, step, scale=scale,
                                     gates=decay.sums if gates is None else gates)
        return decayed_state_sum(_rows(x), _rows(y), fla_g_gamma(decay.slopes, x.device), base,
                                 step, scale=scale)
    dt = acc_dtype(x, y, decay.g)
    with autocast_off(x.device):
        if decay.gated:
            xw = x.to(dt) * decay.weights(x.shape[1], step < 0, dt, x.device)[..., None]
        else:
            w = decay_weights(decay.slopes, x.shape[1], base, step, dt, x.device)    # [H, C]
            xw = x.to(dt) * w.t()[None, :, :, None]
        out = torch.einsum("bchk,bchv->bhkv", xw, y.to(dt))
    return out if scale == 1.0 else scale * out


def _kernel_path(x: torch.Tensor, y: torch.Tensor) -> bool:
    """16-bit CUDA inputs of one dtype, with the GPU extra installed: the Triton kernel."""
    return (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and y.dtype == x.dtype
            and fla_import_error() is None)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """The kernel takes strided rows (every n-th leaf) as they are."""
    return t if t[0].is_contiguous() else t.contiguous()


def _piece_sums(x, y, decay, base: int, step: int, scale: float, pieces: tuple) -> torch.Tensor:
    if not decay.gated and _kernel_path(x, y):
        from .kernels import decayed_state_sum
        return decayed_state_sum(_rows(x), _rows(y), fla_g_gamma(decay.slopes, x.device), base,
                                 step, scale=scale, pieces=pieces)
    return torch.stack([decayed_sum(x[:, a:a + n], y[:, a:a + n], decay.tokens(a, a + n),
                                    n - 1 if step < 0 else base, step, scale)
                        for a, n in pieces], 1)

"""Single-device ops on one leaf of linear attention with decay (the "local op" the scan uses).

A leaf is a contiguous piece of C tokens. With S_in the state just before the leaf (local
position -1) and lam = exp(-s) per head, unrolling S_i = lam S_{i-1} + k_i^T v_i gives

    S_i = lam^(i+1) S_in + sum_{j<=i} lam^(i-j) k_j^T v_j         (local i = 0 .. C-1)
    o_i = scale q_i S_i = o_zero_i + scale lam^(i+1) q_i S_in       -> inter_output
    S_end = S_{C-1} = lam^C S_in + b,   b = sum_j lam^(C-1-j) k_j^T v_j   -> leaf_forward

Backward with do = dL/do and G = dL/dS_end (from later leaves):

    dL/dS_in = scale sum_i lam^(i+1) q_i^T do_i  +  lam^C G        -> state_grad_local
    dq_i = intra + scale lam^(i+1) do_i S_in^T
    dk_j, dv_j = intra + lam^(C-1-j) (v_j G^T, k_j G)              -> leaf_backward

All decays are exp(-s * n) in fp32 (fp64 for fp64 inputs); nothing divides by lam^C.

Per-token gates (a :class:`~sp_attention.linear.decay.Decay` with ``g``) replace lam^(i+1) by
exp(G_i) and lam^(C-1-j) by exp(G_last - G_j) (G: inclusive sums of g in the leaf); the
backward adds dg (the math: ``sp_attention/linear/README.md``). Every op here takes either a
slopes tensor (fixed rates) or a Decay.

Backends: "torch" (chunked pure torch, :mod:`.torch_ops`, any device/dtype, backward by
autograd on a recomputed forward that lives only inside the call) and "fla" (fla-core's Triton
chunk kernels, CUDA, fp16/bf16/fp32, in the one kernel sequence of :mod:`.local`; conventions in
:mod:`.fla_ops`). None picks fla when it can run. Several leaves at once, overlapped with the
scans: :mod:`.leaves`. The one-pass state sum: :mod:`.state_sum`.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from ..planning.schedules import CHUNK
from ..precision import acc_dtype
from ..triton_launch import device_guard
from ..validation import autocast_off
from .decay import Decay, as_decay
from .kernel_set import resolve_kernels
from .local import chunk_states, local_backward, local_output
from .state_sum import decayed_sum
from .torch_ops import decay_powers

DecayLike = Union[torch.Tensor, Decay]

__all__ = ["leaf_forward", "inter_output", "leaf_state", "leaf_output", "state_grad_local",
           "leaf_backward", "torch_leaf_backward", "decayed_sum"]


def _state_or_none(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if x is None else x.to(torch.float32).contiguous()


def leaf_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: DecayLike,
                 scale: float, backend: Optional[str] = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-start output and end state of one leaf.

    q, k [B, C, H, K], v [B, C, H, V], decay: slopes [H] or a Decay. Returns
      o_zero [B, C, H, V]: scale q_i sum_{j<=i} lam^(i-j) k_j^T v_j; fp32/fp64 for "torch",
                           v.dtype for "fla" (the kernel writes the input dtype);
      b [B, H, K, V]: sum_j lam^(C-1-j) k_j^T v_j; fp32 (fp64 for fp64 inputs).
    """
    decay = as_decay(decay)
    kern = resolve_kernels(backend, q, k, v)
    if kern is None:
        with autocast_off(q.device):
            return decay.core(q, k, v, scale, None, CHUNK)
    # fla 0.6.0 bug (seen on H200): in a partial last chunk, chunk_fwd_h scales the zero-padded
    # rows of v by exp2(g_last - g) > 1 with fixed rates, which overflows to inf once
    # s * pad > ~88, and 0 * inf makes the final state NaN (o is unaffected; gates read g = 0
    # in padded rows, exactly). Leading zero tokens are exact instead: the zero start state
    # stays zero and zero k, v add nothing, so pad at the front and drop those rows of o.
    pad = 0 if decay.gated else (-q.shape[1]) % CHUNK
    q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, 0, pad, 0)).contiguous() if pad
               else x.contiguous() for x in (q, k, v))
    fkw = decay.fla_kw(q.device)
    with device_guard(q):
        h, b = chunk_states(kern, k, v, fkw, None, final=True)
        o = kern.chunk_fwd_o(q=q, k=k, v=v, h=h, scale=float(scale), chunk_size=CHUNK, **fkw)
    return o[:, pad:], b


def inter_output(q: torch.Tensor, decay: DecayLike, scale: float,
                 S_in: torch.Tensor) -> torch.Tensor:
    """Contribution of the incoming state: scale * lam^(i+1) q_i @ S_in -> [B, C, H, V] fp32/fp64
    (gates: scale * exp(G_i) q_i @ S_in).

    Local position i = 0 sees S_in decayed once (S_0 = lam S_in + k_0^T v_0), hence i + 1.
    """
    decay = as_decay(decay)
    dt = acc_dtype(q, S_in, decay.g)
    with autocast_off(q.device):
        if decay.gated:
            qd = q.to(dt) * decay.weights(q.shape[1], False, dt, q.device)[..., None]
        else:
            dec = decay_powers(decay.slopes, q.shape[1], 1, dtype=dt, device=q.device)  # [H, C]
            qd = q.to(dt) * dec.t()[None, :, :, None]  # [B, C, H, K]
        return scale * torch.einsum("bchk,bhkv->bchv", qd, S_in.to(dt))


def leaf_state(k: torch.Tensor, v: torch.Tensor, decay: DecayLike) -> torch.Tensor:
    """End state of a leaf from a zero start, b = sum_j lam^(C-1-j) k_j^T v_j -> [B, H, K, V].

    One pass over k and v (no chunk recurrence): what the scan needs before the leaf's output
    can be formed. fp32 (fp64 for fp64 inputs).
    """
    return decayed_sum(k, v, decay, k.shape[1] - 1, -1)


def state_grad_local(q: torch.Tensor, do: torch.Tensor, decay: DecayLike,
                     scale: float) -> torch.Tensor:
    """dL/dS_in through this leaf's outputs only: scale sum_i lam^(i+1) q_i^T do_i -> [B, H, K, V].

    fp32 (fp64 for fp64 inputs); one pass over q and do. The full dL/dS_in adds lam^C * G.
    """
    return decayed_sum(q, do, decay, 1, 1, scale)


def leaf_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: DecayLike,
                scale: float, S_in: Optional[torch.Tensor], backend: Optional[str] = None
                ) -> torch.Tensor:
    """Complete output of a leaf entered with state ``S_in`` (None = zero): one kernel call
    whose chunk states start from ``S_in``, so the inter term needs no extra pass.

    q, k [B, C, H, K], v [B, C, H, V] -> o [B, C, H, V] in the input dtype for "fla",
    fp32/fp64 for "torch".
    """
    decay = as_decay(decay)
    kern = resolve_kernels(backend, q, k, v)
    if kern is not None:
        # No final state is requested, so fla's partial-last-chunk final-state bug (see
        # leaf_forward) cannot reach the output; no padding needed here.
        with device_guard(q):
            return local_output(kern, q.contiguous(), k.contiguous(), v.contiguous(),
                                decay.fla_kw(q.device), scale, _state_or_none(S_in))
    with autocast_off(q.device):
        s_in = None if S_in is None else S_in.to(acc_dtype(q, k, v, S_in))
        return decay.core(q, k, v, scale, s_in, CHUNK)[0]


def torch_leaf_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: DecayLike, scale: float,
    S_in: Optional[torch.Tensor], do: torch.Tensor, G: Optional[torch.Tensor],
) -> tuple:
    """:func:`leaf_backward` of the "torch" backend: recompute the chunked forward from S_in
    under autograd and pull (do, G) back through it. The graph (and its per-chunk states) is
    freed when this call returns."""
    decay = as_decay(decay)
    dt = acc_dtype(q, k, v, S_in, decay.g)
    with torch.enable_grad(), autocast_off(q.device):
        xs = [x.detach().to(dt).requires_grad_(True) for x in (q, k, v)]
        if decay.gated:
            xs.append(decay.g.detach().to(dt).requires_grad_(True))
            local = Decay(g=xs[-1])
        else:
            local = Decay(slopes=decay.slopes.detach())
        s_in = None if S_in is None else S_in.detach().to(dt)
        o, S_end = local.core(*xs[:3], scale, s_in, CHUNK)
        outs, grads = [o], [do.to(dt)]
        if G is not None:
            outs.append(S_end)
            grads.append(G.to(dt))
        got = torch.autograd.grad(outs, xs, grads)
    dg = got[3].to(decay.g.dtype) if decay.gated else None
    return got[0].to(q.dtype), got[1].to(k.dtype), got[2].to(v.dtype), dg


def leaf_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: DecayLike, scale: float,
    S_in: Optional[torch.Tensor], do: torch.Tensor, G: Optional[torch.Tensor],
    backend: Optional[str] = None,
) -> tuple:
    """Complete ``(dq, dk, dv, dg)`` of one leaf (in q/k/v dtypes; ``dg`` in g's dtype, None
    for fixed slopes).

    S_in [B, H, K, V]: state entering the leaf (None = zero). do [B, C, H, V]: dL/do of the
    leaf's full output (o_zero + inter). G [B, H, K, V]: dL/dS_end from later leaves (None =
    zero). Includes the intra terms, the S_in term of dq and the G terms of dk and dv (and
    for gates, dg's terms through S_in and G).
    """
    decay = as_decay(decay)
    kern = resolve_kernels(backend, q, k, v)
    if kern is None:
        return torch_leaf_backward(q, k, v, decay, scale, S_in, do, G)
    with device_guard(q):
        dq, dk, dv, dg = local_backward(
            kern, q.contiguous(), k.contiguous(), v.contiguous(), do.to(v.dtype).contiguous(),
            decay.fla_kw(q.device), scale, _state_or_none(S_in), _state_or_none(G))
    dg = None if dg is None else dg.to(decay.g.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg

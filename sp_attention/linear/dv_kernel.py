"""Our Triton kernel for dv of linear attention with decay, taking the gradient that arrives at
the leaf's end from later ranks (``G``) in-kernel.

Why it exists: in the CP backward the gradient ``G = dL/dS_end`` arrives from the ranks after
this one through a scan. fla's backward consumes it in its first kernel (the gradient
recurrence ``chunk_bwd_dh``, as ``dht``), so the whole local backward waited for the scan, and
each rank first ran a separate pass over q and dO for the contribution it sends (the state sum
``d``). The recurrence is linear in ``dht``: the gradient at the end of chunk n is
``dh_n + w_n G`` with ``dh`` the recurrence from zero and ``w_n`` the decay from chunk n's end
to the leaf's end. So the recurrence runs from zero at once (its initial-state gradient *is*
``d``: the scan starts from it) and this kernel, fla's dv kernel with one more tile load, adds
``w_n G`` to each chunk's gradient before the GEMM. Per (V tile, chunk n, batch·head)::

    grad  = dh_n + w_n G                          (fp32, rounded to the input dtype once)
    dv_j  = Σ_{i ≥ j} scale (k_j·q_i) λ^(i−j) do_i + λ^(last−j) k_j grad

Decays are ``exp2`` of log2 rates: fixed per-head rates (``g_gamma``, fla's convention) with
``w_n = exp2(γ·(T − end_n))``, or per-token gates (``gc``: chunk-local log2 sums, :mod:`.gates`)
with ``w_n = exp2(Σ of the chunk sums after chunk n)`` (``suffix``: :func:`.gates.suffix_sums`
of the chunk totals, read at n + 1, never a total minus a prefix).

Layers: this kernel → :func:`chunk_dv` (launcher) → :func:`sp_attention.linear.local.local_backward`
→ :mod:`sp_attention.linear.leaves`. Reference: :func:`sp_attention.linear.gated_naive.dqkdg_ref`
(its dv, with the gradient at each chunk's end given). Needs triton (the ``gpu`` extra); runs
under ``TRITON_INTERPRET=1`` on CPU for tests.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..triton_launch import device_guard, disk_cached, launch
__all__ = ["chunk_dv", "DV_CANDIDATES"]


@triton.jit(do_not_specialize=["T", "NT"])
def _dv_kernel(q, k, do, dh, G, g_gamma, gc, suffix, dv, scale, T, NT,
               H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
               BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
               GATED: tl.constexpr, ARRIVING: tl.constexpr):
    i_v = tl.program_id(0)
    i_t = tl.program_id(1)
    i_bh = tl.program_id(2).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    tok0 = i_b * T
    q += (tok0 * H + i_h) * K
    k += (tok0 * H + i_h) * K
    do += (tok0 * H + i_h) * V
    dv += (tok0 * H + i_h) * V
    dh += ((i_b * NT + i_t) * H + i_h) * K * V

    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    last = tl.minimum(i_t * BT + BT, T) - 1
    if GATED:
        b_g = tl.load(gc + (tok0 + o_t) * H + i_h, mask=m_t, other=0.0)
        b_glast = tl.load(gc + (tok0 + last) * H + i_h)
        if ARRIVING:    # the chunk sums after chunk n (none after the last chunk)
            after = tl.load(suffix + (i_b * NT + i_t + 1) * H + i_h, mask=i_t + 1 < NT,
                            other=0.0)
            carry = tl.exp2(after)
    else:
        gamma = tl.load(g_gamma + i_h).to(tl.float32)
        b_g = gamma * (tl.arange(0, BT) + 1).to(tl.float32)
        b_glast = gamma * (last + 1 - i_t * BT).to(tl.float32)
        if ARRIVING:
            carry = tl.exp2(gamma * (T - 1 - last).to(tl.float32))
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_A = tl.zeros([BT, BT], dtype=tl.float32)          # kᵀ-side scores: A_ji = k_j·q_i
    b_dv = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_k = tl.load(k + o_t[:, None] * (H * K) + o_k[None, :],
                      mask=m_t[:, None] & m_k[None, :], other=0.0)              # [BT, BK]
        b_qt = tl.load(q + o_k[:, None] + o_t[None, :] * (H * K),
                       mask=m_k[:, None] & m_t[None, :], other=0.0)             # [BK, BT]
        b_A = tl.dot(b_k, b_qt, b_A, input_precision=PRECISION)
        p_s = o_k[:, None] * V + o_v[None, :]
        m_s = m_k[:, None] & m_v[None, :]
        b_dh = tl.load(dh + p_s, mask=m_s, other=0.0).to(tl.float32)
        if ARRIVING:
            b_dh += carry * tl.load(G + i_bh * K * V + p_s, mask=m_s, other=0.0)
        b_dv = tl.dot(b_k, b_dh.to(b_k.dtype), b_dv, input_precision=PRECISION)

    # j ≤ i inside the chunk; exponents masked before exp2 (the other triangle would overflow)
    causal = (o_t[:, None] <= o_t[None, :]) & m_t[:, None] & m_t[None, :]
    b_A = tl.where(causal, b_A * tl.exp2(tl.where(causal, b_g[None, :] - b_g[:, None], 0.0)),
                   0.0) * scale
    b_dv = b_dv * tl.where(m_t, tl.exp2(tl.where(m_t, b_glast - b_g, 0.0)), 0.0)[:, None]
    p_v = o_t[:, None] * (H * V) + o_v[None, :]
    m_ov = m_t[:, None] & m_v[None, :]
    b_do = tl.load(do + p_v, mask=m_ov, other=0.0)
    b_dv = tl.dot(b_A.to(b_do.dtype), b_do, b_dv, input_precision=PRECISION)
    tl.store(dv + p_v, b_dv.to(dv.dtype.element_ty), mask=m_ov)


# Candidate configs (BK, BV, warps, stages); fla's own dv kernel tiles K = V = 128 whole on
# Hopper with 2 or 4 warps and 2-4 stages. The autotuner is offered DV_TUNED; Triton's CPU
# interpreter runs the first candidate. Append only: tests name candidates by index.
DV_CANDIDATES = [
    triton.Config({"BK": bk, "BV": bv}, num_warps=w, num_stages=st)
    for bk, bv, w, st in ((64, 64, 4, 2), (128, 128, 4, 2), (128, 128, 4, 3), (128, 128, 2, 2),
                          (128, 128, 8, 2), (128, 64, 4, 2), (64, 128, 4, 2), (128, 64, 4, 3))
]
DV_TUNED = [1, 2, 3, 4, 5, 7]
_dv_tuned = triton.autotune(configs=[DV_CANDIDATES[i] for i in DV_TUNED],
                            key=["H", "K", "V", "BT", "PRECISION", "GATED", "ARRIVING"],
                            **disk_cached())(_dv_kernel)


def chunk_dv(q: torch.Tensor, k: torch.Tensor, do: torch.Tensor, dh: torch.Tensor,
             scale: float, chunk_size: int = 64, *, g_gamma: torch.Tensor | None = None,
             gc: torch.Tensor | None = None, G: torch.Tensor | None = None,
             suffix: torch.Tensor | None = None, config: int | None = None) -> torch.Tensor:
    """``dv [B, T, H, V]`` (in ``do``'s dtype) of rows of linear attention with decay.

    q, k ``[B, T, H, K]``, do ``[B, T, H, V]`` contiguous, one dtype; ``dh [B, N, H, K, V]``
    (``N = ceil(T / chunk_size)``): the gradient at each chunk's end of the recurrence from a
    zero end gradient (fla's ``chunk_bwd_dh`` with ``dht=None``; any float dtype). Decay: exactly
    one of ``g_gamma [H]`` (fp32 log2 rate per token) and ``gc [B, T, H]`` (fp32 chunk-local
    log2 gate sums). ``G [B, H, K, V]`` fp32: the gradient arriving at each row's end (None:
    zero), with per-token gates also ``suffix [B, N, H]`` (fp32 inclusive suffix sums of the
    chunk totals). ``config``: index into :data:`DV_CANDIDATES` (default: autotuned on the GPU,
    the first in Triton's CPU interpreter).
    """
    B, T, H, K = q.shape
    V = do.shape[-1]
    N = triton.cdiv(T, chunk_size)
    for name, t in (("q", q), ("k", k), ("do", do), ("dh", dh), ("G", G), ("suffix", suffix),
                    ("gc", gc)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"chunk_dv: {name} must be contiguous")
    if k.shape != q.shape or do.shape[:3] != q.shape[:3]:
        raise ValueError(f"chunk_dv: q {tuple(q.shape)}, k {tuple(k.shape)}, do "
                         f"{tuple(do.shape)} disagree")
    if tuple(dh.shape) != (B, N, H, K, V):
        raise ValueError(f"chunk_dv: dh must be [B, N, H, K, V] = {(B, N, H, K, V)}, got "
                         f"{tuple(dh.shape)}")
    if (g_gamma is None) == (gc is None):
        raise ValueError("chunk_dv: pass exactly one of g_gamma and gc")
    if G is not None and (tuple(G.shape) != (B, H, K, V) or G.dtype != torch.float32):
        raise ValueError(f"chunk_dv: G must be fp32 [B, H, K, V] = {(B, H, K, V)}")
    if G is not None and gc is not None and (suffix is None or tuple(suffix.shape) != (B, N, H)):
        raise ValueError(f"chunk_dv: gates with G need suffix [B, N, H] = {(B, N, H)}")
    dv = torch.empty_like(do)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    args = (q, k, do, dh, G, g_gamma, gc, suffix, dv, float(scale), T, N)
    kw = dict(H=H, K=K, V=V, BT=chunk_size, PRECISION=prec, GATED=gc is not None,
              ARRIVING=G is not None)

    def grid(meta):
        return (triton.cdiv(V, meta["BV"]), N, B * H)
    guard = device_guard(q)
    with guard:
        if config is not None or os.environ.get("TRITON_INTERPRET") == "1":
            cfg = DV_CANDIDATES[config or 0]
            _dv_kernel[grid(cfg.kwargs)](*args, **kw, num_warps=cfg.num_warps,
                                         num_stages=cfg.num_stages, **cfg.kwargs)
        else:
            launch(_dv_tuned, grid, *args, **kw)
    return dv

"""Our Triton kernel for dq, dk and dg of gated linear attention, from the chunk states.

Why it exists: fla-core 0.6.0 refuses its own gated ``chunk_bwd_dqkwg`` on Hopper with
Triton ≥ 3.4 and < 3.7.1 (it "produces incorrect results", fla #640; the GPU machines have
Triton 3.6.0). The miscompiled pattern (fla PR #826) is ``tl.trans`` of a ``tl.dot`` result
(``b_ds``, in the wgmma accumulator layout) fed back into a ``tl.dot``. This kernel never
transposes a dot result: it accumulates ``dkᵀ`` directly (``dh·vᵀ`` and ``qᵀ·ds`` with q, v
read transposed by addressing) and stores it through transposed addresses.

Per (K tile, chunk n, batch·head) program, with ``gc`` the chunk-local log2 sums of the gate
(:mod:`.gates`), ``h_n`` the state entering chunk n and ``dh_n`` the gradient at its end (fla's
``chunk_fwd_h`` / ``chunk_bwd_dh`` outputs, any float dtype)::

    ds_ij = scale · (do_i·v_j) · exp2(gc_i − gc_j) · [j ≤ i]
    dq_i  = scale · exp2(gc_i) · do_i h_nᵀ + Σ_j ds_ij k_j
    dk_j  = exp2(gc_last − gc_j) · v_j dh_nᵀ + Σ_i ds_ij q_i
    dG_i  = q_i·dq_i − k_i·dk_i
            (+ exp2(gc_last)·⟨h_n, dh_n⟩ + Σ_j exp2(gc_last − gc_j)·k_j·(v_j dh_nᵀ) at the
               chunk's last token: the chunk's ⟨dh_n, S_end⟩)
    dg_i  = Σ_{i' ≥ i in the chunk} dG_i'    (the gradient of the natural-log gate g_i)

The reverse sum runs in the kernel (``tl.cumsum(reverse=True)``); K tiles (``K > BK``) write
partial ``dg`` rows that the launcher adds. Reference: :func:`.gated_naive.dqkdg_ref`.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..triton_launch import device_guard, disk_cached, launch
__all__ = ["chunk_dqkdg", "DQK_CANDIDATES", "DQK_TUNED", "MIN_BLOCK_K", "tuned_configs", "block_k_of"]


@triton.jit(do_not_specialize=["T", "NT"])
def _dqkdg_kernel(q, k, v, do, h, dh, gc, dq, dk, dg, cu_seqlens, chunk_indices, scale, T, NT,
                  BH_T, G, g_gamma, suffix, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  PRECISION: tl.constexpr, IS_VARLEN: tl.constexpr, DK_ROWS: tl.constexpr = False,
                  GATED: tl.constexpr = True, ARRIVING: tl.constexpr = False):
    i_k = tl.program_id(0)
    i_t = tl.program_id(1)
    i_bh = tl.program_id(2).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    if IS_VARLEN:       # one row of sequences (fla's layout): chunk i_t is (sequence, chunk)
        i_tg = i_t.to(tl.int64)
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int64)
        i_t = tl.load(chunk_indices + i_t * 2 + 1)
        tok0 = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = (tl.load(cu_seqlens + i_n + 1) - tok0).to(tl.int32)
    else:
        i_tg = i_b * NT + i_t
        tok0 = i_b * T
    q += (tok0 * H + i_h) * K
    k += (tok0 * H + i_h) * K
    dq += (tok0 * H + i_h) * K
    dk += (tok0 * H + i_h) * K
    v += (tok0 * H + i_h) * V
    do += (tok0 * H + i_h) * V
    h += (i_tg * H + i_h) * K * V
    dh += (i_tg * H + i_h) * K * V
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    last = tl.minimum(i_t * BT + BT, T) - 1
    if GATED:
        gc += tok0 * H + i_h
        dg += i_k * BH_T + tok0 * H + i_h               # partial rows per K tile
        b_g = tl.load(gc + o_t * H, mask=m_t, other=0.0)
        b_glast = tl.load(gc + last * H)
        if ARRIVING:    # the chunk sums after chunk n (none after the last chunk)
            after = tl.load(suffix + (i_b * NT + i_t + 1) * H + i_h, mask=i_t + 1 < NT,
                            other=0.0)
            carry = tl.exp2(after)
    else:               # fixed per-head rates: no dg
        gamma = tl.load(g_gamma + i_h).to(tl.float32)
        b_g = gamma * (tl.arange(0, BT) + 1).to(tl.float32)
        b_glast = gamma * (last + 1 - i_t * BT).to(tl.float32)
        if ARRIVING:
            carry = tl.exp2(gamma * (T - 1 - last).to(tl.float32))
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    b_ds = tl.zeros([BT, BT], dtype=tl.float32)         # do_i·v_j
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)         # do_i h_nᵀ
    if DK_ROWS:
        b_dst = tl.zeros([BT, BT], dtype=tl.float32)    # v_j·do_i (ds transposed, its own dot)
        b_dk = tl.zeros([BT, BK], dtype=tl.float32)     # v_j dh_nᵀ
    else:
        b_dk = tl.zeros([BK, BT], dtype=tl.float32)     # (v_j dh_nᵀ)ᵀ: dk kept transposed
    b_hdh = tl.zeros([BK], dtype=tl.float32)            # ⟨h_n, dh_n⟩ by K row
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        b_do = tl.load(do + o_t[:, None] * (H * V) + o_v[None, :],
                       mask=m_t[:, None] & m_v[None, :], other=0.0)            # [BT, BV]
        m_s = m_k[:, None] & m_v[None, :]
        b_h = tl.load(h + o_k[:, None] * V + o_v[None, :], mask=m_s, other=0.0)     # [BK, BV]
        b_dh = tl.load(dh + o_k[:, None] * V + o_v[None, :], mask=m_s, other=0.0)   # [BK, BV]
        if ARRIVING:    # the gradient from later ranks, decayed to chunk n's end
            b_dh = b_dh.to(tl.float32) + carry * tl.load(
                G + i_bh * K * V + o_k[:, None] * V + o_v[None, :], mask=m_s, other=0.0)
        if GATED:
            b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=1)
        b_dq = tl.dot(b_do, tl.trans(b_h.to(b_do.dtype)), b_dq, input_precision=PRECISION)
        if DK_ROWS:
            b_v = tl.load(v + o_t[:, None] * (H * V) + o_v[None, :],
                          mask=m_t[:, None] & m_v[None, :], other=0.0)         # [BT, BV]
            b_ds = tl.dot(b_do, tl.trans(b_v), b_ds, input_precision=PRECISION)
            b_dst = tl.dot(b_v, tl.trans(b_do), b_dst, input_precision=PRECISION)
            b_dk = tl.dot(b_v, tl.trans(b_dh.to(b_v.dtype)), b_dk, input_precision=PRECISION)
        else:
            b_vt = tl.load(v + o_v[:, None] + o_t[None, :] * (H * V),
                           mask=m_v[:, None] & m_t[None, :], other=0.0)        # [BV, BT]
            b_ds = tl.dot(b_do, b_vt, b_ds, input_precision=PRECISION)
            b_dk = tl.dot(b_dh.to(b_vt.dtype), b_vt, b_dk, input_precision=PRECISION)

    m_qk = m_t[:, None] & m_k[None, :]
    b_q = tl.load(q + o_t[:, None] * (H * K) + o_k[None, :], mask=m_qk, other=0.0)   # [BT, BK]
    b_k = tl.load(k + o_t[:, None] * (H * K) + o_k[None, :], mask=m_qk, other=0.0)   # [BT, BK]
    b_dq = b_dq * (tl.exp2(b_g) * scale)[:, None]
    # exponent masked before exp2 for rows past T (their g reads 0, gc_last − 0 may be > 0)
    b_kdec = tl.where(m_t, tl.exp2(tl.where(m_t, b_glast - b_g, 0.0)), 0.0)
    causal = (o_t[:, None] >= o_t[None, :]) & m_t[:, None] & m_t[None, :]
    b_ds = tl.where(causal, b_ds * tl.exp2(tl.where(causal, b_g[:, None] - b_g[None, :], 0.0)),
                    0.0) * scale
    b_dq = tl.dot(b_ds.to(b_k.dtype), b_k, b_dq, input_precision=PRECISION)
    if DK_ROWS:
        b_dk = b_dk * b_kdec[:, None]
        if GATED:   # the chunk's ⟨dh_n, S_end⟩ through every k_j (before the intra-chunk term)
            dg_k = tl.sum(tl.sum(b_dk * b_k.to(tl.float32), axis=1), axis=0)
        causal_t = (o_t[None, :] >= o_t[:, None]) & m_t[:, None] & m_t[None, :]
        b_dst = tl.where(causal_t, b_dst * tl.exp2(
            tl.where(causal_t, b_g[None, :] - b_g[:, None], 0.0)), 0.0) * scale
        b_dk = tl.dot(b_dst.to(b_q.dtype), b_q, b_dk, input_precision=PRECISION)
        if GATED:
            b_dG = tl.sum(b_dq * b_q.to(tl.float32), axis=1) \
                - tl.sum(b_dk * b_k.to(tl.float32), axis=1)
    else:
        m_kt = m_k[:, None] & m_t[None, :]
        b_qt = tl.load(q + o_k[:, None] + o_t[None, :] * (H * K), mask=m_kt, other=0.0)
        b_dk = b_dk * b_kdec[None, :]
        if GATED:
            b_kt = tl.load(k + o_k[:, None] + o_t[None, :] * (H * K), mask=m_kt, other=0.0)
            dg_k = tl.sum(tl.sum(b_dk * b_kt.to(tl.float32), axis=1), axis=0)
        b_dk = tl.dot(b_qt, b_ds.to(b_k.dtype), b_dk, input_precision=PRECISION)
        if GATED:
            b_dG = tl.sum(b_dq * b_q.to(tl.float32), axis=1) \
                - tl.sum(b_dk * b_kt.to(tl.float32), axis=0)
    if GATED:
        # the chunk's ⟨dh_n, S_end⟩: through exp2(gc_last)·h_n and through every k_j
        dg_last = tl.sum(b_hdh, axis=0) * tl.exp2(b_glast) + dg_k
        b_dG = tl.where(o_t == last, b_dG + dg_last, b_dG)
        b_dG = tl.where(m_t, b_dG, 0.0)
        b_dg = tl.cumsum(b_dG, axis=0, reverse=True)
    tl.store(dq + o_t[:, None] * (H * K) + o_k[None, :], b_dq.to(dq.dtype.element_ty), mask=m_qk)
    if DK_ROWS:
        tl.store(dk + o_t[:, None] * (H * K) + o_k[None, :], b_dk.to(dk.dtype.element_ty),
                 mask=m_qk)
    else:
        tl.store(dk + o_k[:, None] + o_t[None, :] * (H * K), b_dk.to(dk.dtype.element_ty),
                 mask=m_k[:, None] & m_t[None, :])
    if GATED:
        tl.store(dg + o_t * H, b_dg, mask=m_t)


# Candidate configs (BV, warps, stages, DK_ROWS). BK is a launcher argument (default the whole
# K up to 128: one K tile, so dg needs no partial rows; fla's own tiling on Hopper).
# DK_ROWS=False accumulates dkᵀ from transposed loads of q, k, v; True computes dsᵀ with a
# second dot instead (one more [BT, BT] product, every load and store row-major). The
# autotuner is offered DQK_TUNED; Triton's CPU interpreter runs the first.
DQK_CANDIDATES = [
    triton.Config({"BV": bv, "DK_ROWS": rows}, num_warps=w, num_stages=st)
    for rows in (False, True)
    for bv, w, st in ((64, 4, 2), (64, 8, 2), (32, 4, 2), (64, 4, 3), (128, 8, 2), (32, 4, 3),
                      (64, 8, 1), (128, 4, 2), (128, 8, 3), (128, 4, 3), (64, 8, 3))
]
# the autotuned set: the six fastest at K = V = 128 one K tile, bf16, T 32K, H 16 on one H200
# (2026-11-24, ``benchmarks/gated_check.py --phases sweep``: 0.71–0.77 ms; the slowest
# candidates take 1.36 ms)
DQK_TUNED = [21, 5, 2, 12, 11, 20]
# K tiles of 16 are never run: on Hopper (Triton 3.6, bf16, H200 and H100, 2026-11-27) the
# kernel at a K tile of 16 faults with an illegal memory access in 4- and 8-warp configs alike,
# deterministically per (shape, config) — compute-sanitizer: "out-of-range shared or local
# address" inside the kernel — while every config ran clean at a K tile of 128 (the GPU test
# forcing each config, K = V = 128) and the autotuned ones at 32 (the HF example's head dim 32
# on GPUs). So the smallest K tile is 32; K = 16 runs as one masked tile of 32 (the same
# products, half of the tile's columns zero). Forcing every config at tiles of 32 and 64 on a
# GPU: the test's case with block_k=32 (not yet run there).
MIN_BLOCK_K = 32
# At a K tile of 32 (K up to 32, masked below it, or ``block_k=32``) the candidates with the
# dsᵀ dot (``DK_ROWS``) and 4 warps — 11 and 20 of the tuned set — compute dk and dg wrong on
# Hopper (Triton 3.6, bf16, each config forced by the GPU test, 2026-11-27: on an H200 at
# K = V = 16; on an H100 at K = V = 32 and at K = 64 in tiles of 32 with V 16 and 64, dk off by
# 63–95 %, dg by 36–71 %, dq right), while every tuned config matches at tiles of 64 and 128
# and the CPU interpreter runs them exactly (a GPU code-generation problem). The autotuner is
# never offered them there: pruned per launch, so the lists of the 64 and 128 tiles — and the
# shipped autotune results keyed on them — are unchanged.
def dsT_four_warps(cfg: triton.Config) -> bool:
    """The configs miscompiled at a K tile of 32: the dsᵀ dot with 4 warps."""
    return bool(cfg.kwargs.get("DK_ROWS")) and cfg.num_warps == 4


def _offered(cfg: triton.Config, block_k: int) -> bool:
    return block_k > MIN_BLOCK_K or not dsT_four_warps(cfg)


def tuned_configs(block_k: int) -> list[int]:
    """The candidates (indices into :data:`DQK_CANDIDATES`) the autotuner may pick at a K tile
    of ``block_k``: :data:`DQK_TUNED`, at 32 without :func:`dsT_four_warps`."""
    return [i for i in DQK_TUNED if _offered(DQK_CANDIDATES[i], block_k)]


def _prune(configs: list, named_args: dict, **kwargs) -> list:
    bk = kwargs.get("BK", named_args.get("BK"))
    return configs if bk > MIN_BLOCK_K else [c for c in configs if _offered(c, bk)]


def block_k_of(K: int, block_k: int | None = None) -> int:
    """The K tile a launch runs: ``block_k``, or the whole K up to 128, at least 32."""
    return block_k or min(max(triton.next_power_of_2(K), MIN_BLOCK_K), 128)


_KEY = ["H", "K", "V", "BT", "BK", "PRECISION", "IS_VARLEN", "GATED", "ARRIVING"]
_dqkdg_tuned = triton.autotune(configs=[DQK_CANDIDATES[i] for i in DQK_TUNED], key=_KEY,
                               prune_configs_by={"early_config_prune": _prune},
                               **disk_cached())(_dqkdg_kernel)


def chunk_dqkdg(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                h: torch.Tensor, dh: torch.Tensor, gc: torch.Tensor | None, scale: float,
                chunk_size: int = 64, config: int | None = None, block_k: int | None = None,
                cu_seqlens: torch.Tensor | None = None, chunk_indices: torch.Tensor | None = None,
                *, g_gamma: torch.Tensor | None = None, G: torch.Tensor | None = None,
                suffix: torch.Tensor | None = None) -> tuple:
    """``(dq, dk, dg)`` of gated linear attention from the chunk states (``dg`` None with
    fixed rates).

    q, k ``[B, T, H, K]``, v, do ``[B, T, H, V]`` contiguous, one dtype; ``h``, ``dh``
    ``[B, N, H, K, V]`` (``N = ceil(T / chunk_size)``): the state entering and the gradient at
    the end of each chunk (fla's ``chunk_fwd_h`` / ``chunk_bwd_dh``, any float dtype);
    ``gc [B, T, H]`` fp32 chunk-local log2 sums of the gate (:func:`.gates.gate_sums`, same
    chunk). Returns dq, dk in the input dtype and dg ``[B, T, H]`` fp32 (natural-log gate).
    fp32 inputs run IEEE fp32 dots. ``config``: index into :data:`DQK_CANDIDATES` (default:
    autotuned on the GPU over :func:`tuned_configs` of the K tile, the first in Triton's CPU
    interpreter);
    ``block_k``: the K tile, a power of two from :data:`MIN_BLOCK_K` (32) to 128 (default the
    whole K up to 128, at least 32; more tiles write partial dg rows, added here).
    ``cu_seqlens`` (int32 ``[N+1]``) with ``chunk_indices`` (int32 ``[NT, 2]``: (sequence,
    chunk) per chunk, :func:`sp_attention.linear.varlen.chunk_indices`): B = 1 holds N
    sequences (fla's varlen layout; ``h``, ``dh`` ``[1, NT, H, K, V]``, ``gc`` summed per
    sequence; tokens past ``cu_seqlens[-1]`` are not written).

    ``g_gamma [H]`` (fp32 log2 rate per token) in place of ``gc``: fixed per-head rates, no
    dg. ``G [B, H, K, V]`` fp32: the gradient arriving at each row's end, added in-kernel to
    ``dh`` decayed to every chunk's end (``dh`` then the recurrence from a zero end gradient;
    :mod:`.dv_kernel` says why); with gates also ``suffix [B, N, H]``, the inclusive suffix
    sums of the chunk totals. Not with varlen rows.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    varlen = cu_seqlens is not None
    N = chunk_indices.shape[0] if varlen else triton.cdiv(T, chunk_size)
    if varlen and (B != 1 or chunk_indices.dim() != 2):
        raise ValueError("chunk_dqkdg: varlen needs B = 1 and chunk_indices [NT, 2]")
    gated = gc is not None
    if gated == (g_gamma is not None):
        raise ValueError("chunk_dqkdg: pass exactly one of gc and g_gamma")
    if G is not None:
        if varlen:
            raise ValueError("chunk_dqkdg: G (an arriving gradient) takes rows, not varlen")
        if tuple(G.shape) != (B, H, K, V) or G.dtype != torch.float32:
            raise ValueError(f"chunk_dqkdg: G must be fp32 [B, H, K, V] = {(B, H, K, V)}")
        if gated and (suffix is None or tuple(suffix.shape) != (B, N, H)):
            raise ValueError(f"chunk_dqkdg: gates with G need suffix [B, N, H] = {(B, N, H)}")
    for name, t in (("q", q), ("k", k), ("v", v), ("do", do), ("h", h), ("dh", dh), ("gc", gc),
                    ("G", G), ("suffix", suffix)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"chunk_dqkdg: {name} must be contiguous")
    if k.shape != q.shape or v.shape[:3] != q.shape[:3] or do.shape != v.shape:
        raise ValueError(f"chunk_dqkdg: q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                         f"{tuple(v.shape)}, do {tuple(do.shape)} disagree")
    if tuple(h.shape) != (B, N, H, K, V) or h.shape != dh.shape:
        raise ValueError(f"chunk_dqkdg: h, dh must be [B, N, H, K, V] = {(B, N, H, K, V)}")
    if gated and (tuple(gc.shape) != (B, T, H) or gc.dtype != torch.float32):
        raise ValueError(f"chunk_dqkdg: gc must be fp32 [B, T, H] = {(B, T, H)}")
    if block_k is not None and (block_k < MIN_BLOCK_K or block_k > 128
                                or block_k & (block_k - 1)):
        raise ValueError(f"chunk_dqkdg: block_k={block_k}; use a power of two from "
                         f"{MIN_BLOCK_K} to 128 (K tiles of 16 fault on Hopper: "
                         f"MIN_BLOCK_K's comment), or None for the default")
    BK = block_k_of(K, block_k)
    nk = triton.cdiv(K, BK)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    dg = torch.empty(nk, B, T, H, device=q.device, dtype=torch.float32) if gated else None
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    guard = device_guard(q)
    args = (q, k, v, do, h, dh, gc, dq, dk, dg, cu_seqlens, chunk_indices, float(scale), T, N,
            B * T * H, G, g_gamma, suffix)
    kw = dict(H=H, K=K, V=V, BT=chunk_size, BK=BK, PRECISION=prec, IS_VARLEN=varlen,
              GATED=gated, ARRIVING=G is not None)
    with guard:
        if config is not None or interpret:
            cfg = DQK_CANDIDATES[config or 0]
            _dqkdg_kernel[(nk, N, B * H)](*args, **kw, num_warps=cfg.num_warps,
                                          num_stages=cfg.num_stages, **cfg.kwargs)
        else:
            launch(_dqkdg_tuned, (nk, N, B * H), *args, **kw)
    if not gated:
        return dq, dk, None
    return dq, dk, (dg[0] if nk == 1 else dg.sum(0))

"""Triton kernels of the CP linear attention: a leaf's output from its zero-start chunk states
plus the state entering it, and a leaf's decay-weighted state sum in one pass.

``output_from_states``

Why it exists: the CP forward needs the state ``S_in`` that enters each leaf, which arrives
from other ranks. fla's forward consumes ``S_in`` in its first kernel (the chunk recurrence
``chunk_fwd_h``), so nothing could run while the scan is in flight. The recurrence is linear
in its start, so the states entering chunk ``n`` are ``h_n + λ^(n·BT) S_in`` with ``h`` the
zero-start states: ``chunk_fwd_h`` can run from zero while the scan runs on a side stream, and
this kernel (fla's output kernel with one more tile load) adds ``λ^(n·BT) S_in`` to each chunk
state in fp32 before the output GEMMs. Per (V tile, chunk, batch·head) program::

    state = h_n + λ^(n·BT) S_in                 (fp32, rounded to the input dtype once)
    o_i   = scale · ( λ^(i+1) q_i state + Σ_{j<=i} λ^(i−j) (q_i·k_j) v_j )

``add_entering_state``: the other order (``LinearTuning.forward_schedule="output_first"``): the
output from the zero-start states runs while the scan is in flight, and this kernel adds
``scale · λ^(t+1) q_t S_in`` afterwards — one read of q, one read and write of o, and chunks
whose weights underflow to 0 skipped.

``decayed_state_sum``: ``Σ_t λ^(base + step·t) x_tᵀ y_t`` per (batch, head) in fp32 — the
leaf's zero-start end state (``x = k, y = v``, weights ``λ^(C−1−t)``) or its state-gradient
contribution (``x = q, y = dO``, weights ``λ^(t+1)``). One read of x and y (a GEMM over
torch would first write the weighted x), split over the sequence for parallelism; the
split partial sums are added in a fixed order (deterministic).

Layers: these kernels → :func:`output_from_states`, :func:`add_entering_state` (launchers) →
the leaf routines of :mod:`sp_attention.linear.leaves` → :func:`sp_attention.linear.lightning_attention`.
References: :func:`sp_attention.linear.naive.output_from_states_ref` and
:func:`sp_attention.linear.naive.decayed_state_sum_ref`. Decays are ``exp2`` of
``g_gamma = −slope / ln 2`` times integer positions (fla's convention, see ``fla_ops.py``).
Needs triton (the ``gpu`` extra); runs under ``TRITON_INTERPRET=1`` on CPU for tests.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ..caches import to_device
from ..triton_launch import device_guard, disk_cached, launch
from .gates import GateSums, suffix_sums

# Candidate configs (BK, BV, warps, stages); pass ``config=`` to force one. Measured on an H200
# at 32K, B 1, H 16, K = V = 128 (2026-11-23, benchmarks/linear_kernels.py): the stages hold the
# fp32 S_in tile beside q, k and h in shared memory, so the pipelined configs fit one program
# per SM: [64, 64] x 3 stages 0.342 ms, fla's [128, 128] tiles 0.438; one stage over the whole
# K (128 x 64, 4 warps) 0.241 ms, as fast as fla's own output kernel beside it (0.245).
# The autotuner is offered that one and [64, 64] x 2 stages (0.289; the better fit for K = 64);
# Triton's CPU interpreter runs the first of them.
OUTPUT_CANDIDATES = [
    triton.Config({"BK": bk, "BV": bv}, num_warps=w, num_stages=st)
    for bk, bv, w, st in ((64, 64, 4, 3), (128, 64, 8, 2), (64, 128, 8, 2), (32, 32, 2, 3),
                          (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 4),
                          # fewer pipeline stages: each stage also holds the fp32 S_in tile in
                          # shared memory (3 stages of [64, 64]: 120 KB, one program per SM)
                          (64, 64, 4, 1), (64, 64, 4, 2), (128, 64, 4, 1), (128, 64, 8, 1),
                          (64, 128, 4, 1), (128, 128, 8, 1))
]
_CONFIGS = [OUTPUT_CANDIDATES[9], OUTPUT_CANDIDATES[8]]


@triton.jit
def _chunk_log_decays(g_gamma, gc, prefix, tok0, o_t, m_t, i_b, i_t, i_h, NT,
                      H: tl.constexpr, BT: tl.constexpr, USE_G: tl.constexpr):
    """Chunk n's ``(before, b_g)``: log2 of the decay from the leaf's start to the chunk's
    start, and each of its tokens' log2 decay from there, inclusive (fixed rates:
    ``g_gamma·n·BT`` and ``g_gamma·(i+1)``; gates: the leaf's sum before chunk n and the
    chunk-local sums ``gc``)."""
    if USE_G:
        b_g = tl.load(gc + (tok0 + o_t) * H + i_h, mask=m_t, other=0.0)
        before = tl.load(prefix + ((i_b * NT + i_t - 1) * H + i_h), mask=i_t > 0, other=0.0)
    else:
        gamma = tl.load(g_gamma + i_h).to(tl.float32)  # log2 of the per-token decay (<= 0)
        before = gamma * (i_t * BT).to(tl.float32)
        b_g = gamma * (tl.arange(0, BT) + 1).to(tl.float32)
    return before, b_g


@triton.jit(do_not_specialize=["T", "NT"])
def _output_from_states_kernel(q, k, v, h, s_in, g_gamma, gc, prefix, o, scale, T, NT,
                               H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                               BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                               PRECISION: tl.constexpr, USE_G: tl.constexpr):
    i_v = tl.program_id(0)
    i_t = tl.program_id(1)
    i_bh = tl.program_id(2).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    tok0 = i_b * T                                      # first token of this batch row
    q += (tok0 * H + i_h) * K
    k += (tok0 * H + i_h) * K
    v += (tok0 * H + i_h) * V
    o += (tok0 * H + i_h) * V
    h += ((i_b * NT + i_t) * H + i_h) * K * V
    s_in += i_bh * K * V

    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    if USE_G:
        # per-token gates: chunk-local log2 sums, and the leaf's sum before chunk n
        b_g = tl.load(gc + (tok0 + o_t) * H + i_h, mask=m_t, other=0.0)
        before = tl.load(prefix + ((i_b * NT + i_t - 1) * H + i_h), mask=i_t > 0, other=0.0)
        carry = tl.exp2(before)                         # S_in decayed to chunk n
    else:
        gamma = tl.load(g_gamma + i_h).to(tl.float32)  # log2 of the per-token decay (<= 0)
        carry = tl.exp2(gamma * (i_t * BT).to(tl.float32))  # λ^(n·BT): S_in decayed to chunk n
        b_g = gamma * (tl.arange(0, BT) + 1).to(tl.float32)    # log2 λ^(i+1), local i
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    b_A = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_q = tl.load(q + o_t[:, None] * (H * K) + o_k[None, :],
                      mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_k = tl.load(k + o_k[:, None] + o_t[None, :] * (H * K),
                      mask=m_k[:, None] & m_t[None, :], other=0.0)
        p_s = o_k[:, None] * V + o_v[None, :]
        m_s = m_k[:, None] & m_v[None, :]
        b_s = tl.load(h + p_s, mask=m_s, other=0.0).to(tl.float32) \
            + carry * tl.load(s_in + p_s, mask=m_s, other=0.0)
        b_o = tl.dot(b_q, b_s.to(b_q.dtype), b_o, input_precision=PRECISION)
        b_A = tl.dot(b_q, b_k, b_A, input_precision=PRECISION)

    b_o = b_o * tl.exp2(b_g)[:, None]
    causal = (o_t[:, None] >= o_t[None, :]) & m_t[:, None] & m_t[None, :]
    # exponent masked before exp2: the upper triangle would be λ^(negative) = overflow
    b_A = tl.where(causal, b_A * tl.exp2(tl.where(causal, b_g[:, None] - b_g[None, :], 0.0)), 0.0)
    p_v = o_t[:, None] * (H * V) + o_v[None, :]
    m_ov = m_t[:, None] & m_v[None, :]
    b_v = tl.load(v + p_v, mask=m_ov, other=0.0)
    b_o = (b_o + tl.dot(b_A.to(b_v.dtype), b_v, input_precision=PRECISION)) * scale
    tl.store(o + p_v, b_o.to(o.dtype.element_ty), mask=m_ov)


# Autotuned on the GPU; Triton's CPU interpreter has no benchmarker, so there the first config
# is used as it is.
_output_from_states_tuned = triton.autotune(configs=_CONFIGS, **disk_cached(),
                                           key=["H", "K", "V", "BT", "PRECISION", "USE_G"])(
    _output_from_states_kernel)


def output_from_states(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h: torch.Tensor,
                       S_in: torch.Tensor, g_gamma: torch.Tensor | None, scale: float,
                       chunk_size: int = 64, config: int | None = None,
                       gates: GateSums | None = None) -> torch.Tensor:
    """Launch the kernel: ``o [B, T, H, V]`` in ``v.dtype``.

    q, k ``[B, T, H, K]``, v ``[B, T, H, V]`` contiguous; ``h [B, N, H, K, V]`` the zero-start
    states entering each chunk (``N = ceil(T / chunk_size)``, fla's ``chunk_fwd_h`` layout, any
    float dtype); ``S_in [B, H, K, V]`` fp32, the state entering the leaf; ``g_gamma [H]`` fp32
    log2 decay per token (``−slope / ln 2``). ``config``: index into
    :data:`OUTPUT_CANDIDATES` (default: autotuned over the offered :data:`_CONFIGS` on
    the GPU, their first in Triton's CPU interpreter). ``gates``: per-token decays
    (:func:`sp_attention.linear.gates.gate_sums` of the rows, same ``chunk_size``) in place
    of ``g_gamma`` (None then): the state entering chunk n is ``h_n + exp2(prefix_{n−1}) S_in``
    and the decays inside a chunk are ``exp2(gc_i − gc_j)``.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = triton.cdiv(T, chunk_size)
    for name, t in (("q", q), ("k", k), ("v", v), ("h", h), ("S_in", S_in)):
        if not t.is_contiguous():
            raise ValueError(f"output_from_states: {name} must be contiguous")
    if k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree")
    if tuple(h.shape) != (B, N, H, K, V):
        raise ValueError(f"h must be [B, N, H, K, V] = {(B, N, H, K, V)}, got {tuple(h.shape)}")
    if tuple(S_in.shape) != (B, H, K, V) or S_in.dtype != torch.float32:
        raise ValueError(f"S_in must be fp32 [B, H, K, V] = {(B, H, K, V)}, got "
                         f"{S_in.dtype} {tuple(S_in.shape)}")
    o = torch.empty_like(v)

    def grid(meta):
        return (triton.cdiv(V, meta["BV"]), N, B * H)
    if (gates is None) == (g_gamma is None):
        raise ValueError("output_from_states: pass exactly one of g_gamma and gates")
    gc, prefix = (gates.gc, gates.prefix) if gates is not None else (g_gamma, g_gamma)
    args = (q, k, v, h, S_in, g_gamma, gc, prefix, o, float(scale), T, N)
    kw = dict(H=H, K=K, V=V, BT=chunk_size, PRECISION=_precision(q), USE_G=gates is not None)
    _launch(_output_from_states_kernel, _output_from_states_tuned, _CONFIGS[0],
            OUTPUT_CANDIDATES, config, grid, args, kw, q.device)
    return o


def _precision(x: torch.Tensor) -> str:
    """The dots' input precision: fp32 inputs get IEEE fp32 dots (fp32-accurate results);
    Triton's default for fp32 is TF32 (10-bit mantissa: ~1.5e-3 relative RMS on an H200).
    16-bit inputs are unaffected."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _launch(kernel, tuned, first: triton.Config, candidates: list, config: int | None,
            grid, args: tuple, kw: dict, device: torch.device) -> None:
    """Launch ``kernel`` with candidate ``config`` (tests), or ``first`` in Triton's CPU
    interpreter (no benchmarker there), else through its autotuner ``tuned``."""
    guard = device_guard(device)
    with guard:
        if config is not None or os.environ.get("TRITON_INTERPRET") == "1":
            cfg = first if config is None else candidates[config]
            kernel[grid(cfg.kwargs)](*args, **kw, num_warps=cfg.num_warps,
                                     num_stages=cfg.num_stages, **cfg.kwargs)
        else:
            launch(tuned, grid, *args, **kw)


@triton.jit(do_not_specialize=["T", "NT"])
def _entering_state_kernel(q, s_in, g_gamma, gc, prefix, o, scale, T, NT,
                           H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                           BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                           PRECISION: tl.constexpr, USE_G: tl.constexpr):
    i_v = tl.program_id(0)
    i_t = tl.program_id(1)
    i_bh = tl.program_id(2).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    tok0 = i_b * T
    q += (tok0 * H + i_h) * K
    o += (tok0 * H + i_h) * V
    s_in += i_bh * K * V
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    before, b_g = _chunk_log_decays(g_gamma, gc, prefix, tok0, o_t, m_t, i_b, i_t, i_h, NT,
                                    H, BT, USE_G)
    b_g = before + b_g                                  # log2 of S_in's decay to token t
    # rows past T masked before exp2; decays <= 1, so the block's first row weighs the most:
    # a block whose weights all underflow to 0 in fp32 adds exactly nothing and is skipped
    w = tl.where(m_t, tl.exp2(tl.where(m_t, b_g, 0.0)), 0.0) * scale
    if tl.max(w, axis=0) > 0.0:
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        acc = tl.zeros([BT, BV], dtype=tl.float32)
        for i_k in range(tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < K
            b_q = tl.load(q + o_t[:, None] * (H * K) + o_k[None, :],
                          mask=m_t[:, None] & m_k[None, :], other=0.0)
            b_s = tl.load(s_in + o_k[:, None] * V + o_v[None, :],
                          mask=m_k[:, None] & m_v[None, :], other=0.0)
            acc = tl.dot(b_q, b_s.to(b_q.dtype), acc, input_precision=PRECISION)
        p_o = o_t[:, None] * (H * V) + o_v[None, :]
        m_o = m_t[:, None] & m_v[None, :]
        b_o = tl.load(o + p_o, mask=m_o, other=0.0).to(tl.float32) + acc * w[:, None]
        tl.store(o + p_o, b_o.to(o.dtype.element_ty), mask=m_o)


# Candidate configs (BK, BV, warps, stages) of the entering state's part; the first is what
# Triton's CPU interpreter runs. Append only: tests name candidates by index.
ENTERING_CANDIDATES = [
    triton.Config({"BK": bk, "BV": bv}, num_warps=w, num_stages=st)
    for bk, bv, w, st in ((64, 64, 4, 2), (128, 64, 4, 1), (128, 128, 8, 1), (64, 128, 4, 2))
]
_entering_state_tuned = triton.autotune(configs=ENTERING_CANDIDATES, **disk_cached(),
                                        key=["H", "K", "V", "BT", "PRECISION", "USE_G"],
                                        restore_value=["o"])(_entering_state_kernel)


def add_entering_state(o: torch.Tensor, q: torch.Tensor, S_in: torch.Tensor,
                       g_gamma: torch.Tensor | None, scale: float, chunk_size: int = 64,
                       config: int | None = None, gates: GateSums | None = None
                       ) -> torch.Tensor:
    """Add the part of a leaf's output that the state entering it makes, in place:
    ``o_t += scale · λ^(t+1) q_t S_in`` (gates: ``exp2(prefix_{n−1} + gc_t)`` for token t of
    chunk n) — ``o`` from the zero-start states (fla's ``chunk_fwd_o``) then equals
    :func:`output_from_states` with ``S_in``. Returns ``o``.

    o ``[B, T, H, V]`` and q ``[B, T, H, K]`` contiguous; ``S_in [B, H, K, V]`` fp32, rounded to
    q's dtype for the tensor-core product as :func:`output_from_states` rounds its states;
    the product is weighted and added in fp32, and ``o`` is rounded once more. Chunks of
    ``chunk_size`` tokens whose weights all underflow to 0 in fp32 (fast decays, long leaves)
    are skipped: they add exactly nothing. ``config``: index into
    :data:`ENTERING_CANDIDATES` (default: autotuned on the GPU, the first in Triton's CPU
    interpreter)."""
    B, T, H, K = q.shape
    V = o.shape[-1]
    N = triton.cdiv(T, chunk_size)
    for name, t in (("o", o), ("q", q), ("S_in", S_in)):
        if not t.is_contiguous():
            raise ValueError(f"add_entering_state: {name} must be contiguous")
    if o.shape[:3] != q.shape[:3]:
        raise ValueError(f"add_entering_state: o {tuple(o.shape)} and q {tuple(q.shape)} disagree")
    if tuple(S_in.shape) != (B, H, K, V) or S_in.dtype != torch.float32:
        raise ValueError(f"S_in must be fp32 [B, H, K, V] = {(B, H, K, V)}, got "
                         f"{S_in.dtype} {tuple(S_in.shape)}")
    if (gates is None) == (g_gamma is None):
        raise ValueError("add_entering_state: pass exactly one of g_gamma and gates")
    gc, prefix = (gates.gc, gates.prefix) if gates is not None else (g_gamma, g_gamma)

    def grid(meta):
        return (triton.cdiv(V, meta["BV"]), N, B * H)
    args = (q, S_in, g_gamma, gc, prefix, o, float(scale), T, N)
    kw = dict(H=H, K=K, V=V, BT=chunk_size, PRECISION=_precision(q), USE_G=gates is not None)
    _launch(_entering_state_kernel, _entering_state_tuned, ENTERING_CANDIDATES[0],
            ENTERING_CANDIDATES, config, grid, args, kw, q.device)
    return o


@triton.jit(do_not_specialize=["T", "n_per_split", "sx", "sy", "sg", "sp", "n_pieces"])
def _decayed_state_sum_kernel(x, y, g_gamma, gc, prefix, part, scale, T, n_per_split, base,
                              step, sx, sy, sg, sp, pieces, n_pieces,
                              H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                              BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                              X_ROWS: tl.constexpr, USE_G: tl.constexpr,
                              WEIGHT_Y: tl.constexpr = False, BL: tl.constexpr = 64,
                              PIECES: tl.constexpr = False):
    i_kv = tl.program_id(0)
    i_s = tl.program_id(1)
    i_bh = tl.program_id(2).to(tl.int64)
    NV = tl.cdiv(V, BV)
    i_k = i_kv // NV
    i_v = i_kv % NV
    i_h = i_bh % H
    if PIECES:      # program i_bh: (row, piece, head); the piece's (start, length) from pieces
        i_b = i_bh // (n_pieces * H)
        i_j = (i_bh // H) % n_pieces
        tok0 = tl.load(pieces + i_j * 2).to(tl.int64)
        T = tl.load(pieces + i_j * 2 + 1)
        base = tl.where(step < 0, T - 1, base)          # each piece's own end state
        x += tok0 * (H * K)
        y += tok0 * (H * V)
    else:
        i_b = i_bh // H
    x += i_b * sx + i_h * K                             # rows may be strided (sx, sy)
    y += i_b * sy + i_h * V
    if USE_G:
        gc += i_b * sg + i_h
        # step > 0: ``prefix`` holds the inclusive sums over chunks 0 … c (the weight of t in
        # chunk c is exp2(prefix_{c−1} + gc_t)); step < 0: the inclusive sums over chunks
        # c … last (the end-state weight exp2(Σ_{s>t} g) is exp2(suffix_c − gc_t): never the
        # leaf's total minus a long prefix, which cancels once a very negative gate precedes t)
        prefix += i_b * sp + i_h
        back = tl.where(step < 0, 0, 1)                 # the chunk whose sum t adds to gc_t
    else:
        gamma = tl.load(g_gamma + i_h).to(tl.float32)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    acc = tl.zeros([BK, BV], dtype=tl.float32)
    # BL tokens (BL // BT gate chunks) per iteration; the split covers chunks [c_lo, c_hi)
    c_lo = i_s * n_per_split
    c_hi = (i_s + 1) * n_per_split
    if PIECES:                                          # pieces shorter than the longest
        c_hi = tl.minimum(c_hi, tl.cdiv(T, BT))
    for c in range(c_lo, c_hi, BL // BT):
        o_t = c * BT + tl.arange(0, BL)
        if BL == BT:
            m_t = o_t < T
        else:
            # the split's last block may pass its range when n_per_split is no multiple of BL/BT
            m_t = (o_t < T) & (o_t < c_hi * BT)
        if USE_G:
            # the chunk sums t's weight takes: before t's chunk (step > 0), from it on (< 0)
            if BL == BT:
                before = tl.load(prefix + (c - back) * H, mask=(c >= back) & (c * BT < T),
                                 other=0.0)
            else:
                # per token: the sum over the gate chunks before t's own / from it (gathered)
                c_t = o_t // BT
                before = tl.load(prefix + (c_t - back) * H, mask=m_t & (c_t >= back),
                                 other=0.0)
            G = tl.load(gc + o_t * H, mask=m_t, other=0.0)
            # exponent <= 0 inside the leaf; rows past T masked before exp2 (inf * 0)
            w = tl.exp2(tl.where(m_t, tl.where(step < 0, before - G, before + G), 0.0))
        else:
            # exponent >= 0 inside the leaf (w <= 1); rows past T masked before exp2 (inf * 0)
            w = tl.exp2(gamma * tl.where(m_t, base + step * o_t, 0).to(tl.float32))
        b_y = tl.load(y + o_t[:, None] * (H * V) + o_v[None, :], mask=m_t[:, None] & m_v[None, :],
                      other=0.0)
        if WEIGHT_Y:
            # [BK, BL] x transposed by addressing, fed to the dot as loaded; y [BL, BV] weighted
            b_x = tl.load(x + o_k[:, None] + o_t[None, :] * (H * K),
                          mask=m_k[:, None] & m_t[None, :], other=0.0)
            b_y = (b_y.to(tl.float32) * w[:, None]).to(b_y.dtype)
        elif X_ROWS:
            # [BL, BK] as stored (K contiguous), weighted in fp32, fed transposed to the dot
            b_x = tl.load(x + o_t[:, None] * (H * K) + o_k[None, :],
                          mask=m_t[:, None] & m_k[None, :], other=0.0)
            b_x = tl.trans((b_x.to(tl.float32) * w[:, None]).to(b_x.dtype))
        else:
            # [BK, BL]: x transposed by addressing
            b_x = tl.load(x + o_k[:, None] + o_t[None, :] * (H * K),
                          mask=m_k[:, None] & m_t[None, :], other=0.0)
            b_x = (b_x.to(tl.float32) * w[None, :]).to(b_x.dtype)
        acc = tl.dot(b_x, b_y, acc)
    p = part + ((i_s * tl.num_programs(2) + i_bh) * K + o_k[:, None]) * V + o_v[None, :]
    tl.store(p, acc * scale, mask=m_k[:, None] & m_v[None, :])


# Candidate configs (tile shape, how x is read, warps, stages); the grid's split count does not
# depend on the config, so every config writes the same partial sums. Measured on an H200 at
# 32K, B 1, H 16, K = V = 128 (2026-11-23): x read as stored (X_ROWS=1) with [64, 64] tiles
# 0.195 ms, the transposed read 0.235 ms, [128, 128] tiles 0.24-0.25 ms. Every candidate passed
# test_our_kernels_every_config_gpu on the H200 (2026-11-23); the autotuner is offered the
# first (what Triton's CPU interpreter runs) and the two [64, 64] reads as stored: in a
# rank program at 32K its pick took 0.186 ms (0.225 ms with the first alone).
# Since 2026-11-24 also y weighted in place of x (WEIGHT_Y: x goes to the dot as loaded),
# candidates 9 on. BL: tokens per loop iteration (one dot of depth BL), 64 (one gate chunk, all
# candidates 0-14) or 128 / 256 (2 or 4 gate chunks; each token finds its chunk's prefix by a
# gathered load): at 32K candidate 5 spends 0.239 ms on ~30 latency-bound 64-deep dots per
# program where reading q and dO once costs ~0.06 ms. Candidates 15 on: BL > 64 (all
# compile for sm_90, at most 98 KB of shared memory; measured below). Append only: tests and
# benchmarks name candidates by index.
STATE_CANDIDATES = [
    triton.Config({"BK": bk, "BV": bv, "X_ROWS": xr, "WEIGHT_Y": wy, "BL": bl}, num_warps=w,
                  num_stages=st)
    for bk, bv, xr, wy, w, st, bl in (
        (64, 64, 0, 0, 4, 3, 64), (128, 128, 0, 0, 8, 2, 64), (128, 128, 1, 0, 8, 2, 64),
        (128, 128, 1, 0, 8, 3, 64), (64, 64, 1, 0, 4, 3, 64), (64, 64, 1, 0, 4, 4, 64),
        (64, 128, 1, 0, 4, 3, 64), (128, 64, 1, 0, 8, 3, 64), (64, 64, 0, 0, 4, 4, 64),
        (64, 64, 0, 1, 4, 3, 64), (64, 64, 0, 1, 4, 4, 64), (128, 128, 0, 1, 8, 2, 64),
        (128, 64, 0, 1, 8, 3, 64), (64, 128, 0, 1, 4, 3, 64), (128, 128, 0, 1, 8, 3, 64),
        # 15-: BL > 64
        (64, 64, 1, 0, 4, 3, 128), (64, 64, 1, 0, 4, 4, 128), (64, 64, 1, 0, 4, 3, 256),
        (64, 64, 1, 0, 4, 4, 256), (128, 128, 1, 0, 8, 2, 128), (64, 128, 1, 0, 4, 3, 128),
        (64, 128, 1, 0, 8, 3, 128), (64, 128, 1, 0, 8, 2, 256), (64, 64, 0, 1, 4, 3, 128),
        (64, 64, 1, 0, 8, 3, 256))
]
# Offered to the autotuner: candidate 19 ([128, 128] tiles, x as stored, 128 tokens per dot)
# was the fastest of all 25 in every case of the 2026-11-24 sweep on an H200 (32K, H 16,
# K = V = 128, bf16; `benchmarks/gated_check.py --phases sweep --sweep state`): gated state
# gradient 0.159 ms (candidate 5: 0.241), gated end state 0.166 (0.238), fixed slopes 0.137
# (0.160); 4 and 5 stay for other shapes, 0 is what Triton's CPU interpreter runs.
_STATE_CONFIGS = [STATE_CANDIDATES[i] for i in (19, 0, 4, 5)]
_decayed_state_sum_tuned = triton.autotune(configs=_STATE_CONFIGS, **disk_cached(),
                                           key=["H", "K", "V", "USE_G", "PIECES"])(
    _decayed_state_sum_kernel)


@functools.lru_cache(maxsize=64)      # one entry per CUDA device index
def _sm_count(index) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def decayed_state_sum(x: torch.Tensor, y: torch.Tensor, g_gamma: torch.Tensor | None, base: int,
                      step: int, splits: int | None = None, scale: float = 1.0,
                      config: int | None = None, gates: GateSums | None = None,
                      pieces: tuple | None = None) -> torch.Tensor:
    """``scale · Σ_t exp2(g_gamma·(base + step·t)) x_tᵀ y_t`` -> ``[B, H, K, V]`` fp32.

    x ``[B, T, H, K]``, y ``[B, T, H, V]``, one 16-bit dtype, each row ``x[b]`` contiguous (the
    rows themselves may be strided, e.g. every other leaf of a batch of leaves); the weighted x
    is rounded to the input dtype before the tensor-core product, as the chunk kernels round
    their operands. ``base + step·t >= 0`` for every t (weights ≤ 1). ``splits``: sequence
    pieces summed at the end in a fixed order (default: about two programs per SM per tile; at
    most this many, each a multiple of 256 tokens but the last).
    ``config``: index into :data:`STATE_CANDIDATES` (default: autotuned over the offered
    :data:`_STATE_CONFIGS` on the GPU, their first in Triton's CPU interpreter).
    ``gates``: per-token decays in place of ``g_gamma`` (None then; rows ``gc[b]`` and
    ``prefix[b]`` contiguous, strided like x's rows; ``base`` unused): ``step > 0`` weighs
    by ``exp(G_t)`` with G the row's inclusive sum of g at t (the state-gradient
    contribution of a gated leaf, x = q, y = dO), ``step < 0`` by ``exp(Σ_{s>t} g_s)`` (its
    end state from zero, x = k, y = v; summed from the row's end, :func:`.gates.suffix_sums`
    of the chunk totals, one more small op).
    ``pieces``: ``((start, length), ...)`` token ranges of every row, summed each on its own in
    one launch (fixed rates only; ``step < 0`` takes each piece's own ``base = length − 1``):
    ``[B, len(pieces), H, K, V]``.
    """
    B, T, H, K = x.shape
    V = y.shape[-1]
    n_pieces, bounds = 1, None
    if pieces is not None:
        if gates is not None:
            raise ValueError("decayed_state_sum: pieces take fixed rates (g_gamma) only")
        if not pieces or any(a < 0 or n < 1 or a + n > T for a, n in pieces):
            raise ValueError(f"decayed_state_sum: pieces {pieces} must be non-empty ranges "
                             f"inside the {T} tokens")
        n_pieces, T = len(pieces), max(n for _, n in pieces)
        bounds = _piece_bounds(tuple(pieces), x.device)
        base = base if step > 0 else T - 1              # checked below for the longest piece
    if not (x[0].is_contiguous() and y[0].is_contiguous()) or y.shape[:3] != x.shape[:3]:
        raise ValueError(f"decayed_state_sum: x {tuple(x.shape)} and y {tuple(y.shape)} must have "
                         "contiguous rows and equal B, T, H")
    if (gates is None) == (g_gamma is None):
        raise ValueError("decayed_state_sum: pass exactly one of g_gamma and gates")
    if gates is None and min(base, base + step * (T - 1)) < 0:
        raise ValueError("decayed_state_sum: base + step·t must be >= 0 for every t")
    BT = 64
    n_chunks = triton.cdiv(T, BT)
    if splits is None:
        sms = _sm_count(x.device.index) if x.is_cuda else 8
        splits = max(1, min(n_chunks, triton.cdiv(2 * sms, B * H)))
    # chunks per split: a multiple of the largest BL // BT (4), so no BL block crosses a split
    per = 4 * triton.cdiv(triton.cdiv(n_chunks, splits), 4)
    splits = triton.cdiv(n_chunks, per)
    part = torch.empty(splits, B * n_pieces, H, K, V, device=x.device, dtype=torch.float32)

    def grid(meta):
        return (triton.cdiv(K, meta["BK"]) * triton.cdiv(V, meta["BV"]), splits,
                B * n_pieces * H)
    if gates is not None:
        gc = gates.gc
        # step < 0: the sums over chunks c … last in place of the prefixes (see the kernel)
        prefix = gates.prefix if step > 0 else suffix_sums(gates.tot)
        if not (gc[0].is_contiguous() and prefix[0].is_contiguous()) or gc.shape != x.shape[:3]:
            raise ValueError("decayed_state_sum: gates must be [B, T, H] with contiguous rows")
        if prefix.shape[1] != triton.cdiv(T, 64):
            raise ValueError("decayed_state_sum: gates must be summed in chunks of 64")
        sg, sp = gc.stride(0), prefix.stride(0)
    else:
        gc, prefix, sg, sp = g_gamma, g_gamma, 0, 0
    args = (x, y, g_gamma, gc, prefix, part, float(scale), T, per, base, step, x.stride(0),
            y.stride(0), sg, sp, bounds, n_pieces)
    kw = dict(H=H, K=K, V=V, BT=BT, USE_G=gates is not None, PIECES=pieces is not None)
    _launch(_decayed_state_sum_kernel, _decayed_state_sum_tuned, STATE_CANDIDATES[0],
            STATE_CANDIDATES, config, grid, args, kw, x.device)
    out = part[0] if splits == 1 else part.sum(0)
    return out if pieces is None else out.view(B, n_pieces, H, K, V)


@functools.lru_cache(maxsize=128)
def _piece_bounds(pieces: tuple, device: torch.device) -> torch.Tensor:
    """int32 ``[N, 2]`` (start, length) per piece on ``device`` (cached: one plan, many
    layers)."""
    return to_device(torch.tensor(pieces, dtype=torch.int32).reshape(-1, 2), device)

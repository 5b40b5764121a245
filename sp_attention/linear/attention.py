"""Context-parallel linear attention with per-head decay: autograd Function and public function.

Per rank: view the shard's leaves (1 contiguous, 2 zigzag) as the rows of one batch, run the
chunk recurrence from zero (its final state is each leaf's zero-start end state ``b``), and
scan the fp32 elements ``(λ^C, b)`` across ranks into every leaf's incoming state ``S_in`` (on
GPU on a side stream); the output kernel then adds ``λ^(n·BT) S_in`` to each chunk state
(linearity), so no zero-start output is materialised and corrected.
Backward mirrors it: each leaf's state-gradient contribution (one pass over q and dO) is
suffix-scanned into the gradient ``G`` arriving at its end on the side stream while the
chunk states from ``S_in`` are recomputed; fla's gradient recurrence from ``G`` and its
dq/dk/dv kernels follow.
Only ``S_in`` per leaf is saved for backward; everything else is recomputed by the local op.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..context import SPContext
from .local import BACKENDS, chunk_decay, leaf_backward, leaf_output, leaves_backward, \
    leaves_output, resolve_backend, slope_constant
from .scan_allgather import allgather_scan
from .scan_blelloch import blelloch_scan
from .scan_ring import ring_scan

SCANS = {"blelloch": blelloch_scan, "allgather": allgather_scan, "ring": ring_scan}
# Ranks holding only the sequence's first leaf (no state enters) or only its last (no gradient
# arrives) can take shorter local paths (leaves_output(zero_in=True), leaves_backward(
# zero_grad=True)): measured on one H200 they cut those ranks' GPU work (rank 0 forward 0.53 ->
# 0.45 ms, rank P-1 backward 1.61 -> 1.41 ms at 32K), but the only 2-GPU run with them on gave a
# slower step (0.77 of 2 x fla vs 0.84 without, 2026-11-23) and their GPU tests have not run.
# Off until an A/B on two GPUs (benchmarks/linear_cp.py --ab-static-zero) and the GPU tests
# say otherwise; both settings are exact.
_STATIC_ZERO_PATHS = False
IMPLS = tuple(SCANS) + ("auto",)

# `auto`: two leaves (contiguous P = 2, or zigzag on one rank) need one hop at most, and the ring
# does it with no fold (measured on 2x H200 at 32K: 0.74 vs 0.69 for the all-gather). Beyond
# that one all-gather (a single latency) beats 2⌈log2 L⌉ dependent rounds while the gathered
# states stay small; past this many leaves the tree's O(log L) rounds and O(1) bytes per round win.
_AUTO_ALLGATHER_MAX_LEAVES = 16


def resolve_impl(impl: str, ctx: SPContext) -> str:
    if impl not in IMPLS:
        raise ValueError(f"unknown linear-attention scan impl {impl!r}; use one of {IMPLS}")
    if impl == "auto":
        if ctx.num_leaves <= 2:
            return "ring"
        return "allgather" if ctx.num_leaves <= _AUTO_ALLGATHER_MAX_LEAVES else "blelloch"
    return impl


def _leaf_elements(q: torch.Tensor, slopes: torch.Tensor, n_leaves: int, b: list) -> list:
    """``A = λ^C`` per leaf as ``[B, H]`` in the scan dtype (every leaf has C = T_local / n)."""
    c, B, dt = q.shape[1] // n_leaves, q.shape[0], b[0].dtype
    A = slope_constant(slopes, ("leaf_A", c, B, dt, q.device), lambda: chunk_decay(
        slopes, c, dtype=dt, device=q.device).reshape(1, -1).expand(B, -1).contiguous())
    return [A] * n_leaves


def _rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """``[B, n·C, ...]`` -> ``[B·n, C, ...]``: one row per leaf (a view for contiguous x)."""
    return x.reshape(x.shape[0] * n, x.shape[1] // n, *x.shape[2:])


def _scan_rows(x: torch.Tensor, q: torch.Tensor, slopes: torch.Tensor, ctx: SPContext,
               impl: str, reverse: bool) -> torch.Tensor:
    """Scan the per-leaf states ``x [B·n, H, K, V]`` (this rank's leaves as rows) across the
    group: the state entering each leaf (``reverse``: the gradient arriving at its end), in
    the same row layout, fp32 (fp64 for fp64 inputs)."""
    n = len(ctx.leaves)
    if n == 1:                  # contiguous: the rows are the leaf, no split or stack
        return SCANS[impl](_leaf_elements(q, slopes, 1, [x]), [x], ctx, reverse=reverse)[0]
    parts = list(x.view(q.shape[0], n, *x.shape[1:]).unbind(1))
    out = SCANS[impl](_leaf_elements(q, slopes, n, parts), parts, ctx, reverse=reverse)
    return torch.stack(out, 1).view(x.shape)


class _LightningAttention(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, slopes, ctx: SPContext, impl: str, scale: float,
                backend: Optional[str]):
        if ctx.num_leaves == 1:     # the whole sequence is one leaf: nothing enters it
            S = torch.zeros(())
            out = leaf_output(q, k, v, slopes, scale, None, backend)
        else:
            # A rank's leaves are the rows of one batch. Each leaf's zero-start end state is
            # scanned across ranks into the state S_in entering it (on GPU a side stream; the
            # end states come from the zero-start chunk recurrence), and the output kernel adds
            # S_in to every chunk state. The sequence's first leaf gets S_in = 0 (exact).
            n = len(ctx.leaves)
            qb, kb, vb = _rows(q, n), _rows(k, n), _rows(v, n)
            # a rank holding only the sequence's first leaf receives nothing (S_in = 0)
            zero_in = _STATIC_ZERO_PATHS and all(leaf == 0 for leaf in ctx.leaves)
            o, S = leaves_output(qb, kb, vb, slopes, scale,
                                 lambda b: _scan_rows(b, q, slopes, ctx, impl, False), backend,
                                 zero_in)
            out = o.reshape(*q.shape[:3], v.shape[-1])
        fctx.save_for_backward(q, k, v, slopes, S)
        fctx.sp, fctx.impl, fctx.scale, fctx.backend = ctx, impl, scale, backend
        return out.to(q.dtype)

    @staticmethod
    def backward(fctx, do):
        q, k, v, slopes, S = fctx.saved_tensors
        ctx, scale, backend = fctx.sp, fctx.scale, fctx.backend
        if ctx.num_leaves == 1:     # one leaf: no state enters, no gradient arrives
            dq, dk, dv = leaf_backward(q, k, v, slopes, scale, None, do, None, backend)
        else:
            # Mirror image: each leaf's state-gradient contribution (one pass over q, dO) is
            # suffix-scanned into the gradient G arriving at its end (side stream) while the
            # chunk states from S_in are recomputed; the last leaf gets G = 0 (exact).
            n = len(ctx.leaves)
            qb, kb, vb, dob = _rows(q, n), _rows(k, n), _rows(v, n), _rows(do, n)
            # the sequence's first leaf sends its contribution to nobody: not computed
            needed = tuple(leaf != 0 for leaf in ctx.leaves)
            # ... and one holding only its last leaf receives no gradient (G = 0)
            zero_grad = _STATIC_ZERO_PATHS and all(leaf == ctx.num_leaves - 1
                                                   for leaf in ctx.leaves)
            grads = leaves_backward(
                qb, kb, vb, slopes, scale, S, dob,
                lambda d: _scan_rows(d, q, slopes, ctx, fctx.impl, True), backend, needed,
                zero_grad)
            dq, dk, dv = (g.reshape(x.shape) for g, x in zip(grads, (q, k, v)))
        return dq, dk, dv, None, None, None, None, None


def _check_slope_values(slopes: torch.Tensor) -> None:
    """Slopes must be finite and >= 0. Reading values on the host syncs a CUDA device, which
    would stall the launch queue on every call; slopes are fixed buffers, so each tensor is
    checked once per version (an in-place change bumps ``_version`` and is checked again)."""
    def check() -> bool:
        if not torch.isfinite(slopes).all() or (slopes < 0).any():
            raise ValueError("slopes must be finite and >= 0 (decay exp(-slope) in (0, 1]); "
                             f"got min {slopes.min().item()}")
        return True
    slope_constant(slopes, ("values_checked",), check)


def _check_inputs(q, k, v, slopes, ctx: SPContext, scale) -> None:
    for name, t in (("q", q), ("k", k), ("v", v), ("slopes", slopes)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [B, T, H, K/V]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must have the same shape")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v {tuple(v.shape)} must match q {tuple(q.shape)} in B, T, H")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them "
                         "to one dtype")
    if not (q.device == k.device == v.device):
        raise ValueError("q, k, v are on different devices")
    H = q.shape[2]
    if slopes.dim() != 1 or slopes.shape[0] != H:
        raise ValueError(f"slopes must be [H] = [{H}] (one decay rate per head), got "
                         f"{tuple(slopes.shape)}")
    if slopes.requires_grad:
        raise ValueError("slopes are fixed decay rates here (no gradient is computed for them); "
                         "pass slopes.detach() or a buffer")
    _check_slope_values(slopes)
    if not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be a positive float, got {scale!r}")
    n = len(ctx.leaves)
    if q.shape[1] == 0 or q.shape[1] % n:
        raise ValueError(f"the local sequence length {q.shape[1]} must be a positive multiple of "
                         f"{n} for layout {ctx.layout!r} (each rank holds {n} equal chunks); "
                         "pad the global sequence with sp_attention.pad_for_layout")


def lightning_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor,
                        *, ctx: Optional[SPContext] = None, impl: str = "auto",
                        scale: float = 1.0, backend: Optional[str] = None) -> torch.Tensor:
    """Causal linear attention with per-head decay over a context-parallel group.

    For each head with slope ``s ≥ 0`` (decay ``λ = exp(−s)``), over the *global* sequence::

        S_t = λ·S_{t−1} + k_tᵀ v_t,    o_t = scale · q_t S_t
        (o_t = scale · Σ_{j≤t} λ^{t−j} (q_t·k_j) v_j)

    Args:
        q, k: ``[B, T_local, H, K]`` this rank's shard of the sequence (see
            :func:`sp_attention.shard_sequence`; zigzag holds chunks ``r`` and ``2P−1−r``).
        v: ``[B, T_local, H, V]``.
        slopes: ``[H]`` fixed, non-negative decay rates (0 = no decay). Not differentiated.
        ctx: the CP :class:`~sp_attention.SPContext` (its layout must match how the sequence
            was sharded). ``None`` or world size 1: plain single-device attention.
        impl: cross-rank state scan: ``"blelloch"`` (tree, 2⌈log2 L⌉ rounds of one fp32
            state), ``"allgather"`` (one all-gather, local fold), ``"ring"`` (P−1 sequential
            hops, baseline), ``"auto"`` (ring for 2 leaves, allgather up to 16, else blelloch).
        scale: multiplies ``q`` (default 1.0; pass ``K ** -0.5`` for softmax-like scaling).
        backend: local kernel, ``"fla"`` (fla-core Triton, CUDA) or ``"torch"`` (chunked pure
            torch, any device, fp64 capable); ``None`` picks fla when it can run.

    Returns:
        ``[B, T_local, H, V]`` in ``q.dtype``. Cross-rank states and the inter term are fp32
        (fp64 for fp64 inputs); the local kernel runs in the input dtype.

    Raises ``ValueError``/``TypeError`` before any communication for mismatched shapes or
    dtypes, slopes of the wrong shape or sign, an unknown impl or backend, or a local length
    the layout cannot split. Every rank must call with the same shapes and impl.
    """
    ctx = ctx if ctx is not None else SPContext(None, 0, 1, (0,), "contiguous")
    if not isinstance(ctx, SPContext):
        raise TypeError(f"ctx must be an SPContext, got {type(ctx).__name__}")
    _check_inputs(q, k, v, slopes, ctx, scale)
    impl = resolve_impl(impl, ctx)
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"unknown local backend {backend!r}; use one of {BACKENDS} or None")
    backend = resolve_backend(backend, q, k, v)
    slopes = slopes.to(device=q.device)
    return _LightningAttention.apply(q, k, v, slopes, ctx, impl, float(scale), backend)

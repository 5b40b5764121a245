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

from typing import Optional, Union

import torch

from ..call_check import agree_across_ranks
from ..context import SPContext
from ..tuning import LinearTuning
from ..precision import acc_dtype
from ..validation import (autocast_inputs, autocast_off, check_local_length, check_tensors,
                          resolve_ctx, sdpa_hint)
from .fla_ops import BACKENDS
from .kernel_set import FlaKernels, resolve_kernels
from .leaf import leaf_backward, leaf_output
from .leaves import leaves_backward, leaves_output
from .scan_allgather import allgather_scan
from .scan_blelloch import blelloch_scan
from .scan_ring import ring_scan
from .slope_constants import check_slope_values, leaf_transition

__all__ = ["lightning_attention", "IMPLS", "DEFAULT_IMPL", "SCANS", "resolve_impl", "leaf_rows", "scan_rows"]

SCANS = {"blelloch": blelloch_scan, "allgather": allgather_scan, "ring": ring_scan}
IMPLS = tuple(SCANS) + ("auto",)
# The one default scan choice; routes that do not name a scan pass None and get this (read at
# call time, so every route follows a change of this line).
DEFAULT_IMPL = "auto"
_DEFAULT = LinearTuning()


def resolve_impl(impl: Optional[str], ctx: SPContext, tuning: LinearTuning = _DEFAULT) -> str:
    """The scan schedule ``impl`` names; ``"auto"``: two leaves (contiguous P = 2, or zigzag on
    one rank) need one hop at most, and the ring does it with no fold (measured on 2x H200 at
    32K: 0.74 vs 0.69 for the all-gather); beyond that one all-gather (a single latency) beats
    2⌈log2 L⌉ dependent rounds while the gathered states stay small, up to
    ``tuning.auto_allgather_max_leaves``; past that the tree's O(log L) rounds win."""
    impl = DEFAULT_IMPL if impl is None else impl
    if impl not in IMPLS:
        raise ValueError(f"unknown linear-attention scan impl {impl!r}; use one of {IMPLS}")
    if impl == "auto":
        if ctx.num_leaves <= 2:
            return "ring"
        return "allgather" if ctx.num_leaves <= tuning.auto_allgather_max_leaves else "blelloch"
    return impl


def leaf_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """``[B, n·C, ...]`` -> ``[B·n, C, ...]``: one row per leaf (a view for contiguous x)."""
    return x.reshape(x.shape[0] * n, x.shape[1] // n, *x.shape[2:])


def scan_rows(x: torch.Tensor, q: torch.Tensor, slopes: torch.Tensor, ctx: SPContext,
              impl: str, reverse: bool) -> torch.Tensor:
    """Scan the per-leaf states ``x [B·n, H, K, V]`` (this rank's leaves as rows) across the
    group with schedule ``impl``: the state entering each leaf (``reverse``: the gradient
    arriving at its end), in the same row layout, fp32 (fp64 for fp64 inputs)."""
    n = len(ctx.leaves)
    A = leaf_transition(slopes, q.shape[1] // n, q.shape[0], x.dtype, q.device)   # [B, H]
    if n == 1:                  # contiguous: the rows are the leaf, no split or stack
        return SCANS[impl]([A], [x], ctx, reverse=reverse)[0]
    parts = list(x.view(q.shape[0], n, *x.shape[1:]).unbind(1))
    out = SCANS[impl]([A] * n, parts, ctx, reverse=reverse)
    return torch.stack(out, 1).view(x.shape)


def expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, T, Hkv, D]`` -> ``[B, T, H, D]``: KV head ``g`` serves query heads ``g·G …
    g·G + G − 1`` (``G = H / Hkv``; Megatron's and HF's mapping ``h // G``). No copy for
    ``G = 1``."""
    group = heads // x.shape[2]
    return x if group == 1 else x.repeat_interleave(group, dim=2)


def reduce_kv_grad(dx: torch.Tensor, kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """Sum a ``[B, T, H, D]`` gradient over each GQA group (in fp32, fp64 stays) into
    ``[B, T, Hkv, D]`` of ``dtype``."""
    b, t, h, d = dx.shape
    if h == kv_heads:
        return dx.to(dtype)
    return dx.to(acc_dtype(dx)).view(b, t, kv_heads, h // kv_heads, d).sum(3).to(dtype)


class _LightningAttention(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, slopes, ctx: SPContext, impl: str, scale: float,
                local: Union[str, FlaKernels], tuning: LinearTuning):
        k_in, v_in = k, v
        # GQA: one expansion on this rank (nothing but states crosses ranks), after the
        # checks; the kernels see as many K/V heads as query heads; backward expands again
        k, v = expand_kv(k, q.shape[2]), expand_kv(v, q.shape[2])
        if ctx.num_leaves == 1 and isinstance(local, str):
            # the whole sequence is one leaf: nothing enters it; one kernel call
            S = torch.zeros(())
            out = leaf_output(q, k, v, slopes, scale, None, local)
        else:
            # A rank's leaves are the rows of one batch. Each leaf's zero-start end state is
            # scanned across ranks into the state S_in entering it (on GPU a side stream; the
            # end states come from the zero-start chunk recurrence), and the output kernel adds
            # S_in to every chunk state. The sequence's first leaf gets S_in = 0 (exact).
            n = len(ctx.leaves)
            qb, kb, vb = leaf_rows(q, n), leaf_rows(k, n), leaf_rows(v, n)
            # a rank holding only the sequence's first leaf receives nothing (S_in = 0)
            zero_in = tuning.static_zero_paths and all(leaf == 0 for leaf in ctx.leaves)
            o, S = leaves_output(qb, kb, vb, slopes, scale,
                                 lambda b: scan_rows(b, q, slopes, ctx, impl, False), local,
                                 zero_in, tuning=tuning)
            out = o.reshape(*q.shape[:3], v.shape[-1])
        fctx.save_for_backward(q, k_in, v_in, slopes, S)
        fctx.sp, fctx.impl, fctx.scale, fctx.local, fctx.tuning = ctx, impl, scale, local, tuning
        return out.to(q.dtype)

    @staticmethod
    def backward(fctx, do):
        with autocast_off(do.device):
            return _LightningAttention._backward(fctx, do)

    @staticmethod
    def _backward(fctx, do):
        q, k_in, v_in, slopes, S = fctx.saved_tensors
        k, v = expand_kv(k_in, q.shape[2]), expand_kv(v_in, q.shape[2])
        ctx, scale, local, tuning = fctx.sp, fctx.scale, fctx.local, fctx.tuning
        if ctx.num_leaves == 1 and isinstance(local, str):
            # one leaf: no state enters, no gradient arrives
            dq, dk, dv = leaf_backward(q, k, v, slopes, scale, None, do, None, local)
        else:
            # Mirror image: each leaf's state-gradient contribution (one pass over q, dO) is
            # suffix-scanned into the gradient G arriving at its end (side stream) while the
            # chunk states from S_in are recomputed; the last leaf gets G = 0 (exact).
            n = len(ctx.leaves)
            qb, kb, vb, dob = (leaf_rows(t, n) for t in (q, k, v, do))
            # the sequence's first leaf sends its contribution to nobody: not computed
            needed = tuple(leaf != 0 for leaf in ctx.leaves)
            # ... and one holding only its last leaf receives no gradient (G = 0)
            zero_grad = tuning.static_zero_paths and all(leaf == ctx.num_leaves - 1
                                                         for leaf in ctx.leaves)
            grads = leaves_backward(
                qb, kb, vb, slopes, scale, S, dob,
                lambda d: scan_rows(d, q, slopes, ctx, fctx.impl, True), local, needed,
                zero_grad, tuning=tuning)
            dq, dk, dv = (g.reshape(x.shape) for g, x in zip(grads, (q, k, v)))
        dk = reduce_kv_grad(dk, k_in.shape[2], k_in.dtype)
        dv = reduce_kv_grad(dv, v_in.shape[2], v_in.dtype)
        return dq, dk, dv, None, None, None, None, None, None


def _check_inputs(q, k, v, slopes, ctx: SPContext, scale) -> None:
    check_tensors(q=q, k=k, v=v, slopes=slopes)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [B, T, H, K/V]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must have the same shape "
                         "but for k's heads (B, T, K equal; k may have fewer, grouped heads)")
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
    H = q.shape[2]
    if slopes.dim() != 1 or slopes.shape[0] != H:
        hint = sdpa_hint(q, slopes.shape[0] if slopes.dim() == 1 else None)
        raise ValueError(f"slopes must be [H] = [{H}] (one decay rate per head), got "
                         f"{tuple(slopes.shape)}.{hint}")
    if slopes.requires_grad:
        raise ValueError("slopes are fixed decay rates here (no gradient is computed for them); "
                         "pass slopes.detach() or a buffer")
    check_slope_values(slopes)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be a positive float, got {scale!r}")
    check_local_length(q, ctx)


def _shape(x) -> object:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


def _signature(q, k, v, slopes, impl, scale, backend, kernels, tuning, ctx: SPContext) -> tuple:
    """What every rank must pass alike (checked across ranks once per new signature)."""
    tensors = tuple((n, _shape(x), getattr(x, "dtype", None)) for n, x in
                    (("q", q), ("k", k), ("v", v), ("slopes", slopes)))
    dev = q.device.type if isinstance(q, torch.Tensor) else None
    kind = backend if backend is None or isinstance(backend, str) else type(backend).__name__
    if kernels is not None:
        kind = f"kernels {type(kernels).__name__}"
    return (("tensors", tensors), ("device", dev), ("layout", ctx.layout), ("impl", impl),
            ("scale", scale), ("backend", kind), ("tuning", tuning))


def lightning_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor,
                        *, ctx: Optional[SPContext] = None, impl: Optional[str] = None,
                        scale: float = 1.0, backend: Optional[str] = None,
                        tuning: Optional[LinearTuning] = None) -> torch.Tensor:
    """Causal linear attention with per-head decay over a context-parallel group.

    For each head with slope ``s ≥ 0`` (decay ``λ = exp(−s)``), over the *global* sequence::

        S_t = λ·S_{t−1} + k_tᵀ v_t,    o_t = scale · q_t S_t
        (o_t = scale · Σ_{j≤t} λ^{t−j} (q_t·k_j) v_j)

    Args:
        q: ``[B, T_local, H, K]`` this rank's shard of the sequence (see
            :func:`sp_attention.shard_sequence`; zigzag holds chunks ``r`` and ``2P−1−r``).
            Not SDPA's ``[B, H, T, K]``: transpose(1, 2) such tensors first.
        k, v: ``[B, T_local, Hkv, K]`` and ``[B, T_local, Hkv, V]`` with ``H % Hkv == 0``
            (grouped K/V, GQA: query head ``h`` uses KV head ``h // (H / Hkv)``, Megatron's and
            HF's mapping); pass them as the projections make them, the op expands them once
            on this rank (only states cross ranks) and sums their gradients over each group.
            Dtypes: one floating dtype for q, k, v; under ``torch.autocast`` they are cast to
            the autocast dtype first (SDPA's rule), outside autocast mismatches raise.
        slopes: ``[H]`` fixed, non-negative decay rates (0 = no decay), any float dtype and
            device (moved to ``q``'s device; decays are formed in fp32, fp64 for fp64
            inputs). Not differentiated. Under TP, the slopes of this rank's heads.
        ctx: the CP :class:`~sp_attention.SPContext` (its layout must match how the sequence
            was sharded). ``None`` or world size 1: plain single-device attention.
        impl: cross-rank state scan: ``"blelloch"`` (tree, 2⌈log2 L⌉ rounds of one fp32
            state), ``"allgather"`` (one all-gather, local fold), ``"ring"`` (P−1 sequential
            hops, baseline), ``"auto"`` (ring for 2 leaves, allgather up to 16, else blelloch);
            None: :data:`DEFAULT_IMPL` (``"auto"``).
        scale: multiplies ``q`` (default 1.0, unlike softmax attention's ``D ** -0.5``; pass
            ``K ** -0.5`` for softmax-like scaling).
        backend: local kernel, ``"fla"`` (fla-core Triton, CUDA) or ``"torch"`` (chunked pure
            torch, any device, fp64 capable); ``None`` picks fla when it can run.
        tuning: :class:`~sp_attention.LinearTuning` (None: the defaults); never changes the
            numbers.

    Returns:
        ``[B, T_local, H, V]`` in ``q.dtype``. Cross-rank states and the inter term are fp32
        (fp64 for fp64 inputs); the local kernel runs in the input dtype.

    Raises ``ValueError``/``TypeError`` on every rank, before the op communicates, for
    mismatched shapes or dtypes, slopes of the wrong shape or sign, an unknown impl or
    backend, a local length the layout cannot split, or ranks whose calls differ (shapes,
    dtypes, options: checked by one small all-gather the first time each call signature is
    seen, see :mod:`sp_attention.call_check`).
    """
    return _attend(q, k, v, slopes, ctx, impl, scale, backend, None, tuning)


def lightning_attention_with_kernels(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                     slopes: torch.Tensor, kernels: FlaKernels, *,
                                     ctx: Optional[SPContext] = None, impl: Optional[str] = None,
                                     scale: float = 1.0, tuning: Optional[LinearTuning] = None
                                     ) -> torch.Tensor:
    """:func:`lightning_attention` through the fla path's orchestration (the multi-leaf path,
    its streams and scans) with ``kernels`` in place of fla's, whatever the device: the CPU
    tests run it with pure-torch stand-ins (``tests/linear/test_fla_orchestration.py``). Not
    public API. The same input checks and cross-rank call check run as for
    :func:`lightning_attention`.
    """
    return _attend(q, k, v, slopes, ctx, impl, scale, None, kernels, tuning)


def _attend(q, k, v, slopes, ctx: Optional[SPContext], impl: Optional[str], scale,
            backend: Optional[str], kernels: Optional[FlaKernels],
            tuning: Optional[LinearTuning]) -> torch.Tensor:
    """Checks (on every rank, before any collective), then the autograd Function. ``kernels``:
    a kernel set for the fla path (None: the ``backend`` name decides)."""
    ctx = resolve_ctx(ctx)
    tuning = _DEFAULT if tuning is None else tuning
    q, k, v = autocast_inputs(q, k, v)
    error, local = None, None
    try:
        if not isinstance(tuning, LinearTuning):
            raise TypeError(f"tuning must be a LinearTuning or None, got {type(tuning).__name__}")
        _check_inputs(q, k, v, slopes, ctx, scale)
        resolved = resolve_impl(impl, ctx, tuning)
        if kernels is not None:
            if not isinstance(kernels, FlaKernels):
                raise TypeError(f"kernels must be a FlaKernels, got {type(kernels).__name__}")
            local = kernels
        elif backend is not None and not isinstance(backend, str):
            raise TypeError(f"backend must be a name in {BACKENDS} or None, got "
                            f"{type(backend).__name__}")
        elif backend is not None and backend not in BACKENDS:
            raise ValueError(f"unknown local backend {backend!r}; use one of {BACKENDS} or None")
        else:
            local = "torch" if resolve_kernels(backend, q, k, v) is None else "fla"
    except (TypeError, ValueError) as e:
        error = e
    check_all = isinstance(tuning, LinearTuning) and tuning.check_every_call
    agree_across_ranks(ctx, "lightning_attention",
                       _signature(q, k, v, slopes, DEFAULT_IMPL if impl is None else impl, scale,
                                  backend, kernels, tuning, ctx), error,
                       check_all)
    slopes = slopes.to(device=q.device)
    with autocast_off(q.device):
        return _LightningAttention.apply(q, k, v, slopes, ctx, resolved, float(scale), local,
                                         tuning)

"""Context-parallel linear attention with decay: autograd Functions and the public function.

The decay is fixed per-head rates (``slopes``) or per-token gates (``g``), one code path
(:class:`~sp_attention.linear.decay.Decay`); packed documents (``cu_seqlens``) take the
packed Function (:mod:`.packed`), a trivial plan the unpacked one.

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
The forward and backward bodies (:func:`_forward`, :func:`_backward`) run eagerly or, with
``LinearTuning.op_graphs``, replayed from a CUDA graph each (:mod:`.op_graphs`).
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from ..call_check import agree_across_ranks
from ..context import SPContext
from ..cost.auto import auto_linear_scan
from ..planning.linear_packed import linear_packing
from ..planning.packing import PackingPlan, resolve_plan
from ..planning.linear_rows import row_splits
from ..planning.schedules import LINEAR_IMPLS as IMPLS
from ..precision import acc_dtype
from ..tuning import LinearTuning
from ..validation import autocast_inputs, autocast_off, resolve_ctx
from .decay import Decay
from .fla_ops import BACKENDS
from .inputs import call_signature, check_inputs
from .kernel_set import FlaKernels, resolve_kernels
from .leaf import leaf_backward, leaf_output
from .leaves import leaves_backward, leaves_output, sm_count, split_rows_scan
from .op_graphs import OpGraphs
from .packed import packed_grads, packed_output
from .scan_allgather import (FUSED_MAX_ROWS, allgather_rows, allgather_scan,
                             fused_allgather_leaf_rows)
from .scan_blelloch import blelloch_rows, blelloch_scan
from .scan_ring import ring_rows, ring_scan

__all__ = ["lightning_attention", "IMPLS", "DEFAULT_IMPL", "SCANS", "SCAN_ROWS", "resolve_impl",
           "leaf_rows", "scan_rows"]

SCANS = {"blelloch": blelloch_scan, "allgather": allgather_scan, "ring": ring_scan}
# the same schedules on this rank's elements as rows of one tensor (what the layer calls)
SCAN_ROWS = {"blelloch": blelloch_rows, "allgather": allgather_rows, "ring": ring_rows}
# The one default scan choice; routes that do not name a scan pass None and get this (read at
# call time, so every route follows a change of this line).
DEFAULT_IMPL = "auto"
_DEFAULT = LinearTuning()


def resolve_impl(impl: Optional[str], ctx: SPContext, q: Optional[torch.Tensor] = None,
                 v: Optional[torch.Tensor] = None) -> str:
    """The scan schedule ``impl`` names. ``"auto"`` (the default): the cost model's cheapest
    predicted forward + backward for this call's shape (``q [B, T_local, H, K]``, ``v``), group
    size, layout and links (:func:`sp_attention.auto.auto_linear_scan`: the calibration of
    this device if one was measured, else the built-in H100/H200 or CPU figures; decided and
    logged once per layer shape); one rank: ``"ring"`` (nothing crosses ranks). Without
    tensors (a run's header, before any call): ``"auto"``."""
    impl = DEFAULT_IMPL if impl is None else impl
    if impl not in IMPLS:
        raise ValueError(f"unknown linear-attention scan impl {impl!r}; use one of {IMPLS}")
    if impl != "auto":
        return impl
    if ctx.world_size == 1:
        return "ring"
    if q is None or v is None:
        return "auto"
    return auto_linear_scan(ctx, q, v).name


def leaf_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """``[B, n·C, ...]`` -> ``[B·n, C, ...]``: one row per leaf (a view for contiguous x)."""
    return x.reshape(x.shape[0] * n, x.shape[1] // n, *x.shape[2:])


def scan_rows(x: torch.Tensor, A: torch.Tensor, ctx: SPContext, impl: str,
              reverse: bool, graphs: bool = False) -> torch.Tensor:
    """Scan the per-leaf states ``x [B·n, H, K, V]`` (this rank's leaves as rows, transitions
    ``A [B·n, H]``) across the group with schedule ``impl``: the state entering each leaf
    (``reverse``: the gradient arriving at its end), in the same row layout, fp32 (fp64 for
    fp64 inputs). ``graphs``: replay the scan from a CUDA graph (``LinearTuning.scan_graphs``)."""
    n = len(ctx.leaves)
    B = x.shape[0] // n
    # leaf j's element: batch rows j, j + n, … (the rows are batch-major); views for B = 1
    out = SCAN_ROWS[impl](A.reshape(B, n, -1).transpose(0, 1), x.reshape(B, n, -1).transpose(0, 1),
                          ctx, reverse, graphs=graphs)                     # [n, B·H, K·V]
    return out.reshape(n, B, *x.shape[1:]).transpose(0, 1).reshape(x.shape)


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


def _rows_per_leaf(q: torch.Tensor, v: torch.Tensor, n: int, gated: bool, local,
                   tuning: LinearTuning) -> int:
    """Rows each of this rank's ``n`` leaves runs as (``LinearTuning.row_splits``)."""
    fla = q.is_cuda and resolve_kernels(local, q, None, v) is not None
    return row_splits(tuning.row_splits, q.shape[0] * n, q.shape[1] // n, q.shape[2], q.shape[3],
                      v.shape[3], sm_count(q.device.index if q.device.index is not None
                                           else torch.cuda.current_device()) if fla else None,
                      gated)


def _decay(g, slopes, rows: int) -> Decay:
    """The call's decay as ``rows`` rows of leaves (one row: as given)."""
    decay = Decay(slopes=slopes) if g is None else Decay(g=g)
    return decay if rows == 1 else decay.rows(rows)


def _forward(q, k_in, v_in, g, slopes, decay: Optional[Decay], ctx: SPContext, impl: str,
             scale: float, local, tuning: LinearTuning, m: int) -> tuple:
    """This rank's forward: ``(out in q's dtype, S_in)`` (``S_in``: the states entering the
    leaves, saved for backward; a 0-d placeholder for one leaf). ``decay``: the call's as
    rows of leaves (:func:`_decay`), or None to make it here."""
    # GQA: one expansion on this rank (nothing but states crosses ranks), after the checks;
    # the kernels see as many K/V heads as query heads; backward expands again
    k, v = expand_kv(k_in, q.shape[2]), expand_kv(v_in, q.shape[2])
    n = len(ctx.leaves)
    decay = _decay(g, slopes, n * m) if decay is None else decay
    if ctx.num_leaves == 1:
        # the whole sequence is one leaf: nothing enters it; one kernel call
        return leaf_output(q, k, v, decay, scale, None, local).to(q.dtype), torch.zeros(())
    # A rank's leaves are the rows of one batch. Each leaf's zero-start end state is scanned
    # across ranks into the state S_in entering it (on GPU a side stream; the end states come
    # from the zero-start chunk recurrence), and the output kernel adds S_in to every chunk
    # state. The sequence's first leaf gets S_in = 0 (exact).
    qb, kb, vb = leaf_rows(q, n * m), leaf_rows(k, n * m), leaf_rows(v, n * m)
    # a rank holding only the sequence's first leaf receives nothing (S_in = 0)
    zero_in = tuning.static_zero_paths and m == 1 and all(leaf == 0 for leaf in ctx.leaves)
    o, S = leaves_output(qb, kb, vb, decay, scale, _rows_scan(ctx, impl, False, m, tuning),
                         local, zero_in, tuning=tuning)
    return o.reshape(*q.shape[:3], v.shape[-1]).to(q.dtype), S


def _backward(q, k_in, v_in, g, slopes, S, do, decay: Optional[Decay], ctx: SPContext,
              impl: str, scale: float, local, tuning: LinearTuning, m: int) -> tuple:
    """This rank's backward: ``(dq, dk, dv, dg)`` in the inputs' dtypes (``dk``, ``dv`` summed
    per GQA group; ``dg`` None for fixed rates). ``decay``: the forward's (its gate sums
    reused), or None to make it again."""
    k, v = expand_kv(k_in, q.shape[2]), expand_kv(v_in, q.shape[2])
    n = len(ctx.leaves)
    decay = _decay(g, slopes, n * m) if decay is None else decay
    if ctx.num_leaves == 1:
        # one leaf: no state enters, no gradient arrives
        dq, dk, dv, dg = leaf_backward(q, k, v, decay, scale, None, do, None, local)
    else:
        # Mirror image: each leaf's state-gradient contribution (one pass over q, dO) is
        # suffix-scanned into the gradient G arriving at its end (side stream) while the chunk
        # states from S_in are recomputed; the last leaf gets G = 0 (exact).
        qb, kb, vb, dob = (leaf_rows(t, n * m) for t in (q, k, v, do))
        # the sequence's first leaf sends its contribution to nobody: not computed (with rows,
        # its later rows' contributions reach its earlier rows: all computed)
        needed = tuple(leaf != 0 for leaf in ctx.leaves) if m == 1 else None
        # ... and one holding only its last leaf receives no gradient (G = 0)
        zero_grad = tuning.static_zero_paths and m == 1 and all(
            leaf == ctx.num_leaves - 1 for leaf in ctx.leaves)
        grads = leaves_backward(qb, kb, vb, decay, scale, S, dob,
                                _rows_scan(ctx, impl, True, m, tuning), local, needed,
                                zero_grad, tuning=tuning)
        dq, dk, dv = (x.reshape(t.shape) for x, t in zip(grads[:3], (q, k, v)))
        dg = None if grads[3] is None else grads[3].reshape(g.shape)
    return _reduced(dq, dk, dv, dg, k_in, v_in, g)


# the op's forward and backward replayed from CUDA graphs (LinearTuning.op_graphs)
_OP_GRAPHS = OpGraphs()
# with row splits, each scan with its rows' folds on this rank (LinearTuning.scan_graphs)
_ROW_SCAN_GRAPHS = OpGraphs()


def _rows_scan(ctx: SPContext, impl: str, reverse: bool, m: int, tuning: LinearTuning):
    """The scan callback of a rank's leaf rows ``(x [N·m, H, K, V], A [N·m, H])`` ->
    the states entering them (``reverse``: the gradients arriving at their ends): each leaf's
    ``m`` rows folded into the leaf's element, the cross-rank scan, the result spread back
    over the rows (:func:`.leaves.split_rows_scan`). With ``tuning.scan_graphs`` on CUDA the
    folds and the scan replay from one CUDA graph per signature (one launch instead of the
    folds' ~20 small ops around the scan's own graph); with one row per leaf the scan's own
    graph is all there is. The ``allgather`` scan of fp32 rows on CUDA with
    ``tuning.fused_scan``: two Triton kernels around the collective instead
    (:func:`.scan_allgather.fused_allgather_leaf_rows`)."""
    rows = split_rows_scan(lambda x, A: scan_rows(x, A, ctx, impl, reverse, tuning.scan_graphs),
                           m, reverse)
    if impl == "allgather" and tuning.fused_scan and \
            ctx.world_size * len(ctx.leaves) <= FUSED_MAX_ROWS:
        def fused(x: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
            if x.is_cuda and x.dtype == A.dtype == torch.float32:
                return fused_allgather_leaf_rows(x, A, ctx, reverse, m, tuning.scan_graphs)
            return rows(x, A)           # the torch ops: CPU, fp64
        return fused
    if m == 1 or not tuning.scan_graphs:
        return rows

    def graphed(x: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
        if not _graph_device(x):
            return rows(x, A)
        key = ("rows", reverse, x.shape, x.dtype, A.shape, A.dtype, x.device, _ctx_key(ctx),
               impl, m)
        return _ROW_SCAN_GRAPHS(key, lambda x_, A_: (rows(x_, A_),), (x, A))[0]
    return graphed


def _graph_device(x: torch.Tensor) -> bool:
    """Whether the row scans of ``x`` replay from graphs: on CUDA."""
    return x.is_cuda


def _graphed(tuning: LinearTuning, q: torch.Tensor, local) -> bool:
    """Whether this call replays from :data:`_OP_GRAPHS`: asked for, on CUDA, fla's path."""
    return tuning.op_graphs and q.is_cuda and local != "torch"


def _ctx_key(ctx: SPContext) -> tuple:
    """What of ``ctx`` a graph depends on (its group's communicator, this rank's leaves)."""
    return ctx.group, ctx.rank, ctx.world_size, ctx.layout, ctx.leaves


def _graph_key(role: str, tensors: tuple, ctx: SPContext, impl: str, scale: float, local,
               tuning: LinearTuning, m: int) -> tuple:
    return (role, tuple(None if t is None else (t.shape, t.dtype, t.device) for t in tensors),
            _ctx_key(ctx), impl, scale, local if isinstance(local, str) else id(local), tuning,
            m)


class _LightningAttention(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, g, slopes, ctx: SPContext, impl: str, scale: float,
                local: Union[str, FlaKernels], tuning: LinearTuning):
        # each leaf runs as m rows (one program per row and head: more SMs busy), combined on
        # this rank around the cross-rank scan; the sequence as one leaf (P = 1) stays one row
        m = 1 if ctx.num_leaves == 1 else _rows_per_leaf(q, v, len(ctx.leaves), g is not None,
                                                         local, tuning)
        args = (ctx, impl, scale, local, tuning, m)
        if _graphed(tuning, q, local):
            inputs = (q, k, v, g, slopes)
            out, S = _OP_GRAPHS(_graph_key("fwd", inputs, *args),
                                lambda *t: _forward(*t, None, *args), inputs)
            fctx.decay = None           # made again inside the backward's graph
        else:
            # the backward reuses the gate sums this decay makes (derived, never
            # differentiated)
            fctx.decay = _decay(g, slopes, len(ctx.leaves) * m)
            out, S = _forward(q, k, v, g, slopes, fctx.decay, *args)
        fctx.save_for_backward(q, k, v, g, slopes, S)
        fctx.args = args
        return out

    @staticmethod
    def backward(fctx, do):
        with autocast_off(do.device):
            q, k_in, v_in, g, slopes, S = fctx.saved_tensors
            args = fctx.args
            if fctx.decay is None:
                inputs = (q, k_in, v_in, g, slopes, S, do)
                grads = _OP_GRAPHS(_graph_key("bwd", inputs, *args),
                                   lambda *t: _backward(*t, None, *args), inputs)
            else:
                grads = _backward(q, k_in, v_in, g, slopes, S, do, fctx.decay, *args)
            return _finish(grads, fctx)


def _reduced(dq, dk, dv, dg, k_in, v_in, g) -> tuple:
    """The gradients in the inputs' shapes and dtypes: K/V summed per GQA group, dg in g's
    dtype (None for fixed rates)."""
    dk = reduce_kv_grad(dk, k_in.shape[2], k_in.dtype)
    dv = reduce_kv_grad(dv, v_in.shape[2], v_in.dtype)
    return dq, dk, dv, None if dg is None else dg.to(g.dtype)


def _finish(grads: tuple, fctx) -> tuple:
    """The Function's gradients: ``dg`` only where asked for."""
    dq, dk, dv, dg = grads
    dg = dg if fctx.needs_input_grad[3] else None
    return (dq, dk, dv, dg) + (None,) * (len(fctx.needs_input_grad) - 4)


class _PackedLightningAttention(torch.autograd.Function):
    """Packed documents (:mod:`.packed`): only the crossing segments' states cross ranks."""

    @staticmethod
    def forward(fctx, q, k, v, g, slopes, ctx: SPContext, impl: str, scale: float,
                local: Union[str, FlaKernels], tuning: LinearTuning, lp):
        k_in, v_in = k, v
        k, v = expand_kv(k, q.shape[2]), expand_kv(v, q.shape[2])
        decay = Decay(slopes=slopes) if g is None else Decay(g=g)
        out, S_in = packed_output(q, k, v, decay, scale, lp, _packed_scan(ctx, impl),
                                  resolve_kernels(local, q, k, v))
        fctx.save_for_backward(q, k_in, v_in, g, slopes, *S_in)
        fctx.sp, fctx.impl, fctx.scale, fctx.local, fctx.lp = ctx, impl, scale, local, lp
        return out.to(q.dtype)

    @staticmethod
    def backward(fctx, do):
        with autocast_off(do.device):
            q, k_in, v_in, g, slopes, *S_in = fctx.saved_tensors
            k, v = expand_kv(k_in, q.shape[2]), expand_kv(v_in, q.shape[2])
            decay = Decay(slopes=slopes) if g is None else Decay(g=g)
            dq, dk, dv, dg = packed_grads(q, k, v, decay, fctx.scale, fctx.lp, S_in, do,
                                          _packed_scan(fctx.sp, fctx.impl),
                                          resolve_kernels(fctx.local, q, k, v))
            return _finish(_reduced(dq.to(q.dtype), dk, dv, dg, k_in, v_in, g), fctx)


def _packed_scan(ctx: SPContext, impl: str):
    """The packed path's scan callback over an explicit holder list."""
    def scan(A, x, reverse, holders, like):
        return SCANS[impl](A, x, ctx, reverse=reverse, holders=holders, like=like)
    return scan


def lightning_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        slopes: Optional[torch.Tensor] = None, *,
                        g: Optional[torch.Tensor] = None,
                        cu_seqlens: Union[None, torch.Tensor, PackingPlan] = None,
                        ctx: Optional[SPContext] = None, impl: Optional[str] = None,
                        scale: float = 1.0, backend: Optional[str] = None,
                        tuning: Optional[LinearTuning] = None) -> torch.Tensor:
    """Causal linear attention with decay over a context-parallel group.

    For each head with slope ``s ≥ 0`` (decay ``λ = exp(−s)``), or with per-token log-decays
    ``g_t ≤ 0`` (``λ_t = exp(g_t)``), over the *global* sequence::

        S_t = λ_t·S_{t−1} + k_tᵀ v_t,    o_t = scale · q_t S_t
        (fixed slopes: o_t = scale · Σ_{j≤t} λ^{t−j} (q_t·k_j) v_j)

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
            inputs). Not differentiated. Under TP, the slopes of this rank's heads. Pass
            exactly one of ``slopes`` and ``g``.
        g: ``[B, T_local, H]`` per-token log-decays (natural log, finite, ``≤ 0``; fla's
            ``simple_gla`` gate, Mamba2's ``A·Δ_t``), sharded like q, on q's device, any float
            dtype (kept as it is under autocast; summed in fp32, fp64 for fp64 inputs);
            differentiable (``dg`` in g's dtype). Fixed slopes are the case ``g = −s``.
        cu_seqlens: packed documents: boundaries ``[N+1]`` of the GLOBAL row (int32/int64,
            0 … end of the last document; the same on every rank), or the
            :class:`~sp_attention.PackingPlan` built from them once per batch
            (:func:`sp_attention.plan_packing`; the local tensors are this rank's shard as
            ``plan.shard`` placed it). The state resets at every document start; padding
            gets zero outputs and gradients. None: one sequence (no packing).
        ctx: the CP :class:`~sp_attention.SPContext` (its layout must match how the sequence
            was sharded). ``None`` or world size 1: plain single-device attention.
        impl: cross-rank state scan: ``"blelloch"`` (tree, 2⌈log2 L⌉ − 1 rounds of one fp32
            state; zigzag: 2⌈log2 P⌉ − 1 rounds of up to three), ``"allgather"`` (one all-gather, local fold), ``"ring"`` (P−1 sequential
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
    mismatched shapes or dtypes, slopes of the wrong shape or sign, gates of the wrong shape,
    dtype or device or with values > 0 (``tuning.check_gate_values``), bad document
    boundaries, an unknown impl or backend, a local length the layout cannot split, or ranks
    whose calls differ (shapes, dtypes, options, boundaries: checked by one small all-gather
    the first time each call signature is seen, see :mod:`sp_attention.call_check`).
    """
    return _attend(q, k, v, slopes, g, cu_seqlens, ctx, impl, scale, backend, None, tuning)


def lightning_attention_with_kernels(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                     slopes: Optional[torch.Tensor], kernels: FlaKernels, *,
                                     g: Optional[torch.Tensor] = None, cu_seqlens=None,
                                     ctx: Optional[SPContext] = None, impl: Optional[str] = None,
                                     scale: float = 1.0, tuning: Optional[LinearTuning] = None
                                     ) -> torch.Tensor:
    """:func:`lightning_attention` through the fla path's orchestration (the multi-leaf path,
    its streams and scans) with ``kernels`` in place of fla's, whatever the device: the CPU
    tests run it with pure-torch stand-ins (``tests/linear/test_fla_orchestration.py``). Not
    public API. The same input checks and cross-rank call check run as for
    :func:`lightning_attention`.
    """
    return _attend(q, k, v, slopes, g, cu_seqlens, ctx, impl, scale, None, kernels, tuning)


def _local(backend, kernels, q, k, v):
    """The local kernel choice: a kernel set, or the backend name resolved."""
    if kernels is not None:
        if not isinstance(kernels, FlaKernels):
            raise TypeError(f"kernels must be a FlaKernels, got {type(kernels).__name__}")
        return kernels
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be a name in {BACKENDS} or None, got "
                        f"{type(backend).__name__}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"unknown local backend {backend!r}; use one of {BACKENDS} or None")
    return "torch" if resolve_kernels(backend, q, k, v) is None else "fla"


def _attend(q, k, v, slopes, g, cu_seqlens, ctx: Optional[SPContext], impl: Optional[str],
            scale, backend: Optional[str], kernels: Optional[FlaKernels],
            tuning: Optional[LinearTuning]) -> torch.Tensor:
    """Checks (on every rank, before any collective), then the autograd Function. ``kernels``:
    a kernel set for the fla path (None: the ``backend`` name decides)."""
    ctx = resolve_ctx(ctx)
    tuning = _DEFAULT if tuning is None else tuning
    q, k, v = autocast_inputs(q, k, v)
    error, local, plan, gates_read = None, None, None, False
    resolved = DEFAULT_IMPL if impl is None else impl
    try:
        if not isinstance(tuning, LinearTuning):
            raise TypeError(f"tuning must be a LinearTuning or None, got {type(tuning).__name__}")
        gates_read = check_inputs(q, k, v, slopes, g, ctx, scale, tuning)
        if cu_seqlens is not None:
            plan = resolve_plan(cu_seqlens, ctx, q.shape[1], q.device)
        local = _local(backend, kernels, q, k, v)
        resolved = resolve_impl(impl, ctx, q, v)
    except (TypeError, ValueError) as e:
        error = e
    # a gate tensor's values were read on this call: agree on the outcome on every rank
    always = isinstance(tuning, LinearTuning) and (tuning.check_every_call or gates_read)
    agree_across_ranks(ctx, "lightning_attention",
                       call_signature(q, k, v, slopes, g, resolved, scale, backend, kernels,
                                      tuning, ctx, plan), error, always)
    if slopes is not None:
        slopes = slopes.to(device=q.device)
    with autocast_off(q.device):
        if plan is not None and not plan.is_trivial:
            lp = linear_packing(plan, ctx.rank)
            return _PackedLightningAttention.apply(q, k, v, g, slopes, ctx, resolved,
                                                   float(scale), local, tuning, lp)
        return _LightningAttention.apply(q, k, v, g, slopes, ctx, resolved, float(scale), local,
                                         tuning)

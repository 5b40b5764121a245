"""Context-parallel causal GQA softmax attention: autograd Function and public function.

Forward schedules (``fwd``): ``ring`` (:mod:`.fwd_ring`) and ``allgather``
(:mod:`.fwd_allgather`). Backward schedules (``bwd``): ``ring`` (:mod:`.bwd_ring`) and
``allgather`` (:mod:`.bwd_allgather`). Any forward pairs with any backward: the backward needs
only ``q, k, v, out`` and the global ``lse``, which is all the Function saves. The all-to-all
schedules ``a2a`` and ``a2a_ring`` (:mod:`.a2a`) run forward and backward as one, in their own
Function.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from ..caches import LRU
from ..call_check import agree_across_ranks, plan_identity
from ..context import SPContext
from ..cost.auto import auto_softmax_preset
from ..peer_copy import check_device as check_peer_device
from ..planning.softmax_a2a import head_chunks
from ..planning.softmax_packed import DENSE_MIN, NO_DENSE_CALLS, CallPolicy, auto_dense_min
from ..tuning import SoftmaxTuning
from ..validation import (autocast_inputs, autocast_off, check_local_length, check_tensors,
                          resolve_ctx)
from .a2a import A2AAttention, A2AConfig
from .bwd_allgather import allgather_backward
from .bwd_ring import ring_backward
from .fwd_allgather import allgather_forward
from .fwd_ring import ring_forward
from .backends import KernelBackend, get_backend
from .packed import PackedAttention, PackedConfig, packed_plan_for
from .schedule import (A2A_SCHEDULES, BWD_SCHEDULES, DEFAULT_PRESET, FWD_SCHEDULES, PRESETS,
                       SoftmaxSchedule, default_heads_k_stride)

__all__ = ["context_parallel_attention", "PRESETS", "DEFAULT_PRESET", "FWD_SCHEDULES",
           "BWD_SCHEDULES", "SoftmaxSchedule", "default_heads_k_stride"]

_DEFAULT = SoftmaxTuning()


@dataclass(frozen=True)
class _Config:
    ctx: SPContext
    fwd: str
    bwd: str
    causal: bool
    scale: float
    backend: KernelBackend
    stride: int
    first: Optional[int]
    last: Optional[int]
    return_lse: bool
    pack_kv: bool
    a2a_size: Optional[int] = None     # the all-to-all schedules: U (P for "a2a")
    a2a_chunks: int = 1                # the all-to-all schedules: head chunks (pipelined)
    own_last: bool = False             # the ring pair: the own block last in the backward


def ring_backward_own_last(tuning: SoftmaxTuning, fwd: str, bwd: str, world: int) -> bool:
    """Whether the ring backward runs the rank's own block last
    (``SoftmaxTuning.ring_backward_order``): only after the ring forward, which keeps the
    block it starts from, and across ranks. ``"auto"``: own block first."""
    return (tuning.ring_backward_order == "own_last" and fwd == "ring" == bwd and world > 1)


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, cfg: _Config):
        kept = ()
        if cfg.own_last:      # the last K/V block, where the backward starts
            out, lse, kept = ring_forward(q, k, v, cfg.ctx, cfg.backend, causal=cfg.causal,
                                          scale=cfg.scale, pack_kv=cfg.pack_kv, keep_last=True)
        elif cfg.fwd == "ring":
            out, lse = ring_forward(q, k, v, cfg.ctx, cfg.backend, causal=cfg.causal,
                                    scale=cfg.scale, pack_kv=cfg.pack_kv)
        else:
            out, lse = allgather_forward(q, k, v, cfg.ctx, cfg.backend, causal=cfg.causal,
                                         scale=cfg.scale, heads_k_stride=cfg.stride)
        fctx.save_for_backward(q, k, v, out, lse, *kept)
        fctx.cfg = cfg
        if cfg.return_lse:
            fctx.mark_non_differentiable(lse)
            return out, lse
        return out

    @staticmethod
    def backward(fctx, dout, *unused):
        q, k, v, out, lse, *kept = fctx.saved_tensors
        cfg: _Config = fctx.cfg
        with autocast_off(q.device):
            if cfg.bwd == "ring":
                dq, dk, dv = ring_backward(dout, q, k, v, out, lse, cfg.ctx, cfg.backend,
                                           causal=cfg.causal, scale=cfg.scale,
                                           pack_kv=cfg.pack_kv, kept=tuple(kept) or None)
            else:
                dq, dk, dv = allgather_backward(dout, q, k, v, out, lse, cfg.ctx, cfg.backend,
                                                causal=cfg.causal, scale=cfg.scale,
                                                heads_k_stride=cfg.stride, first=cfg.first,
                                                last=cfg.last)
        return dq, dk, dv, None


def _check_tensors(q, k, v, ctx: SPContext) -> None:
    check_tensors(q=q, k=k, v=v)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q must be [B, T_local, H, D] and k, v [B, T_local, Hkv, D]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape "
                         "(this op uses one head dim for keys and values)")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1]:
        hint = ""
        if q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2] and k.shape[1] \
                and q.shape[1] % k.shape[1] == 0:
            hint = (" They look like [B, H, T, D] (the SDPA / HF layout: dim 1 holds the "
                    f"{q.shape[1]} query and {k.shape[1]} KV heads); this op takes "
                    "[B, T_local, H, D]: pass q, k, v .transpose(1, 2) and transpose the "
                    "output back.")
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch and "
                         f"local sequence length (dims 0 and 1).{hint}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q head dim {q.shape[3]} != k head dim {k.shape[3]}")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads {q.shape[2]} must be a multiple of KV heads {k.shape[2]} "
                         "(GQA: query head h uses KV head h // (H / Hkv))")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them "
                         "to one dtype (under torch.autocast the op casts them to the autocast "
                         "dtype itself, as SDPA does)")
    if not q.dtype.is_floating_point:
        raise ValueError(f"q, k, v must be floating point, got {q.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices ({q.device}, {k.device}, "
                         f"{v.device})")
    check_local_length(q, ctx)


def _check_scale(scale) -> None:
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (
            math.isfinite(scale) and scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite float or None "
                         f"(None = head_dim ** -0.5), got {scale!r}")


def context_parallel_attention(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, ctx: Optional[SPContext] = None,
        fwd: Optional[str] = None, bwd: Optional[str] = None,
        heads_k_stride: Optional[int] = None, bwd_head_first_stride: Optional[int] = None,
        bwd_head_last_stride: Optional[int] = None, causal: bool = True,
        softmax_scale: Optional[float] = None, backend: Optional[str] = None,
        preset: Optional[str] = None, return_lse: bool = False,
        tuning: Optional[SoftmaxTuning] = None, cu_seqlens=None, a2a_size: Optional[int] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Softmax attention (causal, GQA) over a sequence split across a context-parallel group.

    Equals single-device ``softmax(scale · q kᵀ + mask) v`` on the *global* sequence; every
    rank gets the rows of its own shard. Causal means each token sees itself and every earlier
    token of the global sequence.

    Args:
        q: ``[B, T_local, H, D]`` (not SDPA's ``[B, H, T, D]``), this rank's shard of the queries (``sp_attention.
            shard_sequence``: zigzag holds chunks ``r`` and ``2P−1−r`` of ``2P``, contiguous the
            ``r``-th of ``P``; the layout is ``ctx.layout``).
        k, v: ``[B, T_local, Hkv, D]`` with ``H % Hkv == 0`` (query head h uses KV head
            ``h // (H / Hkv)``); K/V are communicated with their ``Hkv`` heads, never expanded.
        ctx: the CP :class:`~sp_attention.SPContext`. ``None`` or world size 1: single-device
            attention through the same code.
        fwd, bwd: forward / backward schedule, each ``"ring"`` or ``"allgather"``; ``None``
            takes the value of the default preset ``"ring"`` (fwd and bwd ``"ring"``, the
            fastest pair measured on 2× H200; see benchmarks/results). The all-to-all
            schedules (``"a2a"``, ``"a2a_ring"``) pair only with themselves: use the preset.
        heads_k_stride: KV heads per all-gather step (allgather schedules only); must divide
            ``Hkv``. ``None``: the smallest divisor giving at least 8 query heads per kernel
            call (:func:`default_heads_k_stride`; 2 for Llama-3-8B's 8 KV heads and group 4).
        bwd_head_first_stride, bwd_head_last_stride: split the backward's first / last stride
            into ``[f, stride−f]`` / ``[stride−l, l]`` heads to shrink the exposed first
            gather and last reduce-scatter (``bwd="allgather"`` only; ``0 < f, l < stride``;
            with one stride ``f + l <= stride``). With one local KV head the all-gather
            backward pipelines over sequence pieces instead, and these must be None.
        causal: causal mask on the global sequence (default True).
        softmax_scale: multiplies the scores ``q·k``; defaults to ``D ** -0.5`` (the name and
            default of flash-attn and Megatron; :func:`~sp_attention.lightning_attention`'s
            ``scale`` multiplies ``q`` and defaults to 1.0, the linear-attention convention).
        backend: kernel backend name (``"cudnn"``, ``"flash"``, ``"flash_attn"``, ``"math"``)
            or None for the fastest that can run the inputs (cuDNN on Hopper, math on CPU).
        preset: a name from :data:`PRESETS` setting ``fwd`` and ``bwd`` together; passing a
            different ``fwd``/``bwd`` as well raises. ``"a2a"`` (Ulysses): all-to-all from
            sequence to head shards over the whole group, the kernel on the whole sequence,
            all-to-all back (needs ``H % P == 0``; KV heads are replicated to the ranks that
            need them when ``Hkv % P != 0``). ``"a2a_ring"``: all-to-all inside groups of
            ``a2a_size`` consecutive ranks, ring across the groups (USP). ``"auto"``: the cost model's cheapest
            predicted pair for this call's shape, group and links
            (:func:`sp_attention.auto.auto_softmax_preset`, decided and logged once per layer
            shape; one rank, or packed documents: the default).
        return_lse: also return the global log-sum-exp ``[B, H, T_local]`` (not
            differentiable).
        tuning: :class:`~sp_attention.SoftmaxTuning` (None: the defaults); never changes the
            numbers.
        cu_seqlens: packed documents: the GLOBAL row's document boundaries (``[N+1]`` int32 /
            int64 tensor, 0 … row length, the same on every rank; on the CPU or q's device) or
            the batch's :class:`~sp_attention.PackingPlan` (:func:`~sp_attention.plan_packing`;
            pass the plan when the row ends in padding). A token then attends to earlier tokens
            of its own document only; q, k, v are this rank's shard as the plan places it
            (``plan.shard``); padding rows give 0 (lse −inf) and zero gradients. Needs
            ``causal=True``. None (default), or one document laid out as the unpacked layout:
            today's path.
        a2a_size: ranks per all-to-all group of ``preset="a2a_ring"`` (``U`` consecutive
            ranks of the group; divides P and H; required with ``"a2a_ring"``; no process group
            of its own is made). With ``"auto"``: lets the cost model consider ``a2a_ring``
            with this U.

    Returns:
        ``out [B, T_local, H, D]`` in ``q.dtype`` (and ``lse`` if ``return_lse``: fp32, fp64 for
        fp64 inputs). LSE merges, dq accumulation across blocks and the dK/dV reductions
        across ranks run in fp32 (fp64 for fp64 inputs); the kernels run in the input dtype.
        Gradients come back in the dtypes of q, k, v.

    Raises:
        TypeError / ValueError before the op communicates, with the fix in the message: non-tensor
        inputs; shapes that disagree (rank, B, T_local, D, ``H % Hkv``) or dtypes/devices that
        differ; a local length the layout cannot split; an unknown fwd / bwd / preset /
        backend, or a preset contradicting fwd/bwd; a stride that does not divide the local KV
        heads or first/last splits out of range; an all-to-all preset whose group size does
        not divide the local query heads or the CP group; a backend that cannot run the inputs (the
        message lists those that can). Raised on every rank: a rank whose own check fails
        tells the others, and ranks whose calls differ (shapes, dtypes, options) all raise;
        both through one small all-gather the first time each call signature is seen
        (:mod:`sp_attention.call_check`).
    """
    ctx = resolve_ctx(ctx)
    tuning = _DEFAULT if tuning is None else tuning
    q, k, v = autocast_inputs(q, k, v)
    options = dict(fwd=fwd, bwd=bwd, preset=preset, heads_k_stride=heads_k_stride,
                   bwd_head_first_stride=bwd_head_first_stride,
                   bwd_head_last_stride=bwd_head_last_stride, causal=causal,
                   softmax_scale=softmax_scale, backend=backend, return_lse=return_lse,
                   a2a_size=a2a_size)
    cfg, error, plan = None, None, None
    try:
        plan = packed_plan_for(cu_seqlens, q, ctx, causal)
        cfg = _config(q, k, v, ctx, tuning, packed=plan is not None and not plan.is_trivial,
                      **options)
        if cfg.fwd in A2A_SCHEDULES and tuning.a2a_transport == "copy_engine":
            check_peer_device(q.device)
    except (TypeError, ValueError) as e:
        error = e
    signature = (("tensors", tuple((n, _shape(x), getattr(x, "dtype", None))
                                   for n, x in (("q", q), ("k", k), ("v", v)))),
                 ("device", q.device.type if isinstance(q, torch.Tensor) else None),
                 ("layout", ctx.layout), ("tuning", tuning)) + tuple(options.items())
    if cfg is not None:     # "auto" resolved per rank: ranks that picked differently raise
        signature += (("schedule", (cfg.fwd, cfg.bwd, cfg.a2a_size)),)
    if cu_seqlens is not None:      # ranks disagreeing on the boundaries all raise
        signature += (("cu_seqlens", plan_identity(ctx, plan) if plan is not None
                       else "invalid"),)
    agree_across_ranks(ctx, "context_parallel_attention", signature, error,
                       isinstance(tuning, SoftmaxTuning) and tuning.check_every_call)
    with autocast_off(q.device):
        packed = plan is not None and not plan.is_trivial
        if cfg.fwd in A2A_SCHEDULES:
            return A2AAttention.apply(q, k, v, A2AConfig(
                cfg.ctx, cfg.a2a_size, cfg.causal, cfg.scale, cfg.backend, cfg.return_lse,
                cfg.pack_kv, plan if packed else None,
                _call_policy(tuning, plan if packed else None, q),
                cfg.a2a_chunks, tuning.a2a_direct, tuning.a2a_transport))
        if packed:
            return PackedAttention.apply(q, k, v, PackedConfig(
                cfg.ctx, plan, cfg.fwd, cfg.bwd, cfg.scale, cfg.backend, cfg.stride, cfg.first,
                cfg.last, cfg.return_lse, cfg.pack_kv, _call_policy(tuning, plan, q)))
        return _ContextParallelAttention.apply(q, k, v, cfg)


def _call_policy(tuning: SoftmaxTuning, plan, q: torch.Tensor) -> CallPolicy:
    """How this call's packed document pairs become kernel calls (``packed_dense_min`` None:
    :func:`~sp_attention.planning.softmax_packed.auto_dense_min` of the row), counting the
    call as one of its packing plan's: no dense call until the plan has had more than
    ``tuning.packed_dense_after`` of them (:data:`_PLAN_CALLS`)."""
    if plan is not None and _count_plan_call(plan) <= tuning.packed_dense_after:
        return CallPolicy(NO_DENSE_CALLS, tuning.packed_varlen_gaps)
    dense_min = tuning.packed_dense_min
    if dense_min is None:
        dense_min = DENSE_MIN if plan is None else auto_dense_min(
            plan.cu_seqlens, plan.world_size, q.shape[2], q.shape[3])
    return CallPolicy(dense_min, tuning.packed_varlen_gaps)


# Calls (forwards) so far per packing plan, i.e. per layout of documents over the ranks. A dense
# call's kernel (cuDNN) builds an execution plan for every new shape it meets (110-160 ms for a
# forward + backward on H200, measured 2026-11-28), which pays only where a layout recurs (the
# same documents step after step, a benchmark); training on varied documents meets new shapes
# every step, so its calls stay varlen. Every rank makes the same calls with the same plans, so
# every rank counts alike.
_PLAN_CALLS = LRU(256)


def _count_plan_call(plan) -> int:
    n = _PLAN_CALLS.get(plan, lambda: 0) + 1
    _PLAN_CALLS.put(plan, n)
    return n


def _shape(x) -> object:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


def _config(q, k, v, ctx: SPContext, tuning, *, fwd, bwd, preset, heads_k_stride,
            bwd_head_first_stride, bwd_head_last_stride, causal, softmax_scale, backend,
            return_lse, a2a_size=None, packed=False) -> _Config:
    """Every local check of the public function (the docstring's Raises), then its config."""
    if not isinstance(tuning, SoftmaxTuning):
        raise TypeError(f"tuning must be a SoftmaxTuning or None, got {type(tuning).__name__}")
    _check_tensors(q, k, v, ctx)
    sched = SoftmaxSchedule(preset, fwd, bwd, heads_k_stride, bwd_head_first_stride,
                            bwd_head_last_stride, backend, a2a_size)
    kv_heads, group = k.shape[2], q.shape[2] // k.shape[2]
    _check_scale(softmax_scale)
    if not isinstance(causal, bool) or not isinstance(return_lse, bool):
        raise TypeError(f"causal and return_lse must be bools, got {causal!r}, {return_lse!r}")
    if sched.is_auto:       # the cost model's pair for this shape (one rank: nothing crosses)
        sched.local_stride(kv_heads, default_heads_k_stride(kv_heads, group, tuning))
        sched = sched.resolve(DEFAULT_PRESET if ctx.world_size == 1 else auto_softmax_preset(
            ctx, q, k, causal=causal, heads_k_stride=sched.heads_k_stride,
            a2a_size=sched.auto_a2a_size(ctx.world_size, q.shape[2]), packed=packed).name)
    size = sched.a2a_group_size(ctx.world_size, q.shape[2])
    chunks = 1 if size is None else head_chunks(q.shape[2], kv_heads, size,
                                                tuning.a2a_head_chunks)
    stride = sched.local_stride(kv_heads, default_heads_k_stride(kv_heads, group, tuning))
    kernel = get_backend(backend, q.device, q.dtype, q.shape[3])   # raises if it cannot run
    scale = q.shape[3] ** -0.5 if softmax_scale is None else float(softmax_scale)
    return _Config(ctx, sched.fwd, sched.bwd, causal, scale, kernel, stride,
                   sched.bwd_head_first_stride, sched.bwd_head_last_stride, return_lse,
                   tuning.pack_kv, size, chunks,
                   ring_backward_own_last(tuning, sched.fwd, sched.bwd, ctx.world_size))

"""Context-parallel causal GQA softmax attention: autograd Function and public function.

Forward schedules (``fwd``): ``ring`` (:mod:`.fwd_ring`) and ``allgather``
(:mod:`.fwd_allgather`). Backward schedules (``bwd``): ``ring`` (:mod:`.bwd_ring`) and
``allgather`` (:mod:`.bwd_allgather`). Any forward pairs with any backward: the backward needs
only ``q, k, v, out`` and the global ``lse``, which is all the Function saves.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from ..context import SPContext
from .bwd_allgather import allgather_backward
from .bwd_ring import ring_backward
from .fwd_allgather import allgather_forward
from .fwd_ring import ring_forward
from .backends import BACKEND_NAMES, KernelBackend, get_backend

__all__ = ["context_parallel_attention", "PRESETS", "DEFAULT_PRESET", "FWD_SCHEDULES",
           "BWD_SCHEDULES", "default_heads_k_stride"]

FWD_SCHEDULES = ("ring", "allgather")
BWD_SCHEDULES = ("ring", "allgather")

PRESETS: dict[str, tuple[str, str]] = {
    # ring forward + all-gather / async fp32 reduce-scatter backward with head strides: the
    # product's "fwd-ring/bwd-flash". The forward overlaps P - 1 small hops with no exposed
    # gather; the backward overlaps everything but one stride's gather and reduce-scatter.
    "ring_ag": ("ring", "allgather"),
    "ring": ("ring", "ring"),                 # ring-flash-attention: p2p only, O(1) buffers
    "allgather": ("allgather", "allgather"),  # no LSE merge; best for small P within a node
    "ag_ring": ("allgather", "ring"),
}
# Default by measurement (2x H200, Llama-3-8B attention, benchmarks/results): ring/ring was the
# fastest pair at T_local 8K (0.76 of one GPU vs 0.66 for ring/allgather) and 32K (0.925 vs
# 0.910). Revisit when the all-gather backward's per-stride overhead is fixed.
DEFAULT_PRESET = "ring"

# Smallest useful kernel call: query heads per call × query tiles should fill the GPU (8 heads
# × 32 tiles of 128 rows at a 4K-token chunk = 256 CTAs, about two waves on 132 SMs).
_MIN_QUERY_HEADS_PER_CALL = 8


def default_heads_k_stride(kv_heads: int, group: int) -> int:
    """Smallest divisor ``s`` of the local KV heads with ``s · group >= 8`` query heads per call
    (all local KV heads if none).

    Why: only the first gather and the last reduce-scatter of the all-gather schedules are
    exposed, and they move ``s / Hkv`` of the traffic, so ``s`` should be small; but each
    kernel call covers ``s · group`` query heads and must still fill the GPU. Llama-3-8B
    (8 local KV heads, group 4) gets ``s = 2`` (4 strides); group 8 gets ``s = 1``.
    """
    for s in range(1, kv_heads + 1):
        if kv_heads % s == 0 and s * group >= _MIN_QUERY_HEADS_PER_CALL:
            return s
    return kv_heads


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


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, cfg: _Config):
        if cfg.fwd == "ring":
            out, lse = ring_forward(q, k, v, cfg.ctx, cfg.backend, causal=cfg.causal,
                                    scale=cfg.scale)
        else:
            out, lse = allgather_forward(q, k, v, cfg.ctx, cfg.backend, causal=cfg.causal,
                                         scale=cfg.scale, heads_k_stride=cfg.stride)
        fctx.save_for_backward(q, k, v, out, lse)
        fctx.cfg = cfg
        if cfg.return_lse:
            fctx.mark_non_differentiable(lse)
            return out, lse
        return out

    @staticmethod
    def backward(fctx, dout, *unused):
        q, k, v, out, lse = fctx.saved_tensors
        cfg: _Config = fctx.cfg
        if cfg.bwd == "ring":
            dq, dk, dv = ring_backward(dout, q, k, v, out, lse, cfg.ctx, cfg.backend,
                                       causal=cfg.causal, scale=cfg.scale)
        else:
            dq, dk, dv = allgather_backward(dout, q, k, v, out, lse, cfg.ctx, cfg.backend,
                                            causal=cfg.causal, scale=cfg.scale,
                                            heads_k_stride=cfg.stride, first=cfg.first,
                                            last=cfg.last)
        return dq, dk, dv, None


def _check_tensors(q, k, v, ctx: SPContext) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q must be [B, T_local, H, D] and k, v [B, T_local, Hkv, D]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape "
                         "(this op uses one head dim for keys and values)")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch and "
                         "local sequence length (dims 0 and 1)")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q head dim {q.shape[3]} != k head dim {k.shape[3]}")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads {q.shape[2]} must be a multiple of KV heads {k.shape[2]} "
                         "(GQA: query head h uses KV head h // (H / Hkv))")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them "
                         "to one dtype")
    if not q.dtype.is_floating_point:
        raise ValueError(f"q, k, v must be floating point, got {q.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices ({q.device}, {k.device}, "
                         f"{v.device})")
    n = len(ctx.leaves)
    if q.shape[1] == 0 or q.shape[1] % n:
        raise ValueError(f"the local sequence length {q.shape[1]} must be a positive multiple of "
                         f"{n} for layout {ctx.layout!r} (each rank holds {n} equal chunks); "
                         "pad the global sequence with sp_attention.pad_for_layout")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_strides(kv_heads: int, stride, first, last, bwd: str) -> None:
    if not _is_int(stride) or stride < 1 or kv_heads % stride:
        divisors = [d for d in range(1, kv_heads + 1) if kv_heads % d == 0]
        raise ValueError(f"heads_k_stride={stride!r} must be a positive divisor of the "
                         f"{kv_heads} local KV heads; use one of {divisors} (or None)")
    for name, val in (("bwd_head_first_stride", first), ("bwd_head_last_stride", last)):
        if val is None:
            continue
        if bwd != "allgather":
            raise ValueError(f"{name} only applies to bwd='allgather' (got bwd={bwd!r}); "
                             "leave it None")
        if kv_heads == 1:
            raise ValueError(f"{name}={val!r}: with one local KV head the all-gather backward "
                             "pipelines over the sequence instead of heads; leave it None")
        if stride == 1:
            raise ValueError(f"{name}={val!r}: heads_k_stride=1 leaves no stride to split (no "
                             f"split is possible); use heads_k_stride >= 2 or leave {name} None")
        if not _is_int(val) or not 0 < val < stride:
            raise ValueError(f"{name}={val!r} must satisfy 0 < {name} < heads_k_stride "
                             f"({stride}); pick one of 1..{stride - 1} or None")
    if kv_heads == stride and first is not None and last is not None and first + last > stride:
        raise ValueError(f"with a single stride of {stride} KV heads, bwd_head_first_stride "
                         f"({first}) + bwd_head_last_stride ({last}) must be <= {stride}; "
                         "lower one of them or use a smaller heads_k_stride")


def _resolve_schedules(fwd: Optional[str], bwd: Optional[str],
                       preset: Optional[str]) -> tuple[str, str]:
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; use one of {sorted(PRESETS)}")
        pf, pb = PRESETS[preset]
        for name, given, want in (("fwd", fwd, pf), ("bwd", bwd, pb)):
            if given is not None and given != want:
                raise ValueError(f"preset={preset!r} means {name}={want!r} but {name}={given!r} "
                                 f"was passed; drop one of the two")
        fwd, bwd = pf, pb
    dflt_f, dflt_b = PRESETS[DEFAULT_PRESET]
    fwd = dflt_f if fwd is None else fwd
    bwd = dflt_b if bwd is None else bwd
    if fwd not in FWD_SCHEDULES:
        raise ValueError(f"unknown forward schedule fwd={fwd!r}; use one of {FWD_SCHEDULES}")
    if bwd not in BWD_SCHEDULES:
        raise ValueError(f"unknown backward schedule bwd={bwd!r}; use one of {BWD_SCHEDULES}")
    return fwd, bwd


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
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Softmax attention (causal, GQA) over a sequence split across a context-parallel group.

    Equals single-device ``softmax(scale · q kᵀ + mask) v`` on the *global* sequence; every
    rank gets the rows of its own shard. Causal means each token sees itself and every earlier
    token of the global sequence.

    Args:
        q: ``[B, T_local, H, D]``, this rank's shard of the queries (``sp_attention.
            shard_sequence``: zigzag holds chunks ``r`` and ``2P−1−r`` of ``2P``, contiguous the
            ``r``-th of ``P``; the layout is ``ctx.layout``).
        k, v: ``[B, T_local, Hkv, D]`` with ``H % Hkv == 0`` (query head h uses KV head
            ``h // (H / Hkv)``); K/V are communicated with their ``Hkv`` heads, never expanded.
        ctx: the CP :class:`~sp_attention.SPContext`. ``None`` or world size 1: single-device
            attention through the same code.
        fwd, bwd: forward / backward schedule, each ``"ring"`` or ``"allgather"``; ``None``
            takes the value of the default preset ``"ring"`` (fwd and bwd ``"ring"``, the
            fastest pair measured on 2× H200; see benchmarks/results).
        heads_k_stride: KV heads per all-gather step (allgather schedules only); must divide
            ``Hkv``. ``None``: the smallest divisor giving at least 8 query heads per kernel
            call (:func:`default_heads_k_stride`; 2 for Llama-3-8B's 8 KV heads and group 4).
        bwd_head_first_stride, bwd_head_last_stride: split the backward's first / last stride
            into ``[f, stride−f]`` / ``[stride−l, l]`` heads to shrink the exposed first
            gather and last reduce-scatter (``bwd="allgather"`` only; ``0 < f, l < stride``;
            with one stride ``f + l <= stride``). With one local KV head the all-gather
            backward pipelines over sequence pieces instead, and these must be None.
        causal: causal mask on the global sequence (default True).
        softmax_scale: defaults to ``D ** -0.5``.
        backend: kernel backend name (``"cudnn"``, ``"flash"``, ``"flash_attn"``, ``"math"``)
            or None for the fastest that can run the inputs (cuDNN on Hopper, math on CPU).
        preset: a name from :data:`PRESETS` setting ``fwd`` and ``bwd`` together; passing a
            different ``fwd``/``bwd`` as well raises.
        return_lse: also return the global log-sum-exp ``[B, H, T_local]`` (not
            differentiable).

    Returns:
        ``out [B, T_local, H, D]`` in ``q.dtype`` (and ``lse`` if ``return_lse``: fp32, fp64 for
        fp64 inputs). LSE merges, dq accumulation across blocks and the dK/dV reductions
        across ranks run in fp32 (fp64 for fp64 inputs); the kernels run in the input dtype.
        Gradients come back in the dtypes of q, k, v.

    Raises:
        TypeError / ValueError before any communication, with the fix in the message: non-tensor
        inputs; shapes that disagree (rank, B, T_local, D, ``H % Hkv``) or dtypes/devices that
        differ; a local length the layout cannot split; an unknown fwd / bwd / preset /
        backend, or a preset contradicting fwd/bwd; a stride that does not divide the local KV
        heads or first/last splits out of range; a backend that cannot run the inputs (the
        message lists those that can). Every rank must call with the same shapes and options.
    """
    ctx = ctx if ctx is not None else SPContext(None, 0, 1, (0,), "contiguous")
    if not isinstance(ctx, SPContext):
        raise TypeError(f"ctx must be an SPContext or None, got {type(ctx).__name__}")
    _check_tensors(q, k, v, ctx)
    fwd, bwd = _resolve_schedules(fwd, bwd, preset)
    kv_heads, group = k.shape[2], q.shape[2] // k.shape[2]
    stride = default_heads_k_stride(kv_heads, group) if heads_k_stride is None else heads_k_stride
    _check_strides(kv_heads, stride, bwd_head_first_stride, bwd_head_last_stride, bwd)
    _check_scale(softmax_scale)
    if not isinstance(causal, bool) or not isinstance(return_lse, bool):
        raise TypeError(f"causal and return_lse must be bools, got {causal!r}, {return_lse!r}")
    if backend is not None and backend not in BACKEND_NAMES:
        raise ValueError(f"unknown kernel backend {backend!r}; use one of {BACKEND_NAMES} or "
                         "None (automatic)")
    kernel = get_backend(backend, q.device, q.dtype, q.shape[3])   # raises if it cannot run
    scale = q.shape[3] ** -0.5 if softmax_scale is None else float(softmax_scale)
    cfg = _Config(ctx, fwd, bwd, causal, scale, kernel, stride, bwd_head_first_stride,
                  bwd_head_last_stride, return_lse)
    return _ContextParallelAttention.apply(q, k, v, cfg)

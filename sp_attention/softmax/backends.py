"""Softmax kernel backends by name: the registry (:data:`BACKEND_NAMES`, :func:`get_backend`,
:func:`list_backends`) and :func:`make_backend`, which wraps a kernel's raw calls with the
checks, the GQA expansion and the bottom-right causal split it needs.

The context-parallel schedules call a backend on a block of queries against a block of keys
and merge blocks by LSE (:mod:`.merge`). Every backend has the same interface
(:mod:`.backend_common`)::

    forward(q, k, v, causal, scale)                      -> (out, lse)
    backward(dout, q, k, v, out, lse, causal, scale)     -> (dq, dk, dv)

Shapes: q, dout, out [B, Tq, H, D]; k, v [B, Tk, Hkv, D] with H % Hkv == 0; lse [B, H, Tq],
natural log of the scaled scores; ``scale=None`` means D ** -0.5. Causal alignment is
bottom-right (:mod:`.causal_split`); causal calls need Tq <= Tk.

Dtypes:
  * ``out`` is in q.dtype; ``lse`` is fp32 (fp64 for fp64 inputs, math backend only).
  * ``backward`` accepts ``out``/``dout`` in any float dtype (kernel backends cast them to
    q.dtype, as their kernels require) and ``lse`` as returned by ``forward`` or merged.
  * Gradients: the math backend returns fp32 (fp64 for fp64 inputs). Kernel backends return
    the kernel's q.dtype gradients when one kernel call produced them, and fp32 when the
    backend had to add partial results (the two-call causal split, or dK/dV summed over a GQA
    group it expanded). Callers accumulate in fp32 either way.

Backends, one module per kind:
  * ``math`` (:mod:`.backend_math`): pure torch, any device and float dtype, analytic
    backward, GQA without copies.
  * ``cudnn``, ``flash``, ``flash_attn`` (:mod:`.backend_cuda`): torch's cuDNN attention
    (fastest on Hopper), torch's FlashAttention-2 kernels, the optional ``flash_attn`` package.

The names of the split modules are re-exported here (:data:`__all__`), so
``sp_attention.softmax.backends`` stays the one import for users of the backends.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Mapping, Optional

import torch
from torch import Tensor

from ..precision import acc_dtype
from .backend_common import (BackwardFn, ForwardFn, KernelBackend, WhyNotFn, check_shapes,
                             default_scale, expand_kv, lastdim_contiguous, reduce_group)
from .backend_cuda import (HALF, NATIVE_BOTTOM_RIGHT, NATIVE_GQA, RAW_CALLS, capability,
                           flash_attn_version, raw_calls)
from .backend_math import MATH, math_backward, math_forward
from .causal_split import bottom_right_causal_backward, bottom_right_causal_forward

__all__ = [
    "BACKEND_NAMES", "BACKENDS", "KernelBackend", "get_backend", "list_backends", "make_backend",
    "raw_calls", "flash_attn_version",
    "math_forward", "math_backward",
    "bottom_right_causal_forward", "bottom_right_causal_backward",
    "NATIVE_BOTTOM_RIGHT", "NATIVE_GQA",
]

BACKEND_NAMES = ("math", "cudnn", "flash", "flash_attn")


def make_backend(name: str, fwd_call: ForwardFn, bwd_call: BackwardFn, why_not: WhyNotFn, *,
                 native_gqa: bool, native_bottom_right: bool) -> KernelBackend:
    """Wrap raw kernel calls (``fwd_call(q, k, v, causal, scale)``, ``bwd_call(dout, q, k, v,
    out, lse, causal, scale)``) with checks, GQA expansion (when not ``native_gqa``) and the
    bottom-right causal split (when not ``native_bottom_right``)."""

    def check(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> None:
        check_shapes(q, k, v)
        if causal and q.shape[1] > k.shape[1]:
            raise ValueError(f"causal block with Tq={q.shape[1]} > Tk={k.shape[1]}: bottom-right "
                             "alignment would leave query rows without keys")
        reason = why_not(q.device, q.dtype, q.shape[-1])
        if reason:
            raise ValueError(f"kernel backend {name!r}: {reason}; "
                             "backends that can: "
                             f"{', '.join(_capable(q.device, q.dtype, q.shape[-1]))}")

    def split(causal: bool, q: Tensor, k: Tensor) -> bool:
        return causal and q.shape[1] != k.shape[1] and not native_bottom_right

    def forward(q: Tensor, k: Tensor, v: Tensor, causal: bool,
                scale: Optional[float] = None) -> tuple[Tensor, Tensor]:
        check(q, k, v, causal)
        scale = default_scale(scale, q)
        q, k, v = (lastdim_contiguous(t) for t in (q, k, v))
        k, v, _ = expand_kv(q, k, v, native_gqa)
        if split(causal, q, k):
            return bottom_right_causal_forward(fwd_call, q, k, v, scale)
        return fwd_call(q, k, v, causal, scale)

    def backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 causal: bool, scale: Optional[float] = None) -> tuple[Tensor, Tensor, Tensor]:
        check(q, k, v, causal)
        scale = default_scale(scale, q)
        q, k, v = (lastdim_contiguous(t) for t in (q, k, v))
        # Kernels read out/dout in the input dtype with identical (contiguous) strides, and
        # the lse as a contiguous [B, H, Tq] buffer (a strided lse gives wrong gradients).
        dout = dout.to(q.dtype).contiguous()
        out = out.to(q.dtype).contiguous()
        lse = lse.to(acc_dtype(q.dtype)).contiguous()
        if lse.data_ptr() % 16:   # a view at an odd offset; cuDNN faults on unaligned bases
            lse = lse.clone()
        k, v, group = expand_kv(q, k, v, native_gqa)
        if split(causal, q, k):
            dq, dk, dv = bottom_right_causal_backward(bwd_call, dout, q, k, v, out, lse, scale)
        else:
            dq, dk, dv = bwd_call(dout, q, k, v, out, lse, causal, scale)
        return dq, reduce_group(dk, group), reduce_group(dv, group)

    return KernelBackend(name, forward, backward, why_not, native_gqa, native_bottom_right)


_BACKENDS: dict[str, KernelBackend] = {
    "math": MATH,
    **{name: make_backend(name, *calls, native_gqa=NATIVE_GQA[name],
                          native_bottom_right=NATIVE_BOTTOM_RIGHT[name])
       for name, calls in RAW_CALLS.items()},
}
# Every backend by name, including those that cannot run here (``why_not`` says why).
BACKENDS: Mapping[str, KernelBackend] = MappingProxyType(_BACKENDS)


def _capable(device: torch.device, dtype: torch.dtype, head_dim: Optional[int]) -> list[str]:
    return [n for n in BACKEND_NAMES if _BACKENDS[n].why_not(device, dtype, head_dim) is None]


def _auto_order(device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    if device.type != "cuda" or dtype not in HALF or not torch.cuda.is_available():
        return ("math",)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if capability(index)[0] == 9:
        # Hopper: torch's cuDNN attention is the fastest (~530 TFLOP/s fwd+bwd on an H200).
        return ("cudnn", "flash", "flash_attn", "math")
    return ("flash", "flash_attn", "cudnn", "math")


def get_backend(name: Optional[str], device, dtype: torch.dtype,
                head_dim: Optional[int] = None) -> KernelBackend:
    """Return the kernel backend ``name`` for ``dtype`` tensors on ``device``.

    ``name=None`` picks the fastest available: on CUDA with fp16/bf16, ``cudnn`` on sm90
    then ``flash`` then ``flash_attn``; ``math`` on CPU, for fp32/fp64 and as the last
    resort. An explicit ``name`` that cannot run the case (CPU tensors for a CUDA kernel, a
    dtype or ``head_dim`` it does not support, a package that is not installed) raises
    ``ValueError`` naming the backends that can. Unknown names raise ``ValueError``.
    """
    device = torch.device(device)
    if name is None:
        for cand in _auto_order(device, dtype):
            if _BACKENDS[cand].why_not(device, dtype, head_dim) is None:
                return _BACKENDS[cand]
        raise ValueError(f"no kernel backend can run {dtype} on {device}")
    if name not in _BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; valid names: "
                         f"{', '.join(BACKEND_NAMES)} (or None for automatic choice)")
    reason = _BACKENDS[name].why_not(device, dtype, head_dim)
    if reason:
        hd = f", head_dim {head_dim}" if head_dim is not None else ""
        raise ValueError(f"kernel backend {name!r} cannot run {dtype} on {device}{hd}: {reason}. "
                         f"Backends that can: {', '.join(_capable(device, dtype, head_dim))}")
    return _BACKENDS[name]


def list_backends(device=None, dtype: Optional[torch.dtype] = None,
                  head_dim: Optional[int] = None) -> list[str]:
    """Names of the backends usable here, in :data:`BACKEND_NAMES` order.

    Defaults: the current CUDA device with bfloat16 when CUDA is available, else CPU with
    float32 (so CPU-only machines list ``["math"]``).
    """
    cuda = torch.cuda.is_available()
    device = torch.device(device if device is not None else ("cuda" if cuda else "cpu"))
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return _capable(device, dtype, head_dim)

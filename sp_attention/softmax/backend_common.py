"""What every softmax kernel backend shares: the :class:`KernelBackend` interface, the input
check, the default scale and the GQA expansion of K/V for kernels without native GQA.

Interface (every backend, see :mod:`.backends` for the registry)::

    forward(q, k, v, causal, scale)                      -> (out, lse)
    backward(dout, q, k, v, out, lse, causal, scale)     -> (dq, dk, dv)

Shapes: q, dout, out [B, Tq, H, D]; k, v [B, Tk, Hkv, D] with H % Hkv == 0 (query head h uses
kv head h // (H / Hkv)); lse [B, H, Tq], natural log of the scaled scores. ``scale=None`` means
D ** -0.5. Causal alignment is bottom-right (:mod:`.causal_split`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from ..precision import acc_dtype

__all__ = ["ForwardFn", "BackwardFn", "WhyNotFn", "KernelBackend", "check_shapes",
           "default_scale", "lastdim_contiguous", "expand_kv", "reduce_group"]

ForwardFn = Callable[..., tuple[Tensor, Tensor]]
BackwardFn = Callable[..., tuple[Tensor, Tensor, Tensor]]
WhyNotFn = Callable[[torch.device, torch.dtype, Optional[int]], Optional[str]]


@dataclass(frozen=True)
class KernelBackend:
    """One kernel backend: ``forward``/``backward`` callables with the module's interface."""

    name: str
    """Backend name, one of :data:`sp_attention.softmax.backends.BACKEND_NAMES`."""
    forward: ForwardFn
    """``(q, k, v, causal, scale) -> (out [B, Tq, H, D] q.dtype, lse [B, H, Tq] fp32)``."""
    backward: BackwardFn
    """``(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)``; dk/dv have Hkv heads."""
    why_not: WhyNotFn
    """``(device, dtype, head_dim) -> None`` if the backend can run that case, else why not."""
    native_gqa: bool = True
    """The kernel takes K/V with fewer heads than Q (else K/V are expanded after any
    communication and dK/dV summed over each group in fp32)."""
    native_bottom_right: bool = True
    """A causal call with Tq < Tk is bottom-right aligned inside the kernel (else the exact
    two-call split of :func:`sp_attention.softmax.causal_split.bottom_right_causal_forward`
    runs)."""

    def supports(self, device, dtype: torch.dtype, head_dim: Optional[int] = None) -> bool:
        """True if this backend can run ``dtype`` tensors on ``device`` with ``head_dim``."""
        return self.why_not(torch.device(device), dtype, head_dim) is None


def check_shapes(q: Tensor, k: Tensor, v: Tensor) -> None:
    """``ValueError`` unless q, k, v fit the interface (4-D, GQA heads, one dtype/device)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D [B, T, heads, D], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head "
                         "dim")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"query heads {q.shape[2]} must be a multiple of kv heads {k.shape[2]}")
    if k.shape[1] == 0:
        raise ValueError("attention over zero keys is undefined; skip the block instead")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError("q, k, v must share dtype and device, got "
                         f"{q.dtype}/{k.dtype}/{v.dtype} on {q.device}/{k.device}/{v.device}")


def default_scale(scale: Optional[float], q: Tensor) -> float:
    """``scale``, or ``D ** -0.5`` for None."""
    return q.shape[-1] ** -0.5 if scale is None else float(scale)


def lastdim_contiguous(x: Tensor) -> Tensor:
    """Kernels need unit stride in D only; other strides (slices of a larger buffer) are fine."""
    return x if x.stride(-1) == 1 else x.contiguous()


def expand_kv(q: Tensor, k: Tensor, v: Tensor, native: bool) -> tuple[Tensor, Tensor, int]:
    """Repeat K/V heads to H when the kernel cannot do GQA; returns the group used (1: none)."""
    group = q.shape[2] // k.shape[2]
    if group == 1 or native:
        return k, v, 1
    return k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2), group


def reduce_group(dx: Tensor, group: int) -> Tensor:
    """Sum an expanded [B, T, H, D] gradient over each GQA group, in fp32 (fp64 stays)."""
    if group == 1:
        return dx
    b, t, h, d = dx.shape
    return dx.to(acc_dtype(dx.dtype)).reshape(b, t, h // group, group, d).sum(dim=3)

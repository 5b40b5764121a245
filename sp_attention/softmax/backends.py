"""Single-device softmax attention backends: kernels that return ``(out, lse)``, and their
backwards, behind one interface (the Triton kernels of this package live in ``*_kernel.py``).

The context-parallel schedules call these on a block of queries against a block of keys and
merge blocks by LSE (:mod:`.merge`). Every backend has the same interface:

    forward(q, k, v, causal, scale)                      -> (out, lse)
    backward(dout, q, k, v, out, lse, causal, scale)     -> (dq, dk, dv)

Shapes: q, dout, out [B, Tq, H, D]; k, v [B, Tk, Hkv, D] with H % Hkv == 0 (query head h uses
kv head h // (H / Hkv)); lse [B, H, Tq], natural log of the scaled scores. ``scale=None`` means
D ** -0.5.

Causal alignment is **bottom-right**: query i sees key j iff j <= i + (Tk - Tq), the alignment a
query chunk needs against the prefix of keys ending at its own position. Causal calls need
Tq <= Tk (no query row is then fully masked). A kernel whose causal flag is top-left (torch
SDPA's ``is_causal``; cuDNN's ``set_causal_mask``) is made bottom-right by
:func:`bottom_right_causal_forward`: a non-causal call on keys [0, Tk - Tq) and a square causal
call on the last Tq keys (where both alignments agree), merged exactly by LSE.

Dtypes:
  * ``out`` is in q.dtype; ``lse`` is fp32 (fp64 for fp64 inputs, math backend only).
  * ``backward`` accepts ``out``/``dout`` in any float dtype (kernel backends cast them to
    q.dtype, as their kernels require) and ``lse`` as returned by ``forward`` or merged.
  * Gradients: the math backend returns fp32 (fp64 for fp64 inputs). Kernel backends return
    the kernel's q.dtype gradients when one kernel call produced them, and fp32 when the
    backend had to add partial results (the two-call causal split, or dK/dV summed over a GQA
    group it expanded). Callers accumulate in fp32 either way.

Backends (see :func:`get_backend`):
  * ``math``: pure torch, any device and float dtype, analytic backward, GQA without copies.
  * ``cudnn``: ``aten._scaled_dot_product_cudnn_attention`` (+ ``_backward``), fp16/bf16,
    D % 8 == 0 and D <= 128, cuDNN >= 9. Fastest on Hopper.
  * ``flash``: ``aten._flash_attention_forward`` / ``_flash_attention_backward`` (the
    FlashAttention-2 kernels inside torch; the same kernels
    ``aten._scaled_dot_product_flash_attention`` wraps, minus its [B, H, T, D] transposes),
    fp16/bf16, sm80+, D % 8 == 0 and D <= 256, bottom-right causal natively.
  * ``flash_attn``: the optional ``flash_attn`` package (>= 2.3), imported lazily.
"""
from __future__ import annotations

import functools
import importlib.util
import inspect
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping, Optional

import torch
from torch import Tensor

from ..precision import acc_dtype
from .merge import merge_blocks_

__all__ = [
    "BACKEND_NAMES", "BACKENDS", "KernelBackend", "get_backend", "list_backends", "make_backend",
    "raw_calls", "flash_attn_version",
    "math_forward", "math_backward",
    "bottom_right_causal_forward", "bottom_right_causal_backward",
    "NATIVE_BOTTOM_RIGHT", "NATIVE_GQA",
]

ForwardFn = Callable[..., tuple[Tensor, Tensor]]
BackwardFn = Callable[..., tuple[Tensor, Tensor, Tensor]]
WhyNotFn = Callable[[torch.device, torch.dtype, Optional[int]], Optional[str]]

BACKEND_NAMES = ("math", "cudnn", "flash", "flash_attn")

# Whether causal=True with Tq < Tk is bottom-right aligned inside the kernel. When False the
# backend uses the exact two-call split instead. torch's flash kernel is FlashAttention-2,
# bottom-right since flash-attn 2.1 (torch/nn/attention/bias.py relies on it for
# causal_lower_right). torch's cuDNN graph uses set_causal_mask, which cudnn-frontend defines
# as top-left (aten/src/ATen/native/cudnn/MHA.cpp): kept False until a GPU run shows otherwise.
NATIVE_BOTTOM_RIGHT: dict[str, bool] = {"cudnn": False, "flash": True, "flash_attn": True}
# Whether the kernel accepts K/V with fewer heads than Q. When False the backend repeats K/V
# heads locally (after any communication) and sums dK/dV over each group in fp32.
NATIVE_GQA: dict[str, bool] = {"cudnn": True, "flash": True, "flash_attn": True}

_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class KernelBackend:
    """One kernel backend: ``forward``/``backward`` callables with the module's interface."""

    name: str
    """Backend name, one of :data:`BACKEND_NAMES`."""
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
    two-call split of :func:`bottom_right_causal_forward` runs)."""

    def supports(self, device, dtype: torch.dtype, head_dim: Optional[int] = None) -> bool:
        """True if this backend can run ``dtype`` tensors on ``device`` with ``head_dim``."""
        return self.why_not(torch.device(device), dtype, head_dim) is None


# --------------------------------------------------------------------------------------------
# Shared checks and helpers
# --------------------------------------------------------------------------------------------

def _check_shapes(q: Tensor, k: Tensor, v: Tensor) -> None:
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


def _default_scale(scale: Optional[float], q: Tensor) -> float:
    return q.shape[-1] ** -0.5 if scale is None else float(scale)


def _causal_allowed(tq: int, tk: int, top_left: bool, device) -> Tensor:
    """[tq, tk] bool, True where query i may see key j."""
    i = torch.arange(tq, device=device).unsqueeze(1)
    j = torch.arange(tk, device=device).unsqueeze(0)
    return j <= (i if top_left else i + (tk - tq))


def _lastdim_contiguous(x: Tensor) -> Tensor:
    # Kernels need unit stride in D only; other strides (slices of a larger buffer) are fine.
    return x if x.stride(-1) == 1 else x.contiguous()


def _normalize_lse(lse: Tensor, tq: int) -> Tensor:
    """Kernel lse -> contiguous fp32 [B, H, Tq]."""
    if lse.dim() == 4:          # cuDNN returns [B, H, Tq, 1]
        lse = lse[..., 0]
    return lse[..., :tq].float().contiguous()   # cut any padded Tq (older flash kernels)


def _expand_kv(q: Tensor, k: Tensor, v: Tensor, native: bool) -> tuple[Tensor, Tensor, int]:
    """Repeat K/V heads to H when the kernel cannot do GQA; returns the group used (1: none)."""
    group = q.shape[2] // k.shape[2]
    if group == 1 or native:
        return k, v, 1
    return k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2), group


def _reduce_group(dx: Tensor, group: int) -> Tensor:
    """Sum an expanded [B, T, H, D] gradient over each GQA group, in fp32 (fp64 stays)."""
    if group == 1:
        return dx
    b, t, h, d = dx.shape
    return dx.to(acc_dtype(dx.dtype)).reshape(b, t, h // group, group, d).sum(dim=3)


# --------------------------------------------------------------------------------------------
# Bottom-right causal from a top-left kernel: exact two-call split
# --------------------------------------------------------------------------------------------

def bottom_right_causal_forward(forward: ForwardFn, q: Tensor, k: Tensor, v: Tensor,
                                scale: float) -> tuple[Tensor, Tensor]:
    """Bottom-right causal attention from any ``forward(q, k, v, causal, scale)``.

    Only square causal calls are made, where top-left and bottom-right agree, so the result
    does not depend on the kernel's alignment: keys [0, Tk - Tq) are visible to every query
    (non-causal call), the last Tq keys form a square causal block; the two are merged in
    fp32 by LSE. Returns ``(out in q.dtype, lse fp32)``.
    """
    tq, tk = q.shape[1], k.shape[1]
    if tq > tk:
        raise ValueError(f"bottom-right causal needs Tq <= Tk, got Tq={tq}, Tk={tk}")
    if tq == tk:
        return forward(q, k, v, True, scale)
    p = tk - tq
    out_a, lse_a = forward(q, k[:, :p], v[:, :p], False, scale)
    out_b, lse_b = forward(q, k[:, p:], v[:, p:], True, scale)
    dt = acc_dtype(q.dtype)
    out = out_a.to(dt, copy=True)
    lse = lse_a.to(dt, copy=True)
    merge_blocks_(out, lse, out_b, lse_b)
    return out.to(q.dtype), lse


def bottom_right_causal_backward(backward: BackwardFn, dout: Tensor, q: Tensor, k: Tensor,
                                 v: Tensor, out: Tensor, lse: Tensor,
                                 scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of :func:`bottom_right_causal_forward` from any ``backward`` kernel.

    Exact per part: each part's backward recomputes P = exp(S - lse) and D = rowsum(dout*out)
    from the *merged* (global) out and lse, which are the true softmax probabilities and
    row terms of the whole block. dq adds the two parts; dk/dv are the concatenation along
    keys. Gradients come back in fp32 (fp64 for fp64 inputs).
    """
    tq, tk = q.shape[1], k.shape[1]
    if tq > tk:
        raise ValueError(f"bottom-right causal needs Tq <= Tk, got Tq={tq}, Tk={tk}")
    if tq == tk:
        return backward(dout, q, k, v, out, lse, True, scale)
    p = tk - tq
    dq_a, dk_a, dv_a = backward(dout, q, k[:, :p], v[:, :p], out, lse, False, scale)
    dq_b, dk_b, dv_b = backward(dout, q, k[:, p:], v[:, p:], out, lse, True, scale)
    dt = acc_dtype(q.dtype)
    dq = dq_a.to(dt, copy=True).add_(dq_b)
    dk = torch.empty(k.shape, dtype=dt, device=k.device)
    dv = torch.empty(v.shape, dtype=dt, device=v.device)
    dk[:, :p].copy_(dk_a)
    dk[:, p:].copy_(dk_b)
    dv[:, :p].copy_(dv_a)
    dv[:, p:].copy_(dv_b)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------
# math backend: pure torch, analytic backward
# --------------------------------------------------------------------------------------------

def _grouped_q(x: Tensor, kv_heads: int, dt: torch.dtype) -> Tensor:
    """[B, T, H, D] -> [B, Hkv, G, T, D]; head h = hkv * G + g, matching h // G = hkv."""
    b, t, h, d = x.shape
    return x.to(dt).reshape(b, t, kv_heads, h // kv_heads, d).permute(0, 2, 3, 1, 4)


def _grouped_kv(x: Tensor, dt: torch.dtype) -> Tensor:
    """[B, T, Hkv, D] -> [B, Hkv, 1, T, D], broadcast over the group without copies."""
    return x.to(dt).permute(0, 2, 1, 3).unsqueeze(2)


def _ungroup(x: Tensor) -> Tensor:
    """[B, Hkv, G, T, D] -> [B, T, H, D]."""
    b, hkv, g, t, d = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(b, t, hkv * g, d)


def _math_scores(qg: Tensor, kg: Tensor, causal: bool, scale: float, top_left: bool) -> Tensor:
    s = (qg @ kg.transpose(-1, -2)) * scale                    # [B, Hkv, G, Tq, Tk]
    if causal:
        allowed = _causal_allowed(s.shape[-2], s.shape[-1], top_left, s.device)
        s = s.masked_fill(~allowed, float("-inf"))
    return s


def _probs(s: Tensor, lse: Tensor) -> Tensor:
    # A fully masked row has lse = -inf; shifting it by 0 makes its probabilities exp(-inf) =
    # 0 instead of NaN, so out and every gradient of that row are 0.
    return torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0.0).unsqueeze(-1))


def math_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: Optional[float] = None,
                 *, top_left: bool = False) -> tuple[Tensor, Tensor]:
    """Pure-torch block attention ``(out in q.dtype, lse [B, H, Tq])`` in fp32 (fp64 for fp64).

    ``top_left=True`` switches the causal mask to torch SDPA's top-left alignment (j <= i);
    it exists to test :func:`bottom_right_causal_forward` and is not used by the library.
    Rows with no visible key (only possible with Tq > Tk) give out 0 and lse -inf.
    """
    _check_shapes(q, k, v)
    scale = _default_scale(scale, q)
    dt = acc_dtype(q.dtype)
    b, tq, h, _ = q.shape
    qg = _grouped_q(q, k.shape[2], dt)
    s = _math_scores(qg, _grouped_kv(k, dt), causal, scale, top_left)
    lse = torch.logsumexp(s, dim=-1)                            # [B, Hkv, G, Tq]
    out = _probs(s, lse) @ _grouped_kv(v, dt)                   # [B, Hkv, G, Tq, D]
    return _ungroup(out).to(q.dtype), lse.reshape(b, h, tq)


def math_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                  causal: bool, scale: Optional[float] = None, *,
                  top_left: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Analytic backward of :func:`math_forward` from (q, k, v, out, lse, dout); no autograd.

    With P = exp(S - lse), dP = dout v^T and D_i = rowsum(dout * out):
    dS = P (dP - D), dq = scale dS k, dk = scale dS^T q, dv = P^T dout; dk/dv are summed over
    each GQA group by the broadcast matmul. Returns fp32 gradients (fp64 for fp64 inputs).
    """
    _check_shapes(q, k, v)
    scale = _default_scale(scale, q)
    dt = acc_dtype(q.dtype)
    b, tq, h, _ = q.shape
    hkv = k.shape[2]
    qg, kg, vg = _grouped_q(q, hkv, dt), _grouped_kv(k, dt), _grouped_kv(v, dt)
    dog, og = _grouped_q(dout, hkv, dt), _grouped_q(out, hkv, dt)
    lse_g = lse.to(dt).reshape(b, hkv, h // hkv, tq)
    p = _probs(_math_scores(qg, kg, causal, scale, top_left), lse_g)   # [B, Hkv, G, Tq, Tk]
    delta = (dog * og).sum(dim=-1, keepdim=True)                        # [B, Hkv, G, Tq, 1]
    ds = p * (dog @ vg.transpose(-1, -2) - delta)
    dq = _ungroup((ds @ kg) * scale)
    dk = ((ds.transpose(-1, -2) @ qg) * scale).sum(dim=2).permute(0, 2, 1, 3)
    dv = (p.transpose(-1, -2) @ dog).sum(dim=2).permute(0, 2, 1, 3)
    return dq, dk, dv


def _why_not_math(device: torch.device, dtype: torch.dtype,
                  head_dim: Optional[int]) -> Optional[str]:
    return None if dtype.is_floating_point else f"needs a floating dtype, got {dtype}"


# --------------------------------------------------------------------------------------------
# Kernel backends: aten cuDNN, aten flash, flash_attn package
# --------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _cuda_reason(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """Common requirements of the CUDA kernels; returns why not, or None."""
    if device.type != "cuda":
        return f"needs CUDA tensors, got {device.type}"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if dtype not in _HALF:
        return f"supports float16/bfloat16 only, got {dtype}"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _capability(index) < (8, 0):
        return f"needs sm80 or newer, device is sm{''.join(map(str, _capability(index)))}"
    return None


def _head_dim_reason(head_dim: Optional[int], limit: int) -> Optional[str]:
    if head_dim is not None and (head_dim % 8 != 0 or head_dim > limit):
        return f"needs head_dim % 8 == 0 and head_dim <= {limit}, got {head_dim}"
    return None


def _why_not_cudnn(device: torch.device, dtype: torch.dtype,
                   head_dim: Optional[int]) -> Optional[str]:
    reason = _cuda_reason(device, dtype)
    if reason:
        return reason
    if torch.version.hip:
        return "cuDNN attention does not exist on ROCm"
    if not torch.backends.cudnn.is_available() or (torch.backends.cudnn.version() or 0) < 90000:
        return f"needs cuDNN >= 9, found {torch.backends.cudnn.version()}"
    # cuDNN supports D up to 256 only on some arch/version pairs; 128 covers Llama and is safe.
    return _head_dim_reason(head_dim, 128)


def _why_not_flash(device: torch.device, dtype: torch.dtype,
                   head_dim: Optional[int]) -> Optional[str]:
    reason = _cuda_reason(device, dtype)
    if reason:
        return reason
    if not torch.backends.cuda.is_flash_attention_available():
        return "this torch build has no flash attention kernels"
    return _head_dim_reason(head_dim, 256)


@functools.lru_cache(maxsize=None)
def flash_attn_version() -> Optional[tuple[int, ...]]:
    """Installed flash_attn version without importing it (import initialises CUDA)."""
    if importlib.util.find_spec("flash_attn") is None:
        return None
    from importlib.metadata import PackageNotFoundError, version
    try:
        text = version("flash_attn")
    except PackageNotFoundError:
        return (0,)
    return tuple(int(x) for x in text.split("+")[0].split(".")[:3] if x.isdigit())


def _why_not_flash_attn(device: torch.device, dtype: torch.dtype,
                        head_dim: Optional[int]) -> Optional[str]:
    ver = flash_attn_version()
    if ver is None:
        return "the flash_attn package is not installed"
    if ver < (2, 3):
        return f"needs flash_attn >= 2.3, found {'.'.join(map(str, ver))}"
    return _cuda_reason(device, dtype) or _head_dim_reason(head_dim, 256)


@functools.lru_cache(maxsize=None)
def _dead_rng(device: torch.device, dtype: torch.dtype, seed_numel: int) -> tuple[Tensor, Tensor]:
    # Philox seed/offset arguments of the backward ops: read only when dropout_p > 0, which
    # these backends never use. Shapes/dtypes mirror what each forward returns.
    # torch.empty, not zeros: CUDA has no fill kernel for uint64.
    seed = torch.empty((seed_numel,) if seed_numel > 1 else (), dtype=dtype, device=device)
    return seed, torch.empty((), dtype=dtype, device=device)


def _cudnn_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool,
               scale: float) -> tuple[Tensor, Tensor]:
    # The op takes [B, H, T, D] with any strides: transposed views of our [B, T, H, D] buffers
    # cost nothing, and the output is allocated in q's layout (so its transpose is contiguous).
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, True, 0.0, causal,
        False, scale=scale)
    return res[0].transpose(1, 2), _normalize_lse(res[1], q.shape[1])


def _cudnn_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
               causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    seed, offset = _dead_rng(q.device, torch.int64, 1)
    # Dense path: cum_seq_q/k undefined (None); max_q/max_k are the plan's S_q/S_kv and must
    # be the true lengths. lse goes back as [B, H, Tq, 1], the layout the forward returns.
    grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        out.transpose(1, 2), lse.unsqueeze(-1), seed, offset, None, None, None,
        q.shape[1], k.shape[1], 0.0, causal, scale=scale)
    return tuple(g.transpose(1, 2) for g in grads)


def _flash_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool,
               scale: float) -> tuple[Tensor, Tensor]:
    # Dense path (cum_seq None) takes [B, T, H, D] directly; returns
    # (out, logsumexp [B, H, Tq], rng_state, unused, debug_mask).
    res = torch.ops.aten._flash_attention_forward(
        q, k, v, None, None, q.shape[1], k.shape[1], 0.0, causal, False, scale=scale)
    return res[0], _normalize_lse(res[1], q.shape[1])


def _flash_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
               causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    seed, offset = _dead_rng(q.device, torch.uint64, 2)
    return torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, None, None, q.shape[1], k.shape[1], 0.0, causal, seed, offset,
        scale=scale)


def _fa_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool,
            scale: float) -> tuple[Tensor, Tensor]:
    from flash_attn import flash_attn_func  # optional dependency: import on first use only

    # The public function is stable across 2.x; return_attn_probs=True adds the lse (the
    # probabilities themselves are only computed with dropout, which is 0 here).
    with torch.no_grad():
        out, lse, _ = flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=scale,
                                      causal=causal, return_attn_probs=True)
    return out, _normalize_lse(lse, q.shape[1])


def _fa_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
            causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    from flash_attn import flash_attn_interface as fai  # optional dependency

    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    # _flash_attn_backward's argument list changed across 2.x (window_size tuple -> two ints,
    # softcap added); fill it by parameter name. It writes dq, dk, dv in place.
    values = dict(dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv,
                  dropout_p=0.0, softmax_scale=scale, causal=causal, window_size=(-1, -1),
                  window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                  deterministic=False, rng_state=None)
    fn = fai._flash_attn_backward
    params = inspect.signature(getattr(fn, "_init_fn", fn)).parameters
    missing = [n for n, prm in params.items()
               if n not in values and prm.default is inspect.Parameter.empty]
    if missing:
        raise RuntimeError(f"unsupported flash_attn version: _flash_attn_backward needs {missing}")
    fn(**{n: values[n] for n in params if n in values})
    return dq, dk, dv


def make_backend(name: str, fwd_call: ForwardFn, bwd_call: BackwardFn, why_not: WhyNotFn, *,
                 native_gqa: bool, native_bottom_right: bool) -> KernelBackend:
    """Wrap raw kernel calls (``fwd_call(q, k, v, causal, scale)``, ``bwd_call(dout, q, k, v,
    out, lse, causal, scale)``) with checks, GQA expansion (when not ``native_gqa``) and the
    bottom-right causal split (when not ``native_bottom_right``)."""

    def check(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> None:
        _check_shapes(q, k, v)
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
        scale = _default_scale(scale, q)
        q, k, v = (_lastdim_contiguous(t) for t in (q, k, v))
        k, v, _ = _expand_kv(q, k, v, native_gqa)
        if split(causal, q, k):
            return bottom_right_causal_forward(fwd_call, q, k, v, scale)
        return fwd_call(q, k, v, causal, scale)

    def backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 causal: bool, scale: Optional[float] = None) -> tuple[Tensor, Tensor, Tensor]:
        check(q, k, v, causal)
        scale = _default_scale(scale, q)
        q, k, v = (_lastdim_contiguous(t) for t in (q, k, v))
        # Kernels read out/dout in the input dtype with identical (contiguous) strides, and
        # the lse as a contiguous [B, H, Tq] buffer (a strided lse gives wrong gradients).
        dout = dout.to(q.dtype).contiguous()
        out = out.to(q.dtype).contiguous()
        lse = lse.to(acc_dtype(q.dtype)).contiguous()
        if lse.data_ptr() % 16:   # a view at an odd offset; cuDNN faults on unaligned bases
            lse = lse.clone()
        k, v, group = _expand_kv(q, k, v, native_gqa)
        if split(causal, q, k):
            dq, dk, dv = bottom_right_causal_backward(bwd_call, dout, q, k, v, out, lse, scale)
        else:
            dq, dk, dv = bwd_call(dout, q, k, v, out, lse, causal, scale)
        return dq, _reduce_group(dk, group), _reduce_group(dv, group)

    return KernelBackend(name, forward, backward, why_not, native_gqa, native_bottom_right)


_RAW_CALLS: dict[str, tuple[ForwardFn, BackwardFn, WhyNotFn]] = {
    "cudnn": (_cudnn_fwd, _cudnn_bwd, _why_not_cudnn),
    "flash": (_flash_fwd, _flash_bwd, _why_not_flash),
    "flash_attn": (_fa_fwd, _fa_bwd, _why_not_flash_attn),
}


def raw_calls(name: str) -> tuple[ForwardFn, BackwardFn, WhyNotFn]:
    """``(fwd_call, bwd_call, why_not)`` of a CUDA backend before :func:`make_backend` wraps
    them (one kernel call each, the kernel's own GQA and causal rules): for tests that pin
    those rules and for wrapping them differently."""
    if name not in _RAW_CALLS:
        raise ValueError(f"no raw kernel calls for {name!r}; use one of {sorted(_RAW_CALLS)}")
    return _RAW_CALLS[name]


_BACKENDS: dict[str, KernelBackend] = {
    "math": KernelBackend("math", math_forward, math_backward, _why_not_math),
    **{name: make_backend(name, *calls, native_gqa=NATIVE_GQA[name],
                          native_bottom_right=NATIVE_BOTTOM_RIGHT[name])
       for name, calls in _RAW_CALLS.items()},
}
# Every backend by name, including those that cannot run here (``why_not`` says why).
BACKENDS: Mapping[str, KernelBackend] = MappingProxyType(_BACKENDS)


# --------------------------------------------------------------------------------------------
# Selection
# --------------------------------------------------------------------------------------------

def _capable(device: torch.device, dtype: torch.dtype, head_dim: Optional[int]) -> list[str]:
    return [n for n in BACKEND_NAMES if _BACKENDS[n].why_not(device, dtype, head_dim) is None]


def _auto_order(device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    if device.type != "cuda" or dtype not in _HALF or not torch.cuda.is_available():
        return ("math",)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _capability(index)[0] == 9:
        # Hopper: torch's cuDNN attention is the fastest measured (DESIGN §5).
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

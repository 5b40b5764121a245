"""The CUDA softmax kernel backends' raw calls: torch's cuDNN and flash attention ops, and the
optional ``flash_attn`` package, each with what it can run (``why_not``).

Each raw call is one kernel call with the kernel's own GQA and causal rules;
:func:`sp_attention.softmax.backends.make_backend` wraps them with the checks, the GQA
expansion and the bottom-right causal split where a kernel needs them (:data:`NATIVE_GQA`,
:data:`NATIVE_BOTTOM_RIGHT`). Interface and shapes: :mod:`.backend_common`.

  * ``cudnn``: ``aten._scaled_dot_product_cudnn_attention`` (+ ``_backward``), fp16/bf16,
    D % 8 == 0 and D <= 128, cuDNN >= 9. Fastest on Hopper.
  * ``flash``: ``aten._flash_attention_forward`` / ``_flash_attention_backward`` (the
    FlashAttention-2 kernels inside torch; the same kernels
    ``aten._scaled_dot_product_flash_attention`` wraps, minus its [B, H, T, D] transposes),
    fp16/bf16, sm80+, D % 8 == 0 and D <= 256, bottom-right causal natively.
  * ``flash_attn``: the optional ``flash_attn`` package (>= 2.3), imported lazily.

Packed documents' varlen calls (:mod:`.varlen`) use :func:`flash_varlen_fwd` /
:func:`flash_varlen_bwd` (the ``flash`` ops with ``cum_seq_q/k``) whatever the backend.
"""
from __future__ import annotations

import functools
import importlib.util
import inspect
from typing import Optional

import torch
from torch import Tensor

from .backend_common import BackwardFn, ForwardFn, WhyNotFn

__all__ = ["NATIVE_BOTTOM_RIGHT", "NATIVE_GQA", "HALF", "RAW_CALLS", "raw_calls",
           "flash_attn_version", "capability", "flash_varlen_fwd", "flash_varlen_bwd"]

# Whether causal=True with Tq < Tk is bottom-right aligned inside the kernel. When False the
# backend uses the exact two-call split instead. torch's flash kernel is FlashAttention-2,
# bottom-right since flash-attn 2.1 (torch/nn/attention/bias.py relies on it for
# causal_lower_right). torch's cuDNN graph uses set_causal_mask, which cudnn-frontend defines
# as top-left (aten/src/ATen/native/cudnn/MHA.cpp): kept False until a GPU run shows otherwise.
NATIVE_BOTTOM_RIGHT: dict[str, bool] = {"cudnn": False, "flash": True, "flash_attn": True}
# Whether the kernel accepts K/V with fewer heads than Q. When False the backend repeats K/V
# heads locally (after any communication) and sums dK/dV over each group in fp32.
NATIVE_GQA: dict[str, bool] = {"cudnn": True, "flash": True, "flash_attn": True}

# The dtypes of the CUDA kernels.
HALF = (torch.float16, torch.bfloat16)


def normalize_lse(lse: Tensor, tq: int) -> Tensor:
    """Kernel lse -> contiguous fp32 [B, H, Tq]."""
    if lse.dim() == 4:          # cuDNN returns [B, H, Tq, 1]
        lse = lse[..., 0]
    return lse[..., :tq].float().contiguous()   # cut any padded Tq (older flash kernels)


@functools.lru_cache(maxsize=64)      # one entry per CUDA device index
def capability(index: int) -> tuple[int, int]:
    """Compute capability of CUDA device ``index``."""
    return torch.cuda.get_device_capability(index)


def _cuda_reason(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """Common requirements of the CUDA kernels; returns why not, or None."""
    if device.type != "cuda":
        return f"needs CUDA tensors, got {device.type}"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if dtype not in HALF:
        return f"supports float16/bfloat16 only, got {dtype}"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if capability(index) < (8, 0):
        return f"needs sm80 or newer, device is sm{''.join(map(str, capability(index)))}"
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


@functools.lru_cache(maxsize=1)
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


# Two tiny device tensors per (device, dtype, size): a node's devices x the two kernels' kinds.
@functools.lru_cache(maxsize=32)
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
    return res[0].transpose(1, 2), normalize_lse(res[1], q.shape[1])


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
    return res[0], normalize_lse(res[1], q.shape[1])


def _flash_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
               causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    seed, offset = _dead_rng(q.device, torch.uint64, 2)
    return torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, None, None, q.shape[1], k.shape[1], 0.0, causal, seed, offset,
        scale=scale)


def flash_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int,
                     max_k: int, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """FlashAttention-2 varlen (``aten._flash_attention_forward`` with ``cum_seq_q/k``, the
    kernels of ``torch.nn.attention.varlen.varlen_attn``, GQA native): q ``[Tq, H, D]``,
    k, v ``[Tk, Hkv, D]`` (unit stride in D), ``cu_q/cu_k`` int32 ``[N+1]`` on the device;
    returns ``(out [Tq, H, D], lse [H, Tq] fp32)``. Causal is bottom-right per sequence; a
    sequence without keys gets out 0 and lse ``+inf`` (the kernel's convention)."""
    res = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale)
    lse = res[1]
    if lse.dim() != 2:
        raise RuntimeError(f"this torch's varlen flash kernel returned an lse of shape "
                           f"{tuple(lse.shape)}; the packed path needs [H, total_q] (torch >= "
                           "2.5); pass SoftmaxTuning(packed_dense_min=1) to use dense calls only")
    return res[0], lse[:, :q.shape[0]].float()


def flash_varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                     cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, causal: bool,
                     scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of :func:`flash_varlen_fwd` given ``out``/``dout`` (contiguous, q's dtype) and
    ``lse [H, Tq]`` fp32 contiguous; keys of a sequence without queries get dk = dv = 0."""
    seed, offset = _dead_rng(q.device, torch.uint64, 2)
    return torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, seed, offset,
        scale=scale)


def _fa_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool,
            scale: float) -> tuple[Tensor, Tensor]:
    from flash_attn import flash_attn_func  # optional dependency: import on first use only

    # The public function is stable across 2.x; return_attn_probs=True adds the lse (the
    # probabilities themselves are only computed with dropout, which is 0 here).
    with torch.no_grad():
        out, lse, _ = flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=scale,
                                      causal=causal, return_attn_probs=True)
    return out, normalize_lse(lse, q.shape[1])


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


RAW_CALLS: dict[str, tuple[ForwardFn, BackwardFn, WhyNotFn]] = {
    "cudnn": (_cudnn_fwd, _cudnn_bwd, _why_not_cudnn),
    "flash": (_flash_fwd, _flash_bwd, _why_not_flash),
    "flash_attn": (_fa_fwd, _fa_bwd, _why_not_flash_attn),
}


def raw_calls(name: str) -> tuple[ForwardFn, BackwardFn, WhyNotFn]:
    """``(fwd_call, bwd_call, why_not)`` of a CUDA backend before
    :func:`sp_attention.softmax.backends.make_backend` wraps them (one kernel call each, the
    kernel's own GQA and causal rules): for tests that pin those rules and for wrapping them
    differently."""
    if name not in RAW_CALLS:
        raise ValueError(f"no raw kernel calls for {name!r}; use one of {sorted(RAW_CALLS)}")
    return RAW_CALLS[name]

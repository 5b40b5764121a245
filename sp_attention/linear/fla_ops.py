"""fla-core glue: which local backend runs (``resolve_backend``) and fla's conventions. The
kernel set the multi-leaf fla path calls is :mod:`.kernel_set`.

fla-core 0.6.0 convention (fla/ops/simple_gla/{naive,chunk}.py, fla/ops/common/chunk_{h,o}.py):
its recurrence is S_t = exp(g_t) S_{t-1} + k_t^T v_t, o_t = scale q_t S_t, i.e. the decay is
applied *before* adding the current token, exactly like our spec, so g_gamma = -s (natural
log). The kernels form decays with exp2 from b_g = g_gamma * (i + 1) (the inter term
q_i lam^(i+1) S_in, same exponent as ours) and the chunk end g_gamma * len (so the final state
is lam^C S_in + b); the public chunk_simple_gla multiplies g_gamma by 1/ln2 before calling
chunk_simple_gla_fwd/bwd, so calling those internals directly we must pass g_gamma = -s / ln 2
ourselves (:func:`sp_attention.linear.slope_constants.fla_g_gamma`). scale defaults to K^-0.5
there: we always pass it. ht/dh0 are fp32; h0/dht are read and upcast to fp32. The internals
need contiguous [B, T, H, D] tensors and the right current CUDA device (the public wrapper's
input_guard does both). chunk_simple_gla_bwd(initial_state=S_in, dht=G) returns dq (incl. the
S_in term) and dk, dv (incl. the G terms) complete, plus dg=None and dh0 = dL/dS_in.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

__all__ = ["BACKENDS", "fla_import_error", "resolve_backend"]

BACKENDS = ("torch", "fla")
_FLA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.lru_cache(maxsize=1)
def fla_import_error() -> Optional[str]:
    """None if fla's simple_gla kernels import, else the reason (cached: imports are slow)."""
    try:
        import fla.ops.simple_gla.chunk  # noqa: F401
    except Exception as e:  # ImportError, or triton failing to initialise without a GPU
        return f"{type(e).__name__}: {e}"
    return None


def _fla_unusable_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Optional[str]:
    if not q.is_cuda:
        return f"inputs are on {q.device}, fla needs CUDA tensors"
    if q.dtype not in _FLA_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"fla needs q, k, v of one dtype in {_FLA_DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.dtype != torch.float32 and (q.shape[-1] % 2 or v.shape[-1] % 2):
        return f"fla's 16-bit backward needs even K and V, got K={q.shape[-1]}, V={v.shape[-1]}"
    err = fla_import_error()
    if err is not None:
        return f"fla-core is not importable ({err})"
    return None


def resolve_backend(backend: Optional[str], q: torch.Tensor, k: Optional[torch.Tensor] = None,
                    v: Optional[torch.Tensor] = None) -> str:
    """Map None to "fla" when it can run on these inputs, else "torch"; validate explicit names."""
    k = q if k is None else k
    v = q if v is None else v
    if backend is None:
        return "fla" if _fla_unusable_reason(q, k, v) is None else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"unknown linear-attention backend {backend!r}; valid: {BACKENDS} or None "
                         "(auto)")
    if backend == "fla":
        reason = _fla_unusable_reason(q, k, v)
        if reason is not None:
            raise ValueError(
                f"backend='fla' cannot run: {reason}. Install the `gpu` extra "
                f"(pip install 'sp_attention[gpu]', i.e. fla-core) on a CUDA machine, "
                f"or use backend='torch'.")
    return backend

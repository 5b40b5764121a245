"""fla-core glue: which local backend runs, fla's conventions, and the fla kernels the CP step
calls (as a :class:`FlaKernels` set, so a test can run the fla path with stand-ins).

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
import inspect
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

__all__ = ["BACKENDS", "CHUNK", "FlaKernels", "fla_kernels", "fla_import_error",
           "resolve_backend", "resolve_kernels"]

BACKENDS = ("torch", "fla")
_FLA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CHUNK = 64  # chunk size of both backends (fla's default BT; a power of two is required there)


@functools.lru_cache(maxsize=1)
def fla_import_error() -> Optional[str]:
    """None if fla's simple_gla kernels import, else the reason (cached: imports are slow)."""
    try:
        import fla.ops.simple_gla.chunk  # noqa: F401
    except Exception as e:  # ImportError, or triton failing to initialise without a GPU
        return f"{type(e).__name__}: {e}"
    return None


@dataclass(frozen=True)
class FlaKernels:
    """The kernels the multi-leaf fla path runs, with fla 0.6's keyword signatures.

    ``chunk_fwd_h`` … ``chunk_bwd_dv``: fla's internal chunk kernels. ``output_from_states``:
    :func:`sp_attention.linear.kernels.output_from_states`. ``state_sum(x, y, slopes, base,
    step, scale)``: ``scale · Σ_t λ^(base + step·t) x_tᵀ y_t`` in fp32
    (:func:`sp_attention.linear.leaf.decayed_sum`). :func:`fla_kernels` gives the real set;
    pass another as ``lightning_attention(backend=...)`` to run the fla path's orchestration
    with other implementations (the CPU tests use pure-torch stand-ins).
    """

    chunk_fwd_h: Callable
    chunk_fwd_o: Callable
    chunk_bwd_dh: Callable
    chunk_bwd_dqkwg: Callable
    chunk_bwd_dv: Callable
    output_from_states: Callable
    state_sum: Callable


@functools.lru_cache(maxsize=1)
def fla_kernels() -> FlaKernels:
    """fla's internal chunk kernels without fla's backend-dispatch wrapper, and ours.

    fla 0.6 wraps its kernels in a run-time backend selector (``fla.backends.dispatch``, itself
    under ``torch.compiler.disable``): per call it walks its backend registry before falling
    back to the Triton implementation. The conventions above were checked against that Triton
    implementation, so it is the one we call, directly (``inspect.unwrap``): no other backend
    can be swapped in underneath us, and the layer's host time, which bounds a lone layer's
    step, loses the selector's per-call cost.
    """
    from fla.ops.common.chunk_h import chunk_bwd_dh, chunk_fwd_h
    from fla.ops.common.chunk_o import chunk_bwd_dqkwg, chunk_bwd_dv, chunk_fwd_o

    from .autotune_seeds import install_once
    from .kernels import output_from_states
    from .leaf import decayed_sum
    install_once()      # shipped autotune results: a fresh machine's first step in seconds
    return FlaKernels(*(inspect.unwrap(f) for f in (chunk_fwd_h, chunk_fwd_o, chunk_bwd_dh,
                                                    chunk_bwd_dqkwg, chunk_bwd_dv)),
                      output_from_states=output_from_states, state_sum=decayed_sum)


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
        raise ValueError(f"unknown linear-attention backend {backend!r}; valid: {BACKENDS}, "
                         "None (auto) or a FlaKernels")
    if backend == "fla":
        reason = _fla_unusable_reason(q, k, v)
        if reason is not None:
            raise ValueError(
                f"backend='fla' cannot run: {reason}. Install the `gpu` extra "
                f"(pip install 'sp_attention[gpu]', i.e. fla-core) on a CUDA machine, "
                f"or use backend='torch'.")
    return backend


def resolve_kernels(backend: Union[None, str, FlaKernels], q: torch.Tensor,
                    k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None
                    ) -> Optional[FlaKernels]:
    """The kernel set of the fla path, or None for the pure-torch path: a :class:`FlaKernels`
    as given, ``"fla"`` (or None where fla can run) as :func:`fla_kernels`."""
    if isinstance(backend, FlaKernels):
        return backend
    return fla_kernels() if resolve_backend(backend, q, k, v) == "fla" else None

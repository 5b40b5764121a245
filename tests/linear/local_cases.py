"""Inputs, slopes and autograd references shared by the single-device linear tests
(``test_torch_ops``, ``test_naive``, ``test_leaf``, ``test_leaves``, ``test_kernels``); not a
test module itself."""
from __future__ import annotations

import pytest
import torch

from sp_attention.linear.fla_ops import fla_import_error
from sp_attention.linear.naive import recurrent_linear_attention

F64 = torch.float64
TOL = 1e-10


def slopes_of(kind: str, H: int) -> torch.Tensor:
    table = {
        "mixed": [0.05, 0.5, 0.0, 2.0][:H] + [0.1] * max(0, H - 4),
        "zero": [0.0] * H,
        "tiny": [1e-6] * H,
        "huge": [50.0] * H,  # lam^64 = exp(-3200) underflows to exactly 0 in fp64
    }
    return torch.tensor(table[kind], dtype=F64)


def inputs(B=2, T=50, H=2, K=4, V=5, dtype=F64, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g, dtype=F64)
    k = torch.randn(B, T, H, K, generator=g, dtype=F64)
    v = torch.randn(B, T, H, V, generator=g, dtype=F64)
    S0 = torch.randn(B, H, K, V, generator=g, dtype=F64)
    do = torch.randn(B, T, H, V, generator=g, dtype=F64)
    G = torch.randn(B, H, K, V, generator=g, dtype=F64)
    cast = lambda x: x.to(device=device, dtype=dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), S0.to(device), do.to(device), G.to(device)


def reference_grads(q, k, v, slopes, scale, S0, do, G):
    """(o, S_end, dq, dk, dv, dS0) by autograd through the recurrence; loss = <o,do> + <S_end,G>."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    s0 = None if S0 is None else S0.detach().clone().requires_grad_(True)
    o, S = recurrent_linear_attention(*leaves, slopes, scale=scale, initial_state=s0, output_final_state=True)
    loss = (o * do).sum() + (0.0 if G is None else (S * G).sum())
    grads = torch.autograd.grad(loss, leaves + ([s0] if s0 is not None else []))
    dS0 = grads[3] if s0 is not None else None
    return o.detach(), S.detach(), grads[0], grads[1], grads[2], dS0


def _fla_ready() -> bool:
    return torch.cuda.is_available() and fla_import_error() is None


gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not _fla_ready(), reason="needs fla-core (the `gpu` extra)"),
]


def apply(marks):
    def deco(fn):
        for m in reversed(marks):
            fn = m(fn)
        return fn

    return deco

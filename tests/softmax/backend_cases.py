"""Inputs and autograd references shared by the softmax backend tests (``test_backends``,
``test_backend_math``, ``test_backend_cuda``, ``test_causal_split``, ``test_merge``); not a test
module itself."""
from __future__ import annotations

import torch

from sp_attention.softmax.naive import attention_reference
from sp_attention.testing import seeded

F64 = torch.float64


def qkv(b, tq, tk, h, hkv, d, seed=0, dtype=F64, device=None):
    q = seeded((b, tq, h, d), seed, dtype, device=device)
    k = seeded((b, tk, hkv, d), seed + 1, dtype, device=device)
    v = seeded((b, tk, hkv, d), seed + 2, dtype, device=device)
    dout = seeded((b, tq, h, d), seed + 3, dtype, device=device)
    return q, k, v, dout


def autograd_reference(q, k, v, dout, causal, scale):
    qr, kr, vr = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out, lse = attention_reference(qr, kr, vr, causal=causal, softmax_scale=scale)
    dq, dk, dv = torch.autograd.grad(out, (qr, kr, vr), dout)
    return out.detach(), lse.detach(), (dq, dk, dv)

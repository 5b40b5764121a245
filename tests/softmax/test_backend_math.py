"""The math backend (``sp_attention/softmax/backend_math.py``) in fp64 against the pure-torch
reference and autograd (~1e-12): GQA groups, bottom-right causal with Tq < Tk, rows that see no
key."""
from __future__ import annotations

import pytest
import torch

from backend_cases import F64, autograd_reference, qkv
from sp_attention.softmax.backend_math import math_backward, math_forward
from sp_attention.softmax.backends import get_backend
from sp_attention.softmax.naive import attention_reference
from sp_attention.testing import assert_close


# (causal, Tq, Tk): square, bottom-right Tq < Tk, single query row, odd sizes.
CASES = [(False, 7, 7), (True, 7, 7), (False, 5, 13), (True, 5, 13), (True, 1, 9), (True, 6, 11)]


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("causal,tq,tk", CASES)
def test_math_backend_matches_reference_and_autograd(causal, tq, tk, group):
    hkv, d = 2, 5
    q, k, v, dout = qkv(2, tq, tk, hkv * group, hkv, d, seed=tq * 31 + tk)
    scale = 0.37
    out, lse = math_forward(q, k, v, causal, scale)
    ref_out, ref_lse, ref_grads = autograd_reference(q, k, v, dout, causal, scale)
    assert out.dtype == F64 and lse.shape == (2, hkv * group, tq)
    assert_close(out, ref_out, 1e-12, "out")
    assert_close(lse, ref_lse, 1e-12, "lse")
    grads = math_backward(dout, q, k, v, out, lse, causal, scale)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert g.shape == r.shape, name
        assert_close(g, r, 1e-10, f"d{name}")


def test_math_backend_default_scale_and_backend_object():
    q, k, v, dout = qkv(1, 4, 6, 4, 2, 8, seed=3)
    be = get_backend("math", "cpu", F64)
    out, lse = be.forward(q, k, v, True, None)
    ref_out, ref_lse = attention_reference(q, k, v, causal=True)
    assert_close(out, ref_out, 1e-12, "out")
    assert_close(lse, ref_lse, 1e-12, "lse")


def test_math_fully_masked_rows_give_zero_and_no_nan():
    # Tq > Tk with bottom-right alignment: the first Tq - Tk query rows see no key.
    q, k, v, dout = qkv(1, 6, 3, 2, 1, 4, seed=5)
    out, lse = math_forward(q, k, v, True, 0.5)
    assert torch.isfinite(out).all()
    assert torch.isneginf(lse[:, :, :3]).all() and torch.isfinite(lse[:, :, 3:]).all()
    assert (out[:, :3] == 0).all()
    ref_out, ref_lse = attention_reference(q[:, 3:], k, v, causal=True, softmax_scale=0.5)
    assert_close(out[:, 3:], ref_out, 1e-12, "out")
    dq, dk, dv = math_backward(dout, q, k, v, out, lse, True, 0.5)
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert (dq[:, :3] == 0).all()

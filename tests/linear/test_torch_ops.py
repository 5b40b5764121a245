"""The torch backend's chunked kernel (``sp_attention/linear/torch_ops.py``) against the
token-by-token recurrence (``naive.py``): outputs, final states and autograd gradients in fp64
within 1e-10, for T not a multiple of the chunk, T < chunk, one and three heads, slopes 0, tiny
and underflowing (λ^64 = 0)."""

from __future__ import annotations

import pytest
import torch

from local_cases import F64, TOL, inputs, reference_grads, slopes_of
from sp_attention.linear.naive import recurrent_linear_attention
from sp_attention.linear.torch_ops import chunked_linear_attention
from sp_attention.testing import assert_close

CASES = [  # (T, H, chunk_size, slope kind)
    (50, 2, 16, "mixed"),  # T not a multiple of the chunk
    (10, 3, 64, "mixed"),  # T < chunk, odd head count
    (64, 1, 16, "mixed"),  # one head, exact multiple
    (37, 2, 8, "zero"),
    (37, 2, 8, "tiny"),
    (70, 3, 16, "huge"),
]


@pytest.mark.parametrize("T,H,chunk,kind", CASES)
@pytest.mark.parametrize("with_init", [False, True])
def test_chunked_matches_recurrent(T, H, chunk, kind, with_init):
    q, k, v, S0, _, _ = inputs(T=T, H=H)
    slopes = slopes_of(kind, H)
    init = S0 if with_init else None
    o_r, S_r = recurrent_linear_attention(q, k, v, slopes, scale=0.7, initial_state=init, output_final_state=True)
    o_c, S_c = chunked_linear_attention(
        q, k, v, slopes, scale=0.7, initial_state=init, output_final_state=True, chunk_size=chunk
    )
    assert o_c.dtype == F64 and S_c.dtype == F64
    assert_close(o_c, o_r, TOL)
    assert_close(S_c, S_r, TOL)
    assert chunked_linear_attention(q, k, v, slopes)[1] is None


def test_chunked_autograd_matches_recurrent():
    q, k, v, S0, do, G = inputs(T=45, H=3)
    slopes = slopes_of("mixed", 3)
    ref = reference_grads(q, k, v, slopes, 1.3, S0, do, G)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, S0)]
    o, S = chunked_linear_attention(
        *leaves[:3], slopes, scale=1.3, initial_state=leaves[3], output_final_state=True, chunk_size=16
    )
    grads = torch.autograd.grad((o * do).sum() + (S * G).sum(), leaves)
    for got, exp in zip(grads, ref[2:]):
        assert_close(got, exp, TOL)


def test_fp32_inputs_keep_dtypes():
    q, k, v, S0, _, _ = inputs(T=20, dtype=torch.float32)
    slopes = slopes_of("mixed", 2)
    o, S = chunked_linear_attention(q, k, v, slopes, initial_state=S0.float(), output_final_state=True)
    assert o.dtype == torch.float32 and S.dtype == torch.float32

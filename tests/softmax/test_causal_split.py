"""The bottom-right causal split (``sp_attention/softmax/causal_split.py``): a top-left kernel
made bottom-right by a non-causal and a square causal call merged by LSE, exact in fp64."""
from __future__ import annotations

import functools

import pytest

from backend_cases import autograd_reference, qkv
from sp_attention.softmax.backend_math import math_backward, math_forward
from sp_attention.softmax.causal_split import (bottom_right_causal_backward,
                                               bottom_right_causal_forward)
from sp_attention.testing import assert_close


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("tq,tk", [(4, 4), (4, 11), (1, 6), (7, 9)])
def test_top_left_kernel_split_gives_bottom_right(tq, tk, group):
    hkv = 2
    q, k, v, dout = qkv(2, tq, tk, hkv * group, hkv, 6, seed=tq + 7 * tk)
    top_left_fwd = functools.partial(math_forward, top_left=True)
    top_left_bwd = functools.partial(math_backward, top_left=True)
    ref_out, ref_lse, ref_grads = autograd_reference(q, k, v, dout, True, 0.4)
    if tq not in (1, tk):  # sanity: the top-left kernel alone is wrong here
        wrong, _ = top_left_fwd(q, k, v, True, 0.4)
        assert (wrong - ref_out).abs().max() > 1e-3
    out, lse = bottom_right_causal_forward(top_left_fwd, q, k, v, 0.4)
    assert_close(out, ref_out, 1e-12, "out")
    assert_close(lse, ref_lse, 1e-12, "lse")
    grads = bottom_right_causal_backward(top_left_bwd, dout, q, k, v, out, lse, 0.4)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert_close(g, r, 1e-10, f"d{name}")

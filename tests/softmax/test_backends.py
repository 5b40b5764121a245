"""The softmax backend registry (``sp_attention/softmax/backends.py``): the wrapper
:func:`make_backend` puts around raw kernel calls (GQA expansion, fp32 dK/dV group sums, the
causal split) run on CPU around top-left math calls, and the choice of backends with its
errors. The backends themselves: ``test_backend_math.py`` (CPU, fp64) and
``test_backend_cuda.py`` (``-m gpu``)."""
from __future__ import annotations

import pytest
import torch

from backend_cases import F64, autograd_reference, qkv
from sp_attention.softmax.backends import (BACKEND_NAMES, BACKENDS, flash_attn_version,
                                           get_backend, list_backends, make_backend,
                                           math_backward, math_forward)
from sp_attention.testing import assert_close


def test_kernel_wrapper_expands_gqa_and_splits_causal():
    """The wrapper used by cudnn/flash/flash_attn, run on CPU around top-left math calls that
    refuse GQA: checks the K/V expansion, the fp32 dK/dV group sum and the causal split."""
    def fwd(q, k, v, causal, scale):
        assert k.shape[2] == q.shape[2], "kernel got unexpanded GQA heads"
        return math_forward(q, k, v, causal, scale, top_left=True)

    def bwd(dout, q, k, v, out, lse, causal, scale):
        assert k.shape[2] == q.shape[2], "kernel got unexpanded GQA heads"
        return math_backward(dout, q, k, v, out, lse, causal, scale, top_left=True)

    be = make_backend("fake", fwd, bwd, lambda device, dtype, head_dim: None,
                      native_gqa=False, native_bottom_right=False)
    for causal, tq, tk in [(True, 5, 12), (True, 6, 6), (False, 3, 8)]:
        q, k, v, dout = qkv(2, tq, tk, 8, 2, 8, seed=tk)
        ref_out, ref_lse, ref_grads = autograd_reference(q, k, v, dout, causal, 0.35)
        out, lse = be.forward(q, k, v, causal, 0.35)
        assert_close(out, ref_out, 1e-12, "out")
        assert_close(lse, ref_lse, 1e-12, "lse")
        grads = be.backward(dout, q, k, v, out, lse, causal, 0.35)
        for name, g, r in zip("qkv", grads, ref_grads):
            assert g.shape == r.shape, name
            assert_close(g, r, 1e-10, f"d{name}")
    with pytest.raises(ValueError, match="Tq=4 > Tk=3"):
        be.forward(*qkv(1, 4, 3, 2, 2, 8)[:3], True, None)


def test_selection_and_errors():
    assert "math" in list_backends()
    assert set(list_backends()) <= set(BACKEND_NAMES)
    assert get_backend(None, "cpu", torch.bfloat16).name == "math"
    assert get_backend(None, "cpu", F64).name == "math"
    with pytest.raises(ValueError, match="valid names: math, cudnn, flash, flash_attn"):
        get_backend("triton", "cpu", F64)
    with pytest.raises(ValueError, match=r"'cudnn' cannot run .*Backends that can: math"):
        get_backend("cudnn", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match=r"'flash' cannot run torch.float64"):
        get_backend("flash", "cuda", F64)
    if flash_attn_version() is None:
        with pytest.raises(ValueError, match="not installed"):
            get_backend("flash_attn", "cuda", torch.bfloat16)
    # A backend that cannot run the tensors it is given says so before launching anything.
    be = BACKENDS["flash"]
    q, k, v, _ = qkv(1, 4, 4, 2, 2, 8)
    with pytest.raises(ValueError, match="backends that can: math"):
        be.forward(q, k, v, False, None)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        math_forward(q, k[:, :, :1].expand(1, 4, 3, 8), v[:, :, :1].expand(1, 4, 3, 8), False)

"""The CUDA kernel backends (``sp_attention/softmax/backend_cuda.py``; ``-m gpu``): every
available backend in bf16 against the fp32 math backend, its fallback paths (expanded GQA, the
two-call causal split), its native causal alignment against :data:`NATIVE_BOTTOM_RIGHT`, and the
automatic choice."""
from __future__ import annotations

import pytest
import torch

from backend_cases import qkv
from sp_attention.softmax.backends import (BACKENDS, NATIVE_BOTTOM_RIGHT, get_backend,
                                           list_backends, make_backend, math_backward,
                                           math_forward, raw_calls)
from sp_attention.testing import assert_close, rel_rms


CUDA_NAMES = ["cudnn", "flash", "flash_attn"]


def _need_backend(name, head_dim=128):
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    reason = BACKENDS[name].why_not(torch.device("cuda"), torch.bfloat16, head_dim)
    if reason:
        pytest.skip(f"{name}: {reason}")


def _gpu_case(causal, tq, tk, h=16, hkv=4, d=128, seed=0):
    q, k, v, dout = qkv(2, tq, tk, h, hkv, d, seed=seed, dtype=torch.bfloat16, device="cuda")
    scale = d ** -0.5
    ref_out, ref_lse = math_forward(q.float(), k.float(), v.float(), causal, scale)
    ref_grads = math_backward(dout.float(), q.float(), k.float(), v.float(), ref_out, ref_lse,
                              causal, scale)
    return (q, k, v, dout, scale), (ref_out, ref_lse, ref_grads)


def _check_backend(be, inputs, refs, causal, out_dtype=torch.bfloat16):
    q, k, v, dout, scale = inputs
    ref_out, ref_lse, ref_grads = refs
    out, lse = be.forward(q, k, v, causal, scale)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape and lse.is_contiguous()
    assert_close(out, ref_out, 1e-2, f"{be.name} out")
    err = (lse - ref_lse).abs().max().item()
    assert err <= 1e-2, f"{be.name} lse max abs error {err:.3e}"
    # The backward must also accept an fp32 out, as a caller that merged blocks holds.
    grads = be.backward(dout, q, k, v, out.to(out_dtype), lse, causal, scale)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert g.shape == r.shape, f"{be.name} d{name} shape {tuple(g.shape)}"
        assert_close(g, r, 2e-2, f"{be.name} d{name}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", CUDA_NAMES)
@pytest.mark.parametrize("causal,tq,tk", [(True, 256, 1024), (True, 512, 512),
                                          (False, 256, 768), (True, 200, 328)])
def test_gpu_backend_matches_fp32_math(name, causal, tq, tk):
    _need_backend(name)
    inputs, refs = _gpu_case(causal, tq, tk, seed=tq + tk)
    _check_backend(get_backend(name, "cuda", torch.bfloat16, head_dim=128), inputs, refs, causal)
    _check_backend(get_backend(name, "cuda", torch.bfloat16), inputs, refs, causal,
                   out_dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("name", CUDA_NAMES)
def test_gpu_fallback_paths_match(name):
    """The expanded-GQA and two-call causal paths, so either flag can be flipped safely."""
    _need_backend(name)
    be = make_backend(name, *raw_calls(name), native_gqa=False, native_bottom_right=False)
    inputs, refs = _gpu_case(True, 256, 640, seed=1)
    _check_backend(be, inputs, refs, True)


@pytest.mark.gpu
@pytest.mark.parametrize("name", CUDA_NAMES)
def test_gpu_native_causal_alignment_matches_flag(name):
    """One raw causal kernel call with Tq < Tk: its alignment must match NATIVE_BOTTOM_RIGHT
    (True: single call is bottom-right; False: it is top-left, so the backend splits)."""
    _need_backend(name)
    q, k, v, _ = qkv(1, 128, 384, 8, 8, 128, seed=2, dtype=torch.bfloat16, device="cuda")
    out, _ = raw_calls(name)[0](q, k, v, True, 128 ** -0.5)
    errs = {}
    for top_left in (False, True):
        ref, _ = math_forward(q.float(), k.float(), v.float(), True, 128 ** -0.5,
                              top_left=top_left)
        errs["top_left" if top_left else "bottom_right"] = rel_rms(out, ref)
    found = min(errs, key=errs.get)
    assert errs[found] <= 1e-2, f"{name}: causal matches neither alignment: {errs}"
    assert (found == "bottom_right") == NATIVE_BOTTOM_RIGHT[name], \
        f"{name}: native causal alignment is {found} ({errs}); update NATIVE_BOTTOM_RIGHT"


@pytest.mark.gpu
def test_gpu_auto_choice():
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    be = get_backend(None, "cuda", torch.bfloat16, head_dim=128)
    if torch.cuda.get_device_capability()[0] == 9 and "cudnn" in list_backends():
        assert be.name == "cudnn"
    assert get_backend(None, "cuda", torch.float32).name == "math"

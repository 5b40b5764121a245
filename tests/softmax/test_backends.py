"""Softmax kernel backends, LSE merge and the bottom-right causal split.

CPU tests run in fp64 against the pure-torch reference (exact to ~1e-12); GPU tests
(``-m gpu``) compare every available CUDA backend in bf16 against the fp32 math backend.
"""
from __future__ import annotations

import functools

import pytest
import torch

from sp_attention.softmax.backends import (
    BACKEND_NAMES, BACKENDS, NATIVE_BOTTOM_RIGHT, bottom_right_causal_backward,
    bottom_right_causal_forward, flash_attn_version, get_backend, list_backends, make_backend,
    math_backward, math_forward, raw_calls)
from sp_attention.softmax.merge import merge_blocks, merge_blocks_
from sp_attention.softmax.naive import attention_reference
from sp_attention.testing import assert_close, rel_rms, seeded

F64 = torch.float64


def _qkv(b, tq, tk, h, hkv, d, seed=0, dtype=F64, device=None):
    q = seeded((b, tq, h, d), seed, dtype, device=device)
    k = seeded((b, tk, hkv, d), seed + 1, dtype, device=device)
    v = seeded((b, tk, hkv, d), seed + 2, dtype, device=device)
    dout = seeded((b, tq, h, d), seed + 3, dtype, device=device)
    return q, k, v, dout


def _ref_grads(q, k, v, dout, causal, scale):
    qr, kr, vr = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out, lse = attention_reference(qr, kr, vr, causal=causal, softmax_scale=scale)
    dq, dk, dv = torch.autograd.grad(out, (qr, kr, vr), dout)
    return out.detach(), lse.detach(), (dq, dk, dv)


# (causal, Tq, Tk): square, bottom-right Tq < Tk, single query row, odd sizes.
CASES = [(False, 7, 7), (True, 7, 7), (False, 5, 13), (True, 5, 13), (True, 1, 9), (True, 6, 11)]


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("causal,tq,tk", CASES)
def test_math_backend_matches_reference_and_autograd(causal, tq, tk, group):
    hkv, d = 2, 5
    q, k, v, dout = _qkv(2, tq, tk, hkv * group, hkv, d, seed=tq * 31 + tk)
    scale = 0.37
    out, lse = math_forward(q, k, v, causal, scale)
    ref_out, ref_lse, ref_grads = _ref_grads(q, k, v, dout, causal, scale)
    assert out.dtype == F64 and lse.shape == (2, hkv * group, tq)
    assert_close(out, ref_out, 1e-12, "out")
    assert_close(lse, ref_lse, 1e-12, "lse")
    grads = math_backward(dout, q, k, v, out, lse, causal, scale)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert g.shape == r.shape, name
        assert_close(g, r, 1e-10, f"d{name}")


def test_math_backend_default_scale_and_backend_object():
    q, k, v, dout = _qkv(1, 4, 6, 4, 2, 8, seed=3)
    be = get_backend("math", "cpu", F64)
    out, lse = be.forward(q, k, v, True, None)
    ref_out, ref_lse = attention_reference(q, k, v, causal=True)
    assert_close(out, ref_out, 1e-12, "out")
    assert_close(lse, ref_lse, 1e-12, "lse")


def test_math_fully_masked_rows_give_zero_and_no_nan():
    # Tq > Tk with bottom-right alignment: the first Tq - Tk query rows see no key.
    q, k, v, dout = _qkv(1, 6, 3, 2, 1, 4, seed=5)
    out, lse = math_forward(q, k, v, True, 0.5)
    assert torch.isfinite(out).all()
    assert torch.isneginf(lse[:, :, :3]).all() and torch.isfinite(lse[:, :, 3:]).all()
    assert (out[:, :3] == 0).all()
    ref_out, ref_lse = attention_reference(q[:, 3:], k, v, causal=True, softmax_scale=0.5)
    assert_close(out[:, 3:], ref_out, 1e-12, "out")
    dq, dk, dv = math_backward(dout, q, k, v, out, lse, True, 0.5)
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert (dq[:, :3] == 0).all()


def _key_blocks(causal, tq, tk, n_blocks):
    """Split [0, Tk) into blocks; with causal the last block (size >= Tq) is causal and every
    earlier block is fully visible to all queries (non-causal)."""
    last = tq + 2 if causal else 0
    cuts = torch.linspace(0, tk - last, n_blocks if causal else n_blocks + 1).round().long()
    bounds = [(int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]
    if causal:
        bounds.append((tk - last, tk))
    return bounds


@pytest.mark.parametrize("n_blocks", [2, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_merge_of_key_blocks_equals_full_attention(causal, n_blocks):
    tq, tk, h, hkv = 5, 17, 8, 2
    q, k, v, _ = _qkv(2, tq, tk, h, hkv, 6, seed=11 + n_blocks)
    ref_out, ref_lse = attention_reference(q, k, v, causal=causal, softmax_scale=0.3)
    bounds = _key_blocks(causal, tq, tk, n_blocks)
    assert len(bounds) == n_blocks
    # Start from the empty accumulator (0, -inf) to exercise the -inf path as a ring does.
    acc_out = torch.zeros(q.shape, dtype=F64)
    acc_lse = torch.full((2, h, tq), float("-inf"), dtype=F64)
    for i, (a, b) in enumerate(bounds):
        blk_causal = causal and i == len(bounds) - 1
        o, l = math_forward(q, k[:, a:b], v[:, a:b], blk_causal, 0.3)
        merge_blocks_(acc_out, acc_lse, o, l)
    assert_close(acc_out, ref_out, 1e-12, "merged out")
    assert_close(acc_lse, ref_lse, 1e-12, "merged lse")
    # The out-of-place variant, merging in the opposite order, agrees too.
    o1, l1 = math_forward(q, k[:, bounds[-1][0]:], v[:, bounds[-1][0]:], causal, 0.3)
    o0, l0 = math_forward(q, k[:, :bounds[-1][0]], v[:, :bounds[-1][0]], False, 0.3)
    mo, ml = merge_blocks(o1, l1, o0, l0)
    assert_close(mo, ref_out, 1e-12, "merge_blocks out")
    assert_close(ml, ref_lse, 1e-12, "merge_blocks lse")


def test_merge_handles_empty_rows_without_nan():
    b, t, h, d = 1, 3, 2, 4
    out = torch.zeros(b, t, h, d, dtype=torch.float32)
    lse = torch.full((b, h, t), float("-inf"))
    blk = torch.randn(b, t, h, d)
    blk_lse = torch.randn(b, h, t)
    blk_lse[:, :, 0] = float("-inf")       # row 0: both sides empty
    blk[:, 0] = 0.0
    merge_blocks_(out, lse, blk, blk_lse)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    assert torch.equal(out[:, 1:], blk[:, 1:]) and torch.equal(lse[:, :, 1:], blk_lse[:, :, 1:])
    assert torch.isneginf(lse[:, :, 0]).all() and (out[:, 0] == 0).all()
    # Merging an empty block leaves the accumulator exactly unchanged.
    before_out, before_lse = out.clone(), lse.clone()
    merge_blocks_(out, lse, torch.zeros_like(out), torch.full_like(lse, float("-inf")))
    assert torch.equal(out, before_out) and torch.equal(lse, before_lse)


def test_merge_rejects_bad_layouts():
    out = torch.zeros(1, 3, 2, 4)
    with pytest.raises(ValueError, match="lse"):
        merge_blocks_(out, torch.zeros(1, 3, 2), out.clone(), torch.zeros(1, 3, 2))
    with pytest.raises(ValueError, match="fp32"):
        merge_blocks_(out.half(), torch.zeros(1, 2, 3).half(), out, torch.zeros(1, 2, 3))


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("tq,tk", [(4, 4), (4, 11), (1, 6), (7, 9)])
def test_top_left_kernel_split_gives_bottom_right(tq, tk, group):
    hkv = 2
    q, k, v, dout = _qkv(2, tq, tk, hkv * group, hkv, 6, seed=tq + 7 * tk)
    top_left_fwd = functools.partial(math_forward, top_left=True)
    top_left_bwd = functools.partial(math_backward, top_left=True)
    ref_out, ref_lse, ref_grads = _ref_grads(q, k, v, dout, True, 0.4)
    if tq not in (1, tk):  # sanity: the top-left kernel alone is wrong here
        wrong, _ = top_left_fwd(q, k, v, True, 0.4)
        assert (wrong - ref_out).abs().max() > 1e-3
    out, lse = bottom_right_causal_forward(top_left_fwd, q, k, v, 0.4)
    assert_close(out, ref_out, 1e-12, "out")
    assert_close(lse, ref_lse, 1e-12, "lse")
    grads = bottom_right_causal_backward(top_left_bwd, dout, q, k, v, out, lse, 0.4)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert_close(g, r, 1e-10, f"d{name}")


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
        q, k, v, dout = _qkv(2, tq, tk, 8, 2, 8, seed=tk)
        ref_out, ref_lse, ref_grads = _ref_grads(q, k, v, dout, causal, 0.35)
        out, lse = be.forward(q, k, v, causal, 0.35)
        assert_close(out, ref_out, 1e-12, "out")
        assert_close(lse, ref_lse, 1e-12, "lse")
        grads = be.backward(dout, q, k, v, out, lse, causal, 0.35)
        for name, g, r in zip("qkv", grads, ref_grads):
            assert g.shape == r.shape, name
            assert_close(g, r, 1e-10, f"d{name}")
    with pytest.raises(ValueError, match="Tq=4 > Tk=3"):
        be.forward(*_qkv(1, 4, 3, 2, 2, 8)[:3], True, None)


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
    q, k, v, _ = _qkv(1, 4, 4, 2, 2, 8)
    with pytest.raises(ValueError, match="backends that can: math"):
        be.forward(q, k, v, False, None)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        math_forward(q, k[:, :, :1].expand(1, 4, 3, 8), v[:, :, :1].expand(1, 4, 3, 8), False)


# --------------------------------------------------------------------------------------------
# GPU: bf16 kernels vs the fp32 math backend
# --------------------------------------------------------------------------------------------

CUDA_NAMES = ["cudnn", "flash", "flash_attn"]


def _need_backend(name, head_dim=128):
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    reason = BACKENDS[name].why_not(torch.device("cuda"), torch.bfloat16, head_dim)
    if reason:
        pytest.skip(f"{name}: {reason}")


def _gpu_case(causal, tq, tk, h=16, hkv=4, d=128, seed=0):
    q, k, v, dout = _qkv(2, tq, tk, h, hkv, d, seed=seed, dtype=torch.bfloat16, device="cuda")
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
    q, k, v, _ = _qkv(1, 128, 384, 8, 8, 128, seed=2, dtype=torch.bfloat16, device="cuda")
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

"""LSE merge: fp64 exactness against the closed form and of blocks of keys merged into full
attention, -inf rows, a low-precision ``out`` accumulator rounded once, strided views updated
in place, clear errors; the Triton merge in the interpreter and on the GPU."""
from __future__ import annotations


import pytest
import torch

from backend_cases import qkv
from sp_attention.softmax.backend_math import math_forward
from sp_attention.softmax.merge import merge_blocks, merge_blocks_
from sp_attention.softmax.naive import attention_reference
from sp_attention.testing import assert_close

F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16
NEG_INF = float("-inf")


# ------------------------------------------------------------------ helpers

def _randn(shape, gen, dtype=F64, scale=1.0, device=None):
    return (torch.randn(shape, generator=gen, dtype=F64) * scale).to(dtype=dtype, device=device)


def _closed_form(out, lse, out_b, lse_b):
    """fp64 log(exp(a) + exp(b)) and the exp-weighted mean; rows empty on both sides stay."""
    out, lse, out_b, lse_b = (x.to(F64) for x in (out, lse, out_b, lse_b))
    ea, eb = lse.exp(), lse_b.exp()                                   # [B, H, Tq]
    new_lse = (ea + eb).log()
    both = (ea + eb) == 0
    ea4, eb4 = (x.transpose(1, 2).unsqueeze(-1) for x in (ea, eb))     # [B, Tq, H, 1]
    new_out = (ea4 * out + eb4 * out_b) / (ea4 + eb4)
    new_out = torch.where(both.transpose(1, 2).unsqueeze(-1), out, new_out)
    return new_out, new_lse


def _mark_empty_rows(out, lse, lse_b):
    """-inf rows on either or both sides, in place: whole rows and single heads."""
    lse[:, :, 0] = NEG_INF                 # accumulator empty: merge copies the block
    out[:, 0] = 0.0
    lse_b[:, :, 1] = NEG_INF               # block empty: accumulator unchanged
    lse[:, :2, 2] = NEG_INF                # both empty on heads 0-1 of row 2
    out[:, 2, :2] = 0.0
    lse_b[:, :2, 2] = NEG_INF
    lse[:, -1, 3] = NEG_INF                # mixed per head in one row
    out[:, 3, -1] = 0.0
    lse_b[:, 0, 3] = NEG_INF


def _slices(layout, h, t):
    """Index tuples selecting the accumulator views from the (out, lse) full buffers."""
    if layout == "rows":           # out[:, rows], lse[:, :, rows] as the ring forward does
        return (slice(None), slice(2, 2 + t)), (slice(None), slice(None), slice(2, 2 + t))
    if layout == "heads":          # head slices
        return (slice(None), slice(None), slice(3, 3 + h)), (slice(None), slice(3, 3 + h))
    return (), ()


def _make_case(dtype, d, layout, h, device, seed, b=2, t=6):
    """Full buffers (out, lse), their views per ``layout`` and a block (out_b, lse_b)."""
    g = torch.Generator().manual_seed(seed)
    extra_t, extra_h = (5, 0) if layout == "rows" else (0, 5) if layout == "heads" else (0, 0)
    out_full = _randn((b, t + extra_t, h + extra_h, d), g, dtype, device=device)
    lse_full = _randn((b, h + extra_h, t + extra_t), g, F32, 3.0, device=device)
    so, sl = _slices(layout, h, t)
    out, lse = out_full[so], lse_full[sl]
    if layout == "heads":          # a strided block too, even along D: a [B, H, D, Tq] buffer
        out_b = _randn((b, h, d, t), g, dtype, device=device).permute(0, 3, 1, 2)
    else:
        out_b = _randn((b, t, h, d), g, dtype, device=device)
    lse_b = _randn((b, h, t), g, F32, 3.0, device=device)
    _mark_empty_rows(out, lse, lse_b)
    return out, lse, out_b, lse_b, out_full, lse_full


def _check_result(out, lse, before, out_b, lse_b, name, rtne=True):
    """Merged (out, lse) against the fp64 closed form of ``before`` = (out, lse) inputs.

    ``rtne=False`` for Triton's interpreter, whose fp32 -> bf16 cast truncates (the GPU one
    rounds to nearest even): a low-precision out is then only held to one ulp.
    """
    out0, lse0 = before
    ref_out, ref_lse = _closed_form(out0, lse0, out_b, lse_b)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), f"{name}: -inf rows"
    assert not torch.isnan(lse).any() and torch.isfinite(out).all(), f"{name}: NaN/inf"
    fin = torch.isfinite(ref_lse)
    assert (lse[fin].to(F64) - ref_lse[fin]).abs().max() <= 1e-5, f"{name}: lse"
    err = (out.to(F64) - ref_out).abs()
    if out.dtype.itemsize == 2:    # one rounding of fp32 math: within half an ulp (+fp32)
        ulps = 0.5 if rtne else 1.0
        bound = ulps * torch.finfo(out.dtype).eps * ref_out.abs() + 1e-6
        assert (err <= bound).all(), f"{name}: out beyond {ulps} ulp"
        same = (out == ref_out.to(out.dtype)).to(F64).mean().item()
        assert same >= 0.999 or not rtne, f"{name}: only {same:.4f} of out rounds like fp64"
    else:
        assert err.max() <= 1e-5, f"{name}: out max err {err.max().item():.2e}"
    # The -inf rules are exact, not approximate.
    blk_empty = torch.isneginf(lse_b).transpose(1, 2)                  # [B, Tq, H]
    acc_empty = torch.isneginf(lse0).transpose(1, 2) & ~blk_empty
    assert torch.equal(out[blk_empty], out0[blk_empty]), f"{name}: empty block changed out"
    assert torch.equal(out[acc_empty], out_b[acc_empty].to(out.dtype)), f"{name}: copy"
    assert torch.equal(lse[torch.isneginf(lse_b)], lse0[torch.isneginf(lse_b)]), name
    acc_only = torch.isneginf(lse0) & ~torch.isneginf(lse_b)
    assert torch.equal(lse[acc_only], lse_b[acc_only].to(lse.dtype)), f"{name}: lse copy"


def _run_case(fn, dtype, d, layout, h=20, device="cpu", seed=0, b=2, t=6, rtne=True):
    """Merge with ``fn`` into views of bigger buffers; check the math and the untouched rest.

    Returns the merged (out, lse) views for cross-implementation comparisons.
    """
    out, lse, out_b, lse_b, out_full, lse_full = _make_case(dtype, d, layout, h, device, seed,
                                                            b, t)
    before = (out.clone(), lse.clone())
    full_before = (out_full.clone(), lse_full.clone())
    fn(out, lse, out_b, lse_b)
    name = f"{fn.__name__}[{dtype}, D={d}, {layout}]"
    _check_result(out.cpu(), lse.cpu(), tuple(x.cpu() for x in before), out_b.cpu(),
                  lse_b.cpu(), name, rtne)
    # Everything outside the views is bitwise untouched.
    for full, old, sel in zip((out_full, lse_full), full_before, _slices(layout, h, t)):
        rest = torch.ones(full.shape, dtype=torch.bool, device=full.device)
        rest[sel] = False
        assert torch.equal(full[rest], old[rest]), f"{name}: wrote outside the view"
    return out, lse


def _compare_to_torch_path(kernel, dtype, d, layout, h, device, seed, b=2, t=6, rtne=True):
    """Run ``kernel`` and the torch path on the same case; both must pass the checks and
    agree with each other to fp32 rounding (16-bit out: at most one ulp apart, rarely)."""
    ko, kl = _run_case(kernel, dtype, d, layout, h, device, seed, b, t, rtne)
    to, tl = _run_case(_torch_path_, dtype, d, layout, h, device, seed, b, t)
    assert torch.equal(torch.isneginf(kl), torch.isneginf(tl))
    fin = torch.isfinite(tl)
    assert (kl[fin] - tl[fin]).abs().max().item() <= 1e-5
    diff = (ko.to(F64) - to.to(F64)).abs()
    if dtype.itemsize == 2:
        assert (diff <= torch.finfo(dtype).eps * to.to(F64).abs() + 1e-6).all()
        assert (ko != to).to(F64).mean().item() <= 1e-3 or not rtne
    else:
        assert diff.max().item() <= 1e-5


# ------------------------------------------------------------------ torch path

def test_torch_path_fp64_matches_closed_form():
    g = torch.Generator().manual_seed(1)
    b, t, h, d = 2, 7, 3, 5
    out, out_b = _randn((b, t, h, d), g), _randn((b, t, h, d), g)
    lse, lse_b = _randn((b, h, t), g, scale=4.0), _randn((b, h, t), g, scale=4.0)
    ref_out, ref_lse = _closed_form(out, lse, out_b, lse_b)
    acc_out, acc_lse = out.clone(), lse.clone()
    merge_blocks_(acc_out, acc_lse, out_b, lse_b)
    assert_close(acc_out, ref_out, 1e-13, "out")
    assert_close(acc_lse, ref_lse, 1e-13, "lse")
    # Far-apart lse (exp would overflow/underflow in fp32) stays exact in the sigmoid form.
    lse_far = lse + 80.0
    acc_out, acc_lse = out.clone(), lse_far.clone()
    merge_blocks_(acc_out, acc_lse, out_b, lse_b)
    ref_out, ref_lse = _closed_form(out, lse_far, out_b, lse_b)
    assert_close(acc_out, ref_out, 1e-13, "out (far)")
    assert_close(acc_lse, ref_lse, 1e-13, "lse (far)")


@pytest.mark.parametrize("dtype", [F64, F32, BF16, torch.float16])
def test_torch_path_empty_rows_exact(dtype):
    g = torch.Generator().manual_seed(2)
    b, t, h, d = 1, 4, 3, 8
    out, out_b = _randn((b, t, h, d), g, dtype), _randn((b, t, h, d), g, dtype)
    lse_dt = F64 if dtype == F64 else F32
    lse, lse_b = _randn((b, h, t), g, lse_dt), _randn((b, h, t), g, lse_dt)
    _mark_empty_rows(out, lse, lse_b)
    before = (out.clone(), lse.clone())
    merge_blocks_(out, lse, out_b, lse_b)
    assert out.dtype == dtype and lse.dtype == lse_dt
    _check_result(out, lse, before, out_b, lse_b, f"torch[{dtype}]")
    # Merging a wholly empty block leaves the accumulator bitwise unchanged.
    before = (out.clone(), lse.clone())
    merge_blocks_(out, lse, torch.zeros_like(out), torch.full_like(lse, NEG_INF))
    assert torch.equal(out, before[0]) and torch.equal(lse, before[1])


@pytest.mark.parametrize("layout", ["contiguous", "rows", "heads"])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_torch_path_low_precision_and_views(dtype, layout):
    # bf16 out: fp32 math rounded once (checked against fp64 math rounded once), in place
    # through row / head slices of bigger buffers, nothing outside them written.
    _run_case(merge_blocks_, dtype, 24, layout, h=5, seed=3)


def test_bf16_accumulator_beats_bf16_math_over_many_merges():
    # Eight merges into a bf16 accumulator vs the fp64 result: one rounding per merge, so
    # the error stays at a few bf16 ulps (fp32 weights, not bf16 ones).
    g = torch.Generator().manual_seed(4)
    b, t, h, d = 1, 16, 4, 32
    acc = torch.zeros(b, t, h, d, dtype=BF16)
    acc_lse = torch.full((b, h, t), NEG_INF)
    ref, ref_lse = torch.zeros(b, t, h, d, dtype=F64), torch.full((b, h, t), NEG_INF, dtype=F64)
    for _ in range(8):
        ob, lb = _randn((b, t, h, d), g, BF16), _randn((b, h, t), g, F32, 2.0)
        merge_blocks_(acc, acc_lse, ob, lb)
        ref, ref_lse = _closed_form(ref, ref_lse, ob, lb)
    assert_close(acc, ref, 2.0 ** -7, "bf16 accumulator")
    assert_close(acc_lse, ref_lse, 1e-6, "lse")


def test_merge_blocks_out_of_place_returns_fp32():
    g = torch.Generator().manual_seed(5)
    out, out_b = _randn((1, 3, 2, 4), g, BF16), _randn((1, 3, 2, 4), g, BF16)
    lse, lse_b = _randn((1, 2, 3), g, BF16), _randn((1, 2, 3), g, BF16)
    mo, ml = merge_blocks(out, lse, out_b, lse_b)
    assert mo.dtype == F32 and ml.dtype == F32
    ref_out, ref_lse = _closed_form(out, lse, out_b, lse_b)
    assert_close(mo, ref_out, 1e-6, "out")
    assert_close(ml, ref_lse, 1e-6, "lse")


def test_merge_errors_are_clear():
    out = torch.zeros(1, 3, 2, 4, dtype=BF16)
    with pytest.raises(ValueError, match="lse accumulator must be fp32"):
        merge_blocks_(out, torch.zeros(1, 2, 3, dtype=BF16), out, torch.zeros(1, 2, 3))
    with pytest.raises(ValueError, match="floating-point"):
        merge_blocks_(out, torch.zeros(1, 2, 3), out.int(), torch.zeros(1, 2, 3))
    with pytest.raises(ValueError, match="one device"):
        merge_blocks_(out, torch.zeros(1, 2, 3), out.to("meta"), torch.zeros(1, 2, 3))


# --------------------------------------------- merging blocks of keys (math backend blocks)

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
    q, k, v, _ = qkv(2, tq, tk, h, hkv, 6, seed=11 + n_blocks)
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


# ------------------------------------------------------------------ Triton kernel

def _torch_path_(out, lse, out_b, lse_b):
    """merge_blocks_ forced onto its pure-torch form (the reference of the kernel)."""
    from unittest import mock

    from sp_attention.softmax import merge as merge_mod
    with mock.patch.object(merge_mod, "_use_kernel", lambda *a: False):
        merge_blocks_(out, lse, out_b, lse_b)


def _triton_(out, lse, out_b, lse_b, **shape):
    from sp_attention.softmax.merge_kernel import merge_blocks_triton
    # the kernel reads D with unit stride (what every schedule passes); a block strided in D
    # (one of the view cases) is made contiguous first, as merge_blocks_ would route it
    merge_blocks_triton(out, lse, out_b if out_b.stride(-1) == 1 else out_b.contiguous(), lse_b,
                        **shape)


def _triton_heads_(out, lse, out_b, lse_b):
    """The kernel with several heads per program (4: a partial head block for h = 5, 3)."""
    _triton_(out, lse, out_b, lse_b, block_t=2, block_h=4)


_KERNEL_CASES = [(dt, d, layout, h, t) for dt in (F32, BF16) for d, h, t in ((16, 5, 6),
                 (24, 3, 37), (128, 2, 70)) for layout in ("contiguous", "rows", "heads")]
_LAUNCHES = {"default": _triton_, "heads": _triton_heads_}


if __import__("os").environ.get("TRITON_INTERPRET") == "1":
    # Collected only in test_triton_merge_in_interpreter's subprocess: the interpreter must be
    # chosen before triton compiles anything.
    @pytest.mark.parametrize("launch", sorted(_LAUNCHES))
    @pytest.mark.parametrize("dtype,d,layout,h,t", _KERNEL_CASES)
    def test_triton_merge_interpreted(dtype, d, layout, h, t, launch):
        """The kernel in Triton's CPU interpreter vs the torch form: -inf rows, row / head
        views of bigger buffers (nothing outside written), D not a power of two, Tq not a
        multiple of the row block, a partial head block, 16-bit out rounded once (the
        interpreter truncates: one ulp)."""
        _compare_to_torch_path(_LAUNCHES[launch], dtype, d, layout, h, "cpu", seed=d + t, t=t,
                               rtne=False)


def test_triton_merge_in_interpreter():
    """Runs test_triton_merge_interpreted in a subprocess with TRITON_INTERPRET=1."""
    pytest.importorskip("triton", reason="triton is in the `test` extra; install it to run this")
    import os
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    from sp_attention.testing import run_process
    r = run_process([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                     os.path.abspath(__file__), "-k", "triton_merge_interpreted"],
                    env=env, timeout=600)
    n = len(_KERNEL_CASES) * len(_LAUNCHES)
    assert r.returncode == 0 and f"{n} passed" in r.stdout, r.stdout[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")
@pytest.mark.parametrize("launch", sorted(_LAUNCHES))
@pytest.mark.parametrize("dtype,d,layout,h,t", _KERNEL_CASES)
def test_triton_merge_gpu_cases(dtype, d, layout, h, t, launch):
    """The kernel on the GPU vs the torch form on the same cases (round to nearest even)."""
    _compare_to_torch_path(_LAUNCHES[launch], dtype, d, layout, h, "cuda", seed=d + t, t=t)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("rows", [slice(None), slice(4096, None)])
def test_triton_merge_gpu_ring_shapes(dtype, rows):
    """The ring forward's own shapes ([1, 8192, 32, 128], every row or the second zigzag
    chunk; fp32 accumulator or the bf16 kernel output merged in place) through merge_blocks_
    (which takes the kernel on CUDA) vs the torch form, elementwise: the case that went wrong
    for an earlier fused kernel on the H200."""
    g = torch.Generator(device="cuda").manual_seed(7)
    out = torch.randn(1, 8192, 32, 128, device="cuda", generator=g).to(dtype)
    lse = torch.randn(1, 32, 8192, device="cuda", generator=g) * 3
    blk = torch.randn(1, 8192, 32, 128, device="cuda", generator=g).to(BF16)[:, rows]
    lse_b = torch.randn(1, 32, 8192, device="cuda", generator=g)[:, :, rows] * 3
    lse_b = lse_b.contiguous()
    got_o, got_l = out.clone(), lse.clone()
    ref_o, ref_l = out.clone(), lse.clone()
    merge_blocks_(got_o[:, rows], got_l[:, :, rows], blk, lse_b)
    _torch_path_(ref_o[:, rows], ref_l[:, :, rows], blk, lse_b)
    assert (got_l - ref_l).abs().max().item() <= 1e-5
    diff = (got_o.double() - ref_o.double()).abs()
    if dtype == BF16:
        assert (diff <= torch.finfo(BF16).eps * ref_o.double().abs() + 1e-6).all()
        assert (got_o != ref_o).double().mean().item() <= 1e-3
    else:
        assert diff.max().item() <= 1e-5
    assert torch.equal(got_o[:, :4096] if rows.start else got_o[:, :0],
                       out[:, :4096] if rows.start else out[:, :0])

"""GPU (``-m gpu``): per-token gates and packed documents through the fla path of the public op
against the torch path in fp32 on the same (rounded) inputs, and fp32 against the fp64
per-document recurrence; every path a call can take on one GPU: one leaf, two leaves (zigzag at
world size 1, the overlapped multi-leaf path), packed documents (fla's varlen kernels)."""
from __future__ import annotations

import pytest
import torch

from sp_attention import SPContext, plan_packing
from sp_attention.linear import lightning_attention
from sp_attention.testing import rel_rms

from local_cases import apply, gpu
from packed_cases import make_inputs, per_document_reference

BF16_TOL, FP32_TOL = 1.5e-2, 2e-3      # fla's fp32 kernels run TF32 dots


def _run(xs, do, gated, slopes, **kw):
    xs = [x.clone().requires_grad_(True) for x in xs]
    dec = {"g": xs[3]} if gated else {}
    o = lightning_attention(*xs[:3], slopes if not gated else None, **dec, scale=0.125, **kw)
    o.backward(do.to(o.dtype))
    return [o] + [x.grad for x in xs[:3]] + ([xs[3].grad] if gated else [])


def _inputs(B, T, H, K, dtype, seed=0):
    q, k, v, do, g = make_inputs(B, T, H, K, K, "mixed", seed)
    g = torch.nn.functional.logsigmoid(g * 40 + 2) / 4             # a realistic gate, ≤ 0
    cast = [t.cuda().to(dtype) for t in (q, k, v, do)]
    return cast[:3] + [g.cuda().float()], cast[3]


@apply(gpu)
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("T", [256, 300])
def test_fla_matches_torch_bf16(layout, gated, T):
    """One leaf (contiguous) or two (zigzag at world size 1: the multi-leaf path with its
    streams, our output / state-sum kernels and, with gates, our dq/dk/dg kernel)."""
    xs, do = _inputs(2, T, 4, 64, torch.bfloat16)
    slopes = torch.tensor([0.0, 0.01, 0.3, 50.0], device="cuda")
    ctx = SPContext(None, 0, 1, (0,), layout)
    got = _run(xs, do, gated, slopes, ctx=ctx, backend="fla")
    ref = _run([x.float() for x in xs], do.float(), gated, slopes, ctx=ctx, backend="torch")
    for name, a, b in zip(("o", "dq", "dk", "dv", "dg"), got, ref):
        assert torch.isfinite(a).all(), name
        assert rel_rms(a.float(), b) < BF16_TOL, (name, rel_rms(a.float(), b))


@apply(gpu)
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_fla_packed_matches_reference(gated, layout):
    """Packed documents (a single token, shorter than a chunk, longer than one, padding after
    them) through fla's varlen kernels: fp32 vs the fp64 per-document recurrence, bf16 vs the
    torch path in fp32. World size 1 (all documents local; the scan's arithmetic is tested at
    every rank on CPU)."""
    cu, row = [0, 1, 40, 170, 300], 310
    xs, do = _inputs(1, row, 4, 64, torch.float32, seed=3)
    slopes = torch.tensor([0.0, 0.01, 0.3, 50.0], device="cuda")
    plan = plan_packing(cu, SPContext(None, 0, 1, (0,), layout), row_len=row)
    sh = lambda t: plan.shard(t, 0, 1)          # noqa: E731
    ctx = SPContext(None, 0, 1, (0,), layout)
    g_ref = xs[3].double() if gated else -slopes.double().expand(1, row, 4)
    ref = per_document_reference(*(x.double() for x in xs[:3]), do.double(), g_ref, cu, 0.125)
    got = _run([sh(x) for x in xs], sh(do), gated, slopes, ctx=ctx, cu_seqlens=plan,
               backend="fla")
    for name, a, b in zip(("o", "dq", "dk", "dv", "dg"), got, ref):
        assert rel_rms(a.double(), sh(b)) < FP32_TOL, (name, rel_rms(a.double(), sh(b)))
    low = _run([sh(x).bfloat16() if i < 3 else sh(x) for i, x in enumerate(xs)],
               sh(do).bfloat16(), gated, slopes, ctx=ctx, cu_seqlens=plan, backend="fla")
    for name, a, b in zip(("o", "dq", "dk", "dv", "dg"), low, got):
        assert rel_rms(a.float(), b.float()) < BF16_TOL, (name, rel_rms(a.float(), b.float()))
        assert float(a.detach()[:, plan.real_len(0):].abs().max()) == 0.0, f"{name}: padding"

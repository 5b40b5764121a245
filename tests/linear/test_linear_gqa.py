"""Grouped K/V (GQA) in ``lightning_attention``: ``k, v [B, T, Hkv, D]`` with query head ``h``
on KV head ``h // (H / Hkv)`` equal the same call with K/V expanded to the query heads, at
every rank of P = 3 (one spawn), both layouts, every scan, outputs and dq/dk/dv (fp64, 1e-10)
against the single-device recurrence on the expanded K/V."""
import torch
import torch.distributed as dist

from sp_attention import build_sp_context, shard_sequence
from sp_attention.linear import lightning_attention
from sp_attention.linear.naive import recurrent_linear_attention
from sp_attention.testing import assert_close, run_distributed, seeded

B, C, H, HKV, K, V = 2, 4, 6, 2, 3, 4
SLOPES = torch.tensor([0.0, 0.1, 0.3, 0.7, 2.0, 40.0], dtype=torch.float64)


def _reference(T, seed=5):
    q, w = seeded((B, T, H, K), seed), seeded((B, T, H, V), seed + 3)
    k, v = seeded((B, T, HKV, K), seed + 1), seeded((B, T, HKV, V), seed + 2)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    g = H // HKV
    o, _ = recurrent_linear_attention(qg, kg.repeat_interleave(g, 2), vg.repeat_interleave(g, 2),
                                      SLOPES, scale=0.6)
    (o * w).sum().backward()
    return (q, k, v, w), (o.detach(), qg.grad, kg.grad, vg.grad)


def _check(ctx, inputs, expected, tag):
    q, k, v, w = (shard_sequence(t, ctx, 1) for t in inputs)
    want = [shard_sequence(t, ctx, 1) for t in expected]
    for impl in ("blelloch", "allgather", "ring"):
        ql, kl, vl = (t.clone().requires_grad_(True) for t in (q, k, v))
        o = lightning_attention(ql, kl, vl, SLOPES, ctx=ctx, impl=impl, scale=0.6,
                                backend="torch")
        (o * w).sum().backward()
        assert kl.grad.shape == kl.shape and vl.grad.shape == vl.shape
        for got, exp, what in zip((o, ql.grad, kl.grad, vl.grad), want, "o dq dk dv".split()):
            assert_close(got, exp, 1e-10, f"{tag} {ctx.layout} {impl} rank{ctx.rank} {what}")


def _gqa_world(rank, world):
    inputs, expected = _reference(2 * world * C)
    group = dist.new_group(list(range(world)))
    for layout in ("zigzag", "contiguous"):
        _check(build_sp_context(group, layout=layout), inputs, expected, f"P={world}")
    return True


def test_grouped_kv_every_scan_and_layout_at_every_rank():
    assert all(run_distributed(_gqa_world, 3, timeout=300))


def test_grouped_kv_single_device():
    inputs, expected = _reference(2 * C + 3)
    ctx = build_sp_context(None, layout="contiguous")    # 11 tokens: any length at P = 1
    _check(ctx, inputs, expected, "P=1")

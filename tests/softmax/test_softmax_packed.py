"""Packed documents through context_parallel_attention vs the per-document reference, fp64 on
CPU/gloo: every document alone through `attention_reference`, concatenated
(`packed_attention_reference`); out, lse, dq, dk, dv within 1e-10 relative at every rank.

One spawn of 8 processes runs every world size P = 1 … 8 on its own group (P = 3 and 5 on
non-contiguous global ranks): both layouts, all four fwd × bwd pairs (fewer at P ≥ 5), head
strides with first/last splits, GQA groups 1/2/4 incl. one KV head, batch 1 and 2, dense and
varlen kernel calls (`packed_dense_min`), and the named rows of issue 24 (boundaries at shard
and leaf edges, documents shorter than a chunk and a leaf, single-token documents, one
document spanning all ranks, ranks with only whole documents, a row ending in padding, ranks
holding only padding, hundreds of tiny documents). At P = 3: changing one document's tokens
leaves every other document's outputs and gradients bit-identical. TP 2 × CP 2 × DP 2 with
Megatron's groups (CP groups not contiguous), each TP rank with its heads. Bad boundaries raise
on every rank. The 2-GPU test's check runs here too, tiny, in bf16 on gloo. The all-to-all
presets at every P: `a2a` on every other row (KV heads split, replicated or straddling),
`a2a_ring` with every all-to-all size 1 < U < P on one row, and `a2a` unpacked at P = 5, 6, 7
(the unpacked spawns of test_softmax_cp.py cover 2, 3, 4, 8).
"""
import math
import random

import pytest
import torch
import torch.distributed as dist

from sp_attention import (SoftmaxTuning, build_sp_context, context_parallel_attention,
                          plan_packing)
from sp_attention.softmax.naive import attention_reference, packed_attention_reference
from sp_attention.testing import (assert_close, megatron_groups, rel_rms, run_distributed,
                                  seeded)

SCALE = 0.7
PAIRS = [("ring", "ring"), ("ring", "allgather"), ("allgather", "allgather"),
         ("allgather", "ring")]
GROUPS = {1: [0], 2: [0, 1], 3: [1, 4, 6], 4: [0, 1, 2, 3], 5: [0, 2, 3, 5, 7],
          6: list(range(6)), 7: list(range(7)), 8: list(range(8))}


def _cu(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def rows_for(P):
    """(name, cu_seqlens, row_len) of the named rows at world size P."""
    c = 4                                          # tokens per zigzag chunk of the plain row
    T = 2 * P * c
    rng = random.Random(P)
    mix, tot = [], 0
    while tot < T:
        n = max(1, min(T - tot, int(rng.lognormvariate(1.6, 1.0))))
        mix.append(n)
        tot += n
    rows = [
        ("mix", _cu(mix), T),
        ("edges", _cu([c, c, 2 * c, T - 4 * c]) if T > 4 * c else _cu([c, T - c]), T),
        ("span+short", _cu([1, T - 4, 1, 2]) if T > 4 else [0, T], T),
        ("single_tokens", _cu([1] * min(T, 12) + ([T - 12] if T > 12 else [])), T),
        ("pad_end", _cu([3, 2 * P + 1]), T + 2),
        ("pad_ranks", [0, 3], 2 * P * 2),
        ("whole_docs", _cu([c] * (2 * P)), T),          # nothing crosses: no communication
    ]
    if P in (3, 8):
        rows.append(("tiny_docs", _cu([1, 2, 3] * (25 if P == 8 else 20)), None))
    return rows


def _reference(cu, T, shape, seed):
    B, H, Hkv, D = shape
    q, w = seeded((B, T, H, D), seed), seeded((B, T, H, D), seed + 1)
    k, v = seeded((B, T, Hkv, D), seed + 2), seeded((B, T, Hkv, D), seed + 3)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    o, lse = packed_attention_reference(qg, kg, vg, cu, softmax_scale=SCALE)
    (o * w).sum().backward()
    return (q, k, v, w), (o.detach(), lse.detach(), qg.grad, kg.grad, vg.grad)


def _run(ctx, plan, inputs, expected, fwd, bwd, kw, name):
    r = ctx.rank
    q, k, v, w = (plan.shard(t, r) for t in inputs)
    want = [plan.shard(expected[0], r),
            plan.shard(expected[1], r, dim=2, pad_value=-math.inf)]       # plan-added padding
    want += [plan.shard(t, r) for t in expected[2:]]
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    o, lse = context_parallel_attention(*leaves, ctx=ctx, fwd=fwd, bwd=bwd,
                                        softmax_scale=SCALE, backend="math", return_lse=True,
                                        cu_seqlens=plan, **kw)
    (o * w).sum().backward()
    real = lse.isfinite()
    assert torch.equal(real, want[1].isfinite()), f"{name}: -inf rows differ"
    assert torch.equal(o[~real.transpose(1, 2)], torch.zeros_like(o[~real.transpose(1, 2)]))
    got = [o, torch.where(real, lse, 0)] + [t.grad for t in leaves]
    want[1] = torch.where(real, want[1], 0)
    for g, e, what in zip(got, want, ("out", "lse", "dq", "dk", "dv")):
        assert g.dtype == torch.float64
        assert_close(g, e, 1e-10, f"{name} {what}")


def _cases(P):
    """(shape (B, H, Hkv, D), fwd, bwd, extra kwargs) for world size P."""
    shapes = [(1, 4, 2, 4), (2, 4, 4, 4), (1, 4, 1, 4)]
    pairs = PAIRS if P <= 4 else PAIRS[:2]
    out = []
    for i, shape in enumerate(shapes):
        for j, (fwd, bwd) in enumerate(pairs):
            if P > 4 and (i + j) % 2:
                continue
            kw = {}
            if "allgather" in (fwd, bwd) and shape[2] == 4:
                kw = dict(heads_k_stride=2, bwd_head_first_stride=1, bwd_head_last_stride=1) \
                    if bwd == "allgather" else dict(heads_k_stride=2)
            kw["tuning"] = SoftmaxTuning(packed_dense_min=(1, 24, 1 << 20)[(i + j) % 3],
                                         packed_dense_after=0)
            out.append((shape, fwd, bwd, kw))
    return out


def _isolation(ctx):
    """P = 3: change document 1's tokens; every other document's rows are bit-identical."""
    cu = _cu([7, 9, 14, 5, 13])
    plan = plan_packing(cu, ctx)
    T = cu[-1]
    shape = (1, 4, 2, 4)
    (q, k, v, w), _ = _reference(cu, T, shape, 11)
    results = []
    for change in (False, True):
        x = [t.clone() for t in (q, k, v)]
        if change:
            for t in x:
                t[:, cu[1]:cu[2]] += 0.5
        leaves = [plan.shard(t, ctx.rank).requires_grad_(True) for t in x]
        o = context_parallel_attention(*leaves, ctx=ctx, softmax_scale=SCALE, backend="math",
                                       cu_seqlens=plan)
        (o * plan.shard(w, ctx.rank)).sum().backward()
        results.append([o.detach()] + [t.grad for t in leaves])
    other = plan.doc_ids(ctx.rank) != 1
    for a, b in zip(*results):
        assert torch.equal(a[:, other], b[:, other]), "another document changed"
    if (~other).any():                            # ... and document 1's did change
        assert not torch.equal(results[0][0][:, ~other], results[1][0][:, ~other])


def _bf16(ctx):
    """bf16 inputs (math backend): P = 2 accumulates in the input dtype (one rounding per
    row), P = 3 in fp32; both within bf16 error of the fp64 reference, every pair."""
    cu = _cu([5, 30, 2, 11, 16])
    plan = plan_packing(cu, ctx)
    inputs, expected = _reference(cu, cu[-1], (1, 4, 2, 8), 31)
    for fwd, bwd in PAIRS:
        leaves = [plan.shard(t, ctx.rank).to(torch.bfloat16).requires_grad_(True)
                  for t in inputs[:3]]
        o = context_parallel_attention(*leaves, ctx=ctx, fwd=fwd, bwd=bwd, softmax_scale=SCALE,
                                       backend="math", cu_seqlens=plan)
        (o.float() * plan.shard(inputs[3], ctx.rank).float()).sum().backward()
        assert o.dtype == torch.bfloat16 and leaves[1].grad.dtype == torch.bfloat16
        for got, exp in zip([o] + [t.grad for t in leaves], [expected[0], *expected[2:]]):
            assert_close(got, plan.shard(exp, ctx.rank), 2e-2, f"bf16 P={ctx.world_size}")


def _trivial(ctx):
    """One document spanning the row is today's path: bit-identical to cu_seqlens=None."""
    t = 2 * ctx.world_size * 3
    x = [seeded((1, t, 4, 4), 5), seeded((1, t, 2, 4), 6), seeded((1, t, 2, 4), 7)]
    plan = plan_packing([0, t], ctx)
    assert plan.is_trivial
    local = [plan.shard(a, ctx.rank) for a in x]
    a = context_parallel_attention(*local, ctx=ctx, backend="math", cu_seqlens=plan)
    b = context_parallel_attention(*local, ctx=ctx, backend="math")
    assert torch.equal(a, b)


def _errors(ctx):
    """Bad boundaries raise on every rank (the call check tells the others)."""
    t = 2 * ctx.world_size * 2
    q = torch.zeros(1, t // ctx.world_size, 2, 4, dtype=torch.float64)
    bad = [
        (torch.tensor([0, 5, 3, t]), "strictly increasing"),
        (torch.tensor([0.0, t]), "int32 or int64"),
        (torch.tensor([0, t // 2]), "T_local"),                     # not the row's length
        (torch.tensor([0, t], device="meta"), "meta"),
        ([0, t], "PackingPlan"),
    ]
    if ctx.world_size > 1:                                          # ranks disagree
        bad.append((torch.tensor([0, 1 + ctx.rank, t]), "different"))
    for cu, match in bad:
        with pytest.raises((ValueError, TypeError), match=match):
            context_parallel_attention(q, q, q, ctx=ctx, backend="math", cu_seqlens=cu)
    with pytest.raises(ValueError, match="causal=True"):
        context_parallel_attention(q, q, q, ctx=ctx, backend="math", causal=False,
                                   cu_seqlens=torch.tensor([0, t]))


def _tp_sharded_heads(mg):
    """TP 2 × CP 2 × DP 2 (Megatron's order, TP innermost: CP groups are not contiguous): each
    TP rank passes its heads (H / TP query, Hkv / TP KV heads) on its CP group."""
    tp, ctx = mg["tp_ranks"].index(dist.get_rank()), build_sp_context(mg["cp"], "zigzag")
    cu = _cu([3, 17, 2, 9, 1])
    (q, k, v, w), exp = _reference(cu, cu[-1], (1, 8, 4, 4), 21)
    plan = plan_packing(cu, ctx)
    hq, hk = slice(4 * tp, 4 * tp + 4), slice(2 * tp, 2 * tp + 2)
    inputs = (q[:, :, hq], k[:, :, hk], v[:, :, hk], w[:, :, hq])
    want = (exp[0][:, :, hq], exp[1][:, hq], exp[2][:, :, hq], None, None)
    leaves = [plan.shard(t, ctx.rank).requires_grad_(True) for t in inputs[:3]]
    o, lse = context_parallel_attention(*leaves, ctx=ctx, softmax_scale=SCALE, backend="math",
                                        return_lse=True, cu_seqlens=plan)
    (o * plan.shard(inputs[3], ctx.rank)).sum().backward()
    assert_close(o, plan.shard(want[0], ctx.rank), 1e-10, "tp out")
    assert_close(lse, plan.shard(want[1], ctx.rank, dim=2), 1e-10, "tp lse")
    assert_close(leaves[0].grad, plan.shard(want[2], ctx.rank), 1e-10, "tp dq")
    # dK/dV of the rank's KV heads: the reference's, as the head groups do not mix
    assert_close(leaves[1].grad, plan.shard(exp[3][:, :, hk], ctx.rank), 1e-10, "tp dk")
    assert_close(leaves[2].grad, plan.shard(exp[4][:, :, hk], ctx.rank), 1e-10, "tp dv")


def _a2a_runs(P, n, li):
    """(shape, kwargs, a2a_size) of the all-to-all runs on row ``n`` at world size P, layout
    ``li`` (0, 1): a2a on every other row, a2a_ring with each size on one row."""
    shapes = [(1, 2 * P, 2, 4), (2, 3 * P, 3, 4)]
    runs = [(shapes[n // 2 % 2], dict(preset="a2a"), None)] if (n + li) % 2 == 0 else []
    if n == 2 + li:
        runs += [(shapes[0], dict(preset="a2a_ring", a2a_size=u), u)
                 for u in range(2, P) if P % u == 0]
    return runs


def _a2a_unpacked(ctx):
    """a2a on a plain sequence (P = 5, 6, 7) vs attention_reference, both layouts' shards."""
    P = ctx.world_size
    T = 2 * P * 3
    for shape in ((1, 2 * P, 1, 4), (1, 3 * P, 3, 4)):
        B, H, Hkv, D = shape
        q, w = seeded((B, T, H, D), 3), seeded((B, T, H, D), 4)
        k, v = seeded((B, T, Hkv, D), 5), seeded((B, T, Hkv, D), 6)
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        o, lse = attention_reference(*leaves, causal=True, softmax_scale=SCALE)
        (o * w).sum().backward()
        from sp_attention import shard_sequence
        loc = [shard_sequence(t, ctx, 1).requires_grad_(True) for t in (q, k, v)]
        ol, ll = context_parallel_attention(*loc, ctx=ctx, preset="a2a", softmax_scale=SCALE,
                                            backend="math", return_lse=True)
        (ol * shard_sequence(w, ctx, 1)).sum().backward()
        want = [o, lse] + [t.grad for t in leaves]
        for g, e, what in zip([ol, ll] + [t.grad for t in loc], want,
                              ("out", "lse", "dq", "dk", "dv")):
            assert_close(g, shard_sequence(e, ctx, 2 if what == "lse" else 1), 1e-10,
                         f"a2a unpacked P={P} {ctx.layout} {shape} {what}")


def _worker(rank, world):
    groups = {P: dist.new_group(ranks) for P, ranks in GROUPS.items()}
    mg = megatron_groups(2, 2, 2)
    done = []
    for P, ranks in GROUPS.items():
        if rank not in ranks:
            continue
        for li, layout in enumerate(("zigzag", "contiguous")):
            ctx = build_sp_context(groups[P], layout=layout)
            for n, (name, cu, row_len) in enumerate(rows_for(P)):
                plan = plan_packing(cu, ctx, row_len=row_len)
                T = plan.row_len
                for m, (shape, fwd, bwd, kw) in enumerate(_cases(P)):
                    if (n + m) % (2 if P <= 4 else 3):       # a rotating subset per row
                        continue
                    inputs, expected = _reference(cu, T, shape, 100 * n + m)
                    tag = f"P={P} {layout} {name} {shape} {fwd}/{bwd} {kw}"
                    _run(ctx, plan, inputs, expected, fwd, bwd, kw, tag)
                    done.append((P, layout, name, fwd, bwd))
                for shape, kw, u in _a2a_runs(P, n, li):
                    inputs, expected = _reference(cu, T, shape, 100 * n + 7)
                    tag = f"P={P} {layout} {name} {shape} {kw}"
                    _run(ctx, plan, inputs, expected, None, None, kw, tag)
                    done.append((P, layout, name, kw["preset"], kw.get("a2a_size")))
            _trivial(ctx)
            if P in (5, 6, 7):
                _a2a_unpacked(ctx)
            if layout == "zigzag":
                _errors(ctx)
                if P == 3:
                    _isolation(ctx)
                if P in (2, 3):
                    _bf16(ctx)
    _tp_sharded_heads(mg)
    if rank in GROUPS[2]:       # the 2-GPU test's own code, tiny, on gloo with bf16 math
        _packed_multigpu_check(rank, 2, T_local=48, shape=(4, 2, 8), device_type="cpu",
                               group=groups[2])
    return done


def test_rows_cover_the_named_cases():
    """The rows above hold what their names promise, at every P (pure, no processes)."""
    for P in GROUPS:
        plans = {(lay, n): plan_packing(cu, P, layout=lay, row_len=r)
                 for lay in ("zigzag", "contiguous") for n, cu, r in rows_for(P)}
        if P > 1:
            assert any(len({r for r, _ in p.doc_pieces[1]}) == P
                       for (_, n), p in plans.items() if n == "span+short")
        assert all(p.crossing_docs == () for (_, n), p in plans.items() if n == "whole_docs")
        assert P == 1 or any(p.real_len(P - 1) == 0 for (_, n), p in plans.items()
                             if n == "pad_ranks")
        if P > 2:                       # a rank with only whole documents while others cross
            assert any(p.crossing_docs and any(not p.crossing_segments(r) and p.real_len(r)
                                               for r in range(P)) for p in plans.values())


def test_packed_softmax_every_world_size():
    done = run_distributed(_worker, 8, timeout=600)
    seen = {x for d in done for x in d}
    for P in GROUPS:
        for layout in ("zigzag", "contiguous"):
            names = {x[2] for x in seen if x[:2] == (P, layout)}
            assert names == {r[0] for r in rows_for(P)}, (P, layout, names)
            pairs = {x[3:] for x in seen if x[:2] == (P, layout) and x[3] in ("ring", "allgather")}
            assert pairs == set(PAIRS if P <= 4 else PAIRS[:2]), (P, layout, pairs)
            a2a = {x[3:] for x in seen if x[:2] == (P, layout) and x[3].startswith("a2a")}
            assert a2a == {("a2a", None)} | {("a2a_ring", u) for u in range(2, P) if P % u == 0}


# ------------------------------------------------------------------------------------------
# GPUs: bf16 vs an fp32 per-document reference (device machine: pytest -m multigpu)
# ------------------------------------------------------------------------------------------

def _packed_multigpu_check(rank, world, T_local=1024, shape=(8, 2, 64), device_type="cuda",
                           group=None):
    """Every pair and layout at P = world in bf16 (dense and varlen calls, gaps and none) vs
    the fp32 per-document reference: within 1.5x the same op's error at P = 1, and < 2e-2."""
    dev = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else \
        torch.device(device_type)
    H, Hkv, D = shape
    group = dist.new_group(list(range(world))) if group is None else group
    T = world * T_local
    rng = random.Random(T)
    lengths = []
    while sum(lengths) < T:
        lengths.append(max(1, min(T - sum(lengths), int(rng.lognormvariate(math.log(T / 12),
                                                                           1.2)))))
    cu = _cu(lengths)
    g = torch.Generator(device=dev).manual_seed(3)
    q, do = (torch.randn(1, T, H, D, device=dev, generator=g) for _ in range(2))
    k, v = (torch.randn(1, T, Hkv, D, device=dev, generator=g) for _ in range(2))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    o, _ = packed_attention_reference(*leaves, cu)
    o.backward(do)
    ref = [o.detach()] + [t.grad for t in leaves]
    report = {}
    for layout in ("zigzag", "contiguous"):
        ctx = build_sp_context(group, layout=layout)
        plan, plan1 = plan_packing(cu, ctx), plan_packing(cu, 1)
        for tuning in (SoftmaxTuning(packed_dense_min=T_local * T_local // 16,
                                     packed_dense_after=0),
                       SoftmaxTuning(packed_dense_min=1 << 40, packed_varlen_gaps=False),
                       SoftmaxTuning(packed_dense_after=0),   # auto_dense_min of the row
                       SoftmaxTuning()):     # the default: the layout's first calls varlen
            for fwd, bwd in PAIRS:
                errs = []
                for p, c in ((plan1, None), (plan, ctx)):
                    r = 0 if c is None else c.rank
                    loc = [p.shard(t.to(torch.bfloat16), r).requires_grad_(True)
                           for t in (q, k, v)]
                    out = context_parallel_attention(*loc, ctx=c, fwd=fwd, bwd=bwd,
                                                     cu_seqlens=p, tuning=tuning)
                    out.backward(p.shard(do.to(torch.bfloat16), r))
                    got = [out] + [t.grad for t in loc]
                    assert all(torch.isfinite(x).all() for x in got)
                    errs.append([rel_rms(x, p.shard(y, r)) for x, y in zip(got, ref)])
                key = (f"{layout} {fwd}/{bwd} dense_min={tuning.packed_dense_min} "
                       f"after={tuning.packed_dense_after}")
                for n, e1, e2 in zip(("out", "dq", "dk", "dv"), *errs):
                    report[f"{key} {n}"] = (e1, e2)
                    assert e2 <= 1.5 * e1 + 2e-4 and e2 < 2e-2, (key, n, e1, e2)
    return report


@pytest.mark.multigpu
@pytest.mark.parametrize("world", [2, 4])
def test_packed_gpus_bf16(world):
    """Documents cut across two and four ranks over NCCL, every pair and layout."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs (device machine)")
    res = run_distributed(_packed_multigpu_check, world, timeout=600, backend="nccl")
    for key, (e1, e2) in sorted(res[0].items()):
        print(f"{key:<70} P=1 {e1:.2e}  P={world} {e2:.2e}")


def test_default_tuning_runs_the_rows_auto_dense_min(monkeypatch):
    """``packed_dense_min=None`` reaches the packed Function as the row's
    :func:`~sp_attention.planning.softmax_packed.auto_dense_min` (small rows: 2^24, few large
    varlen calls), an explicit value as itself — once the layout has had more than
    ``packed_dense_after`` calls; before, every pair is varlen (``NO_DENSE_CALLS``). Each
    layout counts its own calls. One GPU's (no group) packed call, fp64."""
    import sp_attention.softmax.attention as attention
    from sp_attention.caches import LRU
    from sp_attention.planning.softmax_packed import (DENSE_MIN_SMALL_WORK, NO_DENSE_CALLS,
                                                      PACKED_DENSE_AFTER, auto_dense_min)

    seen = []
    real = attention.PackedAttention

    class Recording:
        @staticmethod
        def apply(q, k, v, cfg):
            seen.append(cfg.policy.dense_min)
            return real.apply(q, k, v, cfg)

    monkeypatch.setattr(attention, "PackedAttention", Recording)
    monkeypatch.setattr(attention, "_PLAN_CALLS", LRU(256))     # this test's own counts
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 32, 4, 8, dtype=torch.float64, generator=g)
    k, v = (torch.randn(1, 32, 2, 8, dtype=torch.float64, generator=g) for _ in range(2))

    def call(cu, tuning):
        out = context_parallel_attention(q, k, v, ctx=None, causal=True,
                                         cu_seqlens=torch.tensor(cu), tuning=tuning)
        assert_close(out, packed_attention_reference(q, k, v, cu)[0], 1e-10)
        return seen[-1]

    cu, other = [0, 5, 12, 30, 32], [0, 16, 32]
    assert SoftmaxTuning().packed_dense_after == PACKED_DENSE_AFTER
    assert call(cu, SoftmaxTuning(packed_dense_after=0)) == DENSE_MIN_SMALL_WORK
    assert call(cu, SoftmaxTuning(packed_dense_min=30, packed_dense_after=0)) == 30
    # calls 3, 4 of this layout: varlen while the count is at most 4, dense from the 5th
    assert [call(cu, SoftmaxTuning(packed_dense_after=4)) for _ in range(3)] == \
        [NO_DENSE_CALLS, NO_DENSE_CALLS, DENSE_MIN_SMALL_WORK]
    assert call(other, SoftmaxTuning(packed_dense_after=4)) == NO_DENSE_CALLS   # its 1st
    assert call(other, None) == NO_DENSE_CALLS      # the default: varlen for 256 calls
    assert auto_dense_min(tuple(cu), 1, 4, 8) == DENSE_MIN_SMALL_WORK
    with pytest.raises(ValueError, match="packed_dense_after must be an int >= 0"):
        SoftmaxTuning(packed_dense_after=-1)


def _compact_accumulators_worker(rank, world):
    """bf16 at P = ``world`` (fp32 accumulators): the packed schedules' compact accumulators
    (:class:`RowWindow` over the cross-rank rows / the travel window) against whole-shard ones
    (every window widened to the shard, the schedules' accumulators before them): out, dq, dk,
    dv bit-identical, every pair and layout."""
    from sp_attention.softmax import packed_ring
    group = dist.new_group(list(range(world)))
    T_local, H, Hkv, D = 48, 4, 2, 8
    T = world * T_local
    rng = random.Random(11)
    lengths = []
    while sum(lengths) < T:
        lengths.append(max(1, min(T - sum(lengths), int(rng.lognormvariate(math.log(T / 6),
                                                                           1.0)))))
    cu = _cu(lengths)
    g = torch.Generator().manual_seed(5)
    q, do = (torch.randn(1, T, H, D, generator=g).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, T, Hkv, D, generator=g).to(torch.bfloat16) for _ in range(2))
    real_init = packed_ring.RowWindow.__init__

    def whole(self, x, lo, hi, dtype):          # the window widened to the whole shard
        real_init(self, x, 0, x.shape[1], dtype)
    checked = 0
    for layout in ("zigzag", "contiguous"):
        ctx = build_sp_context(group, layout=layout)
        plan = plan_packing(cu, ctx)
        for fwd, bwd in PAIRS:
            got = []
            for widen in (False, True):
                packed_ring.RowWindow.__init__ = whole if widen else real_init
                try:
                    loc = [plan.shard(t, ctx.rank).requires_grad_(True) for t in (q, k, v)]
                    out = context_parallel_attention(*loc, ctx=ctx, fwd=fwd, bwd=bwd,
                                                     cu_seqlens=plan)
                    out.backward(plan.shard(do, ctx.rank))
                    got.append([out.detach()] + [t.grad for t in loc])
                finally:
                    packed_ring.RowWindow.__init__ = real_init
            for name, a, b in zip(("out", "dq", "dk", "dv"), *got):
                assert a.dtype == torch.bfloat16 and torch.equal(a, b), (layout, fwd, bwd, name)
            checked += 1
    return checked


@pytest.mark.parametrize("world", [3, 4])
def test_compact_accumulators_are_whole_shard_ones(world):
    assert run_distributed(_compact_accumulators_worker, world, timeout=300) == \
        [2 * len(PAIRS)] * world

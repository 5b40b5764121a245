"""Multi-process gloo tests of the communication layer at world sizes 1, 2, 3, 4 and 8, incl. a
TP×CP×DP = 2×2×2 layout whose CP groups are not contiguous global ranks."""
import datetime

import pytest
import torch
import torch.distributed as dist

from sp_attention.comm import (AsyncReduceScatter, RingComm, all_gather_along, all_gather_flat,
                               gather_along, p2p_exchange, pad_flat, reduce_scatter_along,
                               reduce_scatter_flat, scatter_reduce_along)
from sp_attention.context import CPGroupOptions, SPContext, build_sp_context, new_cp_group
from sp_attention.testing import assert_close, megatron_groups, run_distributed, seeded


class _MeanGradAcrossRanks(torch.autograd.Function):
    """Identity forward; backward averages the gradient over ranks. Turns per-rank analytic
    gradients of a replicated input into the gradient of the one global function, so
    ``gradcheck`` can compare it with finite differences of that function."""

    @staticmethod
    def forward(fctx, x, ctx):
        fctx.sp = ctx
        return x.view_as(x)

    @staticmethod
    def backward(fctx, g):
        g = g.clone()
        if fctx.sp.world_size > 1:
            dist.all_reduce(g, group=fctx.sp.group)
        return g / fctx.sp.world_size, None


def _global_fn(ctx):
    P, r = ctx.world_size, ctx.rank
    w = 1.0 + 0.25 * r

    def f(X):  # X: [2, 2P, 3] replicated on every rank
        X = _MeanGradAcrossRanks.apply(X, ctx)
        x = X.chunk(P, dim=1)[r]                                  # this rank's shard
        y = gather_along(x * w, ctx, dim=1)                      # [2, 2P, 3]
        z = scatter_reduce_along(torch.tanh(y) * (r + 1), ctx, dim=1)  # [2, 2, 3]
        return gather_along(z.sin(), ctx, dim=1)                 # replicated [2, 2P, 3]
    return f


def _check_all(ctx: SPContext, tag: str):
    P, r = ctx.world_size, ctx.rank
    # --- fixed-shape all-gather along several dims
    x = seeded((2, 3, 4), seed=100 + r)
    full = [seeded((2, 3, 4), seed=100 + i) for i in range(P)]
    for dim in (0, 1, 2):
        assert torch.equal(all_gather_along(x, ctx, dim), torch.cat(full, dim)), (tag, dim)
    # --- reduce-scatter with fp32 accumulation of bf16 inputs
    y = seeded((2, 4 * P, 3), seed=200 + r).to(torch.bfloat16)
    want = sum(seeded((2, 4 * P, 3), seed=200 + i).to(torch.bfloat16).to(torch.float32)
               for i in range(P))
    got = reduce_scatter_along(y, ctx, dim=1, reduce_dtype=torch.float32)
    assert got.dtype == torch.float32
    assert_close(got, want.chunk(P, dim=1)[r], 1e-7, f"{tag} reduce_scatter bf16->fp32")
    # --- async manager: two slots, two launches each, drained into a bf16 destination
    mgr = AsyncReduceScatter(ctx, num_slots=2)
    dests = [torch.zeros(5, dtype=torch.float32), torch.zeros(5, dtype=torch.bfloat16)]
    for step in range(4):
        slot = step % 2
        buf = mgr.buffer(slot, (5,), "cpu")   # drains this slot's previous launch first
        buf.copy_(seeded((P, 5), seed=300 + 7 * step + r))
        mgr.launch(slot, (5,), "cpu", dests[slot])
        assert mgr.num_pending <= 2
    mgr.drain_all()
    for slot in range(2):
        want = sum(seeded((P, 5), seed=300 + 7 * step + i)[r]
                   for step in range(slot, 4, 2) for i in range(P))
        assert_close(dests[slot].float(), want.float(), 1e-2 if slot else 1e-6,
                     f"{tag} async slot {slot}")
    # --- flat collectives incl. a padded uneven length
    inp = torch.full((3,), float(r), dtype=torch.float64)
    out = torch.empty(3 * P, dtype=torch.float64)
    all_gather_flat(out, inp, ctx)
    assert out.tolist() == [float(i) for i in range(P) for _ in range(3)]
    rs = torch.empty(3, dtype=torch.float64)
    reduce_scatter_flat(rs, torch.arange(3 * P, dtype=torch.float64), ctx)
    assert rs.tolist() == [P * float(3 * r + j) for j in range(3)]
    # --- an uneven flat length, padded to a multiple of the group size
    uneven = torch.arange(7, dtype=torch.float64) * (r + 1)
    padded = pad_flat(uneven, P)
    assert padded.numel() % P == 0 and torch.equal(padded[:7], uneven)
    shard = torch.empty(padded.numel() // P, dtype=torch.float64)
    reduce_scatter_flat(shard, padded, ctx)
    total = torch.arange(7, dtype=torch.float64) * sum(range(1, P + 1))
    want = pad_flat(total, P).view(P, -1)[r]
    assert torch.equal(shard, want), (tag, shard, want)
    # --- ring hops: after k hops rank r holds the block of rank r − k
    if P > 1:
        ring = RingComm(ctx)
        cur = torch.tensor([float(r)])
        for k in range(1, P + 1):
            nxt = ring.send_recv(cur)
            ring.commit()
            ring.wait()
            assert nxt.item() == float((r - k) % P), (tag, k)
            cur = nxt
        # a general exchange: everyone sends to r+2 and receives from r-2 (mod P)
        if P > 2:
            buf = torch.empty(1)
            works = p2p_exchange([(torch.tensor([float(r)]), (r + 2) % P)],
                                 [(buf, (r - 2) % P)], ctx)
            for w in works:
                w.wait()
            assert buf.item() == float((r - 2) % P)
    # --- gradients of the autograd collectives, as a function of the global input
    X = seeded((2, 2 * P, 3), seed=7).requires_grad_(True)
    assert torch.autograd.gradcheck(_global_fn(ctx), (X,), eps=1e-6, atol=1e-8, rtol=1e-6)
    return True


def _world_checks(rank, world):
    group = dist.new_group(list(range(world)))
    ctx = build_sp_context(group)
    assert ctx.world_size == world and ctx.rank == rank
    assert ctx.global_ranks == tuple(range(world))
    _check_all(ctx, f"world{world}")
    if world == 8:
        g = megatron_groups(tp=2, cp=2, dp=2)
        cp = build_sp_context(g["cp"])
        # TP innermost: CP partners are 2 global ranks apart, e.g. (0, 2), (1, 3), (4, 6)
        assert cp.global_ranks == tuple(g["cp_ranks"]) and cp.global_ranks[1] - cp.global_ranks[0] == 2
        _check_all(cp, "cp-of-2x2x2")
        dpctx = build_sp_context(g["dp"])
        assert dpctx.global_ranks[1] - dpctx.global_ranks[0] == 4
        _check_all(dpctx, "dp-of-2x2x2")
    if world >= 3:
        # new_cp_group with NCCL options on gloo (ignored there): a working group of the even
        # ranks (non-contiguous), called by every rank; bad ranks raise before any group call
        with pytest.raises(ValueError, match="distinct global ranks"):
            new_cp_group([0, world])
        with pytest.raises(ValueError, match="distinct global ranks"):
            new_cp_group([0, 0])
        even = list(range(0, world, 2))
        # a timeout is passed through; an hour, so that it never trips on a slow peer (the
        # spawn harness detects a hang by the ranks' lack of progress)
        g = new_cp_group(even, CPGroupOptions(high_priority_stream=True, max_ctas=4),
                         timeout=datetime.timedelta(hours=1))
        if rank in even:
            sub = build_sp_context(g)
            assert sub.global_ranks == tuple(even) and sub.rank == even.index(rank)
            _check_all(sub, f"new_cp_group-even-of-{world}")
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_collectives(world):
    assert all(run_distributed(_world_checks, world, timeout=240))


def test_world_size_one_without_process_group():
    ctx = build_sp_context(None)
    assert ctx.world_size == 1 and ctx.group is None
    _check_all(ctx, "no-group")


def test_bad_input_raises_before_any_collective():
    ctx = build_sp_context(None)
    with pytest.raises(ValueError, match="expected 1 × 3"):
        all_gather_flat(torch.empty(4), torch.empty(3), ctx)
    with pytest.raises(ValueError, match="expected 1 × 2"):
        reduce_scatter_flat(torch.empty(2), torch.empty(3), ctx)
    with pytest.raises(ValueError, match="at least 2"):
        RingComm(ctx)
    fake = SPContext(object(), 0, 2, (0, 1), "zigzag")
    with pytest.raises(ValueError, match="not a multiple of the group size 2"):
        reduce_scatter_along(torch.zeros(3, 3), fake, dim=0)
    with pytest.raises(ValueError, match="peer 0 is not another rank"):
        p2p_exchange([(torch.zeros(1), 0)], [], fake)
    ring = RingComm(fake)
    with pytest.raises(RuntimeError, match="nothing posted"):
        ring.commit()
    with pytest.raises(RuntimeError, match="before commit"):
        ring.wait()
    mgr = AsyncReduceScatter(ctx)
    with pytest.raises(ValueError, match="slot 2"):
        mgr.buffer(2, (1,), "cpu")
    with pytest.raises(RuntimeError, match="before buffer"):
        mgr.launch(0, (1,), "cpu", torch.zeros(1))

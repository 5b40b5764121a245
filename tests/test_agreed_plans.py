"""Packing plans agreed on beforehand (``call_check.note_agreed_plans``): the ops then share
one call signature across new plans and run no exchange for them — with the same numbers —
while a plan nobody vouched for is still checked; and ``sp_train.launch.agree_step``'s plan
check, which raises on every rank when the ranks holding the same rows made different plans."""
import pytest
import torch

from sp_attention.testing import run_distributed

SLOPES = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)


def _docs(seed, T):
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(set(torch.randint(1, T, (3,), generator=g).tolist()))
    return torch.tensor([0] + cuts + [T])


def _plans_worker(rank, world):
    import sp_attention.call_check as cc
    from sp_attention import (build_sp_context, context_parallel_attention, lightning_attention,
                              plan_packing, shard_sequence)
    import torch.distributed as dist
    ctx = build_sp_context(dist.group.WORLD)
    n = [0]
    real = cc._exchange

    def counted(*a, **k):
        n[0] += 1
        return real(*a, **k)
    cc._exchange = counted
    T = 8 * world
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, T, 4, 4, dtype=torch.float64, generator=g)
    k = torch.randn(1, T, 2, 4, dtype=torch.float64, generator=g)
    out = []

    def calls(cu):
        plan = plan_packing(cu, ctx)
        ql, kl = (plan.shard(x, ctx.rank, dim=1) for x in (q, k))
        a = lightning_attention(ql, ql, ql[..., :3], SLOPES, cu_seqlens=plan, ctx=ctx,
                                backend="torch")
        b = context_parallel_attention(ql, kl, kl, cu_seqlens=cu, ctx=ctx, backend="math")
        return plan, a, b

    counts = []
    plan, a0, b0 = calls(_docs(1, T))                 # an unvouched plan: checked, twice
    counts.append(n[0])
    cc.clear_checked_calls()
    cc.note_agreed_plans(ctx, [plan.digest])
    _, a1, b1 = calls(_docs(1, T))                    # agreed: the numbers are the same
    out.append(torch.equal(a0, a1) and torch.equal(b0, b1))
    counts.append(n[0])
    for s in (2, 3, 4):                              # new plans, agreed: no exchange
        cc.note_agreed_plans(ctx, [plan_packing(_docs(s, T), ctx).digest])
        calls(_docs(s, T))
    counts.append(n[0])
    calls(_docs(9, T))                               # a new plan nobody vouched for
    counts.append(n[0])
    cc._exchange = real
    cc.clear_checked_calls()
    return counts, out


@pytest.mark.parametrize("world", [2, 3])
def test_agreed_plans_skip_the_exchange_and_keep_the_numbers(world):
    for counts, same in run_distributed(_plans_worker, world):
        # first plan: one exchange per op; the agreed signature: once per op; three more
        # agreed plans: none; an unvouched plan: one per op again
        assert counts == [2, 4, 4, 6], counts
        assert same == [True]


def _agree_worker(rank, world, dp, bad_rank):
    from sp_train.launch import agree_step
    dp_rank = rank // (world // dp)          # the ranks of a DP rank read the same rows
    plans = [f"{0x0123456789abcdef + 7 * dp_rank + i:016x}" for i in range(2)]
    if rank == bad_rank:
        plans[1] = f"{int(plans[1], 16) ^ (1 << 40):016x}"     # one bit in the third piece
    try:
        return agree_step(torch.zeros((), dtype=torch.float64), None, 1,
                          torch.tensor(3.0, dtype=torch.float64), plans, dp_rank, dp)
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize("world,dp", [(4, 2), (3, 1)])
def test_agree_step_checks_the_next_plans_of_every_dp_rank(world, dp):
    """Ranks reading the same rows with the same plans pass (different DP ranks' plans differ,
    as their rows do); one rank's plan one bit off raises the same error on every rank, naming
    the DP rank and micro-batch."""
    for got in run_distributed(_agree_worker, world, dp, -1):
        assert got == (0.0, 3.0 * world, None)
    bad = world - 1
    msgs = run_distributed(_agree_worker, world, dp, bad)
    assert len(set(msgs)) == 1 and f"DP rank {bad // (world // dp)} micro-batch 1" in msgs[0]
    assert "different packing plans" in msgs[0] and "(seed, step, DP rank)" in msgs[0]


def _train_worker(rank, world, log_dir):
    import sp_attention.call_check as cc
    import train
    from sp_train.launch import TrainHooks
    n, per_step = [0], []
    real = cc._exchange

    def counted(*a, **k):
        n[0] += 1
        return real(*a, **k)
    cc._exchange = counted
    hooks = TrainHooks(after_step=lambda step: per_step.append(n[0]))
    try:
        losses = [r["loss"] for r in train.main(
            ["--sp-model-kind", "hybrid", "--context-parallel-size", str(world), "--packing",
             "documents", "--seq-length", "64", "--global-batch-size", "4", "--num-layers", "4",
             "--train-iters", "4", "--no-progress-bar", "--log-dir", log_dir], hooks=hooks)]
    finally:
        cc._exchange = real
        cc.clear_checked_calls()
    return [b - a for a, b in zip([0] + per_step, per_step)], losses


def test_train_py_packed_steps_agree_on_their_plans_once(tmp_path):
    """train.py with packed documents: the first step's micro-batches are checked in the
    layers (one exchange per op and new plan); from then on their plans travel in the step's
    agreement and the layers exchange nothing but the agreed signature's first check."""
    got = run_distributed(_train_worker, 2, str(tmp_path / "log"))
    per_step = got[0][0]
    assert per_step[0] >= 2 and per_step[1] == 2 and per_step[2:] == [0, 0], per_step
    assert got[1][0] == per_step


def test_plan_digests_of_the_next_step():
    """train.py's plans to agree on: one digest per packed micro-batch; none for unpacked rows,
    the local-attention baseline (each rank's own pieces) or past the agreement's limit."""
    from types import SimpleNamespace
    from sp_attention import plan_packing
    from sp_train.data import PLAN_AGREEMENT_LIMIT, plan_digests
    plans = [plan_packing(_docs(s, 16), None) for s in (1, 2)]
    mbs = [(None,) * 4 + (SimpleNamespace(packing_plan=p),) for p in plans]
    assert plan_digests(mbs) == [p.digest for p in plans]
    assert plan_digests(mbs, local_only=True) is None
    assert plan_digests([(None,) * 5]) is None
    assert plan_digests(mbs, dp=PLAN_AGREEMENT_LIMIT // 2) is not None
    assert plan_digests(mbs, dp=PLAN_AGREEMENT_LIMIT // 2 + 1) is None

"""Pure rank arithmetic of the softmax schedules, for P up to 64 (no process group).

Every kernel call must read exactly the keys its queries may see, with the diagonal piece last
when the call is causal; every (query, key) pair must be computed exactly once across a
schedule; the arrangement runs must rebuild the arrangement; zigzag must balance the ring.
"""
import pytest

from sp_attention.planning.softmax_plan import (Call, gather_plan, piece_ids, ring_calls,
                                                stride_widths)

WORLDS = [1, 2, 3, 4, 5, 7, 8, 16, 64]


def _visible(a, b, causal):
    return not causal or b <= a


def _expand_runs(plan):
    order = []
    for run in plan.runs:
        assert run.start == len(order)
        for i in range(run.count):
            order.append((run.rank + i, run.pos) if run.along_ranks else (run.rank, run.pos + i))
    return tuple(order)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("split,key_ranges", [(1, None), (2, "each")])
def test_gather_plan_calls_read_exactly_the_visible_keys(world, layout, causal, split,
                                                         key_ranges):
    for rank in range(world):
        ids = [piece_ids(r, world, layout, split) for r in range(world)]
        n_pos = len(ids[rank])
        ranges = [(0, n_pos)] if key_ranges is None else [(p, p + 1) for p in range(n_pos)]
        seen = set()
        for k0, k1 in ranges:
            plan = gather_plan(rank, world, layout, split, k0, k1, causal)
            assert _expand_runs(plan) == plan.order
            assert len(set(plan.order)) == len(plan.order)
            key_ids = [ids[r][p + k0] for r, p in plan.order]
            if plan.flat_start is not None:
                n = k1 - k0
                assert [r * n + p for r, p in plan.order] == list(
                    range(plan.flat_start, plan.flat_start + len(plan.order)))
            for c in plan.calls:
                prefix = key_ids[:c.keys]
                for j in range(c.q_start, c.q_stop):
                    a = ids[rank][j]
                    want = {ids[r][p] for r in range(world) for p in range(k0, k1)
                            if _visible(a, ids[r][p], causal)}
                    assert set(prefix) == want, (rank, j, c)
                    if c.causal:         # bottom-right: the diagonal piece must come last
                        assert prefix[-1] == a and c.q_stop - c.q_start == 1
                    else:
                        assert a not in prefix or not causal
                    for b in prefix:
                        assert (a, b) not in seen
                        seen.add((a, b))
        every = {(a, b) for a in ids[rank] for r in range(world) for b in ids[r]
                 if _visible(a, b, causal)}
        assert seen == every


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_calls_cover_each_pair_once_and_step_zero_every_row(world, layout, causal):
    work = []
    for rank in range(world):
        mine = piece_ids(rank, world, layout)
        seen, per_step = set(), []
        for step in range(world):
            src = (rank - step) % world
            theirs = piece_ids(src, world, layout)
            cost = 0.0
            calls = ring_calls(rank, src, world, layout, causal)
            if src == rank:     # own block: one square call, causal iff the attention is
                assert calls == (Call(0, len(mine), len(mine), causal),)
            for c in calls:
                # a call is bottom-right causal over its token rectangle: query piece j of the
                # call sees key pieces up to j + (keys - rows), the last of them diagonally
                offset = c.keys - (c.q_stop - c.q_start)
                for j in range(c.q_start, c.q_stop):
                    seen_keys = theirs[:c.keys]
                    if c.causal:
                        last = j - c.q_start + offset
                        seen_keys = theirs[:last + 1]
                        assert theirs[last] == mine[j]          # the diagonal is the rank's own
                    for b in seen_keys:
                        assert _visible(mine[j], b, causal) and (mine[j], b) not in seen
                        seen.add((mine[j], b))
                        cost += 0.5 if b == mine[j] else 1.0
            if step == 0:   # the forward initialises its accumulators at step 0
                rows = {j for c in ring_calls(rank, rank, world, layout, causal)
                        for j in range(c.q_start, c.q_stop)}
                assert rows == set(range(len(mine)))
            per_step.append(cost)
        every = {(a, b) for a in mine for r in range(world) for b in piece_ids(r, world, layout)
                 if _visible(a, b, causal)}
        assert seen == every
        work.append(per_step)
    if layout == "zigzag" and causal and world > 1:
        # zigzag balances causal work: every rank does the same amount at every step > 0
        for step in range(1, world):
            assert len({w[step] for w in work}) == 1, [w[step] for w in work]


def test_stride_widths():
    assert stride_widths(8, 2, 1, 1) == [1, 1, 2, 2, 1, 1]
    assert stride_widths(8, 2) == [2, 2, 2, 2]
    assert stride_widths(8, 4, 1, 3) == [1, 3, 1, 3]
    assert stride_widths(4, 4, 1, 2) == [1, 1, 2]
    assert stride_widths(4, 4, 2, 2) == [2, 2]
    assert stride_widths(2, 2, 1, None) == [1, 1]
    assert stride_widths(6, 1) == [1] * 6

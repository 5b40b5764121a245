"""Pure rank arithmetic of the softmax schedules, for P up to 64 (no process group).

Every kernel call must read exactly the keys its queries may see, with the diagonal piece last
when the call is causal; every (query, key) pair must be computed exactly once across a
schedule; the arrangement runs must rebuild the arrangement; zigzag must balance the ring.
"""
import pytest
import torch

from sp_attention.softmax.bwd_allgather import backward_units
from sp_attention.softmax.plan import Call, gather_plan, piece_ids, ring_calls, stride_widths

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


def test_stride_widths_and_units():
    assert stride_widths(8, 2, 1, 1) == [1, 1, 2, 2, 1, 1]
    assert stride_widths(8, 2) == [2, 2, 2, 2]
    assert stride_widths(8, 4, 1, 3) == [1, 3, 1, 3]
    assert stride_widths(4, 4, 1, 2) == [1, 1, 2]
    assert stride_widths(4, 4, 2, 2) == [2, 2]
    assert stride_widths(2, 2, 1, None) == [1, 1]
    assert stride_widths(6, 1) == [1] * 6
    units, split = backward_units(8, 2, 16, 2, 1, 1)
    assert split == 1 and [u.heads for u in units] == [1, 1, 2, 2, 1, 1]
    assert units[-1].h1 == 8 and all(u.pieces == 2 for u in units)
    # one KV head: sequence units
    units, split = backward_units(1, 2, 6, 1, None, None)
    assert split == 1 and [(u.p0, u.p1) for u in units] == [(0, 1), (1, 2)]
    units, split = backward_units(1, 1, 6, 1, None, None)
    assert split == 2 and [(u.p0, u.p1) for u in units] == [(0, 1), (1, 2)]
    units, split = backward_units(1, 1, 5, 1, None, None)
    assert split == 1 and [(u.p0, u.p1) for u in units] == [(0, 1)]


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_backward_hop_dtypes(layout, causal):
    """Pure rank arithmetic of the ring backward's accumulator hops, P = 2 … 16: both ends of
    every hop agree on its dtype; a 16-bit hop carries at most one kernel output (simulated by
    counting contributions along each block's path); P = 2 zigzag causal sends 16-bit."""
    from sp_attention.softmax.bwd_ring import hop_dtypes
    from sp_attention.softmax.plan import ring_calls
    lo, hi = torch.bfloat16, torch.float32
    for P in range(2, 17):
        table = [hop_dtypes(r, P, layout, causal, lo, hi) for r in range(P)]
        for r in range(P):
            sent, got = table[r]
            assert len(sent) == len(got) == P - 1
            assert got == table[(r - 1) % P][0]       # what r receives is what r - 1 sends
        for blk in range(P):                          # follow block blk's accumulator
            outputs = 0
            for s in range(1, P):
                r = (blk + s) % P                     # its visitor at step s
                outputs += len(ring_calls(r, blk, P, layout, causal))
                if table[r][0][s - 1] == lo:
                    assert outputs <= 1, (P, blk, s)
    assert hop_dtypes(0, 2, "zigzag", True, lo, hi) == ([lo], [lo])


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_backward_hop_chunks(layout, causal):
    """The rows each accumulator hop carries, P = 2 … 16: both ends agree; a hop covers exactly
    the longest key prefix any visitor of its block has read so far (0: nothing read, no
    message); P = 2 zigzag causal: rank 1 returns one chunk, rank 0 both; contiguous causal:
    rank 0 sends nothing."""
    from sp_attention.softmax.bwd_ring import hop_chunks
    from sp_attention.softmax.plan import ring_calls
    for P in range(2, 17):
        table = [hop_chunks(r, P, layout, causal) for r in range(P)]
        for r in range(P):
            sent, got = table[r]
            assert len(sent) == len(got) == P - 1 and got == table[(r - 1) % P][0]
        for blk in range(P):
            covered = 0
            for s in range(1, P):
                r = (blk + s) % P
                covered = max([covered] + [c.keys for c in ring_calls(r, blk, P, layout, causal)])
                assert table[r][0][s - 1] == covered, (P, blk, s)
    if causal:
        want = {"zigzag": ([2], [1]), "contiguous": ([0], [1])}[layout]
        assert hop_chunks(0, 2, layout, True) == want

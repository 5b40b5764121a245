"""Pure arithmetic of packed softmax (sp_attention/softmax/packed_plan.py), no processes:
for random packed rows at P = 1 … 12, both layouts, every (query, key) pair a query may see
(same document, key not after the query) is computed exactly once over the own-block and
cross-rank calls, nothing else is; calls are valid varlen problems; only travel windows
travel; the ring stops after the last step with work."""
import random

import pytest

from sp_attention import plan_packing
from sp_attention import SoftmaxTuning
from sp_attention.planning.softmax_packed import (DENSE_MIN, DENSE_MIN_SMALL_WORK,
                                                  SMALL_WORK_FLOP, CallPolicy, Pair,
                                                  active_steps, auto_dense_min, group_calls,
                                                  own_calls, step_calls, step_pairs, travel)
from tests.test_packing import _random_lengths, _cu


def _check_call(call, q_limit, k_limit):
    prev = None
    for p in call.pairs:
        assert p.q_len > 0 and p.k_len > 0
        assert 0 <= p.q_start and p.q_stop <= q_limit and 0 <= p.k_start and p.k_stop <= k_limit
        if prev is not None:
            assert p.q_start >= prev.q_stop and p.k_start >= prev.k_stop
        if call.causal:
            assert p.q_len == p.k_len
        prev = p


def _visible(plan):
    """Ground truth: {(rank, q_row, src, k_row)} with k's token visible to q's token."""
    where = {}
    for r, segs in enumerate(plan.segments):
        for s in segs:
            for i in range(s.length):
                where[s.start + i] = (r, s.local_start + i, s.doc)
    out = set()
    cu = plan.cu_seqlens
    for d in range(plan.num_docs):
        for tq in range(cu[d], cu[d + 1]):
            for tk in range(cu[d], tq + 1):
                rq, iq, _ = where[tq]
                rk, ik, _ = where[tk]
                out.add((rq, iq, rk, ik))
    return out


def _computed(plan, dense_min, gaps=True):
    tr = travel(plan)
    got = []
    for r in range(plan.world_size):
        for c in own_calls(plan, r, CallPolicy(dense_min, gaps)):
            _check_call(c, plan.local_len, plan.local_len)
            for p in c.pairs:
                for i in range(p.q_len):
                    for j in range(p.k_len):
                        if j <= i + p.k_len - p.q_len:           # bottom-right causal
                            got.append((r, p.q_start + i, r, p.k_start + j))
        for s in range(1, plan.world_size):
            src = (r - s) % plan.world_size
            calls = step_calls(plan, r, src, CallPolicy(dense_min, gaps))
            if s > active_steps(plan):
                assert calls == ()
            for c in calls:
                assert not c.causal
                _check_call(c, plan.local_len, tr.length)
                for p in c.pairs:
                    for i in range(p.q_len):
                        for j in range(p.k_len):
                            got.append((r, p.q_start + i, src, tr.starts[src] + p.k_start + j))
    return got


@pytest.mark.parametrize("seed", range(3))
def test_every_visible_pair_once(seed):
    rng = random.Random(seed)
    for _ in range(25):
        P = rng.randint(1, 12)
        layout = rng.choice(["zigzag", "contiguous"])
        total = rng.randint(1, 24 * P)
        cu = _cu(_random_lengths(rng, total, rng.choice(["lognormal", "tiny", "uniform"])))
        plan = plan_packing(cu, P, layout=layout, row_len=total + rng.randint(0, 3))
        want = _visible(plan)
        for dense_min, gaps in ((1, True), (30, True), (10 ** 9, True), (10 ** 9, False)):
            got = _computed(plan, dense_min, gaps)
            assert len(got) == len(set(got)), "a (query, key) pair computed twice"
            assert set(got) == want


def test_travel_windows():
    # one document over every rank (zigzag pieces r, 2P-1-r): the whole shard travels, as
    # in the unpacked ring (rank 0's late piece is seen by nobody else, but it is in its span)
    plan = plan_packing([0, 64], 4)
    tr = travel(plan)
    assert tr.starts == (0, 0, 0, 0) and tr.length == 16
    assert active_steps(plan) == 3
    # contiguous: a suffix (the document continuing on the next rank)
    plan = plan_packing([0, 5, 30, 40, 80], 8, layout="contiguous")   # 10 tokens per rank
    tr = travel(plan)
    assert tr.length == 10 and tr.starts == (0, 0, 0, 0, 0, 0, 0, 0)   # d1 fills rank 1
    plan = plan_packing([0, 5, 14, 80], 8, layout="contiguous")
    assert travel(plan).length == 10 and active_steps(plan) == 6     # d2 spans ranks 1 .. 7
    plan = plan_packing([0, 5, 9, 80], 8, layout="contiguous")         # d2 starts rank 1
    tr = travel(plan)
    assert tr.starts[0] == 0 and tr.length == 10
    plan = plan_packing([0, 5, 14, 20, 80], 8, layout="contiguous")
    assert active_steps(plan) == 5                         # d3 spans ranks 2 .. 7
    plan = plan_packing([0, 2, 13, 80], 8, layout="contiguous")
    tr = travel(plan)                                      # rank 0 ships d1[0:8], rows 2 .. 9
    assert tr.length == 10 and tr.starts[0] == 0
    # no crossing document: nothing travels, no ring
    plan = plan_packing(_cu([8] * 8), 4)
    assert travel(plan).length == 0 and active_steps(plan) == 0


def test_zigzag_document_pairs():
    """One document, zigzag: the unpacked ring's pattern (plan.ring_calls)."""
    plan = plan_packing([0, 64], 4)
    # from a lower rank: both local pieces see the source's first piece
    assert step_pairs(plan, 2, 1) == (Pair(0, 16, 0, 8),)
    # from a higher rank: the late piece sees the whole block
    assert step_pairs(plan, 1, 3) == (Pair(8, 8, 0, 16),)


def test_group_calls():
    pairs = (Pair(0, 2, 0, 2), Pair(2, 40, 2, 40), Pair(42, 3, 42, 3), Pair(45, 1, 44, 2))
    calls = group_calls(pairs, False, 1000)           # 40 x 40 dense; 44.. overlaps 42..45
    assert [c.pairs for c in calls] == [pairs[:1], pairs[1:2], pairs[2:3], pairs[3:]]
    assert calls[1].dense and not calls[0].causal
    calls = group_calls(pairs, False, 10 ** 9)      # keys 44.. overlap 42..45: a new call
    assert [len(c.pairs) for c in calls] == [3, 1]
    gapped = (Pair(0, 2, 0, 2), Pair(5, 2, 2, 3), Pair(7, 1, 9, 1))
    assert len(group_calls(gapped, False, 10 ** 9)) == 1
    assert [len(c.pairs) for c in group_calls(gapped, False, 10 ** 9, gaps=False)] == [1, 1, 1]
    assert calls[0].relative()[1] == Pair(2, 40, 2, 40) and calls[1].relative() == (
        Pair(0, 1, 0, 2),)


def test_auto_dense_min_follows_a_ranks_share_of_the_work():
    """packed_dense_min=None: few large varlen calls when a rank's share of the row's causal
    forward is small (its calls' host time is the step), dense calls from 1K documents when it
    is large; the rule reads the global row only (every rank and schedule picks alike)."""
    small = tuple(range(0, 32768 + 1, 1024))          # 32 documents of 1K, P = 4

    assert auto_dense_min(small, 4, 32, 128) == DENSE_MIN_SMALL_WORK
    big = tuple(range(0, 131072 + 1, 8192))          # 16 documents of 8K
    assert auto_dense_min(big, 4, 32, 128) == DENSE_MIN
    # the line: a rank's share of 4 · Σ len²/2 · H · D against SMALL_WORK_FLOP
    n = 8192
    flop_one = 4 * n * n / 2 * 32 * 128
    docs = int(SMALL_WORK_FLOP // flop_one) + 1     # just over the line on one rank
    row = tuple(i * n for i in range(docs + 1))
    assert auto_dense_min(row, 1, 32, 128) == DENSE_MIN
    assert auto_dense_min(row, 2, 32, 128) == DENSE_MIN_SMALL_WORK    # half each: under
    assert auto_dense_min(row, 1, 16, 128) == DENSE_MIN_SMALL_WORK    # half the heads: under
    assert DENSE_MIN < DENSE_MIN_SMALL_WORK


def test_packed_dense_min_default_is_auto_and_checked():
    assert SoftmaxTuning().packed_dense_min is None
    assert SoftmaxTuning(packed_dense_min=7).packed_dense_min == 7
    for bad in (0, -1, 2.5, "1"):
        with pytest.raises(ValueError, match="packed_dense_min must be a positive int or None"):
            SoftmaxTuning(packed_dense_min=bad)

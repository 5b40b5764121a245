"""Pure arithmetic of the all-to-all schedules (sp_attention/planning/softmax_a2a.py), no processes:
the heads every position takes (any H, Hkv, U: every query head once, its KV head in its slot,
replication only where Hkv does not split), the token order after the exchange (P up to 32,
both layouts: the ring rank's chunks, balanced zigzag), and the packed documents' plan of the
groups (random rows, P up to 12: the packed schedules' invariants hold and every visible
(query, key) pair is computed exactly once, each token where the exchange puts it)."""
import random

import pytest

from sp_attention import plan_packing
from sp_attention.planning.layout import leaves_of_rank, num_chunks
from sp_attention.planning.softmax_a2a import (GroupedPlan, arrival_order, grouped_plan,
                                           head_split)
from tests.softmax.test_packed_plan import _computed, _visible
from tests.test_packing import _cu, _random_lengths


def test_head_split_every_shape():
    for U in range(1, 9):
        for Hkv in range(1, 13):
            for G in (1, 2, 3, 4, 8):
                H = Hkv * G
                if H % U:
                    continue
                s = head_split(H, Hkv, U)
                a = s.q_per_rank
                owners: dict = {}
                for u in range(U):
                    assert len(s.kv_heads_of[u]) == s.kv_slots and len(s.q_to_slot[u]) == a
                    for i in range(a):        # query head u·a + i reads its own KV head
                        slot = s.q_to_slot[u][i]
                        assert slot < s.kv_count[u]
                        assert s.kv_heads_of[u][slot] == (u * a + i) // G
                    for j in range(s.kv_count[u]):
                        owners.setdefault(s.kv_heads_of[u][j], set()).add(u)
                assert sorted(owners) == list(range(Hkv))     # every KV head reaches a user
                assert s.disjoint == all(len(o) == 1 for o in owners.values())
                assert s.disjoint == (Hkv % U == 0)
                if s.native:   # plain GQA over the slots: query head i reads slot i // group
                    g = a // s.kv_slots
                    assert all(s.q_to_slot[u][i] == i // g for u in range(U) for i in range(a))
                    assert all(c == s.kv_slots for c in s.kv_count)


def test_head_split_examples():
    s = head_split(32, 8, 4)                  # Llama-3-8B on 4 ranks: 2 KV heads each
    assert s.disjoint and s.native and s.kv_slots == 2 and s.kv_heads_of[3] == (6, 7)
    s = head_split(32, 2, 4)                  # Hkv < P: each KV head replicated to 2 ranks
    assert not s.disjoint and s.native and s.kv_slots == 1
    assert [h[0] for h in s.kv_heads_of] == [0, 0, 1, 1]
    s = head_split(12, 3, 4)                  # straddling: 1, 2, 2, 1 KV heads, padded to 2
    assert not s.native and s.kv_count == (1, 2, 2, 1) and s.kv_heads_of[0] == (0, 0)
    with pytest.raises(ValueError, match="do not split"):
        head_split(12, 3, 5)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_arrival_order_gives_the_ring_ranks_chunks(layout):
    for P in range(1, 33):
        n = num_chunks(P, layout)
        for U in (d for d in range(1, P + 1) if P % d == 0):
            R = P // U
            m = n // num_chunks(R, layout)
            work = set()
            for g in range(R):
                order = arrival_order(layout, P, U, g)
                arrived = [c for u in range(U) for c in leaves_of_rank(g * U + u, P, layout)]
                got = [arrived[i] for i in order]
                want = [p * m + j for p in leaves_of_rank(g, R, layout) for j in range(m)]
                assert got == want, (P, U, g)
                # causal work of the group as one ring rank: the zigzag balance carries over
                work.add(sum(c + 1 for c in got))
                if R == 1:
                    assert got == list(range(n))            # the global order
            if layout == "zigzag":
                assert len(work) == 1, (P, U, work)
            if layout == "contiguous" or U == 1:
                assert all(arrival_order(layout, P, U, g) == tuple(range(len(got)))
                           for g in range(R))


@pytest.mark.parametrize("seed", range(3))
def test_grouped_plan_invariants_and_pairs(seed):
    rng = random.Random(seed)
    for _ in range(20):
        P = rng.randint(1, 12)
        U = rng.choice([d for d in range(1, P + 1) if P % d == 0])
        layout = rng.choice(["zigzag", "contiguous"])
        total = rng.randint(1, 24 * P)
        cu = _cu(_random_lengths(rng, total, rng.choice(["lognormal", "tiny", "uniform"])))
        plan = plan_packing(cu, P, layout=layout, row_len=total + rng.randint(0, 3))
        gp = grouped_plan(plan, U)
        assert isinstance(gp, GroupedPlan) and gp.world_size == P // U
        assert gp != plan_packing(cu, P // U, layout=layout, row_len=plan.row_len)
        L = plan.local_len
        for g, segs in enumerate(gp.segments):
            local = 0
            seen_docs, padding = [], False
            for s, (arr, n) in zip(segs, gp.runs[g]):
                assert s.local_start == local and s.length == n
                local += n
                u, t = divmod(arr, L)          # the exchange puts these tokens here
                src = [x for x in plan.segments[g * U + u] if x.local_start <= t < x.local_stop]
                assert src and src[0].start + t - src[0].local_start == s.start
                if s.doc < 0:
                    padding = True
                    continue
                assert not padding, "padding last"
                if seen_docs and seen_docs[-1][0] == s.doc:     # consecutive, ascending
                    assert s.start >= seen_docs[-1][1]
                else:
                    assert s.doc not in [d for d, _ in seen_docs]
                seen_docs.append((s.doc, s.stop))
            assert local == U * L
        want = _visible(gp)
        for dense_min in (1, 30, 10 ** 9):
            got = _computed(gp, dense_min)
            assert len(got) == len(set(got)) and set(got) == want

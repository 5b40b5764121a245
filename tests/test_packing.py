"""The packing plan (sp_attention/packing.py): pure arithmetic, no processes.

Invariants for many random rows at P = 1 … 16, both layouts; the named cases of issue 24;
shard / unshard / positions / labels against direct per-token definitions; bad boundaries.
"""
import math
import random

import pytest
import torch

from sp_attention import SPContext, plan_packing, shard_sequence
from sp_attention.planning.layout import shard_ranges
from sp_attention.planning.packing import PackingPlan, causal_work, resolve_plan


def _cu(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _random_lengths(rng, total, kind):
    out, tot = [], 0
    while tot < total:
        if kind == "lognormal":
            n = int(rng.lognormvariate(math.log(max(2, total // 12)), 1.2))
        elif kind == "tiny":
            n = rng.randint(1, 4)
        else:
            n = rng.randint(1, total)
        n = max(1, min(total - tot, n))
        out.append(n)
        tot += n
    return out


def check_invariants(plan: PackingPlan):
    """Every property a consumer may rely on (module doc of sp_attention.planning.packing)."""
    P, L, cu = plan.world_size, plan.local_len, plan.cu_seqlens
    n_chunks = 2 * P if plan.layout == "zigzag" else P
    assert L == -(-plan.row_len // n_chunks) * (n_chunks // P)
    assert P * L >= plan.row_len >= cu[-1]
    owner = [None] * (P * L)
    for r, segs in enumerate(plan.segments):
        pos = 0
        seen_docs = []
        for s in segs:
            assert s.length > 0 and s.local_start == pos
            pos += s.length
            if s.doc >= 0:
                assert cu[s.doc] <= s.start and s.stop <= cu[s.doc + 1], s
            else:
                assert cu[-1] <= s.start and s.stop <= P * L, s
            for t in range(s.start, s.stop):
                assert owner[t] is None, f"token {t} held twice"
                owner[t] = (r, s.local_start + t - s.start)
            seen_docs.append(s.doc)
        assert pos == L, f"rank {r} holds {pos} tokens, not {L}"
        # invariant 1: one document's segments are consecutive locally, ascending globally
        runs = [d for i, d in enumerate(seen_docs) if i == 0 or seen_docs[i - 1] != d]
        assert len(runs) == len(set(runs)), f"rank {r}: a document's segments are split {runs}"
        for d in set(seen_docs):
            starts = [s.start for s in segs if s.doc == d]
            assert starts == sorted(starts)
        # padding last
        docs = [s.doc for s in segs]
        if -1 in docs:
            assert docs.index(-1) == len(docs) - 1
        if plan.layout == "zigzag":      # invariant 2: crossing docs first, whole next
            real = [s.doc for s in segs if s.doc >= 0]
            kinds = [plan.is_crossing(d) for d in real]
            assert kinds == sorted(kinds, reverse=True), f"rank {r}: crossing docs not first"
            key = [(-(cu[d + 1] - cu[d]), d) for d in real]      # longest first
            cross = [x for x, d in zip(key, real) if plan.is_crossing(d)]
            whole = [x for x, d in zip(key, real) if not plan.is_crossing(d)]
            assert cross == sorted(cross) and whole == sorted(whole)
        else:                            # contiguous: one global range in order
            assert [s.start for s in segs] == sorted(s.start for s in segs)
            assert segs[0].start == r * L and segs[-1].stop == (r + 1) * L
            assert all(a.stop == b.start for a, b in zip(segs, segs[1:]))
        # local boundaries: one group per document, padding excluded
        lcu = plan.local_cu_seqlens(r)
        assert lcu[0] == 0 and lcu[-1] == plan.real_len(r)
        assert len(lcu) - 1 == len(set(d for d in seen_docs if d >= 0))
        assert L - plan.real_len(r) == sum(s.length for s in segs if s.doc < 0)
        scu = plan.segment_cu_seqlens(r)
        assert scu[-1] == plan.real_len(r) and len(scu) - 1 == sum(s.doc >= 0 for s in segs)
        for s in segs:
            if s.doc >= 0:
                assert plan.offset_in_doc(s) == s.start - cu[s.doc]
    assert all(o is not None for o in owner), "a token of the padded row is held by no rank"
    # crossing documents and their pieces
    for d in range(plan.num_docs):
        pieces = plan.doc_pieces[d]
        assert sum(s.length for _, s in pieces) == cu[d + 1] - cu[d]
        assert [s.start for _, s in pieces] == sorted(s.start for _, s in pieces)
        assert plan.is_crossing(d) == (len({r for r, _ in pieces}) > 1)
    assert plan.padding == P * L - cu[-1]
    return owner


def _rows(seed, count):
    rng = random.Random(seed)
    for i in range(count):
        P = rng.randint(1, 16)
        layout = rng.choice(["zigzag", "contiguous"])
        total = rng.randint(1, 40 * P)
        kind = rng.choice(["lognormal", "tiny", "uniform"])
        lengths = _random_lengths(rng, total, kind)
        row_len = total + (rng.randint(0, 5) if i % 3 == 0 else 0)
        yield P, layout, _cu(lengths), row_len


@pytest.mark.parametrize("seed", range(4))
def test_invariants_random_rows(seed):
    for P, layout, cu, row_len in _rows(seed, 60):
        plan = plan_packing(cu, P, layout=layout, row_len=row_len)
        check_invariants(plan)


def test_data_helpers_random_rows():
    for P, layout, cu, row_len in _rows(7, 30):
        plan = plan_packing(cu, P, layout=layout, row_len=row_len)
        x = torch.arange(row_len, dtype=torch.float64).view(1, row_len, 1) + 1
        shards = [plan.shard(x, r, dim=1) for r in range(P)]
        assert all(s.shape == (1, plan.local_len, 1) for s in shards)
        torch.testing.assert_close(plan.unshard(shards, dim=1), x)
        doc_of = [-1] * (P * plan.local_len)
        for d in range(plan.num_docs):
            for t in range(cu[d], cu[d + 1]):
                doc_of[t] = d
        for r in range(P):
            g = plan.global_index(r).tolist()
            got = shards[r].view(-1).tolist()
            assert got == [t + 1.0 if t < row_len else 0.0 for t in g]       # plan pad = 0
            pos = plan.position_ids(r).tolist()
            assert pos == [t - cu[doc_of[t]] if doc_of[t] >= 0 else 0 for t in g]
            assert plan.doc_ids(r).tolist() == [doc_of[t] for t in g]
        labels = torch.arange(row_len).view(1, row_len) + 100
        shifted = plan.shift_labels(labels, ignore_index=-7)
        want = [t + 101 if t + 1 < row_len and doc_of[t] >= 0 and doc_of[t + 1] == doc_of[t]
                else -7 for t in range(row_len)]
        assert shifted.view(-1).tolist() == want


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_one_document_is_the_unpacked_layout(layout):
    for P in range(1, 17):
        T = 2 * P * 3
        plan = plan_packing([0, T], P, layout=layout)
        check_invariants(plan)
        assert plan.is_trivial
        x = torch.randn(2, T, 3)
        ctx = SPContext(None, 0, 1, layout=layout) if P == 1 else None
        for r in range(P):
            ranges = shard_ranges(r, P, T, layout)
            idx = torch.cat([torch.arange(a, b) for a, b in ranges])
            torch.testing.assert_close(plan.shard(x, r), x[:, idx])
            assert plan.position_ids(r).tolist() == idx.tolist()
        if ctx is not None:
            torch.testing.assert_close(plan.shard(x, 0), shard_sequence(x, ctx))
    # not trivial: several documents, a row ending in padding, a length the layout cannot split
    assert not plan_packing([0, 8, 16], 2).is_trivial
    assert not plan_packing([0, 12], 2, row_len=16).is_trivial
    assert not plan_packing([0, 14], 2).is_trivial


def test_named_cases():
    P = 4
    # a boundary exactly at a shard edge and at a leaf (zigzag chunk) edge
    for layout in ("zigzag", "contiguous"):
        for cu in ([0, 64, 128, 256], [0, 32, 64, 96, 256], [0, 1, 2, 3, 256]):
            check_invariants(plan_packing(cu, P, layout=layout))
    # contiguous: boundaries at shard edges make no crossing document
    assert plan_packing([0, 64, 128, 192, 256], P, layout="contiguous").crossing_docs == ()
    # documents shorter than a chunk (64) and a leaf; single-token documents
    plan = plan_packing(_cu([3, 1, 1, 60, 1, 190]), P)
    check_invariants(plan)
    # one document spanning all ranks, among short ones
    plan = plan_packing(_cu([5, 300, 7, 8]), P)
    check_invariants(plan)
    assert {r for r, _ in plan.doc_pieces[1]} == set(range(P))
    # a rank holding only whole documents (rank 1 of 2, contiguous boundary at the edge)
    plan = plan_packing(_cu([64, 16, 16, 32]), 2, layout="contiguous")
    assert plan.crossing_segments(1) == () and plan.crossing_docs == ()
    plan = plan_packing(_cu([10] * 32), 4)
    check_invariants(plan)
    assert plan.crossing_docs == ()         # 32 equal short documents: all whole, balanced
    w = plan.rank_work()
    assert max(w) == min(w)
    # a row ending in padding; a rank holding only padding
    plan = plan_packing([0, 10, 30], P, layout="contiguous", row_len=128)
    check_invariants(plan)
    assert plan.real_len(3) == 0 and plan.local_cu_seqlens(3) == (0,)
    plan = plan_packing([0, 3], 4)
    check_invariants(plan)
    assert sum(plan.real_len(r) == 0 for r in range(4)) >= 2
    # hundreds of tiny documents
    plan = plan_packing(_cu([1, 2, 3] * 100), 8)
    check_invariants(plan)
    assert plan.padding <= 2 * 8 - 1


def test_balance_realistic_rows():
    """Log-normal documents (median 1K, tail to the whole row): max / mean causal work within
    1.05, padding within 2 %, short documents whole (the full table: packing_balance.py)."""
    rng = random.Random(3)
    for T, P in ((32768, 2), (32768, 8), (131072, 4), (131072, 16)):
        lengths = []
        while sum(lengths) < T:
            lengths.append(max(1, min(T - sum(lengths),
                                      int(rng.lognormvariate(math.log(1024), 1.2)))))
        plan = plan_packing(_cu(lengths), P)
        w = plan.rank_work()
        assert max(w) / (sum(w) / P) <= 1.05
        assert plan.padding <= 0.02 * T
        assert len(plan.crossing_docs) < len(lengths)


def test_cache_and_inputs():
    cu = [0, 5, 9, 40]
    a = plan_packing(cu, 3)
    assert plan_packing(torch.tensor(cu, dtype=torch.int32), 3) is a
    assert plan_packing(torch.tensor(cu, dtype=torch.int64), 3) == a
    assert hash(a) == hash(plan_packing(tuple(cu), 3)) and len(a.digest) == 16
    assert plan_packing(cu, 3, layout="contiguous") != a
    assert plan_packing(cu, 3, row_len=41) != a
    ctx = SPContext(None, 0, 1, layout="zigzag")
    t = torch.tensor([0, 5, 9, 40])
    p1 = resolve_plan(t, ctx, 40)
    assert resolve_plan(t, ctx, 40) is p1
    t[2] = 8                                         # in-place change: a new plan
    assert resolve_plan(t, ctx, 40).cu_seqlens == (0, 5, 8, 40)
    assert resolve_plan(p1, ctx, 40) is p1


def test_causal_work():
    for off in range(4):
        for n in range(1, 6):
            assert causal_work(off, n) == sum(off + i + 1 for i in range(n))


@pytest.mark.parametrize("bad, err, match", [
    ([0, 5, 3, 9], ValueError, "strictly increasing"),        # unsorted
    ([0, 5, 5, 9], ValueError, "length 0"),                    # empty document
    ([1, 5, 9], ValueError, "start at 0"),
    ([0], ValueError, "at least two"),
    (torch.tensor([0.0, 4.0]), TypeError, "int32 or int64"),
    (torch.tensor([[0, 4]]), ValueError, "1-D"),
    ("0,4", TypeError, "tensor"),
    ([0, 2.5], TypeError, "ints"),
])
def test_bad_boundaries(bad, err, match):
    with pytest.raises(err, match=match):
        plan_packing(bad, 2)


def test_bad_plan_use():
    with pytest.raises(ValueError, match="past the row length"):
        plan_packing([0, 10], 2, row_len=8)
    with pytest.raises(ValueError, match="contradicts"):
        plan_packing([0, 8], SPContext(None, 0, 1, layout="zigzag"), layout="contiguous")
    ctx = SPContext(None, 0, 1, layout="zigzag")
    with pytest.raises(ValueError, match="T_local = 6"):          # not the row's length
        resolve_plan(torch.tensor([0, 8]), ctx, 6)
    with pytest.raises(ValueError, match="built for 2 ranks"):
        resolve_plan(plan_packing([0, 8], 2), ctx, 4)
    with pytest.raises(ValueError, match="on meta but q is on cpu"):
        resolve_plan(torch.tensor([0, 8], device="meta"), ctx, 8, device="cpu")
    plan = plan_packing([0, 8], 2)
    with pytest.raises(ValueError, match="row_len = 8"):
        plan.shard(torch.zeros(1, 9), 0)
    with pytest.raises(ValueError, match="2 shards"):
        plan.unshard([torch.zeros(1, 4)])


def test_balance_benchmark_runs(tmp_path, capsys):
    """benchmarks/packing_balance.py end to end on small rows (the table's logic)."""
    from benchmarks import packing_balance as pb
    out, md = tmp_path / "b.jsonl", tmp_path / "b.md"
    rows = pb.main(["--rows", "4096", "--worlds", "2", "4", "--draws", "2", "--out", str(out),
                    "--table", str(md)])
    assert len(rows) == (2 * 2 + 2 + 2) * 3 and out.read_text().count("\n") == len(rows)
    te = [r for r in rows if r["layout"] == "te_2p" and r["kind"] == "tiny32"]
    assert all(r["scan_elems"] == 2 * 4096 // 32 for r in te)          # every document cut
    one = [r for r in rows if r["kind"] == "one_doc" and r["layout"] == "zigzag"]
    assert all(r["imbalance"] == 1.0 and r["padding"] == 0 and r["scan_elems"] == 2
               for r in one)
    assert "| lognormal | 4K | 4 |" in md.read_text()

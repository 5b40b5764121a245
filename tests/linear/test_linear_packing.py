"""The linear view of a packing plan (pure arithmetic, no processes): local sequences, scan
elements only for crossing segments, and a scalar simulation showing that the scan over those
elements (a document's first segment: A = 0, d = 0) gives every segment the state entering it
and the gradient arriving at its end, with nothing leaking between documents."""
from __future__ import annotations

import random

import pytest

from sp_attention.planning.linear_packed import linear_packing
from sp_attention.planning.packing import plan_packing


def _rows(seed: int, n: int = 25):
    rnd = random.Random(seed)
    for _ in range(n):
        kind = rnd.choice(["tiny", "mixed", "long"])
        docs = {"tiny": lambda: rnd.randint(1, 3), "mixed": lambda: rnd.randint(1, 90),
                "long": lambda: rnd.randint(40, 400)}[kind]
        lengths = [docs() for _ in range(rnd.randint(1, 30))]
        cu = [0]
        for x in lengths:
            cu.append(cu[-1] + x)
        yield cu, cu[-1] + rnd.choice([0, 0, 5])


def _doc_of(cu, t):
    return max(i for i in range(len(cu) - 1) if cu[i] <= t)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_pieces_and_elements(layout):
    """Pieces are the plan's document segments in local order, tiling [0, real_len); scan
    positions are every crossing segment once, in global order, with their holders; a
    position starts its document iff its segment does; contiguous ranks hold ≤ 2 elements."""
    for cu, row in _rows(1):
        for P in (1, 2, 3, 5, 8):
            plan = plan_packing(cu, P, layout=layout, row_len=row)
            views = [linear_packing(plan, r) for r in range(P)]
            starts = []
            for r, lp in enumerate(views):
                segs = [s for s in plan.segments[r] if s.doc >= 0]
                assert [(p.local_start, p.length, p.doc) for p in lp.pieces] == \
                    [(s.local_start, s.length, s.doc) for s in segs]
                assert lp.cu_seqlens[-1] == lp.real_len == plan.real_len(r)
                for p, s in zip(lp.pieces, segs):
                    assert p.crossing == plan.is_crossing(s.doc)
                    assert p.first == (s.start == cu[s.doc])
                    if p.crossing:
                        assert lp.holders[p.position] == r
                        assert lp.first[p.position] == p.first
                        starts.append((s.start, p.position))
                if layout == "contiguous":
                    assert len(lp.crossing) <= 2
                # the scans take a rank's elements in global order
                assert [p.position for p in lp.crossing] == sorted(p.position for p in lp.crossing)
            assert sorted(pos for _, pos in starts) == list(range(views[0].num_elements))
            assert [pos for _, pos in sorted(starts)] == list(range(len(starts)))
            assert all(v.holders == views[0].holders for v in views)


def _simulate(cu, row, plan, seed):
    """Scalar model of one head: S_t = a_t S_{t−1} + x_t (S = 0 before a document's first
    token), loss Σ_t w_t S_t. Per crossing segment, compare the serial exclusive scan of the
    elements (A, b) / reverse scan of (A, d) with the true incoming state / arriving gradient."""
    rnd = random.Random(seed)
    T = cu[-1]
    a = [rnd.choice([0.0, 1e-30, rnd.random()]) for _ in range(T)]    # incl. underflow
    x = [rnd.uniform(-1, 1) for _ in range(T)]
    w = [rnd.uniform(-1, 1) for _ in range(T)]
    S, state_before = 0.0, []
    for t in range(T):
        if t in cu:
            S = 0.0
        state_before.append(S)
        S = a[t] * S + x[t]
    grad_after = [0.0] * T          # dL/dS_t through later tokens of the same document
    G = 0.0
    for t in reversed(range(T)):
        grad_after[t] = G
        G = (w[t] + G) * a[t] if t not in cu else 0.0
    lp = linear_packing(plan, 0)
    segs = sorted(((s.start, s) for segs in plan.segments for s in segs
                   if s.doc >= 0 and plan.is_crossing(s.doc)), key=lambda z: z[0])
    A, b, d = [], [], []
    for pos, (_, s) in enumerate(segs):
        first = lp.first[pos]
        prod, st, dd, run = 1.0, 0.0, 0.0, 1.0
        for t in range(s.start, s.stop):
            prod *= a[t]
            st = a[t] * st + x[t]
            run *= a[t]
            dd += w[t] * run            # d: the weights of the incoming state in the loss
        A.append(0.0 if first else prod)
        b.append(st)
        d.append(0.0 if first else dd)
    n = len(segs)
    prefix, acc = [], 0.0
    for i in range(n):
        prefix.append(acc)
        acc = A[i] * acc + b[i]
    suffix, acc = [0.0] * n, 0.0
    for i in reversed(range(n)):
        suffix[i] = acc
        acc = d[i] + A[i] * acc
    for pos, (_, s) in enumerate(segs):
        if not lp.first[pos]:
            assert prefix[pos] == pytest.approx(state_before[s.start], abs=1e-12)
        # the gradient arriving at the segment's end, from later tokens of its document
        assert suffix[pos] == pytest.approx(grad_after[s.stop - 1], abs=1e-12)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_scan_over_crossing_segments_is_per_document(layout):
    for i, (cu, row) in enumerate(_rows(2, 15)):
        for P in (2, 3, 4, 7):
            _simulate(cu, row, plan_packing(cu, P, layout=layout, row_len=row), i)


def test_whole_documents_add_no_elements():
    """A rank's element count does not grow with the whole documents it holds."""
    base = [0, 500, 1000]
    tiny = base + [1000 + 3 * i for i in range(1, 200)]
    for layout in ("contiguous", "zigzag"):
        for cu in (base, tiny):
            plan = plan_packing(cu, 4, layout=layout)
            counts = [len(linear_packing(plan, r).crossing) for r in range(4)]
            assert max(counts) <= 2 * len(plan.crossing_docs), (layout, counts)
        few = plan_packing(base, 4, layout=layout)
        many = plan_packing(tiny, 4, layout=layout)
        assert linear_packing(many, 0).num_elements <= \
            linear_packing(few, 0).num_elements + 2 * 4, layout

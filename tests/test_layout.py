"""Pure rank arithmetic: layouts, neighbours and the tree-scan schedule, P = 1…64."""
import itertools

import pytest

from sp_attention.planning import layout as L


@pytest.mark.parametrize("P", range(1, 65))
def test_zigzag_and_contiguous_cover_sequence_once(P):
    for lay in ("zigzag", "contiguous"):
        n = L.num_chunks(P, lay)
        held = [c for r in range(P) for c in L.leaves_of_rank(r, P, lay)]
        assert sorted(held) == list(range(n))
        for c in range(n):
            assert c in L.leaves_of_rank(L.holder_of_leaf(c, P, lay), P, lay)
        T = n * 3
        tokens = sorted(t for r in range(P) for s, e in L.shard_ranges(r, P, T, lay)
                        for t in range(s, e))
        assert tokens == list(range(T))
    for r in range(P):
        a, b = L.zigzag_chunk_ids(r, P)
        assert a == r and b == 2 * P - 1 - r
        prev, nxt = L.ring_neighbors(r, P)
        assert L.ring_neighbors(nxt, P)[0] == r and L.ring_neighbors(prev, P)[1] == r
        assert L.ring_source(r, P, P) == r and L.ring_source(r, P, 1) == prev


def test_contiguous_range():
    assert L.contiguous_range(2, 4, 16) == (8, 12)


@pytest.mark.parametrize("bad", [0, -1, 2.0])
def test_bad_world_size(bad):
    with pytest.raises(ValueError, match="world size"):
        L.num_chunks(bad, "zigzag")


def test_bad_inputs_say_what_to_change():
    with pytest.raises(ValueError, match="pad it to a multiple of 8"):
        L.shard_ranges(0, 4, 12, "zigzag")
    with pytest.raises(ValueError, match="unknown layout"):
        L.leaves_of_rank(0, 2, "striped")
    with pytest.raises(ValueError, match="outside a group"):
        L.zigzag_chunk_ids(4, 4)


@pytest.mark.parametrize("num_leaves", range(1, 65))
def test_tree_scan_schedule_rounds_and_matching(num_leaves):
    s = L.tree_scan_schedule(num_leaves)
    depth = L.scan_depth(num_leaves)
    assert len(s.up) == len(s.down) == depth and s.num_rounds == 2 * depth
    for rnd in s.up + s.down:
        used = [p for pair in rnd for p in (pair.left, pair.right)]
        assert len(used) == len(set(used)), "a position takes part in two pairs of one round"
        for pair in rnd:
            assert 0 <= pair.left < pair.right < num_leaves


def _simulate(num_leaves, elems, op, identity):
    """Run the schedule on a list: up-sweep message left→right, down-sweep exchange."""
    s = L.tree_scan_schedule(num_leaves)
    x = list(elems)
    for rnd in s.up:
        sent = {p.right: x[p.left] for p in rnd}  # every send has exactly one receive
        for right, val in sent.items():
            x[right] = op(val, x[right])
    x[num_leaves - 1] = identity
    for rnd in s.down:
        new = {}
        for p in rnd:
            new[p.left] = x[p.right]
            new[p.right] = op(x[p.right], x[p.left])
        for k, v in new.items():
            x[k] = v
    return x


@pytest.mark.parametrize("num_leaves", range(1, 65))
def test_tree_scan_gives_exact_exclusive_prefix_and_suffix(num_leaves):
    # Non-commutative operator: string concatenation; and the linear-attention element on
    # scalars (A, b) ⊕ (A2, b2) = (A2·A, A2·b + b2) with exact rationals.
    names = [f"<{i}>" for i in range(num_leaves)]
    got = _simulate(num_leaves, names, lambda a, b: a + b, "")
    assert got == ["".join(names[:i]) for i in range(num_leaves)]
    from fractions import Fraction
    elems = [(Fraction(i + 2, i + 3), Fraction(2 * i - 5)) for i in range(num_leaves)]

    def op(e1, e2):
        return (e2[0] * e1[0], e2[0] * e1[1] + e2[1])
    for reverse in (False, True):
        order = [elems[L.scan_position(p, num_leaves, reverse)] for p in range(num_leaves)]
        got = _simulate(num_leaves, order, op, (Fraction(1), Fraction(0)))
        for pos in range(num_leaves):
            want = (Fraction(1), Fraction(0))
            for e in order[:pos]:
                want = op(want, e)
            assert got[pos] == want


def test_schedule_examples():
    s = L.tree_scan_schedule(6)
    assert [[(p.left, p.right) for p in r] for r in s.up] == [[(0, 1), (2, 3), (4, 5)],
                                                             [(1, 3)], [(3, 5)]]
    assert L.tree_scan_schedule(1).num_rounds == 0
    assert list(itertools.chain(*L.tree_scan_schedule(2).up)) == [L.ScanPair(0, 1)]

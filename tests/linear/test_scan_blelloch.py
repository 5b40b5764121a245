"""The tree scan's messages without processes: every rank runs ``blelloch_scan`` in a thread,
the exchange is a mailbox. Each round posts at most one message per peer and direction (the
elements for one peer travel packed: gloo's ``batch_isend_irecv`` has a slow mode with two
messages to one peer), the buffers' shapes match at both ends, and every leaf gets its exact
fp64 exclusive prefix / suffix, for both layouts, P = 1…8, and an explicit holder list (packed
documents) whose rounds put several pairs between the same two ranks."""
import queue
import threading

import pytest
import torch

from sp_attention.context import SPContext
from sp_attention.planning.layout import (holder_of_leaf, num_chunks, scan_position,
                                         tree_scan_rounds)
from sp_attention.linear import scan_blelloch
from sp_attention.linear.scan_common import Element

ELEMENT = 2 * 3 + 2 * 3 * 4 * 5        # numbers in one packed element (A [2, 3], b [2, 3, 4, 5])


def _round_messages(holder: list, pairs) -> set:
    """The messages ``(sender, receiver)`` a tree round must post: one per peer and direction
    (a down-sweep pair exchanges both ways; up and spine pairs send left to right only)."""
    msgs = set()
    for pr, kind in pairs:
        a, b = holder[pr.left], holder[pr.right]
        if a != b:
            msgs.add((a, b))
            if kind == "down":
                msgs.add((b, a))
    return msgs


def _run(world: int, layout: str, holders, reverse: bool, monkeypatch):
    L = len(holders) if holders is not None else num_chunks(world, layout)
    who = holders or tuple(holder_of_leaf(p, world, layout) for p in range(L))
    g = torch.Generator().manual_seed(L + world)
    A = [torch.rand(2, 3, generator=g, dtype=torch.float64) for _ in range(L)]
    b = [torch.randn(2, 3, 4, 5, generator=g, dtype=torch.float64) for _ in range(L)]
    boxes = {(s, d): queue.Queue() for s in range(world) for d in range(world)}
    calls = [[] for _ in range(world)]

    def exchange(sends, recvs, ctx):
        calls[ctx.rank].append(([p for _, p in sends], [p for _, p in recvs],
                                max((t.numel() // ELEMENT for t, _ in sends), default=0)))
        for t, peer in sends:
            boxes[(ctx.rank, peer)].put(t.clone())
        for t, peer in recvs:
            got = boxes[(peer, ctx.rank)].get(timeout=300)     # a hang detector
            assert got.shape == t.shape and got.dtype == t.dtype, (got.shape, t.shape)
            t.copy_(got)
        return []
    monkeypatch.setattr(scan_blelloch, "p2p_exchange", exchange)
    out, errors = {}, []

    def rank_main(r):
        try:
            ctx = SPContext(object() if world > 1 else None, r, world, layout=layout)
            mine = [p for p in range(L) if who[p] == r]
            res = scan_blelloch.blelloch_scan([A[p] for p in mine], [b[p] for p in mine], ctx,
                                              reverse=reverse, holders=holders)
            out.update(zip(mine, res))
        except BaseException as e:          # re-raised in the main thread
            errors.append(e)
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)     # a hang detector (a missing message raises after 300 s)
    if errors:
        raise errors[0]
    # the exact exclusive prefix (suffix) of every element, by a sequential fold
    order = range(L - 1, -1, -1) if reverse else range(L)
    acc = Element(torch.ones_like(A[0]), torch.zeros_like(b[0]))
    for p in order:
        assert torch.allclose(out[p], acc.b, rtol=1e-12, atol=1e-12), (world, layout, p)
        acc = acc.then(Element(A[p], b[p]))
    return calls


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", range(1, 9))
def test_one_message_per_peer_and_direction_per_round(world, layout, monkeypatch):
    most = 0
    L = num_chunks(world, layout)
    nested = layout == "zigzag" and world > 1
    # zigzag: a tree over the P ranks (three scans in its rounds: first-half elements by rank
    # ascending and descending, second-half elements descending), not over the 2P leaves
    rounds = tree_scan_rounds(world if nested else L)
    for reverse in (False, True):
        calls = _run(world, layout, None, reverse, monkeypatch)
        for sends, recvs, n in (c for rank in calls for c in rank):
            assert len(sends) == len(set(sends)) and len(recvs) == len(set(recvs))
            most = max(most, n)
        # one message per peer and direction, no more, no fewer
        if nested:
            holders = [list(range(world)), list(range(world - 1, -1, -1))]
        else:
            holders = [[holder_of_leaf(scan_position(p, L, reverse), world, layout)
                        for p in range(L)]]
        for r in range(world):
            assert len(calls[r]) == len(rounds) if r in holders[0] else not calls[r]
        for i, pairs in enumerate(rounds):
            msgs = set().union(*(_round_messages(h, pairs) for h in holders))
            for r in range(world):
                sends, recvs, _ = calls[r][i]
                assert sorted(sends) == sorted(b for a, b in msgs if a == r)
                assert sorted(recvs) == sorted(a for a, b in msgs if b == r)
    # zigzag: the scans' elements for one peer in a round travel as one message (X2 and X3
    # pair the same ranks: two, with X1's three)
    assert (2 <= most <= 3) if nested else most == (1 if world > 1 else 0)


def test_explicit_holders_pack_several_pairs_per_peer(monkeypatch):
    holders = (0, 1, 0, 1, 0, 1, 2, 2, 1, 0)        # rounds pair ranks 0 and 1 several times
    for reverse in (False, True):
        calls = _run(3, "contiguous", holders, reverse, monkeypatch)
        for rank in calls:
            for sends, recvs, _ in rank:
                assert len(sends) == len(set(sends)) and len(recvs) == len(set(recvs))
        assert max(n for rank in calls for _, _, n in rank) >= 2


def test_graph_replays_are_per_group_and_released_before_a_destroy():
    """A scan's CUDA graph holds its group's communicator: one graph per process group, and
    ``release_cuda_graphs`` (called before ``destroy_process_group``, which otherwise hangs on
    NCCL, pytorch/pytorch#115388) drops them all. Stand-ins for the graph and the groups."""
    import sp_attention
    from sp_attention.linear.scan_common import GraphReplay

    class Run:
        def __call__(self, A, b, ctx, *args):
            return b

    replay = GraphReplay(Run())
    group_a, group_b = object(), object()
    replay.states[group_a] = [3, object(), None]       # captured for group a
    replay.states[group_b] = [1, None, None]           # seen once, not captured
    assert sp_attention.release_cuda_graphs() == 1
    assert replay.states == {}
    assert sp_attention.release_cuda_graphs() == 0

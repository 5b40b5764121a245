"""The ring backward's pure rank arithmetic (``sp_attention/softmax/bwd_ring.py``): which dtype
and how many key chunks each accumulator hop carries, P = 2 … 16, no processes. Its numbers at
every rank: ``test_softmax_cp.py``."""
import pytest
import torch


@pytest.mark.parametrize("own_last", [False, True])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_backward_hop_dtypes(layout, causal, own_last):
    """Pure rank arithmetic of the ring backward's accumulator hops, P = 2 … 16, both orders:
    both ends of every hop agree on its dtype (the sender is the previous rank, own block last
    the next); a 16-bit hop carries at most one kernel output (simulated by counting
    contributions along each block's path); P = 2 zigzag causal sends 16-bit."""
    from sp_attention.softmax.bwd_ring import hop_dtypes, visit_steps
    from sp_attention.planning.softmax_plan import ring_calls
    lo, hi = torch.bfloat16, torch.float32
    sender = 1 if own_last else -1
    for P in range(2, 17):
        table = [hop_dtypes(r, P, layout, causal, lo, hi, own_last) for r in range(P)]
        for r in range(P):
            sent, got = table[r]
            assert len(sent) == len(got) == P - 1
            assert got == table[(r + sender) % P][0]  # what r receives is what its sender sends
        for blk in range(P):                          # follow block blk's accumulator
            outputs = 0
            for i, s in enumerate(visit_steps(P, own_last)):
                r = (blk + s) % P                     # its visitor at step s
                outputs += len(ring_calls(r, blk, P, layout, causal))
                if table[r][0][i] == lo:
                    assert outputs <= 1, (P, blk, s)
    assert hop_dtypes(0, 2, "zigzag", True, lo, hi, own_last) == ([lo], [lo])


@pytest.mark.parametrize("own_last", [False, True])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_backward_hop_chunks(layout, causal, own_last):
    """The rows each accumulator hop carries, P = 2 … 16, both orders: both ends agree; a hop
    covers exactly the longest key prefix any visitor of its block has read so far (0: nothing
    read, no message); P = 2 zigzag causal: rank 1 returns one chunk, rank 0 both; contiguous
    causal: rank 0 sends nothing."""
    from sp_attention.softmax.bwd_ring import hop_chunks, visit_steps
    from sp_attention.planning.softmax_plan import ring_calls
    sender = 1 if own_last else -1
    for P in range(2, 17):
        table = [hop_chunks(r, P, layout, causal, own_last) for r in range(P)]
        for r in range(P):
            sent, got = table[r]
            assert len(sent) == len(got) == P - 1 and got == table[(r + sender) % P][0]
        for blk in range(P):
            covered = 0
            for i, s in enumerate(visit_steps(P, own_last)):
                r = (blk + s) % P
                covered = max([covered] + [c.keys for c in ring_calls(r, blk, P, layout, causal)])
                assert table[r][0][i] == covered, (P, blk, s)
    if causal:
        want = {"zigzag": ([2], [1]), "contiguous": ([0], [1])}[layout]
        assert hop_chunks(0, 2, layout, True, own_last) == want


def test_visit_steps():
    """The remote blocks' order: steps 1 … P−1, or P−1 … 1 with the own block last."""
    from sp_attention.softmax.bwd_ring import visit_steps
    assert visit_steps(4, False) == (1, 2, 3) and visit_steps(4, True) == (3, 2, 1)
    assert visit_steps(2, True) == (1,) and visit_steps(1, True) == ()

"""The ring backward's pure rank arithmetic (``sp_attention/softmax/bwd_ring.py``): which dtype
and how many key chunks each accumulator hop carries, P = 2 … 16, no processes. Its numbers at
every rank: ``test_softmax_cp.py``."""
import pytest
import torch


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_backward_hop_dtypes(layout, causal):
    """Pure rank arithmetic of the ring backward's accumulator hops, P = 2 … 16: both ends of
    every hop agree on its dtype; a 16-bit hop carries at most one kernel output (simulated by
    counting contributions along each block's path); P = 2 zigzag causal sends 16-bit."""
    from sp_attention.softmax.bwd_ring import hop_dtypes
    from sp_attention.planning.softmax_plan import ring_calls
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
    from sp_attention.planning.softmax_plan import ring_calls
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

"""The all-gather scan's fold plan (``sp_attention/linear/scan_allgather.py``): copied to a
device once per (rank, group shape, direction, dtype, device), not per call, and held in a
bounded cache. The scan's numbers are tested at every rank in ``test_linear_cp.py``."""
import torch

from sp_attention.linear import scan_allgather as sa
from sp_attention.linear.scan_common import _leaf_map, element_map


def test_fold_plan_made_once_per_key_and_bounded():
    sa._DEVICE_PLANS.clear()
    cpu = torch.device("cpu")
    plan = sa._fold_plan(_leaf_map(1, 3, "zigzag", 6, False), torch.float64, cpu)
    again = sa._fold_plan(_leaf_map(1, 3, "zigzag", 6, False), torch.float64, cpu)
    assert all(a is b for a, b in zip(plan, again))            # no copy per call
    order, between, before = plan
    assert between.dtype == before.dtype == torch.float64
    # zigzag P = 3: rank 1 holds leaves 1 and 4, at scan positions 1 and 4 of 6
    assert order.tolist() == [0, 2, 4, 5, 3, 1]
    assert before.tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]]
    assert between[1, 0].tolist() == [0, 1, 1, 1, 0, 0]      # A_1 … A_3 carry b_0 to leaf 4
    for world in range(1, 40):
        sa._fold_plan(_leaf_map(0, world, "contiguous", world, True), torch.float32, cpu)
    assert len(sa._DEVICE_PLANS) <= sa._DEVICE_PLANS.maxsize == 16
    assert sa._host_plan.cache_info().maxsize is not None


def test_fold_plan_of_explicit_holders():
    """Packed documents: ranks hold different numbers of elements; the gathered buffer has
    max-per-rank rows per rank (rank 0: 2 elements, rank 1: 1, rank 2: none)."""
    holders = (0, 1, 0)
    m = element_map(0, holders, False)
    order, between, before = sa._host_plan(m)
    assert m.max_per_rank == 2 and m.local_positions == [0, 2]
    assert order.tolist() == [0, 2, 1]             # rank 1's element sits in row 1·2 + 0
    assert before.tolist() == [[0, 0, 0], [1, 1, 0]]
    r = element_map(0, holders, True)              # reversed: positions 2, 0 are rank 0's
    assert r.local_positions == [2, 0] and sa._host_plan(r)[0].tolist() == [1, 2, 0]
    assert element_map(2, holders, False).local_positions == []

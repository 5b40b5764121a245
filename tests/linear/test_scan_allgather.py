"""The all-gather scan's fold plan (``sp_attention/linear/scan_allgather.py``): band matrices
over the gathered rows (rank-major, padding rows never counted), made once per element map and
bound to buffers once per (map, element size, dtype, device), in bounded caches. The scan's
numbers are tested at every rank in ``test_linear_cp.py``."""
import torch

from sp_attention.linear import scan_allgather as sa
from sp_attention.linear.scan_common import _leaf_map, element_map


def test_band_matrices_address_the_gathered_rows():
    # zigzag P = 3: rank 1 holds leaves 1 and 4, at scan positions 1 and 4 of 6; rank r's
    # elements sit in rows 2r, 2r + 1 (leaves r and 5 − r)
    between, before = sa.host_plan(_leaf_map(1, 3, "zigzag", 6, False), 3)
    pos_of_row = [0, 5, 1, 4, 2, 3]
    assert before.tolist() == [[p < 1 for p in pos_of_row], [p < 4 for p in pos_of_row]]
    # what carries b of leaf 0 (row 0) to leaf 4: A of leaves 1, 2, 3 (rows 2, 4, 5)
    assert [int(between[1, i, 0]) for i in range(6)] == [0, 0, 1, 0, 1, 1]
    assert int(between[0].sum()) == 0               # nothing lies between anything and leaf 1


def test_band_matrices_of_explicit_holders_skip_padding():
    """Packed documents: ranks hold different numbers of elements; the gathered buffer has
    max-per-rank rows per rank (rank 0: 2 elements, rank 1: 1 and a padding row, rank 2: two
    padding rows)."""
    holders = (0, 1, 0)
    m = element_map(0, holders, False)
    between, before = sa.host_plan(m, 3)
    assert m.max_per_rank == 2 and m.local_positions == [0, 2]
    assert between.shape == (2, 6, 6)
    assert before.tolist() == [[0] * 6, [1, 0, 1, 0, 0, 0]]     # rows 0 (pos 0) and 2 (pos 1)
    assert [int(between[1, i, 0]) for i in range(6)] == [0, 0, 1, 0, 0, 0]
    assert element_map(2, holders, False).local_positions == []


def test_runs_made_once_per_key_and_bounded():
    sa._RUNS.clear()
    from sp_attention.context import SPContext
    ctx = SPContext(None, 0, 1, layout="zigzag")
    A = torch.rand(2, 3, dtype=torch.float64)
    b = torch.randn(2, 3 * 4, dtype=torch.float64)
    sa.allgather_rows(A, b, ctx)
    run = next(iter(sa._RUNS._data.values()))
    sa.allgather_rows(A, b, ctx)
    assert len(sa._RUNS) == 1 and next(iter(sa._RUNS._data.values())) is run
    for kv in range(1, 40):
        sa.allgather_rows(A, torch.randn(2, 3 * kv, dtype=torch.float64), ctx)
    assert len(sa._RUNS) <= sa._RUNS.maxsize
    assert sa.host_plan.cache_info().maxsize is not None

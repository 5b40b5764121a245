"""The all-gather backward's units (``sp_attention/softmax/bwd_allgather.py``): head strides
with first/last splits, and sequence units when one KV head is local. Its numbers at every
rank: ``test_softmax_cp.py``."""
from sp_attention.softmax.bwd_allgather import backward_units


def test_backward_units():
    units, split = backward_units(8, 2, 16, 2, 1, 1)
    assert split == 1 and [u.heads for u in units] == [1, 1, 2, 2, 1, 1]
    assert units[-1].h1 == 8 and all(u.pieces == 2 for u in units)
    # one KV head: sequence units
    units, split = backward_units(1, 2, 6, 1, None, None)
    assert split == 1 and [(u.p0, u.p1) for u in units] == [(0, 1), (1, 2)]
    units, split = backward_units(1, 1, 6, 1, None, None)
    assert split == 2 and [(u.p0, u.p1) for u in units] == [(0, 1), (1, 2)]
    units, split = backward_units(1, 1, 5, 1, None, None)
    assert split == 1 and [(u.p0, u.p1) for u in units] == [(0, 1)]

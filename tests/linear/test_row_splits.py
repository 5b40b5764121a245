"""``LinearTuning.row_splits``: each leaf of a rank run as several rows whose states are
combined on the rank around the cross-rank scan (:func:`sp_attention.linear.leaves.split_rows_scan`).
The combine against the rows run one after another (fp64), the built-in rule, the error of a
value that does not fit, and whole CP steps on the torch path (fixed rates and gates, every
scan, both layouts, P = 2 and 3, 2 and 3 rows) against the single-device recurrence at every
rank. The fla path's orchestration with rows: ``test_fla_orchestration.py``."""
from __future__ import annotations

import pytest
import torch

from sp_attention import LinearTuning
from sp_attention.linear.leaves import split_rows_scan
from sp_attention.planning.linear_rows import row_splits
from sp_attention.testing import assert_close, run_distributed


@pytest.mark.parametrize("m", [2, 3])
def test_split_scan_equals_rows_in_sequence(m):
    torch.manual_seed(0)
    N, H, K, V = 2, 2, 3, 4
    x = torch.randn(N * m, H, K, V, dtype=torch.float64)
    a = torch.rand(N * m, H, dtype=torch.float64)
    edge = torch.randn(N, H, K, V, dtype=torch.float64)
    seen = {}

    def scan(el, A):
        seen["x"], seen["A"] = el, A
        return edge
    fwd = split_rows_scan(scan, m, False)(x, a)
    for n in range(N):
        S, end, A = edge[n], torch.zeros(H, K, V, dtype=torch.float64), torch.ones(H, dtype=torch.float64)
        for j in range(m):
            r = n * m + j
            assert_close(fwd[r], S, 1e-14, f"S_in row {j}")
            S = a[r][:, None, None] * S + x[r]
            end, A = a[r][:, None, None] * end + x[r], A * a[r]
        assert_close(seen["x"][n], end, 1e-14, "leaf end state")
        assert_close(seen["A"][n], A, 1e-14, "leaf transition")
    bwd = split_rows_scan(scan, m, True)(x, a)
    for n in range(N):
        G, D = edge[n], x[n * m + m - 1]
        for j in range(m - 1, -1, -1):
            r = n * m + j
            assert_close(bwd[r], G, 1e-14, f"G row {j}")
            G = x[r] + a[r][:, None, None] * G
            if j < m - 1:
                D = x[r] + a[r][:, None, None] * D
        assert_close(seen["x"][n], D, 1e-14, "leaf contribution")


def test_rule():
    # B 1, one leaf, 16 heads of 128: 64 programs per row on 132 SMs -> 2 rows
    assert row_splits(None, 1, 32768, 16, 128, 128, 132) == 2
    assert row_splits(None, 2, 32768, 16, 128, 128, 132) == 1      # zigzag: 128 programs
    assert row_splits(None, 1, 32768, 8, 128, 128, 132) == 4       # capped at 4
    assert row_splits(None, 1, 6144, 16, 128, 128, 132) == 1       # rows under 4096 tokens
    assert row_splits(None, 1, 32768 + 64, 16, 128, 128, 132) == 1  # not whole chunks
    assert row_splits(None, 1, 32768, 16, 128, 128, None) == 1     # off the fla path
    assert row_splits(None, 1, 32768, 16, 128, 128, 132, gated=True) == 4   # gates: 2 x SMs
    assert row_splits(None, 2, 32768, 16, 128, 128, 132, gated=True) == 2
    assert row_splits(None, 1, 8192, 16, 128, 128, 132, gated=True) == 2    # rows >= 4096
    assert row_splits(3, 1, 384, 4, 8, 8, None) == 3
    with pytest.raises(ValueError, match="row_splits=3 needs each leaf's length"):
        row_splits(3, 1, 256, 4, 8, 8, None)
    with pytest.raises(ValueError, match="row_splits must be a positive int"):
        LinearTuning(row_splits=0)


def _world(rank, world):
    import torch.distributed as dist

    from sp_attention import build_sp_context, shard_sequence
    from sp_attention.linear import lightning_attention
    from sp_attention.linear.gated_naive import recurrent_gated_attention
    from sp_attention.linear.naive import recurrent_linear_attention

    group = dist.new_group(list(range(world)))
    gen = torch.Generator().manual_seed(11)
    T, H, D = 2 * world * 384, 2, 4
    q, k, v, w = (torch.randn(1, T, H, D, generator=gen, dtype=torch.float64) for _ in range(4))
    slopes = torch.tensor([0.01, 0.3], dtype=torch.float64)
    gates = -torch.rand(1, T, H, generator=gen, dtype=torch.float64) * 0.2
    for gated in (False, True):
        ins = [t.clone().requires_grad_(True) for t in (q, k, v, gates)]
        o = (recurrent_gated_attention(*ins, scale=0.5)[0] if gated else
             recurrent_linear_attention(*ins[:3], slopes, scale=0.5)[0])
        (o * w).sum().backward()
        expected = [o.detach()] + [t.grad for t in ins[:4 if gated else 3]]
        for layout in ("contiguous", "zigzag"):
            ctx = build_sp_context(group, layout=layout)
            want = [shard_sequence(t, ctx, 1) for t in expected]
            for impl in ("blelloch", "allgather", "ring"):
                for rows in (2, 3):
                    loc = [shard_sequence(t, ctx, 1).clone().requires_grad_(True)
                           for t in (q, k, v, gates)]
                    kw = dict(g=loc[3]) if gated else {}
                    out = lightning_attention(*loc[:3], None if gated else slopes, ctx=ctx,
                                              impl=impl, scale=0.5, backend="torch",
                                              tuning=LinearTuning(row_splits=rows), **kw)
                    (out * shard_sequence(w, ctx, 1)).sum().backward()
                    got = [out] + [t.grad for t in loc[:4 if gated else 3]]
                    for x, y, what in zip(got, want, ("o", "dq", "dk", "dv", "dg")):
                        assert_close(x, y, 1e-10, f"gated={gated} {layout} {impl} rows={rows} "
                                                  f"rank{rank} {what}")
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_cp_step_with_row_splits_torch_path(world):
    assert all(run_distributed(_world, world, timeout=600))

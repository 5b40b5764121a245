"""The fused all-gather scan over a rank's leaf rows (``sp_attention/linear/allgather_kernel.py``,
``scan_allgather.FusedAllgatherRun``): its two Triton kernels in Triton's CPU interpreter, run
at every rank of gloo groups (P = 1, 2, 3, 4, 8, both layouts, one to three rows per leaf, one
and two batch rows, both directions), against an independent fp64 sequential scan over the
whole sequence's rows and against the torch ops it replaces (``LinearTuning(fused_scan=
False)``). Transitions include exact zeros (a state that decays to nothing: log A clamped at
the floor must still weigh it exactly 0) and ones."""
import os

import pytest
import torch
import torch.distributed as dist

from sp_attention.testing import run_distributed

CASES = [(B, m, reverse) for B in (1, 2) for m in (1, 2, 3) for reverse in (False, True)]
# P = 8 (16 gathered rows with zigzag: another tile shape), fewer cases for CI's time
CASES_WIDE = [(B, m, reverse) for B, m in ((1, 3), (2, 1)) for reverse in (False, True)]


def _sequential(X: torch.Tensor, A: torch.Tensor, reverse: bool) -> torch.Tensor:
    """fp64: the state entering each row of ``X [B, L, m, H, kv]`` (``A [B, L, m, H]``) in
    scan order — the rows of all leaves in global order, reversed for ``reverse``."""
    B, L, m, H, kv = X.shape
    x, a = X.reshape(B, L * m, H, kv), A.reshape(B, L * m, H)
    out = torch.empty_like(x)
    s = torch.zeros(B, H, kv, dtype=x.dtype)
    for r in (range(L * m - 1, -1, -1) if reverse else range(L * m)):
        out[:, r] = s
        s = a[:, r, :, None] * s + x[:, r]
    return out.reshape(X.shape)


def _fused_worker(rank, world, device_type):
    if device_type == "interpreter":    # chosen before the kernels' module is imported
        os.environ["TRITON_INTERPRET"] = "1"
    from sp_attention import LinearTuning, build_sp_context
    from sp_attention.linear.attention import _rows_scan
    from sp_attention.linear import scan_allgather as sa
    from sp_attention.linear.scan_allgather import fused_allgather_leaf_rows
    from sp_attention.linear.scan_common import leaf_map
    group = dist.new_group(list(range(world)))
    dev = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else \
        torch.device("cpu")
    H, K, V = 3, 4, 5                   # K·V = 20: one masked tile
    worst = 0.0
    for layout in ("contiguous", "zigzag"):
        ctx = build_sp_context(group, layout=layout)
        L, n = ctx.num_leaves, len(ctx.leaves)
        for B, m, reverse in (CASES if world <= 4 else CASES_WIDE):
            g = torch.Generator().manual_seed(100 * B + 10 * m + reverse)
            X = torch.randn(B, L, m, H, K * V, dtype=torch.float64, generator=g)
            A = torch.rand(B, L, m, H, dtype=torch.float64, generator=g) ** 2
            A.view(-1)[::7] = 0.0       # states that decay to nothing
            A.view(-1)[3::11] = 1.0
            want = _sequential(X, A, reverse)[:, list(ctx.leaves)]
            mine = [t[:, list(ctx.leaves)].reshape(B * n * m, H, *t.shape[4:])
                    for t in (X, A[..., None])]
            x = mine[0].to(dev, torch.float32).reshape(B * n * m, H, K, V).contiguous()
            a = mine[1][..., 0].to(dev, torch.float32).contiguous()
            got = fused_allgather_leaf_rows(x, a, ctx, reverse, m)
            # what a CUDA graph replays: the rows copied into the run's buffers, then the
            # kernels and the collective on them (on GPUs also through GraphReplay itself)
            run = next(r for k, r in sa._RUNS._data.items()
                       if k[0] == "fused" and k[1] == leaf_map(ctx, reverse) and k[3] ==
                       (B * n * m, H, K * V) and k[4] == m)
            run.stage(a, x)
            assert torch.equal(run.compute(ctx).view(x.shape), got)
            if device_type == "cuda":
                for _ in range(3):      # eager, capture, replay
                    again = fused_allgather_leaf_rows(x, a, ctx, reverse, m, graphs=True)
                assert torch.equal(again, got)
            torch_ops = _rows_scan(ctx, "allgather", reverse, m,
                                   LinearTuning(fused_scan=False))(x, a)
            ref = want.reshape(got.shape).to(dev, torch.float32)
            key = (layout, B, m, reverse)
            assert got.shape == x.shape, key
            err = float((got - ref).abs().max())
            worst = max(worst, err)
            assert err <= 1e-5 * (1 + float(ref.abs().max())), (key, err)
            assert torch.allclose(got, torch_ops, rtol=1e-5, atol=1e-5), key
    return worst


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_fused_allgather_scan_interpreted(world):
    """The kernels in Triton's interpreter at every rank of a gloo group."""
    pytest.importorskip("triton", reason="triton is in the `test` extra; install it to run this")
    worst = run_distributed(_fused_worker, world, "interpreter", timeout=300)
    assert all(w < 1e-3 for w in worst)


@pytest.mark.multigpu
@pytest.mark.parametrize("world", [2, 4])
def test_fused_allgather_scan_gpus(world):
    """The compiled kernels over NCCL at every rank (device machine: pytest -m multigpu)."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs (device machine)")
    worst = run_distributed(_fused_worker, world, "cuda", timeout=300, backend="nccl")
    print(f"P={world} fused all-gather scan: worst abs error vs fp64 {max(worst):.2e}")


def test_fused_run_rejects_what_it_cannot_fold():
    """The launchers' checks (no kernel runs): fp32 only, rows in whole leaves."""
    pytest.importorskip("triton", reason="triton is in the `test` extra; install it to run this")
    from sp_attention.linear.allgather_kernel import stage_rows
    send = torch.zeros(1, 2 * (1 + 4))
    with pytest.raises(TypeError, match="fp32"):
        stage_rows(torch.zeros(2, 2, 4, dtype=torch.float64), torch.zeros(2, 2), send, 1, 1,
                   False, -100.0)
    with pytest.raises(ValueError, match="whole|rows"):
        stage_rows(torch.zeros(3, 2, 4), torch.zeros(3, 2), send, 2, 1, False, -100.0)

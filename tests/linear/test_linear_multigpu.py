"""Multi-GPU (NCCL) tests of every linear-attention scan at P = 2 and 4, both layouts, fixed
slopes, per-token gates and packed documents: each rank's bf16 output and gradients against an
fp32 single-device reference, no worse than 1.5 × the same code's error at P = 1; the tuning
variants (early end states, scans replayed from CUDA graphs) give the default's numbers; leaves
run as 2 and 4 rows (``LinearTuning.row_splits``) are as close to fp32; and
a fwd + bwd step captured in a CUDA graph gives the eager step's. Run on the device machine:
``python -m pytest -m multigpu tests/linear/test_linear_multigpu.py``."""
import pytest
import torch

from sp_attention import LinearTuning, build_sp_context, plan_packing, shard_sequence
from sp_attention.linear import lightning_attention
from sp_attention.testing import rel_rms, run_distributed

pytestmark = pytest.mark.multigpu

IMPLS = ("blelloch", "allgather", "ring")
# an error within bf16 noise of the P = 1 error passes (relative RMS; tiny P = 1 errors get
# this floor so a ratio of two roundings cannot fail the test)
FLOOR = 1e-3


def _inputs(dev, T, H=4, K=128, seed=0):      # K = 128: the kernels the benchmarks compile
    g = torch.Generator(device=dev).manual_seed(seed)
    q, k, v, do = (torch.randn(1, T, H, K, device=dev, generator=g) * 0.2 for _ in range(4))
    gates = -torch.rand(1, T, H, device=dev, generator=g) * torch.tensor(
        [0.02, 0.3, 2.0, 30.0], device=dev)
    return q, k, v, do, gates


def _run(q, k, v, do, decay, *, ctx=None, impl=None, cu=None, tuning=None, backend=None,
         dtype=torch.bfloat16):
    xs = [t.detach().to(dtype).clone().requires_grad_(True) for t in (q, k, v)]
    kw = dict(ctx=ctx, impl=impl, cu_seqlens=cu, tuning=tuning, backend=backend)
    if decay.dim() == 1:
        o = lightning_attention(*xs, decay, **kw)
    else:
        o = lightning_attention(*xs, g=decay.detach(), **kw)
    o.backward(do.to(dtype))
    return [o.detach().float()] + [x.grad.float() for x in xs]


def _cases(dev, world):
    """(name, global inputs, decay, packed boundaries or None) at the global length."""
    T = 2 * world * 1000                 # leaves of 1000 tokens: not a multiple of the chunk
    q, k, v, do, gates = _inputs(dev, T)
    slopes = torch.tensor([0.0, 0.01, 0.3, 50.0], device=dev)
    cu = torch.tensor([0, 700, 2500, 2600, T - 300, T], device=dev)
    return [("fixed", (q, k, v, do), slopes, None), ("gated", (q, k, v, do), gates, None),
            ("packed", (q, k, v, do), slopes, cu)]


def _check(rank, world):
    import torch.distributed as dist
    dev = torch.device("cuda", torch.cuda.current_device())
    group = dist.new_group(list(range(world)))
    errors = {}
    for name, (q, k, v, do), decay, cu in _cases(dev, world):
        exact = _run(q, k, v, do, decay.double(), cu=cu, backend="torch", dtype=torch.float64)
        single = _run(q, k, v, do, decay, cu=cu)                     # P = 1, bf16, same code
        e1 = [rel_rms(a, b) for a, b in zip(single, exact)]
        for layout in ("contiguous", "zigzag"):
            ctx = build_sp_context(group, layout=layout)
            plan = None if cu is None else plan_packing(cu, ctx)

            def shard(t):
                return shard_sequence(t, ctx, 1) if plan is None else plan.shard(t, ctx.rank, 1)
            loc = [shard(t) for t in (q, k, v, do)]
            dec = decay if decay.dim() == 1 else shard(decay)
            want = [shard(t) for t in exact]
            for impl in IMPLS:
                got = _run(*loc, dec, ctx=ctx, impl=impl, cu=plan)
                for what, g_, w_, base in zip(("o", "dq", "dk", "dv"), got, want, e1):
                    e = rel_rms(g_, w_)
                    errors[f"{name} {layout} {impl} {what}"] = (e, base)
                    assert torch.isfinite(g_).all(), (name, layout, impl, what)
                    assert e <= 1.5 * max(base, FLOOR), (name, layout, impl, what, e, base)
                if cu is None:          # both schedules each way, whatever auto picks
                    for bwd in ("scan_first", "recurrence_first", "states_first",
                                "output_first"):
                        kw = dict(backward_schedule=bwd) if bwd.startswith(("scan", "rec")) \
                            else dict(forward_schedule=bwd)
                        late = _run(*loc, dec, ctx=ctx, impl=impl, tuning=LinearTuning(**kw))
                        for what, g_, w_, base in zip(("o", "dq", "dk", "dv"), late, want, e1):
                            e = rel_rms(g_, w_)
                            errors[f"{name} {layout} {impl} {bwd} {what}"] = (e, base)
                            assert e <= 1.5 * max(base, FLOOR), (name, bwd, layout, impl, what)
                if cu is None and name == "fixed":
                    for tuning in (LinearTuning(scan_graphs=False),
                                   LinearTuning(early_end_states=True),
                                   LinearTuning(fused_scan=False)):
                        for _ in range(3):       # eager, capture, replay
                            again = _run(*loc, dec, ctx=ctx, impl=impl, tuning=tuning)
                        for what, a, b in zip(("o", "dq", "dk", "dv"), again, got):
                            if not tuning.scan_graphs:  # graphs or not: the same numbers
                                assert torch.equal(a, b), (tuning, layout, impl, what)
                            else:   # b from another kernel, fp32 sums in another order
                                assert rel_rms(a, b) < 2 * FLOOR, (tuning, layout, impl, what)
    return errors


def _rows_check(rank, world):
    """``LinearTuning.row_splits`` 2 and 4 (leaves of whole chunks): fixed and gated, every
    scan, both layouts, within 1.5 × the P = 1 bf16 error of the fp64 result."""
    import torch.distributed as dist
    dev = torch.device("cuda", torch.cuda.current_device())
    group = dist.new_group(list(range(world)))
    q, k, v, do, gates = _inputs(dev, 2 * world * 1024, seed=3)
    slopes = torch.tensor([0.0, 0.01, 0.3, 50.0], device=dev)
    errors = {}
    for name, decay in (("fixed", slopes), ("gated", gates)):
        exact = _run(q, k, v, do, decay.double(), backend="torch", dtype=torch.float64)
        e1 = [rel_rms(a, b) for a, b in zip(_run(q, k, v, do, decay), exact)]
        for layout in ("contiguous", "zigzag"):
            ctx = build_sp_context(group, layout=layout)
            loc = [shard_sequence(t, ctx, 1) for t in (q, k, v, do)]
            dec = decay if decay.dim() == 1 else shard_sequence(decay, ctx, 1)
            want = [shard_sequence(t, ctx, 1) for t in exact]
            for impl in IMPLS:
                for rows in (2, 4):
                    got = _run(*loc, dec, ctx=ctx, impl=impl,
                               tuning=LinearTuning(row_splits=rows))
                    for what, g_, w_, base in zip(("o", "dq", "dk", "dv"), got, want, e1):
                        e = rel_rms(g_, w_)
                        errors[f"{name} {layout} {impl} rows={rows} {what}"] = (e, base)
                        assert torch.isfinite(g_).all(), (name, layout, impl, rows, what)
                        assert e <= 1.5 * max(base, FLOOR), (name, layout, impl, rows, what, e,
                                                             base)
                    # the scans and their row folds replayed from one graph (the third call)
                    # or run eagerly: the same numbers
                    for _ in range(2):
                        graphed = _run(*loc, dec, ctx=ctx, impl=impl,
                                       tuning=LinearTuning(row_splits=rows))
                    eager = _run(*loc, dec, ctx=ctx, impl=impl,
                                 tuning=LinearTuning(row_splits=rows, scan_graphs=False))
                    for what, a, b in zip(("o", "dq", "dk", "dv"), graphed, eager):
                        assert torch.equal(a, b), (name, layout, impl, rows, what)
    return errors


def _graph_step(rank, world):
    """A whole fwd + bwd step captured in a CUDA graph (NCCL scans inside) = the eager step."""
    import torch.distributed as dist
    dev = torch.device("cuda", torch.cuda.current_device())
    group = dist.new_group(list(range(world)))
    q, k, v, do, _ = _inputs(dev, 2 * world * 1024)
    slopes = torch.tensor([0.0, 0.01, 0.3, 50.0], device=dev)
    for layout in ("contiguous", "zigzag"):
        ctx = build_sp_context(group, layout=layout)
        loc = [shard_sequence(t, ctx, 1).to(torch.bfloat16) for t in (q, k, v, do)]
        for impl, tuning in [(i, None) for i in IMPLS] + [("blelloch", LinearTuning(
                row_splits=2))]:
            xs = [t.clone().requires_grad_(True) for t in loc[:3]]

            def step():
                for x in xs:
                    x.grad = None
                lightning_attention(*xs, slopes, ctx=ctx, impl=impl, tuning=tuning).backward(
                    loc[3])
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    step()                   # eager: call checks, streams, communicators
            torch.cuda.current_stream().wait_stream(side)
            eager = [x.grad.clone() for x in xs]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            graph.replay()
            torch.cuda.synchronize()
            for a, b in zip((x.grad for x in xs), eager):
                assert rel_rms(a.float(), b.float()) < 1e-6, (layout, impl, tuning)
    return True


def _run_and_report(check, world):
    """``check`` on ``world`` GPUs over NCCL (its workers assert); rank 0's errors printed."""
    res = run_distributed(check, world, timeout=900, backend="nccl")
    for key, (e, base) in sorted(res[0].items()):
        print(f"P={world} {key:<40} vs fp32 {e:.2e} (P = 1: {base:.2e})")


def _worlds():
    return [w for w in (2, 4) if torch.cuda.device_count() >= w] or [2]


@pytest.mark.parametrize("world", _worlds())
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (device machine)")
def test_every_scan_matches_fp32_within_the_single_gpu_error(world):
    _run_and_report(_check, world)


@pytest.mark.parametrize("world", _worlds())
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (device machine)")
def test_row_splits_match_fp32_within_the_single_gpu_error(world):
    _run_and_report(_rows_check, world)


@pytest.mark.parametrize("world", _worlds())
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (device machine)")
def test_graph_captured_step_equals_eager(world):
    assert all(run_distributed(_graph_step, world, timeout=600, backend="nccl"))

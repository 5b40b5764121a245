"""``LinearTuning(op_graphs=True)``: the op's forward and backward replayed from a graph per
call signature give the eager op's numbers, for every call, at every rank.

On CPU (every CI run) the graph is a stand-in that re-runs the captured body on the graph's
input buffers, as a replay re-runs the recorded kernels: what these tests prove is the
bookkeeping (which call runs eagerly, captures, replays; inputs copied into the buffers on
every call; outputs cloned out, so a later call cannot overwrite an earlier result; one graph
per signature and direction; :func:`release_cuda_graphs` drops them). On the device the real
CUDA graphs (fla's kernels, NCCL scans inside) are checked bit for bit against the eager op
(marked ``gpu`` / ``multigpu``).
"""
from __future__ import annotations

import pytest
import torch

import sp_attention
from sp_attention import LinearTuning, build_sp_context, shard_sequence
from sp_attention.linear import attention as attention_module
from sp_attention.linear import lightning_attention
from sp_attention.linear.op_graphs import OpGraphs
from sp_attention.testing import run_distributed


class ReRun:
    """A graph stand-in: ``capture`` runs the body once (as a capture records it) and keeps
    its outputs as the graph's buffers; ``replay`` runs the body again on the same input
    buffers and writes the results into those outputs."""

    def capture(self, fn):
        self.fn, self.out = fn, fn()
        return self.out

    def replay(self):
        for buf, new in zip(self.out, self.fn()):
            if isinstance(buf, torch.Tensor) and buf.dim():
                buf.copy_(new)


def _use_stand_in() -> OpGraphs:
    """Route the op through OpGraphs with the stand-in graph on CPU tensors."""
    graphs = OpGraphs(graph_type=ReRun)
    attention_module._OP_GRAPHS = graphs
    attention_module._graphed = lambda tuning, q, local: tuning.op_graphs
    return graphs


def _inputs(T, H, seed, gated, Hkv=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, 16, dtype=torch.float64, generator=g)
    k, v = (torch.randn(1, T, Hkv or H, 16, dtype=torch.float64, generator=g) for _ in range(2))
    do = torch.randn(1, T, H, 16, dtype=torch.float64, generator=g)
    decay = -torch.rand(1, T, H, dtype=torch.float64, generator=g) if gated else \
        torch.rand(H, dtype=torch.float64, generator=g)
    return q, k, v, do, decay


def _step(q, k, v, do, decay, ctx, impl, tuning, dtype=None, backend="torch"):
    """One forward + backward: ``[o, dq, dk, dv(, dg)]``; q, k, v, dO in ``dtype`` (None: as
    given), gates as given."""
    dtype = q.dtype if dtype is None else dtype
    xs = [t.detach().to(dtype).clone().requires_grad_(True) for t in (q, k, v)]
    gated = decay.dim() > 1
    g = decay.detach().clone().requires_grad_(True) if gated else None
    o = lightning_attention(*xs, None if gated else decay, g=g, ctx=ctx, impl=impl,
                            tuning=tuning, backend=backend)
    o.backward(do.to(dtype))
    return [o.detach()] + [x.grad for x in xs] + ([g.grad] if gated else [])


def _check(rank, world):
    import torch.distributed as dist
    graphs = _use_stand_in()
    group = dist.new_group(list(range(world))) if world > 1 else None
    on = LinearTuning(op_graphs=True)
    for gated in (False, True):
        # three input sets of one shape; the calls A, A, B, A, C: eager, capture, then replays
        sets = [_inputs(8 * world * 4, 4, seed, gated, Hkv=2) for seed in (0, 1, 2)]
        for layout in ("contiguous", "zigzag"):
            ctx = build_sp_context(group, layout=layout) if group is not None else None

            def local(t):
                return t if ctx is None else shard_sequence(t, ctx, 1)
            shards = [[local(t) if t.dim() > 1 else t for t in s] for s in sets]
            for impl in ("blelloch", "allgather", "ring"):
                want = [_step(*s, ctx, impl, None) for s in shards]
                got = [_step(*shards[i], ctx, impl, on) for i in (0, 0, 1, 0, 2)]
                for call, (i, res) in enumerate(zip((0, 0, 1, 0, 2), got)):
                    for name, a, b in zip(("o", "dq", "dk", "dv", "dg"), res, want[i]):
                        assert torch.equal(a, b), (rank, gated, layout, impl, call, name)
                # every signature met was captured (forward and backward), none twice
                assert graphs.graphs() == len(graphs.entries) > 0
    return graphs.graphs()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_replays_equal_the_eager_op_at_every_rank(world):
    counts = run_distributed(_check, world, timeout=300)
    assert len(set(counts)) == 1


def test_signatures_are_bounded():
    graphs = OpGraphs(graph_type=ReRun, maxsize=2)
    x = torch.ones(3)
    for key in ("a", "b", "c"):
        for _ in range(2):
            graphs(key, lambda t: (t + 1,), (x,))
    assert graphs.entries.keys() == ["b", "c"] and graphs.graphs() == 2


def test_release_drops_the_op_graphs():
    graphs = OpGraphs(graph_type=ReRun)
    x = torch.arange(4.0)
    for _ in range(3):
        out, = graphs("k", lambda t: (t * 2,), (x,))
    assert torch.equal(out, x * 2) and graphs.graphs() == 1
    assert sp_attention.release_cuda_graphs() >= 1
    assert graphs.graphs() == 0
    again, = graphs("k", lambda t: (t * 3,), (x,))      # eager again: a new first call
    assert torch.equal(again, x * 3)


def test_off_cuda_the_option_changes_nothing():
    """Without the stand-in: CPU tensors run eagerly whatever op_graphs says."""
    q, k, v, do, slopes = _inputs(64, 4, 0, False)
    a = _step(q, k, v, do, slopes, None, "ring", LinearTuning(op_graphs=True))
    b = _step(q, k, v, do, slopes, None, "ring", None)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert attention_module._OP_GRAPHS.graphs() == 0


def test_op_graphs_must_be_a_bool():
    with pytest.raises(TypeError, match="op_graphs must be a bool"):
        LinearTuning(op_graphs=1)


# ------------------------------------------------------------------------------ the device
def _gpu_step(q, k, v, do, decay, ctx, impl, tuning):
    return _step(q, k, v, do, decay, ctx, impl, tuning, torch.bfloat16, None)


def _gpu_check(rank, world):
    """Real CUDA graphs (fla's kernels, NCCL scans inside): the calls A, A, B, A, C equal the
    eager op bit for bit, fixed and gated, every scan and layout, default row splits and 2."""
    import torch.distributed as dist
    dev = torch.device("cuda", torch.cuda.current_device())
    group = dist.new_group(list(range(world))) if world > 1 else None
    T = 2 * world * 2048
    for gated in (False, True):
        sets = []
        for seed in (0, 1, 2):
            gen = torch.Generator(device=dev).manual_seed(seed)
            q, k, v, do = (torch.randn(1, T, 4, 128, device=dev, generator=gen) * 0.2
                           for _ in range(4))
            decay = -torch.rand(1, T, 4, device=dev, generator=gen) * 0.3 if gated else \
                torch.tensor([0.0, 0.01, 0.3, 5.0], device=dev)
            sets.append((q, k, v, do, decay))
        layouts = ("contiguous", "zigzag") if group is not None else ("contiguous",)
        for layout in layouts:
            ctx = build_sp_context(group, layout=layout) if group is not None else None

            def local(t):
                return t if ctx is None else shard_sequence(t, ctx, 1)
            shards = [[local(t) if t.dim() > 1 else t for t in s] for s in sets]
            impls = ("blelloch", "allgather", "ring") if group is not None else ("ring",)
            for impl in impls:
                for rows in (None, 2):
                    base = LinearTuning(row_splits=rows)
                    on = LinearTuning(row_splits=rows, op_graphs=True)
                    want = [_gpu_step(*s, ctx, impl, base) for s in shards]
                    for call, i in enumerate((0, 0, 1, 0, 2)):
                        got = _gpu_step(*shards[i], ctx, impl, on)
                        for name, a, b in zip(("o", "dq", "dk", "dv", "dg"), got, want[i]):
                            assert torch.equal(a, b), (rank, gated, layout, impl, rows, call,
                                                       name)
    return True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")
def test_gpu_replays_equal_the_eager_op():
    assert run_distributed(_gpu_check, 1, timeout=600, backend="nccl") == [True]


@pytest.mark.multigpu
@pytest.mark.parametrize("world", [w for w in (2, 4) if torch.cuda.device_count() >= w] or [2])
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (device machine)")
def test_multigpu_replays_equal_the_eager_op(world):
    assert all(run_distributed(_gpu_check, world, timeout=900, backend="nccl"))


# ------------------------------------------------------ row splits: the folds inside the graph
def _rows_check(rank, world):
    """With row splits and ``scan_graphs``, each scan and its rows' folds replay from one graph
    per direction (the stand-in here, on the fla path's orchestration with pure-torch kernels):
    the calls A, A, B, A equal the same calls without graphs, exactly, at every rank."""
    import torch.distributed as dist

    import test_fla_orchestration as orch
    from sp_attention.linear.attention import lightning_attention_with_kernels

    def setattr_(obj, name, value):
        setattr(obj, name, value)
    fake = orch._install(setattr_, orch.SLOPES)
    graphs = OpGraphs(graph_type=ReRun, maxsize=64)
    attention_module._ROW_SCAN_GRAPHS = graphs
    attention_module._graph_device = lambda x: True
    group = dist.new_group(list(range(world)))
    T = 2 * world * 384                    # zigzag leaves of 6 chunks: rows of 3
    sets = []
    for seed in (0, 1):
        g = torch.Generator().manual_seed(seed)
        sets.append([torch.randn(1, T, 3, 4, generator=g, dtype=torch.float64)
                     for _ in range(4)])
    for layout in ("contiguous", "zigzag"):
        ctx = build_sp_context(group, layout=layout)
        for impl in ("blelloch", "allgather", "ring"):
            def run(i, graphs_on):
                q, k, v, w = (shard_sequence(t, ctx, 1) for t in sets[i])
                xs = [t.clone().requires_grad_(True) for t in (q, k, v)]
                out = lightning_attention_with_kernels(
                    *xs, orch.SLOPES, fake, ctx=ctx, impl=impl, scale=0.5,
                    tuning=LinearTuning(row_splits=2, scan_graphs=graphs_on,
                                        fused_scan=False))      # the torch ops' graphs
                (out * w).sum().backward()
                return [out.detach()] + [x.grad for x in xs]
            before = graphs.graphs()
            want = [run(i, False) for i in (0, 1)]
            for call, i in enumerate((0, 0, 1, 0)):
                for name, a, b in zip(("o", "dq", "dk", "dv"), run(i, True), want[i]):
                    assert torch.equal(a, b), (rank, layout, impl, call, name)
            assert graphs.graphs() == before + 2          # forward and backward scans
    return True


def test_row_scan_graphs_equal_the_eager_scans():
    assert all(run_distributed(_rows_check, 3, timeout=300))


def test_a_failed_capture_names_the_fix():
    class Failing(ReRun):
        def capture(self, fn):
            raise RuntimeError("operation not permitted when stream is capturing")
    graphs = OpGraphs(graph_type=Failing)
    x = torch.ones(2)
    graphs("k", lambda t: (t + 1,), (x,))                   # eager
    with pytest.raises(RuntimeError, match="op_graphs=False, scan_graphs=False"):
        graphs("k", lambda t: (t + 1,), (x,))
    assert graphs.graphs() == 0 and len(graphs.entries) == 0

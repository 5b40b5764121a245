"""Cross-rank loss share and gradient all-reduce (sp_train.reduce) on gloo."""
import pytest
import torch
import torch.distributed as dist

from sp_train.reduce import all_reduce_gradients, global_token_mean
from sp_attention.testing import run_distributed, seeded


def _worker(rank, world):
    torch.manual_seed(0)
    w = torch.nn.Parameter(seeded((5,), 1))
    b = torch.nn.Parameter(seeded((3,), 2, dtype=torch.float32))
    x = seeded((world, 4, 5), 3)                      # global batch of world × 4 tokens
    mask = (seeded((world, 4), 4) > -0.3)
    # single-process reference: mean over the real tokens of the whole batch
    ref_w, ref_b = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    tok = (x @ ref_w) + ref_b.double().sum()
    ref = (tok * mask).sum() / mask.sum()
    ref.backward()
    # this rank's tokens only
    share = global_token_mean((x[rank] @ w) + b.double().sum(), mask[rank], dist.group.WORLD)
    share.backward()
    all_reduce_gradients([w, b], dist.group.WORLD)
    total = share.detach().clone()
    dist.all_reduce(total)
    assert torch.allclose(total, ref.detach(), rtol=1e-12)
    assert torch.allclose(w.grad, ref_w.grad, rtol=1e-12)
    assert w.grad.dtype == torch.float64
    assert torch.allclose(b.grad, ref_b.grad, rtol=1e-6)
    return True


def test_share_and_gradients_match_single_process():
    assert all(run_distributed(_worker, 3))


def test_bad_input():
    with pytest.raises(ValueError, match="shape of token_loss"):
        global_token_mean(torch.ones(3), torch.ones(4))
    with pytest.raises(ValueError, match="no real token"):
        global_token_mean(torch.ones(3), torch.zeros(3))
    with pytest.raises(TypeError, match="member"):
        global_token_mean(torch.ones(3), None, group=-100)


def _reducer_worker(rank, world, overlap, write_back):
    """Two micro-batches, three small buckets, an fp32 and an fp64 bucket, a parameter no rank
    reaches, a scale: the reducer's sums equal the single-process gradient at every rank."""
    from sp_train.reduce import GradientReducer
    w1 = torch.nn.Parameter(seeded((6, 5), 1))
    w2 = torch.nn.Parameter(seeded((5,), 2))
    b = torch.nn.Parameter(seeded((5,), 3, dtype=torch.float32))
    unused = torch.nn.Parameter(seeded((4,), 4))
    params = [unused, w1, b, w2]     # buckets in reverse: [w2] [b] (fp32) [w1] [unused]
    x = seeded((world, 2, 3, 6), 5)            # [rank, micro-batch, tokens, features]

    def loss(xs, ws):
        _, a, bb, c = ws
        return ((torch.tanh(xs @ a + bb.double()) @ c) ** 2).sum()

    ref = [p.detach().clone().requires_grad_() for p in params]
    loss(x, ref).backward()
    reducer = GradientReducer(params, dist.group.WORLD, overlap=overlap, bucket_elements=12,
                              write_back=write_back)
    assert [[id(p) for p in bk] for bk in reducer.buckets] == [[id(w2)], [id(b)], [id(w1)],
                                                               [id(unused)]]
    for step in range(2):                      # the hooks stay; each step arms again
        for p in params:
            p.grad = None
        for mb in range(2):
            if mb == 1:
                reducer.arm(scale=0.5)
            loss(x[rank, mb], params).backward()
        # with overlap every bucket before the unreached parameter's left during the backward
        assert reducer._next == (3 if overlap else 0)
        sums = reducer.finish()
        if write_back:
            assert sums is None
            got = [p.grad for p in params]
        else:     # fp32 (fp64) sums in parameter order; .grad dropped when its bucket left
            assert all(p.grad is None for p in params) and len(sums) == len(params)
            assert [g.dtype for g in sums] == [torch.float64, torch.float64, torch.float32,
                                               torch.float64]
            got = sums
        for p, r, g in zip(params, ref, got):
            want = 0.5 * r.grad if r.grad is not None else torch.zeros_like(p)
            assert g is not None and g.dtype == p.dtype and g.shape == p.shape
            p.grad = g
            tol = 1e-6 if p.dtype == torch.float32 else 1e-12     # fp32: summed per rank
            assert torch.allclose(p.grad, want, rtol=tol, atol=tol), (step, p.shape)
    reducer.remove()
    return True


@pytest.mark.parametrize("overlap,write_back", [(True, True), (False, True), (True, False),
                                                (False, False)])
def test_reducer_matches_single_process(overlap, write_back):
    assert all(run_distributed(_reducer_worker, 3, overlap, write_back))


def _twice_worker(rank, world):
    from sp_train.reduce import GradientReducer
    w = torch.nn.Parameter(seeded((3,), 1))
    reducer = GradientReducer([w], dist.group.WORLD)
    reducer.arm()
    (w * 2).sum().backward()
    try:
        (w * 3).sum().backward()      # a second accumulation after the bucket travelled
    except RuntimeError as e:
        assert "accumulated twice" in str(e) and "--no-overlap-grad-reduce" in str(e)
    else:
        raise AssertionError("no error")
    reducer.finish()
    return True


def test_reducer_refuses_a_gradient_accumulated_twice():
    assert all(run_distributed(_twice_worker, 2))


def test_reducer_single_rank_scales_and_needs_arm():
    from sp_train.reduce import GradientReducer
    w = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    reducer = GradientReducer([w], None)
    with pytest.raises(RuntimeError, match="arm"):
        reducer.finish()
    reducer.arm(scale=0.25)
    (w * 4).sum().backward()
    reducer.finish()
    assert torch.equal(w.grad, torch.ones(3, dtype=torch.float64))


def _bf16_buckets_worker(rank, world):
    """bf16 gradients into fp32 buckets on the GPU (the multi-tensor cast): the sums equal the
    fp32 sums of every rank's gradient bit for bit (two ranks: one addition, either order)."""
    from sp_train.reduce import GradientReducer
    shapes = [(64, 48), (48,), (3, 5, 7), (1000,)]
    params = [torch.nn.Parameter(torch.zeros(s, dtype=torch.bfloat16, device="cuda"))
              for s in shapes]

    def grads(r):
        return [seeded(s, 10 * r + i, dtype=torch.float32).to(torch.bfloat16).cuda()
                if i != 2 else None for i, s in enumerate(shapes)]   # one never reached
    reducer = GradientReducer(params, dist.group.WORLD, overlap=False, write_back=False,
                              bucket_elements=3200)
    assert len(reducer.buckets) < len(params)          # several parameters in one bucket
    reducer.arm(scale=1.0)
    for p, g in zip(params, grads(rank)):
        p.grad = g
    sums = reducer.finish()
    for i, (p, got) in enumerate(zip(params, sums)):
        want = sum(g[i].float() if g[i] is not None else torch.zeros(p.shape, device="cuda")
                   for g in (grads(r) for r in range(world)))
        assert got.dtype == torch.float32 and torch.equal(got, want), i
    return True


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (device machine)")
def test_bf16_gradients_into_fp32_buckets_on_nccl():
    assert all(run_distributed(_bf16_buckets_worker, 2, backend="nccl", timeout=120))

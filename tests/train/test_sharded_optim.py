"""The distributed optimizer (sp_train.sharded_optim.ShardedAdamW with the reducer's
reduce-scatter) against the replicated one (MasterAdamW with the all-reduce) on gloo: the same
parameters after clipped steps at P = 2 and 3, the same checkpoint keys and values, and
checkpoints that move between the two (DCP, any layout)."""
import pytest
import torch
import torch.distributed as dist

from sp_attention.testing import run_distributed, seeded

SHAPES = [(6, 5), (5,), (4, 5), (3,), (4, 2)]     # 2-D (decayed) and 1-D (not decayed)


class _Model(torch.nn.Module):
    def __init__(self, dtype, device="cpu"):
        super().__init__()
        self.ps = torch.nn.ParameterList(
            [torch.nn.Parameter(seeded(s, 10 + i, dtype=dtype, device=device))
             for i, s in enumerate(SHAPES)])


def _loss(model, rank, step):
    w1, b1, w2, b2, w3 = model.ps
    x = seeded((3, 6), 100 * step + rank, dtype=w1.dtype, device=w1.device)
    h = torch.tanh(x @ w1 + b1.sum())
    return ((h @ w2.t() + b2.sum()) @ w3).pow(2).sum()


def _pair(world, dtype, bucket_elements, device="cpu"):
    from sp_train.optim import MasterAdamW
    from sp_train.reduce import GradientReducer
    from sp_train.sharded_optim import ShardedAdamW
    kw = dict(lr=0.05, betas=(0.9, 0.95), weight_decay=0.1, tp_group=None, tp_rank=0)
    a, b = _Model(dtype, device), _Model(dtype, device)
    opt_a = MasterAdamW(list(a.named_parameters()), **kw)
    red_a = GradientReducer(opt_a.params, dist.group.WORLD, write_back=False,
                            bucket_elements=bucket_elements)
    red_b = GradientReducer([p for p in b.parameters()], dist.group.WORLD, write_back=False,
                            shard=True, bucket_elements=bucket_elements)
    opt_b = ShardedAdamW(list(b.named_parameters()), red_b.buckets, dist.group.WORLD, **kw)
    return (a, opt_a, red_a), (b, opt_b, red_b)


def _step(model, opt, red, rank, step, clip=0.3):
    red.arm(0.5)
    _loss(model, rank, step).backward()
    return float(opt.step(0.05, clip, red.finish()))


def _gathered(state: dict) -> dict:
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {k: v.float().cpu() for k, v in state.items()})
    out = {}
    for p in parts:
        assert not set(p) & set(out), "a key written by two ranks"
        out.update(p)
    return out


def _equal_worker(rank, world, dtype, device="cpu"):
    (a, opt_a, red_a), (b, opt_b, red_b) = _pair(world, dtype, bucket_elements=13,
                                                  device=device)
    assert len(red_b.buckets) > 1 and any(len(bk.pieces) for bk in opt_b.buckets)
    for step in range(3):
        na = _step(a, opt_a, red_a, rank, step)
        nb = _step(b, opt_b, red_b, rank, step)
        assert abs(na - nb) <= 1e-6 * na and na > 0.3, (na, nb)   # the clip is active
        # the clipping norms differ in their last fp32 bits (other sums): a 16-bit parameter
        # at a rounding boundary may land one unit apart
        rtol = 2 ** -7 if dtype == torch.bfloat16 else 0.0
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert pa.dtype == pb.dtype
            assert torch.allclose(pa, pb, rtol=rtol, atol=1e-6), (step, (pa - pb).abs().max())
    # the checkpoint format: the same keys and values, each written by one rank
    got, want = _gathered(opt_b.checkpoint_state()), opt_a.state_tensors()
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.allclose(got[k], v.float().cpu(), rtol=0, atol=1e-6), k
    return True


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_sharded_steps_equal_replicated(world, dtype):
    assert all(run_distributed(_equal_worker, world, dtype))


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (device machine)")
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", ["steps", "overlap"])
def test_sharded_optimizer_on_nccl(world, case):
    """The same on NCCL, bf16, at P = 2 and 4: the steps equal the replicated optimizer's
    (reduce-scatter, all-gather, fused AdamW); the overlapped parameter gather (async
    all-gathers waited for on the forward's stream) equals the gather after the step."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    worker = {"steps": _equal_worker, "overlap": _overlap_worker}[case]
    assert all(run_distributed(worker, world, torch.bfloat16, "cuda", timeout=300,
                               backend="nccl"))


class _Net(torch.nn.Module):
    """Modules that own parameters, and an output weight the loss reads after the forward
    (as train.py's chunked loss reads the output layer's)."""

    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(6, 5).to(dtype)
        self.mid = torch.nn.Sequential(torch.nn.Linear(5, 5), torch.nn.Tanh(),
                                       torch.nn.Linear(5, 4)).to(dtype)
        self.out = torch.nn.Parameter(seeded((4, 3), 7, dtype=dtype))

    def forward(self, x):
        return self.mid(torch.tanh(self.inp(x)))


def _overlap_worker(rank, world, dtype, device="cpu"):
    """``overlap_param_gather``: the step returns with the gathers in flight and the parameters
    as they were; the next forward takes each bucket in before its module runs; the losses,
    norms and parameters equal the gather-after-the-step optimizer's bit for bit."""
    from sp_train.reduce import GradientReducer
    from sp_train.sharded_optim import ShardedAdamW
    kw = dict(lr=0.05, betas=(0.9, 0.95), weight_decay=0.1, tp_group=None, tp_rank=0)
    runs = []
    for overlap in (False, True):
        net = _Net(dtype).to(device)
        red = GradientReducer(list(net.parameters()), dist.group.WORLD, write_back=False,
                              shard=True, bucket_elements=11)
        opt = ShardedAdamW(list(net.named_parameters()), red.buckets, dist.group.WORLD, **kw,
                           overlap_param_gather=overlap)
        opt.attach(net)
        assert len(opt.buckets) >= 4 and opt.overlap_param_gather == overlap
        losses = []
        for step in range(4):
            x = seeded((3, 6), 100 * step + rank, dtype=dtype, device=device)
            red.arm(0.5)
            loss = (net(x) @ net.out).pow(2).sum()       # net.out: read after the forward
            loss.backward()
            losses.append(float(loss))
            before = [p.detach().clone() for p in net.parameters()]
            opt.step(0.05, 0.3, red.finish())
            if overlap:                                  # nothing copied in yet
                assert len(opt._pending) == len(opt.buckets)
                assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
        opt.settle()
        assert not opt._pending
        runs.append((losses, [p.detach().clone() for p in net.parameters()],
                     _gathered(opt.checkpoint_state())))
        opt.detach()
    (la, pa, sa), (lb, pb, sb) = runs
    assert la == lb, (la, lb)
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    return True


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_overlapped_param_gather_equals_gather_after_the_step(world, dtype):
    assert all(run_distributed(_overlap_worker, world, dtype))



def _checkpoint_worker(rank, world, root):
    from sp_train.checkpoint import load_checkpoint, save_checkpoint
    (a, opt_a, red_a), (b, opt_b, red_b) = _pair(world, torch.bfloat16, bucket_elements=13)
    for step in range(2):
        _step(a, opt_a, red_a, rank, step)
        _step(b, opt_b, red_b, rank, step)
    save_checkpoint(f"{root}/sharded", 2, b, opt_b, tp_rank=0, meta={}, group=None,
                    checksums=False)
    save_checkpoint(f"{root}/replicated", 2, a, opt_a, tp_rank=0, meta={}, group=None,
                    checksums=False)
    # both ways across the optimizers, into fresh (differently initialised) ones
    (c, opt_c, red_c), (d, opt_d, red_d) = _pair(world, torch.bfloat16, bucket_elements=5)
    for p in list(c.parameters()) + list(d.parameters()):
        p.data.mul_(-3.0)
    assert load_checkpoint(f"{root}/sharded/iter_0000002", c, opt_c, tp_rank=0,
                           group=None) == 2
    assert load_checkpoint(f"{root}/replicated/iter_0000002", d, opt_d, tp_rank=0,
                           group=None) == 2
    assert opt_d.steps == 2
    for step in (2, 3):
        norms = [_step(m, o, r, rank, step) for m, o, r in
                 ((a, opt_a, red_a), (b, opt_b, red_b), (c, opt_c, red_c), (d, opt_d, red_d))]
        assert max(norms) - min(norms) <= 1e-6 * max(norms), norms
    for pa, pb, pc, pd in zip(a.parameters(), b.parameters(), c.parameters(), d.parameters()):
        for other in (pb, pc, pd):
            assert torch.allclose(pa.float(), other.float(), rtol=0, atol=1e-2 * 2 ** -7)
    return True


def test_checkpoints_move_between_sharded_and_replicated(tmp_path):
    """Saved by the sharded optimizer at P = 3, resumed by the replicated one (and back), with
    another bucket size: the same training after the resume."""
    assert all(run_distributed(_checkpoint_worker, 3, str(tmp_path)))


def test_sharded_bad_input():
    from sp_train.reduce import GradientReducer
    from sp_train.sharded_optim import ShardedAdamW
    m = _Model(torch.float32)
    with pytest.raises(ValueError, match="every trainable parameter once"):
        ShardedAdamW(list(m.named_parameters()), [list(m.parameters())[:2]], None, lr=0.1,
                     betas=(0.9, 0.95), weight_decay=0.0, tp_group=None, tp_rank=0)
    opt = ShardedAdamW(list(m.named_parameters()), [list(m.parameters())], None, lr=0.1,
                       betas=(0.9, 0.95), weight_decay=0.0, tp_group=None, tp_rank=0)
    with pytest.raises(ValueError, match="one gradient slice per bucket"):
        opt.step(0.1, 1.0, None)
    with pytest.raises(ValueError, match="write_back=False"):
        GradientReducer(list(m.parameters()), None, shard=True)


def test_one_rank_keeps_the_replicated_optimizer():
    """``--use-distributed-optimizer`` on one DP × CP rank: nothing to shard, MasterAdamW and an
    all-reduce-free reducer (the flag is accepted, the numbers are the same)."""
    from types import SimpleNamespace
    from sp_train.args import parse_args
    from sp_train.optim import MasterAdamW
    from sp_train.setup import Groups, build_optimizer
    args = parse_args(["--use-distributed-optimizer"])
    groups = Groups(tp=None, cp=None, dp_cp=None, tp_rank=0, cp_rank=0, dp_rank=0)
    opt, red = build_optimizer(SimpleNamespace(named_parameters=lambda: list(
        _Model(torch.float32).named_parameters())), args, groups)
    assert isinstance(opt, MasterAdamW) and not red.shard and not red.reduce
    assert args.use_distributed_optimizer


def test_the_distributed_optimizer_is_the_default_on_gpus_only():
    """Unset, the optimizer flags follow the device (``TrainArgs.resolve_optimizer``): sharded
    with the overlapped gather on GPUs, replicated on CPU; a flag given wins, and the overlap
    without the distributed optimizer is refused naming the fix."""
    from sp_train.args import UsageError, parse_args

    def resolved(argv, cuda):
        a = parse_args(argv)
        a.resolve_optimizer(cuda)
        return a.use_distributed_optimizer, a.overlap_param_gather

    assert parse_args([]).use_distributed_optimizer is None
    assert resolved([], cuda=True) == (True, True)
    assert resolved([], cuda=False) == (False, False)
    assert resolved(["--no-distributed-optimizer"], cuda=True) == (False, False)
    assert resolved(["--no-overlap-param-gather"], cuda=True) == (True, False)
    assert resolved(["--use-distributed-optimizer"], cuda=False) == (True, True)
    assert resolved(["--use-distributed-optimizer", "--no-overlap-param-gather"],
                    cuda=False) == (True, False)
    with pytest.raises(UsageError, match="drop --no-distributed-optimizer"):
        parse_args(["--overlap-param-gather", "--no-distributed-optimizer"])
    with pytest.raises(UsageError, match="add --use-distributed-optimizer"):
        resolved(["--overlap-param-gather"], cuda=False)

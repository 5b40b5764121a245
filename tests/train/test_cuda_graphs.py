"""--cuda-graphs (sp_train.cuda_graphs.LayerGraphs): on CPU, everything around the capture —
the layers called through make_graphed_callables' contract (tensors in, one tensor out, the
layer's parameters), one capture for all layers at the first call, the same outputs and
gradients as the model's own forward, unchanged parameter names, clear refusals, the layer-level
wait of --overlap-param-gather, release; on the device (-m multigpu) the real capture at CP 2
with NCCL: train.py's losses with and without it."""
import pytest
import torch
import torch.distributed as dist

from sp_attention.testing import run_distributed
from sp_train.args import UsageError, parse_args
from sp_train.cuda_graphs import GRAPHED, LayerGraphs

ARGV = ["--sp-model-kind", "hybrid", "--context-parallel-size", "2", "--num-layers", "2",
        "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--global-batch-size", "2"]


def _as_they_are(calls, samples, num_warmup_iters, allow_unused_input):
    """make_graphed_callables' contract without a GPU: the callables back, unchanged."""
    _as_they_are.seen.append((len(calls), [tuple(t.shape for t in s) for s in samples],
                              [s[0].requires_grad for s in samples], num_warmup_iters))
    for c, s in zip(calls, samples):
        out = c(*s)                       # tensors in, one tensor out
        assert isinstance(out, torch.Tensor) and out.shape == s[0].shape
        assert {id(p) for p in c.parameters()} == {id(p) for p in c.layer.parameters()}
    return calls


def _model_worker(rank, world):
    from sp_train.setup import build_model, init_groups
    from sp_attention import shard_position_ids, shard_sequence
    args = parse_args(ARGV)
    layout = args.layout(world)
    groups = init_groups(layout)
    model = build_model(args, layout, groups, 64, bf16=False, device=torch.device("cpu"))
    torch.manual_seed(3)
    tok = shard_sequence(torch.randint(0, 64, (1, 32)), model.sp_context, dim=1)
    pos = shard_position_ids(32, model.sp_context).unsqueeze(0)

    def run():
        model.zero_grad(set_to_none=True)
        out = model(tok, pos, attention_mask=None)
        out.float().square().mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        assert any(n.startswith("decoder.layers.1.") for n in grads)
        return out.detach().clone(), grads

    want_out, want_grads = run()
    names = [n for n, _ in model.named_parameters()]
    _as_they_are.seen = []
    graphs = LayerGraphs(model.decoder.layers, make_graphed=_as_they_are)
    assert all(getattr(layer, GRAPHED) for layer in model.decoder.layers)
    got_out, got_grads = run()
    run()                                                   # captured once, at the first call
    assert len(_as_they_are.seen) == 1
    n, shapes, grads_on, warmup = _as_they_are.seen[0]
    assert n == 2 and warmup == 3 and all(grads_on)
    assert shapes[0][0] == (16, 1, 32) and len(shapes[0]) == 2   # hidden, RoPE angles
    assert [n for n, _ in model.named_parameters()] == names
    assert torch.equal(got_out, want_out)
    assert got_grads.keys() == want_grads.keys()
    assert all(torch.equal(got_grads[k], want_grads[k]) for k in want_grads)
    layer = model.decoder.layers[0]
    h = torch.zeros(16, 1, 32)
    with pytest.raises(ValueError, match="packed documents"):
        layer(hidden_states=h, packed_seq_params=object())
    with pytest.raises(ValueError, match="attention mask"):
        layer(hidden_states=h, attention_mask=torch.ones(1))
    with pytest.raises(ValueError, match="same micro-batch size and sequence length"):
        layer(hidden_states=torch.zeros(8, 1, 32), rotary_pos_emb=torch.zeros(8, 1, 1, 8))
    graphs.release()
    assert "forward" not in layer.__dict__ and not hasattr(layer, GRAPHED)
    again_out, _ = run()
    assert torch.equal(again_out, want_out)
    return True


def test_layers_called_through_the_capture_contract_give_the_models_numbers():
    assert all(run_distributed(_model_worker, 2, timeout=300))


def _attach_worker(rank, world):
    """--overlap-param-gather with a replayed layer: one pre-hook on the layer for all of its
    parameters, none inside it (hooks inside a graph never run); the same steps as before."""
    from sp_train.reduce import GradientReducer
    from sp_train.sharded_optim import ShardedAdamW
    torch.manual_seed(0)
    runs = []
    for mark in (False, True):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Sequential(
            torch.nn.Linear(5, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4)))
        if mark:
            setattr(net[1], GRAPHED, True)
        red = GradientReducer(list(net.parameters()), dist.group.WORLD, write_back=False,
                              shard=True, bucket_elements=11)
        opt = ShardedAdamW(list(net.named_parameters()), red.buckets, dist.group.WORLD,
                           lr=0.05, betas=(0.9, 0.95), weight_decay=0.0, tp_group=None,
                           tp_rank=0, overlap_param_gather=True)
        opt.attach(net)
        if mark:
            assert len(net[1]._forward_pre_hooks) == 1
            assert all(not m._forward_pre_hooks for m in net[1].modules() if m is not net[1])
        losses = []
        x = torch.randn(3, 6, generator=torch.Generator().manual_seed(rank))
        for _ in range(3):
            loss = net(x).square().sum()
            red.arm()
            loss.backward()
            opt.step(0.05, 1.0, red.finish())
            losses.append(loss.item())
        opt.settle()
        runs.append((losses, [p.detach().clone() for p in net.parameters()]))
    (l0, p0), (l1, p1) = runs
    assert l0 == l1 and all(torch.equal(a, b) for a, b in zip(p0, p1))
    return True


def test_overlapped_gather_waits_for_a_replayed_layer_as_a_whole():
    assert all(run_distributed(_attach_worker, 2, timeout=300))


def test_refusals_name_the_fix():
    with pytest.raises(UsageError, match="--packing none"):
        parse_args(ARGV + ["--cuda-graphs", "--packing", "documents"])
    with pytest.raises(UsageError, match="drop --recompute-granularity or --cuda-graphs"):
        parse_args(ARGV + ["--cuda-graphs", "--recompute-granularity", "full"])
    with pytest.raises(ValueError, match="no decoder layers"):
        LayerGraphs([])
    for flag in ("--cuda-graphs", "--linear-op-graphs"):    # off CUDA, both by name
        args = parse_args(["--sp-model-kind", "linear", flag])
        with pytest.raises(UsageError, match=f"{flag} replays CUDA graphs: run on GPUs"):
            args.check_graph_flags(cuda=False)
        args.check_graph_flags(cuda=True)


@pytest.mark.parametrize("flags, cuda, cp, on", [
    ([], True, 2, True),                                  # the rule: CP > 1 on GPUs
    ([], False, 2, False),                                # CPU
    ([], True, 1, False),                                 # one CP rank: its host keeps ahead
    (["--sp-model-kind", "softmax"], True, 2, True),
    (["--sp-model-kind", "gated"], True, 2, True),
    (["--packing", "documents"], True, 2, False),         # shapes change every batch
    (["--recompute-granularity", "full"], True, 2, False),
    (["--linear-op-graphs"], True, 2, False),             # the op's own graphs were asked for
    (["--no-cuda-graphs"], True, 2, False),               # a flag given wins
    (["--sp-model-kind", "softmax", "--cuda-graphs"], True, 1, True),
])
def test_cuda_graphs_default_rule(flags, cuda, cp, on):
    """``--cuda-graphs`` unset: on for CP > 1 on GPUs with fixed shapes and no recompute
    (``TrainArgs.resolve_cuda_graphs``); given: as given."""
    args = parse_args(ARGV + flags)
    args.resolve_cuda_graphs(cuda=cuda, cp=cp)
    assert args.cuda_graphs is on


def _train_worker(rank, world, tmp, flags):
    import train
    torch.cuda.set_device(rank)
    argv = ["--sp-model-kind", "hybrid", "--context-parallel-size", str(world),
            "--seq-length", "4096", "--global-batch-size", "2", "--micro-batch-size", "1",
            "--train-iters", "4",
            "--num-layers", "4", "--no-progress-bar", "--log-interval", "1", *flags]
    plain = [r["loss"] for r in train.main(argv + ["--log-dir", f"{tmp}/plain",
                                                   "--no-cuda-graphs"])]
    graphed = [r["loss"] for r in train.main(argv + ["--log-dir", f"{tmp}/graphs",
                                                     "--cuda-graphs"])]
    return plain, graphed


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (device machine)")
@pytest.mark.parametrize("optimizer", ["replicated", "distributed-overlapped"])
def test_train_losses_with_cuda_graphs_on_nccl(tmp_path, optimizer):
    """train.py at CP 2 on NCCL, bf16, the hybrid (linear scans and softmax in the graphs):
    the captured layers give the eager run's losses, two micro-batches a step (their gradients
    accumulated out of the graphs' static buffers); the tolerance is bf16 noise of 4 steps.
    ``distributed-overlapped``: with --use-distributed-optimizer --overlap-param-gather, whose
    parameter gathers a replayed layer waits for as a whole."""
    flags = {"replicated": [], "distributed-overlapped": [
        "--use-distributed-optimizer", "--overlap-param-gather"]}[optimizer]
    out = run_distributed(_train_worker, 2, str(tmp_path), flags, timeout=600, backend="nccl")
    plain, graphed = out[0]
    assert len(plain) == len(graphed) == 4
    assert all(abs(a - b) <= 2e-2 * max(1.0, abs(a)) for a, b in zip(plain, graphed)), \
        (plain, graphed)

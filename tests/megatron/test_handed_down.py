"""Built once, handed down: the options of a command line reach the core attentions and the op
under one name (train.py's and the launcher's), and a packed batch's plan travels with the batch
(one plan per micro-batch, none per layer). One process, a process group of one."""
import argparse

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")

from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

import megatron_patches.args as margs  # noqa: E402
import megatron_patches.core_attention as core  # noqa: E402
import megatron_patches.packing as mpacking  # noqa: E402
from megatron_patches.options import SPOptions  # noqa: E402
from megatron_patches.packing import PLAN_ATTRIBUTE, packed_seq_params  # noqa: E402
from tests.plan_counting import count_plan_calls  # noqa: E402


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ps.initialize_model_parallel()
        yield
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.fixture
def scans(monkeypatch):
    """The ``impl=`` every linear core attention hands the op."""
    seen = []
    op = core.lightning_attention
    monkeypatch.setattr(core, "lightning_attention",
                        lambda *a, impl=None, **kw: seen.append(impl) or op(*a, impl=impl, **kw))
    return seen


def _train_model(argv):
    from sp_train.args import parse_args
    from sp_train.setup import build_model, init_groups
    args = parse_args(argv)
    layout = args.layout(1)
    groups = init_groups(layout)
    return args, layout, build_model(args, layout, groups, 128, bf16=False,
                                     device=torch.device("cpu"))


def test_train_py_options_reach_the_op_under_one_name(one_rank, scans, monkeypatch):
    built = []
    check = SPOptions.__post_init__
    monkeypatch.setattr(SPOptions, "__post_init__", lambda self: built.append(1) or check(self))
    args, _, model = _train_model(["--sp-model-kind", "hybrid", "--sp-hybrid-pattern", "LG",
                                   "--context-parallel-impl", "blelloch"])
    assert model.sp_options is args.sp_options and len(built) == 1     # built once, handed down
    layers = [m for m in model.modules() if isinstance(m, core.LinearCoreAttention)]
    assert [m.context_parallel_impl for m in layers] == ["blelloch"] * 2    # L and G
    tokens = torch.randint(0, 32, (1, args.seq_length))
    model(tokens, torch.arange(args.seq_length)[None], None)
    assert scans == ["blelloch"] * 2


def test_launcher_options_reach_every_layer_once(one_rank, scans, monkeypatch):
    from megatron_patches.model import build_gpt_model
    from megatron_patches.specs import ArgsCoreAttention
    ns = margs.add_arguments(argparse.ArgumentParser()).parse_args(
        ["--sp-model-kind", "hybrid", "--sp-hybrid-pattern", "LS",
         "--context-parallel-impl", "ring", "--softmax-cp-preset", "ring_ag"])
    megatron = dict(num_layers=2, num_attention_heads=4, num_query_groups=2,
                    group_query_attention=True, tensor_model_parallel_size=1,
                    context_parallel_size=1, seq_length=8, spec=None)
    for k, v in megatron.items():
        setattr(ns, k, v)
    options = margs.validate_args(ns)
    built = []
    check = SPOptions.__post_init__
    monkeypatch.setattr(SPOptions, "__post_init__", lambda self: built.append(1) or check(self))
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                               num_query_groups=2, attention_dropout=0.0,
                               use_cpu_initialization=True, params_dtype=torch.float32)
    model = build_gpt_model(config, margs.options_of(ns), vocab_size=32, max_sequence_length=8)
    assert model.sp_options is options
    # the prebuilt spec's layers (Megatron-LM's own pretrain_gpt.py) read the kept options
    monkeypatch.setattr(margs, "options_from_megatron_args", lambda: margs.options_of(ns))
    prebuilt = [ArgsCoreAttention(config=config, layer_number=n,
                                  attn_mask_type=AttnMaskType.causal) for n in (1, 2)]
    assert built == []                                   # no layer checked the options again
    ours = [m for m in model.modules() if isinstance(m, core._CPCoreAttention)]
    for layers in (ours, prebuilt):
        linear, softmax = layers
        assert linear.context_parallel_impl == "ring"
        assert softmax.softmax_schedule == options.softmax_schedule
    model(torch.randint(0, 32, (1, 8)), torch.arange(8)[None], None)
    assert scans == ["ring"]


def test_the_packing_plan_travels_with_the_batch(one_rank, monkeypatch):
    """train.py's packed micro-batches: one plan per micro-batch (built where the batch is
    cut), none per layer; a batch built elsewhere (boundaries only) is planned from them."""
    from sp_train.data import CopyTask, packed_micro_batch
    args, layout, model = _train_model(["--sp-model-kind", "hybrid", "--packing", "documents",
                                        "--global-batch-size", "2", "--num-layers", "4"])
    calls = count_plan_calls(monkeypatch, mpacking)
    data = CopyTask(args.seq_length, args.copy_vocab, args.seed, packed=True)
    rows = data.batch(0, args.global_batch_size)
    outs = []
    for i in range(layout.num_micro_batches):
        tok, pos, _, _, params = packed_micro_batch(rows, slice(i, i + 1), model.sp_context,
                                                    torch.device("cpu"))
        assert getattr(params, PLAN_ATTRIBUTE).cu_seqlens == tuple(params.cu_seqlens_q.tolist())
        outs.append(model(tok, pos, None, packed_seq_params=params))
    assert layout.num_micro_batches == 2 and len(model.sp_options.pattern) == 4
    assert calls == {"plan": 2, "lookup": 0}               # one per batch, none per layer
    # a THD batch built outside the project carries no plan: found from its boundaries
    bare = packed_seq_params(params.cu_seqlens_q)
    assert not hasattr(bare, PLAN_ATTRIBUTE)
    assert torch.equal(model(tok, pos, None, packed_seq_params=bare), outs[-1])
    assert calls["lookup"] == 4                           # the tensor-keyed cache, per layer


def test_linear_op_graphs_reach_the_op(one_rank, monkeypatch):
    """train.py's ``--linear-op-graphs`` reaches the linear and the gated layer's op call as
    their LinearTuning (the gated one with its gate check off: ≤ 0 by construction); the
    header says so. A model without linear layers refuses the flag by name."""
    from sp_attention import build_sp_context
    from sp_train.args import parse_args
    from sp_train.progress import describe_attention
    seen = []
    op = core.lightning_attention
    monkeypatch.setattr(core, "lightning_attention",
                        lambda *a, tuning=None, **kw: seen.append(tuning) or op(*a, tuning=tuning,
                                                                                **kw))
    args, _, model = _train_model(["--sp-model-kind", "hybrid", "--sp-hybrid-pattern", "LG",
                                   "--linear-op-graphs"])
    tokens = torch.randint(0, 32, (1, args.seq_length))
    model(tokens, torch.arange(args.seq_length)[None], None)
    assert [(t.op_graphs, t.check_gate_values) for t in seen] == [(True, True), (True, False)]
    assert describe_attention(args.sp_options, build_sp_context(None)).endswith(
        ", linear ops as CUDA graphs")
    with pytest.raises(ValueError, match="--linear-op-graphs would be ignored"):
        parse_args(["--linear-op-graphs"])
    with pytest.raises(ValueError, match="would only add its own graphs' memory"):
        parse_args(["--sp-model-kind", "linear", "--linear-op-graphs", "--cuda-graphs"])

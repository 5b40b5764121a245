"""Each default lives in one constant, read when it is needed: changing the default layout,
linear scan or softmax preset is a one-line change that every route follows — the library's
(``DEFAULT_PRESET`` for a plain call), and the adapters' (``DEFAULT_SOFTMAX_SCHEDULE``, auto):
Megatron's model (core attention, RoPE, the data context), the launcher's and train.py's
parsed arguments, HF's prepare_model_for_cp."""
import pytest

import sp_attention.context as context
import sp_attention.linear.attention as linear
import sp_attention.softmax.schedule as schedule
from sp_attention import SoftmaxSchedule, SPContext, build_sp_context


def test_library_defaults_follow_their_constants(monkeypatch):
    assert build_sp_context(None).layout == context.DEFAULT_LAYOUT == "zigzag"
    monkeypatch.setattr(context, "DEFAULT_LAYOUT", "contiguous")
    assert build_sp_context(None).layout == "contiguous"
    assert SPContext(None, 0, 1).layout == "contiguous"

    ctx = build_sp_context(None)
    assert linear.resolve_impl(None, ctx) == linear.resolve_impl(linear.DEFAULT_IMPL, ctx)
    monkeypatch.setattr(linear, "DEFAULT_IMPL", "blelloch")
    assert linear.resolve_impl(None, ctx) == "blelloch"

    monkeypatch.setattr(schedule, "DEFAULT_PRESET", "ag_ring")
    s = SoftmaxSchedule()
    assert (s.fwd, s.bwd) == ("allgather", "ring")


def _patch_defaults(monkeypatch):
    import megatron_patches.options as options
    monkeypatch.setattr(context, "DEFAULT_LAYOUT", "contiguous")
    monkeypatch.setattr(linear, "DEFAULT_IMPL", "blelloch")
    monkeypatch.setattr(schedule, "DEFAULT_PRESET", "ag_ring")
    monkeypatch.setattr(options, "DEFAULT_SOFTMAX_SCHEDULE", SoftmaxSchedule("ag_ring"))


def test_the_adapters_default_is_auto_and_auto_on_cpu_is_the_library_default(monkeypatch):
    """train.py, the launcher and HF run ``auto`` unless a preset is named; off CUDA ``auto``
    is the library's DEFAULT_PRESET (read now)."""
    import torch
    from megatron_patches.options import DEFAULT_SOFTMAX_SCHEDULE, SPOptions
    from sp_attention.cost.auto import auto_softmax_preset
    assert DEFAULT_SOFTMAX_SCHEDULE == SoftmaxSchedule("auto")
    assert SPOptions(num_layers=1).softmax_schedule.is_auto
    import sp_attention.planning.schedules as plans
    monkeypatch.setattr(plans, "DEFAULT_PRESET", "ag_ring")
    q = torch.zeros(1, 8, 4, 16)
    ctx = SPContext(None, 0, 1)
    assert auto_softmax_preset(ctx, q, q[:, :, :2]).name == "ag_ring"


def _follows(ctx, sched, impl):
    """ctx in the patched layout, the patched preset's pair, the patched scan."""
    assert ctx.layout == "contiguous"
    assert (sched.fwd, sched.bwd) == ("allgather", "ring")
    assert linear.resolve_impl(impl, ctx) == "blelloch"


def test_megatron_model_follows_the_constants(monkeypatch):
    """build_gpt_model: every core attention and the RoPE share the model's one context."""
    pytest.importorskip("megatron.core")
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron_patches.core_attention import LinearCoreAttention, SoftmaxCoreAttention
    from megatron_patches.model import build_gpt_model, cp_context
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    _patch_defaults(monkeypatch)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                               num_query_groups=2, attention_dropout=0.0,
                               use_cpu_initialization=True, params_dtype=torch.float32)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:                                       # Megatron's groups, world of one, this process
        ps.initialize_model_parallel()
        model = build_gpt_model(config, kind="hybrid", hybrid_pattern="LS", vocab_size=16,
                                max_sequence_length=8)
        assert cp_context().layout == "contiguous"
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    layers = [m for m in model.modules() if isinstance(m, (LinearCoreAttention,
                                                           SoftmaxCoreAttention))]
    assert [type(m) for m in layers] == [LinearCoreAttention, SoftmaxCoreAttention]
    assert all(m.sp_ctx is model.sp_context for m in layers)
    assert model.rotary_pos_emb.sp_ctx is model.sp_context
    _follows(model.sp_context, layers[1].softmax_schedule, layers[0].context_parallel_impl)


def test_both_clis_follow_the_constants(monkeypatch):
    """The launcher's and train.py's parsed arguments: the same defaults (None = the library's,
    read when used) and the sequence-length rule of the layout."""
    import argparse
    from megatron_patches.args import add_arguments, options_from_args
    from sp_train.args import parse_args
    from sp_train.progress import describe_attention
    _patch_defaults(monkeypatch)
    ns = add_arguments(argparse.ArgumentParser()).parse_args(["--sp-model-kind", "hybrid"])
    for k, v in dict(context_parallel_size=2, tensor_model_parallel_size=1, seq_length=6,
                     num_attention_heads=4, num_query_groups=2, group_query_attention=True,
                     num_layers=2).items():
        setattr(ns, k, v)
    opts = options_from_args(ns)               # seq 6 is a multiple of CP 2 when contiguous
    _follows(build_sp_context(None), opts.softmax_schedule, opts.context_parallel_impl)
    args = parse_args(["--sp-model-kind", "hybrid"])
    topts = args.sp_options
    _follows(build_sp_context(None), topts.softmax_schedule, topts.context_parallel_impl)
    assert args.layout(6).cp == 6 and args.seq_length == 258    # 256 up to a multiple of 6, not 12
    assert describe_attention(topts, build_sp_context(None)) == "softmax + linear on one rank (CP 1)"


def test_hf_adapter_follows_the_constants(monkeypatch):
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM
    from models.hf import prepare_model_for_cp
    _patch_defaults(monkeypatch)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1))
    handle = prepare_model_for_cp(model, None)
    _follows(handle.ctx, handle.schedule, handle.context_parallel_impl)
    handle.remove()

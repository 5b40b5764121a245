"""Validation errors (arguments, core-attention options), RoPE positions, the TP cut rule and
the launcher's importability and its message where megatron.training is missing. One process,
no process group (and two launcher processes, as torchrun starts them, where megatron.training
is absent)."""
import argparse
import importlib

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_patches.args import add_arguments, options_from_args, validate_args  # noqa: E402
from megatron_patches.core_attention import LinearCoreAttention, SoftmaxCoreAttention  # noqa: E402
from megatron_patches.options import DEFAULT_SOFTMAX_SCHEDULE  # noqa: E402
from sp_attention import SoftmaxSchedule  # noqa: E402


def _args(*argv, **megatron):
    """Our parser's namespace plus Megatron-LM fields at values that pass validation."""
    ns = add_arguments(argparse.ArgumentParser()).parse_args(list(argv))
    base = dict(context_parallel_size=2, tensor_model_parallel_size=2, seq_length=64,
                num_attention_heads=8, num_query_groups=4, group_query_attention=True,
                num_layers=4, transformer_impl="local", pipeline_model_parallel_size=1,
                attention_dropout=0.0, create_attention_mask_in_dataloader=False,
                reset_attention_mask=False, reset_position_ids=False,
                position_embedding_type="rope",
                apply_rope_fusion=False, cp_comm_type=["p2p"], spec=None,
                no_persist_layer_norm=True)
    base.update(megatron)
    for k, v in base.items():
        setattr(ns, k, v)
    return ns


GOOD = ["--context-parallel-impl", "blelloch", "--sp-model-kind", "hybrid"]

BAD = [  # (our argv, Megatron fields, text the message must contain)
    (GOOD, dict(seq_length=62), "multiple of 4 for --context-parallel-size 2"),
    (GOOD, dict(tensor_model_parallel_size=4, num_attention_heads=6, num_query_groups=2),
     "divisible by --tensor-model"),
    (GOOD, dict(num_query_groups=1), "divisible by --tensor-model"),
    (["--context-parallel-impl", "megatron", "--sp-model-kind", "linear"], {},
     "set --context-parallel-impl"),
    (["--context-parallel-impl", "blelloch", "--sp-model-kind", "softmax"], {},
     "use --context-parallel-impl auto"),
    (["--context-parallel-impl", "megatron", "--softmax-cp-preset", "ring_ag"], {},
     "would be ignored"),
    (["--context-parallel-impl", "auto", "--sp-model-kind", "linear",
      "--softmax-cp-preset", "ring"], {}, "would be ignored"),
    (GOOD + ["--softmax-cp-preset", "ring", "--softmax-heads-k-stride", "2"], {},
     "bwd='ring' would ignore it"),
    (GOOD + ["--softmax-cp-preset", "ring_ag", "--softmax-heads-k-stride", "3"], {},
     "must divide"),
    (GOOD + ["--softmax-cp-preset", "ring", "--softmax-bwd-head-first-stride", "1"], {},
     "only applies to bwd='allgather'"),
    (GOOD + ["--softmax-cp-preset", "ring_ag", "--softmax-heads-k-stride", "2",
             "--softmax-bwd-head-first-stride", "2"], {}, "--softmax-bwd-head-first/last"),
    (["--context-parallel-impl", "ring"], {}, "--softmax-cp-preset ring sets"),
    (["--sp-slope-schedule", "lightning"], {}, "no linear layer"),
    (["--context-parallel-impl", "megatron", "--sp-slope-schedule", "lightning"], {},
     "would be ignored"),
    (GOOD + ["--sp-hybrid-pattern", "LLS"], {}, "--sp-hybrid-pattern"),
    (GOOD, dict(transformer_impl="transformer_engine"), "--transformer-impl local"),
    (GOOD, dict(no_persist_layer_norm=False), "--no-persist-layer-norm"),
    (GOOD, dict(pipeline_model_parallel_size=2), "--pipeline-model-parallel-size 1"),
    (GOOD, dict(attention_dropout=0.1), "--attention-dropout 0"),
    (GOOD, dict(create_attention_mask_in_dataloader=True),
     "--no-create-attention-mask-in-dataloader"),
    (GOOD, dict(reset_attention_mask=True), "pass --reset-position-ids too"),
    (["--context-parallel-impl", "megatron"], dict(reset_attention_mask=True,
                                                   reset_position_ids=True),
     "for our attention only"),
    (GOOD, dict(apply_rope_fusion=True), "--no-rope-fusion"),
    (GOOD, dict(position_embedding_type="yarn"), "rope or learned_absolute"),
    (GOOD, dict(cp_comm_type=["p2p", "a2a"]), "--cp-comm-type p2p a2a: give one of"),
    (GOOD + ["--softmax-cp-preset", "ring"], dict(cp_comm_type=["a2a"]),
     "means --softmax-cp-preset a2a"),
    (GOOD, dict(cp_comm_type=["a2a+p2p"], hierarchical_context_parallel_sizes=[2, 2]),
     "whose product is --context-parallel-size 2"),
    (GOOD, dict(hierarchical_context_parallel_sizes=[2, 1]), "would be ignored"),
    (GOOD, dict(cp_comm_type=["a2a+p2p"]), "needs a2a_size"),
    (GOOD + ["--softmax-cp-preset", "a2a"], dict(num_attention_heads=6, num_query_groups=2),
     "splits the 3 local query heads over 2 ranks"),
    (GOOD + ["--softmax-cp-preset", "ring", "--softmax-a2a-size", "2"], {},
     "only applies to preset 'a2a_ring'"),
    (["--context-parallel-impl", "megatron"], dict(spec=["megatron_patches.specs",
                                                         "hybrid_layer_spec"]), "--spec"),
    (GOOD, dict(spec=["megatron_patches.specs", "nope"]), "hybrid_layer_spec"),
]


@pytest.mark.parametrize("argv,megatron,message", BAD, ids=[b[2][:30] for b in BAD])
def test_each_bad_argument_names_the_fix(argv, megatron, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        validate_args(_args(*argv, **megatron))


def test_good_arguments_give_options():
    # documents split at EOD: both reset flags together are honoured (THD batches)
    validate_args(_args(*GOOD, reset_attention_mask=True, reset_position_ids=True))
    opts = options_from_args(_args(*GOOD, "--softmax-cp-preset", "ring_ag",
                                   "--softmax-heads-k-stride", "2",
                                   "--softmax-bwd-head-first-stride", "1"))
    assert opts.context_parallel_impl == "blelloch" and opts.pattern == "LLLS"
    assert opts.softmax_schedule == SoftmaxSchedule("ring_ag", heads_k_stride=2,
                                                    bwd_head_first_stride=1)
    spec = options_from_args(_args("--context-parallel-impl", "auto",
                                   spec=["megatron_patches.specs", "linear_layer_spec"]))
    assert spec.model_kind == "linear" and spec.pattern == "LLLL"
    # the defaults: our attention, the library's scan (None), the softmax schedule auto
    plain = options_from_args(_args())
    assert plain.context_parallel_impl is None and plain.pattern == "SSSS"
    assert plain.softmax_schedule == SoftmaxSchedule("auto") == DEFAULT_SOFTMAX_SCHEDULE
    # strides and a2a_size without a preset go to auto (they apply where its pick uses them)
    got = options_from_args(_args(*GOOD, "--softmax-heads-k-stride", "2")).softmax_schedule
    assert got == SoftmaxSchedule("auto", heads_k_stride=2)
    mega = options_from_args(_args("--context-parallel-impl", "megatron"))
    assert mega.megatron_attention and mega.model_kind == "softmax"
    hyb = options_from_args(_args("--sp-model-kind", "hybrid", num_layers=6))
    assert hyb.pattern == "LLSLLS"                   # the default pattern fits 6 layers
    # Megatron-LM's own names for the softmax CP schedule
    for comm, preset in (("p2p", None), ("all_gather", "allgather"), ("a2a", "a2a")):
        got = options_from_args(_args(cp_comm_type=[comm])).softmax_schedule
        assert got == SoftmaxSchedule(preset or "auto"), comm   # p2p: Megatron's default
    usp = options_from_args(_args(cp_comm_type=["a2a+p2p"], context_parallel_size=4,
                                  seq_length=64, hierarchical_context_parallel_sizes=[2, 2]))
    assert usp.softmax_schedule == SoftmaxSchedule("a2a_ring", a2a_size=2)
    assert options_from_args(_args("--softmax-cp-preset", "a2a_ring", "--softmax-a2a-size", "2",
                                   context_parallel_size=4)).softmax_schedule.a2a_size == 2


def _config(**kw):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                attention_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float32)
    base.update(kw)
    return TransformerConfig(**base)


def _make(cls, config=None, **kw):
    return cls(config=config or _config(), layer_number=1,
               attn_mask_type=kw.pop("attn_mask_type", AttnMaskType.causal),
               attention_type="self", cp_comm_type=None, softmax_scale=None,
               pg_collection=None, **kw)


@pytest.mark.parametrize("cls", [SoftmaxCoreAttention, LinearCoreAttention])
def test_core_attention_refuses_what_it_cannot_honour(cls):
    with pytest.raises(ValueError, match="attention_dropout=0.0"):
        _make(cls, _config(attention_dropout=0.1))
    with pytest.raises(ValueError, match="attention_dropout=0.0"):
        _make(cls, attention_dropout=0.2)
    with pytest.raises(ValueError, match="only causal"):
        _make(cls, attn_mask_type=AttnMaskType.no_mask)
    with pytest.raises(ValueError, match="window_size=None"):
        _make(cls, _config(window_size=(8, 0)))
    ca = _make(cls)
    q = torch.randn(8, 1, 4, 8)
    kv = torch.randn(8, 1, 2, 8)
    out = ca(q, kv, kv, None)
    assert out.shape == (8, 1, 32)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    calls = [
        (dict(attention_mask=torch.ones(1, 1, 8, 8, dtype=torch.bool)),
         "--no-create-attention-mask-in-dataloader"),
        (dict(attention_bias=torch.zeros(1, 4, 8, 8)), "attention_bias"),
        (dict(packed_seq_params=PackedSeqParams(qkv_format="thd")), "neither cu_seqlens_q"),
        (dict(packed_seq_params=PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu)),
         "qkv_format='thd'"),
        (dict(packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu,
                                                local_cp_size=2)), "local_cp_size"),
        (dict(attn_mask_type=AttnMaskType.padding), "only causal"),
    ]
    for kwargs, message in calls:
        mask = kwargs.pop("attention_mask", None)
        with pytest.raises(ValueError, match=message):
            ca(q, kv, kv, mask, **kwargs)


def test_thd_batches():
    """THD: [t, np, hn] in, [t, np·hn] out, each document alone; _padded boundaries win; q/kv
    boundaries must agree; a row whose boundaries do not fill CP × t raises with the fix."""
    from megatron_patches.packing import eod_cu_seqlens, plan_of
    ca = _make(SoftmaxCoreAttention)
    q, kv = torch.randn(8, 4, 8, dtype=torch.float64), torch.randn(8, 2, 8, dtype=torch.float64)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    out = ca(q, kv, kv, None, packed_seq_params=PackedSeqParams(qkv_format="thd",
                                                                cu_seqlens_q=cu, cu_seqlens_kv=cu))
    assert out.shape == (8, 32)
    k = kv.repeat_interleave(2, 1).transpose(0, 1)
    for a, b in ((0, 3), (3, 8)):
        alone = torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[:, a:b], k[:, a:b], is_causal=True)
        assert torch.allclose(out[a:b], alone.transpose(0, 1).reshape(b - a, -1), atol=1e-12)
    padded = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 2, 6]),
                             cu_seqlens_q_padded=cu)
    assert plan_of(padded, ca.sp_ctx, 8).cu_seqlens == (0, 3, 8)
    with pytest.raises(ValueError, match="cu_seqlens_kv differs"):
        plan_of(PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu,
                                cu_seqlens_kv=torch.tensor([0, 4, 8])), ca.sp_ctx, 8)
    with pytest.raises(ValueError, match="CP × t = 1 × 8"):
        plan_of(PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 3, 9])),
                ca.sp_ctx, 8)
    # Megatron's --reset-attention-mask rule: an EOD ends its document, and so does a row
    tokens = torch.tensor([[5, 9, 1, 9], [9, 2, 3, 4]])
    assert eod_cu_seqlens(tokens, 9).tolist() == [0, 2, 4, 5, 8]


def test_bad_options():
    """The rules between options are SPOptions' (build_gpt_model builds one from its keywords
    and the config); a core attention built by hand meets the library's own checks."""
    q, kv = torch.randn(8, 1, 4, 8), torch.randn(8, 1, 2, 8)
    with pytest.raises(ValueError, match="unknown linear-attention scan impl 'tree'"):
        _make(LinearCoreAttention, context_parallel_impl="tree")(q, kv, kv, None)
    with pytest.raises(ValueError, match="slope schedule 'alibi'"):
        _make(LinearCoreAttention, slope_schedule="alibi")
    with pytest.raises(ValueError, match="divisor of the 2 local KV heads"):
        _make(SoftmaxCoreAttention, softmax_schedule={"preset": "allgather",
                                                      "heads_k_stride": 4})(q, kv, kv, None)
    with pytest.raises(TypeError, match="SoftmaxSchedule"):
        _make(SoftmaxCoreAttention, softmax_schedule="ring")
    from megatron_patches.model import build_gpt_model
    from megatron_patches.options import SPOptions
    for kw, message in ((dict(kind="mamba"), "--sp-model-kind mamba"),
                        (dict(context_parallel_impl="x"), "--context-parallel-impl x"),
                        (dict(position_embedding_type="yarn"), "position_embedding_type"),
                        (dict(kind="hybrid", hybrid_pattern="LLS"), "--sp-hybrid-pattern"),
                        (dict(kind="softmax", softmax_schedule=SoftmaxSchedule(
                            "allgather", heads_k_stride=4)), "--softmax-heads-k-stride 4")):
        args = dict(kind="linear", vocab_size=16, max_sequence_length=8)
        args.update(kw)
        with pytest.raises(ValueError, match=message):
            build_gpt_model(_config(), **args)
    with pytest.raises(ValueError, match="num_layers 4 .the model: 2."):
        build_gpt_model(_config(), SPOptions(4), vocab_size=16, max_sequence_length=8)
    with pytest.raises(TypeError, match="not both"):
        build_gpt_model(_config(), SPOptions(2), kind="linear", vocab_size=16,
                        max_sequence_length=8)


def test_linear_gqa_expansion_uses_megatron_group_mapping():
    """Query head i reads KV group i // (np / ng): the same as feeding expanded K/V."""
    ca = _make(LinearCoreAttention)
    q, kv = torch.randn(8, 2, 4, 8), torch.randn(8, 2, 2, 8)
    ref = _make(LinearCoreAttention, _config(num_query_groups=4))
    full = kv[:, :, [0, 0, 1, 1]]
    assert torch.allclose(ca(q, kv, kv, None), ref(q, full, full, None), atol=1e-6)


def test_rope_positions_match_megatron_and_follow_position_ids():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron_patches.rotary import CPRotaryEmbedding
    ours = CPRotaryEmbedding(16, rotary_base=500)
    theirs = RotaryEmbedding(16, 1.0, rotary_base=500, use_cpu_initialization=True)
    f = theirs.get_freqs_non_repeated(12)
    assert torch.allclose(ours(12), torch.cat((f, f), -1)[:, None, None, :])
    ours.position_ids = torch.tensor([[3, 4, 9], [0, 1, 2]])
    emb = ours(3)
    assert emb.shape == (3, 2, 1, 16)
    assert torch.allclose(emb[:, 0, 0], torch.cat((f, f), -1)[[3, 4, 9]])


def test_packed_rope_rotates_by_the_formula_and_reuses_cos_sin_per_positions():
    """rotate (THD batches): Megatron's non-interleaved rotation at the given positions, with
    and without channels past the rotary dim; cos/sin are made once per positions tensor and
    dtype (every layer of a batch passes its plan's one tensor) and anew when the tensor, its
    values or the dtype change; the frequencies are copied to a device once."""
    from megatron_patches.rotary import CPRotaryEmbedding, rope_inv_freq

    def want(x, pos, rot):
        f = pos.float()[:, None] * rope_inv_freq(rot, 500.0)     # fp32 angles, as Megatron's
        f = torch.cat((f, f), -1)[:, None, :].double()
        xr = x[..., :rot].double()
        x1, x2 = xr.chunk(2, -1)
        out = xr * f.cos() + torch.cat((-x2, x1), -1) * f.sin()
        return torch.cat((out, x[..., rot:].double()), -1)

    g = torch.Generator().manual_seed(0)
    pos = torch.tensor([0, 1, 2, 0, 1, 5, 6, 0])
    for dim, rope in ((16, CPRotaryEmbedding(16, rotary_base=500)),
                      (20, CPRotaryEmbedding(20, rotary_percent=0.8, rotary_base=500))):
        x = torch.randn(1, 8, 3, dim, generator=g, dtype=torch.float64)
        torch.testing.assert_close(rope.rotate(x, pos), want(x, pos, 16))
        first = rope.cos_sin(pos, torch.float64)
        assert all(a is b for a, b in zip(rope.cos_sin(pos, torch.float64), first))
        assert rope.cos_sin(pos.clone(), torch.float64)[0] is not first[0]
        other = pos.clone()
        rope.cos_sin(other, torch.float64)
        other[1] = 7                                       # same tensor, new values
        torch.testing.assert_close(rope.rotate(x, other), want(x, other, 16))
        assert rope.cos_sin(other, torch.float32)[0].dtype == torch.float32
        assert list(rope._inv_freq_on) == [torch.device("cpu")]
    with torch.inference_mode():                          # no version counter: made anew
        frozen = pos.clone()
        a = rope.cos_sin(frozen, torch.float64)
        frozen[1] = 9
        torch.testing.assert_close(rope.rotate(x, frozen), want(x, frozen, 16))
        assert rope.cos_sin(frozen, torch.float64)[0] is not a[0]


@pytest.mark.gpu
def test_packed_rope_on_a_gpu_waits_for_nothing_after_its_first_call():
    """On CUDA a rotate after the first makes no host sync (the frequencies' copy to the GPU,
    once per device, waited for the GPU's whole queue at every layer before): run under
    torch's sync debug mode, which raises at any synchronizing call."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    from megatron_patches.rotary import CPRotaryEmbedding
    rope = CPRotaryEmbedding(64, rotary_base=500)
    x = torch.randn(1, 256, 4, 64, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(256, device="cuda") % 100
    first = rope.rotate(x, pos)
    other = pos.flip(0)                        # new positions: cos/sin made anew, on the GPU
    torch.cuda.set_sync_debug_mode("error")
    try:
        again, flipped = rope.rotate(x, pos), rope.rotate(x, other)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(again, first) and not torch.equal(flipped, first)


def test_tp_cut_honours_partition_stride():
    from megatron_patches.model import _tp_slice
    full = torch.arange(8.0)[:, None]                  # SwiGLU fc1: [gate 0..3; up 4..7]
    assert _tp_slice(full, 0, 2, 0, 2).flatten().tolist() == [0, 1, 4, 5]
    assert _tp_slice(full, 0, 2, 1, 2).flatten().tolist() == [2, 3, 6, 7]
    assert _tp_slice(full, 0, 1, 1, 2).flatten().tolist() == [4, 5, 6, 7]


def test_launcher_imports_without_megatron_training():
    mod = importlib.import_module("megatron_patches.pretrain_gpt")
    assert callable(mod.main) and callable(mod.model_provider)
    # batches are split with the model's own context, found inside Megatron's wrappers
    inner = torch.nn.Module()
    inner.sp_context = object()
    wrapped = torch.nn.Module()
    wrapped.module = torch.nn.Module()
    wrapped.module.module = inner
    assert mod.model_context([wrapped]) is inner.sp_context


def test_launcher_names_what_it_needs_once():
    """Python 3.11 resolves megatron-core 0.16.1, which has no megatron.training: the launcher
    says so once (rank 0), with the fix, and every rank exits non-zero (not a
    ModuleNotFoundError per rank).

    The ranks run as torchrun starts them (its RANK, LOCAL_RANK, WORLD_SIZE, … environment),
    as two plain processes side by side: under torchrun itself, the agent stops the other
    ranks as soon as one exits non-zero, so whether rank 0's line is written before it is
    stopped would depend on how busy the machine is. The time limit is a hang detector
    (``run_process``: seconds without any CPU progress), not a wall-clock limit."""
    import os
    import subprocess
    import sys
    from importlib.util import find_spec
    from megatron_patches.pretrain_gpt import missing_requirement
    from sp_attention.testing import finish_process
    msg = missing_requirement((3, 11, 7), "0.16.1", False)
    for text in ("megatron-core >= 0.18", "Python >= 3.12", 'pip install "megatron-core>=0.18"',
                 "Python 3.11.7 with megatron-core 0.16.1", "train.py"):
        assert text in msg, (text, msg)
    assert "megatron-core 0.17.0" in missing_requirement((3, 12, 1), "0.17.0", True)
    assert missing_requirement((3, 12, 1), "0.19.2", True) is None
    if find_spec("megatron.training") is not None:
        return      # a machine that has it (the GPU one): nothing more to refuse here
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", GROUP_RANK="0",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
        procs.append(subprocess.Popen([sys.executable, "-m", "megatron_patches.pretrain_gpt",
                                       "--help"], cwd=root, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outs = [(p, "".join(finish_process(p, timeout=300))) for p in procs]
    for rank, (p, text) in enumerate(outs):
        assert p.returncode == 2 and "ModuleNotFoundError" not in text, (rank, text[-3000:])
    said = [text.count("needs megatron-core >= 0.18 and Python >= 3.12") for _, text in outs]
    assert said == [1, 0], [text[-3000:] for _, text in outs]


def test_prebuilt_spec_core_attention_follows_the_pattern(monkeypatch):
    """``--spec megatron_patches.specs hybrid_layer_spec``: each layer's kind from the pattern."""
    import megatron_patches.args as margs
    from megatron_patches.specs import ArgsCoreAttention
    opts = options_from_args(_args(*GOOD, tensor_model_parallel_size=1, context_parallel_size=1))
    monkeypatch.setattr(margs, "options_from_megatron_args", lambda: opts)
    config = _config(num_layers=4)
    kinds = [type(ArgsCoreAttention(config=config, layer_number=n,
                                    attn_mask_type=AttnMaskType.causal, attention_type="self",
                                    cp_comm_type=None, softmax_scale=None, pg_collection=None))
             for n in (1, 2, 3, 4)]
    assert kinds == [LinearCoreAttention] * 3 + [SoftmaxCoreAttention]
    linear = ArgsCoreAttention(config=config, layer_number=4, attn_mask_type=AttnMaskType.causal,
                               kind="linear")
    assert isinstance(linear, LinearCoreAttention) and linear.context_parallel_impl == "blelloch"


def test_public_api_is_pinned():
    import megatron_patches.args as a
    import megatron_patches.core_attention as c
    import megatron_patches.model as m
    import megatron_patches.specs as s
    assert set(m.__all__) == {"build_gpt_model", "model_options", "KINDS", "POSITION_EMBEDDINGS",
                              "tp_shard_state_dict", "grad_reduce_group", "cp_context",
                              "layer_pattern", "global_loss_share", "HiddenStatesGPTModel",
                              "output_weight", "auto_picks"}
    assert {"SoftmaxCoreAttention", "LinearCoreAttention"} <= set(c.__all__)
    assert {"patch_core_attention", "layer_spec", "block_spec", "softmax_layer_spec",
            "linear_layer_spec", "hybrid_layer_spec"} <= set(s.__all__)
    assert {"add_arguments", "validate_args"} <= set(a.__all__)
    for mod in (a, c, m, s):
        assert all(hasattr(mod, n) for n in mod.__all__), mod.__name__

"""The HF route's pure pieces (no process group): train.py's ``--load-hf`` flags, the weight
conversions, RoPE scaling against transformers' own, and the first hour's small fixes that
need no launch (log folders, the header's schedule, memory labels, checkpoint refusals)."""
import json
import math
import os

import pytest
import torch

from megatron_patches.weights import (HFArchitecture, hf_to_megatron, megatron_to_hf, tp_merge,
                                      tp_partition, tp_slice)
from sp_train import checkpoint as ckpt
from sp_train.args import UsageError, parse_args

CONFIG = dict(model_type="sp_linear_llama", vocab_size=64, hidden_size=32,
              intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=8192, rms_norm_eps=1e-6,
              layer_kinds=["linear", "gated", "softmax", "linear"], slope_schedule="lightning",
              out_norm_per_head=True, tie_word_embeddings=False,
              rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 1024})


def _hf_dir(tmp_path, **changes):
    d = tmp_path / "hf"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({**CONFIG, **changes}))
    return str(d)


def test_load_hf_takes_the_architecture_from_config_json(tmp_path):
    d = _hf_dir(tmp_path)
    a = parse_args(["--load-hf", d])
    assert (a.num_layers, a.hidden_size, a.num_attention_heads, a.num_query_groups,
            a.ffn_hidden_size, a.sp_model_kind, a.layer_kinds()) == (4, 32, 4, 2, 48, "hybrid",
                                                                     "LGSL")
    assert a.sp_slope_schedule == "lightning" and a.norm_epsilon == 1e-6
    assert a.rotary_base == 5e5 and a.rope_scaling["rope_type"] == "llama3"
    assert a.seq_length == 4096                       # the config's context, up to 4096
    same = parse_args(["--load-hf", d, "--num-layers", "4", "--sp-hybrid-pattern", "LGSL"])
    assert same.layer_kinds() == "LGSL"
    longer = parse_args(["--load-hf", d, "--seq-length", "65536", "--rotary-base", "8e6",
                         "--rope-scaling-factor", "32"])
    assert longer.rotary_base == 8e6 and longer.rope_scaling["factor"] == 32
    assert longer.rope_scaling["original_max_position_embeddings"] == 1024


@pytest.mark.parametrize("flags, named", [
    (["--num-layers", "2"], "--num-layers 2 contradicts --load-hf"),
    (["--sp-model-kind", "linear"], "--sp-model-kind linear contradicts"),
    (["--sp-hybrid-pattern", "LS"], "--sp-hybrid-pattern LS contradicts"),
    (["--vocab-size", "128"], "--vocab-size 128 contradicts"),
    (["--preset", "1b"], "--preset and --load-hf both give the model's shape"),
])
def test_load_hf_refuses_a_contradicting_flag_by_name(tmp_path, flags, named):
    with pytest.raises(UsageError, match=named):
        parse_args(["--load-hf", _hf_dir(tmp_path), *flags])


@pytest.mark.parametrize("change, named", [
    (dict(attention_bias=True), "attention_bias=True is not supported"),
    (dict(model_type="mistral"), "model_type 'mistral' is not supported"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
     "RoPE type 'yarn' is not supported"),
])
def test_load_hf_refuses_what_the_model_cannot_honour(tmp_path, change, named):
    with pytest.raises(UsageError, match=named):
        parse_args(["--load-hf", _hf_dir(tmp_path, **change)])
    with pytest.raises(UsageError, match="no config.json"):
        parse_args(["--load-hf", str(tmp_path)])


def test_an_odd_head_dim_is_refused_at_the_flag_check():
    with pytest.raises(UsageError, match="head dim 25: RoPE rotates pairs of channels.*"
                       "--hidden-size 104"):
        parse_args(["--hidden-size", "100"])


def test_weights_round_trip_through_megatron_names_and_tp():
    arch = HFArchitecture.from_config(CONFIG)
    g = torch.Generator().manual_seed(0)
    hf = {}
    for i, kind in enumerate(arch.layer_kinds):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj.weight", (32, 32)),
                            ("self_attn.k_proj.weight", (16, 32)),
                            ("self_attn.v_proj.weight", (16, 32)),
                            ("self_attn.o_proj.weight", (32, 32)),
                            ("mlp.gate_proj.weight", (48, 32)), ("mlp.up_proj.weight", (48, 32)),
                            ("mlp.down_proj.weight", (32, 48)), ("input_layernorm.weight", (32,)),
                            ("post_attention_layernorm.weight", (32,))):
            hf[p + name] = torch.randn(shape, generator=g)
        if kind != "softmax":
            hf[p + "self_attn.o_norm.weight"] = torch.randn(32, generator=g)
        if kind == "gated":
            hf[p + "self_attn.gate_proj.weight"] = torch.randn(4, 32, generator=g)
            hf[p + "self_attn.A_log"] = torch.randn(4, generator=g)
            hf[p + "self_attn.dt_bias"] = torch.randn(4, generator=g)
    for name, shape in (("model.embed_tokens.weight", (64, 32)), ("model.norm.weight", (32,)),
                        ("lm_head.weight", (64, 32))):
        hf[name] = torch.randn(shape, generator=g)
    mg = hf_to_megatron(dict(hf), arch)
    # Megatron's qkv: per KV group [its 2 query heads, k, v] of 8 rows each
    qkv = mg["decoder.layers.0.self_attention.linear_qkv.weight"].view(2, 4, 8, 32)
    assert torch.equal(qkv[1, 0], hf["model.layers.0.self_attn.q_proj.weight"][16:24])
    assert torch.equal(qkv[1, 2], hf["model.layers.0.self_attn.k_proj.weight"][8:16])
    assert torch.equal(qkv[0, 3], hf["model.layers.0.self_attn.v_proj.weight"][0:8])
    back = megatron_to_hf(mg, arch)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)
    for tp in (2, 4):             # cut as Megatron cuts, joined back
        shards = [{k: tp_slice(v, *tp_partition(k), r, tp) if tp_partition(k) else v
                   for k, v in mg.items()} for r in range(tp)]
        merged = tp_merge(shards)
        assert all(torch.equal(merged[k], mg[k]) for k in mg)
    fc1 = tp_slice(mg["decoder.layers.0.mlp.linear_fc1.weight"], 0, 2, 1, 2)   # [gate_1; up_1]
    assert torch.equal(fc1[:24], hf["model.layers.0.mlp.gate_proj.weight"][24:])
    with pytest.raises(ValueError, match="has no place for: model.extra"):
        hf_to_megatron(dict(hf, **{"model.extra": torch.zeros(1)}), arch)


def test_rope_scaling_equals_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megatron_patches.rotary import rope_inv_freq
    for rope in (dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                      high_freq_factor=4.0, original_max_position_embeddings=256),
                 dict(rope_type="linear", factor=4.0)):
        cfg = LlamaConfig(hidden_size=512, num_attention_heads=4, max_position_embeddings=4096,
                          rope_parameters=dict(rope, rope_theta=5e5))
        want, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, "cpu")
        scaling = {k: v for k, v in rope.items()}
        assert torch.equal(rope_inv_freq(128, 5e5, scaling), want)


def test_log_folders_belong_to_their_run(tmp_path):
    from sp_train.progress import claim_log_dir, log_dir_refusal, release_log_dir
    log = str(tmp_path / "runs" / "log.jsonl")
    me = {"model": {"model_kind": "gated"}, "data": "copy", "save": None}
    other = {"model": {"model_kind": "softmax"}, "data": "copy", "save": None}
    assert log_dir_refusal(log, me, resumed=True) is None          # nothing there yet
    claim_log_dir(log, other, fresh=True)
    open(log, "w").write('{"step": 1, "loss": 3.0}\n')
    msg = log_dir_refusal(log, me, resumed=True)                    # would append to softmax's
    assert "holds the log of another run" in msg and "'softmax'} there" in msg
    owner = tmp_path / "runs" / "run.json"          # the owner, still running (another pid)
    owner.write_text(json.dumps(dict(json.loads(owner.read_text()), pid=os.getppid())))
    assert "being written by another run" in log_dir_refusal(log, me, resumed=False)
    release_log_dir(log)
    assert log_dir_refusal(log, me, resumed=False) is None          # a finished run's log
    claim_log_dir(log, me, fresh=True)
    assert not os.path.exists(log) and log_dir_refusal(log, me, resumed=True) is None
    assert parse_args([]).log_json == os.path.join("runs", "softmax", "log.jsonl")
    assert parse_args(["--local-attention-only", "--sp-model-kind", "gated"]).log_dir == \
        os.path.join("runs", "gated-local")


def test_the_header_names_what_auto_picked():
    from megatron_patches.options import SPOptions
    from sp_attention import SoftmaxSchedule, build_sp_context
    from sp_train.progress import describe_attention
    ctx = build_sp_context(None)
    opts = SPOptions(num_layers=2, model_kind="hybrid", hybrid_pattern="LS")
    object.__setattr__(ctx, "world_size", 4)        # a stand-in for a CP group of 4
    text = describe_attention(opts, ctx, picks={"linear": "allgather", "softmax": "a2a"})
    assert "linear scan auto → allgather" in text and "softmax auto → a2a" in text
    named = SPOptions(num_layers=2, model_kind="hybrid", hybrid_pattern="LS",
                      softmax_schedule=SoftmaxSchedule("ring"))
    text = describe_attention(named, ctx, picks={"linear": "allgather", "softmax": "ring"})
    assert "softmax ring +" in text


def test_memory_labels_and_checkpoint_refusals(tmp_path):
    from sp_train.setup import memory_capacity
    cap, where = memory_capacity(torch.device("cpu"))
    assert cap is None or (cap > 0 and where.startswith("available RAM"))
    with pytest.raises(ckpt.CheckpointError, match="saved with layout TP1"):
        ckpt.check_compatible({"tp": 1, "cp": 1, "dp": 1, "model": {}}, "p", tp=2, cp=1, dp=1,
                              model={})
    ckpt.require_checkpoint(str(tmp_path), str(tmp_path), None)     # = --save: a first run
    with pytest.raises(ckpt.CheckpointError, match="--load .* holds no checkpoint"):
        ckpt.require_checkpoint(str(tmp_path), None, None)
    assert math.isfinite(len(where))


def test_sharded_and_single_file_checkpoints_read_alike(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_patches.weights import read_hf_weights
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2))
    model.save_pretrained(tmp_path / "one")
    model.save_pretrained(tmp_path / "many", max_shard_size="20KB")
    assert (tmp_path / "many" / "model.safetensors.index.json").exists()
    one, many = read_hf_weights(str(tmp_path / "one")), read_hf_weights(str(tmp_path / "many"))
    assert one.keys() == many.keys() and all(torch.equal(one[k], many[k]) for k in one)
    (tmp_path / "bin").mkdir()
    with pytest.raises(ValueError, match="no model.safetensors"):
        read_hf_weights(str(tmp_path / "bin"))

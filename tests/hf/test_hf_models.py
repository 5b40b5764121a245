"""HF integration in one process: generate() after registration at CP = 1, save_pretrained /
from_pretrained round trips of the linear, hybrid and gated variants, config checks, a gated
layer against the gated recurrence written here."""
from __future__ import annotations

import copy

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

from models.hf import (LinearLlamaConfig, LinearLlamaForCausalLM, hybrid_layer_kinds,  # noqa: E402
                       prepare_model_for_cp, register_auto_classes)
from sp_attention.testing import rel_rms  # noqa: E402


def _tiny(cls_config=LlamaConfig, **extra):
    return cls_config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      **extra)


@pytest.mark.parametrize("kind", ["llama", "linear", "hybrid"])
def test_generate_after_registration(kind):
    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(_tiny())
    else:
        kinds = None if kind == "linear" else hybrid_layer_kinds(2, 2)
        model = LinearLlamaForCausalLM(_tiny(LinearLlamaConfig, layer_kinds=kinds))
    prepared = copy.deepcopy(model)
    prepare_model_for_cp(prepared, None)
    prompt = torch.randint(0, 64, (1, 7))        # odd length: CP = 1 takes any length
    want = model.generate(prompt, max_new_tokens=6, do_sample=False)
    got = prepared.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)
    # the cached decode path gives the logits of a full forward
    full = model(want).logits
    steps = prepared(want, use_cache=False).logits
    assert rel_rms(steps, full) < 1e-5


@pytest.mark.parametrize("kinds", [None, ["linear", "softmax"], ["gated", "softmax"]])
def test_save_load_round_trip(tmp_path, kinds):
    torch.manual_seed(0)
    model = LinearLlamaForCausalLM(_tiny(LinearLlamaConfig, layer_kinds=kinds,
                                         slope_schedule="lightning"))
    model.save_pretrained(tmp_path)
    loaded = LinearLlamaForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.layer_kinds == model.config.layer_kinds
    assert loaded.config.slope_schedule == "lightning"
    register_auto_classes()
    auto = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(auto) is LinearLlamaForCausalLM
    ids = torch.randint(0, 64, (2, 10))
    want = model(ids).logits
    for other in (loaded, auto):
        torch.testing.assert_close(other(ids).logits, want, rtol=0, atol=0)
        prepare_model_for_cp(other, None)       # prepared after loading: same numbers
        assert rel_rms(other(ids, use_cache=False).logits, want) < 1e-5
    if kinds and "gated" in kinds:              # the gate's parameters are weights, saved
        a, b = model.model.layers[0].self_attn, loaded.model.layers[0].self_attn
        for name in ("A_log", "dt_bias", "gate_proj.weight"):
            assert torch.equal(a.get_parameter(name), b.get_parameter(name)), name


def test_gated_layer_is_the_gated_recurrence():
    """A gated layer's attention equals ``S_t = exp(g_t) S_{t−1} + k_tᵀ v_t``,
    ``o_t = q_t S_t / √d`` with ``g = −exp(A_log)·softplus(x W + dt_bias)``, written here
    (fp64); the fresh gates follow Mamba2's initialisation ranges."""
    import torch.nn.functional as F
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    torch.manual_seed(0)
    config = _tiny(LinearLlamaConfig, layer_kinds=["gated", "linear"])
    model = LinearLlamaForCausalLM(config).double()
    layer = model.model.layers[0].self_attn
    assert torch.all((layer.A_log.exp() >= 1) & (layer.A_log.exp() <= 16))
    dt = F.softplus(layer.dt_bias)
    assert torch.all((dt >= 1e-4 - 1e-12) & (dt <= 0.1 + 1e-12))
    x = torch.randn(1, 9, 32, dtype=torch.float64)
    pos = torch.arange(9)[None]
    cos_sin = LlamaRotaryEmbedding(config)(x, pos)
    got, _ = layer(x, position_embeddings=cos_sin)
    # the recurrence
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    d, heads = layer.head_dim, layer.num_heads
    q = layer.q_proj(x).view(1, 9, heads, d).transpose(1, 2)
    k = layer.k_proj(x).view(1, 9, 2, d).transpose(1, 2)
    v = layer.v_proj(x).view(1, 9, 2, d).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, *cos_sin)
    k, v = k.repeat_interleave(2, 1)[0], v.repeat_interleave(2, 1)[0]     # [h, T, d]
    g = -layer.A_log.exp() * F.softplus(x[0] @ layer.gate_proj.weight.t() + layer.dt_bias)
    state, out = torch.zeros(heads, d, d, dtype=torch.float64), []
    for t in range(9):
        state = g[t].exp()[:, None, None] * state + k[:, t, :, None] * v[:, t, None, :]
        out.append(torch.einsum("hd,hde->he", q[0, :, t], state) * d ** -0.5)
    want = layer.o_proj(layer.o_norm(torch.stack(out)[None]).reshape(1, 9, -1))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_config_checks():
    # huggingface_hub's strict dataclasses wrap our ValueError in their own validation error
    with pytest.raises(Exception, match="one per layer"):
        _tiny(LinearLlamaConfig, layer_kinds=["linear"])
    with pytest.raises(Exception, match="unknown"):
        _tiny(LinearLlamaConfig, layer_kinds=["linear", "mamba"])
    # a gated layer decodes without a cache only
    gated = LinearLlamaForCausalLM(_tiny(LinearLlamaConfig, layer_kinds=["gated", "softmax"]))
    prompt = torch.randint(0, 64, (1, 5))
    with pytest.raises(ValueError, match="use_cache=False"):
        gated.generate(prompt, max_new_tokens=2, do_sample=False)
    assert gated.generate(prompt, max_new_tokens=2, do_sample=False,
                          use_cache=False).shape == (1, 7)
    with pytest.raises(Exception, match="slope_schedule"):
        _tiny(LinearLlamaConfig, slope_schedule="fast")
    assert hybrid_layer_kinds(4, 2) == ["linear", "softmax", "linear", "softmax"]
    with pytest.raises(ValueError, match="attention_dropout"):
        prepare_model_for_cp(LlamaForCausalLM(_tiny(attention_dropout=0.1)), None)


@pytest.mark.parametrize("kinds", [["linear", "softmax"], ["softmax", "softmax"]])
def test_cached_generation_equals_uncached(kinds):
    """Greedy decoding from the KV cache gives the tokens of decoding without it (the cache
    reaches every layer under the keyword this transformers passes: ``cache`` from 5.24,
    ``past_key_values`` before)."""
    torch.manual_seed(0)
    model = LinearLlamaForCausalLM(_tiny(LinearLlamaConfig, layer_kinds=kinds)).eval()
    prompt = torch.randint(0, 64, (2, 5))
    cached = model.generate(prompt, max_new_tokens=8, do_sample=False)
    plain = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=False)
    assert torch.equal(cached, plain)


def test_configs_saved_with_the_old_field_name_load(tmp_path):
    """``decay_schedule`` was renamed ``slope_schedule`` (train.py's --sp-slope-schedule): a
    config saved under the old name loads with its value, and saves under the new one."""
    import json
    torch.manual_seed(0)
    model = LinearLlamaForCausalLM(_tiny(LinearLlamaConfig, slope_schedule="lightning"))
    model.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    cfg = json.loads(path.read_text())
    cfg["decay_schedule"] = cfg.pop("slope_schedule")
    path.write_text(json.dumps(cfg))
    loaded = LinearLlamaForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.slope_schedule == "lightning"
    assert "decay_schedule" not in loaded.config.to_dict()
    ids = torch.randint(0, 64, (2, 10))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_checkpoints_with_the_old_shared_output_norm_still_load(tmp_path):
    """A checkpoint saved before ``out_norm_per_head`` existed (one ``o_norm.weight
    [head_dim]`` for all heads, no such field in config.json) loads and runs as it did; the
    per-head form with that weight repeated for every head gives the same logits (the
    conversion train.py --load-hf applies, models.linear_core.out_norm_weight_from)."""
    import json

    from models.linear_core import out_norm_weight_from
    torch.manual_seed(3)
    old = LinearLlamaForCausalLM(_tiny(LinearLlamaConfig, out_norm_per_head=False))
    with torch.no_grad():
        for layer in old.model.layers:
            layer.self_attn.o_norm.weight.add_(0.3 * torch.randn(8))
    old.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["out_norm_per_head"]                      # as saved before the field existed
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = LinearLlamaForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert loaded.config.out_norm_per_head is False
    assert loaded.model.layers[0].self_attn.o_norm.weight.shape == (8,)
    new = LinearLlamaForCausalLM(_tiny(LinearLlamaConfig)).eval()
    state = {k: out_norm_weight_from(v, 4, 8) if k.endswith("o_norm.weight") else v
             for k, v in loaded.state_dict().items()}
    new.load_state_dict(state)
    assert new.model.layers[0].self_attn.o_norm.weight.shape == (32,)
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        assert torch.allclose(new(ids).logits, loaded(ids).logits, atol=1e-6)
        assert torch.allclose(old.eval()(ids).logits, loaded(ids).logits, atol=0)
    with pytest.raises(ValueError, match="fits neither"):
        out_norm_weight_from(torch.ones(5), 4, 8)

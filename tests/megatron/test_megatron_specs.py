"""Spec patcher over megatron-core's GPT and hybrid specs (0.16.1 in CI; the same file runs
against 0.19.x on the device), prebuilt specs by name, layer patterns. No process group."""
import importlib

import pytest

pytest.importorskip("megatron.core")

from megatron.core.transformer.spec_utils import ModuleSpec, import_module  # noqa: E402

from megatron_patches.core_attention import LinearCoreAttention, SoftmaxCoreAttention  # noqa: E402
from megatron_patches.specs import (ArgsCoreAttention, block_spec, expand_pattern,  # noqa: E402
                                    find_core_attention_slots, layer_kind, patch_core_attention)


def _config(num_layers=4):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig
    return TransformerConfig(num_layers=num_layers, hidden_size=32, num_attention_heads=4,
                             use_cpu_initialization=True, params_dtype=torch.float32)


def _megatron_specs() -> dict:
    """Every GPT / hybrid spec this megatron-core offers without TransformerEngine."""
    from megatron.core.models.gpt import gpt_layer_specs as g
    specs = {
        "gpt_local": g.get_gpt_layer_local_spec(),
        "gpt_local_rms_qknorm": g.get_gpt_layer_local_spec(normalization="RMSNorm",
                                                           qk_layernorm=True),
        "gpt_local_moe": g.get_gpt_layer_local_spec(num_experts=4),
        "gpt_local_mla": g.get_gpt_layer_local_spec(multi_latent_attention=True),
    }
    specs["gpt_decoder_block"] = g.get_gpt_decoder_block_spec(
        _config(), use_transformer_engine=False, normalization="RMSNorm", pp_rank=0)
    for mod, names in (("megatron.core.models.mamba.mamba_layer_specs",
                        ("mamba_stack_spec", "mamba_inference_stack_spec")),
                       ("megatron.core.models.hybrid.hybrid_layer_specs",
                        ("hybrid_stack_spec", "hybrid_inference_stack_spec"))):
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        for n in names:
            if hasattr(m, n):
                specs[n] = getattr(m, n)
    return specs


def test_patcher_finds_and_replaces_every_core_attention_slot():
    specs = _megatron_specs()
    assert "gpt_local" in specs and any("stack" in k for k in specs), sorted(specs)
    assert len(find_core_attention_slots(specs["gpt_decoder_block"])) == 4   # one per layer
    ours = ModuleSpec(module=LinearCoreAttention, params={"context_parallel_impl": "blelloch"})
    for name, spec in specs.items():
        slots = find_core_attention_slots(spec)
        assert slots, f"{name}: no core_attention slot found"
        before = [repr(s) for s in slots]
        patched = patch_core_attention(spec, ours)
        # every slot now holds ours; the original tree is untouched
        seen = []
        patch_core_attention(patched, lambda path, old: seen.append(old) or old)
        assert len(seen) == len(slots) and all(s is ours for s in seen), name
        assert [repr(s) for s in find_core_attention_slots(spec)] == before
        orig = []
        patch_core_attention(spec, lambda path, old: orig.append(old) or old)
        assert not any(o is ours for o in orig), f"{name}: the input spec was modified"


def test_patcher_rejects_a_tree_without_slots():
    with pytest.raises(ValueError, match="no core_attention slot"):
        patch_core_attention(ModuleSpec(module=dict), ours := object())  # noqa: F841


def test_prebuilt_specs_import_by_name():
    for name in ("softmax_layer_spec", "linear_layer_spec", "hybrid_layer_spec"):
        spec = import_module(("megatron_patches.specs", name))
        assert isinstance(spec, ModuleSpec), name
        seen = []
        patch_core_attention(spec, lambda p, old: seen.append(old) or old)
        assert len(seen) == 1 and seen[0].module is ArgsCoreAttention, name


def test_block_spec_follows_the_pattern():
    b = block_spec("LLLS", 8, context_parallel_impl="ring")
    kinds = [find_core_attention_slots(s) and _ca(s).module for s in b.layer_specs]
    assert kinds == [LinearCoreAttention] * 3 + [SoftmaxCoreAttention] + \
        [LinearCoreAttention] * 3 + [SoftmaxCoreAttention]
    assert _ca(b.layer_specs[0]).params["context_parallel_impl"] == "ring"
    with pytest.warns(DeprecationWarning, match="cp_impl= is now context_parallel_impl="):
        old = block_spec("LS", 2, cp_impl="ring")          # the old name, for one release
    assert _ca(old.layer_specs[0]).params["context_parallel_impl"] == "ring"
    assert expand_pattern("LS", 4) == "LSLS"
    assert [layer_kind("LLLS", n, 4) for n in (1, 4)] == ["linear", "softmax"]
    for bad, n in (("LLX", 3), ("LLS", 4), ("", 2), ("LLLLL", 4)):
        with pytest.raises(ValueError, match="pattern"):
            expand_pattern(bad, n)


def _ca(spec):
    out = []
    patch_core_attention(spec, lambda p, old: out.append(old) or old)
    return out[0]

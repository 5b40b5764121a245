"""A hybrid GPT (linear + softmax layers) gives Megatron's distributed checkpoint a valid
sharded state dict: the linear layers' output-norm weight exists in some layers only, so every
layer's tensors must be keyed by its layer number, not stacked over all layers (0.19.2's
torch_dist save refused the stacked form: "Invalid access pattern"). A gated layer's gate
parameters (``A_log``, ``dt_bias``, ``gate_proj.weight``) are sharded over TP by their heads.
The save and resume themselves run on the GPU machine (scripts/device_run.sh); Megatron's writer starts
worker processes, which the test harness's daemonic ranks cannot."""
import warnings

import pytest
import torch

from sp_attention.testing import run_distributed

pytest.importorskip("megatron.core")


def _worker(rank, world):
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_patches.model import build_gpt_model

    ps.initialize_model_parallel(world, 1, context_parallel_size=1)

    def build(seed):
        torch.manual_seed(seed)
        cfg = TransformerConfig(
            num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
            ffn_hidden_size=48, normalization="RMSNorm", add_bias_linear=False,
            attention_dropout=0.0, hidden_dropout=0.0, use_cpu_initialization=True,
            params_dtype=torch.float32, tensor_model_parallel_size=world)
        return build_gpt_model(cfg, kind="hybrid", vocab_size=64, max_sequence_length=16,
                               context_parallel_impl="blelloch", hybrid_pattern="LLGS")

    model = build(1)
    sd = model.sharded_state_dict()
    norms = {v.key: v for k, v in sd.items() if "out_norm_weight" in k}
    assert sorted(norms) == [f"decoder.layers.{i}.self_attention.core_attention.out_norm_weight"
                             for i in range(3)], sorted(norms)
    gate = "decoder.layers.2.self_attention.core_attention."
    shapes = {"A_log": (4,), "dt_bias": (4,), "gate_proj.weight": (4, 32)}
    for name, shape in shapes.items():
        t = sd[gate + name]
        assert t.key == gate + name and t.global_shape == shape, t
        assert t.local_shape == (4 // world,) + shape[1:], t
        assert t.global_offset[0] == rank * 4 // world, t
    assert not any("A_log" in k for k in sd if not k.startswith(gate))
    for t in norms.values():    # no layer axis prepended; TP-sharded along the heads
        assert t.global_shape == (32,) and t.local_shape == (32 // world,), t
        assert t.global_offset == (rank * 32 // world,), t
    linear_qkv = [v for k, v in sd.items() if k.endswith("linear_qkv.weight")]
    assert len(linear_qkv) == 4 and len({t.key for t in linear_qkv}) == 4
    ps.destroy_model_parallel()
    return True


def test_hybrid_sharded_state_dict_keys_layers():
    assert all(run_distributed(_worker, 2, timeout=240))

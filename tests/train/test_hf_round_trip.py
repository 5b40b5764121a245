"""HF → train.py → HF, CPU fp32: tiny random HF checkpoints (a ``LlamaForCausalLM`` with tied
embeddings and Llama 3 RoPE scaling; ``LinearLlamaForCausalLM`` linear — saved in the old
layout, one shared ``[head_dim]`` output-norm weight and a config without
``out_norm_per_head`` —, gated, and a hybrid of linear, gated and softmax layers) start
``train.py --load-hf`` at TP 2 · CP 2 (one gloo spawn of 4 ranks): its logits on fixed tokens
equal the HF model's within 1e-5 before any step; 5 steps later ``python -m
sp_train.export_hf`` writes an HF directory whose model (loaded with ``from_pretrained``: the
stock class for Llama, ``AutoModelForCausalLM`` after ``register_auto_classes`` for ours)
gives train.py's final logits within 1e-5. The exporter's rule for how each weight splits
over TP is checked against the built model's own Megatron attributes.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from sp_attention import unshard_sequence
from sp_attention.testing import run_distributed

pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEQ, STEPS = 32, 5
SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)
MODELS = {
    "llama": dict(num_hidden_layers=2, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 500.0, "factor": 4.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 16}),
    "linear": dict(num_hidden_layers=2, layer_kinds=["linear", "linear"],
                   out_norm_per_head=False),
    "gated": dict(num_hidden_layers=2, layer_kinds=["gated", "gated"]),
    "hybrid": dict(num_hidden_layers=4, layer_kinds=["linear", "gated", "softmax", "linear"],
                   slope_schedule="lightning"),
}


def _hf_model(name: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    from models.hf import LinearLlamaConfig, LinearLlamaForCausalLM
    torch.manual_seed(len(name))
    if name == "llama":
        model = LlamaForCausalLM(LlamaConfig(**SHAPE, **MODELS[name]))
    else:
        model = LinearLlamaForCausalLM(LinearLlamaConfig(**SHAPE, **MODELS[name]))
    with torch.no_grad():             # norms away from 1: their mapping is checked too
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith(("A_log", "dt_bias")):
                p.add_(0.2 * torch.randn_like(p))
    return model.eval()


def _save(model, path: str, old_layout: bool) -> None:
    model.save_pretrained(path)
    if old_layout:                    # a config written before out_norm_per_head existed
        name = os.path.join(path, "config.json")
        cfg = json.load(open(name))
        cfg.pop("out_norm_per_head")
        json.dump(cfg, open(name, "w"))


def _logits_hook(tokens, out):
    """An on_model hook: this rank's logits shard on ``tokens`` with its (tp, cp, dp) ranks."""
    def hook(model, step):
        from megatron.core import parallel_state as ps

        from megatron_patches.model import output_weight
        from megatron_patches.weights import tp_partition
        from sp_attention import shard_position_ids, shard_sequence
        for n, p in model.named_parameters():     # the exporter's TP rules = Megatron's own
            own = ((p.partition_dim, getattr(p, "partition_stride", 1))
                   if getattr(p, "tensor_model_parallel", False) else None)
            assert tp_partition(n) == own, (n, tp_partition(n), own)
        ctx = model.sp_context
        tok = shard_sequence(tokens, ctx, dim=1)
        pos = shard_position_ids(tokens.shape[1], ctx).expand(tokens.shape[0], -1)
        model.eval()
        with torch.no_grad():
            hidden = model(tok, pos, attention_mask=None)                    # [s, b, h]
            logits = (hidden @ output_weight(model).t()).transpose(0, 1)    # [b, s, V/TP]
        model.train()
        out[step] = (ps.get_tensor_model_parallel_rank(), ps.get_context_parallel_rank(),
                     ps.get_data_parallel_rank(), logits)
    return hook


def _train(rank, world, tmp, tokens):
    import train
    from sp_train.launch import TrainHooks
    out = {}
    for name in MODELS:
        seen = {}
        train.main(["--load-hf", f"{tmp}/{name}", "--tensor-model-parallel-size", "2",
                    "--context-parallel-size", "2", "--seq-length", str(SEQ),
                    "--global-batch-size", "2", "--train-iters", str(STEPS),
                    "--lr-warmup-iters", "1", "--save", f"{tmp}/ck_{name}",
                    "--log-dir", f"{tmp}/log_{name}", "--no-progress-bar",
                    "--log-interval", "100"], hooks=TrainHooks(on_model=_logits_hook(tokens, seen)))
        out[name] = seen
    return out


def _assemble(results, name, step):
    """The full ``[b, T, V]`` logits of DP replica 0 from every rank's shard."""
    parts = {}
    for r in results:
        tp, cp, dp, logits = r[name][step]
        if dp == 0:
            parts[(cp, tp)] = logits
    cps = sorted({cp for cp, _ in parts})
    shards = [torch.cat([parts[(cp, tp)] for tp in sorted(t for c, t in parts if c == cp)],
                        dim=-1) for cp in cps]
    return unshard_sequence(shards, "zigzag", dim=1)


def test_hf_to_train_and_back(tmp_path):
    from models.hf import register_auto_classes
    from transformers import AutoModelForCausalLM
    tokens = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(7))
    want = {}
    for name in MODELS:
        model = _hf_model(name)
        with torch.no_grad():
            want[name] = model(tokens).logits
        _save(model, str(tmp_path / name), old_layout=name == "linear")
    results = run_distributed(_train, 4, str(tmp_path), tokens, timeout=600)
    register_auto_classes()
    for name in MODELS:
        start = _assemble(results, name, 0)
        assert (start - want[name]).abs().max() < 1e-5, (name, (start - want[name]).abs().max())
        end = _assemble(results, name, STEPS)
        assert (end - start).abs().max() > 1e-4, name        # it trained
        out = tmp_path / f"hf_{name}"
        cmd = [sys.executable, "-m", "sp_train.export_hf", "--load", str(tmp_path / f"ck_{name}"),
               "--out", str(out)] if name == "llama" else None
        if cmd:     # the documented command, as a user runs it (once: a subprocess costs)
            done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr
            assert done.stdout.strip().splitlines()[-1].startswith(f"wrote {out}: "
                                                                   "LlamaForCausalLM")
        else:
            from sp_train.export_hf import export
            export(str(tmp_path / f"ck_{name}"), str(out))
        if name == "llama":
            from transformers import LlamaForCausalLM
            back = LlamaForCausalLM.from_pretrained(str(out))
        else:
            back = AutoModelForCausalLM.from_pretrained(str(out))
        with torch.no_grad():
            got = back.eval()(tokens).logits
        assert (got - end).abs().max() < 1e-5, (name, (got - end).abs().max())

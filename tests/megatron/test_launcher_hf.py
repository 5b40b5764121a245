"""The Megatron-LM launcher's side of the HF route, CPU fp32 (megatron-core 0.16.1 has no
``megatron.training``, so the launcher itself cannot run here; its pieces do):

- ``--load-hf`` into the model the launcher's ``model_provider`` builds, at TP 2: the model's
  logits equal the HF model's within 1e-5 (a hybrid of linear, gated and softmax layers,
  whose checkpoint keys carry layer numbers, and a gated model, whose layers Megatron's
  checkpoint stacks);
- that model saved the way Megatron-LM saves (``dist_checkpointing`` ``torch_dist``, under
  ``torchrun``: tests/megatron/launcher_checkpoint.py, one launch of 2 processes), then
  ``sp_train.export_hf``: the exported model (``from_pretrained``) gives the same logits, its
  vocabulary cut back from Megatron's padded one;
- ``hf_architecture`` refuses a Megatron flag that contradicts the config by name, and takes
  an explicit ``--rotary-base`` as a long-context override.
"""
import argparse
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)
MODELS = {"hybrid": ["linear", "gated", "softmax", "linear"], "gated": ["gated", "gated"]}
PATTERN = {"hybrid": "LGSL", "gated": "GG"}


def _hf(name):
    from models.hf import LinearLlamaConfig, LinearLlamaForCausalLM
    torch.manual_seed(11)
    model = LinearLlamaForCausalLM(LinearLlamaConfig(
        **SHAPE, num_hidden_layers=len(MODELS[name]), layer_kinds=MODELS[name]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.2 * torch.randn_like(p))
    return model.eval()


def test_launcher_load_hf_and_export(tmp_path):
    from models.hf import LinearLlamaForCausalLM
    from sp_train.export_hf import export
    dirs = []
    for name in MODELS:
        d = tmp_path / name
        _hf(name).save_pretrained(str(d))
        (d / "pattern.txt").write_text(PATTERN[name])
        dirs.append(str(d))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           "2", os.path.join(HERE, "launcher_checkpoint.py"), str(tmp_path),
                           *dirs], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for name in MODELS:
        saved = torch.load(tmp_path / f"{name}.pt")
        tokens, megatron = saved["tokens"], saved["logits"]
        with torch.no_grad():
            want = _hf(name)(tokens).logits
        assert megatron.shape[-1] == 64 + 64                # Megatron's padded vocabulary
        assert (megatron[..., :64] - want).abs().max() < 1e-5, name
        line = export(str(tmp_path / f"ck_{name}"), str(tmp_path / f"out_{name}"))
        assert "iter_0000003" in line, line
        back = LinearLlamaForCausalLM.from_pretrained(str(tmp_path / f"out_{name}")).eval()
        assert back.config.vocab_size == 64 and back.config.layer_kinds == MODELS[name]
        with torch.no_grad():
            got = back(tokens).logits
        assert (got - megatron[..., :64]).abs().max() < 1e-5, name


def test_launcher_load_hf_refuses_a_contradicting_flag(tmp_path):
    sys.path.insert(0, HERE)
    from launcher_checkpoint import megatron_args

    from megatron_patches.args import hf_architecture
    _hf("hybrid").save_pretrained(str(tmp_path / "hf"))
    args = megatron_args(str(tmp_path / "hf"), "LGSL")
    assert hf_architecture(args, argv=[]).pattern == "LGSL"
    bad = argparse.Namespace(**{**vars(args), "num_layers": 8, "sp_hybrid_pattern": "LGSL"})
    with pytest.raises(ValueError, match="--num-layers is 8 but --load-hf .* says 4"):
        hf_architecture(bad, argv=[])
    theta = argparse.Namespace(**{**vars(args), "rotary_base": 1e6})
    with pytest.raises(ValueError, match="--rotary-base is 1000000.0 but"):
        hf_architecture(theta, argv=[])
    assert hf_architecture(theta, argv=["--rotary-base", "1e6"]).rotary_base == 10000.0

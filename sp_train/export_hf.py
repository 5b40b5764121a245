"""Turn a train.py or Megatron-launcher checkpoint into a Hugging Face model directory::

    python -m sp_train.export_hf --load ckpt --out hf_model [--ckpt-step N] [--dtype bf16]

``--load`` is a ``--save`` directory (its newest checkpoint, or ``--ckpt-step N``'s) or one
checkpoint directory, written by

- train.py (``torch.distributed.checkpoint`` shards keyed ``tp{r}/model.<name>``, any TP × CP
  × DP: CP and DP replicas are stored once, the TP ranks' slices are joined here), or
- the Megatron-LM launcher, ``megatron_patches.pretrain_gpt`` (Megatron's ``torch_dist``
  format: ``latest_checkpointed_iteration.txt``, ``iter_N/`` with ``common.pt`` holding the
  run's arguments; tensors stored whole, layers stacked or keyed by layer number).

``--out`` receives ``save_pretrained``'s ``config.json`` and ``model.safetensors``: a softmax
model is a stock ``LlamaForCausalLM`` (``AutoModelForCausalLM.from_pretrained(out)``); a
linear, gated or hybrid one our ``LinearLlamaForCausalLM`` (``models.hf``; call
``models.hf.register_auto_classes()`` first for ``AutoModelForCausalLM``). The HF config comes
from the run: its shape, layer kinds, slopes, RoPE θ and scaling, norm epsilon, tied
embeddings; a run started with ``--load-hf`` keeps that checkpoint's vocabulary size (the
rows train.py padded for TP are dropped) and its tokenizer files are copied along. Reading
a Megatron-launcher checkpoint needs megatron-core (its ``common.pt`` holds Megatron's
argument objects).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_patches.options import model_pattern
from megatron_patches.weights import HFArchitecture, megatron_to_hf, tp_merge

from . import checkpoint as ckpt

__all__ = ["main", "export", "read_train_checkpoint", "read_megatron_checkpoint",
           "megatron_checkpoint_path"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "tokenizer.model", "generation_config.json", "vocab.json", "merges.txt")


def _load_tensors(path: str, keep) -> dict:
    """The tensors of the DCP checkpoint ``path`` whose keys ``keep`` accepts, whole."""
    md = FileSystemReader(path).read_metadata()
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype)
          for k, m in md.state_dict_metadata.items()
          if isinstance(m, TensorStorageMetadata) and keep(k)}
    dcp.load(sd, checkpoint_id=path, no_dist=True)
    return sd


def read_train_checkpoint(path: str) -> tuple[dict, dict]:
    """``(TP-1 Megatron state dict, meta.json)`` of a train.py checkpoint directory."""
    meta = ckpt.verify_checkpoint(path)
    tp = int(meta["tp"])
    sd = _load_tensors(path, lambda k: re.match(r"tp\d+/model\.", k) is not None)
    shards = [{k.split("/model.", 1)[1]: v for k, v in sd.items() if k.startswith(f"tp{r}/")}
              for r in range(tp)]
    return tp_merge(shards), meta


# Megatron's checkpoint names for the local spec's norms (kept compatible with TE's layers)
_MEGATRON_RENAMES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
                     "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}


def read_megatron_checkpoint(path: str) -> tuple[dict, object]:
    """``(TP-1 state dict in our model's names, the run's Megatron args)`` of one
    ``torch_dist`` checkpoint directory of the Megatron-LM launcher."""
    try:
        common = torch.load(os.path.join(path, "common.pt"), map_location="cpu",
                            weights_only=False)
    except ModuleNotFoundError as e:
        raise ValueError(f"{path}/common.pt holds Megatron's objects: install megatron-core "
                         f"to read it ({e})") from None
    sd = _load_tensors(path, lambda k: k.startswith(("embedding.", "decoder.", "output_layer.")))
    out = {}
    for key, t in sd.items():
        m = re.match(r"decoder\.layers\.(\d+)\.(.*)$", key)
        if m:                           # keyed by layer number (hybrid models)
            items = [(int(m.group(1)), m.group(2), t)]
        elif key.startswith("decoder.layers."):   # stacked over the layers (dim 0)
            rest = key[len("decoder.layers."):]
            items = [(i, rest, t[i]) for i in range(t.shape[0])]
        else:
            out[key] = t
            continue
        for i, rest, v in items:
            rest = _MEGATRON_RENAMES.get(rest, rest)
            out[f"decoder.layers.{i}.{rest}"] = v
    for key in [k for k in out if k.endswith("linear_fc1.weight_w")]:   # SwiGLU stored split
        base = key[:-2]
        out[base] = torch.cat([out.pop(key), out.pop(base + "_v")], dim=0)
    return out, common.get("args")


def megatron_checkpoint_path(load: str, step: Optional[int]) -> Optional[str]:
    """The Megatron-launcher checkpoint ``--load`` names (None: not one)."""
    if os.path.isfile(os.path.join(load, "metadata.json")) and \
            os.path.isfile(os.path.join(load, "common.pt")):
        return load
    tracker = os.path.join(load, "latest_checkpointed_iteration.txt")
    if not os.path.isfile(tracker):
        return None
    if step is None:
        step = int(open(tracker).read().strip())
    path = os.path.join(load, f"iter_{step:07d}")
    if not os.path.isdir(path):
        raise ValueError(f"--ckpt-step {step}: there is no {path}")
    return path


def _arch_of_train_run(meta: dict, sd: dict) -> HFArchitecture:
    """The HF architecture of a train.py run (from its meta.json)."""
    args, model = meta["args"], meta["model"]
    info = meta.get("hf_export") or {}
    vocab = sd["embedding.word_embeddings.weight"].shape[0]
    kinds = info.get("layer_kinds") or [
        {"L": "linear", "G": "gated", "S": "softmax"}[c] for c in model["layers"]]
    return HFArchitecture(
        model_type=info.get("model_type") or ("llama" if set(kinds) == {"softmax"}
                                              else "sp_linear_llama"),
        num_layers=model["num_layers"], hidden_size=model["hidden_size"],
        num_attention_heads=model["num_attention_heads"],
        num_query_groups=model["num_query_groups"], ffn_hidden_size=model["ffn_hidden_size"],
        vocab_size=info.get("vocab_size", vocab),
        norm_epsilon=info.get("norm_epsilon", args.get("norm_epsilon") or 1e-5),
        rotary_base=info.get("rotary_base", args.get("rotary_base") or 10000.0),
        rope_scaling=info.get("rope_scaling"),
        tie_word_embeddings=info.get("tie_word_embeddings", False),
        max_position_embeddings=info.get("max_position_embeddings", args["seq_length"]),
        layer_kinds=tuple(kinds),
        slope_schedule=info.get("slope_schedule", args.get("sp_slope_schedule")
                                or ("long_range" if "linear" in kinds else None)))


def _arch_of_megatron_run(a) -> HFArchitecture:
    """The HF architecture of a Megatron-LM launcher run (its parsed arguments)."""
    bad = [f for f, ok in (("--swiglu", getattr(a, "swiglu", False)),
                           ("--normalization RMSNorm", a.normalization == "RMSNorm"),
                           ("--disable-bias-linear", not getattr(a, "add_bias_linear", True)),
                           ("--position-embedding-type rope",
                            a.position_embedding_type == "rope")) if not ok]
    if bad:
        raise ValueError("this Megatron run is not a Llama-style model HF can load: it lacks "
                         + ", ".join(bad))
    pattern = model_pattern(getattr(a, "sp_model_kind", "softmax"), a.num_layers,
                            getattr(a, "sp_hybrid_pattern", None))
    kinds = tuple({"L": "linear", "G": "gated", "S": "softmax"}[c] for c in pattern)
    scaling = None
    if getattr(a, "use_rope_scaling", False):
        scaling = {"rope_type": "llama3", "factor": float(a.rope_scaling_factor),
                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}
    slope = getattr(a, "sp_slope_schedule", None) or "long_range"
    return HFArchitecture(
        model_type="llama" if set(kinds) == {"softmax"} else "sp_linear_llama",
        num_layers=a.num_layers, hidden_size=a.hidden_size,
        num_attention_heads=a.num_attention_heads,
        num_query_groups=a.num_query_groups if a.group_query_attention
        else a.num_attention_heads, ffn_hidden_size=a.ffn_hidden_size,
        vocab_size=a.padded_vocab_size, norm_epsilon=a.norm_epsilon,
        rotary_base=float(a.rotary_base), rope_scaling=scaling,
        tie_word_embeddings=not a.untie_embeddings_and_output_weights,
        max_position_embeddings=a.max_position_embeddings, layer_kinds=kinds,
        slope_schedule=slope if "linear" in kinds else None)


def _hf_classes(model_type: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    from models.hf.linear_llama import LinearLlamaConfig, LinearLlamaForCausalLM
    if model_type == "llama":
        return LlamaConfig, LlamaForCausalLM
    return LinearLlamaConfig, LinearLlamaForCausalLM


def write_hf(sd: dict, arch: HFArchitecture, out: str, dtype: Optional[torch.dtype]) -> str:
    """``save_pretrained`` of the HF model with the Megatron state dict ``sd`` into ``out``."""
    hf = megatron_to_hf(sd, arch)
    dtype = dtype or next(iter(hf.values())).dtype
    config_cls, model_cls = _hf_classes(arch.model_type)
    config = config_cls(**arch.config(), dtype=dtype)
    with torch.device("meta"):
        model = model_cls(config)
    result = model.load_state_dict({k: v.to(dtype) for k, v in hf.items()}, strict=False,
                                   assign=True)
    if arch.tie_word_embeddings:
        model.tie_weights()          # lm_head is the embedding, as the config says
    left = [n for n, p in model.named_parameters() if p.is_meta] + list(result.unexpected_keys)
    if left:
        raise ValueError(f"the converted weights do not fill {model_cls.__name__}: "
                         f"{', '.join(left[:5])}")
    model.save_pretrained(out)
    return model_cls.__name__


def export(load: str, out: str, *, step: Optional[int] = None,
           dtype: Optional[torch.dtype] = None) -> str:
    """Write the checkpoint ``load`` names as an HF directory ``out``; returns one line saying
    what was written."""
    mg_path = megatron_checkpoint_path(load, step)
    source = None
    if mg_path is not None:
        sd, args = read_megatron_checkpoint(mg_path)
        arch, path = _arch_of_megatron_run(args), mg_path
        source = getattr(args, "load_hf", None)
        if source:
            base = HFArchitecture.from_dir(source)
            arch = HFArchitecture(**{**arch.__dict__, "vocab_size": base.vocab_size,
                                     "max_position_embeddings": max(
                                         arch.max_position_embeddings,
                                         base.max_position_embeddings)})
    else:
        path = ckpt.resume_path(load, step)
        if path is None:
            raise ValueError(f"--load {load} holds no checkpoint: looked for train.py's "
                             "iter_NNNNNNN/ (meta.json) and Megatron's "
                             "latest_checkpointed_iteration.txt")
        sd, meta = read_train_checkpoint(path)
        arch = _arch_of_train_run(meta, sd)
        source = meta["args"].get("load_hf")
    name = write_hf(sd, arch, out, dtype)
    if source and os.path.isdir(source):
        for f in _TOKENIZER_FILES:
            if os.path.isfile(os.path.join(source, f)):
                shutil.copy(os.path.join(source, f), out)
    return (f"wrote {out}: {name} ({arch.model_kind}, {arch.num_layers} layers, pattern "
            f"{arch.pattern}) from {path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m sp_train.export_hf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="a --save directory or one checkpoint")
    p.add_argument("--out", required=True, help="the HF directory to write")
    p.add_argument("--ckpt-step", type=int, default=None, help="this step's checkpoint "
                   "(default: the newest)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="the weights' dtype (default: as stored)")
    a = p.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}[a.dtype]
    try:
        print(export(a.load, a.out, step=a.ckpt_step, dtype=dtype), flush=True)
    except ValueError as e:
        print(f"export_hf: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

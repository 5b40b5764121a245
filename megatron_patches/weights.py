"""Weights between Hugging Face checkpoints and our Megatron GPT models, and their TP cuts.

- :class:`HFArchitecture`: what a ``config.json`` of ``LlamaForCausalLM`` or our
  ``LinearLlamaForCausalLM`` (``model_type`` ``llama`` / ``sp_linear_llama``) says about the
  model, checked (what we cannot honour is refused naming the field), and as train.py's flag
  values (:meth:`HFArchitecture.flags`) or an HF config again (:meth:`HFArchitecture.config`).
- :func:`read_hf_weights`: the tensors of a local HF checkpoint directory (safetensors: one
  ``model.safetensors`` or a sharded ``model.safetensors.index.json``).
- :func:`hf_to_megatron` / :func:`megatron_to_hf`: HF names ↔ the names of a 1×1×1 (TP 1)
  :func:`~megatron_patches.model.build_gpt_model` state dict. Megatron fuses q, k, v into one
  ``linear_qkv`` weight laid out per KV group ``[q heads of the group, k, v]`` (so TP, which
  splits whole groups, cuts it contiguously) and SwiGLU's gate and up projections into
  ``linear_fc1 = [gate; up]`` (cut over TP with stride 2: each rank ``[gate_r; up_r]``). A
  linear layer's output norm ``[heads·head_dim]``, a gated layer's ``gate_proj``, ``A_log``
  and ``dt_bias`` keep their shapes (:mod:`models.linear_core`: one layer core, one set of
  weights); an old HF checkpoint's shared ``[head_dim]`` norm weight is broadcast exactly.
- :func:`tp_partition`, :func:`tp_slice`, :func:`tp_merge`, :func:`tp_shard_state_dict`: how
  each Megatron weight splits over TP (Megatron's own rule: ``partition_dim``,
  ``partition_stride``), cutting a full state dict for one rank and joining the ranks' pieces.

No Megatron or transformers import (safetensors is imported where a checkpoint is read): the
command-line checks and the exporter use it without building a model.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from models.linear_core import out_norm_weight_from

__all__ = ["HFArchitecture", "HF_MODEL_TYPES", "read_hf_config", "read_hf_weights",
           "hf_to_megatron", "megatron_to_hf", "tp_partition", "tp_slice", "tp_merge",
           "tp_shard_state_dict", "pad_rows", "padded_vocab", "load_hf_into", "ROPE_TYPES"]

# model_type in config.json -> the transformers class that loads it
HF_MODEL_TYPES = {"llama": "LlamaForCausalLM", "sp_linear_llama": "LinearLlamaForCausalLM"}
ROPE_TYPES = ("default", "linear", "llama3")
_LETTER = {"linear": "L", "gated": "G", "softmax": "S"}
_KIND = {v: k for k, v in _LETTER.items()}


def read_hf_config(path: str) -> dict:
    """``config.json`` of the HF checkpoint directory ``path`` (errors name what is missing)."""
    name = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise ValueError(f"--load-hf {path}: not a directory; give a local HF checkpoint "
                         "directory (what save_pretrained writes: config.json and "
                         "model.safetensors)")
    if not os.path.isfile(name):
        raise ValueError(f"--load-hf {path}: there is no config.json in it; give a directory "
                         "that save_pretrained wrote")
    with open(name) as f:
        return json.load(f)


def _rope(cfg: dict) -> tuple[float, Optional[dict]]:
    """(θ, scaling or None) from a transformers 5 ``rope_parameters`` or a 4.x
    ``rope_theta`` / ``rope_scaling`` config."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = dict(cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = {k: v for k, v in {**legacy, **params}.items() if k != "rope_theta"}
    kind = scaling.pop("rope_type", scaling.pop("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"config.json: RoPE type {kind!r} is not supported (we rotate with "
                         f"{', '.join(ROPE_TYPES)}); YaRN and dynamic scaling change more than "
                         "the frequencies")
    if kind == "default":
        return theta, None
    keep = ("factor",) if kind == "linear" else (
        "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keep if k not in scaling]
    if missing:
        raise ValueError(f"config.json: {kind} RoPE scaling without {', '.join(missing)}")
    return theta, {"rope_type": kind, **{k: scaling[k] for k in keep}}


@dataclass(frozen=True)
class HFArchitecture:
    """The model an HF config describes, in the terms our Megatron models are built from.

    Attributes:
        model_type: ``llama`` or ``sp_linear_llama``.
        num_layers, hidden_size, num_attention_heads, num_query_groups, ffn_hidden_size,
            vocab_size: the shape (HF: ``num_hidden_layers``, ``num_key_value_heads``,
            ``intermediate_size``, ...).
        norm_epsilon: the RMS norms' epsilon (``rms_norm_eps``; also the linear layers' output
            norm).
        rotary_base: RoPE θ. rope_scaling: ``{"rope_type": "linear" | "llama3", ...}`` or None.
        tie_word_embeddings: the output layer is the input embedding.
        max_position_embeddings: as the config says (kept on export).
        layer_kinds: ``linear`` / ``gated`` / ``softmax`` per layer.
        slope_schedule: the fixed-decay layers' slope schedule.
        out_norm_per_head: False for an old ``sp_linear_llama`` checkpoint whose output-norm
            weight is the shared ``[head_dim]`` (broadcast on load).
    """

    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int
    norm_epsilon: float
    rotary_base: float
    rope_scaling: Optional[dict]
    tie_word_embeddings: bool
    max_position_embeddings: int
    layer_kinds: tuple
    slope_schedule: Optional[str] = None
    out_norm_per_head: bool = True

    @classmethod
    def from_config(cls, cfg: dict) -> "HFArchitecture":
        """Check a ``config.json`` dict; every refusal names the field and why."""
        mt = cfg.get("model_type")
        if mt not in HF_MODEL_TYPES:
            raise ValueError(f"config.json: model_type {mt!r} is not supported; train.py "
                             f"loads {', '.join(f'{k} ({v})' for k, v in HF_MODEL_TYPES.items())}")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // heads
        bad = {"attention_bias": cfg.get("attention_bias", False),
               "mlp_bias": cfg.get("mlp_bias", False),
               "hidden_act": cfg.get("hidden_act", "silu") != "silu" and cfg.get("hidden_act"),
               "head_dim": head_dim * heads != hidden and head_dim,
               "pretraining_tp": cfg.get("pretraining_tp", 1) != 1 and cfg.get("pretraining_tp")}
        bad = {k: v for k, v in bad.items() if v}
        if bad:
            raise ValueError("config.json: " + ", ".join(f"{k}={v!r}" for k, v in bad.items())
                             + " is not supported (our GPT layers: no biases, SwiGLU with SiLU, "
                             "head_dim = hidden_size / num_attention_heads)")
        layers = int(cfg["num_hidden_layers"])
        kinds = cfg.get("layer_kinds") if mt == "sp_linear_llama" else None
        kinds = tuple(kinds or (["linear"] * layers if mt == "sp_linear_llama"
                                else ["softmax"] * layers))
        theta, scaling = _rope(cfg)
        return cls(model_type=mt, num_layers=layers, hidden_size=hidden,
                   num_attention_heads=heads,
                   num_query_groups=int(cfg.get("num_key_value_heads") or heads),
                   ffn_hidden_size=int(cfg["intermediate_size"]),
                   vocab_size=int(cfg["vocab_size"]),
                   norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)), rotary_base=theta,
                   rope_scaling=scaling,
                   tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                   max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                   layer_kinds=kinds,
                   slope_schedule=(cfg.get("slope_schedule") or cfg.get("decay_schedule")
                                   if mt == "sp_linear_llama" else None),
                   out_norm_per_head=(mt != "sp_linear_llama"
                                      or bool(cfg.get("out_norm_per_head", False))))

    @classmethod
    def from_dir(cls, path: str) -> "HFArchitecture":
        return cls.from_config(read_hf_config(path))

    @property
    def pattern(self) -> str:
        """One letter per layer: ``L`` linear, ``G`` gated, ``S`` softmax."""
        return "".join(_LETTER[k] for k in self.layer_kinds)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def model_kind(self) -> str:
        letters = set(self.pattern)
        return _KIND[letters.pop()] if len(letters) == 1 else "hybrid"

    def flags(self) -> dict:
        """train.py's (and the launcher's) flag values for this model, by attribute name."""
        kind = self.model_kind
        return {"num_layers": self.num_layers, "hidden_size": self.hidden_size,
                "num_attention_heads": self.num_attention_heads,
                "num_query_groups": self.num_query_groups,
                "ffn_hidden_size": self.ffn_hidden_size, "sp_model_kind": kind,
                "sp_hybrid_pattern": self.pattern if kind == "hybrid" else None,
                "sp_slope_schedule": self.slope_schedule if "L" in self.pattern else None,
                "norm_epsilon": self.norm_epsilon}

    def config(self, **changes) -> dict:
        """The HF config (keyword arguments of ``LlamaConfig`` / ``LinearLlamaConfig``) of
        this architecture with ``changes`` applied (e.g. the θ a run trained with)."""
        a = HFArchitecture(**{**asdict(self), **changes})
        rope = {"rope_type": "default", "rope_theta": a.rotary_base}
        if a.rope_scaling:
            rope = {**a.rope_scaling, "rope_theta": a.rotary_base}
        out = dict(vocab_size=a.vocab_size, hidden_size=a.hidden_size,
                   intermediate_size=a.ffn_hidden_size, num_hidden_layers=a.num_layers,
                   num_attention_heads=a.num_attention_heads,
                   num_key_value_heads=a.num_query_groups, head_dim=a.head_dim,
                   rms_norm_eps=a.norm_epsilon, rope_parameters=rope,
                   tie_word_embeddings=a.tie_word_embeddings,
                   max_position_embeddings=a.max_position_embeddings, hidden_act="silu",
                   attention_bias=False, mlp_bias=False)
        if a.model_type == "sp_linear_llama":
            out.update(layer_kinds=list(a.layer_kinds), out_norm_per_head=True)
            if a.slope_schedule is not None:
                out["slope_schedule"] = a.slope_schedule
        return out


def read_hf_weights(path: str) -> dict:
    """Every tensor of the HF checkpoint in directory ``path`` (safetensors, on the CPU)."""
    try:
        from safetensors.torch import load_file
    except ImportError as e:
        raise ValueError("reading an HF checkpoint needs safetensors (pip install -e "
                         "'.[hf]', or pip install safetensors)") from e
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(single):
        files = ["model.safetensors"]
    else:
        have = ", ".join(sorted(os.listdir(path))) or "nothing"
        raise ValueError(f"--load-hf {path}: no model.safetensors or model.safetensors.index"
                         f".json (it holds {have}); re-save the model with save_pretrained "
                         "(safetensors is transformers' default)")
    out = {}
    for name in files:
        out.update(load_file(os.path.join(path, name)))
    return out


# --- HF names <-> Megatron names (TP 1) ---------------------------------------------------
_HF_LAYER = "model.layers.{i}."
_MG_LAYER = "decoder.layers.{i}."
# per layer: HF suffix -> Megatron suffix, for tensors that keep their shape
_SAME = {"input_layernorm.weight": "input_layernorm.weight",
         "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
         "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
         "mlp.down_proj.weight": "mlp.linear_fc2.weight"}
_GATED = {"self_attn.gate_proj.weight": "self_attention.core_attention.gate_proj.weight",
          "self_attn.A_log": "self_attention.core_attention.A_log",
          "self_attn.dt_bias": "self_attention.core_attention.dt_bias"}
_OUT_NORM = ("self_attn.o_norm.weight", "self_attention.core_attention.out_norm_weight")
_GLOBAL = {"model.embed_tokens.weight": "embedding.word_embeddings.weight",
           "model.norm.weight": "decoder.final_layernorm.weight",
           "lm_head.weight": "output_layer.weight"}


def _take(sd: dict, key: str, where: str) -> torch.Tensor:
    if key not in sd:
        raise ValueError(f"{where}: the weight {key} is missing")
    return sd.pop(key)


def hf_to_megatron(hf: dict, arch: HFArchitecture) -> dict:
    """A TP-1 Megatron state dict of the HF weights ``hf`` (consumed); leftovers raise."""
    hf = dict(hf)
    where = "the HF checkpoint"
    out = {}
    for src, dst in _GLOBAL.items():
        if src == "lm_head.weight" and arch.tie_word_embeddings:
            hf.pop(src, None)
            continue
        out[dst] = _take(hf, src, where)
    H, G, D = arch.num_attention_heads, arch.num_query_groups, arch.head_dim
    for i, kind in enumerate(arch.layer_kinds):
        s, d = _HF_LAYER.format(i=i), _MG_LAYER.format(i=i)
        for a, b in _SAME.items():
            out[d + b] = _take(hf, s + a, where)
        q, k, v = (_take(hf, s + f"self_attn.{n}_proj.weight", where) for n in "qkv")
        h = q.shape[1]
        out[d + "self_attention.linear_qkv.weight"] = torch.cat(
            [q.reshape(G, H // G * D, h), k.reshape(G, D, h), v.reshape(G, D, h)],
            dim=1).reshape(-1, h)
        gate, up = (_take(hf, s + f"mlp.{n}_proj.weight", where) for n in ("gate", "up"))
        out[d + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
        if kind in ("linear", "gated"):
            out[d + _OUT_NORM[1]] = out_norm_weight_from(_take(hf, s + _OUT_NORM[0], where),
                                                         H, D)
        if kind == "gated":
            for a, b in _GATED.items():
                out[d + b] = _take(hf, s + a, where)
    left = sorted(k for k in hf if not k.endswith("rotary_emb.inv_freq"))
    if left:
        raise ValueError(f"{where} holds weights this architecture has no place for: "
                         f"{', '.join(left[:5])}{' ...' if len(left) > 5 else ''}")
    return out


def megatron_to_hf(mg: dict, arch: HFArchitecture) -> dict:
    """The HF state dict of a TP-1 Megatron state dict ``mg`` (its vocabulary rows cut to
    ``arch.vocab_size``); leftovers raise."""
    mg = {k: v for k, v in mg.items() if not k.endswith("_extra_state")}
    where = "the Megatron checkpoint"
    out = {}
    for dst, src in _GLOBAL.items():
        if dst == "lm_head.weight" and arch.tie_word_embeddings:
            mg.pop(src, None)
            continue
        t = _take(mg, src, where)
        out[dst] = t[:arch.vocab_size] if dst != "model.norm.weight" else t
    H, G, D = arch.num_attention_heads, arch.num_query_groups, arch.head_dim
    for i, kind in enumerate(arch.layer_kinds):
        s, d = _HF_LAYER.format(i=i), _MG_LAYER.format(i=i)
        for a, b in _SAME.items():
            out[s + a] = _take(mg, d + b, where)
        qkv = _take(mg, d + "self_attention.linear_qkv.weight", where)
        h = qkv.shape[1]
        q, k, v = qkv.reshape(G, (H // G + 2) * D, h).split([H // G * D, D, D], dim=1)
        out[s + "self_attn.q_proj.weight"] = q.reshape(H * D, h)
        out[s + "self_attn.k_proj.weight"] = k.reshape(G * D, h)
        out[s + "self_attn.v_proj.weight"] = v.reshape(G * D, h)
        gate, up = _take(mg, d + "mlp.linear_fc1.weight", where).chunk(2, dim=0)
        out[s + "mlp.gate_proj.weight"], out[s + "mlp.up_proj.weight"] = gate, up
        if kind in ("linear", "gated"):
            out[s + _OUT_NORM[0]] = _take(mg, d + _OUT_NORM[1], where)
        if kind == "gated":
            for a, b in _GATED.items():
                out[s + a] = _take(mg, d + b, where)
    if mg:
        raise ValueError(f"{where} holds weights the architecture ({arch.pattern}) has no "
                         f"place for: {', '.join(sorted(mg)[:5])}")
    return {k: v.contiguous() for k, v in out.items()}


# --- TP --------------------------------------------------------------------------------------
# (name pattern, partition dim, stride) of Megatron's TP-split weights; the rest is replicated.
_TP_RULES = ((r"(^|\.)embedding\.word_embeddings\.weight$", 0, 1),
             (r"(^|\.)output_layer\.weight$", 0, 1),
             (r"\.linear_qkv\.weight$", 0, 1),
             (r"\.linear_fc1\.weight$", 0, 2),
             (r"\.linear_proj\.weight$", 1, 1),
             (r"\.linear_fc2\.weight$", 1, 1),
             (r"\.core_attention\.(out_norm_weight|A_log|dt_bias|gate_proj\.weight)$", 0, 1))


def tp_partition(name: str) -> Optional[tuple[int, int]]:
    """``(partition_dim, partition_stride)`` of the Megatron weight ``name`` under TP (None:
    replicated on every TP rank). The same as the parameters' own Megatron attributes
    (checked against a built model by the tests)."""
    for pattern, dim, stride in _TP_RULES:
        if re.search(pattern, name):
            return dim, stride
    return None


def tp_slice(full: torch.Tensor, dim: int, stride: int, rank: int, size: int) -> torch.Tensor:
    """Megatron's split of a master weight: ``size·stride`` equal pieces along ``dim``, rank r
    keeps pieces ``r, r+size, …`` (stride 2 = SwiGLU fc1's [gate; up] interleave)."""
    n = full.shape[dim]
    if n % (size * stride):
        raise ValueError(f"dim {dim} of size {n} does not split into {size} x {stride} pieces")
    pieces = torch.split(full, n // (size * stride), dim=dim)
    return torch.cat(pieces[rank::size], dim=dim)


def tp_merge(shards: list) -> dict:
    """The full (TP-1) state dict of the TP ranks' state dicts ``shards`` (rank order):
    :func:`tp_slice` inverted for the split weights, rank 0's copy of the rest."""
    size = len(shards)
    out = {}
    for name, first in shards[0].items():
        rule = tp_partition(name)
        if rule is None or size == 1:
            out[name] = first
            continue
        dim, stride = rule
        parts = [s[name].split(s[name].shape[dim] // stride, dim=dim) for s in shards]
        out[name] = torch.cat([parts[r][j] for j in range(stride) for r in range(size)],
                              dim=dim)
    return out


def tp_shard_state_dict(full_state_dict: dict, model: torch.nn.Module, tp_rank: int,
                        tp_size: int) -> dict:
    """This TP rank's state dict for ``model`` cut from a 1×1×1 model's ``state_dict()``.

    Tensor-parallel parameters are cut by their Megatron attributes (``partition_dim``,
    ``partition_stride``); everything else is copied. Keys missing from ``full_state_dict``
    raise (``_extra_state`` entries are skipped). Load with ``model.load_state_dict(...,
    strict=False)`` to leave extra states alone.
    """
    out = {}
    params = dict(model.named_parameters())
    for name, local in model.state_dict(keep_vars=True).items():
        if name.endswith("_extra_state"):
            continue
        if name not in full_state_dict:
            raise KeyError(f"{name} missing from the full state dict (build the reference "
                           "model with the same config and kind)")
        full = full_state_dict[name]
        p = params.get(name)
        if p is not None and getattr(p, "tensor_model_parallel", False) and tp_size > 1:
            val = tp_slice(full, p.partition_dim, getattr(p, "partition_stride", 1), tp_rank,
                           tp_size)
        else:
            val = full
        if tuple(val.shape) != tuple(local.shape):
            raise ValueError(f"{name}: cut shape {tuple(val.shape)} != local {tuple(local.shape)}")
        out[name] = val.detach().clone()
    return out


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended to ``rows`` (a vocabulary padded for TP)."""
    if t.shape[0] > rows:
        raise ValueError(f"{t.shape[0]} rows do not fit in {rows}")
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def padded_vocab(vocab: int, tp: int) -> int:
    """``vocab`` rounded up to a multiple of TP (each TP rank holds an equal slice)."""
    return math.ceil(vocab / tp) * tp


def load_hf_into(model: torch.nn.Module, path: str, arch: HFArchitecture, *, tp_rank: int,
                 tp_size: int, weights: Optional[dict] = None) -> None:
    """Load the HF checkpoint in directory ``path`` (or its tensors ``weights``) into
    ``model``, a :func:`~megatron_patches.model.build_gpt_model` model of ``arch`` on TP rank
    ``tp_rank`` of ``tp_size``: names and fused layouts converted (:func:`hf_to_megatron`),
    the vocabulary padded with zero rows to the model's, this rank's TP slices kept. Every
    weight of the model must be filled; anything else raises naming the weight."""
    full = hf_to_megatron(read_hf_weights(path) if weights is None else weights, arch)
    own = model.state_dict()
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if key in full and key in own:
            rows = own[key].shape[0] * (tp_size if tp_partition(key) else 1)
            if full[key].shape[0] > rows:
                raise ValueError(f"the HF checkpoint's vocabulary ({full[key].shape[0]}) is "
                                 f"larger than the model's ({rows}): give the model at least "
                                 "the checkpoint's vocabulary")
            full[key] = pad_rows(full[key], rows)
    local = tp_shard_state_dict(full, model, tp_rank, tp_size)
    result = model.load_state_dict(local, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing:
        raise ValueError(f"the HF checkpoint {path} left model weights unset: "
                         f"{', '.join(missing[:5])}")

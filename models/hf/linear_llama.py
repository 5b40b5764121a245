"""HF-style Llama with linear attention (per-head decay) in some or all layers.

``LinearLlamaConfig`` is a ``LlamaConfig`` with two more fields: ``layer_kinds`` (one of
``"linear"`` / ``"gated"`` / ``"softmax"`` per layer; all ``"linear"`` is the linear variant,
``"gated"`` its gated form, a mix is the hybrid) and ``slope_schedule``
(``sp_attention.linear.slopes.decay_slopes``; train.py's and the
launcher's ``--sp-slope-schedule``; configs saved with its old name ``decay_schedule`` still
load). A linear layer
keeps Llama's q/k/v/o projections, GQA and RoPE on q and k (train.py's trials: linear attention
with decay learned long-range copying only with RoPE), replaces softmax by
``sp_attention.lightning_attention`` with scale ``head_dim ** -0.5``, and normalises each
head's output (RMS over the head dim, a weight per head and channel, ``o_norm.weight
[heads·head_dim]``) before ``o_proj``, because the un-normalised sum grows with the number of
tokens a head remembers. The decay, the gate and the norm are the layer core the Megatron
layers share (:mod:`models.linear_core`: same math, same weights).

Checkpoints saved before this release hold one ``o_norm.weight [head_dim]`` shared by the
heads; their ``config.json`` has no ``out_norm_per_head``, which then reads False and builds
that form, so they load and run unchanged; ``train.py --load-hf`` broadcasts it to the
per-head form exactly (:func:`models.linear_core.out_norm_weight_from`) and the export
(``python -m sp_train.export_hf``) writes the per-head form.

Slopes are fixed by the config (not parameters, not saved), so ``save_pretrained`` /
``from_pretrained`` round-trip through the config alone. A ``"gated"`` layer learns its decay
instead: a gate per head and token, ``g = −exp(A_log) · softplus(x·W + dt_bias)``
(Mamba2-style, :mod:`sp_attention.linear.gate_param`; ``gate_proj``, ``A_log`` and ``dt_bias``
are parameters, saved with the weights), handed to ``lightning_attention(g=...)``. Every layer
dispatches through ``ALL_ATTENTION_FUNCTIONS``: after ``models.hf.prepare_model_for_cp`` linear and softmax
layers both reach the CP attention; without it, linear layers run single-device
``lightning_attention`` and softmax layers HF's SDPA.

The field is named ``layer_kinds``, not HF's ``layer_types``: transformers builds cache
layers and masks from ``layer_types`` (``"linear_attention"`` means mamba-style states there).
Generation with a cache stores each linear layer's K/V and recomputes the layer (O(T²) over a
generation; fine for tests, not a fast decoder). Padding masks are ignored by linear layers:
right padding is harmless (causal), left padding is refused by the CP adapter.
"""
from __future__ import annotations


import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig
from transformers import initialization as init
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (LlamaForCausalLM, LlamaModel,
                                                      LlamaPreTrainedModel,
                                                      apply_rotary_pos_emb)

from sp_attention import lightning_attention
from sp_attention.linear.slopes import DEFAULT_SLOPE_SCHEDULE, SLOPE_SCHEDULES
from sp_attention.validation import resolve_ctx

from ..linear_core import HeadRMSNorm, gate_log_decay, gate_params, layer_slopes

from .attention import decay_kwargs, packed_plan

__all__ = ["LinearLlamaConfig", "LinearLlamaAttention", "LinearLlamaForCausalLM",
           "hybrid_layer_kinds", "register_auto_classes", "LAYER_KINDS"]

LAYER_KINDS = ("linear", "gated", "softmax")
LINEAR_KINDS = ("linear", "gated")


def hybrid_layer_kinds(num_layers: int, softmax_every: int) -> list[str]:
    """``softmax_every - 1`` linear layers then one softmax layer, repeated (e.g. every 4th
    layer softmax, as in MiniMax-01 / Lightning-style hybrids); ``softmax_every = 1`` is all
    softmax."""
    if softmax_every < 1 or num_layers < 1:
        raise ValueError(f"need num_layers >= 1 and softmax_every >= 1, got {num_layers}, "
                         f"{softmax_every}")
    return ["softmax" if (i + 1) % softmax_every == 0 else "linear" for i in range(num_layers)]


@strict
class LinearLlamaConfig(LlamaConfig):
    """``LlamaConfig`` plus ``layer_kinds`` (None: every layer linear), ``slope_schedule``
    (``"long_range"`` or ``"lightning"``, see ``sp_attention.linear.slopes``; the old name
    ``decay_schedule`` is read from saved configs) and ``out_norm_per_head`` (True: the
    output norm's weight is ``[heads·head_dim]``; False: one ``[head_dim]`` weight shared by
    the heads, the form of checkpoints saved before it existed — a saved config without the
    field reads False)."""

    model_type = "sp_linear_llama"

    layer_kinds: list[str] | None = None
    slope_schedule: str = DEFAULT_SLOPE_SCHEDULE
    out_norm_per_head: bool = True

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        """A saved config; one saved before ``out_norm_per_head`` existed holds the shared
        ``[head_dim]`` norm weight (the field then reads False)."""
        if "out_norm_per_head" not in config_dict:
            config_dict = dict(config_dict, out_norm_per_head=False)
        return super().from_dict(config_dict, **kwargs)

    def __post_init__(self, **kwargs):
        old = kwargs.pop("decay_schedule", None)      # configs saved before the rename
        if old is not None:
            self.slope_schedule = old
        if self.layer_kinds is None:
            self.layer_kinds = ["linear"] * self.num_hidden_layers
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        """Part of ``@strict`` validation: the Llama checks plus ours, each naming the fix."""
        super().validate_architecture()
        if len(self.layer_kinds) != self.num_hidden_layers:
            raise ValueError(f"layer_kinds has {len(self.layer_kinds)} entries for "
                             f"num_hidden_layers={self.num_hidden_layers}; give one per layer")
        bad = sorted(set(self.layer_kinds) - set(LAYER_KINDS))
        if bad:
            raise ValueError(f"layer_kinds entries {bad} are unknown; use {LAYER_KINDS}")
        if self.slope_schedule not in SLOPE_SCHEDULES:
            raise ValueError(f"slope_schedule={self.slope_schedule!r} is unknown; use one of "
                             f"{SLOPE_SCHEDULES}")


def local_linear_attention(module, query, key, value, attention_mask, scaling=None,
                           dropout=0.0, log_decay=None, **kwargs):
    """Single-device linear attention in HF's attention-function form (``[b, h, s, d]`` in,
    ``[b, s, h, d]`` out; K/V keep their Hkv heads); used when the model is not prepared for
    CP. ``log_decay [b, s, h]``: a gated layer's gates. Packed rows (``cu_seq_lens_q``, or
    restarting ``position_ids``) keep attention inside each document."""
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    ctx = resolve_ctx(None)                       # one process, the row in its order
    plan = packed_plan(ctx, query.shape[2], query.device, kwargs)
    packed = {} if plan is None else {"cu_seqlens": plan}
    return lightning_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                               ctx=ctx, scale=scale, **decay_kwargs(module, log_decay),
                               **packed), None


class LinearLlamaAttention(nn.Module):
    """Llama attention with softmax replaced by causal linear attention with per-head decay:
    fixed slopes, or (``gated``) a learnt gate per head and token."""

    is_linear_attention = True

    def __init__(self, config: LinearLlamaConfig, layer_idx: int, gated: bool = False):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.gated = gated
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim,
                                bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim,
                                bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.o_norm = HeadRMSNorm(self.num_heads, self.head_dim, eps=config.rms_norm_eps,
                                  shared=not config.out_norm_per_head)
        if gated:       # initialised by LinearLlamaForCausalLM._init_weights (Mamba2's rule)
            self.gate_proj = nn.Linear(config.hidden_size, self.num_heads, bias=False)
            a_log, dt_bias = gate_params(self.num_heads)
            self.A_log = nn.Parameter(a_log)
            self.dt_bias = nn.Parameter(dt_bias)

    def decay_slopes(self) -> torch.Tensor:
        """``[H]`` fp32 slopes of this layer (computed, not stored: from_pretrained builds
        modules on the meta device, where a stored tensor would be lost)."""
        return layer_slopes(self.num_heads, self.config.slope_schedule, self.layer_idx + 1,
                            self.config.num_hidden_layers)

    def log_decay(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """A gated layer's gates ``[b, s, h]`` (fp32) for its input ``hidden_states``."""
        return gate_log_decay(self.gate_proj(hidden_states), self.A_log, self.dt_bias)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                past_key_values=None, cache=None, **kwargs):
        # the KV cache: ``cache`` from transformers 5.24 on, ``past_key_values`` before
        cache = past_key_values if cache is None else cache
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # [b, h, s, d]
        key = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        new = query.shape[2]
        gates = {"log_decay": self.log_decay(hidden_states)} if self.gated else {}
        if self.gated and key.shape[2] > new:
            raise ValueError("decoding from a KV cache is not supported by gated layers (the "
                             "cache would have to hold their gates too); generate with "
                             "use_cache=False")
        if key.shape[2] > new:      # decoding: recompute over the cache; row t needs only q_t
            query = nn.functional.pad(query, (0, 0, key.shape[2] - new, 0))
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                          local_linear_attention)
        if getattr(attention, "sp_context", None) is None:   # sdpa/eager/...: not ours
            attention = local_linear_attention
        out, _ = attention(self, query, key, value, None, scaling=self.scaling, dropout=0.0,
                           **gates, **kwargs)
        out = self.o_norm(out[:, -new:])                     # [b, s, h, d]
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), None


class LinearLlamaForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` whose ``layer_kinds`` ``"linear"`` and ``"gated"`` layers use
    :class:`LinearLlamaAttention`."""

    config_class = LinearLlamaConfig
    config: LinearLlamaConfig

    def __init__(self, config: LinearLlamaConfig):
        if not isinstance(config, LinearLlamaConfig):
            raise TypeError(f"LinearLlamaForCausalLM needs a LinearLlamaConfig, got "
                            f"{type(config).__name__}")
        LlamaPreTrainedModel.__init__(self, config)      # LlamaForCausalLM's body, one swap
        self.model = LlamaModel(config)
        for i, kind in enumerate(config.layer_kinds):
            if kind in LINEAR_KINDS:
                self.model.layers[i].self_attn = LinearLlamaAttention(config, i,
                                                                      gated=kind == "gated")
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module):
        """Llama's initialisation, plus Mamba2's for a gated layer's ``A_log`` and
        ``dt_bias`` (parameters of our own, which HF's rule does not know)."""
        super()._init_weights(module)
        if isinstance(module, HeadRMSNorm):
            init.ones_(module.weight)
        if isinstance(module, LinearLlamaAttention) and module.gated:
            a_log, dt_bias = gate_params(module.num_heads)
            init.copy_(module.A_log, a_log)
            init.copy_(module.dt_bias, dt_bias)


def register_auto_classes() -> None:
    """Make ``AutoConfig`` / ``AutoModelForCausalLM`` load saved linear/hybrid models
    (idempotent)."""
    AutoConfig.register(LinearLlamaConfig.model_type, LinearLlamaConfig, exist_ok=True)
    AutoModelForCausalLM.register(LinearLlamaConfig, LinearLlamaForCausalLM, exist_ok=True)

"""The gated linear-attention layer: a scalar decay gate per head and token, Mamba2-style.

    g_t = −exp(A_log) · softplus(x_t · W + dt_bias)      (per head; g_t ≤ 0)
    S_t = exp(g_t) · S_{t−1} + k_tᵀ v_t,    o_t = scale · q_t S_t

``x_t`` is the layer's input (after its input norm), ``W [hidden → heads]`` the gate
projection, ``A_log`` and ``dt_bias`` one value per head (Mamba2's initialisation; the layer
core both frameworks share: :mod:`models.linear_core`). The decay then runs through
``sp_attention.lightning_attention(g=...)`` across the CP group, and the output gets the linear
layers' per-head RMS norm.

Under TP a rank holds its heads' ``A_log``, ``dt_bias`` and rows of ``W`` (a Megatron
``ColumnParallelLinear`` without output gather: each rank computes its heads' gates; its
input gradient is summed over TP as for the qkv projection). With
``use_cpu_initialization`` every rank draws the full tensors from the same seed and keeps its
slice, so the model is the same at every TP size.

How the gate reaches core attention: Megatron's core attention sees only q, k and v, so
:class:`GatedSelfAttention` (Megatron's ``SelfAttention`` with one change) computes ``x·W``
where it computes q, k, v and hands it over as one extra channel of the query
(``[.., np, hn + 1]``): RoPE rotates the first ``hn`` channels and passes the rest through
(Megatron's and ours), and activation recompute of core attention then recomputes from inputs
that carry the gate (no state kept between the two calls).
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron.core.transformer.attention import SelfAttention

from models.linear_core import decay_kwargs, gate_log_decay, gate_params

from .core_attention import LinearCoreAttention

__all__ = ["GatedCoreAttention", "GatedSelfAttention"]


class GatedCoreAttention(LinearCoreAttention):
    """Linear attention with a per-token, per-head decay gate over Megatron's CP group (see
    the module docstring). Used with :class:`GatedSelfAttention`, whose query carries the gate
    projection ``x·W`` as its last channel. Spec params: ``context_parallel_impl``,
    ``linear_tuning``, ``sp_context`` (as
    :class:`~megatron_patches.core_attention.LinearCoreAttention`)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str = "self",
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None, sp_context=None,
                 context_parallel_impl: Optional[str] = None, **kwargs):
        kwargs.pop("slope_schedule", None)              # no fixed slopes in a gated layer
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout,
                         softmax_scale, cp_comm_type, pg_collection, sp_context,
                         context_parallel_impl, **kwargs)
        from megatron.core.tensor_parallel import (ColumnParallelLinear,
                                                   set_tensor_model_parallel_attributes)
        heads = config.num_attention_heads
        first = self.tp_rank * self.heads_per_rank
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        a_log, dt_bias = gate_params(heads)            # full, then this TP rank's heads
        cut = slice(first, first + self.heads_per_rank)
        self.A_log = torch.nn.Parameter(a_log[cut].to(device=device, dtype=config.params_dtype))
        self.dt_bias = torch.nn.Parameter(dt_bias[cut].to(device=device,
                                                          dtype=config.params_dtype))
        for p in (self.A_log, self.dt_bias):
            set_tensor_model_parallel_attributes(p, True, 0, 1)
        self.gate_proj = ColumnParallelLinear(config.hidden_size, heads, config=config,
                                              init_method=config.init_method, bias=False,
                                              gather_output=False, tp_group=self.tp_group)

    def gate_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``x·W`` of this TP rank's heads: ``[s, b, np]`` from the layer input ``[s, b, h]``."""
        out, _ = self.gate_proj(hidden_states)
        return out

    def _decay(self, query: torch.Tensor):
        # the query's last channel is the gate projection (GatedSelfAttention)
        if query.shape[-1] != self.head_dim + 1:
            raise ValueError(f"GatedCoreAttention got a query of head dim {query.shape[-1]}, "
                             f"expected {self.head_dim} + 1 (the gate channel): use it with "
                             "megatron_patches.gated_attention.GatedSelfAttention (the 'gated' "
                             "layer spec, pattern letter G)")
        g = gate_log_decay(query[..., -1], self.A_log, self.dt_bias)     # [b, s, np]
        return query[..., :-1], decay_kwargs(g=g, tuning=self.linear_tuning)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The output norm, ``A_log``, ``dt_bias`` and the gate projection are sharded over TP
        along dim 0 (their heads)."""
        return self._sharded(prefix, sharded_offsets, metadata,
                             ("out_norm_weight", "A_log", "dt_bias", "gate_proj.weight"))


class GatedSelfAttention(SelfAttention):
    """Megatron's ``SelfAttention`` whose query carries one more channel per head, the gate
    projection of the layer input, for a core attention with ``gate_logits`` (the gated
    layer); with any other core attention it is ``SelfAttention``."""

    def get_query_key_value_tensors(self, hidden_states, *args, **kwargs):
        out = super().get_query_key_value_tensors(hidden_states, *args, **kwargs)
        gate = getattr(self.core_attention, "gate_logits", None)
        if gate is None:
            return out
        if not isinstance(out, tuple) or len(out) not in (3, 4) or out[0].dim() != 4:
            raise ValueError("the gated layer needs q, k, v split (no fused single qkv RoPE, "
                             "no output gate): set fused_single_qkv_rope=False and "
                             "attention_output_gate=False")
        query = out[0]
        logits = gate(hidden_states).unsqueeze(-1).to(query.dtype)          # [s, b, np, 1]
        return (torch.cat([query, logits], dim=-1),) + tuple(out[1:])

"""Megatron-Core core-attention modules that split the sequence over Megatron's CP group.

Both honour Megatron's core-attention contract (the slot ``SelfAttention.submodules.
core_attention`` of GPT and hybrid layer specs), megatron-core 0.16 and 0.19 alike:

- constructor kwargs ``config, layer_number, attn_mask_type, attention_type, cp_comm_type,
  softmax_scale, pg_collection`` (+ ``attention_dropout`` on 0.16; anything else is accepted
  and ignored only where it cannot change the result), plus our options from the spec's
  ``params``;
- ``forward(query [sq, b, np, hn], key/value [sk, b, ng, hn], attention_mask,
  attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> [sq, b, np·hn]``,
  where ``sq`` is this CP rank's shard in the layout of the module's ``SPContext`` (spec param
  ``sp_context``: ``build_gpt_model`` passes the model's one context; None builds one over the
  CP group in ``sp_attention.DEFAULT_LAYOUT``, zigzag = Megatron's ``get_batch_on_this_cp_rank``);
- packed documents: with Megatron's THD ``packed_seq_params`` (``qkv_format="thd"``, the
  global row's ``cu_seqlens_q/kv`` or their ``_padded`` forms) query is ``[t, np, hn]`` and the
  output ``[t, np·hn]``; the row's :class:`~sp_attention.PackingPlan`
  (:func:`megatron_patches.packing.plan_of`, built once per batch) says where its tokens lie,
  and attention stays inside each document. The model's RoPE is applied here, from the plan's
  positions (restarting per document): :class:`~megatron_patches.rotary.CPRotaryEmbedding`
  hands Megatron's attention no rotary embedding for THD batches, because Megatron's own THD
  RoPE assumes TransformerEngine's per-document split. ``build_gpt_model`` links each module to
  the model's RoPE (:meth:`_CPCoreAttention.link_packed_rope`); an unlinked module (a prebuilt
  spec under Megatron-LM's own RoPE and THD split) refuses THD batches at CP > 1.

Groups come from ``pg_collection`` (``.cp``, ``.tp``) or Megatron's ``parallel_state`` getters,
never our own. Options the modules cannot honour (packed formats other than THD, attention bias,
dropout > 0, a dense attention mask, non-causal masks, sliding windows, softmax variants) raise
``ValueError`` naming the option to change, at construction where possible, else on the first
forward — on every rank alike, before any collective.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from sp_attention import (SoftmaxSchedule, SPContext, build_sp_context,
                          context_parallel_attention, lightning_attention)
from sp_attention.caches import to_device
from sp_attention.planning.packing import packing_context

from models.linear_core import decay_kwargs, layer_slopes, out_norm

from . import options as _options
from .options import DEFAULT_SLOPE_SCHEDULE, take_renamed
from .packing import check_packed_seq_params, plan_of

__all__ = ["SoftmaxCoreAttention", "LinearCoreAttention", "resolve_groups", "softmax_schedule_of"]


def softmax_schedule_of(schedule: Union[SoftmaxSchedule, dict, None]) -> SoftmaxSchedule:
    """A :class:`~sp_attention.SoftmaxSchedule` from a spec param (the schedule, a dict of its
    fields, or None for the trainers' default, :data:`.options.DEFAULT_SOFTMAX_SCHEDULE`)."""
    if schedule is None:
        return _options.DEFAULT_SOFTMAX_SCHEDULE
    if isinstance(schedule, dict):
        return SoftmaxSchedule(**schedule)
    if not isinstance(schedule, SoftmaxSchedule):
        raise TypeError(f"softmax_schedule must be a sp_attention.SoftmaxSchedule, a dict of its "
                        f"fields or None, got {type(schedule).__name__}")
    return schedule


def resolve_groups(pg_collection) -> tuple[Optional[dist.ProcessGroup], Optional[dist.ProcessGroup]]:
    """``(tp, cp)`` groups from Megatron's ``pg_collection`` or its ``parallel_state`` getters."""
    if pg_collection is not None and hasattr(pg_collection, "cp") and hasattr(pg_collection, "tp"):
        return pg_collection.tp, pg_collection.cp
    from megatron.core import parallel_state as ps
    return (ps.get_tensor_model_parallel_group(check_initialized=False),
            ps.get_context_parallel_group(check_initialized=False))


def _size_rank(group) -> tuple[int, int]:
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _check_config(config, attn_mask_type, attention_type, attention_dropout) -> None:
    """Refuse every option whose effect we would otherwise silently drop."""
    dropout = config.attention_dropout if attention_dropout is None else attention_dropout
    if dropout:
        raise ValueError(f"attention_dropout={dropout}: the CP attention kernels have no dropout; "
                         "set attention_dropout=0.0 (Megatron-LM: --attention-dropout 0)")
    if attention_type != "self":
        raise ValueError(f"attention_type={attention_type!r}: only self-attention is supported")
    if attn_mask_type != AttnMaskType.causal:
        raise ValueError(f"attn_mask_type={attn_mask_type}: only causal attention is supported "
                         "(the spec's self_attention params must say AttnMaskType.causal)")
    if getattr(config, "window_size", None) is not None:
        raise ValueError("window_size (sliding-window attention) is not supported by the CP "
                         "attention; set window_size=None")
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        raise ValueError(f"softmax_type={config.softmax_type!r} is not supported; use 'vanilla'")
    if getattr(config, "multi_latent_attention", False):
        raise ValueError("multi_latent_attention is not supported by the CP attention modules")


def _check_call(attention_mask, attn_mask_type, attention_bias) -> None:
    if attention_bias is not None:
        raise ValueError("attention_bias is not supported by the CP attention; drop the bias "
                         "(e.g. ALiBi) or use position_embedding_type='rope'")
    if attn_mask_type is not None and attn_mask_type != AttnMaskType.causal:
        raise ValueError(f"attn_mask_type={attn_mask_type}: only causal attention is supported")
    if attention_mask is not None:
        raise ValueError("a dense attention_mask cannot be honoured: the CP attention applies the "
                         "causal mask on the global sequence itself. Pass attention_mask=None "
                         "(Megatron-LM: --no-create-attention-mask-in-dataloader; packed "
                         "documents: THD packed_seq_params)")


def _to_bshd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1)    # [s, b, h, d] -> [b, s, h, d] (a view; kernels take strides)


# A module's packed_rope before build_gpt_model linked it: unknown whether (and whose) RoPE
# the model applies to THD batches.
_UNLINKED = object()


def _layer_context(sp_context: Optional[SPContext], cp_group, cp_size: int) -> SPContext:
    """The layer's SPContext: the given one (checked against the CP group's size), else one
    over the CP group in the default layout (rank arithmetic only, no collective)."""
    if sp_context is None:
        return build_sp_context(cp_group)
    if not isinstance(sp_context, SPContext):
        raise TypeError(f"sp_context must be an sp_attention.SPContext, got "
                        f"{type(sp_context).__name__}")
    if sp_context.world_size != cp_size:
        raise ValueError(f"sp_context spans {sp_context.world_size} ranks but the layer's CP group "
                         f"has {cp_size}; build it from the same group (pg_collection.cp)")
    return sp_context


class _CPCoreAttention(MegatronModule):
    """Shared constructor: groups, SP context, head counts, checks."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str = "self",
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None,
                 sp_context: Optional[SPContext] = None, **kwargs):
        super().__init__(config=config)
        _check_config(config, attn_mask_type, attention_type, attention_dropout)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        tp_group, cp_group = resolve_groups(pg_collection)
        self.tp_group = tp_group
        self.tp_size, self.tp_rank = _size_rank(tp_group)
        cp_size, _ = _size_rank(cp_group)
        # heads divisible by TP: SPOptions' rule (and Megatron's own SelfAttention asserts it)
        self.heads_per_rank = config.num_attention_heads // self.tp_size
        self.head_dim = config.kv_channels
        self.softmax_scale = self.head_dim ** -0.5 if softmax_scale is None else softmax_scale
        self.sp_ctx = _layer_context(sp_context, cp_group, cp_size)
        self.packed_ctx = packing_context(self.sp_ctx)    # where THD batches are planned
        self.packed_rope = _UNLINKED

    def link_packed_rope(self, rope) -> None:
        """What rotates q and k of THD batches: the model's
        :class:`~megatron_patches.rotary.CPRotaryEmbedding` (its ``rotate``), or None for a
        model without RoPE (learned absolute positions). ``build_gpt_model`` calls this."""
        self.packed_rope = rope

    def _inputs(self, query, key, value, packed_seq_params):
        """``[b, s, h, d]`` views of q, k, v and the batch's packing plan (None: unpacked);
        THD batches get the model's RoPE here, at the plan's positions."""
        if packed_seq_params is None:
            return _to_bshd(query), _to_bshd(key), _to_bshd(value), None
        check_packed_seq_params(packed_seq_params)
        if query.dim() != 3:
            raise ValueError(f"THD packed_seq_params with query {tuple(query.shape)}: Megatron's "
                             "THD attention hands core attention [t, np, hn]")
        plan = plan_of(packed_seq_params, self.sp_ctx, query.shape[0], query.device)
        if self.packed_rope is _UNLINKED and self.sp_ctx.world_size > 1:
            raise ValueError(
                "a THD (packed) batch at CP > 1 reached a core attention that build_gpt_model "
                "did not build: its tokens must be cut by our packing plan and RoPE must follow "
                "it. Build the model with megatron_patches.model.build_gpt_model (our launcher "
                "and train.py do) and cut batches with megatron_patches.packing.pack_batch")
        q, k, v = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)   # [1, t, h, d]
        if self.packed_rope is not None and self.packed_rope is not _UNLINKED:
            pos = plan.position_ids(self.packed_ctx.rank, q.device)
            q, k = self.packed_rope(q, pos), self.packed_rope(k, pos)
        return q, k, v, plan

    def _output(self, out: torch.Tensor, packed: bool = False) -> torch.Tensor:
        # [b, s, np, hn] -> [s, b, np*hn]; THD: [1, t, np, hn] -> [t, np*hn]
        b, s = out.shape[:2]
        if packed:
            return out.reshape(s, -1)
        return out.transpose(0, 1).reshape(s, b, -1)


class SoftmaxCoreAttention(_CPCoreAttention):
    """Causal GQA softmax attention over Megatron's CP group (ring, head-strided all-gather,
    all-to-all: every preset of :func:`sp_attention.context_parallel_attention`).

    Spec params: ``softmax_schedule`` (:class:`sp_attention.SoftmaxSchedule`, a dict of its
    fields, or None: ``auto``, :data:`.options.DEFAULT_SOFTMAX_SCHEDULE`), ``sp_context``.
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str = "self",
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None,
                 sp_context: Optional[SPContext] = None, softmax_schedule=None, **kwargs):
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout,
                         softmax_scale, cp_comm_type, pg_collection, sp_context)
        # its rules against the head counts: SPOptions' (and the op's, on every call)
        self.softmax_schedule = softmax_schedule_of(softmax_schedule)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        _check_call(attention_mask, attn_mask_type, attention_bias)
        q, k, v, plan = self._inputs(query, key, value, packed_seq_params)
        ctx = self.sp_ctx if plan is None else self.packed_ctx
        out = context_parallel_attention(q, k, v, ctx=ctx, causal=True, cu_seqlens=plan,
                                         softmax_scale=self.softmax_scale,
                                         **self.softmax_schedule.kwargs())
        return self._output(out, packed=plan is not None)


class LinearCoreAttention(_CPCoreAttention):
    """Lightning-style linear attention with per-head decay over Megatron's CP group: a shell
    around the one layer core of both frameworks, :mod:`models.linear_core` (the HF layer is
    the other).

    ``o_t = scale · Σ_{j≤t} λ_h^{t−j} (q_t·k_j) v_j`` per head (``scale`` = Megatron's
    softmax scale, ``hn^-0.5`` by default; q and k arrive with RoPE applied), then the per-head
    RMS output norm with its learnt ``out_norm_weight [np·hn]`` (one value per head and
    channel, :func:`models.linear_core.out_norm`; linear attention's output scale grows with
    the sequence). The norm is per head, so a TP rank normalises only its own heads; its weight
    is TP-sharded like the heads.

    Spec params: ``context_parallel_impl`` (the scan, ``--context-parallel-impl``: blelloch /
    allgather / ring / auto, handed to ``lightning_attention(impl=...)``; None: the library's
    ``DEFAULT_IMPL``, read at each call; its name is checked by
    :class:`~megatron_patches.options.SPOptions` and by the op), ``slope_schedule``
    (``sp_attention.linear.slopes``; None: the default), ``linear_tuning`` (the op's
    :class:`~sp_attention.LinearTuning`, ``--linear-op-graphs``; None: the defaults),
    ``sp_context``. GQA: K/V go to
    ``lightning_attention`` with their ``ng`` heads; it maps query head i to group
    ``i // (np / ng)``, Megatron's mapping.
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str = "self",
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None,
                 sp_context: Optional[SPContext] = None,
                 context_parallel_impl: Optional[str] = None,
                 slope_schedule: Optional[str] = None, linear_tuning=None, **kwargs):
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout,
                         softmax_scale, cp_comm_type, pg_collection, sp_context)
        self.context_parallel_impl = take_renamed(kwargs, "cp_impl", "context_parallel_impl",
                                                  context_parallel_impl)
        self.slope_schedule = DEFAULT_SLOPE_SCHEDULE if slope_schedule is None else slope_schedule
        self.linear_tuning = linear_tuning
        first = self.tp_rank * self.heads_per_rank
        # This TP rank's heads' slopes, fp32. A plain attribute, not a buffer: Megatron's
        # Float16Module casts buffers to bf16, which would round the decay rates.
        self._slopes = layer_slopes(config.num_attention_heads, self.slope_schedule,
                                    self.layer_number, config.num_layers, first,
                                    self.heads_per_rank)
        self._slopes_on: dict = {}
        self.eps = config.layernorm_epsilon
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.out_norm_weight = torch.nn.Parameter(torch.ones(
            self.heads_per_rank * self.head_dim, dtype=config.params_dtype, device=device))
        # TP-sharded along dim 0 (per head), so Megatron's optimizer, grad clipping and
        # checkpoints treat it like the heads' other weights.
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
        set_tensor_model_parallel_attributes(self.out_norm_weight, True, 0, 1)

    @property
    def slopes(self) -> torch.Tensor:
        """``[np]`` fp32 decay rates of this TP rank's heads."""
        return self._slopes

    def _slopes_for(self, device) -> torch.Tensor:
        key = str(device)
        if key not in self._slopes_on:
            self._slopes_on[key] = to_device(self._slopes, device)
        return self._slopes_on[key]

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        _check_call(attention_mask, attn_mask_type, attention_bias)
        q, k, v, plan = self._inputs(query, key, value, packed_seq_params)   # k, v: ng heads
        q, decay = self._decay(q)
        packed = {} if plan is None else {"cu_seqlens": plan}
        o = lightning_attention(q, k, v, ctx=self.sp_ctx if plan is None else self.packed_ctx,
                                impl=self.context_parallel_impl, scale=float(self.softmax_scale),
                                **decay, **packed)
        return self._output(self._out_norm(o, q.dtype), packed=plan is not None)

    def _decay(self, q: torch.Tensor):
        """``(q, the decay keywords of lightning_attention)``: this layer's fixed slopes."""
        return q, decay_kwargs(slopes=self._slopes_for(q.device), tuning=self.linear_tuning)

    def _out_norm(self, o: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The core's per-head RMS norm with the learnt weight, in ``dtype``."""
        return out_norm(o, self.out_norm_weight, self.eps).to(dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The output-norm weight is sharded over TP along dim 0 (distributed checkpoints)."""
        return self._sharded(prefix, sharded_offsets, metadata, ("out_norm_weight",))

    def _sharded(self, prefix, sharded_offsets, metadata, tp_dim0: tuple):
        """Megatron's sharded state dict of this module: ``tp_dim0`` entries split over TP
        along dim 0 (their heads), the rest replicated."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
        state_dict = self.state_dict(prefix="", keep_vars=True)
        dp_cp = metadata.get("dp_cp_group") if metadata else None
        groups = {} if dp_cp is None else {"tp_group": self.tp_group, "dp_cp_group": dp_cp}
        return make_sharded_tensors_for_checkpoint(state_dict, prefix,
                                                   {name: 0 for name in tp_dim0},
                                                   sharded_offsets, **groups)

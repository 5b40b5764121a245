"""Build Megatron-Core GPT models (softmax, linear-attention, hybrid) that split sequences over CP.

Contract of :func:`build_gpt_model` (megatron-core 0.16.1 on CPU/gloo in fp32 with
``use_cpu_initialization=True``; 0.19.x on GPU in bf16):

- Groups: Megatron's own (``parallel_state.initialize_model_parallel(tp, pp=1, cp=cp)`` before
  building, or an explicit ``pg_collection`` with ``.tp``/``.cp``/``.pp``/...). The plugin never
  creates groups.
- Layout: the model holds one ``SPContext`` (``model.sp_context``: Megatron's CP group in
  ``layout``, default ``sp_attention.DEFAULT_LAYOUT`` = zigzag, Megatron's own split), which
  every attention layer and the RoPE use; shard the data with it.
- Inputs: ``model(input_ids, position_ids, attention_mask=None, labels=labels)`` with
  ``input_ids [b, s/cp]`` this CP rank's shard (``sp_attention.shard_sequence(x,
  model.sp_context)``; for zigzag the same as Megatron's ``get_batch_on_this_cp_rank``),
  ``position_ids [b, s/cp]`` the **global** positions of those tokens
  (``sp_attention.shard_position_ids``), ``labels [b, s/cp]`` shifted on the global sequence
  *before* sharding (``sp_attention.shift_labels``). ``attention_mask`` must be None: every
  attention is causal on the global sequence.
- Output: per-token loss ``[b, s/cp]`` (fp32) as Megatron returns it with labels, or logits
  ``[b, s/cp, vocab/tp]`` without.
- Loss and gradients: ``global_loss_share(loss, labels, grad_reduce_group())`` is this rank's
  share of the mean cross entropy over the real targets of the global batch (labels
  ``!= -100``; Megatron's per-token loss is *not* zero at the ``-100`` that ``shift_labels``
  puts at each sequence's end, so an unmasked mean is off by ~1/T); backward it, then sum the
  gradients over Megatron's DP×CP group (:func:`grad_reduce_group`) with
  ``sp_train.reduce.all_reduce_gradients`` (no TP reduction is needed without sequence
  parallelism). Megatron's own DDP/optimizer does the same on GPUs.
- Parallelism invariance: with ``use_cpu_initialization=True`` Megatron draws every weight's
  full master tensor from the torch RNG and keeps the TP slice, so equal seeds give the same
  model at every TP×CP×DP (checked by :func:`tp_shard_state_dict` tests). To start any layout
  from a 1×1×1 state dict explicitly, load ``tp_shard_state_dict(full_sd, model, tp_rank,
  tp_size)`` (it honours ``partition_stride``, e.g. SwiGLU's interleaved fc1).
- RoPE: our :class:`~megatron_patches.rotary.CPRotaryEmbedding` replaces Megatron's (CUDA
  only, slices positions itself): it uses the ``position_ids`` the model is called with.
- Packed documents: ``model(input_ids, position_ids, None, labels=labels,
  packed_seq_params=params)`` with a THD micro-batch cut by
  :func:`megatron_patches.packing.pack_batch` (``input_ids [1, L]``: the micro-batch's rows end
  to end, this rank's shard by the batch's packing plan; ``position_ids`` restarting per
  document; labels shifted inside each document *before* cutting; ``params``: Megatron's
  ``PackedSeqParams(qkv_format="thd", cu_seqlens_q/kv=...)`` of the whole row). Attention
  stays inside each document across CP ranks; RoPE uses the plan's positions.
- Linear layers' decay slopes are the TP rank's heads' slice of the global schedule; GQA K/V
  reach ``lightning_attention`` grouped (Megatron's head-to-group mapping).
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from sp_attention import SoftmaxSchedule, build_sp_context
from sp_attention.cost.auto import auto_softmax_preset
from sp_attention.linear.attention import resolve_impl
from sp_attention.tokens import global_token_mean

from .core_attention import resolve_groups
from .options import MODEL_KINDS as KINDS
from .options import SPOptions, model_pattern, take_renamed
from .rotary import install_cp_rope, link_packed_rope
from .specs import block_spec, options_spec_kwargs
from .weights import tp_shard_state_dict
from .weights import tp_slice as _tp_slice  # noqa: F401  (the old private name, used by tests)

__all__ = ["build_gpt_model", "model_options", "KINDS", "POSITION_EMBEDDINGS", "tp_shard_state_dict",
           "grad_reduce_group", "cp_context", "layer_pattern", "global_loss_share",
           "HiddenStatesGPTModel", "output_weight", "auto_picks"]

POSITION_EMBEDDINGS = ("rope", "learned_absolute")


def layer_pattern(kind: str, num_layers: int, hybrid_pattern: Optional[str] = None) -> str:
    """The expanded per-layer pattern (``L``/``S`` per layer) of a model ``kind`` (hybrid:
    ``hybrid_pattern``, None = ``options.default_hybrid_pattern``)."""
    return model_pattern(kind, num_layers, hybrid_pattern)


class HiddenStatesGPTModel(GPTModel):
    """A ``GPTModel`` whose forward returns the final hidden states ``[s, b, h]`` (after the
    final norm) instead of logits or per-token losses.

    For a loss that applies the output layer itself without ever holding ``[s, b, V]`` logits
    (``sp_train.loss.linear_cross_entropy`` with :func:`output_weight`).
    Everything else — parameters, output layer, state dict, checkpoints — is ``GPTModel``'s;
    only the step after the decoder (``_postprocess``, called with keywords by megatron-core
    0.16 and 0.19 alike) hands back its input. Multi-token prediction is not supported.
    """

    def _postprocess(self, *args, **kwargs):
        return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


def output_weight(model: GPTModel) -> torch.Tensor:
    """The output layer's weight ``[V/TP, h]`` of this TP rank (the word embedding's when
    input and output embeddings are shared)."""
    if getattr(model, "share_embeddings_and_output_weights", False):
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def _check(config: TransformerConfig, position_embedding_type) -> None:
    if not isinstance(config, TransformerConfig):
        raise TypeError(f"config must be a megatron.core TransformerConfig, got "
                        f"{type(config).__name__}")
    if position_embedding_type not in POSITION_EMBEDDINGS:
        raise ValueError(f"position_embedding_type={position_embedding_type!r}: use one of "
                         f"{POSITION_EMBEDDINGS}")
    if config.pipeline_model_parallel_size != 1:
        raise ValueError("pipeline parallelism is not supported by build_gpt_model; set "
                         "pipeline_model_parallel_size=1")
    if not config.use_cpu_initialization and not torch.cuda.is_available():
        raise ValueError("no CUDA device: set use_cpu_initialization=True in the "
                         "TransformerConfig to build on CPU")


def model_options(config: TransformerConfig, options: Optional[SPOptions] = None,
                  **pieces) -> SPOptions:
    """The :class:`~megatron_patches.options.SPOptions` of a model with ``config``: ``options``
    for this config (:meth:`~megatron_patches.options.SPOptions.with_model`), or one built from
    ``pieces`` (``kind``, ``hybrid_pattern``, ``context_parallel_impl``, ``softmax_schedule``,
    ``slope_schedule``) and the config's layer and head counts."""
    heads = config.num_attention_heads
    facts = dict(num_layers=config.num_layers, num_attention_heads=heads,
                 num_query_groups=config.num_query_groups or heads,
                 tensor_model_parallel_size=config.tensor_model_parallel_size)
    if options is None:
        if pieces.get("kind") is None:
            raise TypeError("build_gpt_model needs options= (an SPOptions) or kind=")
        return SPOptions(model_kind=pieces.pop("kind"), **pieces, **facts)
    given = sorted(k for k, v in pieces.items() if v is not None)
    if given:
        raise TypeError(f"pass options= or {', '.join(given)}=, not both")
    if not isinstance(options, SPOptions):
        raise TypeError(f"options must be a megatron_patches.options.SPOptions, got "
                        f"{type(options).__name__}")
    return options.with_model(**facts)


def build_gpt_model(config: TransformerConfig, options: Optional[SPOptions] = None, *,
                    vocab_size: int, max_sequence_length: int, kind: Optional[str] = None,
                    context_parallel_impl: Optional[str] = None,
                    softmax_schedule: Optional[SoftmaxSchedule] = None,
                    hybrid_pattern: Optional[str] = None, slope_schedule: Optional[str] = None,
                    layout: Optional[str] = None, position_embedding_type: str = "rope",
                    pg_collection=None, rotary_base: float = 10000,
                    rope_scaling: Optional[dict] = None,
                    return_hidden_states: bool = False, **gpt_kwargs) -> GPTModel:
    """A Megatron ``GPTModel`` whose attention layers run over Megatron's CP group.

    Args:
        config: Megatron ``TransformerConfig`` (``attention_dropout=0``; TP and CP sizes as
            initialised in ``parallel_state``; ``pipeline_model_parallel_size=1``).
        options: our attention options, one :class:`~megatron_patches.options.SPOptions`
            (train.py's and the launcher's, built once from the command line); or give its
            pieces instead:
        kind: ``"softmax"`` (Llama-style), ``"linear"`` (linear attention with decay),
            ``"gated"`` or ``"hybrid"`` (``hybrid_pattern``).
        context_parallel_impl: the linear layers' cross-rank scan (``--context-parallel-impl``:
            blelloch / allgather / ring / auto; None: the library's
            ``sp_attention.linear.DEFAULT_IMPL``, read at each call). ``cp_impl=``, its old
            name, works for one release.
        softmax_schedule: :class:`sp_attention.SoftmaxSchedule` (preset, head strides, backend)
            of softmax layers; None: ``auto`` (:data:`.options.DEFAULT_SOFTMAX_SCHEDULE`).
        hybrid_pattern: ``L`` (linear) / ``G`` (gated) / ``S`` (softmax) per layer, repeated to
            ``num_layers`` (must divide it); ``"LLLS"``: three linear layers to one softmax
            layer. None: ``megatron_patches.options.default_hybrid_pattern(num_layers)``.
        slope_schedule: linear layers' decay schedule (``sp_attention.linear.slopes``); None:
            ``megatron_patches.options.DEFAULT_SLOPE_SCHEDULE``.
        vocab_size, max_sequence_length: as for ``GPTModel``.
        layout: how sequences lie over the CP group (``"zigzag"``, ``"contiguous"``); None:
            ``sp_attention.DEFAULT_LAYOUT``, read now. The model's one ``SPContext``
            (``model.sp_context``) carries it to every layer and the RoPE; shard data with it.
        position_embedding_type: ``"rope"`` (our RoPE, in the model's layout) or
            ``"learned_absolute"``.
        pg_collection: Megatron ``ProcessGroupCollection``; None uses ``parallel_state``'s.
        rotary_base, **gpt_kwargs: passed on (``share_embeddings_and_output_weights``, ...).
        rope_scaling: HF's ``linear`` or ``llama3`` RoPE frequency scaling
            (:func:`megatron_patches.rotary.rope_inv_freq`; None: none).
        return_hidden_states: build a :class:`HiddenStatesGPTModel` (forward returns the final
            hidden states; apply the output layer in the loss with :func:`output_weight`).

    The rules between the options (and heads divisible by TP) are
    :class:`~megatron_patches.options.SPOptions`'; the model keeps its options as
    ``model.sp_options``. See the module docstring for the input/output and gradient contract.
    """
    _check(config, position_embedding_type)
    if rope_scaling is not None and position_embedding_type != "rope":
        raise ValueError("rope_scaling needs position_embedding_type='rope'")
    scan = take_renamed(gpt_kwargs, "cp_impl", "context_parallel_impl", context_parallel_impl)
    options = model_options(config, options, kind=kind, context_parallel_impl=scan,
                            softmax_schedule=softmax_schedule, hybrid_pattern=hybrid_pattern,
                            slope_schedule=slope_schedule)
    if options.megatron_attention:
        raise ValueError("--context-parallel-impl megatron builds Megatron's own model (the "
                         "launcher does); build_gpt_model runs our attention: pick blelloch, "
                         "allgather, ring or auto")
    ctx = cp_context(pg_collection, layout=layout)
    spec = block_spec(options.pattern, config.num_layers, sp_context=ctx,
                      **options_spec_kwargs(options))
    if pg_collection is not None:
        gpt_kwargs["pg_collection"] = pg_collection
    if len(set(options.pattern)) > 1:
        # Layers of different kinds hold different parameters (a linear layer's output norm),
        # which Megatron's distributed checkpoint cannot stack into one tensor per name over
        # all layers ("Invalid access pattern", seen saving a hybrid on 0.19.2): its own switch
        # for such blocks keys every layer's tensors by the layer's number.
        config.hetereogenous_dist_checkpoint = True
    if return_hidden_states and config.mtp_num_layers:
        raise ValueError("return_hidden_states does not support multi-token prediction; set "
                         "mtp_num_layers=None or use the model's own loss")
    cls = HiddenStatesGPTModel if return_hidden_states else GPTModel
    model = cls(config=config, transformer_layer_spec=spec, vocab_size=vocab_size,
                max_sequence_length=max_sequence_length,
                position_embedding_type=position_embedding_type, rotary_base=rotary_base,
                **gpt_kwargs)
    if position_embedding_type == "rope":
        install_cp_rope(model, config, ctx, rotary_base=rotary_base,
                        rotary_percent=gpt_kwargs.get("rotary_percent", 1.0),
                        seq_len_interpolation_factor=gpt_kwargs.get(
                            "seq_len_interpolation_factor"), rope_scaling=rope_scaling)
    else:           # THD batches: positions come from the embeddings, nothing to rotate
        link_packed_rope(model, None)
    model.sp_options = options
    model.sp_layer_pattern = options.pattern
    model.sp_context = ctx
    return model


def cp_context(pg_collection=None, layout: Optional[str] = None):
    """The ``SPContext`` of Megatron's CP group (``pg_collection.cp`` or ``parallel_state``'s)
    in ``layout`` (None: ``sp_attention.DEFAULT_LAYOUT``, read now). A model built by
    :func:`build_gpt_model` holds its own as ``model.sp_context``; shard batches with that
    (``shard_sequence(x, ctx)``, ``shard_position_ids(seq_len, ctx)``)."""
    _, cp = resolve_groups(pg_collection)
    return build_sp_context(cp, layout=layout)


def grad_reduce_group(pg_collection=None):
    """Megatron's DP×CP group: sum gradients over it (``all_reduce_gradients``)."""
    if pg_collection is not None and getattr(pg_collection, "dp_cp", None) is not None:
        return pg_collection.dp_cp
    from megatron.core import parallel_state
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def global_loss_share(token_loss: torch.Tensor, labels: torch.Tensor, group, *,
                      ignore_index: int = -100) -> torch.Tensor:
    """This rank's share of the mean cross entropy over every real target of ``group``'s
    ranks (Megatron's DP×CP group: :func:`grad_reduce_group`); the shares sum to the mean.

    Megatron's cross entropy has no ignore index: where ``labels == ignore_index`` (the last
    position of each sequence after ``sp_attention.shift_labels``, padding) it returns a
    finite loss (logsumexp − max of the logits, ~ln V for a fresh model), so those tokens must
    be left out of the sum *and* the count, which is what this does.

    Args:
        token_loss: the model's per-token loss ``[b, s/cp]`` (``model(..., labels=labels)``).
        labels: the same shard of the shifted labels ``[b, s/cp]``.
        group: the ranks whose tokens make up the global batch.
    """
    if labels.shape != token_loss.shape:
        raise ValueError(f"labels {tuple(labels.shape)} must have the shape of the per-token "
                         f"loss {tuple(token_loss.shape)}: pass the labels the model got")
    return global_token_mean(token_loss, labels != ignore_index, group)


def auto_picks(options: SPOptions, ctx, *, micro_batch_size: int, seq_length: int,
               head_dim: int, dtype: torch.dtype, device) -> dict:
    """The schedules each layer kind runs, resolved now for the run's per-rank shape
    (``micro_batch_size`` rows of ``seq_length / CP`` tokens, the options' heads per TP rank):
    ``{"softmax": preset, "linear": scan}`` for the kinds the model has. ``auto`` is resolved
    as the op will resolve it (the cost model on GPUs, the fixed rule on CPU; logged once per
    shape on the ``sp_attention.cost`` logger); a named schedule is itself. No memory is
    allocated (shape-only views)."""
    tp = options.tensor_model_parallel_size or 1
    heads = (options.num_attention_heads or 1) // tp
    kv = options.kv_heads_per_tp_rank or heads
    t_local = seq_length // ctx.world_size
    zero = torch.zeros((), dtype=dtype, device=device)
    q = zero.expand(micro_batch_size, t_local, heads, head_dim)
    k = zero.expand(micro_batch_size, t_local, kv, head_dim)
    out = {}
    if options.has_softmax:
        s = options.softmax_schedule
        if s.is_auto and ctx.world_size > 1:
            out["softmax"] = auto_softmax_preset(ctx, q, k,
                                                 heads_k_stride=s.heads_k_stride).name
        else:
            out["softmax"] = s.preset_name
    if options.has_scan:
        out["linear"] = resolve_impl(options.context_parallel_impl, ctx, q, q)
    return out

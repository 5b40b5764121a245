"""Context-parallel attention for HF transformers models through ``AttentionInterface``.

``prepare_model_for_cp(model, cp_group)`` registers one attention function per call under a
fresh name (``AttentionInterface.register``) and switches the model to it with the public
``model.set_attn_implementation``. The function is a closure over the model's
:class:`~sp_attention.SPContext`, its softmax :class:`~sp_attention.SoftmaxSchedule` and its
linear scan (the pieces of one checked :class:`~megatron_patches.options.SPOptions`, the value
both CLIs build): no module globals, so two models with different CP groups (or schedules) live in
one process, each under its own name.

What HF hands a custom attention function (transformers 5.17 and 5.23, checked in the source):
``(module, query [b, h, s, d], key/value [b, hkv, s, d], attention_mask, scaling=, dropout=,
**kwargs)``, returning ``(out [b, s, h, d], None)``. For a name HF's mask registry does not
know, ``create_causal_mask`` returns ``None``: a 2-D padding mask passed to the model is
*dropped* before attention, so causality is ours and padding must be handled in the data
(``prepare_cp_batch``) — a forward pre-hook refuses masks it cannot honour instead of letting
HF drop them silently.

The same function serves softmax layers (``sp_attention.context_parallel_attention``) and the
linear-attention layers of :mod:`models.hf.linear_llama` (``sp_attention.lightning_attention``),
which call ``ALL_ATTENTION_FUNCTIONS`` too and are told apart by their ``is_linear_attention``
attribute.

Packed documents: a batch cut by :func:`models.hf.prepare_cp_batch` carries its
:class:`~sp_attention.PackingPlan` to the attention function in the forward kwargs
(``sp_packing_plan``, beside HF's flash kwargs ``cu_seq_lens_q/k``): every layer uses that
plan, no lookup. A batch built elsewhere gives its boundaries the way HF's flash path takes
them, ``cu_seq_lens_q/k`` (the global packed row's; ``DataCollatorWithFlattening(
return_flash_attn_kwargs=True)`` at CP = 1), or, at CP = 1 only, ``position_ids`` that
restart (HF's packed-sequence rule): those are planned once per boundaries tensor through
``sp_attention.planning.packing``'s tensor-keyed cache (one host copy per batch, not per layer).
Attention stays inside each document.
"""
from __future__ import annotations

import inspect
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from megatron_patches.options import SPOptions, take_renamed
from sp_attention import (SoftmaxSchedule, SPContext, build_sp_context,
                          context_parallel_attention, lightning_attention)
from sp_attention.caches import LRU
from sp_attention.linear import IMPLS as LINEAR_IMPLS
from sp_attention.planning.packing import PackingPlan, packing_context, resolve_plan

from ..linear_core import decay_kwargs as core_decay_kwargs

__all__ = ["CPSchedule", "CPHandle", "prepare_model_for_cp", "make_cp_attention", "model_options",
           "LINEAR_IMPLS"]

# The softmax schedule is the library's one dataclass; CPSchedule is another name for it (the
# linear layers' scan is prepare_model_for_cp's context_parallel_impl=).
CPSchedule = SoftmaxSchedule

# HF's names for a packed row's boundaries (flash kwargs; the second pair: older spellings).
_CU_NAMES = (("cu_seq_lens_q", "cu_seq_lens_k"), ("cu_seqlens_q", "cu_seqlens_k"))
# CP = 1: the boundaries found in a position_ids tensor, by its id (one host copy per forward,
# shared by its layers)
_RESTARTS = LRU(16)


def _check_attention_call(ctx: SPContext, query, key, attention_mask, dropout, kwargs) -> None:
    """Refuse what the CP attention cannot compute. Every check depends only on shapes and call
    structure, which all ranks share, so every rank raises alike before any collective."""
    if attention_mask is not None:
        raise ValueError(
            f"context-parallel attention got an attention mask of shape "
            f"{tuple(attention_mask.shape)}; it computes causal attention only. Pass "
            "attention_mask=None and give right-padding masks to models.hf.prepare_cp_batch, "
            "which removes padded tokens from the loss")
    if dropout:
        raise ValueError(f"attention dropout {dropout} is not supported by context-parallel "
                         "attention; set config.attention_dropout = 0.0")
    if ctx.world_size > 1 and query.shape[2] != key.shape[2]:
        raise ValueError(f"query length {query.shape[2]} != key length {key.shape[2]}: a KV "
                         "cache (generation) is not supported with a CP group of more than one "
                         "rank; generate with an unprepared model or CP = 1")


def _decode_attention(query, key, value, scaling: float) -> torch.Tensor:
    """CP = 1 with a KV cache (queries are the last ``s_q`` of ``s_k`` tokens): plain causal
    attention aligned bottom-right. ``[b, h, s, d]`` in, ``[b, s, h, d]`` out."""
    sq, sk = query.shape[2], key.shape[2]
    group = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(group, dim=1)
    value = value.repeat_interleave(group, dim=1)
    rows = torch.arange(sq, device=query.device)[:, None] + (sk - sq)
    mask = torch.arange(sk, device=query.device)[None, :] <= rows
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2)


def _restarts(position_ids) -> Optional[tuple[int, ...]]:
    """CP = 1: the boundaries of one row whose positions restart (HF's rule: a step other than
    +1 starts a document), None for one sequence; cached per tensor version."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 \
            or position_ids.shape[0] != 1 or position_ids.shape[1] < 2:
        return None
    key = id(position_ids)
    if _RESTARTS.touch(key):
        ref, version, cu = _RESTARTS.get(key, lambda: None)
        if ref() is position_ids and version == position_ids._version:
            return cu
    row = position_ids[0]
    jumps = torch.nonzero(row[1:] - row[:-1] != 1).squeeze(1) + 1
    cu = None if jumps.numel() == 0 else tuple([0] + jumps.tolist() + [row.numel()])
    _RESTARTS.put(key, (weakref.ref(position_ids), position_ids._version, cu))
    return cu


# The keyword a batch's packing plan travels under, from prepare_cp_batch's model_inputs()
# through the model's forward kwargs to the attention function.
PLAN_KWARG = "sp_packing_plan"


def packed_plan(ctx: SPContext, q_len: int, device, kwargs: dict) -> Optional[PackingPlan]:
    """The packing plan of a call (None: unpacked): the batch's own (``sp_packing_plan``, put
    there by :meth:`models.hf.CPBatch.model_inputs`: no lookup), else from HF's
    ``cu_seq_lens_q/k`` (the global row's boundaries, the row being ``P × q_len`` tokens; a
    batch built elsewhere, e.g. by ``DataCollatorWithFlattening``: planned once per boundaries
    tensor, through ``sp_attention.planning.packing``'s tensor-keyed cache) or, at CP = 1, restarting
    ``position_ids``. Raises for boundaries that cannot be honoured."""
    pctx = packing_context(ctx)
    row = pctx.world_size * q_len
    carried = kwargs.get(PLAN_KWARG)
    if carried is not None:
        return resolve_plan(carried, pctx, q_len)
    for q_name, k_name in _CU_NAMES:
        cu_q, cu_k = kwargs.get(q_name), kwargs.get(k_name)
        if cu_q is None and cu_k is None:
            continue
        if cu_q is None:
            raise ValueError(f"{k_name} without {q_name}: pass both (the same boundaries)")
        plan = resolve_plan(cu_q, pctx, q_len, device=device, row_len=row)
        if cu_k is not None and cu_k is not cu_q and \
                resolve_plan(cu_k, pctx, q_len, device=device, row_len=row) is not plan:
            raise ValueError(f"{k_name} differs from {q_name}: causal self-attention over "
                             "packed documents has one set of boundaries")
        return plan
    if ctx.world_size == 1:
        cu = _restarts(kwargs.get("position_ids"))
        if cu is not None:
            return resolve_plan(cu, pctx, q_len, row_len=row)
    return None


def decay_kwargs(module, log_decay, tuning=None) -> dict:
    """``lightning_attention``'s decay and tuning arguments for a linear layer of ours: its
    gates (``log_decay [b, s, h]``, a gated layer) or its fixed slopes; ``tuning`` the
    options' ``linear_tuning`` (None: the defaults)."""
    if log_decay is not None:
        return core_decay_kwargs(g=log_decay, tuning=tuning)
    return core_decay_kwargs(slopes=module.decay_slopes(), tuning=tuning)


def make_cp_attention(ctx: SPContext, schedule: SoftmaxSchedule,
                      context_parallel_impl: Optional[str] = None, linear_tuning=None,
                      **renamed) -> Callable:
    """The attention function to register: a closure over ``ctx``, the softmax ``schedule``,
    the linear layers' scan ``context_parallel_impl`` (None: the library's default, read per
    call; the op checks the name; ``linear_impl=``, its old name, works for one release) and
    their :class:`~sp_attention.LinearTuning` ``linear_tuning`` (None: the defaults)."""
    scan = take_renamed(renamed, "linear_impl", "context_parallel_impl", context_parallel_impl)
    if renamed:
        raise TypeError(f"make_cp_attention() got unexpected keywords {sorted(renamed)}")
    if not isinstance(ctx, SPContext):
        raise TypeError(f"ctx must be an SPContext, got {type(ctx).__name__}")
    if not isinstance(schedule, SoftmaxSchedule):
        raise TypeError(f"schedule must be an sp_attention.SoftmaxSchedule (models.hf.CPSchedule),"
                        f" got {type(schedule).__name__}")
    softmax_kwargs = schedule.kwargs()
    # One rank holds the whole sequence in either layout; contiguous takes any length (odd
    # prompts in generate()), zigzag would demand an even one, and keeps a packed row's order.
    run_ctx = packing_context(ctx)

    def sp_cp_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                        **kwargs):
        # query [b, h, s, d], key/value [b, hkv, s_k, d] (HF's layout)
        _check_attention_call(ctx, query, key, attention_mask, dropout, kwargs)
        scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
        plan = packed_plan(ctx, query.shape[2], query.device, kwargs)
        if query.shape[2] != key.shape[2]:          # CP = 1 decoding from a cache
            if plan is not None:
                raise ValueError("packed documents (cu_seq_lens_q / restarting position_ids) "
                                 "cannot be decoded from a KV cache; generate one sequence "
                                 "per row")
            return _decode_attention(query, key, value, scale), None
        q = query.transpose(1, 2)                   # [B, T_local, H, D]
        packed = {} if plan is None else {"cu_seqlens": plan}
        if getattr(module, "is_linear_attention", False):     # K/V with their Hkv heads (GQA)
            out = lightning_attention(q, key.transpose(1, 2), value.transpose(1, 2),
                                      ctx=run_ctx, impl=scan, scale=scale,
                                      **decay_kwargs(module, kwargs.get("log_decay"),
                                                     linear_tuning),
                                      **packed)
        else:
            out = context_parallel_attention(q, key.transpose(1, 2), value.transpose(1, 2),
                                             ctx=run_ctx, causal=True, softmax_scale=scale,
                                             **softmax_kwargs, **packed)
        return out, None                            # [B, T_local, H, D]

    sp_cp_attention.sp_context = ctx                # lets our linear layers recognise it
    sp_cp_attention.sp_schedule = schedule
    sp_cp_attention.sp_context_parallel_impl = scan
    return sp_cp_attention


@dataclass
class CPHandle:
    """What :func:`prepare_model_for_cp` did to a model; :meth:`remove` undoes it."""

    name: str
    ctx: SPContext
    options: SPOptions
    previous_implementation: Optional[str]
    model: Any = field(repr=False)
    hook: Any = field(repr=False)

    @property
    def schedule(self) -> SoftmaxSchedule:
        """The softmax layers' schedule (``options.softmax_schedule``)."""
        return self.options.softmax_schedule

    @property
    def context_parallel_impl(self) -> Optional[str]:
        """The linear layers' scan (``options.context_parallel_impl``)."""
        return self.options.context_parallel_impl

    @property
    def linear_impl(self) -> Optional[str]:
        """Deprecated name of :attr:`context_parallel_impl` (goes in the next release)."""
        warnings.warn("CPHandle.linear_impl is now CPHandle.context_parallel_impl",
                      DeprecationWarning, stacklevel=2)
        return self.context_parallel_impl

    def remove(self) -> None:
        """Remove the input checks and switch the model back to its previous attention. The
        registered name stays in ``AttentionInterface`` (transformers has no public
        unregister), so it cannot be reused in this process."""
        self.hook.remove()
        self.model.set_attn_implementation(self.previous_implementation or "sdpa")


def _resolve_ctx(cp: Union[SPContext, dist.ProcessGroup, None], layout: Optional[str]) -> SPContext:
    if isinstance(cp, SPContext):
        if layout is not None and layout != cp.layout:
            raise ValueError(f"layout={layout!r} contradicts the SPContext's layout "
                             f"{cp.layout!r}; pass one of them")
        return cp
    return build_sp_context(cp, layout=layout)


def _check_model(model) -> None:
    if not hasattr(model, "set_attn_implementation") or not hasattr(model, "config"):
        raise TypeError(f"expected a transformers PreTrainedModel, got {type(model).__name__}")
    config = model.config
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) != 0.0:
        raise ValueError(f"config.attention_dropout={config.attention_dropout} is not supported "
                         "with context-parallel attention; set it to 0.0")
    if getattr(config, "sliding_window", None) is not None:
        raise ValueError("sliding-window attention is not supported with context-parallel "
                         "attention; set config.sliding_window = None")


def _layer_kinds(model) -> list[str]:
    """The model's attention kind per layer: our linear layers say theirs (``is_linear_attention``,
    ``gated``), every other layer is softmax."""
    kinds = ["softmax"] * model.config.num_hidden_layers
    for m in model.modules():
        if getattr(m, "is_linear_attention", False):
            kinds[m.layer_idx] = "gated" if getattr(m, "gated", False) else "linear"
    return kinds


def model_options(model, options: Optional[SPOptions] = None, *,
                  schedule: Optional[SoftmaxSchedule] = None,
                  context_parallel_impl: Optional[str] = None) -> SPOptions:
    """The :class:`~megatron_patches.options.SPOptions` of an HF ``model``: ``options`` (checked
    against the model's layers and heads), or one built from the model's layers and the
    pieces. Every rule between the options is ``SPOptions``' (e.g. a scan for a model without
    linear layers raises)."""
    kinds = _layer_kinds(model)
    config = model.config
    heads = config.num_attention_heads
    facts = dict(num_attention_heads=heads,
                 num_query_groups=getattr(config, "num_key_value_heads", None) or heads)
    if options is None:
        options = SPOptions.from_layer_kinds(kinds, context_parallel_impl=context_parallel_impl,
                                             softmax_schedule=schedule, **facts)
    elif schedule is not None or context_parallel_impl is not None:
        raise TypeError("pass options= or schedule= / context_parallel_impl=, not both")
    elif not isinstance(options, SPOptions):
        raise TypeError(f"options must be a megatron_patches.options.SPOptions, got "
                        f"{type(options).__name__}")
    else:
        options = options.with_model(num_layers=len(kinds), **facts)
        if options.layer_kinds != tuple(kinds):
            raise ValueError(f"the options describe the layers {options.pattern} but the model's "
                             f"are {SPOptions.from_layer_kinds(kinds).pattern}: build them for "
                             "this model (--sp-model-kind, --sp-hybrid-pattern)")
    if options.megatron_attention:
        raise ValueError("--context-parallel-impl megatron is the Megatron-LM launcher's; HF "
                         "models run our attention: pick blelloch, allgather, ring or auto")
    return options


def prepare_model_for_cp(model, cp: Union[SPContext, dist.ProcessGroup, None], *,
                         options: Optional[SPOptions] = None,
                         schedule: Optional[SoftmaxSchedule] = None,
                         context_parallel_impl: Optional[str] = None,
                         name: Optional[str] = None, layout: Optional[str] = None,
                         **renamed) -> CPHandle:
    """Make ``model`` run its attention split over the CP group ``cp``.

    Args:
        model: an HF ``PreTrainedModel`` whose attention goes through ``AttentionInterface``
            (Llama, and :class:`models.hf.LinearLlamaForCausalLM` linear / hybrid variants).
        cp: the CP process group (never WORLD by default), an :class:`~sp_attention.SPContext`,
            or None for a single process (CP = 1: same code path, no communication).
        options: our attention options, one :class:`~megatron_patches.options.SPOptions` (e.g.
            a command line's, ``SPOptions.from_flags``); it must describe the model's layers.
            Its ``linear_tuning`` (e.g. ``LinearTuning(op_graphs=True)``, the op replayed
            from CUDA graphs for a host-bound eager model) reaches every linear layer's op.
            Or give its pieces instead:
        schedule: the softmax layers' :class:`~sp_attention.SoftmaxSchedule` (``CPSchedule``
            is the same class; None: ``auto``, the trainers' default
            :data:`megatron_patches.options.DEFAULT_SOFTMAX_SCHEDULE`).
        context_parallel_impl: the linear-attention layers' scan (``blelloch``,
            ``allgather``, ``ring``, ``auto``; None: the library's ``DEFAULT_IMPL``, read at
            each call). ``linear_impl=``, its old name, works for one release.
        name: the ``attn_implementation`` name to register; default a fresh
            ``"sp_cp_<id of the model>_<n>"``. A name already registered raises, and so does
            preparing a model that is already prepared.
        layout: sequence layout when ``cp`` is a group (None: ``sp_attention.DEFAULT_LAYOUT``,
            zigzag); must match how the batch is sharded (:func:`models.hf.prepare_cp_batch`
            takes ``handle.ctx``, the same context).

    Returns:
        a :class:`CPHandle` (``.ctx`` is the SPContext to shard batches with, ``.options`` the
        checked options).

    Every call of the prepared model must then take CP-local inputs with *global*
    ``position_ids`` and no ``attention_mask`` or ``labels`` (see :func:`prepare_cp_batch` and
    :func:`causal_lm_loss`); a forward pre-hook checks this on every rank before any
    collective. Under CP > 1 the hook also turns ``use_cache`` off (no KV cache under CP).
    """
    scan = take_renamed(renamed, "linear_impl", "context_parallel_impl", context_parallel_impl)
    if renamed:
        raise TypeError(f"prepare_model_for_cp() got unexpected keywords {sorted(renamed)}")
    _check_model(model)
    ctx = _resolve_ctx(cp, layout)
    options = model_options(model, options, schedule=schedule, context_parallel_impl=scan)
    previous = model.config._attn_implementation
    if _registered_cp_attention(previous) is not None:
        raise ValueError(f"this model is already prepared for CP (attention {previous!r}); call "
                         "the earlier handle's remove() first")
    registered = set(ALL_ATTENTION_FUNCTIONS.valid_keys()) | {"eager"}
    if name is None:    # registrations live for the process: skip names taken before
        name = next(n for n in (f"sp_cp_{id(model):x}_{i}" for i in range(len(registered) + 1))
                    if n not in registered)
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"name must be a non-empty string without '/', got {name!r}")
    if name in registered:
        raise ValueError(f"attention implementation {name!r} is already registered; pass an "
                         "unused name= (or leave it None for a fresh one)")
    AttentionInterface.register(name, make_cp_attention(ctx, options.softmax_schedule,
                                                        options.context_parallel_impl,
                                                        options.linear_tuning))
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        raise RuntimeError(f"{type(model).__name__} did not switch to attention {name!r}: it does "
                           "not dispatch through AttentionInterface")
    hook = model.register_forward_pre_hook(_input_checker(model, ctx), with_kwargs=True)
    return CPHandle(name, ctx, options, previous, model, hook)


def _registered_cp_attention(name: Optional[str]) -> Optional[Callable]:
    """The registered function behind ``name`` if it is one of ours, else None."""
    if not name or name not in ALL_ATTENTION_FUNCTIONS.valid_keys():
        return None
    fn = ALL_ATTENTION_FUNCTIONS[name]
    return fn if getattr(fn, "sp_context", None) is not None else None


def _input_checker(model, ctx: SPContext) -> Callable:
    signature = inspect.signature(model.forward)

    def check(module, args, kwargs):
        bound = signature.bind_partial(*args, **kwargs).arguments
        extra = bound.pop("kwargs", {}) or {}
        bound.update(extra)
        _check_forward_inputs(ctx, bound)
        if ctx.world_size > 1:
            kwargs["use_cache"] = False
        return args, kwargs

    return check


# the KV cache's keyword: ``cache`` from transformers 5.24 on, ``past_key_values`` before
_CACHE_NAMES = ("cache", "past_key_values")


def _check_forward_inputs(ctx: SPContext, inputs: dict) -> None:
    """Forward-level checks (shapes and call structure only, so all ranks agree), plus at
    CP = 1 the values of a 2-D padding mask (no collective to desynchronise there)."""
    mask = inputs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() != 2:
        raise ValueError(f"attention_mask of shape {tuple(mask.shape)} cannot be honoured by "
                         "causal context-parallel attention; only None (CP > 1) or a 2-D "
                         "right-padding mask (CP = 1) is supported")
    cu = next((inputs.get(q) for q, _ in _CU_NAMES if inputs.get(q) is not None), None)
    tokens = inputs.get("input_ids")
    tokens = inputs.get("inputs_embeds") if tokens is None else tokens
    if cu is not None and tokens is not None and tokens.shape[0] != 1:
        raise ValueError(f"cu_seq_lens_q describes ONE packed row, but the batch has "
                         f"{tokens.shape[0]} rows: flatten the documents into one row "
                         "(transformers.DataCollatorWithFlattening) and cut it with "
                         "models.hf.prepare_cp_batch")
    if ctx.world_size == 1:
        if isinstance(mask, torch.Tensor) and not _is_right_padding(mask):
            raise ValueError("attention_mask has padding before real tokens (left padding or "
                             "holes); causal CP attention only honours right padding — "
                             "right-pad the batch")
        return
    if mask is not None:
        raise ValueError("under context parallelism pass attention_mask=None: give the padding "
                         "mask to models.hf.prepare_cp_batch, which masks padded tokens out of "
                         "the loss (causal attention never lets a real token see a right pad)")
    if inputs.get("labels") is not None:
        raise ValueError("do not pass labels to a CP model (HF shifts them inside the shard); "
                         "use prepare_cp_batch(...).labels with models.hf.causal_lm_loss")
    if any(inputs.get(n) is not None for n in _CACHE_NAMES) or inputs.get("use_cache"):
        raise ValueError("a KV cache is not supported with a CP group of more than one rank; "
                         "pass use_cache=False and no past_key_values")
    if inputs.get("position_ids") is None:
        raise ValueError("under context parallelism pass the global position_ids of this rank's "
                         "tokens (prepare_cp_batch(...).position_ids); HF's default "
                         "arange(T_local) would give RoPE the wrong positions")
    if tokens is not None and inputs["position_ids"].shape[-1] != tokens.shape[1]:
        raise ValueError(f"position_ids {tuple(inputs['position_ids'].shape)} do not match the "
                         f"local sequence length {tokens.shape[1]}")


def _is_right_padding(mask: torch.Tensor) -> bool:
    """Every row is ones followed by zeros (or all ones)."""
    m = mask.to(torch.int64)
    return bool(((m[:, 1:] - m[:, :-1]) <= 0).all()) if m.shape[1] > 1 else True

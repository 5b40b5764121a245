"""Megatron-LM command-line arguments for our CP attention, and their validation.

``add_arguments`` is an ``extra_args_provider`` (``parse_and_validate_args(extra_args_provider=
add_arguments)`` on megatron-core >= 0.18, ``pretrain(..., extra_args_provider=add_arguments)``
on 0.17)::

    --context-parallel-impl {blelloch,allgather,ring,auto,megatron}
        linear layers' cross-rank scan (auto: cost-model choice); softmax layers then use our
        CP attention (--softmax-cp-preset). 'megatron' (default) leaves attention to
        Megatron/TransformerEngine.
    --sp-model-kind {softmax,linear,hybrid}     which layers the model has (launcher)
    --sp-hybrid-pattern LLLS                    L linear / S softmax per layer, repeated
    --sp-slope-schedule {long_range,lightning}  linear layers' per-head decay
    --softmax-cp-preset {ring,ring_ag,allgather,ag_ring}
    --softmax-heads-k-stride N, --softmax-bwd-head-first-stride N,
    --softmax-bwd-head-last-stride N

:func:`validate_args` raises ``ValueError`` naming the flag to change for every combination
that cannot work or that Megatron would silently ignore.
"""
from __future__ import annotations

import argparse
from typing import Optional

from sp_attention.linear import IMPLS as LINEAR_IMPLS
from sp_attention.linear.slopes import SLOPE_SCHEDULES
from sp_attention.softmax import PRESETS

__all__ = ["add_arguments", "validate_args", "options_from_args", "options_from_megatron_args",
           "CP_IMPLS", "MEGATRON_IMPL", "MODEL_KINDS"]

MEGATRON_IMPL = "megatron"
CP_IMPLS = LINEAR_IMPLS + (MEGATRON_IMPL,)
MODEL_KINDS = ("softmax", "linear", "hybrid")
_PRESETS = tuple(PRESETS)
_STRIDES = ("softmax_heads_k_stride", "softmax_bwd_head_first_stride",
            "softmax_bwd_head_last_stride")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add our arguments to Megatron-LM's parser (an ``extra_args_provider``)."""
    g = parser.add_argument_group("sp-attention", "context-parallel attention without "
                                  "TransformerEngine (megatron_patches)")
    g.add_argument("--context-parallel-impl", choices=CP_IMPLS, default=MEGATRON_IMPL,
                   help="linear-attention layers' cross-rank state scan; any value but "
                        "'megatron' also runs softmax layers on our CP attention. 'megatron': "
                        "Megatron/TE attention (default).")
    g.add_argument("--sp-model-kind", choices=MODEL_KINDS, default="softmax",
                   help="attention of the model's layers (megatron_patches.pretrain_gpt)")
    g.add_argument("--sp-hybrid-pattern", default="LLLS",
                   help="hybrid layer pattern: L linear, S softmax, repeated to --num-layers")
    g.add_argument("--sp-slope-schedule", choices=SLOPE_SCHEDULES, default="long_range",
                   help="per-head decay slopes of linear layers")
    g.add_argument("--softmax-cp-preset", choices=_PRESETS, default=None,
                   help="softmax layers' CP schedule pair (default ring)")
    for name in _STRIDES:
        g.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    return parser


def _kind_from_spec(args) -> Optional[str]:
    """The layer kind implied by ``--spec megatron_patches.specs <name>``, if that is used."""
    spec = getattr(args, "spec", None)
    if not spec or spec[0] != "megatron_patches.specs":
        return None
    return {"softmax_layer_spec": "softmax", "linear_layer_spec": "linear",
            "hybrid_layer_spec": "hybrid"}.get(spec[1] if len(spec) > 1 else "", "unknown")


def _softmax_options(args):
    from .core_attention import SoftmaxOptions
    preset = args.softmax_cp_preset or "ring"
    try:
        return SoftmaxOptions(preset, *(getattr(args, n) for n in _STRIDES))
    except ValueError as e:
        raise ValueError(f"{e} [flags: --softmax-cp-preset, --softmax-heads-k-stride, "
                         "--softmax-bwd-head-first/last-stride]") from None


def _check_megatron_impl(args, kind: str, spec_kind: Optional[str]) -> None:
    if spec_kind is not None:
        raise ValueError("--spec megatron_patches.specs ... needs --context-parallel-impl "
                         "blelloch/allgather/ring/auto ('megatron' leaves attention to Megatron)")
    if kind != "softmax":
        raise ValueError(f"--sp-model-kind {kind}: linear-attention layers need our scan; set "
                         "--context-parallel-impl to blelloch, allgather, ring or auto")
    given = [f"--{n.replace('_', '-')}" for n in ("softmax_cp_preset",) + _STRIDES
             if getattr(args, n, None) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} would be ignored with --context-parallel-impl "
                         "megatron (Megatron/TE attention); set --context-parallel-impl auto "
                         "or drop them")


def _check_megatron_flags(args) -> None:
    """Megatron-LM options our attention cannot honour (each raises with the fix)."""
    if getattr(args, "transformer_impl", "local") != "local":
        raise ValueError(f"--transformer-impl {args.transformer_impl}: our CP attention is "
                         "built on the local spec; pass --transformer-impl local")
    if not getattr(args, "no_persist_layer_norm", True):
        raise ValueError("the local spec's torch norms cannot persist layer norms; pass "
                         "--no-persist-layer-norm")
    if getattr(args, "pipeline_model_parallel_size", 1) != 1:
        raise ValueError("pipeline parallelism is not supported with --context-parallel-impl; "
                         "set --pipeline-model-parallel-size 1")
    if getattr(args, "attention_dropout", 0.0):
        raise ValueError(f"--attention-dropout {args.attention_dropout}: the CP attention "
                         "kernels have no dropout; pass --attention-dropout 0")
    if getattr(args, "create_attention_mask_in_dataloader", False):
        raise ValueError("a dense attention mask cannot be honoured (the CP attention is causal "
                         "on the global sequence); pass --no-create-attention-mask-in-dataloader")
    if getattr(args, "reset_attention_mask", False):
        raise ValueError("--reset-attention-mask (per-document masks) is not supported by the "
                         "CP attention; drop it")
    pos = getattr(args, "position_embedding_type", "rope")
    if pos not in ("rope", "learned_absolute"):
        raise ValueError(f"--position-embedding-type {pos}: use rope or learned_absolute")
    if pos == "rope" and getattr(args, "apply_rope_fusion", False):
        raise ValueError("fused RoPE needs TransformerEngine and Megatron's own rotary module; "
                         "pass --no-rope-fusion (our RoPE follows the zigzag CP layout)")
    if list(getattr(args, "cp_comm_type", None) or ["p2p"]) != ["p2p"]:
        raise ValueError(f"--cp-comm-type {args.cp_comm_type} configures TE's CP attention and "
                         "would be ignored; drop it and choose --softmax-cp-preset instead")


def validate_args(args) -> None:
    """Check our arguments against Megatron-LM's parsed ``args`` (a namespace). Raises
    ``ValueError`` naming the flag to change."""
    impl = args.context_parallel_impl
    if impl not in CP_IMPLS:
        raise ValueError(f"--context-parallel-impl {impl}: use one of {CP_IMPLS}")
    spec_kind = _kind_from_spec(args)
    if spec_kind == "unknown":
        raise ValueError(f"--spec {' '.join(args.spec)}: megatron_patches.specs offers "
                         "softmax_layer_spec, linear_layer_spec and hybrid_layer_spec")
    kind = spec_kind or args.sp_model_kind
    if kind not in MODEL_KINDS:
        raise ValueError(f"--sp-model-kind {kind}: use one of {MODEL_KINDS}")
    if impl == MEGATRON_IMPL:
        _check_megatron_impl(args, kind, spec_kind)
        return
    if kind == "softmax" and impl != "auto":
        raise ValueError(f"--context-parallel-impl {impl} picks the linear layers' scan, but the "
                         "model has only softmax layers; use --context-parallel-impl auto (and "
                         "--softmax-cp-preset for the softmax schedule)")
    softmax_given = [n for n in ("softmax_cp_preset",) + _STRIDES
                     if getattr(args, n, None) is not None]
    if kind == "linear" and softmax_given:
        raise ValueError(f"--{softmax_given[0].replace('_', '-')} would be ignored: the model "
                         "has no softmax layer (--sp-model-kind linear); drop it")
    cp, tp = args.context_parallel_size, args.tensor_model_parallel_size
    seq = args.seq_length
    if seq is None or seq % (2 * cp):
        raise ValueError(f"--seq-length {seq} must be a multiple of 2 x context-parallel-size "
                         f"= {2 * cp} (zigzag layout: 2 chunks per CP rank); pad or change it")
    heads = args.num_attention_heads
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else heads
    if heads % tp or groups % tp:
        raise ValueError(f"--num-attention-heads {heads} and --num-query-groups {groups} must be "
                         f"divisible by --tensor-model-parallel-size {tp}")
    opts = _softmax_options(args)
    if opts.heads_k_stride is not None and (groups // tp) % opts.heads_k_stride:
        raise ValueError(f"--softmax-heads-k-stride {opts.heads_k_stride} must divide the "
                         f"{groups // tp} KV heads per TP rank")
    if kind == "hybrid":
        from .specs import expand_pattern
        try:
            expand_pattern(args.sp_hybrid_pattern, args.num_layers)
        except ValueError as e:
            raise ValueError(f"--sp-hybrid-pattern: {e}") from None
    _check_megatron_flags(args)


def options_from_args(args) -> dict:
    """Validated core-attention options from a parsed namespace: ``cp_impl``,
    ``layer_pattern``, ``slope_schedule``, ``softmax_options``, ``kind``."""
    validate_args(args)
    kind = _kind_from_spec(args) or args.sp_model_kind
    pattern = {"softmax": "S", "linear": "L"}.get(kind, args.sp_hybrid_pattern)
    return {"cp_impl": args.context_parallel_impl, "layer_pattern": pattern, "kind": kind,
            "slope_schedule": args.sp_slope_schedule, "softmax_options": _softmax_options(args)}


def options_from_megatron_args() -> dict:
    """:func:`options_from_args` of Megatron-LM's global args (``megatron.training.get_args``)."""
    try:
        from megatron.training import get_args
    except ImportError as e:
        raise RuntimeError("the prebuilt specs read Megatron-LM's arguments (megatron.training, "
                           "megatron-core >= 0.17); with megatron-core alone use "
                           "megatron_patches.model.build_gpt_model or specs.layer_spec") from e
    args = get_args()
    if not hasattr(args, "context_parallel_impl"):
        raise RuntimeError("our arguments are missing: pass extra_args_provider="
                           "megatron_patches.args.add_arguments to parse_and_validate_args / "
                           "pretrain")
    return options_from_args(args)

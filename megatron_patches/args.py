"""Megatron-LM command-line arguments for our CP attention, and their validation.

``add_arguments`` is an ``extra_args_provider`` (``parse_and_validate_args(extra_args_provider=
add_arguments)`` on megatron-core >= 0.18, ``pretrain(..., extra_args_provider=add_arguments)``
on 0.17). It adds :data:`megatron_patches.options.SP_OPTIONS`, the same table train.py's
parser is built from (same names, meanings, choices, defaults and help)::

    --sp-model-kind {softmax,linear,gated,hybrid}  which layers the model has (launcher)
    --sp-hybrid-pattern LLLS                    L linear / G gated / S softmax per layer
    --sp-slope-schedule {long_range,lightning}  linear layers' per-head decay
    --context-parallel-impl {blelloch,allgather,ring,auto,megatron}
        linear layers' cross-rank scan (default: the library's); 'megatron' leaves attention to
        Megatron/TransformerEngine.
    --softmax-cp-preset {ring,ring_ag,allgather,ag_ring,a2a,a2a_ring,auto}
    --softmax-heads-k-stride N, --softmax-bwd-head-first-stride N,
    --softmax-bwd-head-last-stride N, --softmax-a2a-size N
    --load-hf DIR                               the initial weights: an HF checkpoint

Megatron-LM's own names for the softmax CP schedule are honoured where a user brings them
(:data:`CP_COMM_TYPES`): ``--cp-comm-type p2p|all_gather|a2a|a2a+p2p`` picks the preset
``ring|allgather|a2a|a2a_ring``, and ``--hierarchical-context-parallel-sizes U R`` (U·R = CP
size) is ``--softmax-a2a-size U``; a contradicting ``--softmax-*`` flag raises.

:func:`validate_args` raises ``ValueError`` naming the flag to change for every combination
that cannot work or that Megatron would silently ignore, and returns our options as one
:class:`~megatron_patches.options.SPOptions` (kept for :func:`options_of`: the checks run once
per run). ``--reset-attention-mask --reset-position-ids`` (documents split at EOD) are honoured at every CP size: the launcher
packs each micro-batch into a THD row cut by our packing plan (:mod:`megatron_patches.packing`).
"""
from __future__ import annotations

import argparse
import sys
import weakref
from typing import Optional, Sequence

from .options import (CP_IMPLS, MEGATRON_IMPL, MODEL_KINDS, SPOptions, add_sp_options,
                      seq_multiple)
from .weights import HFArchitecture

__all__ = ["add_arguments", "validate_args", "options_from_args", "options_of",
            "options_from_megatron_args", "hf_architecture", "rope_scaling_of", "CP_IMPLS",
           "MEGATRON_IMPL", "MODEL_KINDS", "CP_COMM_TYPES"]

# Megatron-LM's --cp-comm-type values (TransformerEngine's CP attention) -> our softmax presets
CP_COMM_TYPES = {"p2p": "ring", "all_gather": "allgather", "a2a": "a2a", "a2a+p2p": "a2a_ring"}


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add our arguments to Megatron-LM's parser (an ``extra_args_provider``)."""
    g = parser.add_argument_group("sp-attention", "context-parallel attention without "
                                  "TransformerEngine (megatron_patches)")
    add_sp_options(g)
    return parser


def _kind_from_spec(args) -> Optional[str]:
    """The layer kind implied by ``--spec megatron_patches.specs <name>``, if that is used."""
    spec = getattr(args, "spec", None)
    if not spec or spec[0] != "megatron_patches.specs":
        return None
    return {"softmax_layer_spec": "softmax", "linear_layer_spec": "linear",
            "gated_layer_spec": "gated", "hybrid_layer_spec": "hybrid"}.get(
                spec[1] if len(spec) > 1 else "", "unknown")


def _check_megatron_impl(args) -> None:
    """``--context-parallel-impl megatron`` against Megatron-LM's own flags (the rules between
    our options live in :class:`~megatron_patches.options.SPOptions`)."""
    if getattr(args, "reset_attention_mask", False):
        raise ValueError("--reset-attention-mask: this launcher packs documents (THD batches cut "
                         "by our packing plan) for our attention only, not for Megatron's; drop "
                         "--context-parallel-impl megatron or --reset-attention-mask")


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
    if getattr(args, "reset_attention_mask", False) and not getattr(args, "reset_position_ids",
                                                                     False):
        raise ValueError("--reset-attention-mask packs each micro-batch as documents split at "
                         "EOD (THD batches), whose positions restart per document: pass "
                         "--reset-position-ids too")
    pos = getattr(args, "position_embedding_type", "rope")
    if pos not in ("rope", "learned_absolute"):
        raise ValueError(f"--position-embedding-type {pos}: use rope or learned_absolute")
    if pos == "rope" and getattr(args, "apply_rope_fusion", False):
        raise ValueError("fused RoPE needs TransformerEngine and Megatron's own rotary module; "
                         "pass --no-rope-fusion (our RoPE follows the CP layout)")


def _megatron_cp_names(args) -> argparse.Namespace:
    """``args`` with Megatron-LM's own CP schedule flags turned into ours (:data:`CP_COMM_TYPES`;
    ``--hierarchical-context-parallel-sizes U R`` -> ``--softmax-a2a-size U``)."""
    ns = argparse.Namespace(**vars(args))
    types = getattr(args, "cp_comm_type", None) or ["p2p"]
    types = [types] if isinstance(types, str) else list(types)
    bad = [t for t in types if t not in CP_COMM_TYPES]
    if bad or len(set(types)) > 1:
        raise ValueError(f"--cp-comm-type {' '.join(types)}: give one of {list(CP_COMM_TYPES)} "
                         "for every layer (our softmax layers share one schedule), or use "
                         "--softmax-cp-preset")
    if types[0] != "p2p":      # Megatron's default: only another value is the user's choice
        want, given = CP_COMM_TYPES[types[0]], getattr(ns, "softmax_cp_preset", None)
        if given is not None and given != want:
            raise ValueError(f"--cp-comm-type {types[0]} means --softmax-cp-preset {want}, but "
                             f"--softmax-cp-preset {given} was given; drop one of the two")
        ns.softmax_cp_preset = want
    sizes = getattr(args, "hierarchical_context_parallel_sizes", None)
    if sizes:
        cp = args.context_parallel_size
        if len(sizes) != 2 or sizes[0] * sizes[1] != cp:
            raise ValueError(f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))}"
                             ": give two sizes, the all-to-all group and the ring across the "
                             f"groups, whose product is --context-parallel-size {cp}")
        if ns.softmax_cp_preset not in ("a2a_ring", "auto"):
            raise ValueError("--hierarchical-context-parallel-sizes sets the all-to-all group "
                             "of the a2a_ring schedule (--cp-comm-type a2a+p2p or "
                             "--softmax-cp-preset a2a_ring) and would be ignored; drop it or "
                             "pick a2a_ring")
        given = getattr(ns, "softmax_a2a_size", None)
        if given is not None and given != sizes[0]:
            raise ValueError(f"--hierarchical-context-parallel-sizes {sizes[0]} {sizes[1]} "
                             f"means --softmax-a2a-size {sizes[0]}, but --softmax-a2a-size "
                             f"{given} was given; drop one of the two")
        ns.softmax_a2a_size = sizes[0]
    return ns


def _check_seq_length(args) -> None:
    cp, seq = args.context_parallel_size, args.seq_length
    multiple = seq_multiple(cp)
    if seq is None or seq % multiple:
        raise ValueError(f"--seq-length {seq} must be a multiple of {multiple} for "
                         f"--context-parallel-size {cp} (the CP layout splits each sequence "
                         "into that many chunks); pad or change it")


def options_from_args(args) -> SPOptions:
    """Validate Megatron-LM's parsed ``args`` (a namespace with our arguments) and return our
    :class:`~megatron_patches.options.SPOptions` (``context_parallel_impl="megatron"``:
    Megatron's own attention). Raises ``ValueError`` naming the flag to change."""
    spec_kind = _kind_from_spec(args)
    if spec_kind == "unknown":
        raise ValueError(f"--spec {' '.join(args.spec)}: megatron_patches.specs offers "
                         "softmax_layer_spec, linear_layer_spec, gated_layer_spec and "
                         "hybrid_layer_spec")
    if spec_kind is not None and getattr(args, "context_parallel_impl", None) == MEGATRON_IMPL:
        raise ValueError("--spec megatron_patches.specs ... needs our attention: drop "
                         "--context-parallel-impl megatron (or pick blelloch/allgather/ring/auto)")
    heads = args.num_attention_heads
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else heads
    options = SPOptions.from_flags(_megatron_cp_names(args), model_kind=spec_kind,
                                   num_layers=args.num_layers, num_attention_heads=heads,
                                   num_query_groups=groups,
                                   tensor_model_parallel_size=args.tensor_model_parallel_size,
                                   context_parallel_size=args.context_parallel_size)
    if options.megatron_attention:
        _check_megatron_impl(args)
        return options
    _check_seq_length(args)
    _check_megatron_flags(args)
    return options


def _given(flag: str, argv: Sequence[str]) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def hf_architecture(args, argv: Optional[Sequence[str]] = None) -> Optional[HFArchitecture]:
    """``--load-hf``'s architecture checked against Megatron-LM's parsed ``args`` (None
    without ``--load-hf``). Megatron's arguments all have values, so each must match the
    checkpoint's config.json (a mismatch raises naming the flag and the value to pass); RoPE θ
    and the scaling factor may differ when given explicitly on the command line ``argv``
    (default ``sys.argv``): a long-context continuation."""
    path = getattr(args, "load_hf", None)
    if path is None:
        return None
    argv = sys.argv[1:] if argv is None else argv
    arch = HFArchitecture.from_dir(path)
    heads = args.num_attention_heads
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else heads
    want = [("--num-layers", args.num_layers, arch.num_layers),
            ("--hidden-size", args.hidden_size, arch.hidden_size),
            ("--num-attention-heads", heads, arch.num_attention_heads),
            ("--num-query-groups (with --group-query-attention)", groups,
             arch.num_query_groups),
            ("--ffn-hidden-size", args.ffn_hidden_size, arch.ffn_hidden_size),
            ("--norm-epsilon", args.norm_epsilon, arch.norm_epsilon),
            ("--swiglu", getattr(args, "swiglu", False), True),
            ("--normalization", args.normalization, "RMSNorm"),
            ("--disable-bias-linear", not getattr(args, "add_bias_linear", True), True),
            ("--position-embedding-type", args.position_embedding_type, "rope"),
            ("--untie-embeddings-and-output-weights",
             getattr(args, "untie_embeddings_and_output_weights", False),
             not arch.tie_word_embeddings)]
    kind = getattr(args, "sp_model_kind", None) or "softmax"
    pattern = SPOptions.from_flags(args, num_layers=args.num_layers).pattern
    want.append(("--sp-model-kind / --sp-hybrid-pattern", f"{kind} {pattern}",
                 f"{arch.model_kind} {arch.pattern}"))
    if not _given("--rotary-base", argv):
        want.append(("--rotary-base", float(args.rotary_base), arch.rotary_base))
    scaling = arch.rope_scaling or {}
    if scaling.get("rope_type") == "linear":
        raise ValueError(f"--load-hf {path}: linear RoPE scaling is not supported by this "
                         "launcher (train.py --load-hf takes it)")
    want.append(("--use-rope-scaling", bool(getattr(args, "use_rope_scaling", False)),
                 bool(scaling)))
    if scaling and not _given("--rope-scaling-factor", argv):
        want.append(("--rope-scaling-factor", float(args.rope_scaling_factor),
                     float(scaling["factor"])))
    for flag, mine, theirs in want:
        if mine != theirs:
            raise ValueError(f"{flag} is {mine} but --load-hf {path}'s config.json says "
                             f"{theirs}: pass the checkpoint's value")
    return arch


def rope_scaling_of(args, arch: Optional[HFArchitecture]) -> Optional[dict]:
    """The RoPE scaling the launcher's model uses: Llama 3's with ``--rope-scaling-factor``
    when ``--use-rope-scaling`` is given (its other figures from the ``--load-hf`` config,
    else Llama 3.1's), else none."""
    if not getattr(args, "use_rope_scaling", False):
        return None
    base = (arch.rope_scaling if arch is not None and arch.rope_scaling else
            {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8192})
    return dict(base, factor=float(args.rope_scaling_factor))


# validate_args' last result: (a weak reference to Megatron-LM's args namespace, its options).
# Not an attribute of the namespace: Megatron pickles its args into checkpoints.
_VALIDATED: list = []


def validate_args(args) -> SPOptions:
    """Check our arguments against Megatron-LM's parsed ``args`` before Megatron initialises
    anything; return our :class:`~megatron_patches.options.SPOptions` and keep it for
    :func:`options_of` (the launcher's model provider and the prebuilt specs), so the checks run
    once per run. Raises ``ValueError`` naming the flag to change."""
    options = options_from_args(args)
    if not options.megatron_attention:
        hf_architecture(args)           # --load-hf against the model flags, before anything
    elif getattr(args, "load_hf", None):
        raise ValueError("--load-hf builds our model; drop --context-parallel-impl megatron")
    _VALIDATED[:] = [(weakref.ref(args), options)]
    return options


def options_of(args) -> SPOptions:
    """The options :func:`validate_args` returned for ``args`` (validated now if it did not
    run for them, e.g. under your own ``pretrain_gpt.py``)."""
    if _VALIDATED and _VALIDATED[0][0]() is args:
        return _VALIDATED[0][1]
    return validate_args(args)


def options_from_megatron_args() -> SPOptions:
    """Our options for Megatron-LM's global args (``megatron.training.get_args``): the value
    :func:`validate_args` kept."""
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
    return options_of(args)

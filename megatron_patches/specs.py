"""Layer specs: put our core attention into any Megatron ``ModuleSpec`` tree.

- :func:`patch_core_attention` replaces every ``core_attention`` slot in a spec tree (GPT layer
  specs, block specs with per-layer lists, HybridModel stack specs, MTP blocks) and returns a
  patched copy; the input is never modified.
- :func:`layer_spec` / :func:`block_spec` build the local (no TransformerEngine) GPT layer spec
  with a softmax, linear or gated linear core attention (the gated one also swaps
  ``SelfAttention`` for :class:`~megatron_patches.gated_attention.GatedSelfAttention`, which
  hands it the gate projection), and a per-layer list for a hybrid pattern (``"LLLS"``: three
  linear layers to one softmax layer; ``G`` gated), which ``GPTModel`` takes on 0.16 and 0.19
  alike.
- Prebuilt specs for Megatron-LM's ``--spec megatron_patches.specs <name>``:
  ``softmax_layer_spec``, ``linear_layer_spec``, ``gated_layer_spec``, ``hybrid_layer_spec``
  — layer specs whose core
  attention takes ``--context-parallel-impl`` and our other arguments from the options the
  launcher's argument check built from Megatron-LM's parsed args (once per run) (one layer spec serves every layer; the hybrid one picks each
  layer's kind from ``--sp-hybrid-pattern`` and its layer number).
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Optional

from megatron.core.transformer.spec_utils import ModuleSpec

from sp_attention import build_sp_context

from . import args as megatron_args
from .core_attention import LinearCoreAttention, SoftmaxCoreAttention, resolve_groups
from .gated_attention import GatedCoreAttention, GatedSelfAttention
from .options import LAYER_KINDS, SPOptions, expand_pattern, take_renamed

__all__ = ["patch_core_attention", "find_core_attention_slots", "layer_kind", "expand_pattern",
           "core_attention_spec", "options_spec_kwargs", "layer_spec", "block_spec",
           "ArgsCoreAttention",
           "softmax_layer_spec", "linear_layer_spec", "gated_layer_spec", "hybrid_layer_spec",
           "LAYER_KINDS",
           "MEGATRON_LAYOUT"]

# How Megatron-LM's own batch split (get_batch_on_this_cp_rank) and RoPE lay a sequence out over
# CP. The prebuilt specs serve Megatron-LM's pretrain_gpt.py, whose data and RoPE are Megatron's,
# so their layers use this layout whatever sp_attention.DEFAULT_LAYOUT says; everything built by
# build_gpt_model (our RoPE, our launcher's batches, train.py) follows the model's one context.
MEGATRON_LAYOUT = "zigzag"


def _walk(node: Any, path: str, visit: Callable[[str, Any], Optional[Any]], seen: set) -> Any:
    """Copy of ``node`` with every ``core_attention`` field replaced by ``visit(path, old)``
    (when it returns non-None). Recurses through ModuleSpecs, submodule dataclasses, lists,
    tuples and dicts."""
    if id(node) in seen:     # specs are trees in practice; guard against shared cycles anyway
        return node
    if isinstance(node, ModuleSpec):
        seen = seen | {id(node)}
        new = copy.copy(node)
        new.params = dict(node.params)
        new.submodules = _walk(node.submodules, path + ".submodules", visit, seen)
        return new
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        seen = seen | {id(node)}
        changes = {}
        for f in dataclasses.fields(node):
            val = getattr(node, f.name)
            sub = f"{path}.{f.name}"
            if f.name == "core_attention":
                rep = visit(sub, val)
                changes[f.name] = val if rep is None else rep
            else:
                changes[f.name] = _walk(val, sub, visit, seen)
        new = copy.copy(node)
        for k, v in changes.items():
            object.__setattr__(new, k, v)
        return new
    if isinstance(node, (list, tuple)):
        out = [_walk(x, f"{path}[{i}]", visit, seen) for i, x in enumerate(node)]
        return type(node)(out) if isinstance(node, list) else tuple(out)
    if isinstance(node, dict):
        return {k: _walk(v, f"{path}[{k!r}]", visit, seen) for k, v in node.items()}
    return node


def find_core_attention_slots(spec: Any) -> list[str]:
    """Paths of every core-attention slot in a spec tree (for tests and diagnostics)."""
    found: list[str] = []
    _walk(spec, "spec", lambda p, v: found.append(p), set())
    return found


def patch_core_attention(spec: Any, core_attention: Any, *, require: bool = True) -> Any:
    """A copy of ``spec`` with every core-attention slot set to ``core_attention``.

    ``core_attention``: a ModuleSpec / class, or a callable ``(path, old) -> new`` to choose per
    slot. ``require``: raise if the tree has no such slot (a spec we do not understand would
    otherwise silently keep Megatron's attention, which refuses CP without TE).
    """
    slots: list[str] = []

    def visit(path, old):
        slots.append(path)
        return core_attention(path, old) if callable(core_attention) and not isinstance(
            core_attention, (type, ModuleSpec)) else core_attention

    out = _walk(spec, "spec", visit, set())
    if require and not slots:
        raise ValueError(f"no core_attention slot found in {type(spec).__name__}; pass a GPT or "
                         "hybrid layer/block spec (SelfAttention submodules)")
    return out


def options_spec_kwargs(options: SPOptions) -> dict:
    """What the core attentions take from ``options``: :func:`core_attention_spec`'s keywords."""
    return {"context_parallel_impl": options.context_parallel_impl,
            "softmax_schedule": options.softmax_schedule,
            "slope_schedule": options.slope_schedule,
            "linear_tuning": options.linear_tuning}


def layer_kind(pattern: str, layer_number: int, num_layers: int) -> str:
    """``"linear"``, ``"gated"`` or ``"softmax"`` for 1-based global ``layer_number``."""
    return LAYER_KINDS[expand_pattern(pattern, num_layers)[layer_number - 1]]


def core_attention_spec(kind: str, *, context_parallel_impl: Optional[str] = None,
                        softmax_schedule=None, slope_schedule: Optional[str] = None,
                        linear_tuning=None, sp_context=None, **renamed) -> ModuleSpec:
    """The core-attention ModuleSpec for one layer kind, from the pieces of an
    :class:`~megatron_patches.options.SPOptions` (:func:`options_spec_kwargs`). None: the
    library's / adapters' defaults, read when the layer is built; ``sp_context`` None: one over
    the layer's CP group in ``sp_attention.DEFAULT_LAYOUT``."""
    scan = take_renamed(renamed, "cp_impl", "context_parallel_impl", context_parallel_impl)
    if renamed:
        raise TypeError(f"unexpected keywords {sorted(renamed)}")
    if kind == "softmax":
        return ModuleSpec(module=SoftmaxCoreAttention,
                          params={"softmax_schedule": softmax_schedule, "sp_context": sp_context})
    if kind == "linear":
        return ModuleSpec(module=LinearCoreAttention,
                          params={"context_parallel_impl": scan, "slope_schedule": slope_schedule,
                                  "linear_tuning": linear_tuning, "sp_context": sp_context})
    if kind == "gated":
        return ModuleSpec(module=GatedCoreAttention,
                          params={"context_parallel_impl": scan, "linear_tuning": linear_tuning,
                                  "sp_context": sp_context})
    raise ValueError(f"unknown layer kind {kind!r}; use one of {sorted(LAYER_KINDS.values())}")


def _local_gpt_layer_spec() -> ModuleSpec:
    """Megatron's local (no TE) GPT layer spec. ``normalization="RMSNorm"`` makes its norms
    ``WrappedTorchNorm``, which follows ``config.normalization`` (LayerNorm or RMSNorm) when
    built, instead of apex's LayerNorm-only fused norm."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    return get_gpt_layer_local_spec(normalization="RMSNorm")


def with_gated_self_attention(spec: Any) -> Any:
    """A copy of a layer spec whose ``self_attention`` module is
    :class:`~megatron_patches.gated_attention.GatedSelfAttention` (what a gated core attention
    needs; with any other core attention it is Megatron's ``SelfAttention``)."""
    from megatron.core.transformer.attention import SelfAttention
    sa = getattr(spec.submodules, "self_attention", None)
    if not isinstance(sa, ModuleSpec) or not (isinstance(sa.module, type) and
                                              issubclass(sa.module, SelfAttention)):
        raise ValueError("the gated layer needs a layer spec whose self_attention is Megatron's "
                         "SelfAttention (e.g. get_gpt_layer_local_spec())")
    subs = dataclasses.replace(spec.submodules,
                               self_attention=dataclasses.replace(sa, module=GatedSelfAttention))
    return dataclasses.replace(spec, submodules=subs)


def layer_spec(kind: str, *, base: Optional[ModuleSpec] = None, **options) -> ModuleSpec:
    """Megatron's local GPT layer spec (or ``base``) with a ``kind`` core attention."""
    base = _local_gpt_layer_spec() if base is None else base
    spec = patch_core_attention(base, core_attention_spec(kind, **options))
    return with_gated_self_attention(spec) if kind == "gated" else spec


def block_spec(pattern: str, num_layers: int, *, base: Optional[ModuleSpec] = None, **options):
    """``TransformerBlockSubmodules`` with one layer spec per layer of the expanded pattern
    (all layers: pipeline parallelism is not supported)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    specs = {k: layer_spec(LAYER_KINDS[k], base=base, **options) for k in set(pattern)}
    layers = [specs[c] for c in expand_pattern(pattern, num_layers)]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=WrappedTorchNorm)


class ArgsCoreAttention:
    """Core attention configured from Megatron-LM's parsed arguments (``--context-parallel-impl``,
    ``--sp-hybrid-pattern``, the softmax schedule options; see :mod:`megatron_patches.args`),
    in :data:`MEGATRON_LAYOUT` (Megatron-LM's batches and RoPE).

    Constructing it returns a :class:`SoftmaxCoreAttention`, :class:`LinearCoreAttention` or
    :class:`GatedCoreAttention` for the layer: what ``--spec megatron_patches.specs <name>``
    puts in every layer. ``kind``: ``"softmax"``, ``"linear"``, ``"gated"`` or ``"pattern"``
    (the layer's letter in the pattern). The options are the one
    :class:`~megatron_patches.options.SPOptions` the launcher's ``validate_args`` built
    (:func:`megatron_patches.args.options_from_megatron_args`): checked once per run, not per
    layer.
    """

    def __new__(cls, *args, kind: str = "pattern", **kwargs):
        options = megatron_args.options_from_megatron_args()
        layer_number = kwargs.get("layer_number", args[1] if len(args) > 1 else 1)
        if kind == "pattern":
            kind = LAYER_KINDS[options.pattern[layer_number - 1]]
        _, cp_group = resolve_groups(kwargs.get("pg_collection"))
        spec = core_attention_spec(kind, sp_context=build_sp_context(cp_group, MEGATRON_LAYOUT),
                                   **options_spec_kwargs(options))
        return spec.module(*args, **spec.params, **kwargs)


def _prebuilt(kind: str) -> ModuleSpec:
    spec = patch_core_attention(_local_gpt_layer_spec(),
                                ModuleSpec(module=ArgsCoreAttention, params={"kind": kind}))
    # a pattern may hold gated layers; GatedSelfAttention is SelfAttention for the others
    return with_gated_self_attention(spec) if kind in ("gated", "pattern") else spec


softmax_layer_spec = _prebuilt("softmax")
linear_layer_spec = _prebuilt("linear")
gated_layer_spec = _prebuilt("gated")
hybrid_layer_spec = _prebuilt("pattern")

"""Our command-line options: one table that builds both CLIs, and the rules they share.

``train.py``'s parser and the Megatron-LM launcher's (``megatron_patches.args.add_arguments``,
an ``extra_args_provider``) both add :data:`SP_OPTIONS`, so every knob has one name, one meaning,
one help text, one set of choices and one default in both. Where Megatron-LM owns a name, ours
carries the ``sp-`` prefix in both CLIs alike (``--sp-model-kind``, ``--sp-hybrid-pattern``,
``--sp-slope-schedule``); the softmax schedule flags are ``--softmax-*``.

The table yields one frozen value, :class:`SPOptions` (model kind, layer pattern, the linear
layers' scan, the softmax schedule, the slope schedule), whose construction holds every rule
between our options (what both CLIs refuse, before any process group exists); it is built once
per run and handed down to the model builders, the launcher's specs, the core attentions and
HF's ``prepare_model_for_cp``. The layer-pattern rules (:func:`expand_pattern`,
:func:`default_hybrid_pattern`, :func:`model_pattern`) live here too. This module imports
nothing from Megatron, so train.py's argument checks and ``--help`` stay cheap.
"""
from __future__ import annotations

import argparse
import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import sp_attention.context as _context
import sp_attention.linear.attention as _linear
import sp_attention.softmax.schedule as _schedule
from sp_attention import LinearTuning, SoftmaxSchedule
from sp_attention.planning.layout import num_chunks
from sp_attention.linear import IMPLS as LINEAR_IMPLS
from sp_attention.linear.slopes import DEFAULT_SLOPE_SCHEDULE, SLOPE_SCHEDULES
from sp_attention.softmax import PRESETS
from sp_attention.softmax.schedule import AUTO_PRESET, PRESET_NAMES

__all__ = ["UsageError", "Option", "SP_OPTIONS", "add_sp_options", "option", "MODEL_KINDS",
           "LAYER_KINDS", "SCAN_LETTERS",
           "MEGATRON_IMPL", "CP_IMPLS", "DEFAULT_SLOPE_SCHEDULE", "SOFTMAX_FLAGS",
           "DEFAULT_SOFTMAX_SCHEDULE",
           "expand_pattern", "default_hybrid_pattern", "model_pattern", "SPOptions",
           "softmax_schedule", "seq_multiple", "take_renamed"]


class UsageError(ValueError):
    """A bad command line: the same on every rank of a node (a function of the flags, the world
    size and the machine), so train.py prints it once per node, from its first rank."""


# Layer letters of a pattern, and the model kinds made of them (a new layer kind adds a letter;
# a new model kind adds a row: its letter, or None for a pattern of several).
LAYER_KINDS = {"L": "linear", "S": "softmax", "G": "gated"}
_KIND_LETTER: dict[str, Optional[str]] = {"softmax": "S", "linear": "L", "gated": "G",
                                          "hybrid": None}
# layers whose decay state crosses CP ranks through the library's scans (--context-parallel-impl)
SCAN_LETTERS = ("L", "G")
MODEL_KINDS = tuple(_KIND_LETTER)

MEGATRON_IMPL = "megatron"           # launcher only: Megatron's own attention (TE)
CP_IMPLS = LINEAR_IMPLS + (MEGATRON_IMPL,)
# The --softmax-* flags (their attributes) and the SoftmaxSchedule field each one sets.
SOFTMAX_FLAGS = {"softmax_cp_preset": "preset", "softmax_heads_k_stride": "heads_k_stride",
                 "softmax_bwd_head_first_stride": "bwd_head_first_stride",
                 "softmax_bwd_head_last_stride": "bwd_head_last_stride",
                 "softmax_a2a_size": "a2a_size"}
# The softmax layers' schedule when no --softmax-cp-preset names one (train.py, the launcher,
# the Megatron specs, HF's prepare_model_for_cp): the cost model's pick per layer shape — on
# 4 x H200 it runs a2a at 8K tokens per GPU (0.91 of one GPU against ring's 0.86) and ring where
# ring is fastest; on CPU/gloo its fixed rule, the library's DEFAULT_PRESET. The library op's own
# default stays DEFAULT_PRESET: a plain function call makes no machine-dependent choice.
DEFAULT_SOFTMAX_SCHEDULE = SoftmaxSchedule(preset=AUTO_PRESET)


@dataclass(frozen=True)
class Option:
    """One command-line option of ours.

    Attributes:
        flag: ``--dashed-name``; the namespace attribute is its underscored form (:attr:`dest`).
        help: what it does, for ``--help``.
        default: the parsed value when the flag is absent (None: decided later, see
            ``default_help``).
        choices: allowed values (None: any value of ``type``).
        type: converts the command-line string.
        default_help: how ``--help`` names the default when it is a rule or a library constant
            (a callable, evaluated when the parser is built, so it shows the current value).
        action: an argparse action instead of a value (``"store_true"``: a switch).
    """

    flag: str
    help: str
    default: Any = None
    choices: Optional[tuple] = None
    type: Callable = str
    default_help: Optional[Callable[[], str]] = None
    action: Optional[str] = None

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")

    def help_text(self) -> str:
        """The help line with its default spelled out."""
        if self.default_help is not None:
            default = self.default_help()
        elif self.default is None:
            default = "unset"
        else:
            default = str(self.default)
        return f"{self.help} (default: {default})"

    def add_to(self, parser, *, default: Any = None, use_default: bool = True) -> None:
        """Add to an argparse parser or group; ``use_default=False`` leaves the attribute unset
        when the flag is absent (``argparse.SUPPRESS``: the caller tells given from default)."""
        kw = dict(help=self.help_text(),
                  default=(self.default if default is None else default) if use_default
                  else argparse.SUPPRESS)
        if self.action is not None:
            kw["action"] = self.action
        else:
            kw["type"] = self.type
        if self.choices is not None:
            kw["choices"] = self.choices
        parser.add_argument(self.flag, **kw)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


_positive_int.__name__ = "positive int"   # argparse names the type in its error


SP_OPTIONS: tuple[Option, ...] = (
    Option("--sp-model-kind", "the model's attention layers: softmax (Llama), linear (linear "
           "attention with fixed per-head decay), gated (linear attention with a per-token "
           "decay gate per head, Mamba2-style: g = -exp(A_log)·softplus(x·W + dt_bias)) or "
           "hybrid (--sp-hybrid-pattern)",
           default="softmax", choices=MODEL_KINDS),
    Option("--sp-hybrid-pattern", "hybrid layer pattern, repeated to --num-layers: L linear, "
           "G gated linear, S softmax (e.g. LLLS: three linear layers to one softmax layer; "
           "GGGS with gated ones)",
           default_help=lambda: "LLLS when --num-layers is a multiple of 4, else LLS, LS, or "
           "linear layers and a last softmax layer"),
    Option("--sp-slope-schedule", "per-head decay rates of linear layers "
           "(sp_attention.linear.slopes)", choices=SLOPE_SCHEDULES,
           default_help=lambda: DEFAULT_SLOPE_SCHEDULE),
    Option("--context-parallel-impl", "how linear-attention layers (L and G) pass their state "
           f"across CP ranks: one of the library's scans ({', '.join(LINEAR_IMPLS)}; auto: the "
           f"cost model's pick per layer shape). '{MEGATRON_IMPL}' (Megatron-LM launcher only) "
           "leaves attention to Megatron/TransformerEngine. Softmax layers take "
           "--softmax-cp-preset",
           choices=CP_IMPLS,
           default_help=lambda: f"{_linear.DEFAULT_IMPL}, the library's "
           "sp_attention.linear.DEFAULT_IMPL"),
    Option("--linear-op-graphs", "replay each linear and gated layer's attention op (forward "
           "and backward on this rank) from CUDA graphs: one launch instead of ~100, for steps "
           "that wait on the host (short sequences per GPU, small models, eager layers); costs "
           "a copy of the op's inputs and outputs per call, a loss when the host runs ahead "
           "(sp_attention.LinearTuning.op_graphs)", default=False, action="store_true"),
    Option("--softmax-cp-preset", "softmax layers' schedule across CP ranks "
           "(sp_attention.softmax.PRESETS: ring, ring_ag, allgather, ag_ring; a2a: Ulysses "
           "all-to-all, needs heads per TP rank divisible by the CP size; a2a_ring: all-to-all "
           "inside groups of --softmax-a2a-size ranks, ring across them; auto: the cost "
           "model's pick per layer shape)",
           choices=PRESET_NAMES,
           default_help=lambda: "auto; on CPU the library's "
           f"sp_attention.softmax.DEFAULT_PRESET, {_schedule.DEFAULT_PRESET}"),
    Option("--softmax-heads-k-stride", "softmax all-gather schedules: KV heads per all-gather "
           "step; must divide the KV heads per TP rank", type=_positive_int,
           default_help=lambda: "the library's choice"),
    Option("--softmax-bwd-head-first-stride", "softmax all-gather backward: split its first "
           "stride into this many heads and the rest (0 < value < heads-k-stride)",
           type=_positive_int),
    Option("--softmax-bwd-head-last-stride", "softmax all-gather backward: split its last "
           "stride into the rest and this many heads (0 < value < heads-k-stride)",
           type=_positive_int),
    Option("--softmax-a2a-size", "softmax a2a_ring: ranks per all-to-all group (consecutive CP "
           "ranks, e.g. the GPUs of a node; must divide the CP size and the heads per TP "
           "rank); with auto, lets the cost model consider a2a_ring of this size",
           type=_positive_int),
    Option("--load-hf", "initialise the model from a local Hugging Face checkpoint directory "
           "(LlamaForCausalLM or our LinearLlamaForCausalLM: config.json and safetensors) under "
           "any TP × CP × DP; its config.json gives the model, and a model flag that "
           "contradicts it is refused by name (RoPE: --rotary-base and --rope-scaling-factor "
           "override it); a checkpoint found under --load wins (requeue)",
           default_help=lambda: "random weights"),
)
_BY_DEST = {o.dest: o for o in SP_OPTIONS}


def option(dest: str) -> Option:
    """The :class:`Option` whose attribute is ``dest``."""
    return _BY_DEST[dest]


def add_sp_options(parser, *, use_defaults: bool = True):
    """Add every :data:`SP_OPTIONS` row to ``parser`` (a parser or an argument group)."""
    for opt in SP_OPTIONS:
        opt.add_to(parser, use_default=use_defaults)
    return parser


# --- layer patterns -----------------------------------------------------------------------
def default_hybrid_pattern(num_layers: int) -> str:
    """The hybrid pattern used when none is given: ``LLLS`` when it fits, else the longest of
    ``LLS``/``LS`` that divides ``num_layers``, else linear layers and one last softmax layer."""
    if num_layers < 2:
        raise ValueError(f"a hybrid model needs at least 2 layers (one linear, one softmax); "
                         f"--num-layers is {num_layers}")
    for pattern in ("LLLS", "LLS", "LS"):
        if num_layers % len(pattern) == 0:
            return pattern
    return "L" * (num_layers - 1) + "S"


def expand_pattern(pattern: str, num_layers: int) -> str:
    """``pattern`` repeated to ``num_layers`` letters (``L`` linear, ``G`` gated linear, ``S``
    softmax); its length must divide ``num_layers``. The error's example fits the model."""
    if not pattern or set(pattern) - set(LAYER_KINDS):
        raise ValueError(f"layer pattern {pattern!r} must be a non-empty string of "
                         f"{'/'.join(LAYER_KINDS)} (L linear, G gated linear, S softmax), e.g. "
                         f"{default_hybrid_pattern(max(num_layers, 2))!r}")
    if num_layers % len(pattern):
        fits = default_hybrid_pattern(num_layers) if num_layers >= 2 else "S"
        raise ValueError(f"layer pattern {pattern!r} (length {len(pattern)}) is repeated over "
                         f"the {num_layers} layers, so its length must divide {num_layers}: "
                         f"e.g. {fits!r}, or use a layer count that is a multiple of "
                         f"{len(pattern)}")
    return pattern * (num_layers // len(pattern))


def model_pattern(kind: str, num_layers: int, hybrid_pattern: Optional[str] = None) -> str:
    """The expanded per-layer letters of a model ``kind`` (hybrid: ``hybrid_pattern``, or
    :func:`default_hybrid_pattern` when None)."""
    if kind not in _KIND_LETTER:
        raise ValueError(f"model kind {kind!r}: use one of {MODEL_KINDS}")
    letter = _KIND_LETTER[kind]
    if letter is not None:
        return letter * num_layers
    if hybrid_pattern is None:
        hybrid_pattern = default_hybrid_pattern(num_layers)
    return expand_pattern(hybrid_pattern, num_layers)


def seq_multiple(cp: int) -> int:
    """What the sequence length must be a multiple of for ``cp`` ranks in the default layout
    (``sp_attention.DEFAULT_LAYOUT``, read now: 2·CP for zigzag, CP for contiguous)."""
    return num_chunks(cp, _context.DEFAULT_LAYOUT)


def take_renamed(kwargs: dict, old: str, new: str, value: Any) -> Any:
    """``value`` (the keyword ``new``), or what ``kwargs`` holds under ``new``'s old name ``old``
    (popped, with a ``DeprecationWarning``: old keywords work for one release)."""
    if old not in kwargs:
        return value
    old_value = kwargs.pop(old)
    warnings.warn(f"{old}= is now {new}= (one name for the linear scan, from "
                  "--context-parallel-impl down); the old keyword goes in the next release",
                  DeprecationWarning, stacklevel=3)
    if value is not None and old_value is not None and value != old_value:
        raise TypeError(f"{old}={old_value!r} and {new}={value!r} disagree: pass {new}= only")
    return old_value if value is None else value


# --- the options object: every rule between our options ---------------------------------
def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def softmax_schedule(ns) -> SoftmaxSchedule:
    """The :class:`~sp_attention.SoftmaxSchedule` of the ``--softmax-*`` flags in ``ns``
    (:data:`SOFTMAX_FLAGS`: each flag's schedule field; an absent preset:
    :data:`DEFAULT_SOFTMAX_SCHEDULE`'s ``auto``); an invalid combination raises naming the flags."""
    fields = {name: getattr(ns, dest, None) for dest, name in SOFTMAX_FLAGS.items()}
    if fields["preset"] is None:
        fields["preset"] = DEFAULT_SOFTMAX_SCHEDULE.preset
    try:
        return SoftmaxSchedule(**fields)
    except ValueError as e:
        raise ValueError(f"{e} [flags: --softmax-cp-preset, --softmax-heads-k-stride, "
                         "--softmax-bwd-head-first/last-stride, --softmax-a2a-size]") from None


def _set_softmax_flags(schedule: SoftmaxSchedule) -> list[str]:
    """The flags whose schedule fields differ from the default schedule (what a user set)."""
    default = DEFAULT_SOFTMAX_SCHEDULE
    if schedule == default:
        return []
    return [_flag(dest) for dest, name in SOFTMAX_FLAGS.items()
            if getattr(schedule, name) != getattr(default, name)] or ["softmax_schedule"]


@dataclass(frozen=True)
class SPOptions:
    """Our attention options of one model, checked: the one value both CLIs, the launcher's
    specs, the core attentions and HF's ``prepare_model_for_cp`` are handed.

    Every rule between our options lives in :meth:`__post_init__` (each ``ValueError`` names the
    flag to change), so a value that exists is valid: build it once — :meth:`from_flags` from a
    parsed command line (train.py's ``TrainArgs``, the launcher's ``validate_args``), or
    directly in code (``build_gpt_model`` builds one from its keywords and the config) — and
    pass it down.

    Attributes:
        num_layers: the model's layer count (the pattern repeats to it).
        model_kind: ``--sp-model-kind``: ``softmax``, ``linear``, ``gated`` or ``hybrid``.
        hybrid_pattern: ``--sp-hybrid-pattern`` as given (hybrid only; None: the default
            pattern for ``num_layers``, :func:`default_hybrid_pattern`).
        context_parallel_impl: ``--context-parallel-impl``: the scan of linear and gated
            layers (``blelloch``, ``allgather``, ``ring``, ``auto``; the ``impl=`` of
            ``sp_attention.lightning_attention``), or ``megatron`` (the launcher only:
            Megatron's own attention). None: the library's ``DEFAULT_IMPL``, read at each call.
        softmax_schedule: the softmax layers' :class:`~sp_attention.SoftmaxSchedule` (the
            ``--softmax-*`` flags, :func:`softmax_schedule`); None:
            :data:`DEFAULT_SOFTMAX_SCHEDULE` (``auto``).
        slope_schedule: ``--sp-slope-schedule``: the fixed decay of ``L`` layers; None: the
            library's ``DEFAULT_SLOPE_SCHEDULE`` (:attr:`slopes`).
        linear_tuning: the :class:`~sp_attention.LinearTuning` of linear and gated layers
            (``--linear-op-graphs`` sets ``op_graphs``); None: the library's defaults (gated
            layers skip the gate-value check either way: their gates are ≤ 0 by
            construction).
        num_attention_heads, num_query_groups, tensor_model_parallel_size,
            context_parallel_size: the model's head counts, TP and CP sizes, for the rules that
            need them (None: unknown, rules skipped — the op checks them at its first call,
            on every rank; HF models have no TP).
        pattern: derived: one letter per layer (``L`` linear, ``G`` gated, ``S`` softmax).
    """

    num_layers: int
    model_kind: str = "softmax"
    hybrid_pattern: Optional[str] = None
    context_parallel_impl: Optional[str] = None
    softmax_schedule: Optional[SoftmaxSchedule] = None
    slope_schedule: Optional[str] = None
    linear_tuning: Optional[LinearTuning] = None
    num_attention_heads: Optional[int] = None
    num_query_groups: Optional[int] = None
    tensor_model_parallel_size: Optional[int] = None
    context_parallel_size: Optional[int] = None
    pattern: str = field(init=False)

    def __post_init__(self) -> None:
        kind = self.model_kind
        if kind not in MODEL_KINDS:
            raise ValueError(f"--sp-model-kind {kind}: use one of {MODEL_KINDS}")
        try:
            pattern = model_pattern(kind, self.num_layers, self.hybrid_pattern)
        except ValueError as e:
            raise ValueError(f"--sp-hybrid-pattern: {e}") from None
        object.__setattr__(self, "pattern", pattern)
        schedule = (DEFAULT_SOFTMAX_SCHEDULE if self.softmax_schedule is None
                    else self.softmax_schedule)
        if not isinstance(schedule, SoftmaxSchedule):
            raise TypeError(f"softmax_schedule must be an sp_attention.SoftmaxSchedule or None, "
                            f"got {type(schedule).__name__}")
        object.__setattr__(self, "softmax_schedule", schedule)
        self._check_scan()
        self._check_heads()
        self._check_softmax()
        self._check_slopes()
        self._check_linear_tuning()

    # -- the rules, one each --------------------------------------------------------------
    def _check_scan(self) -> None:
        impl, kind = self.context_parallel_impl, self.model_kind
        if impl is not None and impl not in CP_IMPLS:
            raise ValueError(f"--context-parallel-impl {impl}: use one of {CP_IMPLS}")
        if impl == MEGATRON_IMPL:
            if self.has_scan:
                raise ValueError(f"--sp-model-kind {kind}: linear-attention layers need our "
                                 "scan; set --context-parallel-impl to blelloch, allgather, "
                                 "ring or auto")
            ignored = _set_softmax_flags(self.softmax_schedule) + (
                ["--sp-slope-schedule"] if self.slope_schedule is not None else [])
            if ignored:
                raise ValueError(f"{', '.join(ignored)} would be ignored with "
                                 "--context-parallel-impl megatron (Megatron/TE attention); drop "
                                 "--context-parallel-impl megatron or those flags")
        elif impl not in (None, "auto") and not self.has_scan:
            hint = (f" (--softmax-cp-preset {impl} sets the softmax schedule)" if impl in PRESETS
                    else "")
            raise ValueError(f"--context-parallel-impl {impl} does not fit --sp-model-kind "
                             f"{kind}: it picks the linear layers' scan and the model has only "
                             f"softmax layers; drop it or use --context-parallel-impl auto{hint}")

    def _check_heads(self) -> None:
        heads, groups = self.num_attention_heads, self.num_query_groups
        tp = self.tensor_model_parallel_size
        if tp is not None and tp < 1:
            raise ValueError(f"--tensor-model-parallel-size {tp} must be >= 1")
        if None not in (heads, groups, tp) and (heads % tp or groups % tp):
            raise ValueError(f"--num-attention-heads {heads} and --num-query-groups {groups} "
                             f"must be divisible by --tensor-model-parallel-size {tp} (each TP "
                             "rank holds whole heads); pick a TP size dividing both")

    def _check_softmax(self) -> None:
        schedule, given = self.softmax_schedule, _set_softmax_flags(self.softmax_schedule)
        if given and not self.has_softmax:
            raise ValueError(f"{', '.join(given)} would be ignored: the model has no softmax "
                             f"layer (--sp-model-kind {self.model_kind}); drop it")
        kv = self.kv_heads_per_tp_rank
        stride = schedule.heads_k_stride
        if self.has_softmax and stride is not None and kv is not None:
            if kv % stride:
                raise ValueError(f"--softmax-heads-k-stride {stride} must divide the {kv} KV "
                                 "heads per TP rank")
            try:
                schedule.local_stride(kv, stride)
            except ValueError as e:
                raise ValueError(f"{e} [flags: --softmax-bwd-head-first/last-stride]") from None
        heads, tp, cp = self.num_attention_heads, self.tensor_model_parallel_size or 1, \
            self.context_parallel_size
        if self.has_softmax and not schedule.is_auto and None not in (heads, cp):
            try:        # the all-to-all presets split the heads of a TP rank over CP ranks
                schedule.a2a_group_size(cp, heads // tp)
            except ValueError as e:
                raise ValueError(f"{e} [flags: --softmax-cp-preset, --softmax-a2a-size, "
                                 "--context-parallel-size, --num-attention-heads]") from None

    def _check_slopes(self) -> None:
        slope = self.slope_schedule
        if slope is not None and slope not in SLOPE_SCHEDULES:
            raise ValueError(f"--sp-slope-schedule {slope}: use one of {SLOPE_SCHEDULES}")
        if slope is not None and "L" not in self.pattern:
            raise ValueError(f"--sp-slope-schedule {slope} would be ignored: the model has no "
                             f"linear layer with fixed slopes (--sp-model-kind "
                             f"{self.model_kind}; gated layers learn their decay); drop it")

    def _check_linear_tuning(self) -> None:
        tuning = self.linear_tuning
        if tuning is not None and not isinstance(tuning, LinearTuning):
            raise TypeError(f"linear_tuning must be an sp_attention.LinearTuning or None, got "
                            f"{type(tuning).__name__}")
        if tuning is not None and tuning.op_graphs and not self.has_scan:
            raise ValueError(f"--linear-op-graphs would be ignored: the model has no linear or "
                             f"gated layer (--sp-model-kind {self.model_kind}); drop it")

    # -- what the builders read -----------------------------------------------------------
    @property
    def has_softmax(self) -> bool:
        return "S" in self.pattern

    @property
    def has_scan(self) -> bool:
        """Whether any layer passes a decay state across CP ranks (``L`` or ``G``)."""
        return any(c in self.pattern for c in SCAN_LETTERS)

    @property
    def megatron_attention(self) -> bool:
        """``--context-parallel-impl megatron``: the launcher builds Megatron's own model."""
        return self.context_parallel_impl == MEGATRON_IMPL

    @property
    def slopes(self) -> str:
        """The slope schedule of ``L`` layers (the default when none was given)."""
        return DEFAULT_SLOPE_SCHEDULE if self.slope_schedule is None else self.slope_schedule

    @property
    def kv_heads_per_tp_rank(self) -> Optional[int]:
        groups, tp = self.num_query_groups, self.tensor_model_parallel_size
        return None if groups is None else groups // (tp or 1)

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """One kind name per layer (``"linear"``, ``"gated"``, ``"softmax"``): the form HF's
        ``LinearLlamaConfig.layer_kinds`` takes."""
        return tuple(LAYER_KINDS[c] for c in self.pattern)

    def with_model(self, **facts) -> "SPOptions":
        """These options for a model with ``facts`` (``num_layers``, ``num_attention_heads``,
        ``num_query_groups``, ``tensor_model_parallel_size``; None: unknown): the unset ones
        filled in, so their rules run now; a contradiction raises."""
        wrong = [f"{k} {getattr(self, k)} (the model: {v})" for k, v in facts.items()
                 if v is not None and getattr(self, k) not in (None, v)]
        if wrong:
            raise ValueError("the options were built for another model: " + ", ".join(wrong))
        unset = {k: v for k, v in facts.items() if v is not None and getattr(self, k) is None}
        return dataclasses.replace(self, **unset) if unset else self

    @classmethod
    def from_flags(cls, ns, *, model_kind: Optional[str] = None, **model) -> "SPOptions":
        """The options of a parsed command line ``ns`` (a namespace with :data:`SP_OPTIONS`'
        attributes); ``model``: ``num_layers`` and, where known, the head counts and TP size.
        ``model_kind`` overrides ``ns.sp_model_kind`` (the launcher's ``--spec``)."""
        return cls(model_kind=ns.sp_model_kind if model_kind is None else model_kind,
                   hybrid_pattern=getattr(ns, "sp_hybrid_pattern", None),
                   context_parallel_impl=getattr(ns, "context_parallel_impl", None),
                   softmax_schedule=softmax_schedule(ns),
                   slope_schedule=getattr(ns, "sp_slope_schedule", None),
                   linear_tuning=LinearTuning(op_graphs=True)
                   if getattr(ns, "linear_op_graphs", False) else None, **model)

    @classmethod
    def from_layer_kinds(cls, kinds, **options) -> "SPOptions":
        """The options of a model whose layers are ``kinds`` (one of ``"linear"``,
        ``"gated"``, ``"softmax"`` per layer, e.g. an HF ``LinearLlamaConfig``'s)."""
        letters = {v: k for k, v in LAYER_KINDS.items()}
        try:
            pattern = "".join(letters[k] for k in kinds)
        except KeyError as e:
            raise ValueError(f"layer kind {e.args[0]!r}: use {sorted(letters)}") from None
        kind = next((k for k, c in _KIND_LETTER.items() if c and set(pattern) == {c}), "hybrid")
        return cls(num_layers=len(pattern), model_kind=kind,
                   hybrid_pattern=pattern if kind == "hybrid" else None, **options)

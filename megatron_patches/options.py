"""Our command-line options: one table that builds both CLIs, and the rules they share.

``train.py``'s parser and the Megatron-LM launcher's (``megatron_patches.args.add_arguments``,
an ``extra_args_provider``) both add :data:`SP_OPTIONS`, so every knob has one name, one meaning,
one help text, one set of choices and one default in both. Where Megatron-LM owns a name, ours
carries the ``sp-`` prefix in both CLIs alike (``--sp-model-kind``, ``--sp-hybrid-pattern``,
``--sp-slope-schedule``); the softmax schedule flags are ``--softmax-*``.

The layer-pattern rules (:func:`expand_pattern`, :func:`default_hybrid_pattern`,
:func:`model_pattern`) and :func:`check_sp_options` (what both CLIs refuse, before any process
group exists) live here too. This module imports nothing from Megatron, so train.py's argument
checks and ``--help`` stay cheap.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable, Optional

import sp_attention.context as _context
import sp_attention.linear.attention as _linear
import sp_attention.softmax.schedule as _schedule
from sp_attention import SoftmaxSchedule
from sp_attention.layout import num_chunks
from sp_attention.linear import IMPLS as LINEAR_IMPLS
from sp_attention.linear.slopes import DEFAULT_SLOPE_SCHEDULE, SLOPE_SCHEDULES
from sp_attention.softmax import PRESETS
from sp_attention.softmax.schedule import PRESET_NAMES

__all__ = ["UsageError", "Option", "SP_OPTIONS", "add_sp_options", "option", "MODEL_KINDS",
           "LAYER_KINDS", "SCAN_LETTERS",
           "MEGATRON_IMPL", "CP_IMPLS", "DEFAULT_SLOPE_SCHEDULE", "SOFTMAX_FLAGS",
           "expand_pattern", "default_hybrid_pattern", "model_pattern", "check_sp_options",
           "softmax_schedule", "seq_multiple"]

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
SOFTMAX_FLAGS = ("softmax_cp_preset", "softmax_heads_k_stride", "softmax_bwd_head_first_stride",
                 "softmax_bwd_head_last_stride", "softmax_a2a_size")


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
    """

    flag: str
    help: str
    default: Any = None
    choices: Optional[tuple] = None
    type: Callable = str
    default_help: Optional[Callable[[], str]] = None

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
        kw = dict(type=self.type, help=self.help_text(),
                  default=(self.default if default is None else default) if use_default
                  else argparse.SUPPRESS)
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
    Option("--softmax-cp-preset", "softmax layers' schedule across CP ranks "
           "(sp_attention.softmax.PRESETS: ring, ring_ag, allgather, ag_ring; a2a: Ulysses "
           "all-to-all, needs heads per TP rank divisible by the CP size; a2a_ring: all-to-all "
           "inside groups of --softmax-a2a-size ranks, ring across them; auto: the cost "
           "model's pick per layer shape)",
           choices=PRESET_NAMES,
           default_help=lambda: f"{_schedule.DEFAULT_PRESET}, the library's "
           "sp_attention.softmax.DEFAULT_PRESET"),
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


# --- what both CLIs check ---------------------------------------------------------------
def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def softmax_schedule(ns) -> SoftmaxSchedule:
    """The :class:`~sp_attention.SoftmaxSchedule` of the ``--softmax-*`` flags in ``ns``; an
    invalid combination raises naming the flags."""
    try:
        return SoftmaxSchedule(preset=getattr(ns, "softmax_cp_preset", None),
                               heads_k_stride=getattr(ns, "softmax_heads_k_stride", None),
                               bwd_head_first_stride=getattr(ns, "softmax_bwd_head_first_stride",
                                                             None),
                               bwd_head_last_stride=getattr(ns, "softmax_bwd_head_last_stride",
                                                            None),
                               a2a_size=getattr(ns, "softmax_a2a_size", None))
    except ValueError as e:
        raise ValueError(f"{e} [flags: --softmax-cp-preset, --softmax-heads-k-stride, "
                         "--softmax-bwd-head-first/last-stride, --softmax-a2a-size]") from None


def check_sp_options(ns, *, num_layers: int, kv_heads_per_tp_rank: int,
                     kind: Optional[str] = None, cp_size: Optional[int] = None,
                     heads_per_tp_rank: Optional[int] = None) -> dict:
    """Check our options in ``ns`` (a namespace with :data:`SP_OPTIONS`' attributes) against
    the model; return what the model builders take: ``kind``, ``pattern`` (one letter per
    layer), ``cp_impl`` (None: the library's default scan), ``softmax_schedule``,
    ``slope_schedule``. ``kind`` overrides ``ns.sp_model_kind`` (the launcher's ``--spec``).
    ``cp_size`` and ``heads_per_tp_rank``, when given, check the all-to-all presets' head rule
    now (else the first forward does, on every rank). Each error names the flag to change."""
    kind = ns.sp_model_kind if kind is None else kind
    if kind not in MODEL_KINDS:
        raise ValueError(f"--sp-model-kind {kind}: use one of {MODEL_KINDS}")
    try:
        pattern = model_pattern(kind, num_layers, getattr(ns, "sp_hybrid_pattern", None))
    except ValueError as e:
        raise ValueError(f"--sp-hybrid-pattern: {e}") from None
    impl = getattr(ns, "context_parallel_impl", None)
    if impl is not None and impl not in CP_IMPLS:
        raise ValueError(f"--context-parallel-impl {impl}: use one of {CP_IMPLS}")
    has_scan, has_softmax = any(c in pattern for c in SCAN_LETTERS), "S" in pattern
    if impl not in (None, "auto", MEGATRON_IMPL) and not has_scan:
        hint = (f" (--softmax-cp-preset {impl} sets the softmax schedule)" if impl in PRESETS
                else "")
        raise ValueError(f"--context-parallel-impl {impl} does not fit --sp-model-kind {kind}: "
                         "it picks the linear layers' scan and the model has only softmax "
                         f"layers; drop it or use --context-parallel-impl auto{hint}")
    given = [_flag(n) for n in SOFTMAX_FLAGS if getattr(ns, n, None) is not None]
    if given and not has_softmax:
        raise ValueError(f"{', '.join(given)} would be ignored: the model has no softmax layer "
                         f"(--sp-model-kind {kind}); drop it")
    schedule = softmax_schedule(ns)
    stride = schedule.heads_k_stride
    if has_softmax and stride is not None:
        if kv_heads_per_tp_rank % stride:
            raise ValueError(f"--softmax-heads-k-stride {stride} must divide the "
                             f"{kv_heads_per_tp_rank} KV heads per TP rank")
        try:
            schedule.local_stride(kv_heads_per_tp_rank, stride)
        except ValueError as e:
            raise ValueError(f"{e} [flags: --softmax-bwd-head-first/last-stride]") from None
    if has_softmax and cp_size is not None and heads_per_tp_rank is not None \
            and not schedule.is_auto:
        try:
            schedule.a2a_group_size(cp_size, heads_per_tp_rank)
        except ValueError as e:
            raise ValueError(f"{e} [flags: --softmax-cp-preset, --softmax-a2a-size, "
                             "--context-parallel-size, --num-attention-heads]") from None
    slope = getattr(ns, "sp_slope_schedule", None)
    if slope is not None and "L" not in pattern:
        raise ValueError(f"--sp-slope-schedule {slope} would be ignored: the model has no "
                         f"linear layer with fixed slopes (--sp-model-kind {kind}; gated layers "
                         "learn their decay); drop it")
    return {"kind": kind, "pattern": pattern, "cp_impl": impl, "softmax_schedule": schedule,
            "slope_schedule": DEFAULT_SLOPE_SCHEDULE if slope is None else slope}

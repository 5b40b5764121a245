"""Activation recompute for train.py, named and carried out as Megatron does it.

``--recompute-granularity selective|full``, ``--recompute-method uniform|block``,
``--recompute-num-layers N`` and ``--recompute-modules`` become the ``TransformerConfig``
fields of the same names, and Megatron-Core's own machinery does the work:

- ``full``: ``TransformerBlock._checkpointed_forward`` keeps only the input of each group of
  layers and replays the whole group (attention with its CP communication, MLP, norms) during
  the backward. ``uniform``: every group of ``N`` consecutive layers is one checkpoint (N = 1:
  each layer — the least memory); ``block``: the first ``N`` layers are checkpointed one by
  one, the rest keep their activations (the knob between speed and memory).
- ``selective``: only the listed submodules of every layer are replayed: ``core_attn`` (our
  CP core attention: for linear layers its output norm's fp32 buffers and expanded K/V; for
  softmax layers only out and LSE, at the price of a second attention forward), ``mlp`` (the
  SwiGLU MLP's ``[T, 3·ffn]`` of activations, the largest share of a layer). Megatron's
  ``layernorm`` module is refused: its ``CheckpointWithoutOutput`` reads TransformerEngine's
  FP8 state whatever the precision (megatron-core 0.16.1 and 0.19.2), so it fails without TE.

Every rank replays the same layers in the same order, so a replayed layer repeats its CP
collectives in the same order on every rank; the library's per-signature call check is
cached, so a replay adds no collective of its own. Megatron's checkpoint saves and restores
the CUDA RNG state, so recompute needs a GPU (refused on CPU; tests shim the RNG calls).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["RECOMPUTE_GRANULARITIES", "RECOMPUTE_METHODS", "RECOMPUTE_MODULES", "Recompute"]

RECOMPUTE_GRANULARITIES = ("selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
# Megatron's dense-model modules (its MoE / MLA ones do not apply to these models; its
# "layernorm" needs TransformerEngine, see the module docstring)
RECOMPUTE_MODULES = ("core_attn", "mlp")


@dataclass(frozen=True)
class Recompute:
    """Validated recompute settings of a model with ``num_layers`` layers.

    Attributes:
        granularity: None (keep every activation), ``"selective"`` or ``"full"``.
        method: ``full`` only: ``"uniform"`` (default) or ``"block"``.
        num_layers: ``full`` only: layers per checkpoint (uniform, default 1) or checkpointed
            layers (block, default all).
        modules: ``selective`` only: submodules to replay (default ``("core_attn",)``, as
            Megatron).
        model_layers: the model's layer count (for the checks).
    """

    granularity: Optional[str] = None
    method: Optional[str] = None
    num_layers: Optional[int] = None
    modules: Optional[tuple] = None
    model_layers: int = 1

    def __post_init__(self) -> None:
        g, n, total = self.granularity, self.num_layers, self.model_layers
        if g not in (None,) + RECOMPUTE_GRANULARITIES:
            raise ValueError(f"--recompute-granularity {g!r}: use one of "
                             f"{RECOMPUTE_GRANULARITIES} (or leave it out: no recompute)")
        if self.method is not None and self.method not in RECOMPUTE_METHODS:
            raise ValueError(f"--recompute-method {self.method!r}: use one of "
                             f"{RECOMPUTE_METHODS}")
        if g != "full" and (self.method is not None or n is not None):
            raise ValueError("--recompute-method and --recompute-num-layers apply to "
                             "--recompute-granularity full only; drop them"
                             + (" (selective recompute replays the --recompute-modules of "
                                "every layer)" if g == "selective" else ""))
        if self.modules is not None:
            bad = sorted(set(self.modules) - set(RECOMPUTE_MODULES))
            if "layernorm" in bad:
                raise ValueError("--recompute-modules layernorm needs TransformerEngine "
                                 "(Megatron's CheckpointWithoutOutput reads its FP8 state); use "
                                 f"some of {RECOMPUTE_MODULES}")
            if bad:
                raise ValueError(f"--recompute-modules {' '.join(bad)}: use some of "
                                 f"{RECOMPUTE_MODULES}")
            if g != "selective":
                raise ValueError("--recompute-modules applies to --recompute-granularity "
                                 "selective only; drop it or pass --recompute-granularity "
                                 "selective")
            if not self.modules:
                raise ValueError("--recompute-modules needs at least one module")
        if g == "full":
            method = self.method or "uniform"
            n = n if n is not None else (1 if method == "uniform" else total)
            if n < 1 or n > total:
                raise ValueError(f"--recompute-num-layers {n} must be in 1..{total} "
                                 "(--num-layers)")
            if method == "uniform" and total % n:
                raise ValueError(f"--recompute-num-layers {n} must divide --num-layers {total} "
                                 "with --recompute-method uniform (each checkpoint replays N "
                                 "consecutive layers)")
            object.__setattr__(self, "method", method)
            object.__setattr__(self, "num_layers", n)
        if g == "selective":
            object.__setattr__(self, "modules", tuple(self.modules or ("core_attn",)))

    @classmethod
    def from_flags(cls, granularity, method, num_layers, modules: Optional[Sequence[str]],
                   model_layers: int) -> "Recompute":
        if granularity in ("none", ""):
            granularity = None
        return cls(granularity, method, num_layers,
                   None if modules is None else tuple(modules), model_layers)

    def config_kwargs(self) -> dict:
        """The ``TransformerConfig`` fields (Megatron's names)."""
        if self.granularity is None:
            return {}
        kw = {"recompute_granularity": self.granularity}
        if self.granularity == "full":
            kw.update(recompute_method=self.method, recompute_num_layers=self.num_layers)
        else:
            kw["recompute_modules"] = list(self.modules)
        return kw

    def recomputed_layers(self) -> int:
        """Layers whose activations are replayed (full) — all of them for selective."""
        if self.granularity == "full":
            return self.model_layers if self.method == "uniform" else self.num_layers
        return self.model_layers if self.granularity == "selective" else 0

    def check_device(self, on_gpu: bool) -> None:
        """Megatron's checkpoint saves the CUDA RNG state: refuse recompute without a GPU."""
        if self.granularity is not None and not on_gpu:
            raise ValueError("--recompute-granularity needs a GPU: Megatron's activation "
                             "checkpointing saves and restores the CUDA RNG state; drop the "
                             "--recompute-* flags on CPU")

    def describe(self) -> str:
        if self.granularity is None:
            return "no recompute"
        if self.granularity == "full":
            return f"full recompute ({self.method}, {self.num_layers} layer(s))"
        return f"selective recompute ({', '.join(self.modules)})"

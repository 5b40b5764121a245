"""What ``impl="auto"`` / ``preset="auto"`` run: on a GPU the cheapest predicted schedule
(:func:`choose_linear_scan`, :func:`choose_softmax_preset`), logged once per layer shape; on
CPU the fixed rule below; and the CP efficiency of a predicted step.

**The CPU rule** (the one place it is written; :mod:`.auto` applies it to CPU tensors). CPU
timing on shared cores does not repeat within the model's tolerance (the same configuration
measured ×0.74–1.58 apart), so no time model is fitted there; ``auto`` follows the schedules'
structure instead:

* linear scan (:func:`cpu_linear_scan`), by the number of leaves ``L`` (P contiguous, 2P
  zigzag): ``ring`` for ``L ≤ 2`` (one hop); ``allgather`` for ``L ≤ 16`` (one collective and
  a fold of at most 16 states); ``blelloch`` beyond (2⌈log2 L⌉ − 1 rounds instead of L − 1
  hops or a fold of L states);
* softmax preset (:func:`cpu_softmax_preset`): the default preset
  (:data:`sp_attention.planning.schedules.DEFAULT_PRESET`).

**Packed documents** (``cu_seqlens``), on every device: the softmax ``auto`` runs the default
preset, ``ring`` (:func:`packed_softmax_preset`). The time model prices one dense causal
sequence; documents change every preset's kernels (dense calls for large document pairs,
varlen calls for the rest) in ways it does not model, and on 4 × H100 (Llama-3-8B attention,
the log-normal document mix, P = 4, 2026-11-27,
``benchmarks/results/2026-11-27_h100x4_softmax_packed.jsonl``) the model's pick ran 2.3 ×
slower than the ring at 32K per GPU (``a2a`` 0.423 vs ``ring`` 0.911 of one GPU on the whole
row; ``ring_ag`` 0.899) and the ring was fastest at 8K too.
"""
from __future__ import annotations

import logging
from typing import Mapping, Optional, Sequence, Union

from ..planning import schedules
from ..planning.layout import num_chunks
from ..planning.schedules import LINEAR_SCANS
from .common import Choice, LinearShape, SoftmaxShape, StepTime, Topology
from .linear import linear_step
from .machine import Machine
from .memory import softmax_memory
from .softmax import modelled_presets, softmax_step
from .softmax_a2a import A2A_PRESETS, a2a_candidates, a2a_memory, a2a_step

logger = logging.getLogger("sp_attention.cost")

_LINEAR_TIE_ORDER = ("allgather", "ring", "blelloch")
_SOFTMAX_TIE_ORDER = ("ring", "ring_ag", "allgather", "ag_ring", "a2a", "a2a_ring")
CPU_RING_LEAVES = 2          # the CPU rule's bounds (see the module docstring)
CPU_ALLGATHER_LEAVES = 16


def cpu_linear_scan(world: int, layout: str) -> str:
    """The linear scan ``auto`` runs on CPU (the module docstring's rule)."""
    leaves = num_chunks(world, layout)
    if leaves <= CPU_RING_LEAVES:
        return "ring"
    return "allgather" if leaves <= CPU_ALLGATHER_LEAVES else "blelloch"


def cpu_softmax_preset() -> str:
    """The softmax preset ``auto`` runs on CPU: the default preset (read now)."""
    return schedules.DEFAULT_PRESET


def packed_softmax_preset() -> Choice:
    """What the softmax ``auto`` runs with packed documents, on any device: the default preset
    (read now), never a time model's pick (the module docstring says why)."""
    return Choice(schedules.DEFAULT_PRESET, {},
                  why="packed documents: the time model prices one dense sequence")


def _pick(times: Mapping[str, StepTime], order: Sequence[str]) -> str:
    """Cheapest by total; exact ties go to the earlier name of ``order`` (deterministic, so
    every rank that predicts the same times picks the same schedule)."""
    return min(times, key=lambda n: (times[n].total_ms,
                                     order.index(n) if n in order else len(order), n))


def choose_linear_scan(shape: LinearShape, world: int, layout: str, machine: Machine,
                       topology: Optional[Topology] = None,
                       candidates: Sequence[str] = LINEAR_SCANS) -> Choice:
    """The scan ``impl="auto"`` runs on GPUs: the cheapest predicted fwd + bwd of
    ``candidates``."""
    times = {c: linear_step(shape, world, layout, c, machine, topology) for c in candidates}
    return Choice(_pick(times, _LINEAR_TIE_ORDER), times)


def choose_softmax_preset(shape: SoftmaxShape, world: int, layout: str, machine: Machine,
                          topology: Optional[Topology] = None,
                          heads_k_stride: Optional[int] = None,
                          memory_limit_bytes: Optional[float] = None,
                          candidates: Optional[Sequence[str]] = None,
                          a2a_size: Optional[int] = None) -> Choice:
    """The preset ``preset="auto"`` runs on GPUs: the cheapest predicted fwd + bwd of
    ``candidates`` whose buffers (:func:`softmax_memory`, :func:`.softmax_a2a.a2a_memory`) fit
    ``memory_limit_bytes`` (None: no limit). ``candidates`` None: every preset the model
    predicts that can run the shape (the all-to-all ones where the heads split, ``a2a_ring``
    with ``a2a_size``: :func:`.softmax_a2a.a2a_candidates`). Raises ``ValueError`` if none
    fits."""
    if candidates is None:
        candidates = modelled_presets() + a2a_candidates(shape, world, a2a_size)
    times, excluded = {}, {}
    for name in candidates:
        a2a = name in A2A_PRESETS
        size = (world if name == "a2a" else a2a_size) if a2a else None
        if memory_limit_bytes is not None:
            need = (a2a_memory(shape, world, layout, machine, size) if a2a else softmax_memory(
                shape, world, layout, *schedules.PRESETS[name], machine, heads_k_stride))["peak"]
            if need > memory_limit_bytes:
                excluded[name] = f"needs {need / 2**30:.2f} GiB"
                continue
        times[name] = (a2a_step(shape, world, layout, machine, topology, size) if a2a else
                       softmax_step(shape, world, layout, *schedules.PRESETS[name], machine,
                                    topology, heads_k_stride))
    if not times:
        raise ValueError("no softmax preset fits memory_limit_bytes="
                         f"{memory_limit_bytes}: {excluded}; use fewer tokens per rank")
    return Choice(_pick(times, _SOFTMAX_TIE_ORDER), times, excluded)


_LOGGED: set = set()


def log_choice(kind: str, key: tuple, choice: Choice, machine: Union[Machine, str]) -> bool:
    """Log ``choice`` once per ``(kind, key)`` (a layer shape) at INFO on the
    ``sp_attention.cost`` logger, with the predicted time of every alternative and where the
    figures come from (``machine``, or a string such as ``"cpu"``); True when it logged."""
    if (kind, key) in _LOGGED:
        return False
    _LOGGED.add((kind, key))
    where = machine if isinstance(machine, str) else f"{machine.name} [{machine.source}]"
    logger.info("auto %s for %s on %s: %s", kind, key, where, choice.describe())
    return True


def cp_efficiency(t: StepTime) -> float:
    """The step's kernel time ÷ its time: per-GPU throughput of the CP step relative to the
    same kernels doing the same per-GPU work on one device (the benchmarks' ratio)."""
    return t.compute_ms / t.total_ms if t.total_ms else 1.0

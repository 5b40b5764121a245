"""Cost model of the context-parallel schedules: predicted forward and backward time per layer
and schedule, and the choice ``impl="auto"`` / ``preset="auto"`` makes from it.

Pure functions of the sizes, the CP size P, the layout, where the ranks sit
(:class:`Topology`: which CP ranks share a node) and a :class:`Machine` (α, β per link class,
kernel rates, overlap; :mod:`.machine`, calibrated on the GPUs by ``python -m
sp_attention.calibrate``, which refuses fits no GPU can have: :mod:`.plausible`). Times are the
slowest rank's GPU time in ms with the host ahead of the device (the benchmarks' ``queued``
timing, a layer inside a model).

There is no CPU model: CPU timing on shared cores does not repeat within the model's tolerance,
so on CPU ``auto`` follows the fixed rule written in :mod:`.choose`.

Formulas (``S`` = one fp32 scan element ``(A, b)`` = ``4·B·H·(K·V + 1)`` bytes; ``kv`` = one
rank's K and V; links per message from the topology):

* linear ``ring``: the prefix walks the leaves: one hop ``α_p2p + S/β`` per leaf boundary that
  crosses ranks (P − 1 contiguous, 2(P − 1) zigzag), each after a combine.
* linear ``blelloch``: 2⌈log2 L⌉ − 1 rounds (L leaves; zigzag: 2⌈log2 P⌉ − 1 rounds of up to
  three elements, ``planning.layout.nested_ranks``; ``planning.layout.tree_scan_rounds``:
  the exclusive scan's dead top round left out); a round costs one ``α_p2p`` plus its busiest
  rank's bytes (``S`` per pair it takes part in) and a combine.
* linear ``allgather``: one collective receiving (P − 1)·(leaves per rank)·S, then a local fold.
* the forward's scan is exposed (the output kernel needs ``S_in``); the backward's hides under
  the chunk-state recomputation (half the forward kernel) on a side stream.
* softmax ``ring``: P steps; a K/V hop overlaps each step's kernels, so a step costs
  ``max(compute, hop) + overlap_cost·(wire time beside the kernels)``: a transfer is hidden
  when compute per step exceeds it, but moving its bytes slows the kernels beside it. The
  backward's dK/dV accumulators travel with K/V and the last one home is exposed.
* softmax ``allgather``: per head stride a K/V all-gather (double-buffered: the first is
  exposed); the backward reduce-scatters fp32 dK/dV per stride (the last is exposed). Its
  kernel calls are its own: one per local chunk against the keys arranged before it.
* an attention call's pairs (:func:`.common.softmax_kernel_ms`): a GPU kernel skips the masked
  triangle (a causal call's FLOPs are the pairs it keeps).

Per-rank memory of the schedules' own buffers: :func:`linear_memory`, :func:`softmax_memory`;
:func:`rank_memory` adds a model-level estimate (weights, optimizer, activations) given by the
caller.

Modules, one job each: :mod:`.machine` (the figures, their defaults and the calibration
file), :mod:`.plausible` (which figures a GPU can have), :mod:`.common` (shapes, topology,
predicted times, FLOPs), :mod:`.linear` (the scans and the linear step), :mod:`.softmax` (the
ring and all-gather schedules), :mod:`.memory` (buffers per rank), :mod:`.choose` (``auto``'s
pick on GPUs, the CPU rule, the log), :mod:`.auto` (the choice for a call's tensors and
group: what the ops call). Every public name but :mod:`.auto`'s is importable from here.
"""
from __future__ import annotations

from .choose import (choose_linear_scan, choose_softmax_preset, cp_efficiency, cpu_linear_scan,
                     cpu_softmax_preset, log_choice)
from .common import (Choice, LinearShape, SoftmaxShape, StepTime, Topology, linear_flops,
                     softmax_flops)
from .linear import linear_scan_ms, linear_step
from .machine import (H100_NVLINK_2GPU, H200_NVLINK_4GPU, H200_NVLINK_IB400, Kernels, Link,
                      Machine, calibration_path, default_machine, load_machine,
                      machine_from_dict, save_machine)
from .memory import linear_memory, rank_memory, softmax_memory
from .plausible import implausible
from .softmax import softmax_step

__all__ = ["LinearShape", "SoftmaxShape", "Topology", "StepTime", "Choice", "linear_flops",
           "softmax_flops", "linear_scan_ms", "linear_step", "softmax_step",
           "choose_linear_scan", "choose_softmax_preset", "cpu_linear_scan",
           "cpu_softmax_preset", "log_choice", "cp_efficiency", "linear_memory",
           "softmax_memory", "rank_memory", "Link", "Kernels", "Machine", "H200_NVLINK_IB400",
           "H200_NVLINK_4GPU", "H100_NVLINK_2GPU",
           "default_machine", "calibration_path", "load_machine", "save_machine",
           "machine_from_dict", "implausible"]

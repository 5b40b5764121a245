"""Cost model of the context-parallel schedules: predicted forward and backward time per layer
and schedule, and the choice ``impl="auto"`` / ``preset="auto"`` makes from it.

Pure functions of the sizes, the CP size P, the layout, where the ranks sit
(:class:`Topology`: which CP ranks share a node) and a :class:`~sp_attention.machine.Machine`
(α, β per link class, kernel rates, overlap). Times are the slowest rank's GPU time in ms with
the host ahead of the device (the benchmarks' ``queued`` timing, a layer inside a model).

On CPU the P processes time-share the machine's ``Kernels.cores`` (a GPU has one device per
rank, and all of this is inert there). Each direction's time is the larger of two bounds:

* its **critical path**, on which work runs at the share of the ranks busy at that moment:
  compute (``Machine.compute_share``) and every communication round in which all ranks take
  part (collectives, softmax ring hops; ``Machine.comm_share``) take ``1 / share`` as long; a
  linear scan's step (a tree round, a ring scan's hop) runs at the share of the ranks with a
  message in it plus the ranks the scan has already passed (they hold all their prefixes and
  go on with their step; the others wait asleep and free their cores), except a ring scan
  hop's ``α + S/β``, a transfer between two ranks, which is not shared;
* the **work-conserving bound** (``StepTime.work_ms``): the CPU work of all P ranks ÷ cores,
  ``P · w / cores``, where a rank's work ``w`` is its kernels (``corun`` included), its host
  work per message and call, its combines, merges and folds, and the bytes of its messages at
  the link's rate (gloo copies them through the cores). A transfer that hides behind a
  kernel on the critical path still takes core time from the other ranks once P > cores.

Host work is time on the same cores: per point-to-point message a rank posts
(``Kernels.msg_us``; a linear scan's element messages ``scan_msg_us`` more; in the work
bound each message end costs at least half the message's whole CPU, ``msg_cpu_us``, which
includes the backend's I/O threads and the wake-up of a receiver that slept; where the
ranks outnumber the cores each receive ``resume_us`` more, the receiver resuming with caches
the others' work refilled), the all-gather
scan's fold (``fold_us``), each attention call (``softmax_call_ms`` forward,
``softmax_bwd_call_ms`` backward); ranks computing side by side run ``Kernels.corun`` slower
than one alone. These host terms are measured on CPU and 0 on a GPU (the host runs ahead).

Formulas (``S`` = one fp32 scan element ``(A, b)`` = ``4·B·H·(K·V + 1)`` bytes; ``kv`` = one
rank's K and V; links per message from the topology):

* linear ``ring``: the prefix walks the leaves: one hop ``α_p2p + S/β`` per leaf boundary that
  crosses ranks (P − 1 contiguous, 2(P − 1) zigzag), each after a combine.
* linear ``blelloch``: 2⌈log2 L⌉ rounds (L leaves); a round costs one ``α_p2p`` plus its
  busiest rank's bytes (``S`` per element it sends or receives) and its postings: one message
  per peer and direction (the elements for one peer travel packed; a down-sweep pair exchanges
  both ways).
* linear ``allgather``: one collective receiving (P − 1)·(leaves per rank)·S, then a local fold.
* the forward's scan is exposed (the output kernel needs ``S_in``); the backward's hides under
  the chunk-state recomputation (half the forward kernel) on a GPU side stream.
* softmax ``ring``: P steps; a K/V hop overlaps each step's kernels, so a step costs
  ``max(compute, hop) + overlap_cost·(wire time beside the kernels)``: a transfer is hidden
  when compute per step exceeds it, but moving its bytes slows the kernels beside it. The
  backward's dK/dV accumulators travel with K/V and the last one home is exposed.
* softmax ``allgather``: per head stride a K/V all-gather (double-buffered: the first is
  exposed); the backward reduce-scatters fp32 dK/dV per stride (the last is exposed). Its
  kernel calls are its own: one per local chunk against the keys arranged before it.
* an attention call's pairs (:func:`.common.softmax_kernel_ms`): a GPU kernel skips the masked
  triangle (a causal call's FLOPs are the pairs it keeps); the CPU ``math`` backend computes the
  call's whole block and masks it (``Kernels.softmax_mask``: the mask costs that many × the
  block's forward in each direction).

Per-rank memory of the schedules' own buffers: :func:`linear_memory`, :func:`softmax_memory`;
:func:`rank_memory` adds a model-level estimate (weights, optimizer, activations) given by the
caller.

Modules, one job each: :mod:`.common` (shapes, topology, predicted times, FLOPs, shared machine
terms), :mod:`.linear` (the scans and the linear step), :mod:`.softmax` (the ring and all-gather
schedules), :mod:`.memory` (buffers per rank), :mod:`.choose` (``auto``'s pick and its log).
Every public name is importable from here.
"""
from __future__ import annotations

from .choose import choose_linear_scan, choose_softmax_preset, cp_efficiency, log_choice
from .common import (LINEAR_SCANS, SOFTMAX_PRESETS, Choice, LinearShape, SoftmaxShape,
                     StepTime, Topology, linear_flops, softmax_flops)
from .linear import linear_scan_ms, linear_step
from .memory import linear_memory, rank_memory, softmax_memory
from .softmax import softmax_step

__all__ = ["LinearShape", "SoftmaxShape", "Topology", "StepTime", "Choice", "LINEAR_SCANS",
           "SOFTMAX_PRESETS", "linear_flops", "softmax_flops", "linear_scan_ms", "linear_step",
           "softmax_step", "choose_linear_scan", "choose_softmax_preset", "log_choice",
           "cp_efficiency", "linear_memory", "softmax_memory", "rank_memory"]

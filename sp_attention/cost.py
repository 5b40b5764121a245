"""Cost model of the context-parallel schedules: predicted forward and backward time per layer
and schedule, and the choice ``impl="auto"`` / ``preset="auto"`` makes from it.

Pure functions of the sizes, the CP size P, the layout, where the ranks sit
(:class:`Topology`: which CP ranks share a node) and a :class:`~sp_attention.machine.Machine`
(α, β per link class, kernel rates, overlap). Times are the slowest rank's GPU time in ms with
the host ahead of the device (the benchmarks' ``queued`` timing, a layer inside a model); on CPU the
P processes time-share the machine's cores (``Machine.compute_share``): compute, and every
communication round in which all ranks take part (collectives, softmax ring hops;
``Machine.comm_share``), take ``1 / share`` as long; a tree round, the share of the ranks that
have a message in it (the others wait asleep); a ring scan's hops are a chain between two
ranks at a time and do not. Host work is time on the same cores: per point-to-point message a
rank posts (``Kernels.msg_us``; a linear scan's element messages ``scan_msg_us`` more), the
all-gather scan's fold (``fold_us``), each attention call (``softmax_call_ms`` forward,
``softmax_bwd_call_ms`` backward); ranks computing side by side run ``Kernels.corun`` slower
than one alone. These host terms are measured on CPU and 0 on a GPU (the host runs ahead).

Formulas (``S`` = one fp32 scan element ``(A, b)`` = ``4·B·H·(K·V + 1)`` bytes; ``kv`` = one
rank's K and V; links per message from the topology):

* linear ``ring``: the prefix walks the leaves: one hop ``α_p2p + S/β`` per leaf boundary that
  crosses ranks (P − 1 contiguous, 2(P − 1) zigzag), each after a combine.
* linear ``blelloch``: 2⌈log2 L⌉ rounds (L leaves); a round costs its slowest rank's messages.
* linear ``allgather``: one collective receiving (P − 1)·(leaves per rank)·S, then a local fold.
* the forward's scan is exposed (the output kernel needs ``S_in``); the backward's hides under
  the chunk-state recomputation (half the forward kernel) on a GPU side stream.
* softmax ``ring``: P steps; a K/V hop overlaps each step's kernels, so a step costs
  ``max(compute, hop) + overlap_cost·(wire time beside the kernels)``: a transfer is hidden
  when compute per step exceeds it, but moving its bytes slows the kernels beside it. The
  backward's dK/dV accumulators travel with K/V and the last one home is exposed.
* softmax ``allgather``: per head stride a K/V all-gather (double-buffered: the first is
  exposed); the backward reduce-scatters fp32 dK/dV per stride (the last is exposed).

Per-rank memory of the schedules' own buffers: :func:`linear_memory`, :func:`softmax_memory`;
:func:`rank_memory` adds a model-level estimate (weights, optimizer, activations) given by the
caller.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Mapping, Optional, Sequence

from .layout import holder_of_leaf, num_chunks, scan_position, tree_scan_schedule
from .machine import Link, Machine

__all__ = ["LinearShape", "SoftmaxShape", "Topology", "StepTime", "Choice", "LINEAR_SCANS",
           "SOFTMAX_PRESETS", "linear_flops", "softmax_flops", "linear_scan_ms", "linear_step",
           "softmax_step", "choose_linear_scan", "choose_softmax_preset", "log_choice",
           "cp_efficiency", "linear_memory", "softmax_memory", "rank_memory"]

LINEAR_SCANS = ("blelloch", "allgather", "ring")
SOFTMAX_PRESETS = {"ring": ("ring", "ring"), "ring_ag": ("ring", "allgather"),
                   "allgather": ("allgather", "allgather"), "ag_ring": ("allgather", "ring")}
_CHUNK = 64          # the chunk length of the linear kernels (fla's and ours)
logger = logging.getLogger("sp_attention.cost")


def _positive_ints(obj, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{type(obj).__name__}.{n} must be a positive int, got {v!r}")


@dataclass(frozen=True)
class LinearShape:
    """One linear-attention layer on one rank: ``q, k [B, T_local, H, K]``, ``v [.., V]``;
    ``itemsize`` of the inputs (2 bf16/fp16, 4 fp32, 8 fp64)."""

    B: int
    T_local: int
    H: int
    K: int
    V: int
    itemsize: int = 2

    def __post_init__(self) -> None:
        _positive_ints(self, "B", "T_local", "H", "K", "V", "itemsize")

    @property
    def state_bytes(self) -> int:
        """One packed scan element ``(A [B, H], b [B, H, K, V])`` in fp32 (fp64 for fp64)."""
        return (8 if self.itemsize == 8 else 4) * self.B * self.H * (self.K * self.V + 1)


@dataclass(frozen=True)
class SoftmaxShape:
    """One causal GQA softmax layer on one rank: ``q [B, T_local, H, D]``, ``k, v [.., Hkv,
    D]``."""

    B: int
    T_local: int
    H: int
    Hkv: int
    D: int
    itemsize: int = 2
    causal: bool = True

    def __post_init__(self) -> None:
        _positive_ints(self, "B", "T_local", "H", "Hkv", "D", "itemsize")
        if self.H % self.Hkv:
            raise ValueError(f"SoftmaxShape: H={self.H} must be a multiple of Hkv={self.Hkv}")

    @property
    def kv_bytes(self) -> int:
        """This rank's K and V: what one ring hop carries."""
        return 2 * self.B * self.T_local * self.Hkv * self.D * self.itemsize


@dataclass(frozen=True)
class Topology:
    """Which node each rank of the CP group sits on (``nodes[r]`` for group rank r)."""

    nodes: tuple[int, ...]

    @staticmethod
    def single_node(world: int) -> "Topology":
        return Topology((0,) * world)

    @staticmethod
    def of_ranks(global_ranks: Sequence[int], ranks_per_node: int) -> "Topology":
        """From the group's global ranks and the ranks (GPUs) per node (torchrun's
        ``LOCAL_WORLD_SIZE``; TP-inner layouts give CP groups strided global ranks)."""
        return Topology(tuple(int(g) // ranks_per_node for g in global_ranks))

    @staticmethod
    def packed(world: int, per_node: int) -> "Topology":
        """``world`` CP ranks filling nodes of ``per_node`` CP ranks each in order."""
        return Topology(tuple(r // per_node for r in range(world)))

    @property
    def world(self) -> int:
        return len(self.nodes)

    @property
    def spans_nodes(self) -> bool:
        return len(set(self.nodes)) > 1

    def link(self, machine: Machine, a: int, b: int) -> Link:
        return machine.intra if self.nodes[a] == self.nodes[b] else machine.inter

    def collective_link(self, machine: Machine) -> Link:
        return machine.inter if self.spans_nodes else machine.intra


@dataclass(frozen=True)
class StepTime:
    """Predicted times of one layer's step (ms, slowest rank): ``compute_ms`` is the kernels'
    share, ``comm_ms`` every transfer as if alone (hidden or not)."""

    fwd_ms: float
    bwd_ms: float
    compute_ms: float
    comm_ms: float

    @property
    def total_ms(self) -> float:
        return self.fwd_ms + self.bwd_ms

    @property
    def exposed_ms(self) -> float:
        """What the schedule adds over its kernels (exposed transfers, bookkeeping)."""
        return max(self.total_ms - self.compute_ms, 0.0)


@dataclass(frozen=True)
class Choice:
    """What ``auto`` picked and the predicted time of every alternative (name -> StepTime)."""

    name: str
    predicted: Mapping[str, StepTime] = field(hash=False)
    excluded: Mapping[str, str] = field(default_factory=dict, hash=False)

    def describe(self) -> str:
        ranked = sorted(self.predicted.items(), key=lambda kv: kv[1].total_ms)
        parts = [f"{n} {t.total_ms:.3g} (fwd {t.fwd_ms:.3g})" for n, t in ranked]
        out = f"{self.name}; predicted fwd+bwd ms: " + ", ".join(parts)
        if self.excluded:
            out += "; excluded: " + ", ".join(f"{n} ({why})" for n, why in self.excluded.items())
        return out


# ----------------------------------------------------------------------------- FLOPs
def linear_flops(shape: LinearShape) -> float:
    """fwd + bwd FLOPs of the chunked linear kernel on one rank: forward
    ``2·B·T·H·(2·K·V + C·(K + V))`` (states ``kᵀv``, output ``q·S``, the intra-chunk
    ``q·kᵀ`` and its product with ``v``, chunk C = 64), backward twice the forward."""
    s = shape
    return 3 * 2 * s.B * s.T_local * s.H * (2 * s.K * s.V + _CHUNK * (s.K + s.V))


def softmax_flops(B: int, H: int, rows: int, keys: int, D: int, causal_diag: bool) -> float:
    """Forward FLOPs of one attention call, ``4·B·H·D·rows·keys``; a bottom-right causal call
    skips the upper triangle of its last ``rows`` keys. Backward = 2.5 × forward (the benchmarks'
    convention)."""
    pairs = rows * keys - (rows * (rows - 1) / 2 if causal_diag else 0)
    return 4.0 * B * H * D * pairs


# ----------------------------------------------------------------------------- linear scans
def _combine_ms(machine: Machine, nbytes: float) -> float:
    """``A·x + b`` on one state: reads two, writes one."""
    k = machine.kernels
    return k.op_us * 1e-3 + 3 * nbytes / k.mem_gbps * 1e-6


def _msgs_ms(machine: Machine, world: int, msgs: int, shared: bool = True) -> float:
    """Host work of ``msgs`` point-to-point messages one rank posts (``Kernels.msg_us`` each):
    CPU time, so on shared cores (``shared``) it takes ``1 / compute_share`` as long."""
    t = msgs * machine.kernels.msg_us * 1e-3
    return t / machine.compute_share(world) if shared else t


def _scan_msgs_ms(machine: Machine, world: int, msgs: int, shared: bool = True) -> float:
    """``msgs`` element messages of a linear scan: the posting (``Kernels.msg_us``) and the
    scan's own host work per message (``Kernels.scan_msg_us``: packing and unpacking the
    element, the receive buffer, the schedule's bookkeeping)."""
    k = machine.kernels
    t = msgs * (k.msg_us + k.scan_msg_us) * 1e-3
    return t / machine.compute_share(world) if shared else t


@lru_cache(maxsize=4096)
def _scan_ms(schedule: str, world: int, layout: str, reverse: bool, S: int, machine: Machine,
             nodes: tuple[int, ...]) -> float:
    topo = Topology(nodes)
    L = num_chunks(world, layout)
    if L == 1:                                  # one leaf: nothing to scan
        return 0.0
    holder = [holder_of_leaf(scan_position(p, L, reverse), world, layout) for p in range(L)]
    share = machine.compute_share(world)
    if schedule == "ring":                      # a chain: every hop waits for the previous one
        t = 0.0
        for p in range(1, L):
            a, b = holder[p - 1], holder[p]
            t += _combine_ms(machine, S)
            if a != b:
                # the chain's two ends post one message each; nothing else waits on them
                t += topo.link(machine, a, b).p2p_ms(S) + _scan_msgs_ms(machine, world, 2, False)
        return t
    if schedule == "blelloch":
        sched = tree_scan_schedule(L)
        t = 0.0
        for i, pairs in enumerate(sched.up + sched.down):
            sent: dict[int, list] = {}
            ops: dict[int, int] = {}
            per = 1 if i < len(sched.up) else 2     # down-sweep pairs exchange both ways
            for pr in pairs:
                a, b = holder[pr.left], holder[pr.right]
                if a != b:
                    sent.setdefault(a, []).append(topo.link(machine, a, b))
                    sent.setdefault(b, []).append(topo.link(machine, a, b))
                    ops[a] = ops.get(a, 0) + per
                    ops[b] = ops.get(b, 0) + per
            comm = max((max(l.alpha_p2p_us for l in ls) * 1e-3
                        + len(ls) * S / min(l.p2p_gbps for l in ls) * 1e-6)
                       for ls in sent.values()) if sent else 0.0
            # ranks with no message in this round wait asleep: the cores go to the m that
            # take part (an up-sweep's upper levels pair few ranks)
            m = max(len(sent), 1)
            t += (comm / machine.comm_share(m)
                  + _combine_ms(machine, S) / machine.compute_share(m))
            if ops:                                 # the busiest rank's messages
                t += _scan_msgs_ms(machine, m, max(ops.values()))
        return t
    if schedule == "allgather":
        n = L // world
        link = topo.collective_link(machine)
        fold = (4 * machine.kernels.op_us * 1e-3 + machine.kernels.fold_us * 1e-3
                + (L + n) * S / machine.kernels.mem_gbps * 1e-6) / share
        comm = (link.collective_ms(world, (world - 1) * n * S) / machine.comm_share(world)
                if world > 1 else 0.0)
        return comm + fold + (_msgs_ms(machine, world, 2) if world > 1 else 0.0)
    raise ValueError(f"unknown linear scan {schedule!r}; use one of {LINEAR_SCANS}")


def linear_scan_ms(schedule: str, shape: LinearShape, world: int, layout: str,
                   machine: Machine, topology: Optional[Topology] = None,
                   reverse: bool = False) -> float:
    """Critical path (ms) of one scan of the states across ``world`` ranks (``reverse``: the
    backward's suffix scan)."""
    topo = topology or Topology.single_node(world)
    if topo.world != world:
        raise ValueError(f"topology has {topo.world} ranks but world={world}")
    return _scan_ms(schedule, world, layout, bool(reverse), shape.state_bytes, machine,
                    topo.nodes)


def linear_step(shape: LinearShape, world: int, layout: str, schedule: str, machine: Machine,
                topology: Optional[Topology] = None) -> StepTime:
    """Predicted fwd / bwd of :func:`~sp_attention.lightning_attention` on the slowest rank."""
    k = machine.kernels
    share = machine.compute_share(world)
    rank = (k.linear_rank_zigzag if layout == "zigzag" else
            1.0 if world == 1 else k.linear_rank_contiguous)
    kern = rank * (k.linear_call_ms + linear_flops(shape) / (k.linear_tflops * 1e9)) / share
    k_fwd = kern * k.linear_fwd_share
    k_bwd = kern - k_fwd
    s_fwd = linear_scan_ms(schedule, shape, world, layout, machine, topology, reverse=False)
    s_bwd = linear_scan_ms(schedule, shape, world, layout, machine, topology, reverse=True)
    if machine.scan_hidden:      # the suffix scan runs beside the chunk-state recomputation
        hide = 0.5 * k_fwd
        wire = 2 * shape.state_bytes / machine.intra.p2p_gbps * 1e-6
        bwd = k_bwd + max(s_bwd - hide, 0.0) + min(machine.overlap_cost * wire, hide)
    else:
        bwd = k_bwd + s_bwd
    return StepTime(k_fwd + s_fwd, bwd, kern, s_fwd + s_bwd)


# ----------------------------------------------------------------------------- softmax
def _ring_link(topo: Topology, machine: Machine) -> Link:
    """The slowest hop of the ring sets its pace."""
    P = topo.world
    links = [topo.link(machine, r, (r + 1) % P) for r in range(P)]
    return min(links, key=lambda l: l.p2p_gbps)


def _ring_compute(shape: SoftmaxShape, world: int, layout: str, machine: Machine,
                  rank: int, with_calls: bool = True) -> list[tuple[float, float]]:
    """(fwd, bwd) kernel ms of each ring step of ``rank`` (its calls from
    :func:`sp_attention.softmax.plan.ring_calls`); ``with_calls=False``: the FLOPs alone, without
    the calls' fixed costs (the all-gather schedules make their own calls)."""
    from .layout import ring_source
    from .softmax.plan import ring_calls
    k, s = machine.kernels, shape
    piece = s.T_local * world // num_chunks(world, layout)
    share = machine.compute_share(world)
    steps = []
    for step in range(world):
        f = 0.0
        calls = ring_calls(rank, ring_source(rank, world, step), world, layout, s.causal)
        for c in calls:
            f += softmax_flops(s.B, s.H, (c.q_stop - c.q_start) * piece, c.keys * piece, s.D,
                               c.causal)
        n = len(calls) if with_calls else 0
        steps.append(((n * k.softmax_call_ms + f / (k.softmax_fwd_tflops * 1e9)) / share,
                      (n * k.bwd_call_ms + 2.5 * f / (k.softmax_bwd_tflops * 1e9)) / share))
    return steps


def _overlapped(compute: float, comm: float, nbytes: float, machine: Machine) -> float:
    """A step whose transfer (``comm`` ms, moving ``nbytes``) overlaps its compute: the
    longer of the two, plus what moving the bytes beside the kernels costs them:
    ``Machine.overlap_cost`` ms per ms those bytes take at the node's own link rate (the
    communication kernels' SM and memory time, which a slower network link does not
    lengthen; latency alone costs nothing), at most the compute itself."""
    wire = nbytes / machine.intra.p2p_gbps * 1e-6
    return max(compute, comm) + min(machine.overlap_cost * wire, compute)


@dataclass(frozen=True)
class _Sched:
    """One schedule's half-step (forward or backward) on one rank: ms and its parts."""

    ms: float
    compute: float
    comm: float


def _ring(shape: SoftmaxShape, world: int, layout: str, machine: Machine, topo: Topology,
          rank: int) -> tuple[_Sched, _Sched]:
    k, s = machine.kernels, shape
    steps = _ring_compute(shape, world, layout, machine, rank)
    link = _ring_link(topo, machine)
    share = machine.compute_share(world)
    cshare = machine.comm_share(world)               # every rank sends and receives at once
    hop = link.p2p_ms(s.kv_bytes) / cshare
    add = (k.op_us * 1e-3 + 3 * s.B * s.T_local * s.H * s.D * s.itemsize / k.mem_gbps * 1e-6
           ) / share                            # one LSE merge / one dq accumulation
    wide = 8 if s.itemsize == 8 else 4
    kv_msgs = _msgs_ms(machine, world, 4)            # K and V, each sent and received
    fwd = bwd = comm_f = comm_b = 0.0
    for i, (cf, cb) in enumerate(steps):
        if i + 1 < world:   # the next block travels while this step computes
            # the accumulator of the block visited at step i - 1 (i >= 2) goes to its next
            # visitor: one kernel output (input dtype) after its first visit, fp32 sums later
            acc = 0.0 if i < 2 else s.kv_bytes * (1.0 if i == 2 else wide / s.itemsize)
            hop_b = link.p2p_ms(s.kv_bytes + acc) / cshare
            fwd += _overlapped(cf, hop, s.kv_bytes, machine) + kv_msgs
            # from step 1 on the dK/dV accumulators travel too
            bwd += _overlapped(cb, hop_b, s.kv_bytes + acc, machine) + kv_msgs * (2 if i else 1)
            comm_f += hop
            comm_b += hop_b
        else:
            fwd += cf
            bwd += cb
        if i:
            fwd += add
            bwd += add
    if world > 1:            # the last accumulator goes home with nothing left to hide it
        last = s.kv_bytes * (1.0 if world == 2 else wide / s.itemsize)
        home = link.p2p_ms(last)
        bwd += home + kv_msgs + (k.op_us * 1e-3 + 3 * last / k.mem_gbps * 1e-6) / share
        comm_b += home
    return (_Sched(fwd, sum(f for f, _ in steps), comm_f),
            _Sched(bwd, sum(b for _, b in steps), comm_b))


def _default_stride(shape: SoftmaxShape) -> int:
    from .softmax.schedule import default_heads_k_stride
    return default_heads_k_stride(shape.Hkv, shape.H // shape.Hkv)


def _allgather(shape: SoftmaxShape, world: int, layout: str, machine: Machine,
               topo: Topology, rank: int, stride: int) -> tuple[_Sched, _Sched]:
    k, s = machine.kernels, shape
    units = s.Hkv // stride
    steps = _ring_compute(shape, world, layout, machine, rank, with_calls=False)
    share = machine.compute_share(world)
    calls = num_chunks(world, layout) // world                 # one call per local chunk
    rate = k.softmax_ag_rate
    cf = (sum(f for f, _ in steps) / rate / units
          + calls * (k.softmax_call_ms + k.softmax_ag_call_fwd_ms) / share)
    cb = (sum(b for _, b in steps) / rate / units
          + calls * (k.bwd_call_ms + k.softmax_ag_call_bwd_ms) / share)
    link = topo.collective_link(machine)
    unit_kv = 2 * s.B * s.T_local * stride * s.D               # elements per rank and unit
    cshare = machine.comm_share(world)
    gather = link.collective_ms(world, (world - 1) * unit_kv * s.itemsize) / cshare
    scatter = link.collective_ms(world, (world - 1) * unit_kv * 4) / cshare
    g_bytes, s_bytes = (world - 1) * unit_kv * s.itemsize, (world - 1) * unit_kv * 4
    arrange = (k.op_us * 1e-3 + 2 * world * unit_kv * s.itemsize / k.mem_gbps * 1e-6) / share
    slot = (2 * k.op_us * 1e-3 + 2 * world * unit_kv * 4 / k.mem_gbps * 1e-6) / share
    post = _msgs_ms(machine, world, 2) if world > 1 else 0.0   # one collective call
    fwd = units * post + gather        # the first gather is exposed
    bwd = 2 * units * post + gather
    for i in range(units):
        nxt = gather if i + 1 < units else 0.0
        nxt_bytes = g_bytes if i + 1 < units else 0.0
        fwd += _overlapped(cf + arrange, nxt, nxt_bytes, machine)
        bwd += _overlapped(cb + arrange + slot, nxt + (scatter if i else 0.0),
                           nxt_bytes + (s_bytes if i else 0.0), machine)
    bwd += scatter                     # the last reduce-scatter is exposed
    # compute: the same kernel work at the full-width rate (what the ring's calls cost), so
    # the all-gather calls' own overheads count as what the schedule adds
    ring = _ring_compute(shape, world, layout, machine, rank)
    return (_Sched(fwd, sum(f for f, _ in ring), units * gather),
            _Sched(bwd, sum(b for _, b in ring), units * (gather + scatter)))


def softmax_step(shape: SoftmaxShape, world: int, layout: str, fwd: str, bwd: str,
                 machine: Machine, topology: Optional[Topology] = None,
                 heads_k_stride: Optional[int] = None) -> StepTime:
    """Predicted fwd / bwd of :func:`~sp_attention.context_parallel_attention` with schedules
    ``fwd`` and ``bwd`` (``"ring"`` / ``"allgather"``) on the slowest rank (zigzag: every rank
    alike; contiguous causal: the last)."""
    topo = topology or Topology.single_node(world)
    if topo.world != world:
        raise ValueError(f"topology has {topo.world} ranks but world={world}")
    stride = heads_k_stride or _default_stride(shape)
    if shape.Hkv % stride:
        raise ValueError(f"heads_k_stride={stride} must divide Hkv={shape.Hkv}")
    for name in (fwd, bwd):
        if name not in ("ring", "allgather"):
            raise ValueError(f"unknown softmax schedule {name!r}; use 'ring' or 'allgather'")
    rank = 0 if layout == "zigzag" or not shape.causal else world - 1
    parts = {}
    for name in {fwd, bwd}:
        parts[name] = (_ring(shape, world, layout, machine, topo, rank) if name == "ring" else
                       _allgather(shape, world, layout, machine, topo, rank, stride))
    f, b = parts[fwd][0], parts[bwd][1]
    return StepTime(f.ms, b.ms, f.compute + b.compute, f.comm + b.comm)


# ----------------------------------------------------------------------------- choices
_LINEAR_TIE_ORDER = ("allgather", "ring", "blelloch")
_SOFTMAX_TIE_ORDER = ("ring", "ring_ag", "allgather", "ag_ring")


def _pick(times: Mapping[str, StepTime], order: Sequence[str]) -> str:
    """Cheapest by total; exact ties go to the earlier name of ``order`` (deterministic, so
    every rank that predicts the same times picks the same schedule)."""
    return min(times, key=lambda n: (times[n].total_ms, order.index(n)))


def choose_linear_scan(shape: LinearShape, world: int, layout: str, machine: Machine,
                       topology: Optional[Topology] = None,
                       candidates: Sequence[str] = LINEAR_SCANS) -> Choice:
    """The scan ``impl="auto"`` runs: the cheapest predicted fwd + bwd of ``candidates``."""
    times = {c: linear_step(shape, world, layout, c, machine, topology) for c in candidates}
    return Choice(_pick(times, _LINEAR_TIE_ORDER), times)


def choose_softmax_preset(shape: SoftmaxShape, world: int, layout: str, machine: Machine,
                          topology: Optional[Topology] = None,
                          heads_k_stride: Optional[int] = None,
                          memory_limit_bytes: Optional[float] = None,
                          candidates: Sequence[str] = tuple(SOFTMAX_PRESETS)) -> Choice:
    """The preset ``preset="auto"`` runs: the cheapest predicted fwd + bwd of ``candidates``
    whose buffers (:func:`softmax_memory`) fit ``memory_limit_bytes`` (None: no limit).
    Raises ``ValueError`` if none fits."""
    times, excluded = {}, {}
    for name in candidates:
        f, b = SOFTMAX_PRESETS[name]
        if memory_limit_bytes is not None:
            need = softmax_memory(shape, world, layout, f, b, machine, heads_k_stride)["peak"]
            if need > memory_limit_bytes:
                excluded[name] = f"needs {need / 2**30:.2f} GiB"
                continue
        times[name] = softmax_step(shape, world, layout, f, b, machine, topology,
                                   heads_k_stride)
    if not times:
        raise ValueError("no softmax preset fits memory_limit_bytes="
                         f"{memory_limit_bytes}: {excluded}; use fewer tokens per rank")
    return Choice(_pick(times, _SOFTMAX_TIE_ORDER), times, excluded)


_LOGGED: set = set()


def log_choice(kind: str, key: tuple, choice: Choice, machine: Machine) -> bool:
    """Log ``choice`` once per ``(kind, key)`` (a layer shape) at INFO on the
    ``sp_attention.cost`` logger, with the predicted time of every alternative; True when it
    logged."""
    if (kind, key) in _LOGGED:
        return False
    _LOGGED.add((kind, key))
    logger.info("auto %s for %s on %s [%s]: %s", kind, key, machine.name, machine.source,
                choice.describe())
    return True


def cp_efficiency(t: StepTime) -> float:
    """The step's kernel time ÷ its time: per-GPU throughput of the CP step relative to the
    same kernels doing the same per-GPU work on one device (the benchmarks' ratio)."""
    return t.compute_ms / t.total_ms if t.total_ms else 1.0


# ----------------------------------------------------------------------------- memory
def linear_memory(shape: LinearShape, world: int, layout: str, schedule: str) -> dict:
    """Working memory (bytes) of one fwd + bwd of the linear op on a rank, inputs excluded.

    Kernel part (fla's backward, the peak): the output ``o`` the caller keeps, chunk states
    ``h`` and their gradients ``dh`` (fp32, ``[B, T/64, H, K, V]`` each) and ``dq, dk, dv``.
    CP part: ``S_in`` per leaf saved for backward, ``G`` per leaf, and the scan's temporaries
    (ring: two states; tree: one per leaf and two; all-gather: every rank's elements and the
    fold's weights), alive while the chunk states are recomputed, before ``dh`` exists.
    """
    s = shape
    n = num_chunks(world, layout) // world
    rows = s.B * s.T_local * s.H
    chunks = n * -(-(s.T_local // n) // _CHUNK)
    states = s.B * chunks * s.H * s.K * s.V * 4
    state = s.state_bytes
    L = n * world
    scan = {"ring": 2 * state, "blelloch": (n + 2) * state,
            "allgather": (world * n + n) * state + n * L * s.B * s.H * 4}[schedule]
    out = {"o": rows * s.V * s.itemsize, "h": states, "dh": states,
           "dq_dk_dv": rows * (2 * s.K + s.V) * s.itemsize, "S_in": n * state, "G": n * state,
           "scan": scan}
    out["peak"] = max(out["o"] + out["h"] + out["S_in"] + scan,
                      sum(v for k, v in out.items() if k != "scan"))
    return out


def _call_bwd_bytes(s: SoftmaxShape, rows: int, keys: int, heads: int, machine: Machine) -> float:
    """One kernel backward over ``rows`` queries and ``keys`` keys of ``heads`` query heads:
    dq, dk, dv and the kernel's workspace (``Kernels.softmax_bwd_workspace`` bytes per query
    element, half of it counted per key element: fitted to cuDNN's peaks on an H200)."""
    kv_heads = heads * s.Hkv // s.H
    ws = machine.kernels.softmax_bwd_workspace / 2
    return s.B * (rows * heads * s.D * (s.itemsize + ws) + keys * heads * s.D * ws
                  + 2 * keys * kv_heads * s.D * s.itemsize)


def softmax_memory(shape: SoftmaxShape, world: int, layout: str, fwd: str, bwd: str,
                   machine: Machine, heads_k_stride: Optional[int] = None) -> dict:
    """Working memory (bytes) of one fwd + bwd on a rank: the larger of the forward's and
    the backward's peak, inputs and the saved ``out``/LSE excluded (the schedule's buffers:
    K/V ring slots, accumulators in flight, gathered strides, fp32 reduce-scatter slots)."""
    s = shape
    wide = 8 if s.itemsize == 8 else 4
    q_bytes = s.B * s.T_local * s.H * s.D * s.itemsize
    lse = s.B * s.H * s.T_local * wide
    out = {}
    if fwd == "ring":
        slots = min(2, world - 1) * s.kv_bytes
        acc = (q_bytes * wide / s.itemsize + lse) if world > 2 else 0
        out["fwd"] = slots + acc + q_bytes + lse
    else:        # out, LSE, send / receive buffers and the arrangement scratch
        stride = heads_k_stride or _default_stride(s)
        unit = 2 * s.B * s.T_local * stride * s.D * s.itemsize
        out["fwd"] = 2 * unit + 3 * world * unit + 2 * (q_bytes + lse)
    if bwd == "ring":
        slots = min(2, world - 1) * s.kv_bytes
        in_flight = 2 * s.kv_bytes * wide / s.itemsize if world > 2 else 0
        dq_acc = q_bytes * wide / s.itemsize if world > 2 else 0
        first = _call_bwd_bytes(s, s.T_local, s.T_local, s.H, machine)
        later = 0.0 if world == 1 else (
            q_bytes + dq_acc + s.kv_bytes + in_flight
            + _call_bwd_bytes(s, s.T_local, s.T_local // 2 if layout == "zigzag"
                              else s.T_local, s.H, machine))
        out["bwd"] = slots + max(first, later)
    else:
        # dq, the fp32 dK/dV sums, two send and two receive buffers of the widest unit, the
        # arrangement scratch, two fp32 reduce-scatter slots; then the unit's calls: each
        # keeps its dK/dV until the unit scatters them, and the kernel gets contiguous copies
        # of its strided head slices of q, dout and out
        stride = heads_k_stride or _default_stride(s)
        unit = 2 * s.B * s.T_local * stride * s.D                  # one rank's unit, elements
        heads = stride * s.H // s.Hkv
        per_chunk = s.T_local * world // num_chunks(world, layout)
        keys = s.T_local * world - per_chunk
        calls = num_chunks(world, layout) // world
        held = (q_bytes + s.kv_bytes * wide / s.itemsize + 2 * unit * s.itemsize
                + 3 * world * unit * s.itemsize + 2 * world * unit * wide)
        parts = 2 * s.B * (calls * keys) * stride * s.D * s.itemsize
        copies = 3 * s.B * per_chunk * heads * s.D * s.itemsize
        out["bwd"] = held + parts + copies + _call_bwd_bytes(s, per_chunk, keys, heads,
                                                             machine)
    out["peak"] = max(out["fwd"], out["bwd"])
    return out


def rank_memory(attention_bytes: float, model=None) -> dict:
    """Per-rank total of a TP × CP × DP layout: the attention schedule's working memory (per
    layer, from :func:`linear_memory` / :func:`softmax_memory` with the rank's shapes: heads
    ÷ TP, tokens ÷ CP, micro-batch; layers run one at a time) with the model-level estimate
    ``model``: an :class:`sp_attention.memory.MemoryEstimate` (weights, gradients, optimizer
    states, activations by recompute setting, loss, and ``workspace``, the largest transient
    of one layer's backward), a mapping with ``total`` (and optionally ``workspace``), or a
    number of bytes. The schedule's buffers are such a transient too, so the peak takes the
    larger of the two rather than their sum. Returns ``{"attention", "model", "total"}``."""
    if model is None:
        total, workspace = 0.0, 0.0
    elif isinstance(model, (int, float)):
        total, workspace = float(model), 0.0
    elif isinstance(model, Mapping):
        total, workspace = float(model["total"]), float(model.get("workspace", 0.0))
    else:
        total, workspace = float(model.total), float(getattr(model, "workspace", 0.0))
    attention = float(attention_bytes)
    return {"attention": attention, "model": total,
            "total": total - workspace + max(workspace, attention)}

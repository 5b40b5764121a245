"""Softmax attention's schedules (ring, all-gather; forward and backward) and the layer step
built on them (:func:`softmax_step`); the formulas are in :mod:`sp_attention.cost`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..planning.layout import num_chunks, ring_source
from ..planning.schedules import PRESETS, default_heads_k_stride
from ..planning.softmax_plan import gather_plan, ring_calls
from .common import SoftmaxShape, StepTime, Topology, softmax_kernel_ms
from .machine import Link, Machine

# The schedules the model has formulas for (forward and backward alike).
MODELLED = ("ring", "allgather")


def modelled_presets() -> tuple[str, ...]:
    """The presets of :data:`~sp_attention.planning.schedules.PRESETS` whose pair the model
    can predict: ``auto``'s candidates (a preset without a formula is never picked)."""
    return tuple(n for n, pair in PRESETS.items() if all(x in MODELLED for x in pair))


def _ring_link(topo: Topology, machine: Machine) -> Link:
    """The slowest hop of the ring sets its pace."""
    P = topo.world
    links = [topo.link(machine, r, (r + 1) % P) for r in range(P)]
    return min(links, key=lambda l: l.p2p_gbps)


def _calls_ms(shape: SoftmaxShape, calls, piece: int, machine: Machine) -> tuple[float, float]:
    """(fwd, bwd) kernel ms of attention ``calls`` (plan ``Call``s over pieces of ``piece``
    tokens) on one rank alone, without their fixed costs."""
    s, f, b = shape, 0.0, 0.0
    for c in calls:
        cf, cb = softmax_kernel_ms(machine, s.B, s.H, (c.q_stop - c.q_start) * piece,
                                   c.keys * piece, s.D, c.causal)
        f, b = f + cf, b + cb
    return f, b


def _ring_compute(shape: SoftmaxShape, world: int, layout: str, machine: Machine,
                  rank: int) -> list[tuple[float, float]]:
    """(fwd, bwd) kernel ms of each ring step of ``rank`` (its calls from
    :func:`sp_attention.planning.softmax_plan.ring_calls`), the calls' fixed costs included."""
    k, s = machine.kernels, shape
    piece = s.T_local * world // num_chunks(world, layout)
    steps = []
    for step in range(world):
        calls = ring_calls(rank, ring_source(rank, world, step), world, layout, s.causal)
        f, b = _calls_ms(s, calls, piece, machine)
        n = len(calls)
        steps.append((n * k.softmax_call_ms + f, n * k.softmax_call_ms + b))
    return steps


def _gather_compute(shape: SoftmaxShape, world: int, layout: str, machine: Machine,
                    rank: int) -> tuple[float, float]:
    """(fwd, bwd) kernel ms of the all-gather schedules' calls on ``rank``, all heads, without
    the calls' fixed costs: one call per local chunk against its arranged prefix of keys
    (:func:`sp_attention.planning.softmax_plan.gather_plan`; a bottom-right causal call where
    the chunk's own diagonal is among them)."""
    n = num_chunks(world, layout)
    plan = gather_plan(rank, world, layout, 1, 0, n // world, shape.causal)
    return _calls_ms(shape, plan.calls, shape.T_local * world // n, machine)


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
    hop = link.p2p_ms(s.kv_bytes)
    add = (k.op_us * 1e-3 + 3 * s.B * s.T_local * s.H * s.D * s.itemsize / k.mem_gbps * 1e-6
           )                                    # one LSE merge / one dq accumulation
    wide = 8 if s.itemsize == 8 else 4
    fwd = bwd = comm_f = comm_b = 0.0
    for i, (cf, cb) in enumerate(steps):
        if i + 1 < world:   # the next block travels while this step computes
            # the accumulator of the block visited at step i - 1 (i >= 2) goes to its next
            # visitor: one kernel output (input dtype) after its first visit, fp32 sums later
            acc = 0.0 if i < 2 else s.kv_bytes * (1.0 if i == 2 else wide / s.itemsize)
            hop_b = link.p2p_ms(s.kv_bytes + acc)
            fwd += _overlapped(cf, hop, s.kv_bytes, machine)
            # from step 1 on the dK/dV accumulators travel too
            bwd += _overlapped(cb, hop_b, s.kv_bytes + acc, machine)
            comm_f += hop
            comm_b += hop_b
        else:
            fwd += cf
            bwd += cb
        if i:
            fwd += add
            bwd += add
    steps_f, steps_b = sum(f for f, _ in steps), sum(b for _, b in steps)
    if world > 1:            # the last accumulator goes home with nothing left to hide it
        last = s.kv_bytes * (1.0 if world == 2 else wide / s.itemsize)
        home = link.p2p_ms(last)
        bwd += home + k.op_us * 1e-3 + 3 * last / k.mem_gbps * 1e-6
        comm_b += home
    return _Sched(fwd, steps_f, comm_f), _Sched(bwd, steps_b, comm_b)


def _allgather(shape: SoftmaxShape, world: int, layout: str, machine: Machine,
               topo: Topology, rank: int, stride: int) -> tuple[_Sched, _Sched]:
    k, s = machine.kernels, shape
    units = s.Hkv // stride
    kf, kb = _gather_compute(shape, world, layout, machine, rank)
    calls = num_chunks(world, layout) // world                 # one call per local chunk
    rate = k.softmax_ag_rate
    cf = kf / rate / units + calls * (k.softmax_call_ms + k.softmax_ag_call_fwd_ms)
    cb = kb / rate / units + calls * (k.softmax_call_ms + k.softmax_ag_call_bwd_ms)
    link = topo.collective_link(machine)
    unit_kv = 2 * s.B * s.T_local * stride * s.D               # elements per rank and unit
    g_bytes, s_bytes = (world - 1) * unit_kv * s.itemsize, (world - 1) * unit_kv * 4
    gather = link.collective_ms(world, g_bytes)
    scatter = link.collective_ms(world, s_bytes)
    arrange = k.op_us * 1e-3 + 2 * world * unit_kv * s.itemsize / k.mem_gbps * 1e-6
    slot = 2 * k.op_us * 1e-3 + 2 * world * unit_kv * 4 / k.mem_gbps * 1e-6
    fwd = bwd = gather                 # the first gather is exposed
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
    stride = heads_k_stride or default_heads_k_stride(shape.Hkv, shape.H // shape.Hkv)
    if shape.Hkv % stride:
        raise ValueError(f"heads_k_stride={stride} must divide Hkv={shape.Hkv}")
    for name in (fwd, bwd):
        if name not in MODELLED:
            raise ValueError(f"the cost model has no formula for the softmax schedule "
                             f"{name!r}; it predicts {MODELLED}")
    rank = 0 if layout == "zigzag" or not shape.causal else world - 1
    parts = {}
    for name in {fwd, bwd}:
        parts[name] = (_ring(shape, world, layout, machine, topo, rank) if name == "ring" else
                       _allgather(shape, world, layout, machine, topo, rank, stride))
    f, b = parts[fwd][0], parts[bwd][1]
    return StepTime(f.ms, b.ms, f.compute + b.compute, f.comm + b.comm)

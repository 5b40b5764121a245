"""Softmax attention's schedules (ring, all-gather; forward and backward) and the layer step
built on them (:func:`softmax_step`); the formulas are in :mod:`sp_attention.cost`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..layout import num_chunks
from ..machine import Link, Machine
from .common import (SoftmaxShape, StepTime, Topology, _msg_work_ms, _msgs_ms,
                     softmax_kernel_ms, work_bound)


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
    :func:`sp_attention.softmax.plan.ring_calls`), the calls' fixed costs included."""
    from ..layout import ring_source
    from ..softmax.plan import ring_calls
    k, s = machine.kernels, shape
    piece = s.T_local * world // num_chunks(world, layout)
    share = machine.compute_share(world)
    steps = []
    for step in range(world):
        calls = ring_calls(rank, ring_source(rank, world, step), world, layout, s.causal)
        f, b = _calls_ms(s, calls, piece, machine)
        n = len(calls)
        steps.append(((n * k.softmax_call_ms + f) / share, (n * k.bwd_call_ms + b) / share))
    return steps


def _gather_compute(shape: SoftmaxShape, world: int, layout: str, machine: Machine,
                    rank: int) -> tuple[float, float]:
    """(fwd, bwd) kernel ms of the all-gather schedules' calls on ``rank``, all heads, without
    the calls' fixed costs: one call per local chunk against its arranged prefix of keys
    (:func:`sp_attention.softmax.plan.gather_plan`; a bottom-right causal call where the
    chunk's own diagonal is among them)."""
    from ..softmax.plan import gather_plan
    n = num_chunks(world, layout)
    share = machine.compute_share(world)
    f, b = _calls_ms(shape, gather_plan(rank, world, layout, 1, 0, n // world,
                                        shape.causal).calls,
                     shape.T_local * world // n, machine)
    return f / share, b / share


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
    """One schedule's half-step (forward or backward) on one rank: ms and its parts (``work``:
    the rank's CPU work, see :func:`~.common.work_bound`)."""

    ms: float
    compute: float
    comm: float
    work: float = 0.0


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
    wire_f = wire_b = 0.0                            # bytes this rank sends, at the link rate
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
            wire_f += link.p2p_ms(s.kv_bytes) - link.p2p_ms(0)
            wire_b += link.p2p_ms(s.kv_bytes + acc) - link.p2p_ms(0)
        else:
            fwd += cf
            bwd += cb
        if i:
            fwd += add
            bwd += add
    # the rank's CPU work: all of the above but the transfers' latency and their overlap
    # charge (the bytes count once, at the link rate), at the rank's rate beside the others
    core = machine.core_share(world)
    steps_f, steps_b = sum(f for f, _ in steps), sum(b for _, b in steps)
    n_hops = world - 1
    kv_work = _msg_work_ms(machine, 4, world)
    work_f = (steps_f + n_hops * add) * core + n_hops * kv_work + wire_f
    work_b = (steps_b + n_hops * add) * core + (2 * n_hops - 1) * kv_work + wire_b
    if world > 1:            # the last accumulator goes home with nothing left to hide it
        last = s.kv_bytes * (1.0 if world == 2 else wide / s.itemsize)
        home = link.p2p_ms(last)
        merge = (k.op_us * 1e-3 + 3 * last / k.mem_gbps * 1e-6) / share
        bwd += home + kv_msgs + merge
        comm_b += home
        work_b += merge * core + kv_work + home - link.p2p_ms(0)
    return (_Sched(fwd, steps_f, comm_f, work_f), _Sched(bwd, steps_b, comm_b, work_b))


def _default_stride(shape: SoftmaxShape) -> int:
    from ..softmax.schedule import default_heads_k_stride
    return default_heads_k_stride(shape.Hkv, shape.H // shape.Hkv)


def _allgather(shape: SoftmaxShape, world: int, layout: str, machine: Machine,
               topo: Topology, rank: int, stride: int) -> tuple[_Sched, _Sched]:
    k, s = machine.kernels, shape
    units = s.Hkv // stride
    kf, kb = _gather_compute(shape, world, layout, machine, rank)
    share = machine.compute_share(world)
    calls = num_chunks(world, layout) // world                 # one call per local chunk
    rate = k.softmax_ag_rate
    cf = kf / rate / units + calls * (k.softmax_call_ms + k.softmax_ag_call_fwd_ms) / share
    cb = kb / rate / units + calls * (k.bwd_call_ms + k.softmax_ag_call_bwd_ms) / share
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
    # the rank's CPU work: its calls and arrangements, each collective as one message sent
    # and one received (the rank posts it and waits once; the backend passes the pieces on
    # without waking it), and the bytes it receives (gather) or sends (reduce-scatter) at the
    # collective rate; the collectives' latency is no work (a waiting rank frees its core)
    core = machine.core_share(world)
    coll = 1e-6 / link.coll_gbps if world > 1 else 0.0
    msgs = _msg_work_ms(machine, 2, world) if world > 1 else 0.0
    work_f = units * ((cf + arrange) * core + msgs + g_bytes * coll)
    work_b = units * ((cb + arrange + slot) * core + 2 * msgs + (g_bytes + s_bytes) * coll)
    return (_Sched(fwd, sum(f for f, _ in ring), units * gather, work_f),
            _Sched(bwd, sum(b for _, b in ring), units * (gather + scatter), work_b))


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
    # the work-conserving bound (shared cores only): zigzag ranks all do this rank's work; a
    # contiguous causal group does less in all, but its last rank's path is the longer one
    w_f, w_b = work_bound(machine, world, f.work), work_bound(machine, world, b.work)
    return StepTime(max(f.ms, w_f), max(b.ms, w_b), f.compute + b.compute, f.comm + b.comm,
                    w_f + w_b)

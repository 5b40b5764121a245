"""Linear attention's scans across ranks and the layer step built on them
(:func:`linear_scan_ms`, :func:`linear_step`); the formulas are in :mod:`sp_attention.cost`."""
from __future__ import annotations

from functools import lru_cache
from typing import Optional

from ..planning.layout import (holder_of_leaf, nested_ranks, num_chunks, scan_position,
                               tree_scan_rounds)
from ..planning import linear_rows
from ..planning.schedules import LINEAR_SCANS
from .common import LinearShape, StepTime, Topology, combine_ms, linear_flops
from .machine import Machine


def _ring_ms(holder: list, S: int, machine: Machine, topo: Topology) -> float:
    """A chain: every hop waits for the previous one (a combine, then the hop if it crosses
    ranks)."""
    t = 0.0
    for p in range(1, len(holder)):
        a, b = holder[p - 1], holder[p]
        t += combine_ms(machine, S)
        if a != b:
            t += topo.link(machine, a, b).p2p_ms(S)
    return t


def _tree_ms(holder: list, S: int, machine: Machine, topo: Topology) -> float:
    """The rounds of :func:`~sp_attention.planning.layout.tree_scan_rounds` (2⌈log2 L⌉ − 1;
    the zigzag pattern: over its P ranks, three scans in each round,
    :func:`~sp_attention.planning.layout.nested_ranks`); a round costs one α plus its busiest
    rank's bytes (``S`` per pair it takes part in: links are full duplex, so a down pair's two
    ways cost one) and a combine."""
    P = nested_ranks(tuple(holder))
    scans = ([list(range(P)), list(range(P - 1, -1, -1)), list(range(P - 1, -1, -1))] if P
             else [holder])
    t = 0.0
    for pairs in tree_scan_rounds(P or len(holder)):
        sent: dict[int, list] = {}
        for h in scans:
            for pr, _ in pairs:
                a, b = h[pr.left], h[pr.right]
                if a != b:
                    sent.setdefault(a, []).append(topo.link(machine, a, b))
                    sent.setdefault(b, []).append(topo.link(machine, a, b))
        comm = max((max(l.alpha_p2p_us for l in ls) * 1e-3
                    + len(ls) * S / min(l.p2p_gbps for l in ls) * 1e-6)
                   for ls in sent.values()) if sent else 0.0
        t += comm + combine_ms(machine, S)
    return t


@lru_cache(maxsize=4096)
def _scan_ms(schedule: str, world: int, layout: str, reverse: bool, S: int, machine: Machine,
             nodes: tuple[int, ...]) -> float:
    if schedule not in LINEAR_SCANS:
        raise ValueError(f"unknown linear scan {schedule!r}; use one of {LINEAR_SCANS}")
    topo = Topology(nodes)
    L = num_chunks(world, layout)
    if L == 1:                                  # one leaf: nothing to scan
        return 0.0
    holder = [holder_of_leaf(scan_position(p, L, reverse), world, layout) for p in range(L)]
    if schedule == "ring":
        return _ring_ms(holder, S, machine, topo)
    if schedule == "blelloch":
        return _tree_ms(holder, S, machine, topo)
    n = L // world                              # allgather: one collective, a local fold
    k = machine.kernels
    fold = 4 * k.op_us * 1e-3 + (L + n) * S / k.mem_gbps * 1e-6
    comm = (topo.collective_link(machine).collective_ms(world, (world - 1) * n * S)
            if world > 1 else 0.0)
    return comm + fold


def linear_scan_ms(schedule: str, shape: LinearShape, world: int, layout: str,
                   machine: Machine, topology: Optional[Topology] = None,
                   reverse: bool = False) -> float:
    """Time (ms) of one scan of the states across ``world`` ranks (``reverse``: the
    backward's suffix scan)."""
    topo = topology or Topology.single_node(world)
    if topo.world != world:
        raise ValueError(f"topology has {topo.world} ranks but world={world}")
    return _scan_ms(schedule, world, layout, bool(reverse), shape.state_bytes, machine,
                    topo.nodes)


def rank_factor(shape: LinearShape, world: int, layout: str, sms: int = 132,
                requested: Optional[int] = None) -> str:
    """The :class:`~sp_attention.cost.machine.Kernels` field of a CP rank's kernel factor:
    ``linear_rank_contiguous`` where the rank runs its tokens as one row,
    ``linear_rank_zigzag`` where as several (zigzag's two leaves, or a leaf split into rows
    by the op's rule, :func:`sp_attention.planning.linear_rows.row_splits`, fixed rates;
    ``requested``: ``LinearTuning.row_splits``, None for the rule)."""
    n = 2 if layout == "zigzag" else 1
    m = linear_rows.row_splits(requested, shape.B * n, shape.T_local // n, shape.H, shape.K, shape.V, sms)
    return "linear_rank_contiguous" if n * m == 1 else "linear_rank_zigzag"


def linear_step(shape: LinearShape, world: int, layout: str, schedule: str, machine: Machine,
                topology: Optional[Topology] = None,
                row_splits: Optional[int] = None) -> StepTime:
    """Predicted fwd / bwd of :func:`~sp_attention.lightning_attention` on the slowest rank:
    the forward's scan is exposed (the output kernel needs ``S_in``); the backward's suffix
    scan runs on a side stream beside the chunk-state recomputation (half the forward
    kernel), its bytes costing the kernels ``overlap_cost``. ``row_splits``: the op's
    ``LinearTuning.row_splits`` (None: its rule)."""
    k = machine.kernels
    rank = (1.0 if world == 1 else      # one rank: the kernel itself, as calibrated
            getattr(k, rank_factor(shape, world, layout, k.sms, row_splits)))
    kern = rank * (k.linear_call_ms + linear_flops(shape) / (k.linear_tflops * 1e9))
    k_fwd = kern * k.linear_fwd_share
    k_bwd = kern - k_fwd
    s_fwd = linear_scan_ms(schedule, shape, world, layout, machine, topology, reverse=False)
    s_bwd = linear_scan_ms(schedule, shape, world, layout, machine, topology, reverse=True)
    hide = 0.5 * k_fwd
    wire = 2 * shape.state_bytes / machine.intra.p2p_gbps * 1e-6
    bwd = k_bwd + max(s_bwd - hide, 0.0) + min(machine.overlap_cost * wire, hide)
    return StepTime(k_fwd + s_fwd, bwd, kern, s_fwd + s_bwd)

"""Linear attention's scans across ranks and the layer step built on them
(:func:`linear_scan_ms`, :func:`linear_step`); the formulas are in :mod:`sp_attention.cost`."""
from __future__ import annotations

from functools import lru_cache
from typing import Optional

from ..layout import holder_of_leaf, num_chunks, scan_position, tree_scan_schedule
from ..machine import Machine
from .common import (LINEAR_SCANS, LinearShape, StepTime, Topology, _combine_ms, _msg_work_ms,
                     _msgs_ms, linear_flops, side_by_side, work_bound)


def _scan_msgs_ms(machine: Machine, world: int, msgs: int, shared: bool = True) -> float:
    """``msgs`` element messages of a linear scan: the posting (``Kernels.msg_us``) and the
    scan's own host work per message (``Kernels.scan_msg_us``: packing and unpacking the
    element, the receive buffer, the schedule's bookkeeping)."""
    k = machine.kernels
    t = msgs * (k.msg_us + k.scan_msg_us) * 1e-3
    return t / machine.compute_share(world) if shared else t


def _round_messages(holder: list, pairs, down: bool) -> set:
    """The messages ``(sender, receiver)`` of one tree round: one per peer and direction, the
    elements a rank sends one peer packed in one buffer (``linear/scan_blelloch.py``); a
    down-sweep pair exchanges both ways."""
    msgs = set()
    for pr in pairs:
        a, b = holder[pr.left], holder[pr.right]
        if a != b:
            msgs.add((a, b))
            if down:
                msgs.add((b, a))
    return msgs


def _busy(holder: list, world: int, ends: set, done_after: dict, now: int) -> int:
    """Ranks competing for the cores at step ``now`` of a scan: ``ends`` (the ranks that act
    in it) and every rank whose last step came before ``now`` (it has all its prefixes and
    goes on with its step); the others wait asleep for a later message and free their core."""
    return min(world, len(ends | {r for r, last in done_after.items() if last < now}))


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
        last = {r: p for p, r in enumerate(holder)}     # a rank's last position
        t = 0.0
        for p in range(1, L):
            a, b = holder[p - 1], holder[p]
            # the chain's CPU work (combine, posting) shares the cores with the two ends and
            # the ranks it has passed; its latency is no work
            m = _busy(holder, world, {a, b}, last, p - 1)
            t += _combine_ms(machine, S) / machine.compute_share(m)
            if a != b:
                t += topo.link(machine, a, b).p2p_ms(S) + _scan_msgs_ms(machine, m, 2)
        return t
    if schedule == "blelloch":
        sched = tree_scan_schedule(L)
        rounds = sched.up + sched.down
        last = {}                               # a rank's last round
        for i, pairs in enumerate(rounds):
            for pr in pairs:
                last[holder[pr.left]] = last[holder[pr.right]] = i
        t = 0.0
        for i, pairs in enumerate(rounds):
            sent: dict[int, list] = {}
            msgs = _round_messages(holder, pairs, down=i >= len(sched.up))
            ops: dict[int, int] = {}                # messages a rank posts: one per peer and
            for a, b in msgs:                       # direction (its elements travel packed)
                ops[a] = ops.get(a, 0) + 1
                ops[b] = ops.get(b, 0) + 1
            for pr in pairs:
                a, b = holder[pr.left], holder[pr.right]
                if a != b:
                    sent.setdefault(a, []).append(topo.link(machine, a, b))
                    sent.setdefault(b, []).append(topo.link(machine, a, b))
            comm = max((max(l.alpha_p2p_us for l in ls) * 1e-3
                        + len(ls) * S / min(l.p2p_gbps for l in ls) * 1e-6)
                       for ls in sent.values()) if sent else 0.0
            # the ranks with a message in this round share the cores with the ranks already
            # through the tree; the others wait asleep (an up-sweep's upper levels pair few)
            m = max(_busy(holder, world, set(sent), last, i), 1)
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


@lru_cache(maxsize=4096)
def _scan_work_ms(schedule: str, world: int, layout: str, reverse: bool, S: int,
                  machine: Machine) -> float:
    """CPU work of one scan summed over the ranks (ms at a rank's rate beside the others):
    every message end a rank handles (the scan's own ``scan_msg_us`` and the message's CPU,
    :func:`~.common._msg_work_ms`), each message's bytes once at the link's rate (on a CPU the
    link is the cores: gloo copies through them), every combine; the all-gather: each rank's
    collective (one message sent and received: it waits once), the bytes it receives and its
    fold.
    Latency is no work: a rank waiting for a message frees its core."""
    L = num_chunks(world, layout)
    if L == 1:
        return 0.0
    k = machine.kernels
    holder = [holder_of_leaf(scan_position(p, L, reverse), world, layout) for p in range(L)]
    post = k.scan_msg_us * 1e-3 + _msg_work_ms(machine, 1, world)
    wire = S / machine.intra.p2p_gbps * 1e-6
    side = side_by_side(machine, world)
    if schedule == "ring":
        hops = sum(holder[p - 1] != holder[p] for p in range(1, L))
        return side * (hops * 2 * post + (L - 1) * _combine_ms(machine, S)) + hops * wire
    if schedule == "blelloch":
        sched = tree_scan_schedule(L)
        t = 0.0
        for i, pairs in enumerate(sched.up + sched.down):
            down = i >= len(sched.up)
            elements = sum(holder[pr.left] != holder[pr.right] for pr in pairs) * (1 + down)
            t += (side * (len(pairs) * _combine_ms(machine, S)
                          + 2 * post * len(_round_messages(holder, pairs, down)))
                  + elements * wire)
        return t
    if schedule == "allgather":
        n = L // world
        fold = (4 * k.op_us * 1e-3 + k.fold_us * 1e-3
                + (L + n) * S / k.mem_gbps * 1e-6 + _msg_work_ms(machine, 2, world))
        recv = (world - 1) * n * S / machine.intra.coll_gbps * 1e-6
        return world * (side * fold + recv)
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
    # the work-conserving bound (shared cores only): every rank's kernels and scan work
    core = machine.core_share(world)     # a shared kernel time -> one rank's work beside the others
    w_fwd = work_bound(machine, world, k_fwd * core + _scan_work_ms(
        schedule, world, layout, False, shape.state_bytes, machine) / world)
    w_bwd = work_bound(machine, world, k_bwd * core + _scan_work_ms(
        schedule, world, layout, True, shape.state_bytes, machine) / world)
    return StepTime(max(k_fwd + s_fwd, w_fwd), max(bwd, w_bwd), kern, s_fwd + s_bwd,
                    w_fwd + w_bwd)

"""The all-to-all softmax schedules in the cost model: ``a2a`` (Ulysses) and ``a2a_ring``
(all-to-all inside groups of U consecutive ranks, ring across the ``R = P / U`` groups), as
:mod:`sp_attention.softmax.a2a` runs them.

Per exchange (one ``all_to_all_single`` over the U ranks of a group, which sit on the nodes
the topology says): ``α + (U − 2)·step + (U − 1)/U · bytes / β`` (the collective figures of the
link the group spans), plus packing the send buffer and unpacking the receive buffer (two
element-wise passes, read + write each, at ``Kernels.mem_gbps``). Bytes per rank, elements of
one shard's rows ``B·T_local·D`` times:

* forward: K and V ``2·n·U`` (``n`` KV heads per position: ``Hkv / U``, or the replicated
  heads, :func:`sp_attention.planning.softmax_a2a.head_split`), Q ``H``, out ``H`` — with
  ``Hkv % U == 0``: ``(U−1)/U · B·T_local·D · (2H + 2Hkv)``;
* backward: dout ``H``, dK/dV ``2·n·U`` (fp32 where the kernel took K/V expanded), dq ``H``.

With ``C`` head chunks (:func:`sp_attention.planning.softmax_a2a.head_chunks`: the tuning's,
else the default) the wire time ``W`` of a direction's exchanges overlaps the inner schedule's
``S``: only the first chunk's inputs and the last one's output wait in the open, and the middle
chunks' exchanges show where they outlast their kernels: ``W / C + max(S, W·(C − 1) / C)``
(``C = 1``: ``W + S``; the copies stay on the compute stream). The NCCL kernels' share of the
SMs and memory beside the kernel is not modelled, so ``C > 1`` is optimistic: on NVLink it
measured slower than one chunk (:attr:`sp_attention.tuning.SoftmaxTuning.a2a_head_chunks`),
which is why the default and ``auto``'s figures use one. Then the inner schedule on the head
shard: the kernel on the group's ``U·T_local`` tokens with ``H / U`` query heads, which for
``R = 1`` is the whole causal sequence, and for ``R > 1`` today's ring across the groups
(:func:`.softmax.softmax_step` with ``"ring"``/``"ring"`` on the shard shape, over the ring's
ranks in the topology).
"""
from __future__ import annotations

from typing import Optional

from ..planning.schedules import A2A_SCHEDULES
from ..planning.softmax_a2a import head_chunks, head_split
from .common import SoftmaxShape, StepTime, Topology
from .machine import Machine
from .memory import softmax_memory
from .softmax import softmax_step

__all__ = ["A2A_PRESETS", "a2a_candidates", "a2a_step", "a2a_memory"]

A2A_PRESETS = A2A_SCHEDULES       # each names its own forward and backward


def a2a_candidates(shape: SoftmaxShape, world: int, a2a_size: Optional[int] = None
                   ) -> tuple[str, ...]:
    """The all-to-all presets that can run ``shape`` on ``world`` ranks: ``a2a`` when the
    query heads split over the group; ``a2a_ring`` when ``a2a_size`` (1 < U < P) divides the
    group and the query heads."""
    out = []
    if world > 1 and shape.H % world == 0:
        out.append("a2a")
    if a2a_size is not None and 1 < a2a_size < world and world % a2a_size == 0 \
            and shape.H % a2a_size == 0:
        out.append("a2a_ring")
    return tuple(out)


def _parts(shape: SoftmaxShape, size: int):
    split = head_split(shape.H, shape.Hkv, size)
    a = split.q_per_rank
    inner = SoftmaxShape(shape.B, size * shape.T_local, a,
                         split.kv_slots if split.native else a, shape.D, shape.itemsize,
                         shape.causal)
    rows = shape.B * shape.T_local * shape.D
    e, wide = shape.itemsize, 8 if shape.itemsize == 8 else 4
    q_bytes = rows * shape.H * e
    kv_bytes = rows * 2 * split.kv_slots * size * e
    dkv_bytes = rows * 2 * split.kv_slots * size * (e if split.native else wide)
    return inner, q_bytes, kv_bytes, dkv_bytes


def a2a_step(shape: SoftmaxShape, world: int, layout: str, machine: Machine,
             topology: Optional[Topology] = None, size: Optional[int] = None,
             chunks: Optional[int] = None) -> StepTime:
    """Predicted fwd / bwd of ``preset="a2a"`` (``size`` None or P) or ``"a2a_ring"`` with
    ``a2a_size=size`` (module doc), in ``chunks`` head chunks (None: the default for the
    shape); group 0 and ring 0 stand for all (every group alike)."""
    U = world if size is None else size
    if U < 1 or world % U:
        raise ValueError(f"a2a size {U} must divide the CP group size {world}")
    topo = topology or Topology.single_node(world)
    if topo.world != world:
        raise ValueError(f"topology has {topo.world} ranks but world={world}")
    inner, q_b, kv_b, dkv_b = _parts(shape, U)
    step = softmax_step(inner, world // U, layout, "ring", "ring", machine,
                        Topology(topo.nodes[::U]))
    if U == 1:
        return step
    C = head_chunks(shape.H, shape.Hkv, U, chunks)
    link = Topology(topo.nodes[:U]).collective_link(machine)
    k = machine.kernels

    def wire(nbytes: float) -> float:       # one chunk's exchange of a C-th of nbytes
        return link.collective_ms(U, (U - 1) / U * nbytes / C)

    def copies(nbytes: float) -> float:     # packing + unpacking: the compute stream's
        return C * 2 * k.op_us * 1e-3 + 4 * nbytes / k.mem_gbps * 1e-6

    def overlapped(inner_ms: float, sent: tuple, back: tuple) -> tuple[float, float]:
        w = C * sum(wire(b) for b in sent + back)
        return w / C + max(inner_ms, w * (C - 1) / C) + sum(map(copies, sent + back)), w

    fwd, w_f = overlapped(step.fwd_ms, (kv_b, q_b), (q_b,))           # K/V, Q; out
    bwd, w_b = overlapped(step.bwd_ms, (q_b,), (dkv_b, q_b))          # dout; dK/dV, dq
    return StepTime(fwd, bwd, step.compute_ms, step.comm_ms + w_f + w_b)


def a2a_memory(shape: SoftmaxShape, world: int, layout: str, machine: Machine,
               size: Optional[int] = None) -> dict:
    """Working memory (bytes) of one fwd + bwd of the all-to-all schedules on a rank, inputs
    and the returned ``out`` excluded: the head shards saved for backward (q, k, v, out, LSE),
    the send and receive buffers of the exchanges alive at once, and the inner ring's buffers
    (:func:`.memory.softmax_memory`)."""
    U = world if size is None else size
    inner, q_b, kv_b, dkv_b = _parts(shape, U)
    wide = 8 if shape.itemsize == 8 else 4
    lse = shape.B * shape.H * shape.T_local * wide
    saved = 2 * q_b + kv_b + lse
    ring = softmax_memory(inner, world // U, layout, "ring", "ring", machine) \
        if world > U else {"peak": 0}
    out = {"saved": saved,
           "fwd": saved + 2 * max(q_b + kv_b, q_b) + ring["peak"],
           "bwd": saved + 2 * (q_b + dkv_b) + q_b + ring["peak"]}
    out["peak"] = max(out["fwd"], out["bwd"])
    return out

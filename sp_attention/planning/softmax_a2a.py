"""Pure arithmetic of the all-to-all schedules (``preset="a2a"``, ``"a2a_ring"``): which heads
every position of an all-to-all group takes, and where every token lands. No tensors, no
process group: tested for any P in ``tests/softmax/test_a2a_plan.py``.

An all-to-all group is ``U`` consecutive ranks of the CP group (``U = P``: Ulysses; ``1 < U <
P``: USP / TransformerEngine's ``a2a+p2p``, a ring across the ``R = P / U`` groups). Position
``u`` of group ``g`` (CP rank ``g·U + u``) takes query heads ``[u·a, (u+1)·a)``, ``a = H / U``,
and the tokens of the whole group.

**KV heads** (:func:`head_split`, ``G = H / Hkv`` query heads per KV head): position ``u``
needs the KV heads of its query heads, ``⌊u·a / G⌋ … ⌊((u+1)·a − 1) / G⌋``.

* ``a % G == 0`` (``Hkv % U == 0``): ``a / G`` KV heads each, disjoint — K/V travel with their
  heads, nothing replicated, GQA stays native (group ``G``).
* ``G % a == 0`` (``Hkv < U``, the query heads of a position inside one KV head's group): one
  KV head each, **replicated** to the ``G / a`` positions that use it; native GQA (group ``a``).
* otherwise the positions' query heads straddle KV-head groups unevenly: every position gets
  the KV heads it needs in ``kv_slots`` slots (the most any position needs; the rest padded
  by repeating its last head, never read), and the local kernel takes them expanded to one per
  query head (``q_to_slot``).

dK/dV of a replicated head are summed over the positions that used it, in fp32.

**Token order** (:func:`arrival_order`): after the exchange a position holds the shards of its
group's ranks concatenated in rank order ("arrival order"). The local kernel (``R = 1``) or
the ring across groups (``R > 1``) needs them in the order of a CP rank ``g`` of ``R`` ranks in
the same layout: zigzag with ``2P`` chunks gives group ``g`` the chunks ``[g·U, (g+1)·U)`` and
``[2P − (g+1)·U, 2P − g·U)``, which are exactly the zigzag pieces ``g`` and ``2R − 1 − g`` of
``2R`` (so the ring across groups is balanced as zigzag is); contiguous gives piece ``g`` of
``R``. With ``R = 1`` that order is the global order, so the kernel's plain causal mask is
the global one. Non-causal attention does not depend on the order: arrival order is kept.

**Packed documents** (:func:`grouped_plan`): the group's tokens are the segments of its ranks
in the batch's :class:`~sp_attention.planning.packing.PackingPlan`; they are re-ordered into a plan of
``R`` ranks (:class:`GroupedPlan`) that keeps the invariants the packed schedules read — a
document's segments on a rank consecutive and ascending, crossing documents first, padding
last — so the packed ring (or, with ``R = 1``, the own-block varlen calls) runs on it
unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

from .layout import leaves_of_rank, num_chunks
from .packing import PackingPlan, Segment

__all__ = ["HeadSplit", "head_split", "arrival_order", "GroupedPlan", "grouped_plan",
           "check_a2a_heads", "head_chunk_counts", "head_chunks", "DEFAULT_HEAD_CHUNKS"]

# Head chunks when the tuning names none: one. Pipelining the heads (chunk c + 1's exchange
# beside chunk c's kernel) measured slower on NVLink at every P, length and chunk count tried
# (4 x H100, 2026-11-27: see SoftmaxTuning.a2a_head_chunks).
DEFAULT_HEAD_CHUNKS = 1


def check_a2a_heads(heads: int, size: int, preset: str) -> None:
    """``ValueError`` unless the ``heads`` local query heads split over ``size`` positions."""
    if heads % size:
        other = ("preset='a2a_ring' with an a2a_size that divides the query heads, or 'ring' / "
                 "'ring_ag' (any head count)" if preset == "a2a" else
                 "an a2a_size that divides them, or preset 'ring' / 'ring_ag'")
        raise ValueError(f"preset={preset!r} splits the {heads} local query heads over "
                         f"{size} ranks (all-to-all from sequence to head shards), so {size} "
                         f"must divide {heads}; use {other}")


def head_chunk_counts(heads: int, kv_heads: int, size: int) -> tuple[int, ...]:
    """Every chunk count ``C`` the heads of an all-to-all call can be pipelined in: chunk
    ``c`` is KV heads ``[c·Hkv/C, (c+1)·Hkv/C)`` with their query heads ``[c·H/C, (c+1)·H/C)``
    (GQA maps query head ``h`` to KV head ``h // G``, so a chunk's query heads use only its
    KV heads), so ``C`` divides ``Hkv`` and the chunk's ``H / C`` query heads split over the
    ``size`` positions."""
    return tuple(c for c in range(1, kv_heads + 1)
                 if kv_heads % c == 0 and heads % c == 0 and (heads // c) % size == 0)


def head_chunks(heads: int, kv_heads: int, size: int, requested: "int | None") -> int:
    """The head chunks of one all-to-all call over U = ``size`` positions:
    ``requested`` if given (``ValueError`` naming the counts that split otherwise), else
    :data:`DEFAULT_HEAD_CHUNKS`. One position (no exchange) runs one chunk."""
    if requested is None:
        return DEFAULT_HEAD_CHUNKS
    counts = head_chunk_counts(heads, kv_heads, size)
    if requested not in counts:
        raise ValueError(f"SoftmaxTuning.a2a_head_chunks={requested} must divide the {kv_heads} "
                         f"local KV heads with the {heads} query heads of each chunk splitting "
                         f"over the {size} ranks of the all-to-all: use one of {list(counts)} "
                         "(or None)")
    return requested if size > 1 else 1


@dataclass(frozen=True)
class HeadSplit:
    """The heads of every position of an all-to-all group of ``size`` ranks (module doc).

    Attributes:
        heads, kv_heads, size: H, Hkv, U (``H % U == 0``, ``H % Hkv == 0``).
        q_per_rank: ``a = H / U`` query heads per position.
        kv_slots: KV heads each position receives (the same for all: fixed-shape messages).
        kv_heads_of: per position, the KV head in each slot (padded by repeating the last).
        kv_count: per position, how many slots are real.
        q_to_slot: per position, the slot each of its query heads reads.
        native: the slots serve the query heads as plain GQA (query head ``i`` reads slot
            ``i // (a / kv_slots)``), so the kernel takes them as they are; else expanded.
        disjoint: every KV head goes to exactly one position (no dK/dV sum across positions).
    """

    heads: int
    kv_heads: int
    size: int

    @property
    def q_per_rank(self) -> int:
        return self.heads // self.size

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    def _range(self, u: int) -> tuple[int, int]:
        a, G = self.q_per_rank, self.group
        return u * a // G, ((u + 1) * a - 1) // G + 1

    @cached_property
    def kv_count(self) -> tuple[int, ...]:
        return tuple(hi - lo for lo, hi in map(self._range, range(self.size)))

    @cached_property
    def kv_slots(self) -> int:
        return max(self.kv_count)

    @cached_property
    def kv_heads_of(self) -> tuple[tuple[int, ...], ...]:
        out = []
        for u in range(self.size):
            lo, hi = self._range(u)
            out.append(tuple(min(lo + j, hi - 1) for j in range(self.kv_slots)))
        return tuple(out)

    @cached_property
    def q_to_slot(self) -> tuple[tuple[int, ...], ...]:
        a, G = self.q_per_rank, self.group
        return tuple(tuple((u * a + i) // G - self._range(u)[0] for i in range(a))
                     for u in range(self.size))

    @property
    def native(self) -> bool:
        a, G = self.q_per_rank, self.group
        return a % G == 0 or G % a == 0

    @property
    def disjoint(self) -> bool:
        return self.kv_heads % self.size == 0


@lru_cache(maxsize=256)
def head_split(heads: int, kv_heads: int, size: int) -> HeadSplit:
    """The :class:`HeadSplit` of ``heads`` query and ``kv_heads`` KV heads over ``size``
    positions (``ValueError`` if they do not split)."""
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"query heads {heads} must be a multiple of KV heads {kv_heads}")
    if size < 1 or heads % size:
        raise ValueError(f"{heads} query heads do not split over {size} positions")
    return HeadSplit(heads, kv_heads, size)


@lru_cache(maxsize=1024)
def arrival_order(layout: str, world: int, size: int, group: int) -> tuple[int, ...]:
    """The ring order of group ``group``'s tokens as arrival-order chunk indices: entry ``i``
    is the arrival position (in chunks of the CP layout of ``world`` ranks: ``T_local /
    leaves`` tokens each) of the ``i``-th chunk of the rank-``group`` shard of ``world /
    size`` ranks in ``layout`` (module doc). Identity for contiguous layouts."""
    if world % size:
        raise ValueError(f"a2a_size {size} must divide the CP group size {world}")
    ring = world // size
    arrived = [c for u in range(size) for c in leaves_of_rank(group * size + u, world, layout)]
    m = num_chunks(world, layout) // num_chunks(ring, layout)       # chunks per ring piece
    want = [piece * m + j for piece in leaves_of_rank(group, ring, layout) for j in range(m)]
    if sorted(arrived) != sorted(want):      # the layouts' arithmetic guarantees this
        raise AssertionError(f"group {group} holds chunks {arrived}, ring rank needs {want}")
    where = {c: i for i, c in enumerate(arrived)}
    return tuple(where[c] for c in want)


@dataclass(frozen=True, eq=False)
class GroupedPlan(PackingPlan):
    """A :class:`~sp_attention.planning.packing.PackingPlan` of the ``R = P / U`` all-to-all groups as
    ranks (built by :func:`grouped_plan`): its key carries ``a2a_size``, so it never equals
    (nor shares cached calls with) a plan made by :func:`~sp_attention.plan_packing`.

    Attributes:
        a2a_size: U.
        runs: per group, ``(arrival_start, length)`` of each of its segments in order: where
            the segment's tokens sit in the group's arrival order (``u·L + local_start``).
    """

    a2a_size: int = 1
    runs: tuple = ()

    @cached_property
    def key(self) -> tuple:
        return (self.world_size, self.layout, self.row_len, self.cu_seqlens, "a2a",
                self.a2a_size)


@lru_cache(maxsize=64)
def grouped_plan(plan: PackingPlan, size: int) -> GroupedPlan:
    """The plan of the all-to-all groups of ``size`` ranks over ``plan``'s rows (module doc)."""
    P, L = plan.world_size, plan.local_len
    if P % size:
        raise ValueError(f"a2a_size {size} must divide the CP group size {P}")
    R = P // size
    owners: dict = {}
    for r, segs in enumerate(plan.segments):
        for s in segs:
            if s.doc >= 0:
                owners.setdefault(s.doc, set()).add(r // size)
    crossing = {d for d, gs in owners.items() if len(gs) > 1}
    segments, runs = [], []
    for g in range(R):
        mine = [(u, s) for u in range(size) for s in plan.segments[g * size + u]]
        mine.sort(key=lambda x: (2 if x[1].doc < 0 else 0 if x[1].doc in crossing else 1,
                                 x[1].doc if x[1].doc >= 0 else 0, x[1].start))
        local, segs, rs = 0, [], []
        for u, s in mine:
            segs.append(Segment(s.start, s.length, s.doc, local))
            rs.append((u * L + s.local_start, s.length))
            local += s.length
        segments.append(tuple(segs))
        runs.append(tuple(rs))
    return GroupedPlan(R, plan.layout, plan.row_len, size * L, plan.cu_seqlens,
                       tuple(segments), a2a_size=size, runs=tuple(runs))

"""Pure arithmetic of packed-document softmax across ranks: which rows meet which keys.

From a :class:`~sp_attention.planning.packing.PackingPlan` (segments of every rank), with no
tensor and no process group, so every rule is unit-tested for any P:

* **Own block** (:func:`own_calls`): a rank's queries against its own keys are one varlen
  causal problem over its document groups (invariant 1 of the plan: a document's segments on a
  rank are consecutive locally and ascending globally, so the square causal mask over the group
  is the document's mask).
* **Cross-rank blocks** (:func:`step_calls`): a query of rank ``r`` and a key of rank ``src``
  never share a position, so within a document a key segment is either entirely before a query
  segment (visible: a full, non-causal block) or entirely after it (skipped). Per document,
  the key segments of ``src`` before a query segment are a prefix of the document's segments on
  ``src``; neighbouring query segments with the same prefix fuse into one **pair**.
* **Travel windows** (:func:`travel`): only keys that a query of another rank can see ever
  leave their rank: the tokens of crossing documents with a later token elsewhere. Rank ``r``
  ships ``[start_r, start_r + travel_len)`` of its shard, one fixed length for all ranks (zigzag
  plans put crossing documents first, so it is a prefix; contiguous plans, a suffix).
  ``travel_len == 0``: no cross-rank work at all.

Pairs become kernel **calls** (:func:`group_calls`): a pair of at least ``dense_min``
(:attr:`SoftmaxTuning.packed_dense_min <sp_attention.SoftmaxTuning>`, by default
:func:`auto_dense_min`) query × key tokens is
one dense call (the fast dense kernels take long documents); the other pairs
are grouped into varlen calls whose query and key ranges ascend without overlap (what a varlen
kernel's ``cu_seqlens_q/k`` can express; rows or keys between pairs are gaps the backend
skips).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .packing import PackingPlan

__all__ = ["Pair", "PackedCall", "Travel", "CallPolicy", "travel", "own_pairs", "step_pairs",
           "group_calls", "own_calls", "step_calls", "active_steps", "cross_rows", "auto_dense_min",
           "DENSE_MIN", "DENSE_MIN_SMALL_WORK", "SMALL_WORK_FLOP", "NO_DENSE_CALLS",
           "PACKED_DENSE_AFTER"]

# packed_dense_min=None (auto, :func:`auto_dense_min`). A dense call (cuDNN on Hopper) runs a
# long document ~1.2-1.6 x faster than FlashAttention-2's varlen kernel, but every call costs
# host time (~0.1-0.3 ms for a forward and backward through torch); when a rank's attention
# is small its calls' host time is the step. Measured on 4 x H200 (2026-11-27, Llama-3-8B
# attention H 32 / Hkv 8 / D 128, the log-normal mix, ring, zigzag; `benchmarks/softmax_cp.py
# --packed --packed-dense-min 16777216 1099511627776`, and again with this rule in the op): at
# T_local 8K dense calls only from pairs of 2^24 took the eager step from 9.59 / 10.36 to 6.41 /
# 6.42 ms and the queued one from 3.62 to 3.46; at 32K they cost 6 % (12.31 -> 13.16 ms), and
# every pair in varlen calls 35 %.
DENSE_MIN = 1 << 20              # pairs this large run dense when the rank's work is large
DENSE_MIN_SMALL_WORK = 1 << 24   # ... and this large when it is small (4K x 4K tokens)
# "Small": a rank's share of the row's causal forward FLOP (4 · q·k/2 · H · D per document,
# divided by P) below this, about 1 ms of Hopper's attention kernels: the 8K row above has
# 1.5e11, the 32K row 1.3e12, one GPU on the 32K-token row 5.9e11 (its eager step gained
# from 2^24 too, its queued one lost 4 %: the line sits just below it).
SMALL_WORK_FLOP = 5e11
# A dense_min no pair reaches: every pair in varlen calls (a packing plan's first calls, while
# SoftmaxTuning.packed_dense_after has not passed).
NO_DENSE_CALLS = 1 << 62
# SoftmaxTuning.packed_dense_after's default: a layout of documents gets dense calls from its
# 257th call on. Training on varied documents makes a new layout every step and ~L calls with it
# (L layers; 2 L with recompute), so 256 keeps every call of models up to 128 layers varlen; a
# layout that recurs (fixed documents, benchmarks) pays the dense calls' plan builds once
# (~0.1-0.3 s a shape) and then runs cuDNN, ~1.5 x FlashAttention-2's varlen speed on long
# documents (4 x H200: the packed ring at 32K per GPU 0.923 dense / 0.603 every pair varlen).
PACKED_DENSE_AFTER = 256


@dataclass(frozen=True)
class Pair:
    """Queries ``[q_start, q_start + q_len)`` (rows of the rank's shard) against keys
    ``[k_start, k_start + k_len)`` (rows of the key block: the own shard, or the source's
    travel window), bottom-right causal in own-block calls, full otherwise."""

    q_start: int
    q_len: int
    k_start: int
    k_len: int

    @property
    def q_stop(self) -> int:
        return self.q_start + self.q_len

    @property
    def k_stop(self) -> int:
        return self.k_start + self.k_len


@dataclass(frozen=True)
class PackedCall:
    """One kernel call: query rows ``[q_start, q_stop)``, key rows ``[k_start, k_stop)``,
    and its pairs (ascending, disjoint in both queries and keys; rows or keys of the spans not
    in any pair take no part). ``dense``: one pair covering both spans (a plain kernel call)."""

    pairs: tuple[Pair, ...]
    causal: bool

    @property
    def q_start(self) -> int:
        return self.pairs[0].q_start

    @property
    def q_stop(self) -> int:
        return self.pairs[-1].q_stop

    @property
    def k_start(self) -> int:
        return self.pairs[0].k_start

    @property
    def k_stop(self) -> int:
        return self.pairs[-1].k_stop

    @property
    def dense(self) -> bool:
        return len(self.pairs) == 1

    def relative(self) -> tuple[Pair, ...]:
        """The pairs with rows counted from the spans' starts."""
        q0, k0 = self.q_start, self.k_start
        return tuple(Pair(p.q_start - q0, p.q_len, p.k_start - k0, p.k_len) for p in self.pairs)


@dataclass(frozen=True)
class Travel:
    """``starts[r]``: first row of rank r's travel window; ``length``: its length (all ranks)."""

    starts: tuple[int, ...]
    length: int


def _doc_segments(plan: PackingPlan, rank: int) -> dict:
    out: dict = {}
    for s in plan.segments[rank]:
        if s.doc >= 0 and plan.is_crossing(s.doc):
            out.setdefault(s.doc, []).append(s)
    return out


@lru_cache(maxsize=256)
def _doc_map(plan: PackingPlan, rank: int) -> dict:
    return _doc_segments(plan, rank)


@lru_cache(maxsize=64)
def travel(plan: PackingPlan) -> Travel:
    """The travel windows (module doc): keys a query of another rank may see."""
    world, L = plan.world_size, plan.local_len
    lo, hi = [], []
    for r in range(world):
        first, last = L, 0
        for d, segs in _doc_map(plan, r).items():
            latest_elsewhere = max((s.start for q, s in plan.doc_pieces[d] if q != r),
                                   default=-1)
            for s in segs:
                if s.start < latest_elsewhere:        # a later token of d on another rank
                    first, last = min(first, s.local_start), max(last, s.local_stop)
        lo.append(first)
        hi.append(last)
    length = max((h - l for l, h in zip(lo, hi) if h > l), default=0)
    starts = tuple(min(l, L - length) if h > l else 0 for l, h in zip(lo, hi))
    return Travel(starts, length)


@lru_cache(maxsize=256)
def own_pairs(plan: PackingPlan, rank: int) -> tuple[Pair, ...]:
    """The own block: one causal pair per document group of ``rank`` (padding excluded)."""
    return tuple(Pair(start, n, start, n) for _, start, n in plan.groups(rank))


@lru_cache(maxsize=4096)
def step_pairs(plan: PackingPlan, rank: int, src: int) -> tuple[Pair, ...]:
    """Full (non-causal) pairs of ``rank``'s queries against ``src``'s keys (``src != rank``);
    key rows relative to ``src``'s travel window."""
    if src == rank:
        raise ValueError("step_pairs is for another rank's keys; use own_pairs")
    mine, theirs = _doc_map(plan, rank), _doc_map(plan, src)
    k0 = travel(plan).starts[src]
    pairs = []
    for d in mine:            # the plan's document order, the same on both ranks
        if d not in theirs:
            continue
        ks = theirs[d]
        group: list = []                     # [q_start, q_len, visible key segments]
        for s in mine[d]:
            c = sum(1 for k in ks if k.stop <= s.start)
            if group and group[2] == c:
                group[1] += s.length
                continue
            if group and group[2]:
                pairs.append(_pair(group, ks, k0))
            group = [s.local_start, s.length, c]
        if group and group[2]:
            pairs.append(_pair(group, ks, k0))
    return tuple(pairs)


def _pair(group, ks, k0) -> Pair:
    q_start, q_len, c = group
    start = ks[0].local_start - k0
    return Pair(q_start, q_len, start, ks[c - 1].local_stop - ks[0].local_start)


def group_calls(pairs: tuple[Pair, ...], causal: bool, dense_min: int,
                gaps: bool = True) -> tuple[PackedCall, ...]:
    """Kernel calls for ``pairs`` (ascending in queries): each pair of ≥ ``dense_min`` query ×
    key tokens alone (dense); the others in varlen calls, a new call whenever a pair's keys
    would not follow the previous pair's (overlapping key prefixes of one document) or, with
    ``gaps=False``, whenever rows or keys lie between two pairs."""
    calls: list[PackedCall] = []
    run: list[Pair] = []

    def flush():
        if run:
            calls.append(PackedCall(tuple(run), causal))
            run.clear()

    for p in pairs:
        if p.q_len * p.k_len >= dense_min:
            flush()
            calls.append(PackedCall((p,), causal))
            continue
        if run and (p.k_start < run[-1].k_stop or not gaps and (
                p.q_start != run[-1].q_stop or p.k_start != run[-1].k_stop)):
            flush()
        run.append(p)
    flush()
    return tuple(calls)


def auto_dense_min(cu_seqlens: tuple, world: int, heads: int, head_dim: int) -> int:
    """``packed_dense_min`` for ``packed_dense_min=None``: :data:`DENSE_MIN_SMALL_WORK` when
    a rank's share of the row's causal attention forward (documents ``cu_seqlens``, ``heads``
    query heads of ``head_dim``, over ``world`` ranks) is under :data:`SMALL_WORK_FLOP` — few,
    large varlen calls, the host's time being the step — else :data:`DENSE_MIN`. Pure
    arithmetic of the global row, so every rank and every schedule (ring, all-gather, a2a)
    picks the same."""
    work = sum((b - a) * (b - a) for a, b in zip(cu_seqlens, cu_seqlens[1:])) / 2
    flop = 4.0 * work * heads * head_dim / max(world, 1)
    return DENSE_MIN_SMALL_WORK if flop < SMALL_WORK_FLOP else DENSE_MIN


@dataclass(frozen=True)
class CallPolicy:
    """How pairs become kernel calls (:func:`group_calls`); from :class:`~sp_attention.
    SoftmaxTuning` (``packed_dense_min`` resolved: :func:`auto_dense_min` for None,
    ``packed_varlen_gaps``)."""

    dense_min: int = DENSE_MIN
    gaps: bool = True


@lru_cache(maxsize=256)
def own_calls(plan: PackingPlan, rank: int, policy: CallPolicy) -> tuple[PackedCall, ...]:
    """Calls of the own block (causal)."""
    return group_calls(own_pairs(plan, rank), True, policy.dense_min, policy.gaps)


@lru_cache(maxsize=4096)
def step_calls(plan: PackingPlan, rank: int, src: int,
               policy: CallPolicy) -> tuple[PackedCall, ...]:
    """Calls of ``rank``'s queries against ``src``'s travel window (non-causal)."""
    return group_calls(step_pairs(plan, rank, src), False, policy.dense_min, policy.gaps)


@lru_cache(maxsize=64)
def active_steps(plan: PackingPlan) -> int:
    """Ring steps ``1 … S`` any rank has work in (the ring stops after step ``S``: the block of
    rank ``r − s`` reaches rank ``r`` at step ``s``); 0 when no document crosses ranks."""
    world = plan.world_size
    if travel(plan).length == 0:
        return 0
    last = 0
    for s in range(1, world):
        if any(step_pairs(plan, r, (r - s) % world) for r in range(world)):
            last = s
    return last


@lru_cache(maxsize=256)
def cross_rows(plan: PackingPlan, rank: int, policy: CallPolicy) -> tuple[int, int]:
    """``(lo, hi)``: the rows of ``rank``'s shard that any cross-rank call takes as queries
    (the bounding range; ``(0, 0)`` when there are none) — the only rows whose output and dq
    take more than the own block's result, so the only ones the schedules accumulate in fp32.
    Zigzag plans put crossing documents first: a short prefix of the shard."""
    lo, hi = None, 0
    for src in range(plan.world_size):
        if src == rank:
            continue
        for c in step_calls(plan, rank, src, policy):
            lo = c.q_start if lo is None else min(lo, c.q_start)
            hi = max(hi, c.q_stop)
    return (0, 0) if lo is None else (lo, hi)

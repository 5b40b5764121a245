"""Packed documents across a CP group: the packing plan, built once per batch, shared by every
layer.

A packed row holds several documents (boundaries ``cu_seqlens [N+1]``: 0, …, the end of the
last document; the flash-attn / fla / TransformerEngine-THD convention); attention stays inside
each document and positions restart at each document start. :func:`plan_packing` decides which
tokens every rank of the CP group holds and in which order, from ``(cu_seqlens, world size,
layout)`` alone: pure host arithmetic, the same on every rank, no collective, no device sync
(given a CUDA tensor, one device→host copy when the plan is built).

A rank's shard is a list of **segments** in local order, ``Segment(start, length, doc,
local_start)``: the tokens ``[start, start + length)`` of the global padded row, of document
``doc`` (−1: padding), at ``[local_start, local_start + length)`` of the shard. Every rank
holds ``local_len`` tokens (static shapes), and the segments cover every shard exactly.

Invariants every consumer may rely on (tested for many random rows, P = 1 … 16):

1. The segments of one document on one rank are consecutive in local order and ascending in
   global order, so a square causal mask over their concatenation is the document's causal
   mask restricted to the rank's tokens (one local varlen causal call per rank).
2. ``zigzag``: segments of **crossing** documents (documents with tokens on more than one rank)
   come first, then whole documents, then padding; within each part documents follow one
   global order, the same on every rank: longest first, ties by index (so the documents big
   enough for dense kernel calls sit together, and the short ones form one varlen run).
   ``contiguous``: the shard is one range of the global row in global order (crossing
   documents are at most its first and last segment); padding last too (it only exists at
   the row's end).

Layouts (``local_len = L``, ``P`` ranks, padded row ``P·L``):

* ``contiguous``: ``L = ⌈row_len / P⌉``; rank ``r`` holds ``[r·L, (r+1)·L)``; documents may
  cross ranks.
* ``zigzag`` (balanced causal softmax): ``L = 2·⌈row_len / 2P⌉``. The longest documents (as
  few as the balance needs) are cut into ``2P`` pieces, piece ``i`` and ``2P−1−i`` on rank
  ``i`` (the zigzag rule per document: every rank gets the same causal work from it); every
  other document stays whole on one rank, placed longest first on the rank with the least
  causal work that still has room; a document that fits nowhere is cut over the ranks with
  room left (a "spill", usually the last short documents). One document spanning the row,
  with ``row_len % 2P == 0``, gives exactly the unpacked zigzag shards (:attr:`PackingPlan.
  is_trivial`). Unlike TransformerEngine's THD split (every document padded to a multiple of
  ``2P`` and cut into ``2P`` pieces), short documents are never cut nor padded: padding is at
  most ``2P − 1`` tokens plus the row's own trailing padding, and cuts grow with the long
  documents, not with the document count (``benchmarks/packing_balance.py``).

Padding (tokens after ``cu_seqlens[-1]``, and the up to ``P·L − row_len`` the plan adds) belongs
to no document: the ops give it zero outputs and gradients.

Data helpers: :meth:`PackingPlan.shard` / :meth:`~PackingPlan.unshard` (index gathers, index
tensors cached per device), :meth:`~PackingPlan.position_ids` (restart at 0 per document),
:meth:`~PackingPlan.shift_labels` (per document, on the global row, before sharding).
"""
from __future__ import annotations

import dataclasses
import gc
import hashlib
import heapq
import weakref
from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional, Sequence, Union

import torch

from ..caches import LRU, to_device
from .layout import DEFAULT_LAYOUT, LAYOUTS, GroupLayout, shard_ranges

__all__ = ["Segment", "PackingPlan", "plan_packing", "check_cu_seqlens", "resolve_plan",
           "packing_context", "causal_work", "BALANCE_TARGET"]

# The zigzag planner cuts the fewest long documents that bring max / mean per-rank causal work
# to this (the issue's bar is 1.05; the margin absorbs the spills' rounding).
BALANCE_TARGET = 1.04
# Plans by boundary values (a batch's layers share one), and by tensor object (a tensor seen
# before, unmodified, needs no device-to-host copy of its values).
_PLAN_CACHE = LRU(64)
_TENSOR_PLANS = LRU(64)


@dataclass(frozen=True)
class Segment:
    """Tokens ``[start, start + length)`` of the global padded row, of document ``doc`` (−1:
    padding), at ``[local_start, local_start + length)`` of its rank's shard."""

    start: int
    length: int
    doc: int
    local_start: int

    @property
    def stop(self) -> int:
        return self.start + self.length

    @property
    def local_stop(self) -> int:
        return self.local_start + self.length


def causal_work(offset: int, length: int) -> int:
    """Visible (query, key) pairs of ``length`` consecutive queries starting ``offset`` tokens
    into their document: ``Σ_i (offset + i + 1)`` (causal attention FLOPs ∝ this)."""
    return length * offset + length * (length + 1) // 2


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------

def check_cu_seqlens(cu_seqlens, row_len: Optional[int] = None) -> tuple[int, ...]:
    """Validate document boundaries and return them as a tuple of ints (host copy).

    ``cu_seqlens``: ``[N+1]`` int32/int64 tensor (or a sequence of ints), starting at 0,
    strictly increasing (every document has ≥ 1 token), ending at the row length, or before it
    when ``row_len`` is given (the rest of the row is padding). Raises ``TypeError`` /
    ``ValueError`` naming the fix.
    """
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"cu_seqlens must be int32 or int64 (the flash-attn / fla / TE "
                            f"convention), got {cu_seqlens.dtype}; pass .to(torch.int32)")
        if cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens must be 1-D [N+1] boundaries of ONE packed row (the "
                             f"same for every batch row), got shape {tuple(cu_seqlens.shape)}")
        values = tuple(int(x) for x in cu_seqlens.tolist())
    elif isinstance(cu_seqlens, (list, tuple)):
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in cu_seqlens):
            raise TypeError("cu_seqlens as a sequence must hold ints")
        values = tuple(cu_seqlens)
    else:
        raise TypeError(f"cu_seqlens must be an int32/int64 tensor [N+1] (or a PackingPlan "
                        f"where the op takes one), got {type(cu_seqlens).__name__}")
    if len(values) < 2:
        raise ValueError(f"cu_seqlens needs at least two entries [0, T] (one document), got "
                         f"{list(values)}")
    if values[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0 (boundaries of the whole row, e.g. "
                         f"torch.cat([zeros(1), lengths.cumsum(0)])), got {values[0]}")
    for i in range(1, len(values)):
        if values[i] <= values[i - 1]:
            raise ValueError(
                f"cu_seqlens must be strictly increasing: document {i - 1} has length "
                f"{values[i] - values[i - 1]} (cu_seqlens[{i - 1}:{i + 1}] = "
                f"{list(values[i - 1:i + 1])}); boundaries are cumulative sums of positive "
                "lengths — sort them and drop empty documents")
    if row_len is not None:
        if isinstance(row_len, bool) or not isinstance(row_len, int) or row_len < 1:
            raise ValueError(f"row_len must be a positive int, got {row_len!r}")
        if values[-1] > row_len:
            raise ValueError(f"cu_seqlens ends at {values[-1]}, past the row length {row_len}; "
                             "the last boundary must be the end of the last document, at most "
                             "the row length")
    return values


# --------------------------------------------------------------------------------------------
# Planners: per rank, pieces (doc, offset in doc, length) before ordering
# --------------------------------------------------------------------------------------------

def _contiguous_segments(cu: tuple[int, ...], world: int, local_len: int) -> list[list[Segment]]:
    bounds = list(cu) + [world * local_len]           # the padding "document" last
    out: list[list[Segment]] = []
    d = 0
    for r in range(world):
        lo, hi = r * local_len, (r + 1) * local_len
        segs: list[Segment] = []
        while d + 1 < len(bounds) and bounds[d + 1] <= lo:
            d += 1
        j = d
        while j + 1 < len(bounds) and bounds[j] < hi:
            s, e = max(bounds[j], lo), min(bounds[j + 1], hi)
            if e > s:
                doc = j if j < len(cu) - 1 else -1
                segs.append(Segment(s, e - s, doc, s - lo))
            j += 1
        out.append(segs)
    return out


def _split_sizes(n: int, parts: int) -> list[int]:
    q, rem = divmod(n, parts)
    return [q + (1 if i < rem else 0) for i in range(parts)]


def _ranks_for(m: int, need: Sequence[int], load: list[int], free: list[int]) -> Optional[list]:
    """The ``m`` least loaded ranks with room for the shares ``need`` (largest share first to
    the first rank found), returned in ascending rank order (so that a document cut over every
    rank lands as the unpacked zigzag does: pieces ``r`` and ``2P−1−r`` on rank ``r``)."""
    world = len(load)
    if m == world:
        ok = all(free[r] >= need[r] for r in range(world))
        return list(range(world)) if ok else None
    by_load = sorted(range(world), key=lambda r: (load[r], r))
    chosen = [r for r in by_load if free[r] >= max(need)][:m]
    return sorted(chosen) if len(chosen) == m else None


def _least_loaded_with_room(heap: list, load: list[int], free: list[int],
                            n: int) -> Optional[int]:
    """Pop the least loaded rank with ``n`` tokens of room off the lazy heap (None if none);
    ranks without room go back on it (room only shrinks, documents only get shorter)."""
    aside, found = [], None
    while heap:
        ld, r = heapq.heappop(heap)
        if ld != load[r] or free[r] == 0:
            continue                      # stale, or full for good
        if free[r] >= n:
            found = r
            break
        aside.append((ld, r))
    for item in aside:
        heapq.heappush(heap, item)
    return found


def _zigzag_pieces(lengths: Sequence[int], order: Sequence[int], n_split: int, world: int,
                   local_len: int) -> tuple[list[list[tuple[int, int, int]]], list[int]]:
    """Assign documents to ranks. The ``n_split`` first documents of ``order`` (longest
    first) are cut, each over ``m`` ranks in ``2m`` zigzag pieces (piece ``j`` and ``2m−1−j``
    on the ``j``-th of its ranks: the same causal work on each), ``m`` growing with the
    document's causal work relative to that of document ``n_split`` (the longest one kept
    whole), at least enough ranks to hold it and at most P. Items (a whole document, or one
    rank's share of a cut one) go largest per-rank work first to the least loaded ranks with
    room; one that fits nowhere is spilled: cut over the ranks with room left. Returns per
    rank ``[(doc, offset, length)]`` and the per-rank causal work."""
    pieces: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
    load = [0] * world
    free = [local_len] * world
    tau = causal_work(0, lengths[order[n_split]]) if n_split < len(order) else 1
    items = []
    for i, d in enumerate(order):
        n = lengths[d]
        m = 1
        if i < n_split:
            m = max(2, -(-causal_work(0, n) // max(tau, 1)), -(-n // local_len))
            m = min(world, m, max(1, n // 2))
        items.append((causal_work(0, n) // m, n, d, m))
    items.sort(key=lambda x: (-x[0], -x[1], x[2]))
    heap = [(0, r) for r in range(world)]          # (load, rank), stale entries skipped
    for _, n, d, m in items:
        if m == 1:
            r = _least_loaded_with_room(heap, load, free, n)
            if r is not None:
                pieces[r].append((d, 0, n))
                load[r] += causal_work(0, n)
                free[r] -= n
                heapq.heappush(heap, (load[r], r))
                continue
        else:
            sizes = _split_sizes(n, 2 * m)
            share = [sizes[j] + sizes[2 * m - 1 - j] for j in range(m)]
            ranks = _ranks_for(m, share if m == world else [max(share)] * world, load, free)
            if ranks is not None:
                offs = [sum(sizes[:i]) for i in range(2 * m)]
                for j, r in enumerate(ranks):
                    for i in (j, 2 * m - 1 - j):
                        if sizes[i]:
                            pieces[r].append((d, offs[i], sizes[i]))
                            load[r] += causal_work(offs[i], sizes[i])
                            free[r] -= sizes[i]
                    heapq.heappush(heap, (load[r], r))
                continue
        # Spill: cut the document over the ranks with room, the cheap early tokens to the
        # busiest ranks, the expensive late ones to the least busy.
        off = 0
        for r in sorted((r for r in range(world) if free[r] > 0), key=lambda r: (-load[r], r)):
            if off == n:
                break
            k = min(free[r], n - off)
            pieces[r].append((d, off, k))
            load[r] += causal_work(off, k)
            free[r] -= k
            heapq.heappush(heap, (load[r], r))
            off += k
        if off != n:   # cannot happen: total room >= total tokens
            raise AssertionError("zigzag planner ran out of room")
    return pieces, load


def _imbalance(load: Sequence[int]) -> float:
    mean = sum(load) / len(load)
    return max(load) / mean if mean > 0 else 1.0


def _choose_split(lengths: Sequence[int], order: Sequence[int], world: int, local_len: int,
                  target: float) -> tuple[list[list[tuple[int, int, int]]], list[int]]:
    """The fewest longest documents to cut (``k``) such that the per-rank causal work is within
    ``target`` of the mean: documents longer than ``local_len`` are always cut; then ``k``
    grows by doubling and is bisected down (the best seen wins if none reaches the target)."""
    if world == 1:
        return _zigzag_pieces(lengths, order, 0, world, local_len)
    k_min = sum(1 for d in order if lengths[d] > local_len)
    n = len(order)
    seen: dict[int, tuple] = {}

    def run(k: int):
        if k not in seen:
            seen[k] = _zigzag_pieces(lengths, order, k, world, local_len)
        return seen[k]

    def ok(k: int) -> bool:
        return _imbalance(run(k)[1]) <= target

    if ok(k_min):
        return run(k_min)
    lo, step = k_min, 1
    hi = None
    while lo + step <= n:
        if ok(lo + step):
            hi = lo + step
            break
        lo, step = lo + step, step * 2
    if hi is None:
        if n not in seen and ok(n):
            hi = n
        else:
            best = min(seen, key=lambda k: (_imbalance(seen[k][1]), k))
            return seen[best]
    while hi - lo > 1:                  # lo fails, hi passes
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return run(hi)


def _zigzag_segments(cu: tuple[int, ...], world: int, local_len: int,
                     target: float) -> list[list[Segment]]:
    lengths = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
    order = sorted(range(len(lengths)), key=lambda d: (-lengths[d], d))
    pieces, _ = _choose_split(lengths, order, world, local_len, target)
    holders: dict[int, set] = {}
    for r, ps in enumerate(pieces):
        for d, _, _ in ps:
            holders.setdefault(d, set()).add(r)
    pad_at = cu[-1]
    out: list[list[Segment]] = []
    for r, ps in enumerate(pieces):
        # crossing documents first, whole ones next; longest first (invariant 2)
        ps = sorted(ps, key=lambda p: (len(holders[p[0]]) == 1, -lengths[p[0]], p[0], p[1]))
        segs, pos = [], 0
        for d, off, m in ps:
            segs.append(Segment(cu[d] + off, m, d, pos))
            pos += m
        if pos < local_len:
            segs.append(Segment(pad_at, local_len - pos, -1, pos))
            pad_at += local_len - pos
        out.append(segs)
    return out


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class PackingPlan:
    """Which tokens of a packed row every rank of a CP group holds, in which order.

    Build it with :func:`plan_packing` (cached). Equality and hash are by content: the
    boundaries, the world size, the layout and the row length determine the plan.

    Attributes:
        world_size: CP ranks ``P``.
        layout: ``"zigzag"`` or ``"contiguous"`` (see the module doc).
        row_len: length of the row as the caller holds it (documents, then any trailing
            padding); ``shard`` takes tensors of this length, ``unshard`` returns it.
        local_len: tokens per rank ``L`` (every shard); ``P·L >= row_len``.
        cu_seqlens: the document boundaries ``(0, …, end of the last document)``.
        segments: per rank, its segments in local order (they tile ``[0, L)``).
    """

    world_size: int
    layout: str
    row_len: int
    local_len: int
    cu_seqlens: tuple[int, ...]
    segments: tuple[tuple[Segment, ...], ...] = field(repr=False)

    # -- identity -------------------------------------------------------------------------------
    @cached_property
    def key(self) -> tuple:
        return (self.world_size, self.layout, self.row_len, self.cu_seqlens)

    @cached_property
    def digest(self) -> str:
        """16 hex digits identifying the plan (what ranks compare in the ops' call check)."""
        return hashlib.blake2b(repr(self.key).encode(), digest_size=8).hexdigest()

    def __eq__(self, other) -> bool:
        return isinstance(other, PackingPlan) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        return (f"PackingPlan(world_size={self.world_size}, layout={self.layout!r}, row_len="
                f"{self.row_len}, local_len={self.local_len}, docs={self.num_docs}, "
                f"crossing={len(self.crossing_docs)}, digest={self.digest})")

    # -- documents ------------------------------------------------------------------------------
    @property
    def num_docs(self) -> int:
        return len(self.cu_seqlens) - 1

    @cached_property
    def doc_pieces(self) -> tuple[tuple[tuple[int, Segment], ...], ...]:
        """``doc_pieces[d]``: ``(rank, segment)`` of document ``d``, ascending in global order
        (the chain a linear-attention state follows through the document)."""
        pieces: list[list] = [[] for _ in range(self.num_docs)]
        for r, segs in enumerate(self.segments):
            for s in segs:
                if s.doc >= 0:
                    pieces[s.doc].append((r, s))
        return tuple(tuple(sorted(p, key=lambda x: x[1].start)) for p in pieces)

    @cached_property
    def crossing_docs(self) -> tuple[int, ...]:
        """Documents with tokens on more than one rank, ascending."""
        return tuple(d for d, p in enumerate(self.doc_pieces) if len({r for r, _ in p}) > 1)

    @cached_property
    def _crossing_set(self) -> frozenset:
        return frozenset(self.crossing_docs)

    def is_crossing(self, doc: int) -> bool:
        return doc in self._crossing_set

    def crossing_segments(self, rank: int) -> tuple[Segment, ...]:
        """``rank``'s segments of crossing documents, in local order."""
        return tuple(s for s in self.segments[rank] if s.doc >= 0 and s.doc in self._crossing_set)

    @cached_property
    def _groups(self) -> tuple[tuple[tuple[int, int, int], ...], ...]:
        out = []
        for segs in self.segments:
            groups: list[list[int]] = []
            for s in segs:
                if s.doc < 0:
                    continue
                if groups and groups[-1][0] == s.doc:
                    groups[-1][2] += s.length
                else:
                    groups.append([s.doc, s.local_start, s.length])
            out.append(tuple(tuple(g) for g in groups))
        return tuple(out)

    def groups(self, rank: int) -> tuple[tuple[int, int, int], ...]:
        """``(doc, local_start, length)`` of every document on ``rank`` (its segments there
        concatenated, invariant 1), in local order; padding excluded."""
        return self._groups[rank]

    def local_cu_seqlens(self, rank: int) -> tuple[int, ...]:
        """Boundaries of ``rank``'s document groups in its shard, ``(0, …, real_len(rank))``:
        what a local varlen causal kernel takes (padding, after them, excluded)."""
        out = [0]
        for _, start, n in self._groups[rank]:
            out.append(start + n)
        return tuple(out)

    def segment_cu_seqlens(self, rank: int) -> tuple[int, ...]:
        """Boundaries of ``rank``'s segments in its shard (padding excluded), one sequence per
        segment: what a local recurrence takes where state must not flow between a document's
        segments on one rank (zigzag pieces ``j`` and ``2m−1−j`` are not adjacent globally).
        Use :meth:`local_cu_seqlens` (per document) for softmax, :meth:`offset_in_doc` to find
        segments that start their document."""
        out = [0]
        for s in self.segments[rank]:
            if s.doc >= 0:
                out.append(s.local_stop)
        return tuple(out)

    def offset_in_doc(self, seg: Segment) -> int:
        """Tokens of ``seg``'s document before it (0: the segment starts its document)."""
        return seg.start - self.cu_seqlens[seg.doc] if seg.doc >= 0 else 0

    def real_len(self, rank: int) -> int:
        """Tokens of ``rank`` that belong to a document (the rest, at the end, is padding)."""
        g = self._groups[rank]
        return g[-1][1] + g[-1][2] if g else 0

    @cached_property
    def padding(self) -> int:
        """Padding tokens in all shards together (``P·L − cu_seqlens[-1]``)."""
        return self.world_size * self.local_len - self.cu_seqlens[-1]

    @cached_property
    def is_trivial(self) -> bool:
        """One document spanning the row, every shard exactly the unpacked layout's
        (:func:`sp_attention.planning.layout.shard_ranges`): the ops take their unpacked path
        (today's code and speed)."""
        n = num_chunks_for(self.world_size, self.layout)
        if self.num_docs != 1 or self.padding != 0 or self.row_len % n:
            return False
        return all(_merged([(s.start, s.stop) for s in segs])
                   == _merged(shard_ranges(r, self.world_size, self.row_len, self.layout))
                   for r, segs in enumerate(self.segments))

    # -- per-token maps -------------------------------------------------------------------------
    def global_index(self, rank: int) -> torch.Tensor:
        """int64 ``[L]``: position in the padded global row (``P·L``) of each local token."""
        return self._index("global", rank, torch.device("cpu"))

    def position_ids(self, rank: int, device=None) -> torch.Tensor:
        """int64 ``[L]``: each token's position inside its document (restarting at 0 at every
        document start; padding 0). Pass these to RoPE."""
        return self._index("pos", rank, torch.device("cpu") if device is None else
                           torch.device(device))

    def doc_ids(self, rank: int, device=None) -> torch.Tensor:
        """int64 ``[L]``: each local token's document (−1: padding)."""
        return self._index("doc", rank, torch.device("cpu") if device is None else
                           torch.device(device))

    @cached_property
    def _index_cache(self) -> dict:
        return {}

    def _index(self, kind: str, rank: int, device: torch.device) -> torch.Tensor:
        key = (kind, rank, str(device))
        t = self._index_cache.get(key)
        if t is None:
            if rank == -1:          # inverse permutation of the whole padded row
                t = torch.empty(self.world_size * self.local_len, dtype=torch.int64)
                for r in range(self.world_size):
                    t[self.global_index(r)] = torch.arange(r * self.local_len,
                                                           (r + 1) * self.local_len)
            else:
                parts = []
                for s in self.segments[rank]:
                    if kind == "global":
                        parts.append(torch.arange(s.start, s.stop))
                    elif kind == "pos":
                        base = self.cu_seqlens[s.doc] if s.doc >= 0 else s.start
                        fill = torch.arange(s.start - base, s.stop - base)
                        parts.append(fill if s.doc >= 0 else torch.zeros(s.length,
                                                                         dtype=torch.int64))
                    else:
                        parts.append(torch.full((s.length,), s.doc, dtype=torch.int64))
                t = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
            t = to_device(t, device)
            self._index_cache[key] = t
        return t

    # -- data -----------------------------------------------------------------------------------
    def shard(self, x: torch.Tensor, rank: int, dim: int = 1,
              pad_value: Union[int, float] = 0) -> torch.Tensor:
        """Rank ``rank``'s shard ``[…, L, …]`` of the global row ``x`` (length ``row_len``, or
        the padded ``P·L``, along ``dim``): an index gather (a copy, differentiable); tokens
        the plan adds past ``x``'s end get ``pad_value``."""
        dim = dim % x.dim()
        t = x.shape[dim]
        full = self.world_size * self.local_len
        if t not in (self.row_len, full):
            raise ValueError(f"the row has {t} tokens along dim {dim}; this plan shards rows of "
                             f"row_len = {self.row_len} (or {full} padded)")
        if t < full:
            shape = list(x.shape)
            shape[dim] = full - t
            x = torch.cat([x, torch.full(shape, pad_value, dtype=x.dtype, device=x.device)],
                          dim)
        return x.index_select(dim, self._index("global", rank, x.device))

    def unshard(self, shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """Inverse of :meth:`shard`: ``shards[r]`` is rank r's shard; returns the row of
        ``row_len`` tokens along ``dim`` (plan-added padding dropped)."""
        if len(shards) != self.world_size:
            raise ValueError(f"unshard needs {self.world_size} shards, got {len(shards)}")
        dim = dim % shards[0].dim()
        for r, s in enumerate(shards):
            if s.shape[dim] != self.local_len:
                raise ValueError(f"shard {r} has {s.shape[dim]} tokens along dim {dim}, the "
                                 f"plan's local_len is {self.local_len}")
        whole = torch.cat(list(shards), dim)
        inv = self._index("global", -1, whole.device)
        return whole.index_select(dim, inv).narrow(dim, 0, self.row_len)

    def shift_labels(self, labels: torch.Tensor, ignore_index: int = -100,
                     dim: int = -1) -> torch.Tensor:
        """Next-token targets per document on the GLOBAL row (length ``row_len`` along
        ``dim``): ``out[t] = labels[t+1]`` inside a document; a document's last token and
        padding get ``ignore_index``. Shift before sharding (the next token may live on
        another rank), then ``shard`` the result."""
        dim = dim % labels.dim()
        if labels.shape[dim] != self.row_len:
            raise ValueError(f"labels have {labels.shape[dim]} tokens along dim {dim}, the row "
                             f"has row_len = {self.row_len}")
        fill = torch.full_like(labels.narrow(dim, 0, 1), ignore_index)
        out = torch.cat([labels.narrow(dim, 1, self.row_len - 1), fill], dim)
        keep = torch.ones(self.row_len, dtype=torch.bool)
        ends = torch.tensor(self.cu_seqlens[1:], dtype=torch.int64) - 1
        keep[ends] = False
        keep[self.cu_seqlens[-1]:] = False
        shape = [1] * labels.dim()
        shape[dim] = self.row_len
        return out.masked_fill(~keep.to(labels.device).view(shape), ignore_index)

    # -- description ----------------------------------------------------------------------------
    def rank_work(self) -> list[int]:
        """Causal work (visible query-key pairs) of every rank."""
        out = []
        for segs in self.segments:
            out.append(sum(causal_work(s.start - self.cu_seqlens[s.doc], s.length)
                           for s in segs if s.doc >= 0))
        return out

    def describe(self) -> str:
        """One line per rank: its segments as ``doc[start:stop]`` (``pad×n`` for padding),
        crossing documents marked ``*``."""
        lines = []
        for r, segs in enumerate(self.segments):
            parts = []
            for s in segs:
                if s.doc < 0:
                    parts.append(f"pad×{s.length}")
                else:
                    o = s.start - self.cu_seqlens[s.doc]
                    star = "*" if self.is_crossing(s.doc) else ""
                    parts.append(f"d{s.doc}{star}[{o}:{o + s.length}]")
            lines.append(f"rank {r}: " + " ".join(parts))
        return "\n".join(lines)


def _merged(ranges) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1][1] = b
        else:
            out.append([a, b])
    return [tuple(x) for x in out]


def num_chunks_for(world: int, layout: str) -> int:
    return 2 * world if layout == "zigzag" else world


def _local_len(row_len: int, world: int, layout: str) -> int:
    n = num_chunks_for(world, layout)
    return -(-row_len // n) * (n // world)


def plan_packing(cu_seqlens, ctx: Union[GroupLayout, int, None] = None, *,
                 layout: Optional[str] = None, row_len: Optional[int] = None,
                 balance_target: float = BALANCE_TARGET) -> PackingPlan:
    """The packing plan of one packed row over a CP group (cached: the same boundaries give
    the same plan object).

    Args:
        cu_seqlens: document boundaries of the GLOBAL row, ``[N+1]`` int32/int64 tensor (or a
            sequence of ints): 0, …, end of the last document (the same on every rank).
        ctx: the :class:`~sp_attention.SPContext` (its world size and layout), or a world size
            (then ``layout``, default :data:`~sp_attention.DEFAULT_LAYOUT`); None: one rank.
        layout: only with an int ``ctx``; must match ``ctx.layout`` otherwise.
        row_len: the row's length including trailing padding (default ``cu_seqlens[-1]``).
        balance_target: zigzag: cut long documents until max / mean per-rank causal work is
            at most this (fewest cuts that reach it).

    Raises ``TypeError`` / ``ValueError`` naming the fix (see :func:`check_cu_seqlens`).
    """
    world, lay = _world_layout(ctx, layout)
    cu = check_cu_seqlens(cu_seqlens, row_len)
    row = cu[-1] if row_len is None else row_len
    return _PLAN_CACHE.get((cu, world, lay, row, balance_target),
                           lambda: _build(cu, world, lay, row, balance_target))


def _build(cu: tuple[int, ...], world: int, lay: str, row: int, target: float) -> PackingPlan:
    local = _local_len(row, world, lay)
    # The planner allocates many small acyclic objects; with a large heap (torch imported)
    # the cyclic collector's passes would cost more than the planning (measured 3-6x).
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        if lay == "contiguous":
            segs = _contiguous_segments(cu, world, local)
        else:
            segs = _zigzag_segments(cu, world, local, target)
        return PackingPlan(world, lay, row, local, cu, tuple(tuple(s) for s in segs))
    finally:
        if gc_was_on:
            gc.enable()


def _world_layout(ctx, layout) -> tuple[int, str]:
    if isinstance(ctx, GroupLayout):
        if layout is not None and layout != ctx.layout:
            raise ValueError(f"layout={layout!r} contradicts ctx.layout={ctx.layout!r}; drop "
                             "layout= (the plan follows the context)")
        return ctx.world_size, ctx.layout
    if ctx is None:
        ctx = 1
    if isinstance(ctx, bool) or not isinstance(ctx, int) or ctx < 1:
        raise TypeError(f"ctx must be an SPContext or a positive world size, got {ctx!r}")
    lay = DEFAULT_LAYOUT if layout is None else layout
    if lay not in LAYOUTS:
        raise ValueError(f"unknown layout {lay!r}; use one of {LAYOUTS}")
    return ctx, lay


def packing_context(ctx: GroupLayout) -> GroupLayout:
    """The context framework adapters plan packed batches in (Megatron's core attention and
    batches, HF's attention function and ``prepare_cp_batch``, train.py): ``ctx`` itself on
    more than one rank; on one rank the ``contiguous`` layout, whose plan keeps the row in its
    own order (a zigzag plan puts the longest documents first even on one rank), so a packed
    batch that no plan sharded — a framework's own at CP = 1 — is already laid out as its plan
    says."""
    if ctx.world_size == 1 and ctx.layout != "contiguous":
        return dataclasses.replace(ctx, layout="contiguous")
    return ctx


def resolve_plan(cu_seqlens, ctx: GroupLayout, local_len: int, device=None, *,
                 row_len: Optional[int] = None) -> PackingPlan:
    """What the ops do with their ``cu_seqlens`` argument: a :class:`PackingPlan` is checked
    against ``ctx`` and the local length; a tensor gives the cached plan for its values (a tensor
    object seen before, unmodified, costs no device→host copy). ``row_len``: the row's length
    with its trailing padding, for boundaries that end before it (an adapter passes
    ``P · local_len``: its shards are the whole padded row). Raises naming the fix."""
    if isinstance(cu_seqlens, PackingPlan):
        plan = cu_seqlens
        if plan.world_size != ctx.world_size or (plan.layout != ctx.layout
                                                 and ctx.world_size > 1):
            raise ValueError(f"the PackingPlan was built for {plan.world_size} ranks, layout "
                             f"{plan.layout!r}; this op runs on {ctx.world_size} ranks, layout "
                             f"{ctx.layout!r}: build it with plan_packing(cu_seqlens, ctx)")
    else:
        if isinstance(cu_seqlens, torch.Tensor) and device is not None \
                and cu_seqlens.device.type != "cpu" \
                and cu_seqlens.device != torch.device(device):
            raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {device}; "
                             "pass it on the CPU or on q's device")
        plan = _plan_of_tensor(cu_seqlens, ctx, row_len) \
            if isinstance(cu_seqlens, torch.Tensor) else plan_packing(cu_seqlens, ctx,
                                                                      row_len=row_len)
    if plan.local_len != local_len:
        raise ValueError(
            f"the packing plan gives every rank {plan.local_len} tokens (row of {plan.row_len}, "
            f"cu_seqlens ending at {plan.cu_seqlens[-1]}) but q has T_local = {local_len}. "
            f"cu_seqlens must describe the global row these shards came from (P·T_local = "
            f"{ctx.world_size * local_len} tokens) and end at its length; shard the row with "
            "plan.shard, and if it ends in padding build the plan with "
            "sp_attention.plan_packing(cu_seqlens, ctx, row_len=...) and pass the plan")
    return plan


def _plan_of_tensor(t: torch.Tensor, ctx: GroupLayout,
                    row_len: Optional[int] = None) -> PackingPlan:
    key = (id(t), ctx.world_size, ctx.layout, row_len)
    if _TENSOR_PLANS.touch(key):
        ref, version, plan = _TENSOR_PLANS.get(key, lambda: None)
        if ref() is t and version == t._version:
            return plan
    plan = plan_packing(t, ctx, row_len=row_len)
    _TENSOR_PLANS.put(key, (weakref.ref(t), t._version, plan))
    return plan

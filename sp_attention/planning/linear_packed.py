"""Pure arithmetic of packed-document linear attention across ranks, from a packing plan.

A document start resets the state (``S = 0`` before its first token; no decay or gate carries
across a boundary). From a :class:`~sp_attention.planning.packing.PackingPlan` (every rank's
segments), with no tensor and no process group:

* **Local sequences** (:attr:`LinearPacking.pieces`): every segment of a document on this rank
  is one sequence of the local varlen computation: a whole document starts from zero; a
  segment of a *crossing* document (one with tokens on several ranks) starts from the state
  the scan brings (zero if the segment starts its document). Padding (at the end of the
  shard) is no sequence: its outputs and gradients are zero.
* **Scan elements** (:attr:`LinearPacking.holders`): only crossing segments enter the
  cross-rank scan, one element each, in global order (``position`` = rank of the segment's
  start among all crossing segments). The element of a segment that starts its document has
  ``A = 0`` (nothing passes through the reset) and no state-gradient contribution ``d`` (no
  token of it reads the incoming state); otherwise ``A = exp(Σ g)`` over the segment, ``b`` its
  end state from zero, ``d = scale Σ_i exp(G_i) q_iᵀ dO_i``. With these, the same exclusive
  scan that carries one long sequence carries every crossing document at once: a reset
  element cuts the prefix (forward) and contributes nothing to the suffix (backward), so no
  state or gradient leaks between documents. A rank's element count is its number of
  crossing segments: it grows with the boundaries a plan cuts, not with the documents held.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from .packing import PackingPlan

__all__ = ["Piece", "LinearPacking", "linear_packing"]


@dataclass(frozen=True)
class Piece:
    """A local sequence: tokens ``[local_start, local_start + length)`` of the shard, of
    document ``doc``; ``position``: its scan position (−1: a whole document on this rank);
    ``first``: it starts its document (the state entering it is zero)."""

    local_start: int
    length: int
    doc: int
    position: int
    first: bool

    @property
    def local_stop(self) -> int:
        return self.local_start + self.length

    @property
    def crossing(self) -> bool:
        return self.position >= 0


@dataclass(frozen=True)
class LinearPacking:
    """The linear-attention view of a plan for one rank (get it with :func:`linear_packing`).

    Attributes:
        rank, world_size, local_len: as in the plan.
        pieces: this rank's local sequences in local order (padding excluded).
        holders: for every scan position (crossing segments of all ranks, in global order),
            the rank holding it.
        first: for every scan position, whether its segment starts its document.
    """

    rank: int
    world_size: int
    local_len: int
    pieces: tuple[Piece, ...]
    holders: tuple[int, ...]
    first: tuple[bool, ...]

    @property
    def num_elements(self) -> int:
        """Scan elements of the whole group (0: no document crosses a rank boundary)."""
        return len(self.holders)

    @functools.cached_property
    def crossing(self) -> tuple[Piece, ...]:
        """This rank's crossing pieces (its scan elements) in global (scan) order, the order
        the scans take a rank's elements in (the plan's local order may differ)."""
        return tuple(sorted((p for p in self.pieces if p.crossing), key=lambda p: p.position))

    @property
    def real_len(self) -> int:
        """Tokens of documents on this rank (padding follows, up to ``local_len``)."""
        return self.pieces[-1].local_stop if self.pieces else 0

    @functools.cached_property
    def cu_seqlens(self) -> tuple[int, ...]:
        """Boundaries of the local sequences ``(0, …, real_len)`` for a varlen kernel."""
        return (0,) + tuple(p.local_stop for p in self.pieces)

    @functools.cached_property
    def max_elements(self) -> int:
        """The most scan elements any rank holds (the all-gather pads every rank to it)."""
        counts = [0] * self.world_size
        for r in self.holders:
            counts[r] += 1
        return max(counts)


@functools.lru_cache(maxsize=256)
def linear_packing(plan: PackingPlan, rank: int) -> LinearPacking:
    """The :class:`LinearPacking` of ``rank`` under ``plan`` (pure host arithmetic, cached per
    plan and rank: every layer of a batch shares it)."""
    if not 0 <= rank < plan.world_size:
        raise ValueError(f"rank {rank} is not in a plan of {plan.world_size} ranks")
    crossing = sorted(((s.start, r, s) for r, segs in enumerate(plan.segments) for s in segs
                       if s.doc >= 0 and plan.is_crossing(s.doc)), key=lambda x: x[0])
    position = {(r, s.start): i for i, (_, r, s) in enumerate(crossing)}
    holders = tuple(r for _, r, _ in crossing)
    first = tuple(s.start == plan.cu_seqlens[s.doc] for _, _, s in crossing)
    pieces = tuple(Piece(s.local_start, s.length, s.doc, position.get((rank, s.start), -1),
                         s.start == plan.cu_seqlens[s.doc])
                   for s in plan.segments[rank] if s.doc >= 0)
    for a, b in zip(pieces, pieces[1:]):
        if b.local_start != a.local_stop:
            raise AssertionError("plan segments of documents must tile the shard's start")
    return LinearPacking(rank, plan.world_size, plan.local_len, pieces, holders, first)

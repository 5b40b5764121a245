"""The scan element of linear attention with decay and what every scan schedule shares.

Element of leaf ℓ: ``e = (A, b)`` with ``A = λ^C`` (``[B, H]``) and ``b`` the leaf's state from a
zero start (``[B, H, K, V]``). Operator (associative, not commutative)::

    (A₁, b₁) ⊕ (A₂, b₂) = (A₂·A₁, A₂·b₁ + b₂),   identity (1, 0)

A schedule receives the elements of this rank's leaves and returns, per leaf, the ``b`` part of
the exclusive prefix (the state entering the leaf). ``reverse=True`` runs the same scan right
to left, which turns state-gradient contributions into the gradient arriving at each leaf's end
from later leaves (backward). All cross-rank math is in fp32 (fp64 when the inputs are fp64).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..context import SPContext
from ..planning.layout import holder_of_leaf


@dataclass
class Element:
    """One scan element: ``A [B, H]`` and ``b [B, H, K, V]``."""

    A: torch.Tensor
    b: torch.Tensor

    def then(self, later: "Element") -> "Element":
        """``self ⊕ later``: first ``self``, then ``later``."""
        return Element(later.A * self.A, later.A[..., None, None] * self.b + later.b)

    def pack(self) -> torch.Tensor:
        """One flat buffer so an element crosses the network as one message."""
        return torch.cat([self.A.reshape(-1), self.b.reshape(-1)])

    def unpack_like(self, flat: torch.Tensor) -> "Element":
        n = self.A.numel()
        return Element(flat[:n].view_as(self.A), flat[n:].view_as(self.b))

    @staticmethod
    def pack_all(elements: list) -> torch.Tensor:
        """Several elements in one flat buffer, in order (one message for all of them)."""
        return torch.cat([t.reshape(-1) for e in elements for t in (e.A, e.b)])

    def unpack_all_like(self, flat: torch.Tensor) -> list:
        """Inverse of :meth:`pack_all` for elements shaped like this one."""
        n = self.A.numel() + self.b.numel()
        return [self.unpack_like(flat[i:i + n]) for i in range(0, flat.numel(), n)]

    def empty_packed(self, count: int) -> torch.Tensor:
        """A receive buffer for ``count`` elements shaped like this one."""
        return torch.empty(count * (self.A.numel() + self.b.numel()),
                           dtype=torch.promote_types(self.A.dtype, self.b.dtype),
                           device=self.b.device)

    @staticmethod
    def identity_like(e: "Element") -> "Element":
        return Element(torch.ones_like(e.A), torch.zeros_like(e.b))


class ScanMap:
    """Where the scan's elements live, in scan order (positions), for one rank: the leaves of
    the layout (:func:`leaf_map`), or any explicit holder list, e.g. the crossing segments of
    packed documents (:func:`element_map`). A rank's elements are passed to a scan in
    ascending global order; ``local_positions`` gives their scan positions in that order."""

    def __init__(self, rank: int, holders: tuple, reverse: bool):
        num = len(holders)
        self.rank, self.reverse, self.num = rank, reverse, num
        mine = [p for p, r in enumerate(holders) if r == rank]       # global order
        self.local_positions = [num - 1 - p if reverse else p for p in mine]
        self._holders = tuple(holders[::-1]) if reverse else tuple(holders)
        counts: dict = {}
        for r in holders:
            counts[r] = counts.get(r, 0) + 1
        self.max_per_rank = max(counts.values()) if counts else 0
        # all-gather layout: rank r's i-th element (global order) in row r·max_per_rank + i
        seen: dict = {}
        rows = []
        for r in holders:
            rows.append(r * self.max_per_rank + seen.get(r, 0))
            seen[r] = seen.get(r, 0) + 1
        self.rows = tuple(rows[::-1]) if reverse else tuple(rows)
        self._key = (rank, tuple(holders), reverse)

    def __eq__(self, other) -> bool:
        return isinstance(other, ScanMap) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def holder(self, position: int) -> int:
        """Group rank holding scan position ``position``."""
        return self._holders[position]

    def is_mine(self, position: int) -> bool:
        return self._holders[position] == self.rank

    def row(self, position: int) -> int:
        """Row of ``position``'s element in the all-gathered buffer."""
        return self.rows[position]


@functools.lru_cache(maxsize=256)
def element_map(rank: int, holders: tuple, reverse: bool) -> ScanMap:
    """The :class:`ScanMap` of an explicit holder list (forward scan order), cached."""
    return ScanMap(rank, tuple(holders), bool(reverse))


def leaf_map(ctx: SPContext, reverse: bool) -> ScanMap:
    """This rank's :class:`ScanMap` of the layout's leaves: pure rank arithmetic, built once
    per (rank, world size, layout, direction) — the scans run on every layer call and the
    step is host-bound."""
    return _leaf_map(ctx.rank, ctx.world_size, ctx.layout, ctx.num_leaves, bool(reverse))


@functools.lru_cache(maxsize=256)
def _leaf_map(rank: int, world: int, layout: str, num: int, reverse: bool) -> ScanMap:
    holders = tuple(holder_of_leaf(p, world, layout) for p in range(num))
    return ScanMap(rank, holders, reverse)


def scan_map(ctx: SPContext, reverse: bool, holders) -> ScanMap:
    """The map a scan runs on: the layout's leaves (``holders`` None) or ``holders``."""
    return leaf_map(ctx, reverse) if holders is None else element_map(ctx.rank, holders,
                                                                       reverse)


def check_elements(A: list, b: list, ctx: SPContext, leaves: ScanMap) -> None:
    n = len(leaves.local_positions)
    if len(A) != n or len(b) != n:
        raise ValueError(f"this rank holds {n} scan elements ({ctx.layout}); got {len(A)} A "
                         f"and {len(b)} b elements")

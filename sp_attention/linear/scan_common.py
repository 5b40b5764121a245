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
from ..layout import holder_of_leaf, leaves_of_rank, scan_position


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
    def identity_like(e: "Element") -> "Element":
        return Element(torch.ones_like(e.A), torch.zeros_like(e.b))


class LeafMap:
    """Where the leaves of the scan live, in scan order (positions), for one rank.
    Get one with :func:`leaf_map` (cached)."""

    def __init__(self, rank: int, world_size: int, layout: str, num: int, reverse: bool):
        self.reverse, self.num = reverse, num
        self.local_leaves = leaves_of_rank(rank, world_size, layout)   # global ids, shard order
        self.local_positions = [scan_position(l, num, reverse) for l in self.local_leaves]
        self._holders = tuple(holder_of_leaf(scan_position(p, num, reverse), world_size, layout)
                              for p in range(num))

    def holder(self, position: int) -> int:
        """Group rank holding scan position ``position``."""
        return self._holders[position]

    def is_mine(self, position: int) -> bool:
        return position in self.local_positions


def leaf_map(ctx: SPContext, reverse: bool) -> LeafMap:
    """This rank's :class:`LeafMap`: pure rank arithmetic, built once per (rank, world size,
    layout, direction) — the scans run on every layer call and the step is host-bound."""
    return _leaf_map(ctx.rank, ctx.world_size, ctx.layout, ctx.num_leaves, bool(reverse))


_leaf_map = functools.lru_cache(maxsize=256)(LeafMap)


def check_elements(A: list, b: list, ctx: SPContext) -> None:
    n = len(ctx.leaves)
    if len(A) != n or len(b) != n:
        raise ValueError(f"this rank holds {n} leaves ({ctx.layout}); got {len(A)} A and "
                         f"{len(b)} b elements")

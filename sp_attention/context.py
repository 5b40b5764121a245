"""`SPContext`: everything a context-parallel op needs to know about its process group.

Built once at the edge (from Megatron's CP group, a DeviceMesh dimension, or a plain
`dist.new_group`) and passed explicitly to every public function. No module-level group
globals: two models with different CP groups can live in one process.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist

LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class SPContext:
    """A context-parallel group and how the sequence is laid out over it.

    Attributes:
        group: the CP process group; None only when ``world_size == 1``.
        rank: this process's rank *inside* ``group`` (0 … world_size−1).
        world_size: number of ranks ``P`` in the group.
        global_ranks: global rank of every group rank, in group-rank order. Point-to-point ops
            on a subgroup take global ranks; this maps group-rank arithmetic onto them.
        layout: ``"zigzag"`` (the sequence is cut into 2P chunks; rank r holds chunks r and
            2P−1−r — Megatron's split, causal-balanced) or ``"contiguous"`` (rank r holds the
            r-th of P equal pieces).
    """

    group: Optional[dist.ProcessGroup]
    rank: int
    world_size: int
    global_ranks: tuple[int, ...] = field(default=())
    layout: str = "zigzag"

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"SPContext.world_size must be a positive int, got {self.world_size!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"SPContext.rank={self.rank} is outside the group of size {self.world_size}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; use one of {LAYOUTS}")
        if self.world_size > 1 and self.group is None:
            raise ValueError("a world_size > 1 SPContext needs a process group; pass group=...")
        if self.global_ranks and len(self.global_ranks) != self.world_size:
            raise ValueError(
                f"global_ranks has {len(self.global_ranks)} entries for world_size {self.world_size}")
        if not self.global_ranks:
            # Single-process context: the only member is "rank 0" of nothing.
            object.__setattr__(self, "global_ranks", tuple(range(self.world_size)))

    @property
    def num_leaves(self) -> int:
        """Number of contiguous sequence pieces in global order (P or 2P)."""
        return 2 * self.world_size if self.layout == "zigzag" else self.world_size

    @property
    def leaves(self) -> tuple[int, ...]:
        """Global indices of the pieces this rank holds, in the order they sit in its shard."""
        from .layout import leaves_of_rank

        return leaves_of_rank(self.rank, self.world_size, self.layout)

    def global_rank(self, group_rank: int) -> int:
        """Global rank of ``group_rank`` (for p2p ops, which address global ranks)."""
        return self.global_ranks[group_rank % self.world_size]


def build_sp_context(group: Optional[dist.ProcessGroup] = None, layout: str = "zigzag",
                     ) -> SPContext:
    """Build an :class:`SPContext` from a process group.

    ``group=None`` with torch.distributed uninitialised (or a group of one) gives a world-size-1
    context that runs everything locally. ``group=None`` with an initialised default group is
    refused: the plugin never defaults to WORLD, pass the CP group explicitly.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; use one of {LAYOUTS}")
    if group is None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(
                "build_sp_context(group=None) with an initialised multi-process default group is "
                "ambiguous; pass the context-parallel group explicitly (e.g. "
                "parallel_state.get_context_parallel_group()).")
        return SPContext(None, 0, 1, (0,), layout)
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup, got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given group; build the context from "
                         "the group this rank belongs to")
    size = dist.get_world_size(group)
    ranks = tuple(dist.get_process_group_ranks(group))
    return SPContext(group if size > 1 else None, rank, size, ranks, layout)


"""Pure rank arithmetic: sequence layouts (their names and the default), ring neighbours and
the tree-scan partner schedule.

Nothing here touches a process group; every function maps integers to integers so it can be
unit-tested for any P without spawning processes. All ranks are *group* ranks; map them to
global ranks with ``SPContext.global_rank`` at the point of communication.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

LAYOUTS = ("contiguous", "zigzag")
# The one default: Megatron's split (causal-balanced, what its RoPE and softmax layers assume).
# Every builder and adapter that does not name a layout reads this constant
# (sp_attention.DEFAULT_LAYOUT, through sp_attention.context).
DEFAULT_LAYOUT = "zigzag"



@runtime_checkable
class GroupLayout(Protocol):
    """What the planners read of a context-parallel group: its size and how the sequence is laid
    out over it (an :class:`~sp_attention.SPContext` is one; the planners never communicate)."""

    world_size: int
    layout: str


# The one padding helper every error message about sequence lengths names.
PAD_HELPER = "sp_attention.pad_for_layout"


def _check_world(world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size must be a positive int, got {world_size!r}")


def _check_rank(rank: int, world_size: int) -> None:
    _check_world(world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of size {world_size}")


def num_chunks(world_size: int, layout: str) -> int:
    """Equal pieces the sequence is cut into: 2P for zigzag, P for contiguous."""
    _check_world(world_size)
    if layout == "zigzag":
        return 2 * world_size
    if layout == "contiguous":
        return world_size
    raise ValueError(f"unknown layout {layout!r}; use 'contiguous' or 'zigzag'")


def zigzag_chunk_ids(rank: int, world_size: int) -> tuple[int, int]:
    """Chunks of 2P held by ``rank`` under zigzag: ``(r, 2P−1−r)`` (Megatron's split)."""
    _check_rank(rank, world_size)
    return rank, 2 * world_size - 1 - rank


@functools.lru_cache(maxsize=1024)
def leaves_of_rank(rank: int, world_size: int, layout: str) -> tuple[int, ...]:
    """Global chunk indices held by ``rank``, in the order they are concatenated in its shard."""
    _check_rank(rank, world_size)
    if layout == "zigzag":
        return zigzag_chunk_ids(rank, world_size)
    num_chunks(world_size, layout)  # validates the name
    return (rank,)


def holder_of_leaf(leaf: int, world_size: int, layout: str) -> int:
    """Group rank that holds global chunk ``leaf``."""
    n = num_chunks(world_size, layout)
    if not 0 <= leaf < n:
        raise ValueError(f"chunk {leaf} is outside 0..{n - 1}")
    if layout == "zigzag":
        return leaf if leaf < world_size else n - 1 - leaf
    return leaf


def chunk_size(seq_len: int, world_size: int, layout: str) -> int:
    """Tokens per chunk; raises if ``seq_len`` does not split evenly."""
    n = num_chunks(world_size, layout)
    if seq_len <= 0 or seq_len % n:
        raise ValueError(
            f"sequence length {seq_len} cannot be split into {n} equal chunks for layout "
            f"{layout!r} with world size {world_size}; pad it to a multiple of {n} with "
            f"{PAD_HELPER}")
    return seq_len // n


def shard_ranges(rank: int, world_size: int, seq_len: int, layout: str) -> tuple[tuple[int, int], ...]:
    """Half-open global token ranges ``[start, end)`` held by ``rank``, in shard order."""
    c = chunk_size(seq_len, world_size, layout)
    return tuple((i * c, (i + 1) * c) for i in leaves_of_rank(rank, world_size, layout))


def contiguous_range(rank: int, world_size: int, seq_len: int) -> tuple[int, int]:
    """``[start, end)`` of rank's piece under the contiguous layout."""
    return shard_ranges(rank, world_size, seq_len, "contiguous")[0]


def ring_neighbors(rank: int, world_size: int) -> tuple[int, int]:
    """``(previous, next)`` group ranks on the ring ``0 → 1 → … → P−1 → 0``."""
    _check_rank(rank, world_size)
    return (rank - 1) % world_size, (rank + 1) % world_size


def ring_source(rank: int, world_size: int, step: int) -> int:
    """Group rank whose block arrives at ``rank`` after ``step`` hops along the ring."""
    _check_rank(rank, world_size)
    return (rank - step) % world_size


# ---------------------------------------------------------------------------------------------
# Work-efficient (Blelloch) tree scan over L leaves, any L.
#
# Positions 0..L−1 hold elements in scan order. The tree is the classic stride tree clipped at
# the right edge: at level d (stride s = 2^d) node i = (m+1)·2s − 1 combines its left child,
# whose aggregate sits at position i − s, with its right child, whose aggregate sits at
# min(i, L−1). Clipping instead of padding keeps non-powers of two exact with no phantom ranks:
# a node whose left child already lies at or past the clipped right end has no work.
#
# Up-sweep (levels 0 … D−1): right ← left ⊕ right   (one message left → right).
# Down-sweep (levels D−1 … 0), the root's prefix being the identity at position L−1:
#   with p the prefix held at the right position and a the left subtree's aggregate,
#   left ← p, right ← p ⊕ a   (an exchange: each side sends its value to the other).
# After the down-sweep every position holds its exclusive prefix.
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ScanPair:
    """One tree node in one round: the left child's aggregate lives at ``left``, the right's at
    ``right`` (positions in scan order)."""

    left: int
    right: int


@dataclass(frozen=True)
class ScanSchedule:
    """Rounds of the tree scan over ``num_leaves`` positions.

    ``up[d]`` and ``down[j]`` list the node pairs active in each round; every position takes part
    in at most one pair per round, so each round is one ``batch_isend_irecv``.
    """

    num_leaves: int
    up: tuple[tuple[ScanPair, ...], ...]
    down: tuple[tuple[ScanPair, ...], ...]

    @property
    def num_rounds(self) -> int:
        return len(self.up) + len(self.down)


def scan_depth(num_leaves: int) -> int:
    """⌈log2 L⌉: levels of the scan tree."""
    _check_world(num_leaves)
    return (num_leaves - 1).bit_length()


def tree_scan_schedule(num_leaves: int) -> ScanSchedule:
    """Partner schedule of the work-efficient exclusive scan over ``num_leaves`` positions:
    ⌈log2 L⌉ up-sweep rounds then as many down-sweep rounds (2⌈log2 L⌉ in all)."""
    depth = scan_depth(num_leaves)
    levels = []
    for d in range(depth):
        s = 1 << d
        pairs = []
        for i in range(2 * s - 1, num_leaves - 1 + 2 * s, 2 * s):
            right = min(i, num_leaves - 1)
            left = i - s
            if left < right:
                pairs.append(ScanPair(left, right))
        levels.append(tuple(pairs))
    return ScanSchedule(num_leaves, tuple(levels), tuple(reversed(levels)))


# Kinds of a pair in a round of :func:`tree_scan_rounds`.
UP, DOWN, SPINE = "up", "down", "spine"


def tree_scan_rounds(num_leaves: int) -> tuple:
    """The rounds of :func:`tree_scan_schedule` an *exclusive* scan needs: per round, the
    ``(ScanPair, kind)`` that do work, every empty round dropped.

    ``up``: ``right ← left ⊕ right``. The last position's up-sweep values are dead (the root
    takes the identity before the down-sweep reads it), so every up pair into it is dropped —
    the whole top round among them. ``down``: ``left ← right`` (the parent's prefix),
    ``right ← right ⊕ left``. ``spine``: a down pair whose parent prefix is the identity (the
    leftmost path from the root): the left becomes the identity without a message and the
    right takes the left's aggregate as it is, so only that aggregate travels. 2⌈log2 L⌉ − 1
    rounds (L ≥ 2); the same for every rank (pure arithmetic), so both ends of each message
    agree."""
    sched = tree_scan_schedule(num_leaves)
    last = num_leaves - 1
    rounds = [tuple((p, UP) for p in pairs if p.right != last) for pairs in sched.up]
    identity = {last}               # positions whose value is the identity
    for pairs in sched.down:
        kinds = tuple((p, SPINE if p.right in identity else DOWN) for p in pairs)
        for p, kind in kinds:
            if kind == SPINE:
                identity.discard(p.right)
                identity.add(p.left)
        rounds.append(kinds)
    return tuple(r for r in rounds if r)


def nested_ranks(holders: tuple) -> int:
    """``P`` when ``holders`` (scan order) is the nested pattern ``0, 1, …, P−1, P−1, …, 1, 0``
    of ``P ≥ 2`` ranks — the zigzag layout's leaves, in either direction — else 0.

    Such a scan runs as a tree over the ``P`` ranks instead of the ``2P`` leaves
    (``2⌈log2 P⌉ − 1`` rounds, not ``2⌈log2 2P⌉ − 1``). With ``E1_r`` the element rank ``r``
    holds in the first half (position ``r``) and ``E2_r`` its second (position ``2P−1−r``), three
    exclusive scans over the ranks run in the same rounds: ``X1_r = E1_0 ⊕ … ⊕ E1_{r−1}`` (ranks
    ascending), ``X2_r = E1_{r+1} ⊕ … ⊕ E1_{P−1}`` (ranks descending, the operands swapped so
    that the composition keeps sequence order) and ``X3_r = E2_{P−1} ⊕ … ⊕ E2_{r+1}`` (ranks
    descending). ``E1_r``'s prefix is ``X1_r``; ``E2_r``'s is ``X1_r ⊕ E1_r ⊕ X2_r ⊕ X3_r``:
    every element between the two positions is some ``E1_s`` or ``E2_s`` with ``s > r``."""
    L = len(holders)
    P = L // 2
    if P < 2 or L != 2 * P:
        return 0
    ok = all(holders[p] == p and holders[L - 1 - p] == p for p in range(P))
    return P if ok else 0


def scan_position(leaf: int, num_leaves: int, reverse: bool) -> int:
    """Position of ``leaf`` in scan order; reverse scans (suffixes, for backward) run right to
    left."""
    return num_leaves - 1 - leaf if reverse else leaf

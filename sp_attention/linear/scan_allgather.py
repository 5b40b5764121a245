"""All-gather scan: one fixed-shape all-gather of every leaf's packed fp32 element, then each
rank folds the prefix of its own leaves locally (Horner over at most L−1 elements).

One collective instead of 2⌈log2 L⌉ dependent rounds: the lowest latency for small P within a
node; it moves (P−1)·(per-rank elements) into every rank.
"""
from __future__ import annotations

import torch

from ..comm import all_gather_flat
from ..context import SPContext
from ..layout import leaves_of_rank, scan_position
from .scan_common import Element, LeafMap, check_elements


def allgather_scan(A: list, b: list, ctx: SPContext, reverse: bool = False) -> list:
    """Exclusive prefix (suffix if ``reverse``) ``b`` state for each of this rank's leaves."""
    check_elements(A, b, ctx)
    leaves = LeafMap(ctx, reverse)
    mine = [Element(a, s) for a, s in zip(A, b)]
    local = torch.stack([e.pack() for e in mine])                     # [n_local, numel]
    gathered = torch.empty((ctx.world_size,) + tuple(local.shape), dtype=local.dtype,
                           device=local.device)
    all_gather_flat(gathered, local, ctx)
    by_position = {}
    for r in range(ctx.world_size):
        for i, leaf in enumerate(leaves_of_rank(r, ctx.world_size, ctx.layout)):
            by_position[scan_position(leaf, leaves.num, reverse)] = gathered[r, i]
    out = []
    for e, pos in zip(mine, leaves.local_positions):
        state = torch.zeros_like(e.b)
        for q in range(pos):                                          # Horner, in scan order
            prev = e.unpack_like(by_position[q])
            state = prev.A[..., None, None] * state + prev.b
        out.append(state)
    return out

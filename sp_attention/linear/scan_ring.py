"""Ring (LASP-1 chain) scan, the baseline: the prefix walks the leaves in scan order, one hop
per leaf boundary that crosses ranks (P−1 hops contiguous, 2(P−1) zigzag). Each rank's local
intra-leaf work is done before the scan starts, so only the state waits on the chain.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..comm import p2p_exchange
from ..context import SPContext
from .scan_common import check_elements, scan_map


def ring_scan(A: list, b: list, ctx: SPContext, reverse: bool = False,
              holders: Optional[tuple] = None, like=None) -> list:
    """Exclusive prefix (suffix if ``reverse``) ``b`` state for each of this rank's leaves
    (``holders``: the elements' holders in scan order, default the layout's leaves; ``like``
    is unused here, see :func:`~.scan_allgather.allgather_scan`)."""
    leaves = scan_map(ctx, reverse, holders)
    check_elements(A, b, ctx, leaves)
    if not leaves.local_positions:      # holds no element: takes part in no exchange
        return []
    mine = dict(zip(leaves.local_positions, zip(A, b)))
    incoming = {}
    template = b[0]
    state = None   # running prefix b held by whoever holds the current position; None = zero
    for pos in range(leaves.num):
        holder = leaves.holder(pos)
        if pos > 0:
            src = leaves.holder(pos - 1)
            if src != holder and ctx.rank in (src, holder):
                if ctx.rank == src:
                    works = p2p_exchange([(state.contiguous(), holder)], [], ctx)
                else:
                    state = torch.empty_like(template)
                    works = p2p_exchange([], [(state, src)], ctx)
                for w in works:
                    w.wait()
        if holder != ctx.rank:
            continue
        incoming[pos] = state if state is not None else torch.zeros_like(template)
        if pos + 1 < leaves.num:    # the last leaf's prefix is needed by nobody
            a, bb = mine[pos]
            state = bb if state is None else a[..., None, None] * state + bb
    return [incoming[pos] for pos in leaves.local_positions]

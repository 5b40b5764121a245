"""Blelloch (work-efficient tree) exclusive scan across ranks: 2⌈log2 L⌉ rounds, any L.

Up-sweep: each tree node's right child receives its left sibling's aggregate (one message).
Down-sweep from the identity at the root: the two children exchange values; the left takes the
parent's prefix, the right the prefix ⊕ left aggregate. Partners come from
``layout.tree_scan_schedule``; a rank holding both ends of a pair (zigzag) combines locally.
Each round is one ``batch_isend_irecv`` of single packed fp32 elements.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..comm import p2p_exchange
from ..context import SPContext
from ..layout import tree_scan_schedule
from .scan_common import Element, ScanMap, check_elements, scan_map


def _round(x: dict, pairs, leaves: ScanMap, ctx: SPContext, down: bool) -> None:
    """One round: up-sweep ``right ← left ⊕ right``; down-sweep ``left ← right``,
    ``right ← right ⊕ left``."""
    me = ctx.rank
    template = next(iter(x.values()))
    sends, recvs, arrivals = [], [], []
    for p in pairs:  # same order on every rank -> messages between two ranks match in order
        hl, hr = leaves.holder(p.left), leaves.holder(p.right)
        if hl == me and hr == me:
            left, right = x[p.left], x[p.right]
            if down:
                x[p.left], x[p.right] = right, right.then(left)
            else:
                x[p.right] = left.then(right)
            continue
        if hl == me:
            sends.append((x[p.left].pack(), hr))
            if down:
                buf = torch.empty_like(sends[-1][0])
                recvs.append((buf, hr))
                arrivals.append((p, buf, "left"))
        elif hr == me:
            buf = torch.empty_like(template.pack())
            recvs.append((buf, hl))
            arrivals.append((p, buf, "right"))
            if down:
                sends.append((x[p.right].pack(), hl))
    for w in p2p_exchange(sends, recvs, ctx):
        w.wait()
    for p, buf, side in arrivals:
        other = template.unpack_like(buf)
        if side == "right":   # this rank holds the right end; `other` is the left value
            x[p.right] = x[p.right].then(other) if down else other.then(x[p.right])
        else:                 # this rank holds the left end; `other` is the parent prefix
            x[p.left] = other


def blelloch_scan(A: list, b: list, ctx: SPContext, reverse: bool = False,
                  holders: Optional[tuple] = None, like=None) -> list:
    """Exclusive prefix (suffix if ``reverse``) ``b`` state for each of this rank's leaves
    (``holders``: the elements' holders in scan order, default the layout's leaves; ``like``
    is unused here, see :func:`~.scan_allgather.allgather_scan`)."""
    leaves = scan_map(ctx, reverse, holders)
    check_elements(A, b, ctx, leaves)
    if not leaves.local_positions:      # holds no element: takes part in no exchange
        return []
    sched = tree_scan_schedule(leaves.num)
    x = {pos: Element(a, s) for pos, a, s in zip(leaves.local_positions, A, b)}
    for pairs in sched.up:
        _round(x, pairs, leaves, ctx, down=False)
    last = leaves.num - 1
    if leaves.is_mine(last):
        x[last] = Element.identity_like(x[last])
    for pairs in sched.down:
        _round(x, pairs, leaves, ctx, down=True)
    return [x[pos].b for pos in leaves.local_positions]

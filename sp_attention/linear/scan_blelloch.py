"""Blelloch (work-efficient tree) exclusive scan across ranks: 2⌈log2 L⌉ rounds, any L.

Up-sweep: each tree node's right child receives its left sibling's aggregate (one message).
Down-sweep from the identity at the root: the two children exchange values; the left takes the
parent's prefix, the right the prefix ⊕ left aggregate. Partners come from
``layout.tree_scan_schedule``; a rank holding both ends of a pair (zigzag) combines locally.
Each round is one ``batch_isend_irecv`` with at most one message per peer and direction: the
elements a rank sends one peer in a round (zigzag: two leaves whose partners sit on the same
rank; packed documents: any number) travel packed in one flat fp32 buffer, in the order of the
round's pairs, which both ends know from the schedule. (gloo's ``batch_isend_irecv`` has a slow
mode with two messages to one peer.)
"""
from __future__ import annotations

from typing import Optional

from ..comm import p2p_exchange
from ..context import SPContext
from ..planning.layout import tree_scan_schedule
from .scan_common import Element, ScanMap, check_elements, scan_map


def _round(x: dict, pairs, leaves: ScanMap, ctx: SPContext, down: bool) -> None:
    """One round: up-sweep ``right ← left ⊕ right``; down-sweep ``left ← right``,
    ``right ← right ⊕ left``."""
    me = ctx.rank
    template = next(iter(x.values()))
    out: dict = {}        # peer -> the elements this rank sends it, in pair order
    arrivals: dict = {}   # peer -> (pair, the end this rank holds) of each element it receives
    for p in pairs:  # same order on every rank -> both ends agree on each buffer's layout
        hl, hr = leaves.holder(p.left), leaves.holder(p.right)
        if hl == me and hr == me:
            left, right = x[p.left], x[p.right]
            if down:
                x[p.left], x[p.right] = right, right.then(left)
            else:
                x[p.right] = left.then(right)
            continue
        if hl == me:
            out.setdefault(hr, []).append(x[p.left])
            if down:
                arrivals.setdefault(hr, []).append((p, "left"))
        elif hr == me:
            arrivals.setdefault(hl, []).append((p, "right"))
            if down:
                out.setdefault(hl, []).append(x[p.right])
    sends = [(Element.pack_all(els), peer) for peer, els in sorted(out.items())]
    recvs = [(template.empty_packed(len(arr)), peer) for peer, arr in sorted(arrivals.items())]
    for w in p2p_exchange(sends, recvs, ctx):
        w.wait()
    for buf, peer in recvs:
        for (p, side), other in zip(arrivals[peer], template.unpack_all_like(buf)):
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

"""Blelloch (work-efficient tree) exclusive scan across ranks: 2⌈log2 L⌉ − 1 rounds, any L.

Up-sweep: each tree node's right child receives its left sibling's aggregate (one message).
Down-sweep from the identity at the root: the two children exchange values; the left takes the
parent's prefix, the right the prefix ⊕ left aggregate. Partners come from
``layout.tree_scan_rounds``, which leaves out what an exclusive scan never reads (every up-sweep
value of the last position, so the top round) and the identity the leftmost path would carry
down (there the left becomes the identity without a message): at L = 2 one message, as the
ring. A rank holding both ends of a pair (zigzag) combines locally.
Each round is one batched exchange with at most one message per peer and direction: the
elements a rank sends one peer in a round (zigzag: two leaves whose partners sit on the same
rank; packed documents: any number) travel packed in one flat buffer, in the order of the
round's pairs, which both ends know from the schedule. (gloo's ``batch_isend_irecv`` has a slow
mode with two messages to one peer.)

The schedule compiles once per element map into a :class:`~.scan_common.Program` (which row
holds which position's value, what travels where); a call runs its tensor operations and
messages only (two in-place operations per combine, none for a copy: a value that moves is
renamed at compile time).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ..comm import p2p_exchange
from ..context import SPContext
from ..planning.layout import DOWN, SPINE, tree_scan_rounds
from .scan_common import (IDENTITY, Program, ProgramBuilder, ScanMap, Step, rows_to_list,
                          run_program)


def _round(pb: ProgramBuilder, pairs) -> None:
    """One round of ``(ScanPair, kind)``: ``up`` ``right ← left ⊕ right``; ``down``
    ``left ← right``, ``right ← right ⊕ left``; ``spine`` (the right holds the identity)
    ``left ← identity``, ``right ← left``, only the left's aggregate travelling."""
    leaves, me = pb.leaves, pb.leaves.rank
    pre, post, out, arrivals = [], [], {}, {}
    for p, kind in pairs:  # same order on every rank -> both ends agree on each buffer's layout
        hl, hr = leaves.holder(p.left), leaves.holder(p.right)
        if hl == me and hr == me:
            left, right = pb.row[p.left], pb.row[p.right]
            if kind == SPINE:           # a rename: the left's aggregate moves right
                pb.row[p.left], pb.row[p.right] = IDENTITY, left
            elif kind == DOWN:   # the prefix ⊕ left aggregate, into the aggregate's row
                pb.fold(pre, left, right)
                pb.row[p.left], pb.row[p.right] = right, left
            else:
                pb.fold(pre, right, left)
            continue
        if hl == me:
            out.setdefault(hr, []).append(pb.row[p.left])
            if kind == DOWN:
                arrivals.setdefault(hr, []).append((p, "left"))
            elif kind == SPINE:
                pb.row[p.left] = IDENTITY
        elif hr == me:
            arrivals.setdefault(hl, []).append((p, kind))
            if kind == DOWN:
                out.setdefault(hl, []).append(pb.row[p.right])
    recvs = []
    for peer, arr in sorted(arrivals.items()):
        first = pb.receive(len(arr))
        recvs.append((peer, first, len(arr)))
        for got, (p, what) in enumerate(arr, start=first):
            if what == "left":          # the parent's prefix
                pb.row[p.left] = got
            elif what == DOWN:          # the prefix ⊕ the left aggregate that arrived
                pb.fold(post, got, pb.row[p.right])
                pb.row[p.right] = got
            elif what == SPINE:         # the left aggregate is the right's prefix
                pb.row[p.right] = got
            else:                       # the left aggregate ⊕ this right one
                pb.fold(post, pb.row[p.right], got)
    pb.steps.append(Step(tuple(pre), tuple((peer, tuple(r)) for peer, r in sorted(out.items())),
                         tuple(recvs), tuple(post)))


@functools.lru_cache(maxsize=256)
def compile_blelloch(leaves: ScanMap) -> Program:
    """The tree scan of this rank's elements (pure rank arithmetic, cached per map): the
    rounds of :func:`~sp_attention.planning.layout.tree_scan_rounds` (dead up-sweep work and
    identity messages left out)."""
    pb = ProgramBuilder(leaves)
    if leaves.local_positions:          # a rank holding no element takes part in no exchange
        if leaves.is_mine(leaves.num - 1):
            pb.row[leaves.num - 1] = IDENTITY   # its up-sweep values are dead
        for pairs in tree_scan_rounds(leaves.num):
            _round(pb, pairs)
    return pb.finish()


def blelloch_rows(A: torch.Tensor, b: torch.Tensor, ctx: SPContext, reverse: bool = False,
                  holders: Optional[tuple] = None, graphs: bool = False) -> torch.Tensor:
    """This rank's elements as rows (``A [n, …]``, ``b [n, …]``, ascending global order) ->
    the exclusive prefix (suffix if ``reverse``) ``b`` of each, ``[n, n_a, kv]``."""
    return run_program("blelloch", compile_blelloch, A, b, ctx, reverse, holders, graphs, p2p_exchange)


def blelloch_scan(A: list, b: list, ctx: SPContext, reverse: bool = False,
                  holders: Optional[tuple] = None, like=None) -> list:
    """Exclusive prefix (suffix if ``reverse``) ``b`` state for each of this rank's leaves
    (``holders``: the elements' holders in scan order, default the layout's leaves; ``like``
    is unused here, see :func:`~.scan_allgather.allgather_scan`)."""
    return rows_to_list(blelloch_rows, A, b, ctx, reverse, holders, like)

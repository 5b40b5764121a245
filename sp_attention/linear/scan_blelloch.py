"""Blelloch (work-efficient tree) exclusive scan across ranks: 2⌈log2 L⌉ − 1 rounds, any L;
the zigzag layout's 2P leaves in 2⌈log2 P⌉ − 1 (a tree over the ranks, three scans per round:
:func:`~sp_attention.planning.layout.nested_ranks`, :func:`_compile_nested`).

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
from ..planning.layout import DOWN, SPINE, nested_ranks, tree_scan_rounds
from .scan_common import (IDENTITY, Program, ProgramBuilder, ScanMap, Step, rows_to_list,
                          run_program)


class _Sub:
    """One exclusive scan in a program's rounds: who holds each position, which row holds a
    position's value on this rank (``row``), and its combine (``op``: ``"fold"``, ``x ⊕ y``
    with ``x`` first in sequence order; ``"rfold"``, the operands swapped)."""

    def __init__(self, holder, row: dict, op: str = "fold"):
        self.holder, self.row, self.op = holder, row, op

    def fold(self, ops: list, dst: int, first: int) -> None:
        """``dst ← first ⊛ dst`` for this scan's operator ``⊛``."""
        if self.op == "fold":
            ProgramBuilder.fold(ops, dst, first)
        else:
            if dst == IDENTITY:
                raise AssertionError("a scan program would write the identity row")
            ops.append(("rfold", dst, first))


def _collect(sub: _Sub, pairs, me: int, pre: list, post: list, out: dict,
             arrivals: dict) -> None:
    """One scan's part of a round of ``(ScanPair, kind)``: ``up`` ``right ← left ⊕ right``;
    ``down`` ``left ← right``, ``right ← right ⊕ left``; ``spine`` (the right holds the
    identity) ``left ← identity``, ``right ← left``, only the left's aggregate travelling."""
    for p, kind in pairs:  # same order on every rank -> both ends agree on each buffer's layout
        hl, hr = sub.holder(p.left), sub.holder(p.right)
        if hl == me and hr == me:
            left, right = sub.row[p.left], sub.row[p.right]
            if kind == SPINE:           # a rename: the left's aggregate moves right
                sub.row[p.left], sub.row[p.right] = IDENTITY, left
            elif kind == DOWN:   # the prefix ⊕ left aggregate, into the aggregate's row
                sub.fold(pre, left, right)
                sub.row[p.left], sub.row[p.right] = right, left
            else:
                sub.fold(pre, right, left)
            continue
        if hl == me:
            out.setdefault(hr, []).append(sub.row[p.left])
            if kind == DOWN:
                arrivals.setdefault(hr, []).append((sub, p, "left"))
            elif kind == SPINE:
                sub.row[p.left] = IDENTITY
        elif hr == me:
            arrivals.setdefault(hl, []).append((sub, p, kind))
            if kind == DOWN:
                out.setdefault(hl, []).append(sub.row[p.right])


def _close(pb: ProgramBuilder, pre: list, post: list, out: dict, arrivals: dict) -> None:
    """The round's one exchange (rows for each peer's arrivals, in the order collected) and
    what the arrivals feed."""
    recvs = []
    for peer, arr in sorted(arrivals.items()):
        first = pb.receive(len(arr))
        recvs.append((peer, first, len(arr)))
        for got, (sub, p, what) in enumerate(arr, start=first):
            if what == "left":          # the parent's prefix
                sub.row[p.left] = got
            elif what == DOWN:          # the prefix ⊕ the left aggregate that arrived
                sub.fold(post, got, sub.row[p.right])
                sub.row[p.right] = got
            elif what == SPINE:         # the left aggregate is the right's prefix
                sub.row[p.right] = got
            else:                       # the left aggregate ⊕ this right one
                sub.fold(post, sub.row[p.right], got)
    pb.steps.append(Step(tuple(pre), tuple((peer, tuple(r)) for peer, r in sorted(out.items())),
                         tuple(recvs), tuple(post)))


def _round(pb: ProgramBuilder, pairs) -> None:
    """One round of the tree over the map's own positions."""
    pre, post, out, arrivals = [], [], {}, {}
    _collect(_Sub(pb.leaves.holder, pb.row), pairs, pb.leaves.rank, pre, post, out, arrivals)
    _close(pb, pre, post, out, arrivals)


def _compile_nested(leaves: ScanMap, P: int) -> Program:
    """The zigzag pattern (:func:`~sp_attention.planning.layout.nested_ranks`) as three scans
    over the ``P`` ranks in the same rounds: ``X1`` (first-half elements, ranks ascending),
    ``X2`` (first-half elements, ranks descending, operands swapped) and ``X3`` (second-half
    elements, ranks descending); then this rank's second element's prefix is
    ``X1 ⊕ E1 ⊕ X2 ⊕ X3`` (three local chains)."""
    pb = ProgramBuilder(leaves)
    me = leaves.rank
    pos = leaves.local_positions                    # input order
    i1 = 0 if pos[0] < P else 1                     # the input row of the first-half element
    i2 = 1 - i1
    keep = pb.receive(2)                            # E1 kept, and E1 for X2 (folds are
    c2 = keep + 1                                   # in place)
    ascending, descending = (lambda t: t), (lambda t: P - 1 - t)
    subs = [_Sub(ascending, {me: i1}),                         # X1: E1 at position r
            _Sub(descending, {P - 1 - me: c2}, "rfold"),       # X2: E1 at position P−1−r
            _Sub(descending, {P - 1 - me: i2})]                # X3: E2 at position P−1−r
    for sub in subs:                    # the last position's up-sweep values are dead
        if sub.holder(P - 1) == me:
            sub.row[P - 1] = IDENTITY
    first = [("copy", keep, i1), ("copy", c2, i1)]
    for n, pairs in enumerate(tree_scan_rounds(P)):
        pre, post, out, arrivals = (first if n == 0 else []), [], {}, {}
        for sub in subs:
            _collect(sub, pairs, me, pre, post, out, arrivals)
        _close(pb, pre, post, out, arrivals)
    x1, x2, x3 = subs[0].row[me], subs[1].row[P - 1 - me], subs[2].row[P - 1 - me]
    t1 = pb.receive(3)
    chains = [("chain", t1, keep, x1), ("chain", t1 + 1, x2, t1), ("chain", t1 + 2, x3, t1 + 1)]
    last = pb.steps[-1]
    pb.steps[-1] = Step(last.pre, last.sends, last.recvs, last.post + tuple(chains))
    pb.row[pos[i1]], pb.row[pos[i2]] = x1, t1 + 2
    return pb.finish()


@functools.lru_cache(maxsize=256)
def compile_blelloch(leaves: ScanMap) -> Program:
    """The tree scan of this rank's elements (pure rank arithmetic, cached per map): the
    rounds of :func:`~sp_attention.planning.layout.tree_scan_rounds` (dead up-sweep work and
    identity messages left out)."""
    P = nested_ranks(tuple(leaves.holder(p) for p in range(leaves.num)))
    if P:                               # zigzag: a tree over the ranks, not the 2P leaves
        return _compile_nested(leaves, P)
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

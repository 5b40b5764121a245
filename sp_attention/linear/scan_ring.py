"""Ring (LASP-1 chain) scan, the baseline: the prefix walks the leaves in scan order, one hop
per leaf boundary that crosses ranks (P−1 hops contiguous, 2(P−1) zigzag). Each rank's local
intra-leaf work is done before the scan starts, so only the state waits on the chain.

Compiled once per element map (:class:`~.scan_common.Program`): a call runs one receive, one
combine and one send per hop it takes part in.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ..comm import p2p_exchange
from ..context import SPContext
from .scan_common import (IDENTITY, Program, ProgramBuilder, ScanMap, Step, rows_to_list,
                          run_program)


@functools.lru_cache(maxsize=256)
def compile_ring(leaves: ScanMap) -> Program:
    """The chain over this rank's elements (pure rank arithmetic, cached per map). The running
    prefix travels as a row whose ``b`` is the state (its ``A`` is not read)."""
    pb, me = ProgramBuilder(leaves), leaves.rank
    if not leaves.local_positions:      # holds no element: takes part in no exchange
        return pb.finish()
    incoming, state, pending = {}, IDENTITY, []      # IDENTITY's b is the zero start
    for pos in range(leaves.num):
        holder = leaves.holder(pos)
        if pos > 0:
            src = leaves.holder(pos - 1)
            if src != holder and me == src:
                pb.steps.append(Step(tuple(pending), ((holder, (state,)),)))
                pending = []
            elif src != holder and me == holder:
                state = pb.receive(1)
                pb.steps.append(Step(tuple(pending), (), ((src, state, 1),)))
                pending = []
        if holder != me:
            continue
        incoming[pos] = state
        if pos + 1 < leaves.num:        # the last leaf's prefix is needed by nobody
            elem = pb.row[pos]
            if state == IDENTITY:
                state = elem            # zero ⊕ element: the element's own b
            else:
                nxt = pb.receive(1)     # a scratch row for elem.A·state + elem.b
                pending.append(("chain", nxt, elem, state))
                state = nxt
    if pending:
        pb.steps.append(Step(tuple(pending)))
    pb.row.update(incoming)
    return pb.finish()


def ring_rows(A: torch.Tensor, b: torch.Tensor, ctx: SPContext, reverse: bool = False,
              holders: Optional[tuple] = None, graphs: bool = False) -> torch.Tensor:
    """This rank's elements as rows -> the exclusive prefix (suffix if ``reverse``) ``b`` of
    each, ``[n, n_a, kv]`` (see :func:`~.scan_blelloch.blelloch_rows`)."""
    return run_program("ring", compile_ring, A, b, ctx, reverse, holders, graphs, p2p_exchange)


def ring_scan(A: list, b: list, ctx: SPContext, reverse: bool = False,
              holders: Optional[tuple] = None, like=None) -> list:
    """Exclusive prefix (suffix if ``reverse``) ``b`` state for each of this rank's leaves
    (``holders``: the elements' holders in scan order, default the layout's leaves; ``like``
    is unused here, see :func:`~.scan_allgather.allgather_scan`)."""
    return rows_to_list(ring_rows, A, b, ctx, reverse, holders, like)

"""All-gather scan: one fixed-shape all-gather of every leaf's packed fp32 element, then each
rank forms the prefix of its own leaves locally.

One collective instead of 2⌈log2 L⌉ dependent rounds: the lowest latency for small P within a
node; it moves (P−1)·(per-rank elements) into every rank.

The local fold is vectorised rather than a Horner loop over up to L−1 elements (one small op
each, host-bound on a GPU): the prefix entering scan position p is

    S_in(p) = Σ_{q<p} (Π_{q<r<p} A_r) · b_q

and the products are exp(Σ log A_r), a 0/1 band matrix times log A — no division by A and no
difference of cumulative sums (both break when A underflows to 0). log A is clamped at −1e4,
whose exp is exactly 0 in fp32 and fp64, so an underflowed A still contributes an exact 0.
"""
from __future__ import annotations

import torch

from ..comm import all_gather_flat
from ..context import SPContext
from ..layout import leaves_of_rank, scan_position
from .scan_common import Element, LeafMap, check_elements

_LOG_FLOOR = -1.0e4


def _band(local_positions: list, num: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """For each local position p: ``between[p, q, r] = 1`` iff q < r < p (the A factors that
    carry b_q to p), and ``before[p, q] = 1`` iff q < p."""
    p = torch.tensor(local_positions, device=device)[:, None, None]
    q = torch.arange(num, device=device)[None, :, None]
    r = torch.arange(num, device=device)[None, None, :]
    return ((q < r) & (r < p)), (q[..., 0] < p[..., 0])


def allgather_scan(A: list, b: list, ctx: SPContext, reverse: bool = False) -> list:
    """Exclusive prefix (suffix if ``reverse``) ``b`` state for each of this rank's leaves."""
    check_elements(A, b, ctx)
    leaves = LeafMap(ctx, reverse)
    mine = [Element(a, s) for a, s in zip(A, b)]
    local = torch.stack([e.pack() for e in mine])                     # [n_local, numel]
    gathered = torch.empty((ctx.world_size,) + tuple(local.shape), dtype=local.dtype,
                           device=local.device)
    all_gather_flat(gathered, local, ctx)
    # rows of `gathered` in scan order
    order = [0] * leaves.num
    per_rank = local.shape[0]
    for r in range(ctx.world_size):
        for i, leaf in enumerate(leaves_of_rank(r, ctx.world_size, ctx.layout)):
            order[scan_position(leaf, leaves.num, reverse)] = r * per_rank + i
    elems = gathered.view(-1, local.shape[1])[torch.tensor(order, device=local.device)]
    n_a = mine[0].A.numel()
    log_a = elems[:, :n_a].log().clamp_min(_LOG_FLOOR)                 # [L, B·H]
    b_all = elems[:, n_a:].view(leaves.num, n_a, -1)                   # [L, B·H, K·V]
    between, before = _band(leaves.local_positions, leaves.num, local.device)
    log_w = torch.einsum("pqr,rx->pqx", between.to(log_a.dtype), log_a)   # [n_local, L, B·H]
    w = log_w.exp() * before[..., None].to(log_a.dtype)
    s_in = torch.einsum("pqx,qxy->pxy", w, b_all)                     # [n_local, B·H, K·V]
    return [s_in[i].view_as(e.b) for i, e in enumerate(mine)]

"""All-gather scan: one fixed-shape all-gather of every leaf's packed fp32 element, then each
rank forms the prefix of its own leaves locally.

One collective instead of 2⌈log2 L⌉ dependent rounds: the lowest latency for small P within a
node; it moves (P−1)·(per-rank elements) into every rank. Where ranks hold different numbers
of elements (packed documents: one per crossing segment), every rank sends as many as the rank
holding the most, zero rows padding the rest.

The local fold is vectorised rather than a Horner loop over up to L−1 elements (one small op
each, host-bound on a GPU): the prefix entering scan position p is

    S_in(p) = Σ_{q<p} (Π_{q<r<p} A_r) · b_q

and the products are exp(Σ log A_r), a 0/1 band matrix times log A — no division by A and no
difference of cumulative sums (both break when A underflows to 0). log A is clamped at the gate
floor of its dtype (:data:`.gates.GATE_FLOOR`, the one home of "exp is exactly 0 below"), so an
underflowed A (log −inf) still contributes an exact 0, and every sum in the band stays finite.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ..caches import LRU
from ..comm import all_gather_flat
from ..context import SPContext
from .gates import GATE_FLOOR
from .scan_common import Element, ScanMap, check_elements, scan_map


@functools.lru_cache(maxsize=256)
def _host_plan(leaves: ScanMap) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Index and band tensors of the fold on the host (pure rank arithmetic, a few hundred
    bytes each; bounded by the element maps a process meets, compared by content).

    ``order[pos]`` is the row of the gathered buffer holding scan position ``pos``; for each
    local position p: ``between[p, q, r] = 1`` iff q < r < p (the A factors that carry b_q to
    p), and ``before[p, q] = 1`` iff q < p.
    """
    num = leaves.num
    p = torch.tensor(leaves.local_positions, dtype=torch.int64)[:, None, None]
    q = torch.arange(num)[None, :, None]
    r = torch.arange(num)[None, None, :]
    order = torch.tensor([leaves.row(i) for i in range(num)], dtype=torch.int64)
    return order, (q < r) & (r < p), q[..., 0] < p[..., 0]


# The plan's copies on the devices that run the fold, made once per (element map, dtype,
# device): a host-to-device copy per call would be a device sync per call. A training process
# folds on one device, in one dtype and in both directions per CP group: a handful of entries
# (packed documents: a few per batch's plan); the bound keeps a process that meets many
# groups, plans, devices or dtypes from holding device memory for ever (a dropped plan is
# copied again on its next use).
_DEVICE_PLANS = LRU(16)


def _fold_plan(leaves: ScanMap, dtype: torch.dtype, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(order, between, before)`` of :func:`_host_plan` on ``device`` (the bands in
    ``dtype``)."""
    def make():
        order, between, before = _host_plan(leaves)
        return (order.to(device), between.to(device=device, dtype=dtype),
                before.to(device=device, dtype=dtype))
    return _DEVICE_PLANS.get((leaves, dtype, device), make)


def allgather_scan(A: list, b: list, ctx: SPContext, reverse: bool = False,
                   holders: Optional[tuple] = None, like: Optional[torch.Tensor] = None) -> list:
    """Exclusive prefix (suffix if ``reverse``) ``b`` state for each of this rank's leaves
    (``holders``: the elements' holders in scan order, default the layout's leaves). A rank
    holding no element passes ``like`` (a tensor shaped as one ``b``) for the element size."""
    leaves = scan_map(ctx, reverse, holders)
    check_elements(A, b, ctx, leaves)
    mine = [Element(a, s) for a, s in zip(A, b)]
    if mine:
        local = torch.stack([e.pack() for e in mine])                  # [n_local, numel]
        n_a = mine[0].A.numel()
    elif like is None:
        raise ValueError("allgather_scan: a rank holding no element must pass like=")
    else:
        n_a = like.shape[0] * like.shape[1]
        local = like.new_zeros(0, n_a + like.numel())
    if local.shape[0] < leaves.max_per_rank:
        local = torch.cat([local, local.new_zeros(leaves.max_per_rank - local.shape[0],
                                                  local.shape[1])])
    gathered = torch.empty((ctx.world_size,) + tuple(local.shape), dtype=local.dtype,
                           device=local.device)
    all_gather_flat(gathered, local, ctx)
    if not mine:
        return []
    order, between, before = _fold_plan(leaves, local.dtype, local.device)
    elems = gathered.view(-1, local.shape[1])[order]                   # rows in scan order
    log_a = elems[:, :n_a].log().clamp_min(GATE_FLOOR[local.dtype])    # [L, B·H]
    b_all = elems[:, n_a:].view(leaves.num, n_a, -1)                   # [L, B·H, K·V]
    w = torch.matmul(between, log_a).exp_().mul_(before[..., None])   # [n_local, L, B·H]
    # S_in[p, x] = Σ_q w[p, q, x] b[q, x]: one batched GEMM over x = (batch, head)
    s_in = torch.bmm(w.permute(2, 0, 1), b_all.transpose(0, 1)).transpose(0, 1)  # [n, B·H, K·V]
    return [s_in[i].view_as(e.b) for i, e in enumerate(mine)]

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

import functools

import torch

from ..caches import LRU
from ..comm import all_gather_flat
from ..context import SPContext
from ..layout import leaves_of_rank, scan_position
from .scan_common import Element, check_elements, leaf_map

_LOG_FLOOR = -1.0e4


@functools.lru_cache(maxsize=256)
def _host_plan(rank: int, world: int, layout: str, reverse: bool
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Index and band tensors of the fold on the host (pure rank arithmetic, a few hundred
    bytes each; bounded by the (rank, group shape, direction) keys a process meets).

    ``order[pos]`` is the row of the gathered buffer holding scan position ``pos``; for each
    local position p: ``between[p, q, r] = 1`` iff q < r < p (the A factors that carry b_q to
    p), and ``before[p, q] = 1`` iff q < p.
    """
    num = len(leaves_of_rank(0, world, layout)) * world
    per_rank = num // world
    order = [0] * num
    for r in range(world):
        for i, leaf in enumerate(leaves_of_rank(r, world, layout)):
            order[scan_position(leaf, num, reverse)] = r * per_rank + i
    mine = [scan_position(leaf, num, reverse) for leaf in leaves_of_rank(rank, world, layout)]
    p = torch.tensor(mine)[:, None, None]
    q = torch.arange(num)[None, :, None]
    r = torch.arange(num)[None, None, :]
    return torch.tensor(order), (q < r) & (r < p), q[..., 0] < p[..., 0]


# The plan's copies on the devices that run the fold, made once per (rank, group shape,
# direction, dtype, device): a host-to-device copy per call would be a device sync per call.
# A training process folds on one device, in one dtype and in both directions per CP group:
# a handful of entries; the bound keeps a process that meets many groups, devices or dtypes
# from holding device memory for ever (a dropped plan is copied again on its next use).
_DEVICE_PLANS = LRU(16)


def _fold_plan(rank: int, world: int, layout: str, reverse: bool, dtype: torch.dtype,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(order, between, before)`` of :func:`_host_plan` on ``device`` (the bands in
    ``dtype``)."""
    def make():
        order, between, before = _host_plan(rank, world, layout, reverse)
        return (order.to(device), between.to(device=device, dtype=dtype),
                before.to(device=device, dtype=dtype))
    return _DEVICE_PLANS.get((rank, world, layout, reverse, dtype, device), make)


def allgather_scan(A: list, b: list, ctx: SPContext, reverse: bool = False) -> list:
    """Exclusive prefix (suffix if ``reverse``) ``b`` state for each of this rank's leaves."""
    check_elements(A, b, ctx)
    leaves = leaf_map(ctx, reverse)
    mine = [Element(a, s) for a, s in zip(A, b)]
    local = torch.stack([e.pack() for e in mine])                     # [n_local, numel]
    gathered = torch.empty((ctx.world_size,) + tuple(local.shape), dtype=local.dtype,
                           device=local.device)
    all_gather_flat(gathered, local, ctx)
    order, between, before = _fold_plan(ctx.rank, ctx.world_size, ctx.layout, bool(reverse),
                                        local.dtype, local.device)
    elems = gathered.view(-1, local.shape[1])[order]                   # rows in scan order
    n_a = mine[0].A.numel()
    log_a = elems[:, :n_a].log().clamp_min(_LOG_FLOOR)                 # [L, B·H]
    b_all = elems[:, n_a:].view(leaves.num, n_a, -1)                   # [L, B·H, K·V]
    w = torch.matmul(between, log_a).exp_().mul_(before[..., None])   # [n_local, L, B·H]
    # S_in[p, x] = Σ_q w[p, q, x] b[q, x]: one batched GEMM over x = (batch, head)
    s_in = torch.bmm(w.permute(2, 0, 1), b_all.transpose(0, 1)).transpose(0, 1)  # [n, B·H, K·V]
    return [s_in[i].view_as(e.b) for i, e in enumerate(mine)]

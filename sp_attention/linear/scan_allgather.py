"""All-gather scan: one fixed-shape all-gather of every leaf's packed fp32 element, then each
rank forms the prefix of its own leaves locally.

One collective instead of 2⌈log2 L⌉ − 1 dependent rounds: the lowest latency for small P
within a node; it moves (P−1)·(per-rank elements) into every rank. Where ranks hold different numbers
of elements (packed documents: one per crossing segment), every rank sends as many as the rank
holding the most, zero rows padding the rest.

The local fold is vectorised rather than a Horner loop over up to L−1 elements (one small op
each, host-bound on a GPU): the prefix entering scan position p is

    S_in(p) = Σ_{q<p} (Π_{q<r<p} A_r) · b_q

and the products are exp(Σ log A_r), a 0/1 band matrix times log A — no division by A and no
difference of cumulative sums (both break when A underflows to 0). Each rank sends log A in
place of A, clamped at the gate floor of its dtype (:data:`.gates.GATE_FLOOR`, the one home of
"exp is exactly 0 below"), so an underflowed A (log −inf) still contributes an exact 0 and every
sum in the band stays finite; the band matrices address the gathered rows as they arrive
(rank-major), so a call is: stage, log, all-gather, one batched matmul for the weights, one
batched GEMM for the states (everything after the stage replayed from one CUDA graph on GPUs).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ..caches import LRU
from ..comm import all_gather_flat
from ..context import SPContext
from .gates import GATE_FLOOR
from .scan_common import ScanMap, leaf_map, replayed, rows_to_list, scan_map


@functools.lru_cache(maxsize=256)
def host_plan(leaves: ScanMap, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fold's band matrices over the gathered rows (pure rank arithmetic, a few hundred
    bytes; bounded by the element maps a process meets, compared by content): for each local
    position p (in the caller's order) and the ``world · max_per_rank`` gathered rows i, j:
    ``between[p, i, j] = 1`` iff row i's position lies strictly between row j's and p (the A
    factors that carry b_j to p), ``before[p, j] = 1`` iff row j's position is before p.
    Padding rows hold no position and are never counted."""
    pos = torch.full((world * leaves.max_per_rank,), -1, dtype=torch.int64)
    for position in range(leaves.num):
        pos[leaves.row(position)] = position
    real = pos >= 0
    p = torch.tensor(leaves.local_positions, dtype=torch.int64)[:, None, None]
    i, j = pos[None, :, None], pos[None, None, :]
    between = (j < i) & (i < p) & real[None, :, None] & real[None, None, :]
    before = (pos[None, :] < p[..., 0]) & real[None, :]
    return between, before


class AllgatherRun:
    """The all-gather scan bound to buffers of one element size, dtype, device and group size
    (the send and gathered buffers and the band matrices, made once)."""

    def __init__(self, leaves: ScanMap, world: int, n_a: int, kv: int, dtype: torch.dtype,
                 device: torch.device):
        width, m = n_a * (1 + kv), leaves.max_per_rank
        self.n_a, self.kv, self.n = n_a, kv, len(leaves.local_positions)
        self.send = torch.zeros(m, width, dtype=dtype, device=device)
        self.log_a = self.send[:self.n, :n_a]
        self.gathered = torch.empty(world * m, width, dtype=dtype, device=device)
        between, before = host_plan(leaves, world)
        self.between = between.to(device=device, dtype=dtype)          # [n, rows i, rows j]
        self.before = before.to(device=device, dtype=dtype)[:, None]     # [n, 1, rows j]
        self.g_log_a_t = self.gathered[:, :n_a].t()                     # [n_a, rows]
        rows = world * m
        self.g_b = self.gathered[:, n_a:].view(rows, n_a, kv).transpose(0, 1)  # [n_a, rows, kv]

    def stage(self, A: torch.Tensor, b: torch.Tensor) -> None:
        """This rank's elements into the send rows (``compute`` turns ``A`` into ``log A``
        there: inside a replayed CUDA graph, not as two more launches from the host)."""
        if self.n:
            torch.cat([A.reshape(self.n, -1), b.reshape(self.n, -1)], dim=1,
                      out=self.send[:self.n])

    def __call__(self, A: torch.Tensor, b: torch.Tensor, ctx: SPContext) -> torch.Tensor:
        self.stage(A, b)
        return self.compute(ctx)

    def compute(self, ctx: SPContext) -> torch.Tensor:
        """``log A`` in the staged rows, the all-gather and the fold -> ``[n, n_a, kv]``."""
        if self.n:
            torch.log(self.log_a, out=self.log_a).clamp_min_(GATE_FLOOR[self.log_a.dtype])
        all_gather_flat(self.gathered, self.send, ctx)
        if not self.n:
            return self.send.new_zeros(0, self.n_a, self.kv)
        # w[p, x, j] = exp(Σ_i log A[i, x] · between[p, i, j]), 0 unless row j precedes p
        w = torch.matmul(self.g_log_a_t, self.between).exp_().mul_(self.before)  # [n, n_a, rows]
        # S_in[p, x] = Σ_j w[p, x, j] b[j, x]: one batched GEMM over x = (batch, head)
        return torch.bmm(w.transpose(0, 1), self.g_b).transpose(0, 1)           # [n, n_a, kv]


# the fused fold holds every gathered row's weights and a tile of its state in one program:
# up to this many rows (P ≤ 16 with zigzag's two leaves a rank, 32 with one); beyond, the
# torch ops run the same math
FUSED_MAX_ROWS = 32


class FusedAllgatherRun:
    """The all-gather scan over a rank's leaf rows in two Triton kernels around the collective
    (:mod:`.allgather_kernel`): the rows folded into each leaf's element and staged as
    ``[log A | b]``, then the gathered rows folded into each leaf's entering state and spread
    back over its rows. Bound to one row shape, group size and direction (the send and
    gathered buffers and the band matrices, made once); fp32 on CUDA.

    A call runs the kernels on the caller's rows. Replayed from a CUDA graph
    (:class:`~.scan_common.GraphReplay`: on these hosts a Triton launch costs 0.1–0.4 ms of
    Python), ``stage`` copies the rows and transitions into fixed buffers and ``compute`` runs
    both kernels and the collective on them."""

    def __init__(self, leaves: ScanMap, world: int, shape: tuple, rows_per_leaf: int,
                 device: torch.device):
        R, H, kv = shape
        n_a = R // rows_per_leaf // max(len(leaves.local_positions), 1) * H
        self.n, self.m, self.reverse = len(leaves.local_positions), rows_per_leaf, leaves.reverse
        self.send = torch.zeros(leaves.max_per_rank, n_a * (1 + kv), dtype=torch.float32,
                                device=device)
        self.gathered = torch.empty(world * leaves.max_per_rank, n_a * (1 + kv),
                                    dtype=torch.float32, device=device)
        between, before = host_plan(leaves, world)
        self.between = between.to(device=device, dtype=torch.float32).contiguous()
        self.before = before.to(device=device, dtype=torch.float32).contiguous()
        self.shape = shape
        self.x = self.a = None          # the rows' buffers of a replay (made by ``stage``)

    def run(self, x: torch.Tensor, A: torch.Tensor, ctx: SPContext) -> torch.Tensor:
        from .allgather_kernel import fold_rows, stage_rows
        stage_rows(x, A, self.send, self.m, self.n, self.reverse, GATE_FLOOR[torch.float32])
        all_gather_flat(self.gathered, self.send, ctx)
        return fold_rows(self.gathered, self.between, self.before, x, A, torch.empty_like(x),
                         self.m, self.n, self.reverse)

    def __call__(self, A: torch.Tensor, x: torch.Tensor, ctx: SPContext) -> torch.Tensor:
        return self.run(x.view(self.shape), A, ctx)

    def stage(self, A: torch.Tensor, x: torch.Tensor) -> None:
        if self.x is None:
            self.x, self.a = torch.empty_like(x.view(self.shape)), torch.empty_like(A)
        self.x.copy_(x.view(self.shape))
        self.a.copy_(A)

    def compute(self, ctx: SPContext) -> torch.Tensor:
        return self.run(self.x, self.a, ctx)


def fused_allgather_leaf_rows(x: torch.Tensor, A: torch.Tensor, ctx: SPContext, reverse: bool,
                              rows_per_leaf: int, graphs: bool = False) -> torch.Tensor:
    """The all-gather scan of a rank's leaf rows in two kernels (:class:`FusedAllgatherRun`):
    ``x [R, H, K, V]`` the rows' states (``R = B · n · rows_per_leaf``: batch-major, then this
    rank's ``n`` leaves, then each leaf's rows), ``A [R, H]`` their transitions, fp32, CUDA ->
    the state entering each row (``reverse``: the gradient arriving at its end), shaped as
    ``x``. The same result as :func:`~.leaves.split_rows_scan` over :func:`allgather_rows`,
    up to the order of fp32 sums. ``graphs``: replayed from a CUDA graph on CUDA."""
    leaves = leaf_map(ctx, reverse)
    shape = (x.shape[0], A.shape[1], x[0].numel() // A.shape[1])
    run = _RUNS.get(("fused", leaves, ctx.world_size, shape, rows_per_leaf, x.device),
                    lambda: FusedAllgatherRun(leaves, ctx.world_size, shape, rows_per_leaf,
                                              x.device))
    out = replayed(run, graphs, x.device)(A.contiguous(), x.contiguous(), ctx)
    return out.view(x.shape)


# bound scans: (ScanMap, world, n_a, kv, dtype, device) and ("fused", ScanMap, world, row
# shape, rows per leaf, device); see scan_common._RUNS for the bound
_RUNS = LRU(32)


def allgather_rows(A: torch.Tensor, b: torch.Tensor, ctx: SPContext, reverse: bool = False,
                   holders: Optional[tuple] = None, graphs: bool = False) -> torch.Tensor:
    """This rank's elements as rows (``A [n, …]``, ``b [n, …]``; ``n`` may be 0, the shapes
    then give the element size) -> the exclusive prefix (suffix if ``reverse``) ``b`` of each,
    ``[n, n_a, kv]``. ``graphs``: replay from a CUDA graph (:class:`~.scan_common.GraphReplay`)."""
    leaves = scan_map(ctx, reverse, holders)
    n_a = A.shape[1:].numel()
    kv = b.shape[1:].numel() // n_a
    run = _RUNS.get((leaves, ctx.world_size, n_a, kv, b.dtype, b.device),
                    lambda: AllgatherRun(leaves, ctx.world_size, n_a, kv, b.dtype, b.device))
    return replayed(run, graphs, b.device)(A, b, ctx)


def allgather_scan(A: list, b: list, ctx: SPContext, reverse: bool = False,
                   holders: Optional[tuple] = None, like: Optional[torch.Tensor] = None) -> list:
    """Exclusive prefix (suffix if ``reverse``) ``b`` state for each of this rank's leaves
    (``holders``: the elements' holders in scan order, default the layout's leaves). A rank
    holding no element passes ``like`` (a tensor shaped as one ``b``) for the element size."""
    if not A and like is None:
        raise ValueError("allgather_scan: a rank holding no element must pass like=")
    return rows_to_list(allgather_rows, A, b, ctx, reverse, holders, like)

"""Triton kernels of the all-gather scan over a rank's leaf rows: the staging of its elements
and the fold of the gathered ones, one launch each.

Why they exist: at 8K tokens per GPU and P = 4 the two scans of a forward + backward were the
gap to fla's one-GPU step (~126 µs of 633, 4 × H200, `sp_attention/linear/README.md`), and
most of each scan was ~12 small torch ops in a chain — the fold of a leaf's row states into its
element, the transition's product, a ``cat`` into the send rows, ``log`` and the clamp; after
the all-gather a GEMM for the weights, ``exp``, the ``before`` mask, a batched GEMV, a
transposing copy and the spread of the leaf's state back over its rows — each a launch and a
few µs on the scan's critical path. Here the same math is two kernels around the collective.

Rows and elements (as :func:`sp_attention.linear.leaves.split_rows_scan` and
:func:`sp_attention.linear.attention.scan_rows` define them): ``x [R, H, K·V]`` holds the
rows' states, ``R = B · n · M`` rows batch-major, then leaf (``n`` per rank), then the ``M``
rows of a leaf; ``a [R, H]`` their transitions. Leaf ``i``'s element for batch ``β``, head
``h`` (column ``c = β·H + h`` of ``n_a = B·H``) is folded along the leaf (from its end when
``REVERSE``)::

    acc ← a_j · acc + x_j  (rows j in scan order)        log A = max(Σ_j log a_j, floor)

and staged as send row ``i``: ``[log A (n_a) | acc (n_a · K·V)]``. After the all-gather
(``world · max_per_rank`` rows, rank-major) the state entering leaf ``i`` is
``S = Σ_r w_r b_r`` with ``w_r = exp(Σ_q log A_q · between[i, q, r]) · before[i, r]``
(:func:`sp_attention.linear.scan_allgather.host_plan`), and it is spread over the leaf's rows
in scan order: ``out_first = S``, ``out_next = a_j · out_j + x_j``.

Layers: these kernels → :func:`stage_rows` / :func:`fold_rows` (launchers) →
:class:`sp_attention.linear.scan_allgather.FusedAllgatherRun`. Reference: the torch ops of
:class:`~sp_attention.linear.scan_allgather.AllgatherRun` with
:func:`~sp_attention.linear.leaves.split_rows_scan`. Needs triton; runs under
``TRITON_INTERPRET=1`` on CPU for tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_launch import device_guard, launch

__all__ = ["stage_rows", "fold_rows"]


@triton.jit(do_not_specialize=["M", "n_leaves", "NA", "KV", "width"])
def _stage_kernel(x, a, send, log_floor, M, n_leaves, NA, KV, width,
                  H: tl.constexpr, REVERSE: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    i = pid // NA                       # the leaf (this rank's element)
    c = pid % NA                        # its column: batch row · H + head
    h = c % H
    row0 = ((c // H) * n_leaves + i) * M
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < KV
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    log_a = tl.sum(tl.zeros([1], dtype=tl.float32), axis=0)
    for t in range(M):
        row = row0 + t + REVERSE * (M - 1 - 2 * t)      # rows in scan order
        a_j = tl.load(a + row * H + h)
        acc = a_j * acc + tl.load(x + (row * H + h) * KV + offs, mask=mask, other=0.0)
        log_a += tl.log(a_j)
    tl.store(send + i * width + NA + c * KV + offs, acc, mask=mask)
    if blk == 0:
        tl.store(send + i * width + c, tl.maximum(log_a, log_floor))


@triton.jit(do_not_specialize=["M", "n_leaves", "NA", "KV", "width", "ROWS"])
def _fold_kernel(gathered, between, before, x, a, out, M, n_leaves, NA, KV, width, ROWS,
                 H: tl.constexpr, REVERSE: tl.constexpr, RB: tl.constexpr,
                 BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    i = pid // NA
    c = pid % NA
    h = c % H
    row0 = ((c // H) * n_leaves + i) * M
    r = tl.arange(0, RB)
    rm = r < ROWS
    # w_r = exp(Σ_q log A_q · between[i, q, r]) · before[i, r] over the gathered rows
    log_a = tl.load(gathered + r * width + c, mask=rm, other=0.0)
    band = tl.load(between + (i * ROWS + r[:, None]) * ROWS + r[None, :],
                   mask=rm[:, None] & rm[None, :], other=0.0)
    w = tl.exp(tl.sum(log_a[:, None] * band, axis=0)) * tl.load(before + i * ROWS + r,
                                                                  mask=rm, other=0.0)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < KV
    b = tl.load(gathered + r[:, None] * width + NA + c * KV + offs[None, :],
                mask=rm[:, None] & mask[None, :], other=0.0)
    s = tl.sum(w[:, None] * b, axis=0)
    # spread over the leaf's rows in scan order
    for t in range(M - 1):
        row = row0 + t + REVERSE * (M - 1 - 2 * t)
        tl.store(out + (row * H + h) * KV + offs, s, mask=mask)
        s = tl.load(a + row * H + h) * s + tl.load(x + (row * H + h) * KV + offs, mask=mask,
                                                   other=0.0)
    last = row0 + (1 - REVERSE) * (M - 1)
    tl.store(out + (last * H + h) * KV + offs, s, mask=mask)


def _block(kv: int, rows: int) -> int:
    """The K·V tile: ≤ 4096 gathered values a program holds, at least 128, at most the row."""
    return max(128, min(1024, triton.next_power_of_2(kv), 4096 // max(rows, 1)))


def _check(x: torch.Tensor, a: torch.Tensor, rows_per_leaf: int, n_leaves: int) -> tuple:
    if x.dtype != torch.float32 or a.dtype != torch.float32:
        raise TypeError(f"the fused all-gather scan runs on fp32 states; got {x.dtype} / "
                        f"{a.dtype}")
    if not (x.is_contiguous() and a.is_contiguous()) or x.dim() != 3 or a.shape != x.shape[:2]:
        raise ValueError(f"x [R, H, K·V] and a [R, H], contiguous; got {tuple(x.shape)} and "
                         f"{tuple(a.shape)}")
    R, H, kv = x.shape
    if R % (rows_per_leaf * n_leaves):
        raise ValueError(f"{R} rows are not batches of {n_leaves} leaves × {rows_per_leaf} rows")
    return R // (rows_per_leaf * n_leaves) * H, H, kv


def stage_rows(x: torch.Tensor, a: torch.Tensor, send: torch.Tensor, rows_per_leaf: int,
               n_leaves: int, reverse: bool, log_floor: float) -> None:
    """Fold each leaf's rows (``x [R, H, K·V]``, ``a [R, H]``, fp32, contiguous) into its
    element and write send rows ``0 … n_leaves − 1`` (``[log A | b]``, ``send`` contiguous,
    ``n_a · (1 + K·V)`` columns)."""
    na, H, kv = _check(x, a, rows_per_leaf, n_leaves)
    width = send.shape[1]
    if width != na * (1 + kv) or send.shape[0] < n_leaves or not send.is_contiguous():
        raise ValueError(f"send {tuple(send.shape)} cannot take {n_leaves} rows of "
                         f"{na * (1 + kv)}")
    block = _block(kv, 1)
    with device_guard(x):
        launch(_stage_kernel, (n_leaves * na, triton.cdiv(kv, block)), x, a, send,
               float(log_floor), rows_per_leaf, n_leaves, na, kv, width, H=H,
               REVERSE=int(bool(reverse)), BLOCK=block)


def fold_rows(gathered: torch.Tensor, between: torch.Tensor, before: torch.Tensor,
              x: torch.Tensor, a: torch.Tensor, out: torch.Tensor, rows_per_leaf: int,
              n_leaves: int, reverse: bool) -> torch.Tensor:
    """The state entering each of this rank's leaves from the gathered rows (``gathered
    [rows, n_a · (1 + K·V)]``; ``between [n_leaves, rows, rows]``, ``before [n_leaves,
    rows]``, fp32 0/1), spread over the leaf's rows into ``out`` (shaped as ``x``)."""
    na, H, kv = _check(x, a, rows_per_leaf, n_leaves)
    rows = gathered.shape[0]
    if between.shape != (n_leaves, rows, rows) or before.shape != (n_leaves, rows) \
            or gathered.shape[1] != na * (1 + kv) or out.shape != x.shape:
        raise ValueError("fold_rows: the band matrices, gathered rows and out do not match")
    block = _block(kv, rows)
    with device_guard(x):
        launch(_fold_kernel, (n_leaves * na, triton.cdiv(kv, block)), gathered, between,
               before, x, a, out, rows_per_leaf, n_leaves, na, kv, gathered.shape[1], rows, H=H,
               REVERSE=int(bool(reverse)), RB=max(2, triton.next_power_of_2(rows)), BLOCK=block)
    return out

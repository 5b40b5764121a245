"""Per-token gates in the units the chunk kernels take.

fla's chunk kernels (and ours) take a gate as its chunk-local inclusive sums in log2 units
(``exp2`` is the fast exponential): ``gc_i = Σ_{chunk start ≤ t ≤ i} g_t / ln 2``
(:func:`chunk_local_sums`, one launch on a GPU, also in fla's varlen layout). The CP path also
needs, per leaf row, the sum of g over each chunk and everything before it (the carry of the
leaf's incoming state to chunk n is ``exp2(prefix_{n−1})``) and over the whole leaf (the scan
transition ``A = exp2(total)``): :func:`gate_sums` adds them (one cumulative sum over the
chunk totals).

Sums are fp32 (a 16-bit ``g`` is read as it is and summed in fp32; the torch form keeps fp64
for fp64 gates), taken inside a chunk and then across chunks, never differences of a long
running sum.

**The gate floor.** Every gate is clamped at :data:`GATE_FLOOR` of its summation dtype before it
is summed (:func:`clamp_gates`, the one home of the rule; the Triton sums apply the same
number): below it ``exp`` underflows to exactly 0 in that dtype, so the clamp changes no
decay, but it bounds a chunk's running sum. Without it one very negative (finite) gate, e.g.
−1e6, makes every later running sum of its chunk huge, and a decay between two later tokens,
a difference of two such sums, keeps only the bits left over (catastrophic cancellation).
"""
from __future__ import annotations

import math
import os
from typing import NamedTuple, Optional

import torch

from ..precision import acc_dtype
from ..triton_launch import device_guard, launch
from .varlen import chunk_indices, cu_seqlens_tensor

__all__ = ["GateSums", "chunk_local_sums", "gate_sums", "gate_sums_torch", "RCP_LN2",
           "GATE_FLOOR", "clamp_gates", "suffix_sums", "sums_from_local"]

RCP_LN2 = 1.0 / math.log(2.0)

# Natural-log gates at or below these have exp(g) == 0 in the dtype: fp32 underflows to 0 below
# −150·ln 2 ≈ −103.97 (half the smallest subnormal), fp64 below −1075·ln 2 ≈ −745.13; the floors
# keep a margin for exponentials that are not correctly rounded (and for exp2 with subnormals
# flushed, which is 0 from −126 on). Any sum including a clamped gate is ≤ its floor: exp 0 too.
GATE_FLOOR = {torch.float32: -110.0, torch.float64: -750.0}


def clamp_gates(g: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``g`` in its summation dtype (``dtype``, default :func:`acc_dtype` of g: fp32, fp64
    stays), clamped below at that dtype's :data:`GATE_FLOOR`. Changes no ``exp(g)`` nor any
    ``exp`` of a sum including g; a gate below the floor gets no gradient through the clamp."""
    dt = acc_dtype(g) if dtype is None else acc_dtype(dtype)
    return g.to(dt).clamp_min(GATE_FLOOR[dt])


def suffix_sums(tot: torch.Tensor) -> torch.Tensor:
    """``[R, N, H]`` inclusive suffix sums over chunks (``Σ_{c' ≥ c} tot_c'``) of the chunk
    totals ``tot [R, N, H]``: summed from the row's end, never a total minus a prefix."""
    return tot.flip(1).cumsum(1).flip(1)


class GateSums(NamedTuple):
    """Sums of ``g / ln 2`` (gates clamped at :data:`GATE_FLOOR`) over leaf rows ``[R, T, H]``
    cut in chunks of ``chunk`` tokens."""

    gc: torch.Tensor        #: ``[R, T, H]``: chunk-local inclusive sums (fla's ``g``)
    prefix: torch.Tensor    #: ``[R, N, H]``: inclusive sums over chunks 0 … n
    total: torch.Tensor     #: ``[R, H]``: the row's sum (the scan's ``A = exp2(total)``)
    tot: torch.Tensor       #: ``[R, N, H]``: each chunk's sum (:func:`suffix_sums` takes it)

    def leaf(self, n: int, j: int) -> "GateSums":
        """Rows of leaf ``j`` of ``n`` per batch row (rows are batch-major): strided views."""
        if n == 1:
            return self
        return GateSums(*(x.view(x.shape[0] // n, n, *x.shape[1:])[:, j] for x in self))


def _torch_local(g: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    R, T, H = g.shape
    N = max(1, -(-T // chunk))
    x = clamp_gates(g) * RCP_LN2
    if N * chunk - T:
        x = torch.nn.functional.pad(x, (0, 0, 0, N * chunk - T))
    x = x.view(R, N, chunk, H)
    return x.cumsum(2).reshape(R, N * chunk, H)[:, :T].contiguous(), x.sum(2)


def chunk_local_sums(g: torch.Tensor, chunk: int = 64, cu_seqlens: Optional[tuple] = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gc, tot)``: the chunk-local inclusive sums of ``g [R, T, H] / ln 2`` (``[R, T, H]``)
    and each chunk's sum (``[R, N, H]``), fp32 (fp64 for fp64 gates off the GPU), the gates
    clamped at :data:`GATE_FLOOR` of that dtype first.

    ``cu_seqlens`` (host tuple): ``R = 1`` holds these sequences (fla's varlen layout); the
    chunks restart at every sequence start and ``tot`` is ``[1, NT, H]`` in fla's varlen chunk
    order; tokens past the last sequence get ``gc = 0``. CUDA (or Triton's interpreter): one
    launch of :func:`.gate_kernel._chunk_local_sums_kernel`; elsewhere pure torch."""
    if g.dim() != 3:
        raise ValueError(f"g must be [R, T, H], got {tuple(g.shape)}")
    if not (g.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        if cu_seqlens is None:
            return _torch_local(g, chunk)
        parts = [_torch_local(g[:, a:b], chunk) for a, b in zip(cu_seqlens, cu_seqlens[1:])]
        pad = g.new_zeros(1, g.shape[1] - cu_seqlens[-1], g.shape[2], dtype=acc_dtype(g))
        return torch.cat([p[0] for p in parts] + [pad], 1), torch.cat([p[1] for p in parts], 1)
    import triton

    from .gate_kernel import _chunk_local_sums_kernel
    g = g.contiguous()
    R, T, H = g.shape
    if cu_seqlens is not None:
        if R != 1:
            raise ValueError("chunk_local_sums: varlen needs one row (R = 1)")
        ci = chunk_indices(cu_seqlens, chunk, g.device)
        NT, nb, grid = ci.shape[0], 1, (ci.shape[0], H)
        cu_t = cu_seqlens_tensor(cu_seqlens, g.device)
        gc = torch.zeros(1, T, H, device=g.device, dtype=torch.float32)
    else:
        NT = triton.cdiv(T, chunk)
        nb = 4 if NT >= 4 else triton.next_power_of_2(NT)
        grid, ci, cu_t = (triton.cdiv(NT, nb), R * H), None, None
        gc = torch.empty(R, T, H, device=g.device, dtype=torch.float32)
    tot = torch.empty(R, NT, H, device=g.device, dtype=torch.float32)
    guard = device_guard(g)
    with guard:
        launch(_chunk_local_sums_kernel, grid, g, gc, tot, cu_t, ci, GATE_FLOOR[torch.float32],
               RCP_LN2, T, NT, H=H, BT=chunk, NB=nb, IS_VARLEN=cu_seqlens is not None)
    return gc, tot


def gate_sums(g: torch.Tensor, chunk: int = 64) -> GateSums:
    """Chunk-local sums, per-chunk inclusive prefixes and row totals of ``g [R, T, H] / ln 2``:
    :func:`chunk_local_sums`, then one cumulative sum over the chunk totals."""
    return sums_from_local(*chunk_local_sums(g, chunk))


def gate_sums_torch(g: torch.Tensor, chunk: int) -> GateSums:
    """:func:`gate_sums` in pure torch (any device; the reference of the kernel path)."""
    return sums_from_local(*_torch_local(g, chunk))


def sums_from_local(gc: torch.Tensor, tot: torch.Tensor) -> GateSums:
    """:class:`GateSums` from the chunk-local sums and chunk totals: one cumulative sum."""
    prefix = tot.cumsum(1)
    return GateSums(gc, prefix, prefix[:, -1], tot)


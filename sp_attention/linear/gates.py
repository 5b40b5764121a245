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
"""
from __future__ import annotations

import math
import os
from typing import NamedTuple, Optional

import torch

from ..precision import acc_dtype
from .varlen import chunk_indices, cu_seqlens_tensor

__all__ = ["GateSums", "chunk_local_sums", "gate_sums", "gate_sums_torch", "RCP_LN2"]

RCP_LN2 = 1.0 / math.log(2.0)


class GateSums(NamedTuple):
    """Sums of ``g / ln 2`` over leaf rows ``[R, T, H]`` cut in chunks of ``chunk`` tokens."""

    gc: torch.Tensor        #: ``[R, T, H]``: chunk-local inclusive sums (fla's ``g``)
    prefix: torch.Tensor    #: ``[R, N, H]``: inclusive sums over chunks 0 … n
    total: torch.Tensor     #: ``[R, H]``: the row's sum (the scan's ``A = exp2(total)``)

    def leaf(self, n: int, j: int) -> "GateSums":
        """Rows of leaf ``j`` of ``n`` per batch row (rows are batch-major): strided views."""
        if n == 1:
            return self
        return GateSums(*(x.view(x.shape[0] // n, n, *x.shape[1:])[:, j] for x in self))


def _torch_local(g: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    R, T, H = g.shape
    N = max(1, -(-T // chunk))
    x = g.to(acc_dtype(g)) * RCP_LN2
    if N * chunk - T:
        x = torch.nn.functional.pad(x, (0, 0, 0, N * chunk - T))
    x = x.view(R, N, chunk, H)
    return x.cumsum(2).reshape(R, N * chunk, H)[:, :T].contiguous(), x.sum(2)


def chunk_local_sums(g: torch.Tensor, chunk: int = 64, cu_seqlens: Optional[tuple] = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gc, tot)``: the chunk-local inclusive sums of ``g [R, T, H] / ln 2`` (``[R, T, H]``)
    and each chunk's sum (``[R, N, H]``), fp32 (fp64 for fp64 gates off the GPU).

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
    guard = torch.cuda.device(g.device) if g.is_cuda else _null()
    with guard:
        _chunk_local_sums_kernel[grid](g, gc, tot, cu_t, ci, RCP_LN2, T, NT, H=H, BT=chunk,
                                       NB=nb, IS_VARLEN=cu_seqlens is not None)
    return gc, tot


def gate_sums(g: torch.Tensor, chunk: int = 64) -> GateSums:
    """Chunk-local sums, per-chunk inclusive prefixes and row totals of ``g [R, T, H] / ln 2``:
    :func:`chunk_local_sums`, then one cumulative sum over the chunk totals."""
    gc, tot = chunk_local_sums(g, chunk)
    prefix = tot.cumsum(1)
    return GateSums(gc, prefix, prefix[:, -1])


def gate_sums_torch(g: torch.Tensor, chunk: int) -> GateSums:
    """:func:`gate_sums` in pure torch (any device; the reference of the kernel path)."""
    gc, tot = _torch_local(g, chunk)
    prefix = tot.cumsum(1)
    return GateSums(gc, prefix, prefix[:, -1])


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False

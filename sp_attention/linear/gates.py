"""Per-token gates in the units the chunk kernels take: one pass over ``g``.

fla's chunk kernels (and ours) take a gate as its chunk-local inclusive sums in log2 units
(``exp2`` is the fast exponential): ``gc_i = Σ_{chunk start ≤ t ≤ i} g_t / ln 2``. The CP path
also needs, per leaf row, the sum of g over each chunk and everything before it (the carry of
the leaf's incoming state to chunk n is ``exp2(prefix_{n−1})``) and over the whole leaf (the
scan transition ``A = exp2(total)``). :func:`gate_sums` makes all three in one kernel launch on
a GPU (a pure-torch form elsewhere, and as the reference).

Sums are fp32 (a 16-bit ``g`` is read as it is and summed in fp32; the torch form keeps fp64
for fp64 gates), taken inside a chunk and then across chunks, never differences of a long
running sum.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from ..precision import acc_dtype

__all__ = ["GateSums", "gate_sums", "gate_sums_torch", "RCP_LN2"]

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


def gate_sums_torch(g: torch.Tensor, chunk: int, cu_seqlens: Optional[tuple] = None
                    ) -> GateSums:
    """:func:`gate_sums` in pure torch (any device; the reference of the kernel)."""
    if cu_seqlens is not None:
        parts = [gate_sums_torch(g[:, a:b], chunk) for a, b in zip(cu_seqlens, cu_seqlens[1:])]
        gc = torch.cat([p.gc for p in parts] + [g.new_zeros(1, g.shape[1] - cu_seqlens[-1],
                                                            g.shape[2], dtype=acc_dtype(g))], 1)
        return GateSums(gc, torch.cat([p.prefix for p in parts], 1),
                        torch.cat([p.total for p in parts], 0))
    R, T, H = g.shape
    N = max(1, -(-T // chunk))
    x = g.to(acc_dtype(g)) * RCP_LN2
    if N * chunk - T:
        x = torch.nn.functional.pad(x, (0, 0, 0, N * chunk - T))
    x = x.view(R, N, chunk, H)
    gc = x.cumsum(2).reshape(R, N * chunk, H)[:, :T].contiguous()
    prefix = x.sum(2).cumsum(1)
    return GateSums(gc, prefix.contiguous(), prefix[:, -1].contiguous())


def gate_sums(g: torch.Tensor, chunk: int = 64, cu_seqlens: Optional[tuple] = None
              ) -> GateSums:
    """Chunk-local sums, per-chunk prefixes and row totals of ``g [R, T, H] / ln 2`` (fp32).

    ``cu_seqlens`` (host tuple): ``R = 1`` holds these sequences (fla's varlen layout); the
    sums restart at every sequence start, ``prefix`` is ``[1, NT, H]`` in fla's varlen chunk
    order and ``total`` ``[N, H]`` per sequence; tokens past the last sequence get ``gc = 0``
    on the torch path and are not written on the kernel path.
    CUDA: one Triton launch (:func:`_gate_sums_kernel`); elsewhere :func:`gate_sums_torch`.
    """
    if g.dim() != 3:
        raise ValueError(f"g must be [R, T, H], got {tuple(g.shape)}")
    import os
    if not (g.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return gate_sums_torch(g, chunk, cu_seqlens)
    import triton

    from .gate_kernel import _gate_sums_kernel
    from .varlen import chunk_offsets, cu_seqlens_tensor
    g = g.contiguous()
    R, T, H = g.shape
    if cu_seqlens is not None:
        if R != 1:
            raise ValueError("gate_sums: varlen needs one row (R = 1)")
        offs = chunk_offsets(cu_seqlens, chunk)
        R, N, nmax = len(cu_seqlens) - 1, offs[-1], max(
            b - a for a, b in zip(cu_seqlens, cu_seqlens[1:]))
        cu_t, off_t = (cu_seqlens_tensor(x, g.device) for x in (cu_seqlens, offs))
        gc = torch.zeros(1, T, H, device=g.device, dtype=torch.float32)
        prefix = torch.empty(1, N, H, device=g.device, dtype=torch.float32)
    else:
        N = nmax = triton.cdiv(T, chunk)
        cu_t = off_t = None
        gc = torch.empty(R, T, H, device=g.device, dtype=torch.float32)
        prefix = torch.empty(R, N, H, device=g.device, dtype=torch.float32)
        nmax = T
    total = torch.empty(R, H, device=g.device, dtype=torch.float32)
    nb = max(1, min(16, triton.next_power_of_2(triton.cdiv(nmax, chunk))))
    guard = torch.cuda.device(g.device) if g.is_cuda else _null()
    with guard:
        _gate_sums_kernel[(R * H,)](g, gc, prefix, total, cu_t, off_t, RCP_LN2, T, N, H=H,
                                    BT=chunk, NB=nb, IS_VARLEN=cu_seqlens is not None)
    return GateSums(gc, prefix, total)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False

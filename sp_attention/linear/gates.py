"""Per-token gates in the units the chunk kernels take: one pass over ``g``.

fla's chunk kernels (and ours) take a gate as its chunk-local inclusive sums in log2 units
(``exp2`` is the fast exponential): ``gc_i = Σ_{chunk start ≤ t ≤ i} g_t / ln 2``. The CP path
also needs, per leaf row, the sum of g over each chunk and everything before it (the carry of
the leaf's incoming state to chunk n is ``exp2(prefix_{n−1})``) and over the whole leaf (the
scan transition ``A = exp2(total)``). :func:`gate_sums` makes all three in one kernel launch on
a GPU (a pure-torch form elsewhere, and as the reference).

Sums are fp32 (a 16-bit ``g`` is read as it is and summed in fp32), taken inside a chunk and
then across chunks, never differences of a long running sum.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = ["GateSums", "gate_sums", "gate_sums_torch", "RCP_LN2"]

RCP_LN2 = 1.0 / math.log(2.0)


class GateSums(NamedTuple):
    """Sums of ``g / ln 2`` over leaf rows ``[R, T, H]`` cut in chunks of ``chunk`` tokens."""

    gc: torch.Tensor        #: ``[R, T, H]`` fp32: chunk-local inclusive sums (fla's ``g``)
    prefix: torch.Tensor    #: ``[R, N, H]`` fp32: inclusive sums over chunks 0 … n
    total: torch.Tensor     #: ``[R, H]`` fp32: the row's sum (the scan's ``A = exp2(total)``)


def gate_sums_torch(g: torch.Tensor, chunk: int) -> GateSums:
    """:func:`gate_sums` in pure torch (any device; the reference of the kernel)."""
    R, T, H = g.shape
    N = max(1, -(-T // chunk))
    x = g.to(torch.float32) * RCP_LN2
    if N * chunk - T:
        x = torch.nn.functional.pad(x, (0, 0, 0, N * chunk - T))
    x = x.view(R, N, chunk, H)
    gc = x.cumsum(2).reshape(R, N * chunk, H)[:, :T].contiguous()
    prefix = x.sum(2).cumsum(1)
    return GateSums(gc, prefix.contiguous(), prefix[:, -1].contiguous())


def gate_sums(g: torch.Tensor, chunk: int = 64) -> GateSums:
    """Chunk-local sums, per-chunk prefixes and row totals of ``g [R, T, H] / ln 2`` (fp32).

    CUDA: one Triton launch (:func:`_gate_sums_kernel`); elsewhere :func:`gate_sums_torch`.
    """
    if g.dim() != 3:
        raise ValueError(f"g must be [R, T, H], got {tuple(g.shape)}")
    import os
    if not (g.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return gate_sums_torch(g, chunk)
    import triton

    from .gate_kernel import _gate_sums_kernel
    g = g.contiguous()
    R, T, H = g.shape
    N = triton.cdiv(T, chunk)
    gc = torch.empty(R, T, H, device=g.device, dtype=torch.float32)
    prefix = torch.empty(R, N, H, device=g.device, dtype=torch.float32)
    total = torch.empty(R, H, device=g.device, dtype=torch.float32)
    nb = max(1, min(16, triton.next_power_of_2(N)))
    guard = torch.cuda.device(g.device) if g.is_cuda else _null()
    with guard:
        _gate_sums_kernel[(R * H,)](g, gc, prefix, total, RCP_LN2, T, N, H=H, BT=chunk, NB=nb)
    return GateSums(gc, prefix, total)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False

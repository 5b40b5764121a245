"""Triton kernel of :func:`sp_attention.linear.gates.gate_sums` (one program per row and
head; blocks of ``NB`` chunks at a time, the running sum carried across blocks)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["T", "N"])
def _gate_sums_kernel(g, gc, prefix, total, cu_seqlens, chunk_offsets, rcp_ln2, T, N,
                      H: tl.constexpr, BT: tl.constexpr, NB: tl.constexpr,
                      IS_VARLEN: tl.constexpr):
    i_rh = tl.program_id(0).to(tl.int64)
    i_r = i_rh // H
    i_h = i_rh % H
    if IS_VARLEN:       # row i_r is sequence i_r of one varlen row (fla's layout)
        tok0 = tl.load(cu_seqlens + i_r).to(tl.int64)
        T = (tl.load(cu_seqlens + i_r + 1) - tok0).to(tl.int32)
        N = tl.cdiv(T, BT)
        chunk0 = tl.load(chunk_offsets + i_r).to(tl.int64)
    else:
        tok0 = i_r * T
        chunk0 = i_r * N
    g += tok0 * H + i_h
    gc += tok0 * H + i_h
    prefix += chunk0 * H + i_h
    carry = tl.zeros([1], dtype=tl.float32)
    for blk in range(tl.cdiv(N, NB)):
        c = blk * NB + tl.arange(0, NB)                         # chunk ids [NB]
        t = c[:, None] * BT + tl.arange(0, BT)[None, :]         # tokens [NB, BT]
        m = t < T
        x = tl.load(g + t * H, mask=m, other=0.0).to(tl.float32) * rcp_ln2
        tl.store(gc + t * H, tl.cumsum(x, axis=1), mask=m)
        inc = tl.cumsum(tl.sum(x, axis=1), axis=0)[:, None] + carry[None, :]   # [NB, 1]
        tl.store(prefix + c[:, None] * H + tl.zeros([1], dtype=tl.int32)[None, :], inc,
                 mask=(c < N)[:, None])
        last = tl.minimum(blk * NB + NB - 1, N - 1)
        carry = tl.sum(tl.where((c == last)[:, None], inc, 0.0), axis=0)      # [1]
    tl.store(total + i_rh + tl.zeros([1], dtype=tl.int32), carry)

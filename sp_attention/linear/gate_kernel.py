"""Triton kernel of :func:`sp_attention.linear.gates.gate_sums` (one program per row and
head; blocks of ``NB`` chunks at a time, the running sum carried across blocks)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["T", "N"])
def _gate_sums_kernel(g, gc, prefix, total, rcp_ln2, T, N, H: tl.constexpr, BT: tl.constexpr,
                      NB: tl.constexpr):
    i_rh = tl.program_id(0).to(tl.int64)
    i_r = i_rh // H
    i_h = i_rh % H
    g += i_r * T * H + i_h
    gc += i_r * T * H + i_h
    prefix += i_r * N * H + i_h
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

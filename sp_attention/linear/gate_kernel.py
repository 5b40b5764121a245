"""Triton kernel of :func:`sp_attention.linear.gates.chunk_local_sums`: every program sums
``NB`` chunks of one (row, head) on its own (dense rows), or one chunk of one sequence (fla's
varlen layout, ``chunk_indices``): fully parallel, one launch. Each gate is clamped at
``g_floor`` (:data:`.gates.GATE_FLOOR`, fp32) as it is read."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["T", "NT"])
def _chunk_local_sums_kernel(g, gc, tot, cu_seqlens, chunk_indices, g_floor, rcp_ln2, T, NT,
                             H: tl.constexpr, BT: tl.constexpr, NB: tl.constexpr,
                             IS_VARLEN: tl.constexpr):
    i_c = tl.program_id(0).to(tl.int64)
    i_rh = tl.program_id(1).to(tl.int64)
    i_r = i_rh // H
    i_h = i_rh % H
    if IS_VARLEN:       # program i_c: chunk i_c of the varlen order, (sequence, chunk in it)
        i_n = tl.load(chunk_indices + i_c * 2).to(tl.int64)
        c0 = tl.load(chunk_indices + i_c * 2 + 1).to(tl.int64)
        tok0 = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = (tl.load(cu_seqlens + i_n + 1) - tok0).to(tl.int32)
        chunk0 = i_c - c0                               # the sequence's first chunk
    else:
        c0 = i_c * NB
        tok0 = i_r * T
        chunk0 = i_r * NT
    c = c0 + tl.arange(0, NB)                           # chunks of this program [NB]
    t = c[:, None] * BT + tl.arange(0, BT)[None, :]     # tokens [NB, BT]
    m = t < T
    x = tl.load(g + (tok0 + t) * H + i_h, mask=m, other=0.0).to(tl.float32)
    x = tl.maximum(x, g_floor) * rcp_ln2                # exp(g_floor) == 0: changes no decay
    tl.store(gc + (tok0 + t) * H + i_h, tl.cumsum(x, axis=1), mask=m)
    tl.store(tot + ((chunk0 + c) * H + i_h)[:, None] + tl.zeros([1], dtype=tl.int64)[None, :],
             tl.sum(x, axis=1)[:, None], mask=(c * BT < T)[:, None])

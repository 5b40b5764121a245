"""Triton kernel of the LSE merge: one pass over both blocks, fp32 math, any strides.

Same result as :func:`sp_attention.softmax.merge._merge_inplace` (the pure-torch reference),
written as one kernel: the torch form makes about ten elementwise passes over
``[B, Tq, H, D]`` (≈0.43 ms on an H200 for a bf16 ``[1, 8192, 32, 128]`` block against an
fp32 accumulator, 6 % of a CP ring step at T_local 8K); this reads ``out`` and ``out_b`` once
and writes ``out`` once. Per program: ``BT`` query rows × ``BH`` heads of one batch row
(``BH`` = every head: whole rows of a contiguous ``out``)::

    m   = max(lse, lse_b)                       (rows where both are -inf stay untouched)
    lse' = m + log(exp(lse − m) + exp(lse_b − m))
    w   = exp(lse_b − lse')                     (block b's share of the softmax mass)
    out' = out + w · (out_b − out)              (fp32, rounded once into out's dtype)

``out`` may be 16-bit: the merge is then computed in fp32 from its values and rounded once,
exactly what the torch path does for a 16-bit accumulator. Offsets are 64-bit; strides are
runtime values. Layers: this kernel → :func:`merge_blocks_triton` (launcher) →
:func:`sp_attention.softmax.merge.merge_blocks_`. Needs triton; runs under
``TRITON_INTERPRET=1`` on CPU for tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_launch import device_guard, launch


@triton.jit(do_not_specialize=["Tq", "H", "so_b", "so_t", "so_h", "sb_b", "sb_t", "sb_h",
                               "sl_b", "sl_h", "sl_t", "slb_b", "slb_h", "slb_t"])
def _merge_kernel(out, lse, out_b, lse_b, Tq, H,
                  so_b, so_t, so_h, sb_b, sb_t, sb_h, sl_b, sl_h, sl_t, slb_b, slb_h, slb_t,
                  D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr):
    # a program: BT query rows x BH heads of one batch row, as BT·BH (row, head) pairs with the
    # head fastest (memory order of a [B, Tq, H, D] tensor: BH = H reads whole rows)
    i_t = tl.program_id(0)
    i_bg = tl.program_id(1).to(tl.int64)
    n_hb = tl.cdiv(H, BH)
    i_b = i_bg // n_hb
    r = tl.arange(0, BT * BH)
    o_t = (i_t * BT + r // BH).to(tl.int64)
    o_h = ((i_bg % n_hb) * BH + r % BH).to(tl.int64)
    m_r = (o_t < Tq) & (o_h < H)
    o_d = tl.arange(0, BD).to(tl.int64)
    m_d = o_d < D

    p_l = lse + i_b * sl_b + o_h * sl_h + o_t * sl_t
    p_lb = lse_b + i_b * slb_b + o_h * slb_h + o_t * slb_t
    a = tl.load(p_l, mask=m_r, other=float("-inf")).to(tl.float32)
    b = tl.load(p_lb, mask=m_r, other=float("-inf")).to(tl.float32)
    m = tl.maximum(a, b)
    seen = m > float("-inf")                      # False: neither side saw a key
    m0 = tl.where(seen, m, 0.0)
    ea = tl.exp(a - m0)                           # exp(-inf) = 0 for an unseen side
    eb = tl.exp(b - m0)
    s = ea + eb
    s1 = tl.where(seen, s, 1.0)
    w = tl.where(seen, eb / s1, 0.0)              # [BT·BH]
    new_lse = tl.where(seen, m0 + tl.log(s1), float("-inf"))

    mask = m_r[:, None] & m_d[None, :]
    p_o = out + (i_b * so_b + o_h * so_h + o_t * so_t)[:, None] + o_d[None, :]
    p_ob = out_b + (i_b * sb_b + o_h * sb_h + o_t * sb_t)[:, None] + o_d[None, :]
    x = tl.load(p_o, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(p_ob, mask=mask, other=0.0).to(tl.float32)
    x = x + w[:, None] * (y - x)
    tl.store(p_o, x.to(out.dtype.element_ty), mask=mask)
    tl.store(p_l, new_lse.to(lse.dtype.element_ty), mask=m_r)


def merge_blocks_triton(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor,
                        lse_b: torch.Tensor, *, block_t: int = 2, block_h: int = 4,
                        num_warps: int = 2) -> None:
    """Merge (out_b, lse_b) into (out, lse) in place with one kernel.

    out, out_b ``[B, Tq, H, D]`` with unit stride in D (any other strides); lse, lse_b
    ``[B, H, Tq]`` fp32, any strides. ``out`` fp32 or 16-bit (rounded once). Shapes are assumed
    checked by the caller (:func:`sp_attention.softmax.merge.merge_blocks_`). ``block_t``
    query rows × ``block_h`` heads per program (powers of two; ``block_h`` is capped at the
    head count's) and ``num_warps``: the launch shape. Default 2 rows × 4 heads × 2 warps: on
    an H200 (2026-11-23, ``benchmarks/merge_sweep.py``, [1, T, 32, 128] bf16 into bf16) 88 µs
    at 8K rows (2.3 TB/s) vs 139 µs for the earlier 16 rows × 1 head, and the fastest shape for
    4K rows and for fp32 accumulators too (104 µs at 8K rows, 3.3 TB/s).
    """
    B, Tq, H, D = out.shape
    if out.stride(3) != 1 or out_b.stride(3) != 1:
        raise ValueError("merge_blocks_triton: out and out_b need unit stride in D")
    if Tq == 0 or B * H == 0:
        return
    for name, n in (("block_t", block_t), ("block_h", block_h)):
        if n < 1 or n & (n - 1):
            raise ValueError(f"merge_blocks_triton: {name} must be a power of two, got {n}")
    BT, BH = block_t, min(block_h, triton.next_power_of_2(H))
    grid = (triton.cdiv(Tq, BT), B * triton.cdiv(H, BH))
    guard = device_guard(out)
    with guard:
        launch(
            _merge_kernel, grid, out, lse, out_b, lse_b, Tq, H,
            out.stride(0), out.stride(1), out.stride(2),
            out_b.stride(0), out_b.stride(1), out_b.stride(2),
            lse.stride(0), lse.stride(1), lse.stride(2),
            lse_b.stride(0), lse_b.stride(1), lse_b.stride(2),
            D=D, BD=triton.next_power_of_2(D), BT=BT, BH=BH, num_warps=num_warps)

"""Triton row kernels of the chunked linear + cross entropy (:mod:`.loss`): two passes over one
chunk's logits instead of the torch path's ~9 elementwise passes over an fp32 copy.

The chunk's logits ``z = h_c Wᵀ`` stay in the GEMM's dtype (bf16 in training, as Megatron's
and Liger's losses keep them); the math is fp32 in registers:

``_stats_kernel`` (one program per token row): online max and exp-sum over the row's
``V/TP`` columns, and the target's logit when this TP rank holds the label::

    m = max_v z_v,   s = Σ_v exp(z_v − m),   t = z_y (0 if y is not in this rank's shard)

Between the kernels the TP ranks combine rows (``M = max_r m_r``, ``S = Σ_r s_r exp(m_r − M)``,
``t = Σ_r t_r``: one all-reduce each for M and (S, t)) and ``lse = M + log S``.

``_grad_kernel`` (row × column-block programs) overwrites the logits with their gradient::

    g_v = exp(z_v − lse) − [v = y]     (0 for rows whose label is ignore_index)

Layers: these kernels → :func:`chunk_triton` (launcher, called per chunk by
``loss._LinearCrossEntropy``). Reference: ``loss._chunk_torch`` (the same chunk in torch,
fp32). Needs triton and a CUDA device; runs under ``TRITON_INTERPRET=1`` on CPU for tests.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from sp_attention.triton_launch import launch
# Columns per loop step / program: 4096 bf16 values = 8 KB (smaller in the CPU interpreter).
BLOCK_V = 4096


@triton.jit(do_not_specialize=["V", "start", "stride"])
def _stats_kernel(z, stride, labels, m_out, s_out, t_out, V, start, BV: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = z + row * stride
    cols = tl.arange(0, BV)
    m = tl.full([BV], float("-inf"), tl.float32)        # per-lane running max and sum
    s = tl.zeros([BV], tl.float32)
    for off in range(0, V, BV):
        x = tl.load(base + off + cols, mask=off + cols < V, other=float("-inf")).to(tl.float32)
        nm = tl.maximum(m, x)
        nm_safe = tl.where(nm == float("-inf"), 0.0, nm)   # lanes that saw nothing yet
        s = s * tl.exp(m - nm_safe) + tl.exp(x - nm_safe)
        m = nm
    row_max = tl.max(m, 0)
    s = tl.where(m == float("-inf"), 0.0, s * tl.exp(m - row_max))
    y = tl.load(labels + row)
    col = y - start
    here = (col >= 0) & (col < V)
    t = tl.load(base + tl.where(here, col, 0)).to(tl.float32)
    tl.store(m_out + row, row_max)
    tl.store(s_out + row, tl.sum(s, 0))
    tl.store(t_out + row, tl.where(here, t, 0.0))


@triton.jit(do_not_specialize=["V", "start", "stride", "ignore_index"])
def _grad_kernel(z, stride, labels, lse, V, start, ignore_index, BV: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BV + tl.arange(0, BV)
    mask = cols < V
    base = z + row * stride
    y = tl.load(labels + row)
    x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
    p = tl.exp(x - tl.load(lse + row))
    p = tl.where(cols == y - start, p - 1.0, p)
    p = tl.where(y == ignore_index, 0.0, p)
    tl.store(base + cols, p.to(z.dtype.element_ty), mask=mask)


def chunk_triton(hc: torch.Tensor, weight: torch.Tensor, yc: torch.Tensor, cfg,
                 want_grad: bool):
    """One chunk (the contract of ``loss._chunk_torch``): (per-token loss [c] fp32, the
    logits' gradient [c, V/TP] in the weight's dtype — the logits buffer overwritten — or
    None)."""
    z = torch.mm(hc, weight.t())                                         # [c, Vl]
    c, V = z.shape
    yc = yc.contiguous().to(torch.int64)
    stats = torch.empty(3, c, dtype=torch.float32, device=z.device)      # m, s, t
    bv = min(BLOCK_V, triton.next_power_of_2(V))
    launch(_stats_kernel, (c,), z, z.stride(0), yc, stats[0], stats[1], stats[2], V,
           cfg.vocab_start, BV=bv, num_warps=8 if bv >= 2048 else 4)
    m = stats[0]
    if cfg.tp_size > 1:
        M = m.clone()
        dist.all_reduce(M, op=dist.ReduceOp.MAX, group=cfg.tp_group)
        st = torch.stack([stats[1] * torch.exp(m - M), stats[2]])
        dist.all_reduce(st, group=cfg.tp_group)
        m, s, t = M, st[0], st[1]
    else:
        s, t = stats[1], stats[2]
    lse = m + s.log()
    valid = yc != cfg.ignore_index
    loss = torch.where(valid, lse - t, torch.zeros_like(lse))
    if not want_grad:
        return loss, None
    lse = lse.contiguous()
    launch(_grad_kernel, (c, triton.cdiv(V, bv)), z, z.stride(0), yc, lse, V, cfg.vocab_start,
           cfg.ignore_index, BV=bv, num_warps=8 if bv >= 2048 else 4)
    return loss, z


# Below the row kernels, so that their lines (part of Triton's cache keys) stay put.
@triton.jit
def _scaled_kernel(x, s, out, n, BLOCK: tl.constexpr):
    """``out = x · s`` in fp32, rounded once to ``out``'s dtype; ``s`` read on the device."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)   # > 2^31 elements too
    mask = offs < n
    v = tl.load(x + offs, mask=mask).to(tl.float32) * tl.load(s)
    tl.store(out + offs, v.to(out.dtype.element_ty), mask=mask)


def scaled(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``x * s`` for a 0-d fp32 tensor ``s`` on ``x``'s device, without reading ``s`` on the
    host: each element in fp32, rounded once to ``x``'s dtype — what ``x * float(s)`` gives
    (torch rounds a 0-d tensor operand to a 16-bit ``x``'s dtype first), minus the device
    sync of ``float(s)``."""
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    block = 4096
    launch(_scaled_kernel, (triton.cdiv(n, block),), x, s.reshape(1).to(torch.float32), out,
           n, BLOCK=block)
    return out

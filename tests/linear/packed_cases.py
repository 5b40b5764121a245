"""Packed-document cases for the linear CP tests (run inside the per-world-size spawns of
``test_linear_cp.py``): rows of documents, their single-device per-document reference (the
token recurrence run on each document alone, results concatenated, autograd), and the check
of one rank's shard against it."""
from __future__ import annotations

import torch

from sp_attention.linear.gated_naive import recurrent_gated_attention
from sp_attention.testing import seeded

F64 = torch.float64


def named_rows(P: int) -> dict:
    """``name -> (cu_seqlens, row_len)`` at ``P`` ranks (contiguous shards of ``L`` tokens
    for the boundary cases; the zigzag plan places documents its own way)."""
    L = 12                               # tokens per rank in the contiguous layout
    row = P * L
    rows = {
        "boundary at shard edges": [0] + [L * r for r in range(1, P)] + [row],
        "short docs, single tokens": [0, 1, 2, 5, 6, 20, 21, 22, row - 1, row],
        "one doc over all ranks": [0, row],
        "hundreds of tiny docs": list(range(0, row + 1, 1)) if row <= 64 else
        list(range(0, row, 2)) + [row],
        "row ends in padding": [0, 7, row - 5],
    }
    out = {}
    for name, cu in rows.items():
        cu = sorted(set(c for c in cu if 0 <= c <= row))
        if cu[0] != 0 or len(cu) < 2:
            continue
        out[name] = (cu, row)
    return out


def make_inputs(B: int, row: int, H: int, K: int, V: int, gate_kind: str, seed: int):
    """Global row tensors: q, k, v, do ``[B, row, H, *]`` and g ``[B, row, H]`` (fp64)."""
    q, k = seeded((B, row, H, K), seed), seeded((B, row, H, K), seed + 1)
    v, do = seeded((B, row, H, V), seed + 2), seeded((B, row, H, V), seed + 3)
    u = seeded((B, row, H), seed + 4).abs()
    g = {"mixed": -u * torch.tensor([0.02, 0.7, 40.0][:H] + [0.3] * (H - 3), dtype=F64)[:H],
         "underflow": -50.0 - u, "near_one": -1e-9 * u}[gate_kind]
    return q, k, v, do, g


def per_document_reference(q, k, v, do, g, cu, scale: float):
    """o, dq, dk, dv, dg of each document run alone (zero start), concatenated; padding (past
    cu[-1]) zero. The token recurrence and autograd, fp64."""
    xs = [t.detach().clone().requires_grad_(True) for t in (q, k, v, g)]
    outs = []
    for a, b in zip(cu, cu[1:]):
        o, _ = recurrent_gated_attention(*(t[:, a:b] for t in xs), scale=scale)
        outs.append(o)
    pad = q.shape[1] - cu[-1]
    if pad:
        outs.append(q.new_zeros(q.shape[0], pad, q.shape[2], v.shape[3]))
    o = torch.cat(outs, 1)
    grads = torch.autograd.grad((o * do).sum(), xs, allow_unused=True)
    return [o.detach()] + [torch.zeros_like(x) if gr is None else gr
                           for x, gr in zip(xs, grads)]


def assert_dg_close(dg, ref, q, dq_ref, tol: float = 1e-10, name: str = "dg") -> None:
    """dg against its reference, relative to the larger of the reference and the per-token
    terms ``q_i·dq_i`` whose differences form it (where every decay underflows the true dg is
    ~exp(g), 1e-22, and any chunked form computes it only to rounding of O(1) terms)."""
    if not torch.isfinite(dg).all():
        raise AssertionError(f"{name}: non-finite values")
    scale = max(float(ref.norm()), float((q * dq_ref).sum(-1).norm()), 1e-300)
    err = float((dg - ref).norm()) / scale
    if not err <= tol:
        raise AssertionError(f"{name}: scaled error {err:.3e} > {tol:.1e}")


def check_shard(got, want, q_shard, name: str, tol: float = 1e-10) -> None:
    """(o, dq, dk, dv[, dg]) of a shard against the sharded reference."""
    from sp_attention.testing import assert_close
    for x, y, what in zip(got[:4], want[:4], ("o", "dq", "dk", "dv")):
        assert_close(x, y, tol, f"{name} {what}")
    if len(got) > 4 and got[4] is not None:
        assert_dg_close(got[4], want[4], q_shard, want[1], tol, f"{name} dg")

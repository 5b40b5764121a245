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


# single very negative (finite) gates among moderate ones: each resets the state; below the
# gate floor they are clamped (sp_attention.linear.gates.GATE_FLOOR), which changes no decay
BIG_GATES = (-1e2, -1e4, -1e6, -1e8, -1e12, -1e16, -1e30)


def with_big_gates(g: torch.Tensor, values=BIG_GATES) -> torch.Tensor:
    """``g`` with one gate of each of ``values`` at tokens ``5, 42, 79, …`` (mod T, spread over
    the row: mid-chunk, mid-leaf and at leaf edges), rows and heads in turn."""
    g = g.clone()
    B, T, H = g.shape
    for i, x in enumerate(values):
        g[i % B, (5 + 37 * i) % T, i % H] = x
    return g


def make_inputs(B: int, row: int, H: int, K: int, V: int, gate_kind: str, seed: int):
    """Global row tensors: q, k, v, do ``[B, row, H, *]`` and g ``[B, row, H]`` (fp64).
    ``gate_kind``: mixed rates, ``underflow`` (every chunk's transition 0), ``near_one``,
    ``big`` (mixed with :data:`BIG_GATES` among them)."""
    q, k = seeded((B, row, H, K), seed), seeded((B, row, H, K), seed + 1)
    v, do = seeded((B, row, H, V), seed + 2), seeded((B, row, H, V), seed + 3)
    u = seeded((B, row, H), seed + 4).abs()
    mixed = -u * torch.tensor([0.02, 0.7, 40.0][:H] + [0.3] * (H - 3), dtype=F64)[:H]
    if gate_kind == "big":
        return q, k, v, do, with_big_gates(mixed)
    g = {"mixed": mixed, "underflow": -50.0 - u, "near_one": -1e-9 * u}[gate_kind]
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


IMPLS = ("blelloch", "allgather", "ring", "auto")


def _gated_unpacked(group, world: int, rank: int, full: bool) -> int:
    """Per-token gates on the unpacked path: every schedule, both layouts, GQA (Hkv = 1),
    gates that underflow and that keep A near 1."""
    from sp_attention import build_sp_context, shard_sequence
    from sp_attention.linear import lightning_attention
    n = 0
    kinds = ("mixed", "underflow", "near_one", "big") if full else ("mixed",)
    for i, kind in enumerate(kinds):
        T = 2 * world * (7 if kind == "mixed" else 5)
        q, k, v, do, g = make_inputs(2, T, 3, 4, 5, kind, 11)
        kv_heads = 1 if kind == "mixed" else 3             # GQA: one K/V head for three
        k1, v1 = k[:, :, :kv_heads], v[:, :, :kv_heads]
        ke, ve = (x.repeat_interleave(3 // kv_heads, 2) for x in (k1, v1))
        ref = per_document_reference(q, ke, ve, do, g, [0, T], 0.6)
        for j, layout in enumerate(("contiguous", "zigzag")):
            ctx = build_sp_context(group, layout=layout)
            sh = lambda t: shard_sequence(t, ctx, 1)        # noqa: E731
            want = [sh(t) for t in ref]
            if kv_heads != 3:        # GQA: the reference's K/V gradients summed per group
                want[2], want[3] = (w.view(*w.shape[:2], kv_heads, -1, w.shape[-1]).sum(3)
                                    for w in want[2:4])
            for impl in IMPLS if i == 0 else IMPLS[j::2]:
                xs = [sh(t).clone().requires_grad_(True) for t in (q, k1, v1, g)]
                o = lightning_attention(*xs[:3], g=xs[3], ctx=ctx, impl=impl, scale=0.6,
                                        backend="torch")
                (o * sh(do)).sum().backward()
                check_shard((o,) + tuple(x.grad for x in xs), want, xs[0].detach(),
                            f"gated {kind} {layout} {impl} P{world} r{rank}")
                n += 1
    return n


def packed_rows(world: int, full: bool) -> dict:
    """Named packed rows: the boundary cases of :func:`named_rows`, long documents (pieces of
    several chunks) and, at small P, hundreds of tiny documents."""
    rows = named_rows(world)
    if not full:
        return {k: rows[k] for k in ("boundary at shard edges", "short docs, single tokens")}
    L = 80
    cut = int(0.6 * world * L)
    rows["long docs over chunks"] = ([0, cut, cut + 1, world * L - 5], world * L)
    rows["boundaries at leaf edges"] = (list(range(0, world * 12 + 1, 6)), world * 12)
    if world in (2, 3):
        rows["hundreds of tiny docs"] = (list(range(0, 360, 2)) + [361], 362)
    return rows


BIG_ROWS = ("one doc over all ranks", "long docs over chunks")     # rows with BIG_GATES


def _packed(group, world: int, rank: int, full: bool) -> int:
    """Packed documents: every named row × both layouts, gates and fixed slopes, against the
    per-document reference; every schedule on the first rows, one each (in turn) on the rest
    (the spawn's time)."""
    from sp_attention import build_sp_context, plan_packing
    from sp_attention.linear import lightning_attention
    n = 0
    slopes = torch.tensor([0.02, 0.7, 40.0], dtype=F64)
    for i, (name, (cu, row)) in enumerate(packed_rows(world, full).items()):
        gates = "underflow" if "tiny" in name else "big" if name in BIG_ROWS else "mixed"
        q, k, v, do, g = make_inputs(2 if row < 300 else 1, row, 3, 4, 5, gates, 7)
        if i == 0:                       # GQA: one K/V head serves the three query heads
            k, v = k[:, :, :1], v[:, :, :1]
        ke, ve = k.expand(-1, -1, 3, -1), v.expand(-1, -1, 3, -1)
        refs = {"g": per_document_reference(q, ke, ve, do, g, cu, 0.6)}
        if full and i < 3:
            fixed = -slopes.expand_as(g)
            refs["slopes"] = per_document_reference(q, ke, ve, do, fixed, cu, 0.6)
        for j, layout in enumerate(("contiguous", "zigzag")):
            ctx = build_sp_context(group, layout=layout)
            plan = plan_packing(cu, ctx, row_len=row)
            sh = lambda t: plan.shard(t, ctx.rank, 1)       # noqa: E731
            for kind, ref in refs.items():
                for impl in IMPLS if i < 2 else (IMPLS[(i + j) % len(IMPLS)],):
                    xs = [sh(t).clone().requires_grad_(True) for t in (q, k, v, g)]
                    dec = {"g": xs[3]} if kind == "g" else {"slopes": slopes}
                    o = lightning_attention(*xs[:3], **dec, cu_seqlens=plan, ctx=ctx, impl=impl,
                                            scale=0.6, backend="torch")
                    (o * sh(do)).sum().backward()
                    got = (o,) + tuple(x.grad for x in xs[:3]) + \
                        ((xs[3].grad,) if kind == "g" else ())
                    want = [sh(t) for t in ref]
                    if i == 0:           # the K/V gradients summed over the query-head group
                        want[2], want[3] = (w.sum(2, keepdim=True) for w in want[2:4])
                    check_shard(got, want, xs[0].detach(),
                                f"packed {name} {kind} {layout} {impl} P{world} r{rank}")
                    n += 1
    return n


def _isolation(group, world: int, rank: int) -> int:
    """Changing one document's tokens leaves every other document's outputs and gradients
    bit-identical (both layouts, every schedule)."""
    from sp_attention import build_sp_context, plan_packing
    from sp_attention.linear import lightning_attention
    cu, row = [0, 9, 30, 31, 50, 72], 72
    q, k, v, do, g = make_inputs(1, row, 3, 4, 5, "mixed", 21)
    changed = [t.clone() for t in (q, k, v, g)]
    for t in changed:                 # document 2 (its one token, 30)
        t[:, 30:31] = t[:, 30:31] * 1.5 + 0.25
    changed[3] = changed[3].clamp(max=0.0)
    n = 0
    for layout in ("contiguous", "zigzag"):
        ctx = build_sp_context(group, layout=layout)
        plan = plan_packing(cu, ctx, row_len=row)
        doc = plan.doc_ids(ctx.rank)
        keep = (doc != 2)
        for impl in IMPLS:
            outs = []
            for inputs in ((q, k, v, g), tuple(changed)):
                xs = [plan.shard(t, ctx.rank, 1).clone().requires_grad_(True) for t in inputs]
                o = lightning_attention(*xs[:3], g=xs[3], cu_seqlens=plan, ctx=ctx, impl=impl,
                                        scale=0.6, backend="torch")
                (o * plan.shard(do, ctx.rank, 1)).sum().backward()
                outs.append([o.detach()] + [x.grad for x in xs])
            for a, b, what in zip(*outs, ("o", "dq", "dk", "dv", "dg")):
                assert torch.equal(a[:, keep], b[:, keep]), \
                    f"isolation {layout} {impl} r{rank} {what}: another document changed"
            n += 1
    return n


def big_gate_fp32(group, world: int, rank: int) -> int:
    """fp32 with single −1e6 gates among moderate ones (unpacked and packed, both layouts):
    every rank's errors in o, dq, dk, dv and dg against the fp64 recurrence are at most twice
    those with the moderate gates alone (unclamped, the running sums of g cancel: ~1e-2)."""
    from sp_attention import build_sp_context, plan_packing, shard_sequence
    from sp_attention.linear import lightning_attention
    from sp_attention.testing import rel_rms
    T = 2 * world * 24
    q, k, v, do, g = make_inputs(2, T, 3, 8, 8, "mixed", 31)
    rows = {"moderate": g, "-1e6": with_big_gates(g, (-1e6,) * 3)}
    n = 0
    for cu in ([0, T], [0, 30, T - 7]):
        refs = {name: per_document_reference(q, k, v, do, gg, cu, 0.6) for name, gg in rows.items()}
        for layout in ("contiguous", "zigzag"):
            ctx = build_sp_context(group, layout=layout)
            plan = None if len(cu) == 2 else plan_packing(cu, ctx, row_len=T)
            sh = (lambda t: shard_sequence(t, ctx, 1)) if plan is None else \
                (lambda t: plan.shard(t, ctx.rank, 1))
            errs = {}
            for name, gg in rows.items():
                xs = [sh(t).float().requires_grad_(True) for t in (q, k, v, gg)]
                o = lightning_attention(*xs[:3], g=xs[3], cu_seqlens=plan, ctx=ctx,
                                        impl="blelloch", scale=0.6, backend="torch")
                (o * sh(do).float()).sum().backward()
                got = [o] + [x.grad for x in xs]
                errs[name] = [rel_rms(a, sh(b)) for a, b in zip(got, refs[name])]
            for what, a, b in zip(("o", "dq", "dk", "dv", "dg"), errs["moderate"], errs["-1e6"]):
                assert 0 < b <= 2 * a, f"fp32 -1e6 gate cu {cu} {layout} r{rank} {what}: " \
                    f"{b:.2e} > 2 x {a:.2e} (moderate gates)"
            n += 1
    return n


def gated_and_packed(group, world: int, rank: int) -> int:
    """Everything above at this world size (fewer cases at P ≥ 5: the spawn's time)."""
    full = world <= 4
    n = _gated_unpacked(group, world, rank, full) + _packed(group, world, rank, full)
    if world == 3:
        n += _isolation(group, world, rank)
    if world in (1, 3):
        n += big_gate_fp32(group, world, rank)
    return n

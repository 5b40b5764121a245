"""Quickstart demo: split one sequence over N CPU processes (gloo) and check every rank.

    python -m sp_attention.demo --world-size 4

Each rank holds its zigzag shard; linear attention with decay runs through every scan schedule
and softmax attention through every forward × backward pair. Each rank's output and input
gradients are compared (fp64) with single-device attention on the whole sequence.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from . import build_sp_context, shard_sequence
from .linear import IMPLS, lightning_attention
from .linear.naive import recurrent_linear_attention
from .softmax import PRESETS, context_parallel_attention
from .softmax.naive import attention_reference
from .testing import rel_rms, run_distributed, seeded


def _linear(ctx, T):
    B, H, K = 1, 4, 16
    q, k, v, w = (seeded((B, T, H, K), s) for s in range(4))
    slopes = torch.tensor([0.01, 0.1, 0.5, 2.0], dtype=torch.float64)
    ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
    o, _ = recurrent_linear_attention(*ref, slopes)
    (o * w).sum().backward()
    want = [shard_sequence(t, ctx, 1) for t in (o.detach(), *(r.grad for r in ref))]
    rows = []
    for impl in [i for i in IMPLS if i != "auto"]:
        loc = [shard_sequence(t, ctx, 1).requires_grad_(True) for t in (q, k, v)]
        out = lightning_attention(*loc, slopes, ctx=ctx, impl=impl, backend="torch")
        (out * shard_sequence(w, ctx, 1)).sum().backward()
        err = max(rel_rms(g, e) for g, e in zip((out, *(t.grad for t in loc)), want))
        rows.append((f"linear {impl}", err))
    return rows


def _softmax(ctx, T):
    B, H, Hkv, D = 1, 8, 2, 16
    q, do = seeded((B, T, H, D), 10), seeded((B, T, H, D), 11)
    k, v = seeded((B, T, Hkv, D), 12), seeded((B, T, Hkv, D), 13)
    ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
    o, _ = attention_reference(*ref, causal=True)
    o.backward(do)
    want = [shard_sequence(t, ctx, 1) for t in (o.detach(), *(r.grad for r in ref))]
    rows, P = [], ctx.world_size
    sizes = [u for u in range(2, P) if P % u == 0 and H % u == 0]
    for name in PRESETS:
        kw = dict(preset=name)
        if name == "a2a" and H % P:
            continue                    # Ulysses splits the heads over the ranks
        if name == "a2a_ring":
            if not sizes:
                continue                # all-to-all groups need a size dividing P and H
            kw["a2a_size"] = sizes[0]
            name = f"a2a_ring (groups of {sizes[0]})"
        loc = [shard_sequence(t, ctx, 1).requires_grad_(True) for t in (q, k, v)]
        out = context_parallel_attention(*loc, ctx=ctx, causal=True, backend="math", **kw)
        out.backward(shard_sequence(do, ctx, 1))
        err = max(rel_rms(g, e) for g, e in zip((out, *(t.grad for t in loc)), want))
        rows.append((f"softmax {name}", err))
    return rows


def _rank_main(rank, world, T):
    ctx = build_sp_context(dist.new_group(list(range(world))), layout="zigzag")
    return _linear(ctx, T) + _softmax(ctx, T)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=4, help="number of CPU processes (CP size)")
    p.add_argument("--seq-len", type=int, default=None, help="global tokens (default 8 per rank)")
    a = p.parse_args(argv)
    if a.world_size < 1:
        p.error("--world-size must be >= 1")
    T = a.seq_len or 8 * a.world_size
    if T % (2 * a.world_size):
        p.error(f"--seq-len must be a multiple of 2 × world size = {2 * a.world_size}")
    print(f"splitting {T} tokens over {a.world_size} gloo processes (zigzag) ...", flush=True)
    t0 = time.time()
    per_rank = run_distributed(_rank_main, a.world_size, T, timeout=600)
    worst = 0.0
    print(f"{'schedule':<28}" + "".join(f"rank {r:<6}" for r in range(a.world_size)))
    for i, (name, _) in enumerate(per_rank[0]):
        errs = [rows[i][1] for rows in per_rank]
        worst = max(worst, *errs)
        print(f"{name:<28}" + "".join(f"{e:<11.1e}" for e in errs))
    ok = worst < 1e-10
    print(f"max relative error vs single-device fp64: {worst:.2e} -> {'OK' if ok else 'FAIL'} "
          f"({time.time() - t0:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

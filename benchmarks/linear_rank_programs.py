"""Benchmark: each rank's local GPU work in a linear CP step, on ONE GPU.

    python benchmarks/linear_rank_programs.py [--t-local 16384 32768] [--worlds 1 2 4]
        [--layouts contiguous zigzag] [--device cpu --t-local 128]   # CPU dry run

Every rank's program is assembled as `lightning_attention` assembles it (its leaves as the rows
of one batch via `leaf_rows`, the first-leaf / last-leaf flags of `LinearTuning`, then
`leaves_output` and `leaves_backward`) on T_local tokens. For P > 1 the scan callbacks return
prepared states of the right shape (zeros where nothing enters / no gradient arrives) instead
of communicating, so a row is the GPU time of that rank's kernels and bookkeeping alone (queued
timing on CUDA). For P = 1 (zigzag: two leaves on one GPU) the scan is the library's own
`scan_rows` over a one-rank context, for each `--scans` schedule: nothing is left out.

Rows (`impl` "rank program"): layout, world (P), rank, scan, ms_fwd, ms_bwd, ms_fwd_bwd (one
forward then its backward, timed together), `ratio` = (ms_fwd + ms_bwd) ÷ the single-GPU
kernel's fwd+bwd on the same T_local (fla `chunk_simple_gla` on CUDA, the torch backend on CPU),
`ratio_slowest` = the largest `ratio` over the ranks of that (layout, P): a CP step can be no
faster than its slowest rank. `peak_mem_gb`: what one fwd+bwd adds at its peak above its inputs
(the baseline row carries the single-GPU kernel's). Also the older A/B rows of the contiguous
P = 2 ranks: first/last-leaf shortcuts on and off, the backward's two chunk recurrences on two
streams and one after the other. What this cannot show is the waiting between ranks;
`linear_cp.py` on several GPUs measures that.

    python benchmarks/linear_rank_programs.py --summary FILE.jsonl   # table of the JSON lines

``--gated``: the same with per-token gates ``g`` (logsigmoid(x)/16, fp32) in place of the
slopes. fla 0.6.0 refuses its gated backward on Hopper with Triton < 3.7.1 (fla #640), so
the rows carry three baselines: ``fla fwd g`` (fla's own gated forward: ``ratio_fwd``), our
one-leaf gated call (``ours P=1 g``: ``ratio`` as above), and ``fla g estimate``: fla's
gated forward plus its gated backward kernels with the refused ``chunk_bwd_dqkwg`` timed as
its fixed-rate twin (the same GEMMs, no dg): what fla with gates would cost if it ran
(``ratio_fla_estimate``); ``fla g estimate, gated dqkwg`` the same with fla's gated
``chunk_bwd_kernel_dqkwg`` itself launched and timed (its results unread:
``benchmarks.common.fla_gated_dqkwg_timing_only``; ``ratio_fla_estimate_gated``). The row
``ours P=1 fwd g`` is the public call's forward at P = 1 (``ratio_fwd``: ÷ fla's gated
forward). One command for the gated speed (the public call against fla's forward, then every
rank's program)::

    python benchmarks/linear_rank_programs.py --gated --t-local 32768 --no-ab
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import (base_parser, device_name, emit, host_ahead_lost,  # noqa: E402
                               kernel_table, peak_mem_gb, parse_or_summarize, time_ms)
from sp_attention import LinearTuning, SPContext, lightning_attention  # noqa: E402
from sp_attention.planning.layout import leaves_of_rank  # noqa: E402
from sp_attention.linear.attention import leaf_rows, scan_rows  # noqa: E402
from sp_attention.linear.decay import Decay  # noqa: E402
from sp_attention.linear.leaves import leaves_backward, leaves_output  # noqa: E402

SUMMARY_COLS = ["impl", "decay", "layout", "world", "rank", "scan", "T_local", "ms", "ms_fwd",
                "ms_bwd", "ms_fwd_bwd", "ratio", "ratio_slowest", "ratio_fwd",
                "ratio_fla_estimate", "ratio_fla_estimate_gated", "peak_mem_gb", "host_ahead_lost"]


def rank_program(rank: int, world: int, layout: str, q, k, v, do, slopes, backend: str,
                 tuning: LinearTuning, scan: str = "ring"):
    """``(fwd, bwd, fwd_bwd)`` closures of rank ``rank``'s program at ``world`` ranks on its
    ``q, k, v, do [1, T_local, H, K]``, as `_LightningAttention` runs it. ``world == 1``: the
    library's scan ``scan`` over a one-rank context; otherwise prepared states. ``slopes``:
    a slopes tensor or a :class:`~sp_attention.linear.decay.Decay` (gates of the shard)."""
    leaves = leaves_of_rank(rank, world, layout)
    n, L = len(leaves), (2 * world if layout == "zigzag" else world)
    qb, kb, vb, dob = (leaf_rows(t, n) for t in (q, k, v, do))
    slopes = slopes.rows(n) if isinstance(slopes, Decay) else slopes
    zero_in = tuning.static_zero_paths and all(leaf == 0 for leaf in leaves)
    needed = tuple(leaf != 0 for leaf in leaves)
    zero_grad = tuning.static_zero_paths and all(leaf == L - 1 for leaf in leaves)
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    g = torch.Generator(device=q.device).manual_seed(3 + rank)
    S = torch.randn(n, H, K, V, device=q.device, dtype=torch.float32, generator=g) * 0.01
    G = torch.randn(n, H, K, V, device=q.device, dtype=torch.float32, generator=g) * 0.01
    S[[j for j, leaf in enumerate(leaves) if leaf == 0]] = 0        # nothing enters leaf 0
    G[[j for j, leaf in enumerate(leaves) if leaf == L - 1]] = 0    # nor leaves the last one
    if world == 1:
        ctx = SPContext(None, 0, 1, layout=layout)
        fscan = lambda b, A: scan_rows(b, A, ctx, scan, False)  # noqa: E731
        bscan = lambda d, A: scan_rows(d, A, ctx, scan, True)  # noqa: E731
    else:
        fscan, bscan = (lambda b, A: S), (lambda d, A: G)

    def fwd():
        return leaves_output(qb, kb, vb, slopes, 1.0, fscan, backend, zero_in, tuning=tuning)

    def bwd(S_in=S):
        return leaves_backward(qb, kb, vb, slopes, 1.0, S_in, dob, bscan, backend, needed,
                               zero_grad, tuning=tuning)

    def fwd_bwd():
        _, S_in = fwd()
        return bwd(S_in)
    return fwd, bwd, fwd_bwd


def programs(worlds, layouts, scans):
    """``(layout, P, scan)`` groups to time: P = 1 only zigzag (contiguous P = 1 is one leaf,
    the plain kernel), once per scan schedule; P > 1 with the stand-in scan ("-")."""
    for layout in layouts:
        for P in worlds:
            if P == 1:
                if layout == "zigzag":
                    yield from ((layout, P, s) for s in scans)
            else:
                yield layout, P, "-"


def ab_rows(q, k, v, do, slopes, backend: str, tuning: LinearTuning) -> dict:
    """The contiguous P = 2 A/B rows: shortcuts on/off (zero states or prepared ones)."""
    g = torch.Generator(device=q.device).manual_seed(11)
    S = torch.randn(1, q.shape[2], q.shape[3], v.shape[3], device=q.device, generator=g) * 0.01
    Z = torch.zeros_like(S)

    def out(zero_in, S_in):
        return lambda: leaves_output(q, k, v, slopes, 1.0, lambda b, A: S_in, backend,
                                     zero_in=zero_in, tuning=tuning)

    def back(S_in, G, **kw):
        return lambda: leaves_backward(q, k, v, slopes, 1.0, S_in, do, lambda d, A: G, backend,
                                       tuning=tuning, **kw)
    return {"rank0 fwd, shortcut": out(True, Z), "rank0 fwd, no shortcut": out(False, Z),
            "rank1 fwd": out(False, S), "rank0 bwd": back(Z, S, needed=(False,)),
            "rank1 bwd, shortcut": back(S, Z, zero_grad=True),
            "rank1 bwd, no shortcut": back(S, Z)}


def baselines(q, k, v, do, slopes, dev: str, g=None) -> dict:
    """The single-GPU kernel on the same tokens: ``{"fwd": fn, "fwd+bwd": fn}``; with gates
    ``g`` (fla refuses its gated backward here): ``{"fwd": fla's gated forward, "fwd+bwd":
    our one-leaf gated call, "estimate": fla's gated kernels with the refused one timed as
    its fixed-rate twin}``."""
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    if g is not None:
        return _gated_baselines(q, k, v, do, g, slopes, dev, (qg, kg, vg))
    if dev == "cuda":
        from fla.ops.simple_gla import chunk_simple_gla

        def f(a, b, c):
            return chunk_simple_gla(a, b, c, g_gamma=-slopes, scale=1.0)[0]
    else:
        def f(a, b, c):
            return lightning_attention(a, b, c, slopes, backend="torch")

    def fb():
        f(qg, kg, vg).backward(do)
    return {"fwd": lambda: f(q, k, v), "fwd+bwd": fb}


def _gated_baselines(q, k, v, do, g, slopes, dev: str, grads) -> dict:
    qg, kg, vg = grads
    backend = "fla" if dev == "cuda" else "torch"

    def ours():
        lightning_attention(qg, kg, vg, g=g, scale=1.0, backend=backend).backward(do)
    out = {"fwd+bwd": ours,
           "ours fwd": lambda: lightning_attention(q, k, v, g=g, scale=1.0, backend=backend)}
    if dev != "cuda":
        out["fwd"] = lambda: lightning_attention(q, k, v, g=g, scale=1.0, backend=backend)
        return out
    import math

    from fla.ops.common.chunk_h import chunk_bwd_dh, chunk_fwd_h
    from fla.ops.common.chunk_o import chunk_bwd_dqkwg, chunk_bwd_dv
    from fla.ops.simple_gla import chunk_simple_gla
    from fla.ops.utils import chunk_local_cumsum

    from benchmarks.common import fla_gated_dqkwg_timing_only
    gg = (-slopes / math.log(2)).float()

    def fla_gated_step(dqk):
        """fla's gated forward and its backward's steps, dq/dk/dg by ``dqk(h, dh, gc)``."""
        def run():
            chunk_simple_gla(q, k, v, g=g, scale=1.0)            # fla's gated forward
            gc = chunk_local_cumsum(g, 64, scale=1 / math.log(2))
            h, _ = chunk_fwd_h(k=k, v=v, g=gc, h0=None, output_final_state=False,
                               chunk_size=64, states_in_fp32=True)
            dh, _ = chunk_bwd_dh(q=q, k=k, v=v, do=do, h0=None, dht=None, scale=1.0, g=gc,
                                 chunk_size=64, states_in_fp32=True)
            chunk_bwd_dv(q=q, k=k, do=do, dh=dh, g=gc, scale=1.0, chunk_size=64)
            dqk(h, dh, gc)
        return run

    def twin(h, dh, gc):    # the refused gated kernel timed as its fixed-rate twin (no dg)
        chunk_bwd_dqkwg(q=q, k=k, v=v, do=do, h=h, dh=dh, g_gamma=gg, scale=1.0, chunk_size=64)
        chunk_local_cumsum(g, 64, reverse=True)                  # dg's reverse sums

    def gated(h, dh, gc):   # fla's gated kernel itself, timed only (+ dg's reverse sums)
        fla_gated_dqkwg_timing_only(q, k, v, do, h, dh, gc, 1.0)
    out["fwd"] = lambda: chunk_simple_gla(q, k, v, g=g, scale=1.0)
    out["estimate"] = fla_gated_step(twin)
    out["estimate gated"] = fla_gated_step(gated)
    return out


def run_t(T: int, a, dev: str) -> None:
    device = torch.device("cuda", 0) if dev == "cuda" else torch.device("cpu")
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if dev == "cuda"
                                                     else torch.float32)
    backend = "fla" if dev == "cuda" else "torch"
    H, K = a.heads, a.head_dim
    slopes = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)], device=device)
    g = torch.Generator(device=device).manual_seed(11)
    q, k, v, do = (torch.randn(1, T, H, K, device=device, dtype=dtype, generator=g) * 0.1
                   for _ in range(4))
    gates = (torch.nn.functional.logsigmoid(torch.randn(1, T, H, device=device, generator=g))
             / 16) if a.gated else None
    mode = "queued" if dev == "cuda" else "eager"
    base = {"bench": "linear_rank_programs", "T_local": T, "H": H, "K": K,
            "dtype": str(dtype).replace("torch.", ""), "device": device_name(dev),
            "timing": mode, "backend": backend, "decay": "g" if a.gated else "slopes"}
    if a.gated:
        return run_gated(T, a, dev, q, k, v, do, slopes, gates, base)

    def timer(fn):
        fn()
        if dev == "cuda":
            torch.cuda.synchronize()
        return time_ms(fn, dev, a.warmup, a.iters, a.repeats, mode=mode)
    ref = baselines(q, k, v, do, slopes, dev)
    ref_ms = timer(ref["fwd+bwd"])
    name = "fla" if dev == "cuda" else "torch"      # "fla fwd+bwd": as in earlier results
    emit(dict(base, impl=f"{name} fwd", ms=timer(ref["fwd"])), a.out, 0)
    emit(dict(base, impl=f"{name} fwd+bwd", ms=ref_ms, ms_fwd_bwd=ref_ms, ratio=1.0,
              peak_mem_gb=peak_mem_gb(ref["fwd+bwd"], dev)), a.out, 0)
    default = LinearTuning()
    for layout, P, scan in programs(a.worlds, a.layouts, a.scans):
        rows = []
        for r in range(P):
            fwd, bwd, fb = rank_program(r, P, layout, q, k, v, do, slopes, backend, default,
                                        "ring" if scan == "-" else scan)
            tf, tb = timer(fwd), timer(bwd)
            rows.append(dict(base, impl="rank program", layout=layout, world=P, rank=r,
                             leaves=list(leaves_of_rank(r, P, layout)), scan=scan, ms_fwd=tf,
                             ms_bwd=tb, ms_fwd_bwd=timer(fb), ratio=(tf + tb) / ref_ms,
                             peak_mem_gb=peak_mem_gb(fb, dev)))
        worst = max(row["ratio"] for row in rows)
        for row in rows:      # host_ahead_lost: queued repeats so far that were not host-ahead
            emit(dict(row, ratio_slowest=worst, host_ahead_lost=host_ahead_lost()), a.out, 0)
    if a.profile and dev == "cuda":
        kernel_table(ref["fwd"], f"fla fwd, T {T}")
        kernel_table(ref["fwd+bwd"], f"fla fwd+bwd, T {T}")
        for r in (0, 1):
            fwd, bwd, _ = rank_program(r, 2, "contiguous", q, k, v, do, slopes, backend,
                                       default)
            kernel_table(fwd, f"contiguous P 2 rank {r} fwd, T {T}")
            kernel_table(bwd, f"contiguous P 2 rank {r} bwd, T {T}")
    if a.no_ab:
        return
    flip = LinearTuning(concurrent_recurrences=not default.concurrent_recurrences)
    runs = list(ab_rows(q, k, v, do, slopes, backend, default).items())
    tag = ", serial" if default.concurrent_recurrences else ", concurrent"
    runs += [(name + tag, fn) for name, fn in ab_rows(q, k, v, do, slopes, backend,
                                                       flip).items() if "bwd" in name]
    for name, fn in runs:
        emit(dict(base, impl=name, layout="contiguous", world=2, ms=timer(fn)), a.out, 0)


def run_gated(T, a, dev, q, k, v, do, slopes, gates, base) -> None:
    """The ``--gated`` rows: every rank's program with gates, against the three baselines."""
    def timer(fn):
        fn()
        if dev == "cuda":
            torch.cuda.synchronize()
        return time_ms(fn, dev, a.warmup, a.iters, a.repeats, mode=base["timing"])
    ref = baselines(q, k, v, do, slopes, dev, g=gates)
    times = {name: timer(fn) for name, fn in ref.items()}
    names = {"fwd": "fla fwd g" if dev == "cuda" else "torch fwd g", "fwd+bwd": "ours P=1 g",
             "ours fwd": "ours P=1 fwd g", "estimate": "fla g estimate",
             "estimate gated": "fla g estimate, gated dqkwg"}
    for name, ms in times.items():
        extra = {"ratio_fwd": ms / times["fwd"]} if name == "ours fwd" else {}
        emit(dict(base, impl=names[name], ms=ms, **extra), a.out, 0)
    backend = base["backend"]
    for layout, P, scan in programs(a.worlds, a.layouts, a.scans):
        rows = []
        for r in range(P):
            fwd, bwd, fb = rank_program(r, P, layout, q, k, v, do, Decay(g=gates), backend,
                                        LinearTuning(), "ring" if scan == "-" else scan)
            tf, tb = timer(fwd), timer(bwd)
            row = dict(base, impl="rank program", layout=layout, world=P, rank=r, scan=scan,
                       ms_fwd=tf, ms_bwd=tb, ms_fwd_bwd=timer(fb),
                       ratio=(tf + tb) / times["fwd+bwd"], ratio_fwd=tf / times["fwd"])
            if "estimate" in times:
                row["ratio_fla_estimate"] = (tf + tb) / times["estimate"]
                row["ratio_fla_estimate_gated"] = (tf + tb) / times["estimate gated"]
            rows.append(row)
        worst = max(row["ratio"] for row in rows)
        for row in rows:
            emit(dict(row, ratio_slowest=worst, host_ahead_lost=host_ahead_lost()), a.out, 0)


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4], help="CP sizes P")
    p.add_argument("--layouts", nargs="+", default=["contiguous", "zigzag"],
                   choices=["contiguous", "zigzag"])
    p.add_argument("--scans", nargs="+", default=["ring", "blelloch", "allgather"],
                   choices=["ring", "blelloch", "allgather"], help="P = 1 scan schedules")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--no-ab", action="store_true", help="skip the contiguous P = 2 A/B rows")
    p.add_argument("--gated", action="store_true",
                   help="per-token gates g in place of the slopes (see the module doc)")
    p.add_argument("--profile", action="store_true",
                   help="CUDA: print the kernels of fla's fwd / fwd+bwd and of the contiguous "
                        "P = 2 ranks' fwd / bwd")
    a = parse_or_summarize(p, SUMMARY_COLS)
    if a is None:
        return
    for T in a.t_local or ([32768] if a.device == "cuda" else [128]):
        run_t(T, a, a.device)


if __name__ == "__main__":
    main()

"""GPU check and benchmark of packed-document linear attention on ONE GPU (each rank's program
alone, as ``linear_rank_programs.py`` does), fixed slopes and per-token gates.

    python benchmarks/packed_linear.py --out-dir $OUT              # on the H200
    python benchmarks/packed_linear.py --dry-run                   # CPU: torch path, tiny rows

Rows of log-normal documents (median 720 tokens, σ 1.25, as DESIGN §4c measured; seeded) of
``P·T_local`` tokens are planned (:func:`sp_attention.plan_packing`, both layouts) and every
rank's shard is run through the library's packed path (:func:`sp_attention.linear.packed.
packed_output` / ``packed_grads``) with the scan replaced by prepared states (no
communication; nothing else is left out).

``check`` (bf16 and fp32, small rows, P = 3): every rank's o, dq, dk, dv (and dg) against the
per-document fp64 recurrence on the GPU (relative RMS; bf16 ≤ 1.5e-2, fp32 ≤ 2e-3).
``perf`` (bf16, B 1, H 16, K = V 128, T_local ``--t-local`` 8K 32K, P = 2 and 4): per rank
``ms_fwd``, ``ms_fwd_bwd``, and the baseline: fla's varlen ``chunk_simple_gla`` on the same
local sequences (``cu_seqlens``, per-sequence ``initial_state``); ``ratio`` = ours ÷ fla
(target ≤ 1.05, fixed slopes). fla 0.6.0 refuses its gated backward on Hopper with Triton < 3.7.1
(fla #640): for gates the baseline is fla's forward only (``ratio_fwd``). fla's varlen
``chunk_fwd_h`` reads its chunk count on the host (a device sync per call, both sides), so
the timing is eager (``timing``), the host enqueueing while the GPU runs.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

_FAILED: list = []
_OUT: list = [None]
_T0 = time.time()


def emit(rec: dict) -> None:
    rec.setdefault("elapsed_s", round(time.time() - _T0, 1))
    line = json.dumps(rec, sort_keys=True)
    print(line, flush=True)
    if _OUT[0]:
        with open(_OUT[0], "a") as f:
            f.write(line + "\n")


def lognormal_cu(T: int, rng: random.Random, median: int = 720, sigma: float = 1.25) -> list:
    cu = [0]
    while cu[-1] < T:
        cu.append(cu[-1] + max(1, min(T - cu[-1], int(rng.lognormvariate(math.log(median),
                                                                           sigma)))))
    return cu


def rank_program(q, k, v, do, decay, scale, lp, kern, seed: int):
    """``(fwd, fwd_bwd)`` closures of one rank's packed program with prepared scan states."""
    import torch

    from sp_attention.linear.packed import packed_grads, packed_output
    B, H, K, V = q.shape[0], q.shape[2], q.shape[3], v.shape[3]
    gen = torch.Generator(device=q.device).manual_seed(seed)
    dt = torch.float32 if kern is not None else torch.float64
    states = [torch.randn(B, H, K, V, device=q.device, generator=gen, dtype=torch.float32)
              .to(dt) * 0.01 for _ in lp.crossing]

    def scan(A, x, reverse, holders, like):
        return states[:len(x)]

    def fwd():
        return packed_output(q, k, v, decay, scale, lp, scan, kern)

    def fwd_bwd():
        o, S = fwd()
        return packed_grads(q, k, v, decay, scale, lp, S, do, scan, kern)
    return fwd, fwd_bwd


def fla_baseline(q, k, v, do, decay, scale, lp, S_in):
    """fla's varlen chunk_simple_gla on the same local sequences and incoming states."""
    import torch
    from fla.ops.simple_gla import chunk_simple_gla

    from sp_attention.linear.packed import _flat, _states, varlen_layout
    from sp_attention.linear.varlen import cu_seqlens_tensor
    B = q.shape[0]
    cu, _ = varlen_layout(lp, B)
    cu_t = cu_seqlens_tensor(cu, q.device).long()
    cu_cpu = torch.tensor(cu, dtype=torch.long)
    entering = {p.position: s for p, s in zip(lp.crossing, S_in) if not p.first}
    h0 = _states(entering, lp, B, len(cu) - 1, q.new_zeros(1, q.shape[2], q.shape[3],
                                                           v.shape[3]))
    qf, kf, vf, dof = _flat(q), _flat(k), _flat(v), _flat(do)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (qf, kf, vf))
    kw = dict(g=_flat(decay.g)) if decay.gated else dict(g_gamma=-decay.slopes)

    def fwd(a=qf, b=kf, c=vf):
        return chunk_simple_gla(a, b, c, scale=scale, initial_state=h0, cu_seqlens=cu_t,
                                cu_seqlens_cpu=cu_cpu, **kw)[0]

    def fwd_bwd():
        fwd(qg, kg, vg).backward(dof)
    return fwd, (None if decay.gated else fwd_bwd)


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300)) if bool(a.isfinite().all()) \
        else float("nan")


def check(a, device, kern, dtype) -> None:
    import torch

    from sp_attention.linear.decay import Decay
    from sp_attention.planning.linear_packed import linear_packing
    from sp_attention.planning.packing import plan_packing
    sys.path.insert(0, os.path.join(ROOT, "tests", "linear"))
    from packed_cases import per_document_reference
    rng = random.Random(5)
    P, B, H, K, V = 3, 2, 4, 32, 32
    T = 120 if a.dry_run else 600
    cu = lognormal_cu(P * T - 7, rng, median=40 if a.dry_run else 150)
    for gated in (False, True):
        gen = torch.Generator(device=device).manual_seed(1)
        q, k, v, do = (torch.randn(B, P * T - 7, H, d, device=device, generator=gen,
                                   dtype=torch.float64) for d in (K, K, V, V))
        slopes = torch.tensor([0.01, 0.3, 2.0, 60.0], device=device, dtype=torch.float64)
        g = (-torch.rand(B, P * T - 7, H, device=device, generator=gen, dtype=torch.float64)
             * torch.tensor([0.01, 0.3, 2.0, 60.0], device=device, dtype=torch.float64)) \
            if gated else -slopes.expand(B, P * T - 7, H)
        ref = per_document_reference(q, k, v, do, g, cu, K ** -0.5)
        for layout in ("contiguous", "zigzag"):
            plan = plan_packing(cu, P, layout=layout, row_len=P * T - 7)
            for r in range(P):
                lp = linear_packing(plan, r)

                def sh(t):
                    return plan.shard(t, r, 1)
                dec = Decay(g=sh(g).to(dtype)) if gated else Decay(slopes=slopes.to(dtype))
                from sp_attention.linear.packed import packed_grads, packed_output
                want = [sh(t) for t in ref]
                true_in, true_arr = _true_states(q, k, v, do, g, cu, K ** -0.5, plan, r, lp)

                def scan(A, x, reverse, holders, like):     # the true states, no exchange
                    return [t.to(like.dtype) for t in (true_arr if reverse else true_in)]
                xs = [sh(t).to(dtype) for t in (q, k, v, do)]
                o, S = packed_output(*xs[:3], dec, K ** -0.5, lp, scan, kern)
                grads = packed_grads(*xs[:3], dec, K ** -0.5, lp, S, xs[3], scan, kern)
                tol = 2e-3 if dtype == torch.float32 else 1.5e-2
                for name, x, y in zip(("o", "dq", "dk", "dv", "dg"), (o,) + tuple(grads),
                                      want):
                    if x is None:
                        continue
                    err = rel(x, y)
                    ok = bool(err <= tol)
                    if not ok:
                        _FAILED.append(f"{name} {layout} rank {r}")
                    emit(dict(bench="packed_linear", phase="check", dtype=str(dtype)[6:],
                              gated=gated, layout=layout, rank=r, what=name, err=err, tol=tol,
                              ok=ok))


def _true_states(q, k, v, do, g, cu, scale, plan, r, lp):
    """The true state entering / gradient arriving at each crossing segment of rank ``r``
    (fp64, from the per-document recurrence) in the scan's output form."""
    import torch

    from sp_attention.linear.gated_naive import recurrent_gated_attention
    S_in, G = [], []
    segs = {(s.local_start): s for s in plan.segments[r]}
    for p in lp.crossing:
        s = segs[p.local_start]
        a = cu[s.doc]
        _, st = recurrent_gated_attention(q[:, a:s.start], k[:, a:s.start], v[:, a:s.start],
                                          g[:, a:s.start], scale=scale,
                                          output_final_state=True)
        S_in.append(st)
        # gradient at the segment's end: autograd of the rest of the document w.r.t. its
        # incoming state
        b = cu[s.doc + 1]
        S0 = st.detach().clone() if s.start > a else torch.zeros_like(st)
        S_end = S0
        if s.stop < b:
            _, S_end = recurrent_gated_attention(q[:, s.start:s.stop], k[:, s.start:s.stop],
                                                 v[:, s.start:s.stop], g[:, s.start:s.stop],
                                                 scale=scale, initial_state=S0,
                                                 output_final_state=True)
            S_end = S_end.detach().requires_grad_(True)
            o, _ = recurrent_gated_attention(q[:, s.stop:b], k[:, s.stop:b], v[:, s.stop:b],
                                             g[:, s.stop:b], scale=scale, initial_state=S_end)
            (gr,) = torch.autograd.grad((o * do[:, s.stop:b]).sum(), S_end)
            G.append(gr)
        else:
            G.append(torch.zeros_like(st))
    return S_in, G


def perf(a, device, kern) -> None:
    import torch

    from benchmarks.common import time_ms
    from sp_attention.linear.decay import Decay
    from sp_attention.planning.linear_packed import linear_packing
    from sp_attention.planning.packing import plan_packing
    H, K = a.heads, a.head_dim
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    slopes = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)], device=device)
    for T in a.t_local:
        for P in a.worlds:
            rng = random.Random(11 + P + T)
            cu = lognormal_cu(P * T, rng)
            gen = torch.Generator(device=device).manual_seed(3)
            q, k, v, do = (torch.randn(1, P * T, H, K, device=device, generator=gen,
                                       dtype=dtype) * 0.1 for _ in range(4))
            g = torch.nn.functional.logsigmoid(torch.randn(1, P * T, H, device=device,
                                                           generator=gen)) / 16
            for layout in a.layouts:
                plan = plan_packing(cu, P, layout=layout)
                for gated in [d == "gated" for d in a.decays]:
                    for r in range(P):
                        lp = linear_packing(plan, r)
                        xs = [plan.shard(t, r, 1) for t in (q, k, v, do)]
                        dec = Decay(g=plan.shard(g, r, 1)) if gated else Decay(slopes=slopes)
                        fwd, fb = rank_program(*xs, dec, K ** -0.5, lp, kern, r)
                        tm = lambda fn: time_ms(fn, device, a.warmup, a.iters, a.repeats)  # noqa
                        row = dict(bench="packed_linear", phase="perf", T_local=T, world=P,
                                   layout=layout, rank=r, gated=gated, docs=len(cu) - 1,
                                   local_seqs=len(lp.pieces), crossing=len(lp.crossing),
                                   ms_fwd=tm(fwd), ms_fwd_bwd=tm(fb), timing="eager")
                        if kern is not None:
                            S = [torch.zeros(1, H, K, K, device=device) for _ in lp.crossing]
                            bf, bfb = fla_baseline(*xs, dec, K ** -0.5, lp, S)
                            row["fla_ms_fwd"] = tm(bf)
                            row["ratio_fwd"] = row["ms_fwd"] / row["fla_ms_fwd"]
                            if bfb is not None:
                                row["fla_ms_fwd_bwd"] = tm(bfb)
                                row["ratio"] = row["ms_fwd_bwd"] / row["fla_ms_fwd_bwd"]
                        emit(row)
                        label = f"T {T} P {P} {layout} rank {r} gated {gated}"
                        if a.profile and kern is not None:
                            from benchmarks.common import kernel_table
                            kernel_table(fb, "ours " + label)
                            if bfb is not None:
                                kernel_table(bfb, "fla varlen " + label)
                        if a.host_profile:
                            from benchmarks.common import host_profile
                            host_profile(fb, "ours " + label)
                            if kern is not None and bfb is not None:
                                host_profile(bfb, "fla varlen " + label)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phases", nargs="+", default=["check", "perf"], choices=["check", "perf"])
    p.add_argument("--dry-run", action="store_true", help="CPU, torch path, tiny shapes")
    p.add_argument("--out-dir", default=os.environ.get("OUT"))
    p.add_argument("--t-local", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--layouts", nargs="+", default=["contiguous", "zigzag"])
    p.add_argument("--decays", nargs="+", default=["fixed", "gated"], choices=["fixed", "gated"],
                   help="fixed slopes (the ≤ 1.05 × fla target) and/or per-token gates")
    p.add_argument("--host-profile", action="store_true",
                   help="print where the host's time goes (cProfile) in each rank's fwd+bwd")
    p.add_argument("--profile", action="store_true",
                   help="print the GPU kernels of each rank's fwd+bwd and of fla's beside it")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    import torch
    if a.dry_run:
        a.t_local, a.worlds, a.heads, a.head_dim = [96], [2], 2, 8
        a.warmup, a.iters, a.repeats = 0, 1, 1
    device = "cpu" if a.dry_run else "cuda"
    if a.out_dir:
        os.makedirs(a.out_dir, exist_ok=True)
        _OUT[0] = os.path.join(a.out_dir, "packed_linear.jsonl")
    kern = None
    if not a.dry_run:
        from sp_attention.linear.kernel_set import fla_kernels
        kern = fla_kernels()
    emit(dict(bench="packed_linear", phase="env", device=torch.cuda.get_device_name()
              if device == "cuda" else "cpu", torch=torch.__version__, dry_run=a.dry_run))
    if "check" in a.phases:
        for dtype in ((torch.float64,) if a.dry_run else (torch.float32, torch.bfloat16)):
            check(a, device, kern, dtype)
    if "perf" in a.phases:
        perf(a, device, kern)
    emit(dict(bench="packed_linear", phase="done", failed=_FAILED))
    return 1 if _FAILED else 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: context-parallel linear attention (lightning_attention) per scan, layout and decay.

    torchrun --standalone --nproc-per-node 4 benchmarks/linear_cp.py --out linear.jsonl \
        --t-local 8192 32768 --timing eager queued --cases fixed gated packed
    CUDA_VISIBLE_DEVICES=0,1 torchrun --standalone --nproc-per-node 2 benchmarks/linear_cp.py ...
    torchrun --standalone --nproc-per-node 3 benchmarks/linear_cp.py --device cpu   # gloo dry run

For each T_local, every rank first times the single-GPU kernel a user would otherwise call on
its own T_local tokens (fixed slopes: fla's `chunk_simple_gla`; per-token gates: our op at
P = 1, which is fla's forward and our backward, since fla 0.6 refuses its gated backward on
Hopper; packed documents: fla's varlen `chunk_simple_gla` on the rank's own documents), then
the CP op per layout and scan. ratio = (P·T_local / t_cp) ÷ (P · T_local / t_base) = t_base /
t_cp, with t_base the slowest rank's baseline (a CP step cannot beat its slowest rank's own
work; for unpacked rows all ranks do the same work). `timing`: `eager` (the host enqueues
while the GPU runs: a layer called as a model calls it), `queued` (every timed call enqueued
behind a GPU sleep: the GPU's own time, as in a deep model whose host runs ahead).
`ms_host_fwd_bwd`: the host's time to enqueue one fwd+bwd (GPU drained before), the
baseline's too; `host_vs_base`: a CP row's over its baseline's (the issue's ≤ 1.3 ×).
`--ab`: the same rows with a LinearTuning field flipped, or set to its other values (impl
suffix), side by side.
`--profile DIR`: one profiled fwd+bwd per layout and scan at the last T_local: a
`linear_phases` row (host time, each stream's kernel time, the NCCL kernels, the main
stream's idle time inside the step) and a text timeline on stderr.
"""
from __future__ import annotations

import contextlib
import os
import random
import sys
from dataclasses import replace

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.common import (COMM_VARIANTS, base_parser, cp_groups, device_name,  # noqa: E402
                               emit, host_ahead_lost, host_ms, init_dist, time_ms)
from benchmarks.packed_linear import lognormal_cu  # noqa: E402
from sp_attention import LinearTuning, SPContext, build_sp_context, plan_packing  # noqa: E402
from sp_attention.linear import lightning_attention  # noqa: E402
from sp_attention.linear.fla_ops import resolve_backend  # noqa: E402
from sp_attention.linear.leaves import backward_schedule, forward_schedule  # noqa: E402
from sp_attention.planning.schedules import LINEAR_SCANS  # noqa: E402
from sp_attention.triton_launch import plain_launches  # noqa: E402

# --ab NAME: (LinearTuning field, impl suffix when on, when off)
AB = {"early": ("early_end_states", "-early", "-late"),
      "fused": ("fused_scan", "-fused", "-unfused"),      # the allgather scan only
      "graphs": ("scan_graphs", "-graphs", "-eager"),
      "op_graphs": ("op_graphs", "-opgraphs", "-noopgraphs"),
      "serial": ("concurrent_recurrences", "-concurrent", "-serial"),
      "zero": ("static_zero_paths", "-zero", "-nozero")}
GATED_AB = ("serial", "op_graphs", "fused")     # the flags that also apply with per-token gates
# --ab launch: the default tuning with every Triton launch through Triton's own per-call path
# (sp_attention.triton_launch.plain_launches) instead of the remembered launches
PLAIN_LAUNCH = "-plainlaunch"
# --ab NAME for a field with several values: (LinearTuning field, ((value, impl suffix), ...))
AB_VALUES = {"backward": ("backward_schedule", (("recurrence_first", "-recfirst"),
                                                ("scan_first", "-scanfirst"))),
             "forward": ("forward_schedule", (("output_first", "-outfirst"),
                                              ("states_first", "-statesfirst"))),
             "row_splits": ("row_splits", ((1, "-rows1"), (2, "-rows2"), (4, "-rows4")))}
# what a field's default runs (its "auto" resolved), so the A/B skips the default's twin
RESOLVED = {"backward_schedule": backward_schedule, "forward_schedule": forward_schedule,
            "row_splits": lambda t: t.row_splits}


def _phases(events: list) -> dict:
    """Where one profiled step's time goes (µs, rank 0): the GPU span from the first to the last
    kernel, each stream's kernel time, the NCCL kernels, and the main stream's idle time inside
    the span (its waits: exposed scans, host gaps)."""
    kern = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
                   and "sleep" not in e["name"] and "spin_kernel" not in e["name"]),
                  key=lambda e: e["ts"])
    cpu = [e for e in events if e.get("cat") == "cpu_op"]
    if not kern:
        return {}
    t0, t1 = kern[0]["ts"], max(e["ts"] + e["dur"] for e in kern)
    streams: dict = {}
    for e in kern:
        streams.setdefault(str(e["args"].get("stream", "?")), []).append(e)
    main = max(streams, key=lambda s: sum(e["dur"] for e in streams[s]))
    busy = sum(e["dur"] for e in streams[main])
    out = {"gpu_span_us": t1 - t0, "main_stream_busy_us": busy,
           "main_stream_idle_us": (t1 - t0) - busy,
           "nccl_kernel_us": sum(e["dur"] for e in kern if "nccl" in e["name"].lower()),
           "host_us": (max(e["ts"] + e.get("dur", 0) for e in cpu) - min(e["ts"] for e in cpu))
           if cpu else None}
    for s, evs in streams.items():
        out[f"stream_{s}_us"] = sum(e["dur"] for e in evs)
    out["kernels"] = {}
    for e in kern:
        name = e["name"].split("(")[0][:48]
        out["kernels"][name] = out["kernels"].get(name, 0) + e["dur"]
    return out


def _profile(step, out_dir: str, tag: str, rank: int, base: dict, out) -> None:
    import json

    from torch.profiler import ProfilerActivity, profile
    os.makedirs(out_dir, exist_ok=True)
    step()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    path = os.path.join(out_dir, f"trace_{tag}_rank{rank}.json")
    prof.export_chrome_trace(path)
    if rank != 0:
        return
    events = json.load(open(path))["traceEvents"]
    emit(dict(base, bench="linear_phases", tag=tag, **_phases(events)), out, rank)
    kern = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                  key=lambda e: e["ts"])
    t0 = kern[0]["ts"] if kern else 0
    print(f"# timeline {tag} (rank 0; µs from the first kernel)", file=sys.stderr)
    for e in kern:
        print(f"  s{e['args'].get('stream', '?'):<4} {e['ts'] - t0:9.0f} {e['dur']:7.0f}  "
              f"{e['name'][:80]}", file=sys.stderr)


def _host_profile(step, n: int, tag: str, rank: int, base: dict, out) -> None:
    """Python's own time per call of ``step`` (cProfile over ``n`` calls after one, every rank
    running them; rank 0 reports): where the op's host time goes, function by function (the
    CUDA profiler's trace shows launches, not the Python between them)."""
    import cProfile
    import pstats
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    step()
    sync()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        step()
    pr.disable()
    sync()
    if rank != 0:
        return
    rows = []
    for (f, line, name), (_, nc, tt, ct, _) in pstats.Stats(pr).stats.items():
        where = f.split("site-packages/")[-1] if "site-packages/" in f else \
            os.path.relpath(f, ROOT) if f.startswith(ROOT) else f
        rows.append((ct / n * 1e3, tt / n * 1e3, nc / n, f"{where}:{line} {name}"))
    total = sum(r[1] for r in rows)
    top_self = sorted(rows, key=lambda r: -r[1])[:30]
    top_cum = sorted((r for r in rows if "sp_attention/" in r[3] or "fla/" in r[3]),
                     key=lambda r: -r[0])[:30]
    emit(dict(base, bench="linear_host_profile", tag=tag, calls=n, python_ms=total,
              top_self=[[round(a, 4), round(b, 4), c, d] for a, b, c, d in top_self],
              top_cumulative=[[round(a, 4), round(b, 4), c, d] for a, b, c, d in top_cum]),
         out, rank)
    print(f"# host profile {tag} (rank 0, per call: {total:.3f} ms of Python; cum ms, self ms, "
          "calls)", file=sys.stderr)
    for a_, b_, c_, d_ in top_cum:
        print(f"  {a_:8.3f} {b_:8.3f} {c_:6.1f}  {d_}", file=sys.stderr)


class _Rows:
    """The rows of one T_local and decay: baselines, then the CP op per layout × scan × variant."""

    def __init__(self, a, rank, world, dev, groups, backend, case, T, dtype, device):
        self.a, self.rank, self.world, self.dev, self.groups = a, rank, world, dev, groups
        self.backend, self.T, self.case = backend, T, case
        self.decay = "gated" if case == "gated" else "fixed"
        B, H, K = a.batch, a.heads, a.head_dim
        gen = torch.Generator(device=device).manual_seed(1234 + rank)
        q, k, v, self.do = (torch.randn(B, T, H, K, device=device, dtype=dtype,
                                        generator=gen) * 0.1 for _ in range(4))
        self.x = [t.requires_grad_(True) for t in (q, k, v)]
        self.slopes = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)], device=device)
        self.g = None
        if case == "gated":
            self.g = -torch.rand(B, T, H, device=device, generator=gen) * 0.05
        self.cu = None
        if case == "packed":    # one log-normal document mix of the global row, the same everywhere
            self.cu = torch.tensor(lognormal_cu(world * T, random.Random(7)), dtype=torch.long)

    def timer(self, mode):
        a, dev = self.a, self.dev
        return lambda fn: time_ms(fn, dev, a.warmup, a.iters, a.repeats, mode=mode)

    def step(self, ctx, impl, backward, tuning=None, plan=None):
        kw = dict(ctx=ctx, impl=impl, backend=self.backend, tuning=tuning, cu_seqlens=plan)
        if self.g is None:
            o = lightning_attention(*self.x, self.slopes, **kw)
        else:
            o = lightning_attention(*self.x, g=self.g, **kw)
        if backward:    # as in a model: q, k, v are activations, nothing accumulates
            torch.autograd.grad(o, self.x, self.do)

    def fla_step(self, backward, cu=None):
        from fla.ops.simple_gla import chunk_simple_gla
        o, _ = chunk_simple_gla(*self.x, g_gamma=-self.slopes, scale=1.0, cu_seqlens=cu)
        if backward:
            torch.autograd.grad(o, self.x, self.do)

    def baseline(self, timer, plan) -> tuple:
        """(name, fwd ms, fwd+bwd ms, host ms per fwd+bwd or None) of the single-GPU baseline,
        the slowest rank's."""
        if self.cu is not None and self.backend == "fla" and self.g is None:
            cu = torch.tensor(plan.local_cu_seqlens(self.rank), device=self.x[0].device)
            name = "fla_varlen"
            fwd, fwd_bwd = (lambda: self.fla_step(False, cu)), (lambda: self.fla_step(True, cu))
        elif self.cu is None and self.backend == "fla" and self.g is None:
            name = "fla_chunk_simple_gla"
            fwd, fwd_bwd = (lambda: self.fla_step(False)), (lambda: self.fla_step(True))
        else:       # gates (fla's gated backward is refused on Hopper) or the torch backend
            single = SPContext(None, 0, 1, (0,), "contiguous")
            local = None if plan is None else torch.tensor(plan.local_cu_seqlens(self.rank))
            name = "local_op"
            fwd = lambda: self.step(single, "ring", False, plan=local)      # noqa: E731
            fwd_bwd = lambda: self.step(single, "ring", True, plan=local)   # noqa: E731
        host = host_ms(fwd_bwd) if self.dev == "cuda" else 0.0
        t = torch.tensor([timer(fwd), timer(fwd_bwd), host], dtype=torch.float64,
                         device=self.x[0].device if self.dev == "cuda" else "cpu")
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return name, float(t[0]), float(t[1]), float(t[2]) if self.dev == "cuda" else None

    def run(self, base: dict, mode: str, profile: bool) -> None:
        a = self.a
        default = LinearTuning()
        variants = [(default, "")]
        for name in (a.ab if self.case in ("fixed", "gated") else ()):
            if name == "launch":
                variants.append((default, PLAIN_LAUNCH))
                continue
            if name in AB_VALUES:       # every value but the one the default runs
                field, values = AB_VALUES[name]
                runs = RESOLVED[field](default)
                variants += [(replace(default, **{field: value}), sfx) for value, sfx in values
                             if value != runs]
                continue
            if self.case != "fixed" and name not in GATED_AB:
                continue
            field, on, off = AB[name]
            flipped = replace(default, **{field: not getattr(default, field)})
            variants.append((flipped, on if getattr(flipped, field) else off))
        refs = {}
        # the default rows first, every variant after them (a variant that fails or hangs
        # costs only its own rows); --variants-first: the other way round, to tell a row's
        # place in the run from the flag's effect
        if a.variants_first:
            variants = variants[1:] + variants[:1]
        for tuning, suffix in variants:
            plain = plain_launches() if suffix == PLAIN_LAUNCH else contextlib.nullcontext()
            with plain:
                self.variant_rows(base, mode, profile, tuning, suffix, refs)

    def variant_rows(self, base, mode, profile, tuning, suffix, refs) -> None:
        """One variant's CP rows: every communication setting, layout and scan."""
        a = self.a
        for comm in a.comm_variants:
            for layout in a.layouts:
                ctx = build_sp_context(self.groups[comm], layout=layout)
                plan = None if self.cu is None else plan_packing(self.cu, ctx)
                if (comm, layout) not in refs:
                    refs[comm, layout] = ref = self.baseline(self.timer(mode), plan)
                    emit(dict(base, impl=ref[0], layout=layout, world=1, ms_fwd=ref[1],
                              ms_fwd_bwd=ref[2], ms_host_fwd_bwd=ref[3], ratio=1.0), a.out,
                         self.rank)
                for impl in a.impls:
                    t = replace(tuning, side_stream_priority=0) if comm == "side0" \
                        else tuning
                    self.cp_row(base, mode, ctx, plan, impl, t,
                                suffix + ("" if comm == "default" else f"+{comm}"),
                                refs[comm, layout],
                                profile and not suffix and comm == "default")

    def cp_row(self, base, mode, ctx, plan, impl, tuning, suffix, ref, profile) -> None:
        a, T, world = self.a, self.T, self.world
        timer = self.timer(mode)
        tf = timer(lambda: self.step(ctx, impl, False, tuning, plan))
        tfb = timer(lambda: self.step(ctx, impl, True, tuning, plan))
        host = host_ms(lambda: self.step(ctx, impl, True, tuning, plan)) \
            if self.dev == "cuda" else None
        rec = dict(base, impl=impl + suffix, layout=ctx.layout, ms_fwd=tf, ms_fwd_bwd=tfb,
                   ms_host_fwd_bwd=host, mtok_s=world * T / tfb / 1e3,
                   baseline=f"{world} x {ref[0]}", ms_base_fwd_bwd=ref[2], ratio=ref[2] / tfb,
                   ratio_fwd=ref[1] / tf,
                   host_vs_base=host / ref[3] if host is not None and ref[3] else None)
        if mode == "queued":
            rec["host_ahead_lost"] = host_ahead_lost()
        emit(rec, a.out, self.rank)
        tag = f"{ctx.layout}-{impl}-{self.decay}{'-packed' if plan else ''}-{T}"
        if profile and self.dev == "cuda" and mode == a.timing[0] and a.profile:
            _profile(lambda: self.step(ctx, impl, True, tuning, plan), a.profile, tag,
                     self.rank, dict(base, impl=impl, layout=ctx.layout), a.out)
        if profile and mode == a.timing[0] and a.host_profile:
            _host_profile(lambda: self.step(ctx, impl, True, tuning, plan), a.host_profile,
                          tag, self.rank, dict(base, impl=impl, layout=ctx.layout), a.out)
            if self.cu is None and self.g is None and self.backend == "fla":
                _host_profile(lambda: self.fla_step(True), a.host_profile, f"fla-{T}",
                              self.rank, dict(base, impl="fla_chunk_simple_gla", world=1), a.out)


def main() -> None:
    p = base_parser(__doc__.splitlines()[1])
    p.add_argument("--impls", nargs="+", default=list(LINEAR_SCANS), choices=LINEAR_SCANS)
    p.add_argument("--layouts", nargs="+", default=["contiguous", "zigzag"])
    p.add_argument("--cases", nargs="+", default=["fixed"], choices=["fixed", "gated", "packed"],
                   help="fixed per-head slopes; per-token gates g; packed documents (fixed "
                        "slopes, one log-normal document mix of the global row, median 720 "
                        "tokens; baseline: fla's varlen kernel on each rank's own documents)")
    p.add_argument("--t-local-other", type=int, nargs="+", default=None,
                   help="T_local of the gated and packed cases (default: --t-local's)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--ab", nargs="*", default=[],
                   choices=sorted(AB) + sorted(AB_VALUES) + ["launch"],
                   help="also run every CP row of the fixed case with this LinearTuning field "
                        "flipped: "
                        + ", ".join(f"{k} ({v[0]})" for k, v in AB.items())
                        + "; or (fixed and gated cases) with its other values: "
                        + ", ".join(f"{k} ({v[0]})" for k, v in AB_VALUES.items())
                        + "; launch: every Triton launch through Triton's own path (impl "
                        f"suffix {PLAIN_LAUNCH}) beside the remembered launches")
    p.add_argument("--variants-first", action="store_true",
                   help="run the --ab variants' rows before the default rows")
    p.add_argument("--comm-variants", nargs="+", default=["default"], choices=COMM_VARIANTS,
                   help="CP rows per communication setting: 'default' (a plain dist.new_group), "
                        "'nccl-hp' (the group's NCCL kernels on a high-priority stream), "
                        "'side0' (the scan's side stream at normal priority); suffix '+VARIANT'")
    p.add_argument("--profile", metavar="DIR",
                   help="also profile one fwd+bwd step per layout and scan at the last T_local")
    p.add_argument("--host-profile", type=int, default=0, metavar="N",
                   help="also cProfile N eager fwd+bwd calls per layout and scan at the last "
                        "T_local (and fla's own call): Python's time per call, function by "
                        "function (rows bench='linear_host_profile')")
    p.add_argument("--backend", choices=["fla", "torch"], default=None,
                   help="local kernel (default: fla when it can run)")
    a = p.parse_args()
    dev = a.device
    rank, world = init_dist(dev)
    device = torch.device("cuda", torch.cuda.current_device()) if dev == "cuda" \
        else torch.device("cpu")
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if dev == "cuda"
                                                     else torch.float32)
    t_locals = a.t_local or ([8192, 32768] if dev == "cuda" else [256])
    groups = cp_groups(a.comm_variants, world)
    backend = resolve_backend(a.backend, torch.empty(1, 1, a.heads, a.head_dim, device=device,
                                                     dtype=dtype))
    modes = a.timing if dev == "cuda" else ["eager"]
    for case in a.cases:
        for T in (t_locals if case == "fixed" else a.t_local_other or t_locals):
            rows = _Rows(a, rank, world, dev, groups, backend, case, T, dtype, device)
            for mode in modes:
                base = {"bench": "linear_cp", "world": world, "B": a.batch, "T_local": T,
                        "H": a.heads, "K": a.head_dim, "V": a.head_dim, "decay": rows.decay,
                        "packed": case == "packed", "dtype": str(dtype).replace("torch.", ""),
                        "device": device_name(dev), "backend": backend, "timing": mode,
                        "grads": "autograd.grad"}
                rows.run(base, mode, profile=T == t_locals[-1] and case == "fixed")
            del rows
    if dist.is_initialized():
        dist.barrier()
    os._exit(0)         # no process-group teardown: NCCL's can hang after graph captures


if __name__ == "__main__":
    main()

"""Benchmark: context-parallel linear attention with decay (lightning_attention) per scan schedule.

    torchrun --standalone --nproc-per-node 2 benchmarks/linear_cp.py --out linear.jsonl
    python benchmarks/linear_cp.py                      # P = 1
    torchrun --standalone --nproc-per-node 8 benchmarks/linear_cp.py --device cpu   # gloo dry run

For each T_local, every rank first runs the single-GPU kernel on its own T_local tokens (the
baseline: P GPUs each doing the same per-GPU work alone), then the CP op per schedule and
layout. ratio = (P·T_local / t_cp) ÷ (P · T_local / t_base) = t_base / t_cp, where the base is
the library kernel a user would otherwise call, fla's public `chunk_simple_gla` (our own op at
P = 1, `local_kernel`, on other backends; `ratio_vs_local_op` gives that reading too).
Per-phase times (leaf state GEMM, scan, local kernels from S_in; backward: state-grad GEMM,
reverse scan, local backward) time each piece alone; on GPU the GEMM + scan run on a side
stream under the chunk recurrence, so `scan_share` (standalone scan times ÷ step) is an upper
bound and `overhead_share` (1 − ratio) is what CP costs in all.
"""
from __future__ import annotations

import os
import sys
from dataclasses import replace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import (COMM_VARIANTS, base_parser, cp_groups, device_name,  # noqa: E402
                               emit, host_ahead_lost, host_ms, init_dist, time_ms)
from sp_attention import LinearTuning, SPContext, build_sp_context  # noqa: E402
from sp_attention.linear import lightning_attention  # noqa: E402
from sp_attention.linear.attention import leaf_rows, scan_rows  # noqa: E402
from sp_attention.linear.fla_ops import resolve_backend  # noqa: E402
from sp_attention.linear.leaf import leaf_state, state_grad_local  # noqa: E402
from sp_attention.linear.leaves import leaves_backward, leaves_output  # noqa: E402
from sp_attention.linear.slope_constants import leaf_transition  # noqa: E402
from sp_attention.planning.schedules import LINEAR_SCANS  # noqa: E402


def _phases(q, k, v, slopes, do, ctx, impl, backend, timer, tuning) -> dict:
    """Time the pieces of one CP step alone (ms), in the order the autograd Function runs them
    (on GPU the forward takes the end states from the chunk recurrence, not ``leaf_state``, and
    the backward's scan runs on a side stream under the recomputed recurrence, so the step
    costs less than the sum; ``ms_local_bwd`` includes the state-gradient pass)."""
    n = len(ctx.leaves)
    qb, kb, vb, dob = (leaf_rows(t, n) for t in (q, k, v, do))
    b = leaf_state(kb, vb, slopes)
    A = leaf_transition(slopes, qb.shape[1], qb.shape[0], b.dtype, q.device)
    S = scan_rows(b, A, ctx, impl, False)
    d = state_grad_local(qb, dob, slopes, 1.0)
    G = scan_rows(d, A, ctx, impl, True)
    return {
        "ms_state_fwd": timer(lambda: leaf_state(kb, vb, slopes)),
        "ms_scan_fwd": timer(lambda: scan_rows(b, A, ctx, impl, False)),
        "ms_local_fwd": timer(lambda: leaves_output(qb, kb, vb, slopes, 1.0, lambda *_: S, backend,
                                                    tuning=tuning)),
        "ms_state_grad_bwd": timer(lambda: state_grad_local(qb, dob, slopes, 1.0)),
        "ms_scan_bwd": timer(lambda: scan_rows(d, A, ctx, impl, True)),
        "ms_local_bwd": timer(lambda: leaves_backward(qb, kb, vb, slopes, 1.0, S, dob,
                                                      lambda *_: G, backend, tuning=tuning)),
    }


def _profile(step, out_dir: str, tag: str, rank: int) -> None:
    """One profiled fwd+bwd step: Chrome trace per rank, and from rank 0 a text timeline of
    the GPU kernels per stream (start and length in µs from the first one) and the top ops."""
    import json

    from torch.profiler import ProfilerActivity, profile
    os.makedirs(out_dir, exist_ok=True)
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    path = os.path.join(out_dir, f"trace_{tag}_rank{rank}.json")
    prof.export_chrome_trace(path)
    if rank != 0:
        return
    ev = json.load(open(path))["traceEvents"]
    kern = sorted((e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                  key=lambda e: e["ts"])
    cpu = [e for e in ev if e.get("cat") == "cpu_op"]
    t0 = min(e["ts"] for e in kern + cpu)
    lines = [f"# timeline {tag} (rank 0; µs from the first event)"]
    cpu_end = max(e["ts"] + e.get("dur", 0) for e in cpu) - t0
    lines.append(f"host: last op ends at {cpu_end:.0f}; GPU: first kernel {kern[0]['ts'] - t0:.0f}, "
                 f"last ends {max(e['ts'] + e['dur'] for e in kern) - t0:.0f}")
    for e in kern:
        lines.append(f"  s{e['args'].get('stream', '?'):<4} {e['ts'] - t0:9.0f} {e['dur']:7.0f}  "
                     f"{e['name'][:90]}")
    print("\n".join(lines), file=sys.stderr, flush=True)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25), file=sys.stderr,
          flush=True)


def _graph_rows(a, base, qg, kg, vg, do, slopes, group, backend, timer, rank, world) -> None:
    """fwd+bwd replayed from CUDA graphs (no host work per kernel): ours per layout and scan,
    and fla's public call as the baseline. A capture that fails is recorded, not fatal."""
    def graphed_ms(fn):
        try:
            g = torch.cuda.make_graphed_callables(
                fn, tuple(t.detach().clone().requires_grad_(True) for t in (qg, kg, vg)))

            def step():
                g(qg, kg, vg).backward(do)
            return timer(step), None
        except Exception as e:  # noqa: BLE001 - recorded in the results
            return None, f"{type(e).__name__}: {e}"[:300]
    base_ms, err = None, None
    if backend == "fla":
        from fla.ops.simple_gla import chunk_simple_gla
        base_ms, err = graphed_ms(lambda q, k, v: chunk_simple_gla(q, k, v, g_gamma=-slopes,
                                                                    scale=1.0)[0])
        emit(dict(base, impl="fla_chunk_simple_gla", world=1, cuda_graph=True,
                  ms_fwd_bwd=base_ms, graph_error=err), a.out, rank)
    for layout in a.layouts:
        ctx = build_sp_context(group, layout=layout)
        for impl in a.impls:
            ms, err = graphed_ms(lambda q, k, v: lightning_attention(
                q, k, v, slopes, ctx=ctx, impl=impl, backend=backend))
            emit(dict(base, impl=impl, layout=layout, cuda_graph=True, ms_fwd_bwd=ms,
                      ratio=(base_ms / ms) if (ms and base_ms) else None,
                      baseline=f"{world} x graphed fla", graph_error=err), a.out, rank)


def _suffix(tuning: LinearTuning, default: LinearTuning, variant: str) -> str:
    """impl suffix naming what differs from the default tuning (the A/B rows)."""
    suffix = ""
    if tuning.static_zero_paths != default.static_zero_paths:
        suffix += "-zero" if tuning.static_zero_paths else "-nozero"
    if tuning.concurrent_recurrences != default.concurrent_recurrences:
        suffix += "-concurrent" if tuning.concurrent_recurrences else "-serial"
    return suffix + ("" if variant == "default" else f"+{variant}")


class _Run:
    """Rows of one T_local: the 1-GPU baselines, then every layout x schedule, in one mode."""

    def __init__(self, a, rank, world, dev, groups, backend, slopes, qg, kg, vg, do):
        self.a, self.rank, self.world, self.dev, self.groups = a, rank, world, dev, groups
        self.backend, self.slopes, self.qg, self.kg, self.vg, self.do = (
            backend, slopes, qg, kg, vg, do)

    def timer(self, mode):
        a, dev = self.a, self.dev
        return lambda fn: time_ms(fn, dev, a.warmup, a.iters, a.repeats, mode=mode)

    def step(self, ctx, impl, backward, tuning=None):
        o = lightning_attention(self.qg, self.kg, self.vg, self.slopes, ctx=ctx, impl=impl,
                                backend=self.backend, tuning=tuning)
        if backward:
            o.backward(self.do)

    def fla_step(self, backward):
        from fla.ops.simple_gla import chunk_simple_gla
        o, _ = chunk_simple_gla(self.qg, self.kg, self.vg, g_gamma=-self.slopes, scale=1.0)
        if backward:
            o.backward(self.do)

    def rows(self, base: dict, mode: str, qkv, profile: bool) -> None:
        a, rank, world, dev, step = self.a, self.rank, self.world, self.dev, self.step
        timer, T = self.timer(mode), base["T_local"]
        # Baseline: the single-GPU local op on this rank's T_local tokens, no communication.
        single = SPContext(None, 0, 1, (0,), "contiguous")
        t1_f = timer(lambda: step(single, "allgather", False))
        t1_fb = timer(lambda: step(single, "allgather", True))
        emit(dict(base, impl="local_kernel", world=1, ms_fwd=t1_f, ms_fwd_bwd=t1_fb,
                  mtok_s=T / t1_fb / 1e3, baseline="self", ratio=1.0), a.out, rank)
        base_name, tb_f, tb_fb = "local_kernel", t1_f, t1_fb
        if self.backend == "fla":  # the library kernel itself: the baseline users would pick
            f_f = timer(lambda: self.fla_step(False))
            f_fb = timer(lambda: self.fla_step(True))
            emit(dict(base, impl="fla_chunk_simple_gla", world=1, ms_fwd=f_f, ms_fwd_bwd=f_fb,
                      ms_host_fwd_bwd=host_ms(lambda: self.fla_step(True)),
                      mtok_s=T / f_fb / 1e3, baseline="local_kernel", ratio=t1_fb / f_fb),
                 a.out, rank)
            base_name, tb_f, tb_fb = "fla_chunk_simple_gla", f_f, f_fb
        default = LinearTuning()
        runs = [(layout, impl, default, variant) for variant in a.comm_variants
                for layout in a.layouts for impl in a.impls]
        if a.ab_static_zero:
            flip = replace(default, static_zero_paths=not default.static_zero_paths)
            runs += [("contiguous", impl, flip, "default") for impl in a.impls]
        if a.ab_concurrent:
            flip = replace(default, concurrent_recurrences=not default.concurrent_recurrences)
            runs += [(layout, impl, flip, "default") for layout in a.layouts for impl in a.impls]
        for layout, impl, tuning, variant in runs:
            if variant == "side0":      # the scan's side stream at normal priority
                tuning = replace(tuning, side_stream_priority=0)
            self.cp_row(base, mode, qkv, profile and variant == "default", layout, impl,
                        _suffix(tuning, default, variant), (base_name, tb_f, tb_fb, t1_fb),
                        variant, tuning)

    def cp_row(self, base, mode, qkv, profile, layout, impl, suffix, ref, variant,
               tuning) -> None:
        a, rank, world, dev, step = self.a, self.rank, self.world, self.dev, self.step
        timer, T = self.timer(mode), base["T_local"]
        base_name, tb_f, tb_fb, t1_fb = ref
        ctx = build_sp_context(self.groups[variant], layout=layout)
        tf = timer(lambda: step(ctx, impl, False, tuning))
        tfb = timer(lambda: step(ctx, impl, True, tuning))
        host = host_ms(lambda: step(ctx, impl, True, tuning)) if dev == "cuda" else None
        rec = dict(base, impl=impl + suffix, layout=layout, comm=variant,
                   ms_fwd=tf, ms_fwd_bwd=tfb, ms_host_fwd_bwd=host,
                   mtok_s=world * T / tfb / 1e3, mtok_s_fwd=world * T / tf / 1e3,
                   baseline=f"{world} x {base_name}", ratio=tb_fb / tfb,
                   ratio_fwd=tb_f / tf, ratio_vs_local_op=t1_fb / tfb)
        if not a.no_phases:
            q, k, v = qkv
            ph = _phases(q, k, v, self.slopes, self.do, ctx, impl, self.backend, timer, tuning)
            rec.update(ph)
            # upper bound: the scans' standalone times, as if nothing hid them
            rec["scan_share"] = (ph["ms_scan_fwd"] + ph["ms_scan_bwd"]) / tfb
        # everything CP adds over the 1-GPU kernel on the same per-GPU tokens (state passes,
        # scans, exposed communication, host work in eager mode): 1 - ratio
        rec["overhead_share"] = max(0.0, (tfb - tb_fb) / tfb)
        if mode == "queued":
            rec["host_ahead_lost"] = host_ahead_lost()
        emit(rec, a.out, rank)
        if profile and dev == "cuda" and mode == a.timing[0]:
            _profile(lambda: step(ctx, impl, True, tuning), a.profile, f"{layout}-{impl}-{T}",
                     rank)


def main() -> None:
    p = base_parser(__doc__.splitlines()[1])
    p.add_argument("--impls", nargs="+", default=list(LINEAR_SCANS))
    p.add_argument("--layouts", nargs="+", default=["contiguous", "zigzag"])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--no-phases", action="store_true")
    p.add_argument("--ab-static-zero", action="store_true",
                   help="contiguous rows also with the first/last-leaf shortcuts "
                        "(LinearTuning.static_zero_paths) flipped (impl suffix "
                        "'-zero' when on, '-nozero' when off): an A/B in the same run")
    p.add_argument("--comm-variants", nargs="+", default=["default"], choices=COMM_VARIANTS,
                   help="CP rows per communication setting, side by side: 'default' (a plain "
                        "dist.new_group, the library's high-priority scan stream), 'nccl-hp' "
                        "(the group's NCCL kernels on a high-priority stream: new_cp_group with "
                        "CPGroupOptions(high_priority_stream=True)), 'side0' (default group, "
                        "scan side stream at normal priority); impl suffix '+VARIANT'")
    p.add_argument("--ab-concurrent", action="store_true",
                   help="also run the CP rows with LinearTuning.concurrent_recurrences "
                        "flipped (the backward's two chunk recurrences "
                        "on two streams, or one after the other; impl suffix '-serial' / "
                        "'-concurrent')")
    p.add_argument("--cuda-graph", action="store_true",
                   help="also time the fwd+bwd step captured as CUDA graphs "
                        "(torch.cuda.make_graphed_callables), ours and fla's, to show how much "
                        "of the step is host time; runs after the eager rows of each T_local")
    p.add_argument("--profile", metavar="DIR",
                   help="also profile one fwd+bwd step per layout and schedule at the first "
                        "T_local (Chrome traces per rank, text timeline on stderr)")
    p.add_argument("--backend", choices=["fla", "torch"], default=None,
                   help="local kernel (default: fla when it can run)")
    a = p.parse_args()
    dev = a.device
    rank, world = init_dist(dev)
    device = torch.device("cuda", torch.cuda.current_device()) if dev == "cuda" else torch.device("cpu")
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if dev == "cuda" else torch.float32)
    t_locals = a.t_local or ([8192, 16384, 32768] if dev == "cuda" else [256])
    groups = cp_groups(a.comm_variants, world)
    group = groups["default"]
    B, H, K = a.batch, a.heads, a.head_dim
    backend = resolve_backend(a.backend, torch.empty(1, 1, H, K, device=device, dtype=dtype))

    slopes = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)], device=device)
    modes = a.timing if dev == "cuda" else ["eager"]
    for T in t_locals:
        g = torch.Generator(device=device).manual_seed(1234 + rank)
        q, k, v, do = (torch.randn(B, T, H, K, device=device, dtype=dtype, generator=g) * 0.1
                       for _ in range(4))
        qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
        run = _Run(a, rank, world, dev, groups, backend, slopes, qg, kg, vg, do)
        for mode in modes:
            base = {"bench": "linear_cp", "world": world, "B": B, "T_local": T, "H": H, "K": K,
                    "V": K, "dtype": str(dtype).replace("torch.", ""),
                    "device": device_name(dev), "backend": backend, "timing": mode}
            run.rows(base, mode, (q, k, v), profile=bool(a.profile) and T == t_locals[0])
        if a.cuda_graph and dev == "cuda":
            base = dict(base, timing="cuda_graph")
            _graph_rows(a, base, qg, kg, vg, do, slopes, group, backend, run.timer("eager"),
                        rank, world)
        del q, k, v, do, qg, kg, vg, run
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

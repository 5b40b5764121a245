"""Validate the cost model on CPU/gloo: calibrate, then time every schedule at P = 2…8 and
write measured beside predicted step times as JSON lines.

    python benchmarks/cost_cpu.py --out benchmarks/results/DATE_cpu_gloo_cost.jsonl [--runs 3]

One spawn of ``--max-world`` gloo processes (one thread each). Inside it: the calibration probe
(:mod:`sp_attention.calibrate`) measures the local kernels on rank 0 alone (attention calls
causal and not, at the sizes of the steps' calls; again before each P, the fit taking the median
of each shape, since one burst of calls can fall on a slow spell of a shared host's core), and
this script
each CP rank's own CPU work ÷ the plain kernel (the rank factors); then for each P the ranks
``0 … P−1`` form a group, probe their links (ring hops and all-gathers among the P
processes, and the host terms: messages, the library's scans, the kernel on all ranks at once)
and time :func:`~sp_attention.lightning_attention` (every scan × layout) and
:func:`~sp_attention.context_parallel_attention` (every preset, zigzag), fwd and fwd + bwd
(the other ranks wait in a barrier, which sleeps). Two predictions per row: from the links
between two processes, extrapolated by the model to P (``pred_*``), and from the links probed
among the P processes themselves (``pred_*_links_at_p``: the probe run on the CP group at
hand, which also catches how busy the machine is at that moment). Every CPU timing is the
fastest of ``--repeats × --iters`` calls, each timed alone after a barrier, the schedules
interleaved round by round (other processes on the shared machine only ever add time, and a
burst of their load then falls on every schedule alike). P processes share
the machine's cores: the model gives each ``min(1, cores / P)`` of a core's rate. Other work
on the machine lowers that share; timing the fastest single call filters most of it, each row
records the load average (and the machine row the cores the job saw: the plain kernel on all
ranks at once vs alone), and ``--runs`` repeats the whole sweep (report.py takes the median
over runs).

Rows: ``bench="cost_cpu"``, ``kind`` (linear / softmax), ``schedule``, ``layout``, ``world``,
shape fields, ``ms_fwd``, ``ms_fwd_bwd`` (measured), ``pred_fwd``, ``pred_fwd_bwd`` (the model
with this run's calibration), ``local_ms`` (linear: the plain kernel on T_local timed by all P
ranks at once), ``loadavg``, ``run``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sp_attention import build_sp_context  # noqa: E402
from sp_attention.calibrate import (calibrate, fit_link, fit_scan_host,  # noqa: E402
                                    pair_host_rows, probe_kernels, probe_links, time_ms,
                                    typical_probe_rows)
from sp_attention.cost import (LINEAR_SCANS, SOFTMAX_PRESETS, LinearShape,  # noqa: E402
                               SoftmaxShape, linear_step, softmax_step)
from sp_attention.linear import lightning_attention  # noqa: E402
from sp_attention.softmax import context_parallel_attention  # noqa: E402

LIN = dict(B=1, T_local=128, H=4, K=32)
SOFT = dict(B=1, T_local=128, H=8, Hkv=4, D=32)
LINK_SIZES = [2 ** 14, 2 ** 16, 2 ** 18, 2 ** 20]
KERNEL_SHAPES = {"linear": dict(B=1, H=4, K=32, T=(128, 512)),
                 "softmax": dict(B=1, H=8, Hkv=4, D=32, T=(32, 64, 128, 256),
                                 causal=(True, False))}


def _barrier(group):
    return lambda: dist.barrier(group=group) if group is not None else dist.barrier()


def _interleaved(fns: dict, group, a) -> dict:
    """``{name: fastest single call, ms}`` with the calls interleaved: each of ``a.repeats``
    rounds times every function ``a.iters`` times (each call after a barrier), so a burst of
    load on the shared machine falls on all schedules alike instead of on one."""
    for fn in fns.values():
        fn()
        fn()                       # warm-up (the first call per signature checks across ranks)
    best = {n: float("inf") for n in fns}
    for _ in range(a.repeats):
        for name, fn in fns.items():
            best[name] = min(best[name], time_ms(fn, "cpu", iters=a.iters, repeats=1, warmup=0,
                                                 barrier=_barrier(group)))
    return best


def _linear_rows(rank, P, group, a) -> list[dict]:
    B, T, H, K = LIN["B"], LIN["T_local"], LIN["H"], LIN["K"]
    g = torch.Generator().manual_seed(rank)
    q, k, v, do = (torch.randn(B, T, H, K, generator=g) * 0.1 for _ in range(4))
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    slopes = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)])
    fns = {("local", "-", "fwd_bwd"): lambda: torch.autograd.grad(
        lightning_attention(q, k, v, slopes), (q, k, v), do)}
    for layout in ("contiguous", "zigzag"):
        ctx = build_sp_context(group, layout=layout)
        for impl in LINEAR_SCANS:
            def fwd(ctx=ctx, impl=impl):
                with torch.no_grad():
                    lightning_attention(q, k, v, slopes, ctx=ctx, impl=impl)

            def fwd_bwd(ctx=ctx, impl=impl):
                torch.autograd.grad(lightning_attention(q, k, v, slopes, ctx=ctx, impl=impl),
                                    (q, k, v), do)
            fns[(impl, layout, "fwd")], fns[(impl, layout, "fwd_bwd")] = fwd, fwd_bwd
    ms = _interleaved(fns, group, a)
    return [dict(kind="linear", schedule=n, layout=lay, ms_fwd=ms.get((n, lay, "fwd")),
                 ms_fwd_bwd=ms[(n, lay, "fwd_bwd")]) for (n, lay, m) in fns if m == "fwd_bwd"]


def _softmax_rows(rank, P, group, a) -> list[dict]:
    B, T, H, Hkv, D = (SOFT[n] for n in ("B", "T_local", "H", "Hkv", "D"))
    g = torch.Generator().manual_seed(rank)
    q, do = (torch.randn(B, T, H, D, generator=g) for _ in range(2))
    k, v = (torch.randn(B, T, Hkv, D, generator=g) for _ in range(2))
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    ctx = build_sp_context(group, layout="zigzag")
    fns = {}
    for preset in SOFTMAX_PRESETS:
        def fwd(preset=preset):
            with torch.no_grad():
                context_parallel_attention(q, k, v, ctx=ctx, preset=preset)

        def fwd_bwd(preset=preset):
            torch.autograd.grad(context_parallel_attention(q, k, v, ctx=ctx, preset=preset),
                                (q, k, v), do)
        fns[(preset, "fwd")], fns[(preset, "fwd_bwd")] = fwd, fwd_bwd
    ms = _interleaved(fns, group, a)
    return [dict(kind="softmax", schedule=p, layout="zigzag", ms_fwd=ms[(p, "fwd")],
                 ms_fwd_bwd=ms[(p, "fwd_bwd")]) for p in SOFTMAX_PRESETS]


def _predict(row: dict, P: int, machine) -> dict:
    if row["kind"] == "linear":
        if row["schedule"] == "local":
            return {}
        shape = LinearShape(LIN["B"], LIN["T_local"], LIN["H"], LIN["K"], LIN["K"], 4)
        t = linear_step(shape, P, row["layout"], row["schedule"], machine)
    else:
        shape = SoftmaxShape(SOFT["B"], SOFT["T_local"], SOFT["H"], SOFT["Hkv"], SOFT["D"], 4)
        t = softmax_step(shape, P, "zigzag", *SOFTMAX_PRESETS[row["schedule"]], machine)
    return dict(pred_fwd=t.fwd_ms, pred_fwd_bwd=t.total_ms, pred_compute=t.compute_ms)


def _local_ms(a, barrier=None) -> float:
    """The plain linear kernel's fwd + bwd on this rank's T_local tokens (ms)."""
    B, T, H, K = LIN["B"], LIN["T_local"], LIN["H"], LIN["K"]
    g = torch.Generator().manual_seed(5)
    q, k, v, do = (torch.randn(B, T, H, K, generator=g) * 0.1 for _ in range(4))
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    slopes = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)])
    return time_ms(lambda: torch.autograd.grad(lightning_attention(q, k, v, slopes), (q, k, v),
                                               do), "cpu", iters=5, repeats=7, barrier=barrier)


def rank_factors() -> dict:
    """The CP rank's own CPU work ÷ the plain kernel on the same tokens, per layout: the
    slowest rank of P = 2 from ``linear_rank_programs.rank_program`` (the CPU twin of the
    one-GPU rank programs that set the H200 factors), times what the public op adds on the
    host around a rank's program (checks, the autograd Function: the op at P = 1 zigzag ÷ the
    same program there), which on a CPU is time on the critical path."""
    from benchmarks.linear_rank_programs import rank_program
    from sp_attention import LinearTuning, SPContext
    B, T, H, K = LIN["B"], LIN["T_local"], LIN["H"], LIN["K"]
    g = torch.Generator().manual_seed(7)
    q, k, v, do = (torch.randn(B, T, H, K, generator=g) * 0.1 for _ in range(4))
    slopes = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)])
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    one = SPContext(None, 0, 1, (0,), "zigzag")

    def timed(fn):
        return time_ms(fn, "cpu", iters=10, repeats=7)
    base = timed(lambda: torch.autograd.grad(lightning_attention(qg, kg, vg, slopes),
                                             (qg, kg, vg), do))
    op = timed(lambda: torch.autograd.grad(lightning_attention(qg, kg, vg, slopes, ctx=one,
                                                               impl="ring"), (qg, kg, vg), do))
    host = op / timed(rank_program(0, 1, "zigzag", q, k, v, do, slopes, "torch",
                                   LinearTuning(), "ring")[2])
    out = {}
    for layout in ("contiguous", "zigzag"):
        ms = [timed(rank_program(r, 2, layout, q, k, v, do, slopes, "torch",
                                 LinearTuning())[2]) for r in range(2)]
        out[layout] = host * max(ms) / base
    return out


def worker(rank: int, world: int, a) -> list:
    torch.set_num_threads(1)
    pair = dist.new_group([0, 1])      # the links between two processes (the others sleep)
    link_rows = probe_links(rank, 2, "cpu", LINK_SIZES, group=pair) if rank < 2 else []
    dist.barrier()
    kernel_rows = probe_kernels("cpu", KERNEL_SHAPES) if rank == 0 else []
    dist.barrier()
    # for the record: the plain kernel on rank 0 alone, then on every rank at once (the cores
    # the job saw; the model uses the machine's, the fastest calls being the undisturbed ones)
    t_one = _local_ms(a) if rank == 0 else 0.0
    dist.barrier()
    t_all = _local_ms(a, barrier=_barrier(None))
    f = rank_factors() if rank == 0 else None
    dist.barrier()
    measured = []
    for P in range(2, world + 1):
        group = dist.new_group(list(range(P)))      # every rank makes every group, in order
        # the kernels again, spread over the job (rank 0 alone): the fit takes the median
        kernel_rows += probe_kernels("cpu", KERNEL_SHAPES) if rank == 0 else []
        dist.barrier()
        if rank < P:
            # the links among these P processes (the probe run on this group)
            links = probe_links(rank, P, "cpu", LINK_SIZES, group=group)
            rows = _linear_rows(rank, P, group, a) + _softmax_rows(rank, P, group, a)
            if rank == 0:
                measured.append((P, rows, links, os.getloadavg()[0]))
        dist.barrier()
    out, machine = [], None
    if rank == 0:
        # the host terms of two processes from every probe of the job that has them
        host = pair_host_rows(r for _, _, links, _ in measured for r in links)
        machine = calibrate("cpu", link_rows + host, typical_probe_rows(kernel_rows), 2)
        machine = dataclasses.replace(machine, kernels=dataclasses.replace(
            machine.kernels, linear_rank_contiguous=f["contiguous"],
            linear_rank_zigzag=f["zigzag"]),
            extra=dict(cores_seen=world * t_one / t_all, t_one=t_one, t_all=t_all))
        for P, rows, links, load in measured:
            link = fit_link(links, P, machine.intra)
            mp = fit_scan_host(links, dataclasses.replace(machine, intra=link, inter=link,
                                                          links_world=P))
            for r in rows:
                r.update(_predict(r, P, machine), world=P, loadavg=load)
                r.update({k + "_links_at_p": v for k, v in _predict(r, P, mp).items()})
            out += rows + [dict(r, bench="calibrate", run=a.run) for r in links]
            out.append(dict(bench="cost_cpu_machine", run=a.run, world=P, machine=mp.to_dict()))
    if rank == 0:
        base = dict(bench="cost_cpu", device="cpu", torch=torch.__version__,
                    date=time.strftime("%Y-%m-%d"), run=a.run, cores=machine.kernels.cores,
                    linear_shape=LIN, softmax_shape=SOFT)
        return ([dict(r, bench="calibrate", run=a.run) for r in link_rows + kernel_rows]
                + [r if r.get("bench") in ("calibrate", "cost_cpu_machine") else dict(base, **r)
                   for r in out]
                + [dict(bench="cost_cpu_machine", run=a.run, machine=machine.to_dict())])
    return []


def main() -> None:
    from sp_attention.testing import run_distributed
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="append the JSON lines to this file")
    p.add_argument("--max-world", type=int, default=8)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--repeats", type=int, default=8)
    a = p.parse_args()
    for run in range(a.runs):
        a.run = f"{time.strftime('%H%M%S')}-{run}"
        rows = run_distributed(worker, a.max_world, a, timeout=3600.0)[0]
        for r in rows:
            line = json.dumps(r, sort_keys=True)
            print(line, flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(line + "\n")


if __name__ == "__main__":
    main()

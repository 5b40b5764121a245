"""Calibration probe: measure α and β of the CP links and the local kernels' rates on the
machine at hand and save them for the cost model (:mod:`sp_attention.cost`).

    python -m sp_attention.calibrate                        # CPU: kernels + gloo among 2 processes
    python -m sp_attention.calibrate --device cuda          # one GPU: kernels (links: >= 2 GPUs)
    torchrun --nproc-per-node 8 -m sp_attention.calibrate   # the links among 8 GPUs as well

Writes the :class:`~sp_attention.machine.Machine` as JSON to ``--out`` (default
:func:`~sp_attention.machine.calibration_path`: ``$SP_ATTENTION_CALIBRATION`` or
``~/.cache/sp_attention/calibration.json``) and every raw measurement as a JSON line to
``--jsonl`` (``benchmarks/report.py`` reads them). Takes seconds on a CPU, about a minute on a
GPU (fla's autotuning on a cold cache takes longer). On CPU the link probe also measures the
host terms of :class:`~sp_attention.machine.Kernels` (``msg_us`` per posted message,
``scan_msg_us`` and ``fold_us`` from the library's own scans across the ranks, ``corun``: the
kernel on every rank at once ÷ alone); on a GPU they stay 0 (the host runs ahead of the
device). What it cannot measure keeps the default
of :func:`~sp_attention.machine.default_machine`: links with fewer than two ranks, and always
the inter-node link (not measured here).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .cost import LinearShape, linear_flops, softmax_flops
from .machine import Link, Machine, calibration_path, default_machine, save_machine

__all__ = ["fit_latency_rate", "time_ms", "probe_links", "probe_kernels", "fit_host", "calibrate",
           "main"]


def fit_latency_rate(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Fit ``ms = a + x·b`` to ``(x, ms)`` points by least squares in *relative* error (a
    small message's latency weighs as much as a large one's bandwidth); returns ``(a, b)``
    with both clamped to >= 0 (``b`` to a tiny positive value)."""
    if len(points) < 2:
        raise ValueError(f"fit_latency_rate needs >= 2 points, got {len(points)}")
    sw = sx = sxx = sm = sxm = 0.0
    for x, m in points:
        w = 1.0 / (m * m)
        sw, sx, sxx, sm, sxm = sw + w, sx + w * x, sxx + w * x * x, sm + w * m, sxm + w * x * m
    det = sw * sxx - sx * sx
    b = (sw * sxm - sx * sm) / det if det else 0.0
    b = max(b, 1e-30)
    a = max((sm - b * sx) / sw, 0.0)
    return a, b


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], object], device: str, iters: int = 5, repeats: int = 5,
            warmup: int = 2, barrier: Optional[Callable[[], None]] = None) -> float:
    """ms per call. CUDA: the median over ``repeats`` of the mean of ``iters`` calls enqueued
    behind a sleep kernel (the GPU's own time, the host ahead as inside a model; CUDA events).
    CPU: the fastest of ``repeats × iters`` calls timed one by one, each after ``barrier``
    (the ranks start together), since other processes on a shared machine only ever add time
    (the ranks' own sharing of the cores is in every call: a CP step's ranks wait on each
    other)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    out = []
    for _ in range(repeats):
        if barrier:
            barrier()
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(50_000_000)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / iters)
        else:          # every call timed alone, from a common start: the least disturbed counts
            for i in range(iters):
                if barrier and i:
                    barrier()
                t0 = time.perf_counter()
                fn()
                out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out) if device == "cuda" else min(out)


def _row(what: str, device: str, **kw) -> dict:
    return dict(bench="calibrate", what=what, device=_device_name(device), torch=torch.__version__,
                date=time.strftime("%Y-%m-%d"), **kw)


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def probe_links(rank: int, world: int, device: str, sizes: Sequence[int],
                group=None) -> list[dict]:
    """p2p ring hops (``batch_isend_irecv`` to the next rank, from the previous) and
    all-gathers of ``sizes`` bytes per rank, timed on every rank (rows from rank 0)."""
    from .comm import all_gather_flat
    from .context import build_sp_context
    group = group or dist.new_group(list(range(world)))
    ctx = build_sp_context(group, layout="contiguous")
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else "cpu"
    nxt, prv = ctx.global_ranks[(rank + 1) % world], ctx.global_ranks[(rank - 1) % world]

    def barrier():
        dist.barrier(group=group, device_ids=[torch.cuda.current_device()] if device == "cuda"
                     else None)
    rows = []
    for nbytes in sizes:
        x = torch.ones(nbytes // 4, device=dev)
        recv = torch.empty_like(x)
        out = torch.empty(world * x.numel(), device=dev)

        def hop():
            ops = [dist.P2POp(dist.isend, x, nxt, group), dist.P2POp(dist.irecv, recv, prv, group)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        for what, fn, moved in (("p2p", hop, nbytes),
                                ("all_gather", lambda: all_gather_flat(out, x, ctx),
                                 (world - 1) * nbytes)):
            ms = time_ms(fn, device, iters=10, repeats=5, barrier=barrier)
            rows.append(_row(what, device, world=world, bytes=nbytes, bytes_moved=moved,
                             ms=_slowest(ms, group, dev)))
    if device == "cpu":
        rows += _host_rows(rank, world, nxt, prv, group, barrier)
    return rows


def _slowest(ms: float, group, dev) -> float:
    t = torch.tensor([ms], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _host_rows(rank: int, world: int, nxt: int, prv: int, group, barrier) -> list[dict]:
    """CPU host costs (rows ``msgs`` and ``corun``): ``m`` = 1, 2, 4, 8 small messages sent
    to the next rank and received from the previous one in one ``batch_isend_irecv`` (each
    further message is host work: the ``P2POp``, the work object, gloo's hand-off to its I/O
    thread and back); and the plain linear kernel run by every rank of the group at once
    against each rank running it alone, timed the same way (the ranks share caches and memory
    bandwidth), the row holding the median over the ranks of each."""
    from .linear import lightning_attention
    rows = []
    for m in (1, 2, 4, 8):
        xs = [torch.ones(1024) for _ in range(m)]
        rs = [torch.empty(1024) for _ in range(m)]

        def batch():
            ops = [dist.P2POp(dist.isend, x, nxt, group) for x in xs]
            ops += [dist.P2POp(dist.irecv, r, prv, group) for r in rs]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        ms = time_ms(batch, "cpu", iters=10, repeats=5, barrier=barrier)
        rows.append(_row("msgs", "cpu", world=world, msgs=2 * m, ms=_slowest(ms, group, "cpu")))
    rows += _scan_rows(world, group, barrier)
    rows.append(_msg_cpu_row(rank, world, nxt, prv, group, barrier))
    g = torch.Generator().manual_seed(rank)
    q, k, v, do = (torch.randn(1, 128, 4, 32, generator=g) * 0.1 for _ in range(4))
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    slopes = torch.tensor([2 ** (-2 * (h + 1)) for h in range(4)])

    def kernel():
        torch.autograd.grad(lightning_attention(q, k, v, slopes), (q, k, v), do)

    def idle():
        pass
    # each rank alone (the others pass the same barriers idle), then all at once: the same
    # timing either way, so only the company differs
    alone = [time_ms(kernel if rank == r else idle, "cpu", iters=5, repeats=5,
                     barrier=barrier) for r in range(world)][rank]
    together = time_ms(kernel, "cpu", iters=5, repeats=5, barrier=barrier)
    rows.append(_row("corun", "cpu", world=world,
                     ms_alone=_median_rank(alone, rank, group, world),
                     ms=_median_rank(together, rank, group, world)))
    resume = _resume_row(rank, world, nxt, prv, group, barrier, kernel)
    return rows + ([resume] if resume else [])


def _resume_row(rank: int, world: int, nxt: int, prv: int, group, barrier, kernel,
                n: int = 10, rounds: int = 5) -> Optional[dict]:
    """Row ``resume``: what a received message costs its receiver (group rank 1: process
    time, every thread) more when the sender (group rank 0) computes ``kernel`` before each
    send on the receiver's own core than on another one (the median of ``rounds`` alternating
    blocks of ``n`` messages each way), in µs per message: the refill of
    caches the others' work evicted while the receiver waited, which every receive pays where
    the ranks outnumber the cores. The two ranks are pinned for the probe and then set back;
    None on every rank where the sender may not run on both of the receiver's first two CPUs
    (or without ``os.sched_setaffinity``)."""
    if world < 2:
        return None
    mine = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cpus = torch.tensor([mine[0] if mine else -1, mine[1] if len(mine) > 1 else -1]
                        if rank == 1 else [0, 0], dtype=torch.int64)
    dist.all_reduce(cpus, group=group)       # the receiver's first two CPUs, to every rank
    # the sender must be allowed on both (a launcher may give each rank its own CPUs): every
    # rank learns the answer before any pinning, so all skip the probe together
    ok = torch.tensor([0 if rank == 0 and not {int(c) for c in cpus} <= set(mine) else 1])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if int(cpus.min()) < 0 or not int(ok):
        return None
    cpu = {"apart": [], "same": []}
    for _ in range(rounds):      # alternating blocks: a slow spell falls on both alike
        for where, sender_cpu in (("apart", int(cpus[1])), ("same", int(cpus[0]))):
            if rank < 2:
                os.sched_setaffinity(0, {int(cpus[0]) if rank == 1 else sender_cpu})
            barrier()
            cpu[where].append(_message_cpu_us(rank, nxt, prv, group, n, kernel))
    if rank < 2:
        os.sched_setaffinity(0, mine)
    t = torch.tensor([statistics.median(cpu["same"]) - statistics.median(cpu["apart"])
                      if rank == 1 else 0.0], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return _row("resume", "cpu", world=world, us=float(t.item()))


def _median_rank(ms: float, rank: int, group, world: int) -> float:
    """The median over the group's ranks of a per-rank time (one rank's bad spell on a shared
    machine does not set a machine-wide factor)."""
    t = torch.zeros(world, dtype=torch.float64)
    t[rank] = ms
    dist.all_reduce(t, group=group)
    return statistics.median(t.tolist())


def _msg_cpu_row(rank: int, world: int, nxt: int, prv: int, group, barrier, n: int = 20,
                 wait_s: float = 2e-3) -> dict:
    """Row ``msg_cpu``: the CPU time (every thread of both processes) of one small message from
    group rank 0 to group rank 1 (``nxt`` of 0, ``prv`` of 1: global ranks) while rank 1 waits
    for it (rank 0 sleeps ``wait_s`` before each send, as a rank computes before it sends), in
    µs per message."""
    barrier()
    us = _message_cpu_us(rank, nxt, prv, group, n, lambda: time.sleep(wait_s))
    cpu = torch.tensor([us if rank < 2 else 0.0], dtype=torch.float64)
    dist.all_reduce(cpu, group=group)
    return _row("msg_cpu", "cpu", world=world, us=float(cpu.item()), wait_s=wait_s)


def _message_cpu_us(rank: int, nxt: int, prv: int, group, n: int, before_send) -> float:
    """This process's CPU time (every thread) per message while group rank 0 sends ``n``
    small messages to group rank 1, calling ``before_send`` before each (the other ranks: 0)."""
    x = torch.ones(1024)
    t0 = time.process_time()
    for _ in range(n):
        if rank == 0:
            before_send()
            dist.send(x, nxt, group=group)
        elif rank == 1:
            dist.recv(x, prv, group=group)
    return (time.process_time() - t0) * 1e6 / n if rank < 2 else 0.0


_SCAN_PROBE = dict(B=1, H=8, K=32, V=32)     # one fp32 scan element of 32 KiB


def _scan_rows(world: int, group, barrier) -> list[dict]:
    """The library's tree scan and all-gather scan of one element per leaf (zigzag: two
    leaves per rank) across the group, no kernels around them (rows ``scan_blelloch``,
    ``scan_allgather``): what a scan costs beyond the links' α and β is host work."""
    from .context import build_sp_context
    from .linear.scan_allgather import allgather_scan
    from .linear.scan_blelloch import blelloch_scan
    ctx = build_sp_context(group, layout="zigzag")
    n, (B, H, K, V) = len(ctx.leaves), _SCAN_PROBE.values()
    A = [torch.full((B, H), 0.9) for _ in range(n)]
    b = [torch.full((B, H, K, V), 0.01) for _ in range(n)]
    rows = []
    for what, scan in (("scan_blelloch", blelloch_scan), ("scan_allgather", allgather_scan)):
        ms = time_ms(lambda: scan(A, b, ctx), "cpu", iters=10, repeats=5, barrier=barrier)
        rows.append(_row(what, "cpu", world=world, layout="zigzag", **_SCAN_PROBE,
                         ms=_slowest(ms, group, "cpu")))
    return rows


def fit_scan_host(rows: Sequence[dict], machine: Machine) -> Machine:
    """``Kernels.scan_msg_us`` and ``Kernels.fold_us`` from the ``scan_*`` rows of
    :func:`probe_links`: the value at which the cost model's time of that scan (its α, β and
    ``msg_us`` from ``machine``) equals the measured one (the model is linear in each)."""
    from .cost import LinearShape, linear_scan_ms
    kw = {}
    for r in rows:
        field = {"scan_blelloch": "scan_msg_us", "scan_allgather": "fold_us"}.get(r["what"])
        if field is None:
            continue
        shape = LinearShape(r["B"], 64, r["H"], r["K"], r["V"], 4)

        def at(x: float) -> float:
            m = dataclasses.replace(machine, kernels=dataclasses.replace(
                machine.kernels, **{field: x}))
            return linear_scan_ms(r["what"][5:], shape, r["world"], r["layout"], m)
        t0, t1 = at(0.0), at(1.0)
        kw[field] = max((r["ms"] - t0) / (t1 - t0), 0.0) if t1 > t0 else 0.0
    return dataclasses.replace(machine, kernels=dataclasses.replace(machine.kernels, **kw))


def pair_host_rows(rows) -> list[dict]:
    """Of :func:`probe_links` rows from groups of any size, those that describe two processes,
    as :func:`fit_host` reads them for a machine calibrated on two: ``corun`` probed in a
    group of two, ``resume`` from every group (always group ranks 0 and 1, the others
    idle)."""
    return [r for r in rows if r.get("what") == "resume"
            or (r.get("what") == "corun" and r.get("world") == 2)]


def fit_host(rows: Sequence[dict], base):
    """``Kernels.msg_us`` (the slope of the ``msgs`` rows per message a rank posts),
    ``Kernels.resume_us`` (the ``resume`` rows, at least 0),
    ``Kernels.corun`` (the ``corun`` rows: together ÷ alone, the median over the rows given,
    at least 1) and
    ``Kernels.msg_cpu_us`` (the ``msg_cpu`` rows) from
    :func:`probe_links` rows; ``base`` where the rows are missing (GPU, one rank)."""
    kw = {}
    msgs = [(r["msgs"], r["ms"]) for r in rows if r["what"] == "msgs"]
    if len(msgs) >= 2:
        n = len(msgs)
        mx, my = sum(x for x, _ in msgs) / n, sum(y for _, y in msgs) / n
        slope = (sum((x - mx) * (y - my) for x, y in msgs)
                 / sum((x - mx) ** 2 for x, _ in msgs))
        kw["msg_us"] = max(slope, 0.0) * 1e3
    corun = [r["ms"] / r["ms_alone"] for r in rows if r["what"] == "corun"]
    if corun:
        kw["corun"] = max(statistics.median(corun), 1.0)
    cpu = [r["us"] for r in rows if r["what"] == "msg_cpu"]
    if cpu:
        kw["msg_cpu_us"] = statistics.median(cpu)
    resume = [r["us"] for r in rows if r["what"] == "resume"]
    if resume:
        kw["resume_us"] = max(statistics.median(resume), 0.0)
    return dataclasses.replace(base, **kw)


def _link_worker(rank: int, world: int, device: str, sizes: Sequence[int]) -> list[dict]:
    if device == "cuda":
        torch.cuda.set_device(rank)
    torch.set_num_threads(1)
    return probe_links(rank, world, device, sizes)


def fit_link(rows: Sequence[dict], world: int, base: Link) -> Link:
    """A :class:`Link` from ``probe_links`` rows (p2p: α, β from bytes per hop; all-gather:
    α, β from bytes received; ``step_us`` kept from ``base``: one world size says nothing
    about how latency grows with P)."""
    p2p = fit_latency_rate([(r["bytes_moved"], r["ms"]) for r in rows if r["what"] == "p2p"])
    coll = fit_latency_rate([(r["bytes_moved"], r["ms"]) for r in rows
                             if r["what"] == "all_gather"])
    return Link(alpha_p2p_us=p2p[0] * 1e3, p2p_gbps=1e-6 / p2p[1],
                alpha_coll_us=coll[0] * 1e3, coll_gbps=1e-6 / coll[1], step_us=base.step_us)


_CPU_SHAPES = {"linear": dict(B=1, H=4, K=32, T=(256, 1024)),
               "softmax": dict(B=1, H=8, Hkv=4, D=32, T=(32, 64, 128, 256),
                               causal=(True, False))}
_GPU_SHAPES = {"linear": dict(B=1, H=16, K=128, T=(8192, 16384, 32768)),
               "softmax": dict(B=1, H=32, Hkv=8, D=128, T=(4096, 8192, 16384))}


def peak_bytes(fn: Callable[[], object], device: str) -> Optional[int]:
    """Bytes one call of ``fn`` adds at its peak on top of what was allocated before it (the
    call's working memory, its inputs excluded); None off CUDA."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _linear_rows(device: str, dtype: torch.dtype, shapes: dict) -> list[dict]:
    from .linear import lightning_attention
    dev = "cuda" if device == "cuda" else "cpu"
    B, H, K = shapes["B"], shapes["H"], shapes["K"]
    slopes = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)], device=dev)
    rows = []
    for T in shapes["T"]:
        g = torch.Generator(device=dev).manual_seed(T)
        q, k, v, do = (torch.randn(B, T, H, K, device=dev, dtype=dtype, generator=g) * 0.1
                       for _ in range(4))
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))

        def fwd():
            with torch.no_grad():
                return lightning_attention(q, k, v, slopes)

        def fwd_bwd():
            return torch.autograd.grad(lightning_attention(q, k, v, slopes), (q, k, v), do)
        ms_f, ms_fb = time_ms(fwd, device), time_ms(fwd_bwd, device)
        shape = LinearShape(B, T, H, K, K, q.element_size())
        rows.append(_row("linear", device, B=B, T=T, H=H, K=K, V=K, dtype=str(dtype)[6:],
                         ms_fwd=ms_f, ms_fwd_bwd=ms_fb, flops_fwd_bwd=linear_flops(shape),
                         peak_bytes=peak_bytes(fwd_bwd, device)))
    return rows


def _softmax_rows(device: str, dtype: torch.dtype, shapes: dict) -> list[dict]:
    from .softmax import context_parallel_attention
    dev = "cuda" if device == "cuda" else "cpu"
    B, H, Hkv, D = shapes["B"], shapes["H"], shapes["Hkv"], shapes["D"]
    rows = []
    for T in shapes["T"]:
        g = torch.Generator(device=dev).manual_seed(T)
        q, do = (torch.randn(B, T, H, D, device=dev, dtype=dtype, generator=g) for _ in range(2))
        k, v = (torch.randn(B, T, Hkv, D, device=dev, dtype=dtype, generator=g) for _ in range(2))
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
        for causal in shapes.get("causal", (True,)):
            def fwd(causal=causal):
                with torch.no_grad():
                    return context_parallel_attention(q, k, v, causal=causal)

            def fwd_bwd(causal=causal):
                return torch.autograd.grad(context_parallel_attention(q, k, v, causal=causal),
                                           (q, k, v), do)
            ms_f, ms_fb = time_ms(fwd, device), time_ms(fwd_bwd, device)
            rows.append(_row("softmax", device, B=B, T=T, H=H, Hkv=Hkv, D=D,
                             dtype=str(dtype)[6:], causal=causal, ms_fwd=ms_f, ms_fwd_bwd=ms_fb,
                             flops_fwd=softmax_flops(B, H, T, T, D, causal),
                             peak_bytes=peak_bytes(fwd_bwd, device)))
    return rows


def _memory_rows(device: str) -> list[dict]:
    dev = "cuda" if device == "cuda" else "cpu"
    n = (64 if device == "cuda" else 4) * 2 ** 20
    x, y = torch.ones(n, device=dev), torch.ones(n, device=dev)
    a, s1, s2 = (torch.ones(8, device=dev), torch.ones(8, 1024, device=dev),
                 torch.ones(8, 1024, device=dev))
    ms = time_ms(lambda: y.add_(x), device, iters=10)
    # a small state combine, A·b1 + b2 (two ops and an allocation): the fixed cost per op
    op = time_ms(lambda: s1.mul(a[:, None]).add_(s2), device, iters=50) / 2
    return [_row("memory", device, bytes_moved=3 * 4 * n, ms=ms, op_ms=op)]


def probe_kernels(device: str, shapes: Optional[dict] = None) -> list[dict]:
    """Rows of the local kernels (the library's own ops at world size 1: linear fwd and
    fwd + bwd, softmax likewise; peak memory on CUDA) and of element-wise bandwidth."""
    shapes = shapes or (_GPU_SHAPES if device == "cuda" else _CPU_SHAPES)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return (_linear_rows(device, dtype, shapes["linear"])
            + _softmax_rows(device, dtype, shapes["softmax"]) + _memory_rows(device))


def typical_probe_rows(rows: Sequence[dict]) -> list[dict]:
    """Of kernel probe rows (:func:`probe_kernels`) repeated over a job, the median row per
    probed shape (by its fwd + bwd time). Each probe is already the fastest of its calls, but a
    whole probe can fall on a slow spell: on the 16-vCPU H200 hosts one rank alone measures
    either of two speeds about 1.5 × apart from probe to probe."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["what"], r.get("T"), r.get("causal", True)), []).append(r)
    out = []
    for g in groups.values():
        g = sorted(g, key=lambda r: r.get("ms_fwd_bwd", r.get("ms")))
        out.append(g[len(g) // 2])
    return out


def _fit_softmax(rows: Sequence[dict], mask: Optional[float]) -> dict:
    """The attention call's fixed costs and rates (and ``softmax_mask``) from probe rows; the
    model is :func:`sp_attention.cost.common.softmax_kernel_ms` plus a fixed cost per call and
    direction. ``mask`` None (a kernel that skips the masked triangle): a causal call's FLOPs
    are the pairs it keeps. Otherwise the kernel computes every pair of the block: the
    non-causal rows give the fixed costs and rates, and the causal rows what the mask adds
    (with causal rows alone, ``mask`` is taken as known and the fit takes it out)."""
    def causal(r):
        return float(r.get("causal", True))

    if mask is None:
        work, fit_on, m = (lambda r: r["flops_fwd"]), rows, 0.0
    else:
        def work(r):       # the full block
            return softmax_flops(r["B"], r["H"], r["T"], r["T"], r["D"], False)
        full = [r for r in rows if not causal(r)]
        fit_on, m = (full, 0.0) if len(full) >= 2 else (rows, mask)

    def bwd(r):
        return r["ms_fwd_bwd"] - r["ms_fwd"]
    # fwd = call + work·(1 + m·causal)·per_f;  bwd = call_b + 2.5·work·per_b + m·causal·work·per_f
    call_f, per_f = fit_latency_rate([(work(r) * (1 + m * causal(r)), r["ms_fwd"])
                                      for r in fit_on])
    call_b, per_b = fit_latency_rate([(2.5 * work(r), bwd(r) - m * causal(r) * work(r) * per_f)
                                      for r in fit_on])
    out = dict(softmax_call_ms=call_f, softmax_bwd_call_ms=call_b,
               softmax_fwd_tflops=1e-9 / per_f, softmax_bwd_tflops=1e-9 / per_b)
    if mask is not None and fit_on is not rows:
        added = [(r["ms_fwd"] - call_f - work(r) * per_f + bwd(r) - call_b
                  - 2.5 * work(r) * per_b) / (2 * work(r) * per_f) for r in rows if causal(r)]
        if added:
            out["softmax_mask"] = max(statistics.median(added), 0.0)
    return out


def fit_kernels(rows: Sequence[dict], base):
    """The :class:`~sp_attention.machine.Kernels` that ``probe_kernels`` rows imply (fields
    they do not inform are kept from ``base``)."""
    lin = [r for r in rows if r["what"] == "linear"]
    soft = [r for r in rows if r["what"] == "softmax"]
    mem = [r for r in rows if r["what"] == "memory"]
    kw = {}
    if lin:
        call, per = fit_latency_rate([(r["flops_fwd_bwd"], r["ms_fwd_bwd"]) for r in lin])
        kw.update(linear_call_ms=call, linear_tflops=1e-9 / per,
                  linear_fwd_share=statistics.median(r["ms_fwd"] / r["ms_fwd_bwd"] for r in lin))
    if soft:
        kw.update(_fit_softmax(soft, base.softmax_mask))
        big = max(soft, key=lambda r: r["T"])
        if big.get("peak_bytes"):
            it = 2 if big["dtype"] in ("bfloat16", "float16") else 4
            elems = big["B"] * big["T"] * big["H"] * big["D"]
            kv = 2 * big["B"] * big["T"] * big["Hkv"] * big["D"] * it
            lse = big["B"] * big["H"] * big["T"] * 4
            kw["softmax_bwd_workspace"] = max(
                (big["peak_bytes"] - 2 * elems * it - kv - lse) / elems, 0.0)
    if mem:
        kw.update(mem_gbps=mem[0]["bytes_moved"] / mem[0]["ms"] * 1e-6, op_us=mem[0]["op_ms"] * 1e3)
    return dataclasses.replace(base, **kw)


def calibrate(device: str, link_rows: Sequence[dict], kernel_rows: Sequence[dict],
              world: int) -> Machine:
    """The :class:`Machine` these measurements describe, on top of the device's defaults."""
    base = default_machine(_device_name(device) if device == "cuda" else "cpu")
    kernels = fit_host(link_rows, fit_kernels(kernel_rows, base.kernels))
    if device == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        kernels = dataclasses.replace(kernels, cores=cores)
    intra = fit_link(link_rows, world, base.intra) if link_rows else base.intra
    if device == "cpu" and link_rows:   # gloo's ring collectives: one more pairwise step per rank
        intra = dataclasses.replace(intra, step_us=intra.alpha_coll_us)
    links = f"links among {world} ranks" if link_rows else "links: defaults (one rank)"
    machine = dataclasses.replace(
        base, name=f"calibrated {_device_name(device)}", kernels=kernels, intra=intra,
        links_world=world if link_rows else 0,
        inter=intra if device == "cpu" else base.inter, device=_device_name(device),
        source=f"python -m sp_attention.calibrate, {time.strftime('%Y-%m-%d')}, "
               f"torch {torch.__version__}; {links}; inter-node: "
               + ("none (one host)" if device == "cpu" else "default, not measured"))
    return fit_scan_host(link_rows, machine)


def _write_jsonl(rows: Sequence[dict], path: Optional[str]) -> None:
    for r in rows:
        print(json.dumps(r, sort_keys=True), flush=True)
    if path:
        with open(path, "a") as f:
            for r in rows:
                f.write(json.dumps(r, sort_keys=True) + "\n")


def main(argv: Optional[Sequence[str]] = None) -> Machine:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"],
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", help="calibration JSON (default: %(default)s -> "
                                 + calibration_path() + ")")
    p.add_argument("--jsonl", help="append the raw measurements as JSON lines to this file")
    p.add_argument("--world", type=int, default=2,
                   help="ranks to spawn for the link probe when not under torchrun (CPU: gloo "
                        "processes; CUDA: one per GPU, at most the GPUs present)")
    p.add_argument("--no-links", action="store_true", help="measure the kernels only")
    a = p.parse_args(argv)
    sizes = [2 ** 16, 2 ** 18, 2 ** 20, 2 ** 22] if a.device == "cpu" else \
        [2 ** 20, 2 ** 23, 2 ** 25, 2 ** 27]
    if "RANK" in os.environ:               # torchrun: every rank probes the links
        backend = "nccl" if a.device == "cuda" else "gloo"
        if a.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        rank, world = dist.get_rank(), dist.get_world_size()
        link_rows = [] if a.no_links or world < 2 else probe_links(rank, world, a.device, sizes)
        kernel_rows = probe_kernels(a.device) if rank == 0 else []
        dist.barrier()
        dist.destroy_process_group()
        if rank:
            return None
    else:
        world = min(a.world, torch.cuda.device_count()) if a.device == "cuda" else a.world
        kernel_rows = probe_kernels(a.device)
        link_rows = []
        if not a.no_links and world >= 2:
            from .testing import run_distributed
            link_rows = run_distributed(_link_worker, world, a.device, sizes,
                                        backend="nccl" if a.device == "cuda" else "gloo")[0]
    _write_jsonl(list(link_rows) + list(kernel_rows), a.jsonl)
    machine = calibrate(a.device, link_rows, kernel_rows, world)
    path = save_machine(machine, a.out)
    print(f"sp_attention.calibrate: wrote {path} ({machine.source})", file=sys.stderr)
    return machine


if __name__ == "__main__":
    main()

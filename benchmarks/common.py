"""Shared benchmark plumbing: process-group setup (torchrun/NCCL or CPU/gloo), timing by the
PERF.md protocol (warm-up, ≥ 10 timed iterations, median of ≥ 3 repeats, barrier first) and JSON
lines on stdout (and ``--out FILE``)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--device", choices=["cuda", "cpu"],
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--t-local", type=int, nargs="+", help="tokens per rank (default by device)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help="append the JSON lines to this file too")
    p.add_argument("--dtype", default=None, help="bfloat16 (cuda default) / float32 (cpu default)")
    p.add_argument("--timing", nargs="+", choices=["eager", "queued"], default=["eager"],
                   help="eager: the host enqueues while the GPU runs (a lone layer is host-bound "
                        "when its launches outlast its kernels); queued: every timed call is "
                        "enqueued before the GPU starts them (the GPU's own time, as inside a "
                        "model whose host runs ahead). Rows carry the mode in 'timing'.")
    return p


def init_dist(device: str) -> tuple[int, int]:
    """Initialise from torchrun's environment (one process per GPU); single process if absent."""
    if "RANK" not in os.environ:
        return 0, 1
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


# Communication settings the CP benchmarks can run side by side (--comm-variants): "default"
# (a plain dist.new_group; the library's own stream settings), "nccl-hp" (the group's NCCL
# kernels on a high-priority stream), "ctaN" (NCCL bounded to N CTAs per operation, so its
# kernels take fewer SMs beside the attention kernels), "hp-ctaN" (both), "side0" (linear only:
# the scan's side stream at normal priority instead of the library's high priority).
COMM_VARIANTS = ("default", "nccl-hp", "cta1", "cta2", "cta4", "hp-cta2", "side0")


def cp_groups(variants, world: int) -> dict:
    """``{variant: CP group over all ranks}`` for ``variants`` plus ``"default"`` (None at world
    size 1). Every rank creates the same groups in the same order, as ``new_group`` requires."""
    from sp_attention import CPGroupOptions, new_cp_group
    if world == 1:
        return {v: None for v in ("default", *variants)}
    ranks = list(range(world))
    groups = {"default": dist.new_group(ranks)}
    for v in variants:
        if v == "nccl-hp":
            groups[v] = new_cp_group(ranks, CPGroupOptions(high_priority_stream=True))
        elif v.startswith(("cta", "hp-cta")):
            groups[v] = new_cp_group(ranks, CPGroupOptions(
                high_priority_stream=v.startswith("hp-"), max_ctas=int(v.rpartition("cta")[2])))
        elif v in COMM_VARIANTS:
            groups[v] = groups["default"]
        else:
            raise ValueError(f"unknown communication variant {v!r}; use one of {COMM_VARIANTS}")
    return groups


def barrier(device: str) -> None:
    if dist.is_initialized():
        dist.barrier(device_ids=[torch.cuda.current_device()] if device == "cuda" else None)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# Host-ahead timing: the GPU is held by a sleep kernel long enough for the host to enqueue every
# timed iteration, so the timed region runs with a full launch queue, as a layer does inside a
# model whose host runs ahead of the GPU (or under CUDA graphs). Cycles at ~2 GHz: 60 ms.
_HOLD_CYCLES = 120_000_000
_HOST_AHEAD_LOST: list = []


def time_ms(fn: Callable[[], object], device: str, warmup: int, iters: int, repeats: int,
            mode: str = "eager") -> float:
    """Median over ``repeats`` of the mean time of ``iters`` calls (ms), after ``warmup``.

    ``mode="eager"``: the host enqueues while the GPU runs (host time per call shows when it
    exceeds the GPU time). ``mode="queued"``: every timed call is enqueued behind a sleep
    kernel before the GPU reaches the first one, so the number is the GPU's own time for the
    calls (CUDA only; a repeat whose enqueue outlasted the sleep is recorded in
    :func:`host_ahead_lost`).
    """
    if mode not in ("eager", "queued"):
        raise ValueError(f"unknown timing mode {mode!r}; use 'eager' or 'queued'")
    for _ in range(warmup):
        fn()
    sync(device)
    results = []
    for _ in range(repeats):
        barrier(device)
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if mode == "queued":
                torch.cuda._sleep(_HOLD_CYCLES)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            if mode == "queued" and start.query():   # the GPU reached the calls before the host
                _HOST_AHEAD_LOST.append(1)            # finished enqueueing them: not host-ahead
            end.synchronize()
            ms = start.elapsed_time(end) / iters
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            ms = (time.perf_counter() - t0) * 1e3 / iters
        results.append(ms)
    # Every rank reports the slowest rank's time: a CP step is as slow as its slowest member.
    t = torch.tensor([statistics.median(results)], dtype=torch.float64,
                     device=device if device == "cuda" else "cpu")
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def host_ahead_lost() -> int:
    """How many queued-mode repeats so far lost the host-ahead property (0 = all valid)."""
    return len(_HOST_AHEAD_LOST)


def host_ms(fn: Callable[[], object], iters: int = 10) -> float:
    """Host time to enqueue one call (ms), GPU queue drained first and after: when it is above
    the GPU time the step is host-bound."""
    fn()
    sync("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    ms = (time.perf_counter() - t0) * 1e3 / iters
    sync("cuda" if torch.cuda.is_available() else "cpu")
    return ms


def peak_mem_gb(fn: Callable[[], object], device: str) -> Optional[float]:
    """GB (1e9 bytes) that one call of ``fn`` adds at its peak on top of what was allocated
    before it (``max_memory_allocated`` after a reset, minus ``memory_allocated`` at the start):
    the call's working memory, its inputs excluded, so rows measured in one process compare
    whatever else that process holds. None off CUDA."""
    from sp_attention.calibrate import peak_bytes
    nbytes = peak_bytes(fn, device)
    return None if nbytes is None else nbytes / 1e9


def kernel_table(fn: Callable[[], object], label: str, iters: int = 5, top: int = 15) -> None:
    """Print the GPU kernels of one call of ``fn`` (µs per call, launches per call), from the
    torch profiler over ``iters`` calls after one warm-up: where a row's time goes."""
    fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.device_time_total for e in events) / iters
    print(f"--- kernels of {label}: {total:.1f} us per call (sum of kernel times)")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:top]:
        print(f"{e.device_time_total / iters:9.1f} us | {e.count / iters:5.1f} x | {e.key[:100]}")


def host_profile(fn: Callable[[], object], label: str, iters: int = 10, top: int = 40,
                 show: bool = True) -> None:
    """Print where the host's time goes in ``iters`` calls of ``fn`` after one warm-up
    (cProfile, sorted by cumulative time; GPU syncs show as time in the call that waits).
    ``show=False``: make the same calls, print nothing (the other ranks of a collective op)."""
    import cProfile
    import io
    import pstats
    fn()
    sync("cuda" if torch.cuda.is_available() else "cpu")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        fn()
    prof.disable()
    if not show:
        return
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(top)
    print(f"--- host profile of {label}, {iters} calls")
    print(out.getvalue())


def print_summary(paths, cols) -> None:
    """A markdown table of the JSON lines in ``paths``: the columns of ``cols`` any row has."""
    rows = [json.loads(line) for p in paths for line in open(p) if line.strip()]
    cols = [c for c in cols if any(c in r for r in rows)]

    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else "" if v is None else str(v)
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(fmt(r.get(c)) for c in cols) + " |")


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


_SMI: list = []      # [False] once nvidia-smi was not found


def gpu_state() -> Optional[list]:
    """``[[index, SM MHz, °C, W], …]`` of this host's GPUs now (nvidia-smi), or None: rows
    timed later in a sweep may run at lower clocks (heat, power), which the row then shows."""
    if _SMI or not torch.cuda.is_available():
        return None
    import subprocess
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,clocks.sm,temperature.gpu,"
                              "power.draw", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        _SMI.append(False)
        return None
    rows = []
    for line in out.strip().splitlines():
        try:
            rows.append([float(x) for x in line.split(",")])
        except ValueError:          # "[N/A]" fields
            continue
    return rows or None


def emit(record: dict, out: Optional[str], rank: int) -> None:
    if rank != 0:
        return
    record.setdefault("torch", torch.__version__)
    state = gpu_state()
    if state is not None:
        record.setdefault("gpu_state", state)
    record.setdefault("date", time.strftime("%Y-%m-%d"))
    # NCCL knobs change what overlaps what; keep them with the numbers they produced.
    nccl = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    if nccl:
        record.setdefault("nccl_env", nccl)
    line = json.dumps(record, sort_keys=True)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def parse_or_summarize(p: argparse.ArgumentParser, cols) -> Optional[argparse.Namespace]:
    """Parse the benchmark's arguments, with ``--summary FILE...`` (print the table of earlier
    JSON lines and return None: the caller exits)."""
    p.add_argument("--summary", nargs="+", metavar="JSONL", help="print a table and exit")
    a = p.parse_args()
    if a.summary:
        print_summary(a.summary, cols)
        return None
    return a


def fla_gated_dqkwg_timing_only(q, k, v, do, h, dh, gc, scale):
    """fla's gated ``chunk_bwd_kernel_dqkwg`` launched as fla's ``chunk_bwd_dqkwg`` launches it
    on Hopper (BK = BV = 128), then its ``dg`` partial sum and reverse chunk cumsum (what
    ``chunk_simple_gla``'s backward adds): for TIMING ONLY, the baseline our ``chunk_dqkdg``
    replaces. fla refuses this kernel on Hopper with Triton < 3.7.1 because its results can be
    wrong there (fla #640); nothing here reads them."""
    import triton
    from fla.ops.common.chunk_o import chunk_bwd_kernel_dqkwg
    from fla.ops.utils import chunk_local_cumsum
    B, T, H, K = k.shape
    V, BT = v.shape[-1], 64
    BK = min(max(triton.next_power_of_2(K), 16), 128)
    BV = min(max(triton.next_power_of_2(V), 16), 128)
    NK, NT = triton.cdiv(K, BK), triton.cdiv(T, BT)
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    dg = torch.empty(NK, B, T, H, device=q.device, dtype=torch.float32)
    chunk_bwd_kernel_dqkwg[(NK * NT, B * H)](
        q=q, k=k, v=v, g=gc, g_gamma=None, h=h, do=do, dh=dh, dq=dq, dk=dk, dw=None, dv=None,
        dg=dg, cu_seqlens=None, chunk_indices=None, scale=scale, B=B, T=T, H=H, HV=H, K=K, V=V,
        BT=BT, BK=BK, BV=BV, STATE_V_FIRST=False)
    return dq, dk, chunk_local_cumsum(dg.sum(0), chunk_size=BT, reverse=True)

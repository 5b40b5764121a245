"""Where a train.py step's GPU time goes: runs ``train.main(argv)`` under the torch profiler and
prints the CUDA kernels by time per step, the time per kind of kernel (NCCL, GEMM, attention,
cross-entropy, norm, optimizer, copies, other element-wise), the summed kernel time and the
wall time of the profiled steps. Only steady steps are recorded: ``--profile-skip`` steps
(default 2: compilation, autotuning, allocator growth) run first, then ``--profile-steps``
(default 3) are profiled; pass ``--train-iters`` ≥ their sum. The harness syncs only at the
profiled window's edges: between the profiled steps the host runs ahead as in a real run, so
the boundaries inside the window (``boundary_ms``) are a real run's. Kinds are guessed from kernel
names (Megatron's torch.compile'd fusions show as ``triton_*``: read the names). ``--trace
FILE.json`` also writes the Chrome trace and splits each step's wall time on this rank's GPU
into compute, NCCL that nothing hid, NCCL beside compute and idle (the GPU waiting for the host
or for a peer), and counts the host's waits for the GPU per step (a stream sync: ``.item()``,
a blocking copy; each one empties the GPU's queue) with the GPU idle right after them: at
CP > 1 run it under torchrun, every rank writes its own (``{rank}`` in the name is replaced
by the rank). ``--analyze TRACE.json[.gz] --steps N`` reads a trace another program wrote
(Megatron's ``--profile --use-pytorch-profiler`` writes ``torch_profile/rank-R.json.gz`` beside
its ``--tensorboard-dir``) and prints the same tables, so the launcher and train.py compare.
``--out FILE.jsonl`` (both modes) appends each rank's tables as one JSON line (the per-kind
sums, the top kernels, the timeline and host waits): what a device call brings back instead of
the traces.

    python benchmarks/train_profile.py --preset 1b --train-iters 6 --micro-batch-size 4 \\
        --global-batch-size 16 --no-progress-bar --log-dir /tmp/prof
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys
import time
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402

# first match wins; matched against the lower-cased kernel name
KINDS = (
    ("nccl", ("nccl",)),
    # before GEMMs: FlashAttention's kernels carry cutlass' names in their template arguments
    ("attention", ("flash", "fmha", "cudnn", "attn", "chunk_", "sp_attention")),
    ("gemm", ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas", "matmul")),
    ("cross_entropy", ("cross_entropy", "log_softmax", "logsumexp", "nll_loss", "softmax")),
    ("norm", ("rms", "norm")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("copy", ("copy", "memcpy", "memset", "cat", "transpose", "contiguous")),
    ("elementwise", ("elementwise", "vectorized", "triton", "reduce", "fused")),
)


def _union(spans: list) -> list:
    """Sorted, merged ``(start, end)`` intervals."""
    out: list = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _length(spans: list) -> float:
    return sum(b - a for a, b in spans)


def _intersect(x: list, y: list) -> float:
    """Total overlap of two merged interval lists."""
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, hi - lo)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def timeline(kernels: list, wall_us: float, steps: int) -> dict:
    """Where the profiled steps' wall time went on the GPU, per step (ms), from ``kernels``
    ``[(start_us, end_us, name)]`` of one GPU: ``compute`` (time some non-NCCL kernel ran),
    ``nccl_exposed`` (only NCCL kernels ran: communication nothing hid), ``nccl_hidden`` (NCCL
    beside compute), ``idle`` (no kernel: the GPU waiting on the host or on a peer that has
    not launched yet) — compute + nccl_exposed + idle = wall."""
    comm = _union([(a, b) for a, b, n in kernels if "nccl" in n.lower()])
    comp = _union([(a, b) for a, b, n in kernels if "nccl" not in n.lower()])
    busy = _length(_union([(a, b) for a, b, _ in kernels]))
    hidden = _intersect(comm, comp)
    steps = max(1, steps)
    out = {"compute": _length(comp), "nccl_exposed": _length(comm) - hidden,
           "nccl_hidden": hidden, "idle": max(0.0, wall_us - busy)}
    return {k: round(v / 1e3 / steps, 2) for k, v in out.items()}


def nccl_op(name: str, dur_us: float) -> str:
    """An NCCL kernel's collective from its name (``ncclDevKernel_AllGather_RING_LL`` ->
    ``AllGather``), with `` long`` for one of 1 ms or more (the bulk transfers: gradient
    reduce-scatters, parameter gathers) against the short ones (the attention's exchanges)."""
    m = re.search(r"nccl(?:DevKernel|Kernel)_([A-Za-z]+)", name)
    return (m.group(1) if m else "other") + (" long" if dur_us >= 1000.0 else "")


def _nccl_by_op(kernels: list) -> dict:
    """The NCCL kernels' merged spans by collective (:func:`nccl_op`)."""
    ops: dict = {}
    for a, b, n in kernels:
        if "nccl" in n.lower():
            ops.setdefault(nccl_op(n, b - a), []).append((a, b))
    return {op: _union(spans) for op, spans in ops.items()}


def nccl_exposed_by_op(kernels: list, steps: int) -> dict:
    """``nccl_exposed`` of :func:`timeline` split by collective (:func:`nccl_op`), ms per
    step: the time each one's kernels ran with no compute kernel beside them (two
    collectives running at once both count)."""
    comp = _union([(a, b) for a, b, n in kernels if "nccl" not in n.lower()])
    steps = max(1, steps)
    out = {op: round((_length(mine) - _intersect(mine, comp)) / 1e3 / steps, 2)
           for op, mine in _nccl_by_op(kernels).items()}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _clip(spans: list, lo: float, hi: float) -> list:
    """The parts of merged ``spans`` inside ``[lo, hi]``."""
    return [[max(a, lo), min(b, hi)] for a, b in spans if b > lo and a < hi]


def step_boundary(kernels: list) -> dict:
    """The steps' boundaries, ms each on average: from the last GEMM of a backward to the first
    GEMM of the next forward around AdamW's kernels (``window``) — the backward's tail
    (the last gradient buckets), the norm, clip and AdamW (``optimizer``), other kernels (the
    embedding, casts: ``other_compute``), NCCL with nothing beside it by collective
    (``nccl_only``: the last reduce-scatter, the parameters' gathers, the step's agreement) and
    ``idle`` (the GPU waiting for the host). Only boundaries with a GEMM on both sides count."""
    def optimizer_kernel(n: str) -> bool:      # the norm's, the clip's and AdamW's kernels
        return "multi_tensor" in n.lower() or kind_of(n) == "optimizer"
    gemm = sorted((a, b) for a, b, n in kernels if kind_of(n) == "gemm")
    opt = sorted((a, b) for a, b, n in kernels if optimizer_kernel(n))
    windows = []
    for a, b in ((a, b) for a, b, n in kernels if "adam" in n.lower()):   # AdamW: the anchor
        before = [e for _, e in gemm if e <= a]
        after = [s for s, _ in gemm if s >= b]
        if before and after and (not windows or windows[-1] != (max(before), min(after))):
            windows.append((max(before), min(after)))
    if not windows:
        return {"count": 0}
    every = _union([(a, b) for a, b, _ in kernels])
    optimizer = _union(opt)
    other = _union([(a, b) for a, b, n in kernels
                    if "nccl" not in n.lower() and not optimizer_kernel(n)
                    and kind_of(n) != "gemm"])
    compute = _union([(a, b) for a, b, n in kernels if "nccl" not in n.lower()])
    ops = _nccl_by_op(kernels)
    total = {"window": 0.0, "optimizer": 0.0, "other_compute": 0.0, "idle": 0.0}
    nccl_only: dict = {}
    for lo, hi in windows:
        comp, mine_opt, mine_other = (_clip(x, lo, hi) for x in (compute, optimizer, other))
        total["window"] += hi - lo
        total["optimizer"] += _length(mine_opt)
        total["other_compute"] += _length(mine_other) - _intersect(mine_other, mine_opt)
        total["idle"] += (hi - lo) - _length(_clip(every, lo, hi))
        for op, spans in ops.items():
            mine = _clip(spans, lo, hi)
            nccl_only[op] = nccl_only.get(op, 0.0) + _length(mine) - _intersect(mine, comp)
    n = len(windows)
    out = {k: round(v / 1e3 / n, 2) for k, v in total.items()}
    out["nccl_only"] = {k: round(v / 1e3 / n, 2) for k, v in
                        sorted(nccl_only.items(), key=lambda kv: -kv[1]) if v > 0}
    return {"count": n, **out}


def trace_events(path) -> list:
    """The ``traceEvents`` of a Chrome trace the profiler wrote (``.gz``: compressed); a list
    (events read before) is returned as it is, so one trace is parsed once."""
    if isinstance(path, list):
        return path
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return json.load(f).get("traceEvents", [])


def trace_kernels(path) -> list:
    """``[(start_us, end_us, name)]`` of the GPU kernels in a Chrome trace the profiler wrote
    (``cat: kernel``; one process's GPU; ``path`` or its :func:`trace_events`)."""
    events = trace_events(path)
    return [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e.get("name", ""))
            for e in events if e.get("cat") == "kernel" and "ts" in e]


SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize")


def host_syncs(path, steps: int, window_us: float = 1000.0) -> dict:
    """The host's waits for the GPU inside the profiled steps, per step, from a Chrome trace's
    CUDA runtime events: ``count`` (``cudaStreamSynchronize`` / ``cudaEventSynchronize`` —
    ``.item()``, a copy to the host, a blocking copy from pageable host memory; the profiler's
    own ``cudaDeviceSynchronize`` between steps is left out), ``idle_after_ms`` (GPU idle
    within ``window_us`` after each wait returned: the host had lost its lead and the GPU
    waited for its next launches) and ``by_op`` (the GPU op the host launched just before
    each wait, e.g. ``Memcpy HtoD (Pageable -> Device) 128B``, and how often)."""
    events = trace_events(path)
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
           and "ts" in e]
    by_corr = {e.get("args", {}).get("correlation"): e for e in gpu}
    busy = _union([(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in gpu])
    runtime = sorted((e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
                      and "ts" in e), key=lambda e: float(e["ts"]))
    steps = max(1, steps)
    count, windows, by_op = 0, [], {}
    for i, e in enumerate(runtime):
        if e.get("name") not in SYNC_CALLS:
            continue
        count += 1
        before = "?"
        for j in range(i - 1, max(-1, i - 8), -1):
            op = by_corr.get(runtime[j].get("args", {}).get("correlation"))
            if op is not None:
                size = op.get("args", {}).get("bytes")
                before = op.get("name", "?")[:60] + (f" {size}B" if size is not None else "")
                break
        by_op[before] = by_op.get(before, 0) + 1
        a = float(e["ts"]) + float(e.get("dur", 0))
        windows.append((a, a + window_us))
    windows = _union(windows)                  # waits close together: their idle once
    idle = _length(windows) - _intersect(windows, busy)
    return {"count": round(count / steps, 1), "idle_after_ms": round(idle / 1e3 / steps, 2),
            "by_op": {k: round(v / steps, 1) for k, v in
                      sorted(by_op.items(), key=lambda x: -x[1])[:6]}}


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def print_kinds(per_kernel: dict, steps: int, top: int = 50) -> dict:
    """The kernel table and the per-kind sums, per step, from ``{name: (us, calls)}``;
    returns the sums ``{kind: ms per step}``."""
    steps = max(1, steps)
    by_kind: dict = {}
    for name, (us, _) in per_kernel.items():
        kind = kind_of(name)
        by_kind[kind] = by_kind.get(kind, 0.0) + us
    print("kernel time per step (ms) | calls per step | kind | kernel")
    for name, (us, n) in sorted(per_kernel.items(), key=lambda x: -x[1][0])[:top]:
        print(f"{us / 1e3 / steps:9.2f} | {n / steps:7.1f} | {kind_of(name):13s} | {name[:110]}")
    kinds = {k: round(v / 1e3 / steps, 1) for k, v in sorted(by_kind.items(), key=lambda x: -x[1])}
    print("per step (ms) by kind: " + json.dumps(kinds))
    return kinds


def profile_row(per_kernel: dict, steps: int, kinds: dict, top: int = 25, **extra) -> dict:
    """One JSON line of a profile (``bench: "train_profile"``): the per-kind sums, the ``top``
    kernels ``[ms per step, calls per step, kind, name]`` and ``extra`` (rank, timeline, host
    waits, command ...) — what a device call brings back instead of the traces."""
    steps = max(1, steps)
    kernels = [[round(us / 1e3 / steps, 3), round(n / steps, 1), kind_of(name), name[:160]]
               for name, (us, n) in sorted(per_kernel.items(), key=lambda x: -x[1][0])[:top]]
    return {"bench": "train_profile", "steps": steps, "by_kind_ms": kinds,
            "top_kernels": kernels, "date": time.strftime("%Y-%m-%d"), **extra}


def append_row(path: Optional[str], row: dict) -> None:
    """Append ``row`` to ``path`` (``{rank}`` in it: this rank's file), when given."""
    if path:
        with open(path.replace("{rank}", str(row.get("rank", 0))), "a") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")


def analyze(path: str, steps: int, out: Optional[str] = None) -> dict:
    """The tables of a trace written elsewhere, over its profiled ``steps`` (the wall: from
    the first to the last ``ProfilerStep#`` event's end, else the kernels' span); returns
    the timeline."""
    events = trace_events(path)                 # parsed once: traces run to 100s of MB
    kernels = trace_kernels(events)
    per_kernel: dict = {}
    for a, b, name in kernels:
        us, n = per_kernel.get(name, (0.0, 0))
        per_kernel[name] = (us + b - a, n + 1)
    marks = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events
             if str(e.get("name", "")).startswith("ProfilerStep#") and "ts" in e]
    span = marks or [(a, b) for a, b, _ in kernels] or [(0.0, 0.0)]
    wall_us = max(b for _, b in span) - min(a for a, _ in span)
    kinds = print_kinds(per_kernel, steps)
    line = timeline(kernels, wall_us, steps)
    by_op = nccl_exposed_by_op(kernels, steps)
    edge = step_boundary(kernels)
    waits = host_syncs(events, steps)
    print(f"{path}: timeline per step (ms; compute + nccl_exposed + idle = wall "
          f"{wall_us / 1e3 / max(1, steps):.1f}): " + json.dumps(line))
    print(f"{path}: NCCL nothing hid, by collective, per step (ms): " + json.dumps(by_op))
    print(f"{path}: between the steps (ms, last backward GEMM to first forward GEMM): "
          + json.dumps(edge))
    print(f"{path}: host waits for the GPU per step: " + json.dumps(waits))
    append_row(out, profile_row(per_kernel, steps, kinds, trace=path, timeline_ms=line,
                                nccl_exposed_by_op_ms=by_op, boundary_ms=edge,
                                wall_ms=round(wall_us / 1e3 / max(1, steps), 2),
                                host_waits=waits))
    return line


def main() -> None:
    if "--analyze" in sys.argv[1:]:
        q = argparse.ArgumentParser(description="the tables of traces written elsewhere")
        q.add_argument("--analyze", nargs="+", required=True, metavar="TRACE")
        q.add_argument("--steps", type=int, required=True, help="profiled steps in each trace")
        q.add_argument("--out", metavar="FILE.jsonl", help="append a JSON line per trace")
        a = q.parse_args()
        for path in a.analyze:
            analyze(path, a.steps, a.out)
        return
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)   # the rest: train.py
    p.add_argument("--profile-skip", type=int, default=2)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--trace", metavar="FILE.json",
                   help="write the Chrome trace there and print where each step's wall time "
                        "went on this GPU: compute, NCCL alone, NCCL beside compute, idle")
    p.add_argument("--out", metavar="FILE.jsonl",
                   help="append this rank's profile as a JSON line (per-kind sums, the top "
                        "kernels, the timeline and host waits with --trace; {rank} in the "
                        "name: a file per rank)")
    p.add_argument("--cuda-only", action="store_true",
                   help="profile GPU activity only (no host-side op events: the profiler's "
                        "own host cost, which makes small steps host-bound, mostly goes)")
    ours, argv = p.parse_known_args(sys.argv[1:])
    skip, active = ours.profile_skip, ours.profile_steps
    acts = [torch.profiler.ProfilerActivity.CUDA] + (
        [] if ours.cuda_only else [torch.profiler.ProfilerActivity.CPU])
    prof = torch.profiler.profile(activities=acts, schedule=torch.profiler.schedule(
        wait=max(0, skip - 1), warmup=1 if skip else 0, active=active, repeat=1))
    step_fn = train.train_step
    starts, ends = [], []

    def profiled_step(*a, **kw):       # train.main looks train_step up per call
        # a sync only at the profiled window's edges: between its steps the host runs ahead
        # as in a real run (a sync there would make each step's boundary wait for the
        # parameters' gathers and the next step's data)
        i = len(starts)
        if i == skip == 0:
            torch.cuda.synchronize()
        starts.append(time.perf_counter())
        out = step_fn(*a, **kw)
        if i in (skip - 1, skip + active - 1):
            torch.cuda.synchronize()   # the window starts with nothing queued and ends with
            ends.append(time.perf_counter())     # its steps' kernels done
        prof.step()
        return out

    train.train_step = profiled_step
    with prof:
        train.main(argv)
    records = starts[skip:skip + active]
    if len(starts) < skip + active:     # the run ended inside the window (--train-iters short)
        torch.cuda.synchronize()
        ends.append(time.perf_counter())
    wall = (ends[-1] - starts[skip]) if len(starts) > skip else 0.0
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"
              and not e.key.startswith("ProfilerStep")]      # the profiler's step marker
    total_us = sum(e.device_time_total for e in events)
    steps = max(1, len(records))
    per_kernel = {e.key: (e.device_time_total, e.count) for e in events}
    kinds = print_kinds(per_kernel, steps)
    print(f"profiled steps {len(records)} | wall {wall:.2f} s | CUDA kernel time "
          f"{total_us / 1e6:.2f} s (the gap: the GPU waiting on the host)")
    rank = os.environ.get("RANK", "0")
    extra = dict(rank=int(rank), world=int(os.environ.get("WORLD_SIZE", "1")),
                 wall_ms=round(wall * 1e3 / steps, 2), device=torch.cuda.get_device_name(),
                 command="benchmarks/train_profile.py " + " ".join(sys.argv[1:]))
    if ours.trace:
        path = ours.trace.replace("{rank}", rank)
        prof.export_chrome_trace(path)
        events = trace_events(path)
        kernels = trace_kernels(events)
        extra["timeline_ms"] = timeline(kernels, wall * 1e6, steps)
        extra["nccl_exposed_by_op_ms"] = nccl_exposed_by_op(kernels, steps)
        extra["boundary_ms"] = step_boundary(kernels)
        extra["host_waits"] = host_syncs(events, steps)
        print(f"rank {rank} timeline per step (ms; compute + nccl_exposed + idle = wall "
              f"{wall * 1e3 / steps:.1f}): " + json.dumps(extra["timeline_ms"]))
        print(f"rank {rank} NCCL nothing hid, by collective, per step (ms): "
              + json.dumps(extra["nccl_exposed_by_op_ms"]))
        print(f"rank {rank} between the steps (ms, last backward GEMM to first forward GEMM): "
              + json.dumps(extra["boundary_ms"]))
        print(f"rank {rank} host waits for the GPU per step (idle within 1 ms after them, by "
              f"the op launched before): " + json.dumps(extra["host_waits"]))
    append_row(ours.out, profile_row(per_kernel, steps, kinds, **extra))


if __name__ == "__main__":
    main()

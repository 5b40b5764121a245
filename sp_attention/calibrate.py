"""Calibration probe: measure the cost model's figures on the GPUs at hand and save them.

    python -m sp_attention.calibrate                           # one GPU: the kernels
    torchrun --nproc-per-node 4 -m sp_attention.calibrate      # + NCCL links at P = 2 and 4,
                                                               #   the overlap cost at P = 4
    python -m sp_attention.calibrate --world 4                 # the same, spawning 4 processes

Measures the library's own ops at world size 1 (linear and softmax attention, fwd and fwd +
bwd, peak memory; element-wise bandwidth), the NCCL links (ring hops and all-gathers) among
the first 2, 4, … and all ranks, one softmax ``ring`` step across all ranks (the overlap cost
is the value at which the model's step equals it) and one linear step per layout (a CP
rank's kernel factors, likewise). The fits (:mod:`sp_attention.cost.fit`)
are checked before anything is written (:mod:`sp_attention.cost.plausible`: a rate above the
device's peak, a negative or absurd latency, a fwd + bwd no slower than its forward, a
non-finite number): an implausible fit is refused with a message naming each figure, nothing
is written, and the exit status is 1. Otherwise the :class:`~sp_attention.cost.Machine` goes
as JSON to ``--out`` (default :func:`~sp_attention.cost.calibration_path`:
``$SP_ATTENTION_CALIBRATION`` or ``~/.cache/sp_attention/calibration.json``) and the raw rows
as JSON lines to ``--jsonl``; the rows are printed either way. What it cannot measure keeps the
built-in figure: the inter-node link, the all-gather calls' overheads (and on one GPU the
links, the overlap cost and a CP rank's kernel factors). About a minute on warm caches.

Calibration is for GPUs: on a machine without one it says so and exits with status 2, writing
nothing (on CPU ``auto`` follows a fixed rule, :mod:`sp_attention.cost.choose`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .comm import all_gather_flat
from .context import build_sp_context
from .cost import (LinearShape, Machine, calibration_path, default_machine, linear_flops,
                   save_machine, softmax_flops)
from .cost.fit import fit_machine
from .linear import lightning_attention, release_cuda_graphs
from .sharding import shard_sequence
from .softmax import context_parallel_attention
from .testing import run_distributed
from .tuning import LinearTuning

__all__ = ["time_ms", "peak_bytes", "link_worlds", "probe_links", "probe_kernels",
           "probe_overlap", "probe_linear_steps", "main"]

_HOLD_CYCLES = 200_000_000      # a sleep kernel the host enqueues the timed calls behind
_DEV = "cuda"                   # what the probes run on ("cpu" only in the tests' dry run)
_LINK_SIZES = (2 ** 20, 2 ** 23, 2 ** 25, 2 ** 27)
_KERNEL_SHAPES = {"linear": dict(B=1, H=16, K=128, T=(8192, 16384, 32768)),
                  "softmax": dict(B=1, H=32, Hkv=8, D=128, T=(4096, 8192, 16384, 32768))}
_RING_SHAPE = dict(B=1, T_local=8192, H=32, Hkv=8, D=128)     # Llama-3-8B attention
_LINEAR_STEP = dict(B=1, T_local=16384, H=16, K=128, V=128)
NO_GPU = ("sp_attention.calibrate: calibration is for GPUs (the cost model is a GPU model) and "
          "this machine has none; nothing written. On CPU `auto` follows a fixed rule "
          "(sp_attention.cost.choose).")


def time_ms(fn: Callable[[], object], iters: int = 5, repeats: int = 5, warmup: int = 2,
            barrier: Optional[Callable[[], None]] = None) -> float:
    """ms per call on the GPU: the median over ``repeats`` of the mean of ``iters`` calls
    enqueued behind a sleep kernel (the GPU's own time, the host ahead as inside a model; CUDA
    events), each repeat after ``barrier`` (the ranks start together)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        if barrier:
            barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(_HOLD_CYCLES)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / iters)
    return statistics.median(out)


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


def _row(what: str, **kw) -> dict:
    return dict(bench="calibrate", what=what, device=_device_name(),
                torch=torch.__version__, date=time.strftime("%Y-%m-%d"), **kw)


def _device_name() -> str:
    return torch.cuda.get_device_name() if _DEV == "cuda" else _DEV


def _dtype() -> torch.dtype:
    return torch.bfloat16 if _DEV == "cuda" else torch.float32


def _barrier(group=None) -> None:
    dist.barrier(group=group,
                 device_ids=[torch.cuda.current_device()] if _DEV == "cuda" else None)


def _slowest(ms: float, group) -> float:
    t = torch.tensor([ms], dtype=torch.float64, device=_DEV)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def link_worlds(world: int) -> list[int]:
    """The group sizes the links are probed among: 2, 4, 8, … below ``world``, and ``world``."""
    sizes, p = [], 2
    while p < world:
        sizes.append(p)
        p *= 2
    return sizes + ([world] if world >= 2 else [])


def probe_links(group, sizes: Sequence[int] = _LINK_SIZES) -> list[dict]:
    """Ring hops (``batch_isend_irecv`` to the next rank, from the previous) and all-gathers of
    ``sizes`` bytes per rank among ``group``'s ranks, the slowest rank's time."""
    ctx = build_sp_context(group, layout="contiguous")
    rank, world = ctx.rank, ctx.world_size
    nxt, prv = ctx.global_ranks[(rank + 1) % world], ctx.global_ranks[(rank - 1) % world]

    rows = []
    for nbytes in sizes:
        x = torch.ones(nbytes // 4, device=_DEV)
        recv, out = torch.empty_like(x), torch.empty(world * x.numel(), device=_DEV)

        def hop():
            ops = [dist.P2POp(dist.isend, x, nxt, group), dist.P2POp(dist.irecv, recv, prv, group)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        for what, fn, moved in (("p2p", hop, nbytes),
                                ("all_gather", lambda: all_gather_flat(out, x, ctx),
                                 (world - 1) * nbytes)):
            ms = time_ms(fn, iters=10, repeats=5, barrier=lambda: _barrier(group))
            rows.append(_row(what, world=world, bytes=nbytes, bytes_moved=moved,
                             ms=_slowest(ms, group)))
    return rows


def _linear_rows(shapes: dict) -> list[dict]:
    B, H, K = shapes["B"], shapes["H"], shapes["K"]
    slopes = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)], device=_DEV)
    rows = []
    for T in shapes["T"]:
        g = torch.Generator(device=_DEV).manual_seed(T)
        q, k, v, do = (torch.randn(B, T, H, K, device=_DEV, dtype=_dtype(), generator=g)
                       * 0.1 for _ in range(4))
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))

        def fwd():
            with torch.no_grad():
                return lightning_attention(q, k, v, slopes)

        def fwd_bwd():
            return torch.autograd.grad(lightning_attention(q, k, v, slopes), (q, k, v), do)
        rows.append(_row("linear", B=B, T=T, H=H, K=K, V=K, dtype=str(_dtype())[6:],
                         ms_fwd=time_ms(fwd), ms_fwd_bwd=time_ms(fwd_bwd),
                         flops_fwd_bwd=linear_flops(LinearShape(B, T, H, K, K,
                                                                _dtype().itemsize)),
                         peak_bytes=peak_bytes(fwd_bwd, _DEV)))
    return rows


def _softmax_rows(shapes: dict) -> list[dict]:
    B, H, Hkv, D = shapes["B"], shapes["H"], shapes["Hkv"], shapes["D"]
    rows = []
    for T in shapes["T"]:
        g = torch.Generator(device=_DEV).manual_seed(T)
        q, do = (torch.randn(B, T, H, D, device=_DEV, dtype=_dtype(), generator=g)
                 for _ in range(2))
        k, v = (torch.randn(B, T, Hkv, D, device=_DEV, dtype=_dtype(), generator=g)
                for _ in range(2))
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))

        def fwd():
            with torch.no_grad():
                return context_parallel_attention(q, k, v)

        def fwd_bwd():
            return torch.autograd.grad(context_parallel_attention(q, k, v), (q, k, v), do)
        rows.append(_row("softmax", B=B, T=T, H=H, Hkv=Hkv, D=D, dtype=str(_dtype())[6:],
                         causal=True, ms_fwd=time_ms(fwd), ms_fwd_bwd=time_ms(fwd_bwd),
                         flops_fwd=softmax_flops(B, H, T, T, D, True),
                         peak_bytes=peak_bytes(fwd_bwd, _DEV)))
    return rows


def _memory_rows(n: int) -> list[dict]:
    x, y = torch.ones(n, device=_DEV), torch.ones(n, device=_DEV)
    a, s1, s2 = (torch.ones(8, device=_DEV), torch.ones(8, 1024, device=_DEV),
                 torch.ones(8, 1024, device=_DEV))
    ms = time_ms(lambda: y.add_(x), iters=10)
    # a small state combine, A·b1 + b2 (two ops and an allocation): the fixed cost per op
    op = time_ms(lambda: s1.mul(a[:, None]).add_(s2), iters=50) / 2
    return [_row("memory", bytes_moved=3 * 4 * n, ms=ms, op_ms=op)]


def probe_kernels(shapes: Optional[dict] = None) -> list[dict]:
    """Rows of the local kernels on this GPU (the library's own ops at world size 1: linear
    fwd and fwd + bwd, softmax likewise, peak memory) and of element-wise bandwidth (over
    ``memory_elems`` fp32 elements)."""
    shapes = shapes or _KERNEL_SHAPES
    return (_linear_rows(shapes["linear"]) + _softmax_rows(shapes["softmax"])
            + _memory_rows(shapes.get("memory_elems", 64 * 2 ** 20)))


def probe_overlap(group, shape: Optional[dict] = None) -> dict:
    """One softmax ``ring`` fwd + bwd across ``group`` (zigzag, bf16; default: Llama-3-8B
    attention at 8K tokens per rank), the slowest rank's time: the row the overlap cost is
    fitted to."""
    s = dict(_RING_SHAPE, **(shape or {}))
    ctx = build_sp_context(group, layout="zigzag")
    T = ctx.world_size * s["T_local"]
    g = torch.Generator(device=_DEV).manual_seed(T)       # the same tensors on every rank
    full = [torch.randn(s["B"], T, h, s["D"], device=_DEV, dtype=_dtype(), generator=g)
            for h in (s["H"], s["Hkv"], s["Hkv"], s["H"])]
    q, k, v, do = (shard_sequence(t, ctx, 1).contiguous() for t in full)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))

    def step():
        return torch.autograd.grad(context_parallel_attention(q, k, v, ctx=ctx, preset="ring"),
                                   (q, k, v), do)
    ms = time_ms(step, iters=5, repeats=5, barrier=lambda: _barrier(group))
    return _row("softmax_ring", world=ctx.world_size, itemsize=_dtype().itemsize,
                ms_fwd_bwd=_slowest(ms, group), **s)


def probe_linear_steps(group, shape: Optional[dict] = None, scan: str = "allgather") -> list:
    """One linear fwd + bwd across ``group`` per layout (``scan``, bf16; default: H 16, K = V
    128 at 16K tokens per rank), the slowest rank's time: the rows a CP rank's kernel factors
    are fitted to."""
    s = dict(_LINEAR_STEP, **(shape or {}))
    H = s["H"]
    slopes = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)], device=_DEV)
    g = torch.Generator(device=_DEV).manual_seed(dist.get_rank(group))
    q, k, do = (torch.randn(s["B"], s["T_local"], H, s["K"], device=_DEV,
                            dtype=_dtype(), generator=g) * 0.1 for _ in range(3))
    v = torch.randn(s["B"], s["T_local"], H, s["V"], device=_DEV, dtype=_dtype(),
                    generator=g) * 0.1
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    rows = []
    # contiguous as one row per rank, zigzag as its two leaves: the two kernel factors
    # (sp_attention.cost.linear.rank_factor)
    for layout, splits in (("contiguous", 1), ("zigzag", None)):
        ctx = build_sp_context(group, layout=layout)
        tuning = LinearTuning(row_splits=splits)

        def step(ctx=ctx, tuning=tuning):
            return torch.autograd.grad(lightning_attention(q, k, v, slopes, ctx=ctx, impl=scan,
                                                          tuning=tuning), (q, k, v), do)
        ms = time_ms(step, iters=5, repeats=5, barrier=lambda: _barrier(group))
        rows.append(_row("linear_step", world=ctx.world_size, layout=layout, scan=scan,
                         itemsize=_dtype().itemsize, ms_fwd_bwd=_slowest(ms, group),
                         row_splits=splits, **s))
    return rows


def _probe_group(rank: int, world: int, shapes: Optional[dict] = None) -> tuple[list, list, list]:
    """Every rank's part: the links among the first 2, 4, … ranks, the kernels (each rank on
    its own GPU at once; rank 0's rows kept), the softmax ring step and the linear steps
    across all. Rows from rank 0. ``shapes`` (the tests' dry run): ``sizes``, ``kernels``,
    ``ring``, ``linear`` instead of the defaults."""
    shapes = shapes or {}
    link_rows = []
    for size in link_worlds(world):
        group = dist.new_group(list(range(size)))        # every rank creates every group
        if rank < size:
            link_rows += probe_links(group, shapes.get("sizes", _LINK_SIZES))
    kernel_rows = probe_kernels(shapes.get("kernels"))
    _barrier()
    step_rows = []
    if world > 1:
        group = dist.new_group(list(range(world)))
        step_rows = ([probe_overlap(group, shapes.get("ring"))]
                     + probe_linear_steps(group, shapes.get("linear")))
    return (link_rows, kernel_rows, step_rows) if rank == 0 else ([], [], [])


def _measure(world_arg: int) -> tuple[int, list, list, list]:
    """(rank, rows): under torchrun every rank probes; otherwise ``world_arg`` spawned
    processes (one per GPU), or this process alone on one GPU."""
    if "RANK" in os.environ:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
        rank, world = dist.get_rank(), dist.get_world_size()
        rows = _probe_group(rank, world) if world > 1 else ([], probe_kernels(), [])
        _barrier()
        return rank, world, *rows
    world = min(world_arg, torch.cuda.device_count())
    if world < 2:
        return 0, 1, [], probe_kernels(), []
    return 0, world, *run_distributed(_probe_group, world, backend="nccl", timeout=1200)[0]


def _finish(rank: int, world: int, rows: tuple, a, device: str) -> Optional[Machine]:
    """Rank 0: fit ``rows`` (links, kernels, CP steps) measured on ``device``, check, write
    (or refuse: exit status 1); every rank learns the outcome. Returns the machine (rank 0,
    accepted) or None."""
    machine, problems = None, []
    if rank == 0:
        link_rows, kernel_rows, step_rows = rows
        for r in (*link_rows, *kernel_rows, *step_rows):
            print(json.dumps(r, sort_keys=True), flush=True)
        links = f"links among {link_worlds(world)} ranks" if link_rows else "links: defaults"
        source = (f"python -m sp_attention.calibrate, {time.strftime('%Y-%m-%d')}, torch "
                  f"{torch.__version__}; {links}; inter-node: default, not measured")
        machine, problems = fit_machine(default_machine(device), device, link_rows,
                                        kernel_rows, step_rows, source)
    if dist.is_initialized():           # the same exit status on every rank
        flag = torch.tensor([len(problems)], device=_DEV)
        dist.broadcast(flag, 0)
        problems = problems or (["see rank 0"] if int(flag.item()) else [])
        release_cuda_graphs()           # a live graph holding NCCL blocks the destroy
        dist.destroy_process_group()
    if problems:
        if rank == 0:
            print("sp_attention.calibrate: refused, nothing written; implausible:\n  "
                  + "\n  ".join(problems), file=sys.stderr)
        raise SystemExit(1)
    if rank:
        return None
    if a.jsonl:
        with open(a.jsonl, "a") as f:
            for r in (*rows[0], *rows[1], *rows[2]):
                f.write(json.dumps(r, sort_keys=True) + "\n")
    path = save_machine(machine, a.out)
    print(f"sp_attention.calibrate: wrote {path} ({machine.source})", file=sys.stderr)
    return machine


def main(argv: Optional[Sequence[str]] = None) -> Optional[Machine]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda (the only device calibrated; cpu explains why and exits 2)")
    p.add_argument("--out", help="calibration JSON (default: " + calibration_path() + ")")
    p.add_argument("--jsonl", help="append the raw measurements as JSON lines to this file")
    p.add_argument("--world", type=int, default=1,
                   help="GPUs to spawn one process each for when not under torchrun (links, "
                        "overlap; at most the GPUs present)")
    a = p.parse_args(argv)
    if a.device != "cuda" or not torch.cuda.is_available():
        print(NO_GPU, file=sys.stderr)
        raise SystemExit(2)
    rank, world, *rows = _measure(a.world)
    return _finish(rank, world, tuple(rows), a, torch.cuda.get_device_name())


if __name__ == "__main__":
    main()

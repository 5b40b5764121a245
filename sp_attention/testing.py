"""Test helpers: a gloo spawn harness that never hangs, relative-RMS comparison, seeded
factories, Megatron-style process-group layouts and rank gathers.

Used by the test suite and by anyone validating a new schedule on CPU::

    def check(rank, world):            # module-level so spawn can import it
        group = dist.new_group(list(range(world)))
        ctx = build_sp_context(group, layout="zigzag")
        ...
    run_distributed(check, world_size=4)
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["run_distributed", "WorkerError", "assert_close", "rel_rms", "seeded",
           "megatron_groups", "gather_objects"]


class WorkerError(RuntimeError):
    """A spawned rank raised; the message carries its rank and traceback."""


def _worker(fn, rank, world, init_file, args, results, timeout_s, backend):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=max(1, int(timeout_s))))
        out = fn(rank, world, *args)
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException as e:  # noqa: BLE001 - everything must reach the parent
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - teardown after a failure is best effort
                pass


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any,
                    timeout: float = 120.0, backend: str = "gloo") -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes (gloo on CPU; with
    ``backend="nccl"`` one GPU per rank).

    Returns the list of return values by rank. If any rank raises, raises
    :class:`WorkerError` with that rank's traceback (the first failure, others listed). If the
    ranks do not all finish within ``timeout`` seconds (a rank skipped a collective, a
    deadlock), kills them and raises ``TimeoutError`` naming the ranks still running.
    ``fn`` and ``args`` must be picklable (define ``fn`` at module level).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    spawn = mp.get_context("spawn")
    results = spawn.Queue()
    with tempfile.TemporaryDirectory(prefix="sp_dist_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [spawn.Process(target=_worker, daemon=True,
                               args=(fn, r, world_size, init_file, args, results, timeout, backend))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        got: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(got) < world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(world_size)) - set(got))
                    errors = [f"rank {r}: {m}" for r, (s, m) in got.items() if s == "error"]
                    raise TimeoutError(
                        f"ranks {missing} of {world_size} did not finish within {timeout:.0f} s "
                        "(a rank skipped or reordered a collective?)"
                        + ("\n" + "\n".join(errors) if errors else ""))
                try:
                    rank, status, payload = results.get(timeout=min(left, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs)
                            if r not in got and not p.is_alive() and p.exitcode not in (0, None)]
                    if dead:
                        r = dead[0]
                        raise WorkerError(f"rank {r} died with exit code {procs[r].exitcode} "
                                          "before reporting")
                    continue
                got[rank] = (status, payload)
                if status == "error":
                    # Give the others a moment to report their own failures, then stop.
                    others = _drain(results, got, world_size, 2.0)
                    msg = f"rank {rank} of {world_size} raised:\n{payload}"
                    if others:
                        msg += "\nother failing ranks: " + ", ".join(map(str, others))
                    raise WorkerError(msg)
        finally:
            for p in procs:
                if p.is_alive():
                    p.join(timeout=0.5 if len(got) < world_size else 10)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
    return [pickle.loads(got[r][1]) for r in range(world_size)]


def _drain(results, got: dict, world: int, wait: float) -> list:
    end = time.monotonic() + wait
    failing = []
    while len(got) < world and time.monotonic() < end:
        try:
            rank, status, payload = results.get(timeout=max(0.05, end - time.monotonic()))
        except queue.Empty:
            break
        got[rank] = (status, payload)
        if status == "error":
            failing.append(rank)
    return failing


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖₂ / ‖expected‖₂ in fp64 (absolute when the reference is 0)."""
    a = actual.detach().to(torch.float64).cpu()
    e = expected.detach().to(torch.float64).cpu()
    den = e.norm().item()
    num = (a - e).norm().item()
    return num / den if den > 0 else num


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-10,
                 name: str = "tensor") -> float:
    """Assert equal shapes, no NaN/inf in ``actual``, and relative RMS error ≤ ``rtol``."""
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected "
                             f"{tuple(expected.shape)}")
    if not torch.isfinite(actual).all():
        bad = (~torch.isfinite(actual)).sum().item()
        raise AssertionError(f"{name}: {bad} non-finite values (NaN/inf)")
    err = rel_rms(actual, expected)
    if not err <= rtol:
        raise AssertionError(f"{name}: relative RMS error {err:.3e} > {rtol:.1e}")
    return err


def seeded(shape: Sequence[int], seed: int, dtype: torch.dtype = torch.float64,
           scale: float = 1.0, device=None) -> torch.Tensor:
    """Deterministic normal tensor, identical on every rank for the same seed."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tuple(shape), generator=g, dtype=torch.float64) * scale).to(
        dtype=dtype, device=device)


def megatron_groups(tp: int, cp: int, dp: int) -> dict:
    """Create TP, CP and DP groups laid out as Megatron does (order tp-cp-dp, TP innermost):
    global rank = tp_rank + tp·(cp_rank + cp·dp_rank). CP groups are therefore *not*
    contiguous global ranks when tp > 1. Every rank must call this (group creation is
    collective). Returns this rank's ``{"tp", "cp", "dp"}`` groups and their rank lists."""
    world = dist.get_world_size()
    if tp * cp * dp != world:
        raise ValueError(f"tp·cp·dp = {tp * cp * dp} != world size {world}")
    me = dist.get_rank()
    out: dict = {}

    def rank_of(t, c, d):
        return t + tp * (c + cp * d)

    layouts = {
        "tp": [[rank_of(t, c, d) for t in range(tp)] for d in range(dp) for c in range(cp)],
        "cp": [[rank_of(t, c, d) for c in range(cp)] for d in range(dp) for t in range(tp)],
        "dp": [[rank_of(t, c, d) for d in range(dp)] for c in range(cp) for t in range(tp)],
    }
    for name, groups in layouts.items():
        for ranks in groups:
            g = dist.new_group(ranks)
            if me in ranks:
                out[name], out[name + "_ranks"] = g, ranks
    return out


def gather_objects(obj: Any, group: Optional[dist.ProcessGroup] = None) -> list:
    """Every rank's ``obj`` (picklable), in group-rank order; for comparing results across
    ranks inside a test (not for the hot path)."""
    if not dist.is_initialized():
        return [obj]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out

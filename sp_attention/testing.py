"""Test helpers: a gloo process harness that never hangs, relative-RMS comparison, seeded
factories, Megatron-style process-group layouts and rank gathers.

Used by the test suite and by anyone validating a new schedule on CPU::

    def check(rank, world):            # module-level so a rank can import it
        group = dist.new_group(list(range(world)))
        ctx = build_sp_context(group, layout="zigzag")
        ...
    run_distributed(check, world_size=4)
"""
from __future__ import annotations

import datetime
import functools
import multiprocessing as mp
import os
import pickle
import queue
import signal
import subprocess
import tempfile
import time
import traceback
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .linear.scan_common import release_cuda_graphs

__all__ = ["run_distributed", "WorkerError", "assert_close", "rel_rms", "seeded",
           "megatron_groups", "gather_objects", "Stall", "run_process", "finish_process",
           "spin_cap"]


class WorkerError(RuntimeError):
    """A rank raised; the message carries its rank and traceback."""


# ---------------------------------------------------------------------------- hang detection
# A test's time limit must catch a hang, not a busy machine: on a shared 2-core CI machine a
# spawn can take several times as long as on a quiet one. So the limits here count the seconds
# in which the processes concerned made no progress: none of them ran on a CPU (a rank blocked
# in a collective or a deadlocked wait sleeps; a slow process on a loaded machine still runs,
# only less often), read from /proc on Linux. A process that keeps running without end (a spin,
# no deadlock) meets a wall-clock cap of SPIN_FACTOR × the limit, at least SPIN_MIN_S. Without
# /proc the limit is wall-clock, as it then cannot tell the two apart.
SPIN_FACTOR = 8
SPIN_MIN_S = 1800.0
_BUSY_CPU_S = 0.15    # CPU seconds of one process within _WINDOW_S that count as progress:
_WINDOW_S = 6.0       # 2.5 % of a core (blocked in gloo: ~0.3 %; torchrun's agent polling its
#                       workers: ~0.2 %; runnable on 2 cores under load 40: ~5 %)
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def spin_cap(limit: float) -> float:
    """The wall-clock cap of a hang-detecting ``limit``: ``max(SPIN_FACTOR · limit,
    SPIN_MIN_S)`` (it only stops a process that never stops running)."""
    return max(SPIN_FACTOR * float(limit), SPIN_MIN_S)


def _stat(pid: int) -> Optional[list]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):      # gone meanwhile
        return None


def _with_descendants(pids: Sequence[int]) -> list:
    """``pids`` and every live process below them (one scan of /proc)."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                parent[int(entry)] = int(st[1])
    out, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += [c for c, pp in parent.items() if pp == pid and c not in out]
    return out


class Stall:
    """Seconds without progress of some processes: ``expired()`` (call it about once a second)
    returns why the ``limit`` is reached, or None. Progress: one of them (``tree``: or a process
    below them) used ``_BUSY_CPU_S`` CPU seconds within the last ``_WINDOW_S`` seconds; the
    wall-clock cap is :func:`spin_cap`. Without /proc: ``limit`` of wall-clock."""

    def __init__(self, limit: float, pids: Callable[[], Sequence[int]], tree: bool = False):
        self.limit, self.pids, self.tree = float(limit), pids, tree
        self.start = self.last = time.monotonic()
        self.procfs = os.path.isdir("/proc/self") and os.path.exists("/proc/self/stat")
        self.samples: list = []           # (time, {pid: cpu seconds})

    def _cpu(self) -> dict:
        pids = list(self.pids())
        out = {}
        for pid in (_with_descendants(pids) if self.tree else pids):
            st = _stat(pid)
            if st is not None:
                out[pid] = (int(st[11]) + int(st[12])) / _CLK_TCK
        return out

    def expired(self) -> Optional[str]:
        now = time.monotonic()
        if not self.procfs:
            return (f"did not finish within {self.limit:.0f} s"
                    if now - self.start > self.limit else None)
        cpu = self._cpu()
        self.samples = [x for x in self.samples if now - x[0] <= _WINDOW_S] + [(now, cpu)]
        then = self.samples[0][1]
        if any(c - then.get(pid, c) >= _BUSY_CPU_S for pid, c in cpu.items()):
            self.last = now
        if now - self.last > self.limit:
            return f"made no progress (no CPU time) for {self.limit:.0f} s"
        if now - self.start > spin_cap(self.limit):
            return f"kept running for {spin_cap(self.limit):.0f} s"
        return None


def kill_tree(p: subprocess.Popen) -> None:
    """SIGKILL ``p`` and every process below it (torchrun's workers run in sessions of their
    own: killing torchrun alone leaves them holding their GPUs)."""
    pids = _with_descendants([p.pid]) if os.path.isdir("/proc/self") else [p.pid]
    for pid in reversed(pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def finish_process(p: subprocess.Popen, timeout: float) -> tuple:
    """``p.communicate()`` whose ``timeout`` is a hang detector (:class:`Stall` over ``p`` and
    every process below it): ``(stdout, stderr)``; on a hang the process tree is killed and
    ``subprocess.TimeoutExpired`` raised with the output so far."""
    stall = Stall(timeout, lambda: [p.pid], tree=True)
    while True:
        try:
            return p.communicate(timeout=1.0)
        except subprocess.TimeoutExpired:
            why = stall.expired()
            if why is not None:
                kill_tree(p)
                out, err = p.communicate()
                raise subprocess.TimeoutExpired(p.args, timeout, output=out, stderr=err) \
                    from RuntimeError(f"the process {why}")


def run_process(cmd, *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, **kwargs)`` with ``timeout`` a
    hang detector (:func:`finish_process`), not a wall-clock limit."""
    kwargs.setdefault("text", True)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)
    out, err = finish_process(p, timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


@functools.lru_cache(maxsize=1)
def _processes():
    """The multiprocessing context of :func:`run_distributed`: a fork server that has imported
    torch once, so a rank starts in ~10 ms instead of importing torch anew (~1-2 s a rank on
    a CI core; hundreds of ranks a test suite). Nothing in it has touched CUDA, threads or
    the environment of a test: each rank takes the caller's environment as it is at the
    call (:func:`_worker`)."""
    if "forkserver" not in mp.get_all_start_methods():      # not a POSIX system: spawn
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])   # read when it first starts
    return ctx


def _worker(fn, rank, world, init_file, args, results, timeout_s, backend, env):
    # the fork server's environment is the caller's at its start: take the call's (as spawn
    # did), e.g. a variable a test set since
    os.environ.clear()
    os.environ.update(env)
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
                release_cuda_graphs()   # a live graph holding NCCL blocks the destroy
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - teardown after a failure is best effort
                pass


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any,
                    timeout: float = 120.0, backend: str = "gloo") -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes (gloo on CPU; with
    ``backend="nccl"`` one GPU per rank).

    Returns the list of return values by rank. If any rank raises, raises
    :class:`WorkerError` with that rank's traceback (the first failure, others listed). If the
    ranks still running make no progress for ``timeout`` seconds (a rank skipped a collective,
    a deadlock: :class:`Stall`, so a busy machine slows a spawn down but never fails it), kills
    them and raises ``TimeoutError`` naming them. gloo's own collective timeout is then the
    spin cap (:func:`spin_cap`): a rank waiting on a slow peer is not an error. With
    ``backend="nccl"`` (ranks blocked on a GPU may spin on their CPU) ``timeout`` is wall-clock,
    for the collectives too. ``fn`` and ``args`` must be picklable (define ``fn`` at module
    level).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    processes = _processes()
    results = processes.Queue()
    with tempfile.TemporaryDirectory(prefix="sp_dist_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        got: dict[int, tuple] = {}
        procs: list = []
        stall = Stall(timeout, lambda: [p.pid for r, p in enumerate(procs)
                                        if r not in got and p.pid is not None])
        if backend == "nccl":
            stall.procfs = False            # wall-clock (see the docstring)
        pg_timeout = timeout if not stall.procfs else spin_cap(timeout)
        procs += [processes.Process(target=_worker, daemon=True,
                                    args=(fn, r, world_size, init_file, args, results,
                                          pg_timeout, backend, dict(os.environ)))
                  for r in range(world_size)]
        for p in procs:
            p.start()
        try:
            while len(got) < world_size:
                why = stall.expired()
                if why is not None:
                    missing = sorted(set(range(world_size)) - set(got))
                    errors = [f"rank {r}: {m}" for r, (s, m) in got.items() if s == "error"]
                    raise TimeoutError(
                        f"ranks {missing} of {world_size} {why} "
                        "(a rank skipped or reordered a collective?)"
                        + ("\n" + "\n".join(errors) if errors else ""))
                try:
                    rank, status, payload = results.get(timeout=1.0)
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

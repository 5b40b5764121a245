"""Per-round timing of the linear tree scan on CPU/gloo: where its time goes as P grows.

    OMP_NUM_THREADS=1 python benchmarks/scan_rounds.py --max-world 8 --out FILE.jsonl

For P = 2 … ``--max-world`` (one spawn, groups of the first P ranks, zigzag), each rank runs
:func:`~sp_attention.linear.scan_blelloch.blelloch_scan` ``--reps`` times (each after a
barrier) and records how long each round took on it (posting, waiting, unpacking). Rows: per P
and round, the round's messages (host total) and the busiest rank's, and over the repetitions
the median of the slowest rank's round time and of the mean over ranks; plus the whole scan
(fastest and median call). For the cost model's tree-scan term (issue 27).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import emit  # noqa: E402
from sp_attention import build_sp_context  # noqa: E402
from sp_attention.cost.linear import _round_messages  # noqa: E402
from sp_attention.layout import (holder_of_leaf, num_chunks, scan_position,  # noqa: E402
                                 tree_scan_schedule)
from sp_attention.linear import scan_blelloch  # noqa: E402


def worker(rank: int, world: int, a) -> list:
    torch.set_num_threads(1)
    out = []
    real = scan_blelloch._round
    times: list = []

    def timed(*args, **kw):
        t0 = time.perf_counter()
        real(*args, **kw)
        times.append(time.perf_counter() - t0)
    scan_blelloch._round = timed
    for P in range(2, world + 1):
        group = dist.new_group(list(range(P)))
        if rank < P:
            ctx = build_sp_context(group, layout="zigzag")
            n = len(ctx.leaves)
            A = [torch.rand(1, 4) for _ in range(n)]
            b = [torch.randn(1, 4, 32, 32) for _ in range(n)]
            per_rep, whole = [], []
            for i in range(a.reps + 3):
                dist.barrier(group=group)
                times.clear()
                t0 = time.perf_counter()
                scan_blelloch.blelloch_scan(A, b, ctx)
                if i >= 3:
                    whole.append((time.perf_counter() - t0) * 1e3)
                    per_rep.append([t * 1e3 for t in times])
            gathered = [None] * P
            dist.all_gather_object(gathered, (per_rep, whole), group=group)
            if rank == 0:
                L = num_chunks(P, "zigzag")
                sched = tree_scan_schedule(L)
                holder = [holder_of_leaf(scan_position(p, L, False), P, "zigzag")
                          for p in range(L)]
                rounds = sched.up + sched.down
                for j, pairs in enumerate(rounds):
                    msgs = _round_messages(holder, pairs, down=j >= len(sched.up))
                    ops: dict = {}
                    for s_, d_ in msgs:
                        ops[s_] = ops.get(s_, 0) + 1
                        ops[d_] = ops.get(d_, 0) + 1
                    slow = [max(g[0][i][j] for g in gathered) for i in range(a.reps)]
                    mean = [statistics.mean(g[0][i][j] for g in gathered) for i in range(a.reps)]
                    out.append(dict(bench="scan_rounds", world=P, round=j, msgs=len(msgs),
                                    busiest=max(ops.values()) if ops else 0,
                                    ms_slowest_rank=statistics.median(slow),
                                    ms_mean_rank=statistics.median(mean)))
                w = gathered[0][1]
                out.append(dict(bench="scan_rounds", world=P, round="all", ms_min=min(w),
                                ms_median=statistics.median(w)))
        dist.barrier()
    return out


def main() -> None:
    from sp_attention.testing import run_distributed
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-world", type=int, default=8)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--out")
    a = p.parse_args()
    for r in run_distributed(worker, a.max_world, a, timeout=1800.0)[0]:
        emit(r, a.out, 0)


if __name__ == "__main__":
    main()

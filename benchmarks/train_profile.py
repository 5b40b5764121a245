"""Where a train.py step's GPU time goes: runs ``train.main(argv)`` under the torch profiler and
prints the CUDA kernels by total time, the summed kernel time and the wall time (their gap is
the time the GPU waited on the host).

    python benchmarks/train_profile.py --preset 1b --train-iters 6 --micro-batch-size 4 \\
        --global-batch-size 16 --no-progress-bar --log-dir /tmp/prof
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402


def main() -> None:
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        records = train.main(sys.argv[1:])
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    total_us = sum(e.device_time_total for e in events if e.device_type.name == "CUDA")
    print(events.table(sort_by="device_time_total", row_limit=40, max_name_column_width=70))
    print(f"steps {len(records)} | wall {wall:.1f} s | CUDA kernel time {total_us / 1e6:.1f} s")


if __name__ == "__main__":
    main()

"""Where a train.py step's GPU time goes: runs ``train.main(argv)`` under the torch profiler and
prints the CUDA kernels by total time, the time per kind of kernel (GEMM, attention,
cross-entropy, norm, RoPE, optimizer, other element-wise, copies), the summed kernel time and
the wall time (their gap is the time the GPU waited on the host).

    python benchmarks/train_profile.py --preset 1b --train-iters 6 --micro-batch-size 4 \\
        --global-batch-size 16 --no-progress-bar --log-dir /tmp/prof
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402

# first match wins; matched against the lower-cased kernel name
KINDS = (
    ("gemm", ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas", "matmul")),
    ("attention", ("flash", "fmha", "cudnn", "attn", "chunk_", "sp_attention")),
    ("cross_entropy", ("cross_entropy", "log_softmax", "logsumexp", "nll_loss", "softmax")),
    ("norm", ("rms", "norm")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("copy", ("copy", "memcpy", "memset", "cat", "transpose", "contiguous")),
    ("elementwise", ("elementwise", "vectorized", "triton", "reduce", "fused")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def main() -> None:
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        records = train.main(sys.argv[1:])
    wall = time.perf_counter() - t0
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total_us = sum(e.device_time_total for e in events)
    by_kind: dict = {}
    for e in events:
        k = kind_of(e.key)
        by_kind[k] = by_kind.get(k, 0.0) + e.device_time_total
    steps = max(1, len(records))
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=40,
                                    max_name_column_width=90))
    print(f"steps {len(records)} | wall {wall:.1f} s | CUDA kernel time {total_us / 1e6:.2f} s")
    print("per step (ms) by kind: " + json.dumps(
        {k: round(v / 1e3 / steps, 1) for k, v in sorted(by_kind.items(), key=lambda x: -x[1])}))


if __name__ == "__main__":
    main()

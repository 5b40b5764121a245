"""Seconds from process start to the first finished linear-attention step on a fresh GPU machine.

A fresh machine has an empty Triton cache, so fla's kernels autotune (every config of every
kernel compiled and timed) before the first step finishes. This times, in one process, the
import and the first fwd+bwd of ``lightning_attention`` for each (dtype, head dim, layout)
the library and its models use, then a second call of each (already compiled: the steady
state). Run it with ``TRITON_CACHE_DIR`` pointing at an empty directory for the fresh-machine
figure, and at a directory holding only shipped autotune results to see what they save::

    TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/first_call.py --out first_call.jsonl

Prints one JSON line per case and a ``total`` line (the first-call figure of PERF.md).
"""
from __future__ import annotations

import argparse
import json
import os
import time

T0 = time.perf_counter()

import torch  # noqa: E402

from sp_attention import SPContext, lightning_attention  # noqa: E402


def _case(dtype: torch.dtype, head_dim: int, layout: str, t_local: int, heads: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (1, t_local, heads, head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, generator=g).requires_grad_()
               for _ in range(3))
    slopes = torch.linspace(0.0, 0.5, heads, device="cuda")
    ctx = SPContext(None, 0, 1, (0,), layout)   # one rank: zigzag still runs two leaves
    times = []
    for _ in range(2):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = lightning_attention(q, k, v, slopes, ctx=ctx, backend="fla")
        out.float().square().mean().backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return {"first_s": round(times[0], 3), "second_s": round(times[1], 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    p.add_argument("--layouts", nargs="+", default=["contiguous", "zigzag"])
    p.add_argument("--t-local", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--label", default="", help="free text stored in every row")
    p.add_argument("--out")
    a = p.parse_args()
    rows = []
    import_s = time.perf_counter() - T0
    for dt in a.dtypes:
        for d in a.head_dims:
            for layout in a.layouts:
                row = {"bench": "first_call", "dtype": dt, "K": d, "V": d, "layout": layout,
                       "T_local": a.t_local, "H": a.heads, "label": a.label}
                row.update(_case(getattr(torch, dt), d, layout, a.t_local, a.heads))
                rows.append(row)
    rows.append({"bench": "first_call", "impl": "total", "label": a.label,
                 "import_s": round(import_s, 2),
                 "process_s": round(time.perf_counter() - T0, 2),
                 "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR", ""),
                 "device": torch.cuda.get_device_name(), "torch": torch.__version__})
    for row in rows:
        line = json.dumps(row)
        print(line, flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()

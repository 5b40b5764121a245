"""Benchmark: the LSE merge kernel's launch shapes on one GPU (query rows × heads per program
× warps), against the bytes it must move (read out, out_b and both LSEs, write out and the LSE).

    python benchmarks/merge_sweep.py [--rows 4096 8192] [--heads 32] [--head-dim 128]

Rows: ``out_dtype`` (the accumulator: bf16 when the ring's single merge goes straight into the
kernel output at P = 2, fp32 otherwise), ``block_t``, ``block_h``, ``num_warps``, ``us`` and
``gbps`` (bytes moved ÷ time). Shapes with ``block_t·block_h`` (rows of D per program) outside
``--pairs`` are skipped. The default launch shape is the row with ``default: true``.
"""
from __future__ import annotations

import inspect
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import base_parser, device_name, emit, time_ms  # noqa: E402
from sp_attention.softmax.merge_kernel import merge_blocks_triton  # noqa: E402

DEFAULTS = {k: v.default for k, v in inspect.signature(merge_blocks_triton).parameters.items()
            if v.kind is v.KEYWORD_ONLY}


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-t", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--block-h", type=int, nargs="+", default=[1, 4, 8, 32])
    p.add_argument("--num-warps", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--pairs", type=int, nargs=2, default=[8, 128], metavar=("MIN", "MAX"),
                   help="only shapes whose block_t·block_h lies in this range")
    a = p.parse_args()
    dev = a.device
    device = torch.device("cuda", 0) if dev == "cuda" else torch.device("cpu")
    H, D = a.heads, a.head_dim
    for T in a.rows:
        for out_dtype in (torch.bfloat16, torch.float32):
            g = torch.Generator(device=device).manual_seed(0)
            out = torch.randn(1, T, H, D, device=device, generator=g).to(out_dtype)
            ob = torch.randn(1, T, H, D, device=device, generator=g).to(torch.bfloat16)
            lse = torch.randn(1, H, T, device=device, generator=g)
            lb = torch.randn(1, H, T, device=device, generator=g)
            nbytes = out.numel() * out.element_size() * 2 + ob.numel() * 2 + lse.numel() * 12
            shapes = [(bt, bh, nw) for bt in a.block_t for bh in a.block_h
                      for nw in a.num_warps if a.pairs[0] <= bt * min(bh, H) <= a.pairs[1]]
            for bt, bh, nw in shapes:
                def fn(bt=bt, bh=bh, nw=nw):
                    merge_blocks_triton(out, lse, ob, lb, block_t=bt, block_h=bh, num_warps=nw)
                ms = time_ms(fn, dev, a.warmup, a.iters, a.repeats)
                emit({"bench": "merge_sweep", "device": device_name(dev), "rows": T, "H": H,
                      "D": D, "out_dtype": str(out_dtype).replace("torch.", ""), "block_t": bt,
                      "block_h": bh, "num_warps": nw, "us": ms * 1e3, "gbps": nbytes / ms / 1e6,
                      "default": (bt, bh, nw) == (DEFAULTS["block_t"], DEFAULTS["block_h"],
                                                  DEFAULTS["num_warps"])}, a.out, 0)


if __name__ == "__main__":
    main()

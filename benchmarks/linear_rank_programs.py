"""Benchmark: each rank's local GPU work in a contiguous P = 2 linear CP step, on ONE GPU.

    python benchmarks/linear_rank_programs.py [--t-local 32768]

The scan callbacks return prepared states instead of communicating, so each row is the GPU
time of one rank's kernels alone (queued timing): rank 0 (the sequence's first leaf: nothing
enters it) and rank 1 (its last leaf: no gradient arrives), forward and backward, with the
first/last-leaf shortcuts of `leaves_output` / `leaves_backward` on and off, the backward with
its two chunk recurrences on two streams and one after the other, next to fla's own forward
and backward on the same tokens. What it cannot show is the waiting between ranks;
`linear_cp.py` on two GPUs measures that.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import base_parser, device_name, emit, time_ms  # noqa: E402
from sp_attention import LinearTuning  # noqa: E402
from sp_attention.linear.leaves import leaves_backward, leaves_output  # noqa: E402


def main() -> None:
    a = base_parser(__doc__.splitlines()[0]).parse_args()
    from fla.ops.simple_gla import chunk_simple_gla
    dev = torch.device("cuda", 0)
    H, K = 16, 128
    slopes = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)], device=dev)
    for T in a.t_local or [32768]:
        g = torch.Generator(device=dev).manual_seed(11)
        q, k, v, do = (torch.randn(1, T, H, K, device=dev, dtype=torch.bfloat16, generator=g) * 0.1
                       for _ in range(4))
        S = torch.randn(1, H, K, K, device=dev, generator=g) * 0.01
        Z = torch.zeros_like(S)
        qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

        def fla_fb():
            o, _ = chunk_simple_gla(qg, kg, vg, g_gamma=-slopes, scale=1.0)
            o.backward(do)
        default = LinearTuning()
        flip = LinearTuning(concurrent_recurrences=not default.concurrent_recurrences)

        def rows(tuning):
            return {
                "rank0 fwd, shortcut": lambda: leaves_output(
                    q, k, v, slopes, 1.0, lambda b: Z, "fla", zero_in=True, tuning=tuning),
                "rank0 fwd, no shortcut": lambda: leaves_output(
                    q, k, v, slopes, 1.0, lambda b: Z, "fla", tuning=tuning),
                "rank1 fwd": lambda: leaves_output(q, k, v, slopes, 1.0, lambda b: S, "fla",
                                                   tuning=tuning),
                "rank0 bwd": lambda: leaves_backward(q, k, v, slopes, 1.0, Z, do, lambda d: S,
                                                     "fla", needed=(False,), tuning=tuning),
                "rank1 bwd, shortcut": lambda: leaves_backward(
                    q, k, v, slopes, 1.0, S, do, lambda d: Z, "fla", zero_grad=True,
                    tuning=tuning),
                "rank1 bwd, no shortcut": lambda: leaves_backward(
                    q, k, v, slopes, 1.0, S, do, lambda d: Z, "fla", tuning=tuning),
            }
        runs = [("fla fwd", lambda: chunk_simple_gla(q, k, v, g_gamma=-slopes, scale=1.0)),
                ("fla fwd+bwd", fla_fb)] + list(rows(default).items())
        tag = ", serial" if default.concurrent_recurrences else ", concurrent"
        runs += [(name + tag, fn) for name, fn in rows(flip).items() if "bwd" in name]
        for name, fn in runs:
            fn()
            torch.cuda.synchronize()
            ms = time_ms(fn, "cuda", a.warmup, a.iters, a.repeats, mode="queued")
            emit({"bench": "linear_rank_programs", "impl": name, "T_local": T, "H": H, "K": K,
                  "dtype": "bfloat16", "device": device_name("cuda"), "timing": "queued",
                  "ms": ms}, a.out, 0)


if __name__ == "__main__":
    main()

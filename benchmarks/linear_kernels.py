"""Benchmark: GPU and host time of each kernel of the linear-attention step on ONE GPU.

    python benchmarks/linear_kernels.py [--t-local 32768] [--out FILE]

Per piece: `ms` = GPU time per call with every call enqueued before the GPU starts them
(`time_ms(mode="queued")`: no host in the number), `host_us` = host time to enqueue one call
(`host_ms`), both on B 1, H 16, K = V 128, bf16. Pieces: fla's public `chunk_simple_gla`
(fwd, fwd+bwd), fla's internal kernels that the CP step calls (`chunk_fwd_h`, `chunk_fwd_o`,
`chunk_bwd_dh`, `chunk_bwd_dqkwg`, `chunk_bwd_dv`, with and without fla's backend dispatch
wrapper), our `output_from_states` and `decayed_state_sum` per tile shape and sequence split. The sum of the
pieces a rank runs is the GPU floor of a CP step; `host_us` shows what makes a lone layer
host-bound.
"""
from __future__ import annotations

import inspect
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import base_parser, device_name, emit, host_ms, time_ms  # noqa: E402
from sp_attention.linear.kernels import (OUTPUT_CANDIDATES, STATE_CANDIDATES,  # noqa: E402
                                         decayed_state_sum, output_from_states)


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--state-splits", type=float, nargs="*", default=[1, 4, 8],
                   help="also time every state-kernel config with the sequence split into "
                        "about this many pieces per SM per head (besides the default split)")
    a = p.parse_args()
    from fla.ops.common.chunk_h import chunk_bwd_dh, chunk_fwd_h
    from fla.ops.common.chunk_o import chunk_bwd_dqkwg, chunk_bwd_dv, chunk_fwd_o
    from fla.ops.simple_gla import chunk_simple_gla

    from sp_attention.linear.autotune_seeds import install_once
    install_once()      # fla's shipped Hopper autotune results: no minutes of fla autotuning
    dev = torch.device("cuda", 0)
    H, K = a.heads, a.head_dim
    slopes = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)], device=dev)
    gg = (-slopes / math.log(2)).float()
    for T in a.t_local or [32768]:
        g = torch.Generator(device=dev).manual_seed(3)
        q, k, v, do = (torch.randn(1, T, H, K, device=dev, dtype=torch.bfloat16, generator=g) * 0.1
                       for _ in range(4))
        qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
        S = torch.randn(1, H, K, K, device=dev) * 0.01
        h, _ = chunk_fwd_h(k=k, v=v, g_gamma=gg, h0=None, output_final_state=True)
        h32, _ = chunk_fwd_h(k=k, v=v, g_gamma=gg, h0=S, states_in_fp32=True)
        dh, _ = chunk_bwd_dh(q=q, k=k, v=v, do=do, h0=None, dht=S, scale=1.0, g_gamma=gg,
                             states_in_fp32=True)

        def fla_fb():
            o, _ = chunk_simple_gla(qg, kg, vg, g_gamma=-slopes, scale=1.0)
            o.backward(do)

        def raw(f):       # fla's function without its backend-dispatch wrapper
            return inspect.unwrap(f)

        pieces = {
            "fla public fwd": lambda: chunk_simple_gla(q, k, v, g_gamma=-slopes, scale=1.0),
            "fla public fwd+bwd": fla_fb,
            "chunk_fwd_h (zero start, end state)": lambda: chunk_fwd_h(
                k=k, v=v, g_gamma=gg, h0=None, output_final_state=True),
            "chunk_fwd_h, no dispatch wrapper": lambda: raw(chunk_fwd_h)(
                k=k, v=v, g_gamma=gg, h0=None, output_final_state=True),
            "chunk_fwd_h (from S_in, fp32 states)": lambda: chunk_fwd_h(
                k=k, v=v, g_gamma=gg, h0=S, states_in_fp32=True),
            "chunk_fwd_o (fla output)": lambda: chunk_fwd_o(q=q, k=k, v=v, h=h, g_gamma=gg,
                                                            scale=1.0),
            "output_from_states (ours)": lambda: output_from_states(q, k, v, h, S, gg, 1.0),
            "chunk_bwd_dh (dht given)": lambda: chunk_bwd_dh(
                q=q, k=k, v=v, do=do, h0=None, dht=S, scale=1.0, g_gamma=gg,
                states_in_fp32=True),
            "chunk_bwd_dqkwg": lambda: chunk_bwd_dqkwg(q=q, k=k, v=v, do=do, h=h32, dh=dh,
                                                       g_gamma=gg, scale=1.0),
            "chunk_bwd_dv": lambda: chunk_bwd_dv(q=q, k=k, do=do, dh=dh, g_gamma=gg, scale=1.0),
        }
        for i, c in enumerate(OUTPUT_CANDIDATES):
            pieces[f"output_from_states cfg{i} {c.kwargs} w{c.num_warps} s{c.num_stages}"] = (
                lambda i=i: output_from_states(q, k, v, h, S, gg, 1.0, 64, i))
        pieces["decayed_state_sum (autotuned)"] = lambda: decayed_state_sum(q, do, gg, 1, 1)
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        n_chunks = -(-T // 64)
        for i, c in enumerate(STATE_CANDIDATES):
            # the sequence split: the default (about 2 programs per SM per tile) and others
            for per_sm in (None,) + tuple(a.state_splits):
                splits = None if per_sm is None else max(1, min(n_chunks,
                                                                math.ceil(per_sm * sms / H)))
                name = f"decayed_state_sum cfg{i} {c.kwargs} w{c.num_warps} s{c.num_stages}"
                pieces[name + ("" if splits is None else f" splits{splits}")] = (
                    lambda i=i, splits=splits: decayed_state_sum(q, do, gg, 1, 1, splits,
                                                                 config=i))
        for name, fn in pieces.items():
            try:
                fn()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - e.g. a candidate out of shared memory
                emit({"bench": "linear_kernels", "impl": name, "T_local": T,
                      "error": f"{type(e).__name__}: {e}"[:300]}, a.out, 0)
                continue
            ms = time_ms(fn, "cuda", a.warmup, a.iters, a.repeats, mode="queued")
            emit({"bench": "linear_kernels", "impl": name, "T_local": T, "B": 1, "H": H, "K": K,
                  "V": K, "dtype": "bfloat16", "device": device_name("cuda"), "timing": "queued",
                  "ms": ms, "host_us": 1e3 * host_ms(fn, 20)}, a.out, 0)
        del q, k, v, do, qg, kg, vg, h, h32, dh


if __name__ == "__main__":
    main()

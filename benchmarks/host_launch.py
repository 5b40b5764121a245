"""Host cost per call (µs to enqueue, GPU queue drained first) of each piece of the CP linear
attention step on one GPU, next to fla's own calls: which launches make the step host-bound.

    python benchmarks/host_launch.py [--t-local 32768]
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import host_ms  # noqa: E402
from sp_attention import SPContext  # noqa: E402
from sp_attention.linear import lightning_attention  # noqa: E402
from sp_attention.linear.attention import leaf_rows, scan_rows  # noqa: E402
from sp_attention.linear.leaf import state_grad_local  # noqa: E402
from sp_attention.linear.leaves import leaves_backward, leaves_output  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--t-local", type=int, default=32768)
    a = p.parse_args()
    from fla.ops.common.chunk_h import chunk_fwd_h
    from fla.ops.simple_gla import chunk_simple_gla

    from sp_attention.linear.kernels import decayed_state_sum, output_from_states
    dev = torch.device("cuda", 0)
    T, H, K = a.t_local, 16, 128
    q, k, v, do = (torch.randn(1, T, H, K, device=dev, dtype=torch.bfloat16) * 0.1
                   for _ in range(4))
    slopes = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)], device=dev)
    gg = (-slopes / math.log(2)).float()
    zz = SPContext(None, 0, 1, (0,), "zigzag")
    qb, kb, vb, dob = (leaf_rows(t, 2) for t in (q, k, v, do))
    h, b = chunk_fwd_h(k=k, v=v, g_gamma=gg, h0=None, output_final_state=True)
    S = torch.zeros(1, H, K, K, device=dev)
    S2 = torch.zeros(2, H, K, K, device=dev)
    A2 = torch.ones(2, H, device=dev)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    side = torch.cuda.Stream()

    def switch():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            pass
        torch.cuda.current_stream().wait_stream(side)

    def fla_fb():
        o, _ = chunk_simple_gla(qg, kg, vg, g_gamma=-slopes, scale=1.0)
        o.backward(do)

    def ours_fb(ctx):
        lightning_attention(qg, kg, vg, slopes, ctx=ctx, impl="ring").backward(do)

    rows = {
        "fla chunk_simple_gla fwd": lambda: chunk_simple_gla(q, k, v, g_gamma=-slopes, scale=1.0),
        "fla chunk_simple_gla fwd+bwd": fla_fb,
        "fla chunk_fwd_h": lambda: chunk_fwd_h(k=k, v=v, g_gamma=gg, h0=None, output_final_state=True),
        "our output_from_states": lambda: output_from_states(q, k, v, h, S, gg, 1.0),
        "our decayed_state_sum": lambda: decayed_state_sum(q, do, gg, 1, 1),
        "state_grad_local": lambda: state_grad_local(q, do, slopes, 1.0),
        "stream switch (2 waits)": switch,
        "scan ring, world 1 zigzag": lambda: scan_rows(S2, A2, zz, "ring", False),
        "scan allgather, world 1 zigzag": lambda: scan_rows(S2, A2, zz, "allgather", False),
        "leaves_output (2 leaves)": lambda: leaves_output(qb, kb, vb, slopes, 1.0, lambda *_: S2),
        "leaves_backward (2 leaves)": lambda: leaves_backward(qb, kb, vb, slopes, 1.0, S2, dob,
                                                              lambda *_: S2),
        "lightning_attention fwd+bwd, one leaf": lambda: ours_fb(None),
        "lightning_attention fwd+bwd, world 1 zigzag": lambda: ours_fb(zz),
    }
    print(f"T_local {T}, B 1, H {H}, K = V {K}, bf16 ({torch.cuda.get_device_name(dev)})")
    for name, fn in rows.items():
        print(f"{name:<46}{1e3 * host_ms(fn, 20):9.0f} µs host")


if __name__ == "__main__":
    main()

"""Probe the links between the GPUs of one host: NCCL all-gather, reduce-scatter, all-to-all
and p2p bandwidth for a few message sizes (the α/β figures the schedules' overlap depends on).
Each row records the ``NCCL_*`` variables of the environment (``nccl_env``, as every
benchmark's row does), so runs under different settings compare.

    torchrun --standalone --nproc-per-node 2 benchmarks/link_probe.py [--out FILE]
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import base_parser, device_name, emit, init_dist, time_ms  # noqa: E402
from sp_attention import build_sp_context  # noqa: E402
from sp_attention.planning.layout import ring_neighbors  # noqa: E402
from sp_attention.comm import all_gather_flat, all_to_all_flat, reduce_scatter_flat  # noqa: E402


def main() -> None:
    a = base_parser(__doc__.splitlines()[0]).parse_args()
    rank, world = init_dist(a.device)
    if world < 2:
        sys.exit("link_probe measures links between ranks: start it with "
                 "torchrun --standalone --nproc-per-node N (N >= 2)")
    dev = torch.device("cuda", torch.cuda.current_device()) if a.device == "cuda" else "cpu"
    ctx = build_sp_context(dist.new_group(list(range(world))))
    for mib in (1, 8, 32, 128):
        n = mib * 2 ** 20 // 2                                   # bf16 elements per rank
        x = torch.randn(n, device=dev).to(torch.bfloat16)
        out = torch.empty(world * n, device=dev, dtype=torch.bfloat16)
        peer_prev, peer_next = ring_neighbors(rank, world)   # WORLD group: group = global
        recv = torch.empty_like(x)
        swapped = torch.empty_like(x)

        def p2p():
            ops = [dist.P2POp(dist.isend, x, peer_next), dist.P2POp(dist.irecv, recv, peer_prev)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        t = {"all_gather": time_ms(lambda: all_gather_flat(out, x, ctx), a.device,
                                   a.warmup, a.iters, a.repeats),
             "reduce_scatter": time_ms(lambda: reduce_scatter_flat(x, out, ctx), a.device,
                                       a.warmup, a.iters, a.repeats),
             "all_to_all": time_ms(lambda: all_to_all_flat(swapped, x, ctx), a.device,
                                   a.warmup, a.iters, a.repeats),
             "p2p_ring_hop": time_ms(p2p, a.device, a.warmup, a.iters, a.repeats)}
        for op, ms in t.items():
            # bytes each rank receives: (P-1)·n for the gather and the reduce-scatter,
            # (P-1)/P·n for the all-to-all (its own share stays), n for one hop
            recv_bytes = {"p2p_ring_hop": n * 2, "all_to_all": (world - 1) * n * 2 // world}.get(
                op, (world - 1) * n * 2)
            emit({"bench": "link_probe", "op": op, "MiB_per_rank": mib, "world": world,
                  "ms": ms, "GB_s_received": recv_bytes / ms / 1e6,
                  "device": device_name(a.device)}, a.out, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

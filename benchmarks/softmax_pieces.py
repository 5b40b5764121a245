"""Benchmark: the kernel work of one rank's ring schedule on ONE GPU, without communication.

    python benchmarks/softmax_pieces.py --t-local 8192 32768 [--world 2]

Every rank of a P-rank ring makes a fixed list of kernel calls (:func:`sp_attention.softmax.
plan.ring_calls`), merges blocks by LSE (forward) and accumulates dq / fp32 dK/dV (backward).
Here each rank's calls run on one GPU with K/V taken from the global tensors instead of
received, so the time is the schedule's ceiling with free communication. Next to it, the 1-GPU
kernel on the global causal problem (the strong-scaling baseline of `softmax_cp.py`) and on
T_local alone. Rows: per rank and variant — `kernels` (the calls alone), `schedule` (calls +
merges into an fp32 accumulator and fp32 dq/dK/dV accumulation), `schedule_groups` (the
backward's last step split into 4 KV-head groups, as `bwd_ring` ran it until 2026-11-23).
`ratio` = per-GPU TFLOP/s of the variant ÷ the 1-GPU global kernel, i.e. what the CP step
could reach if every transfer were hidden and cost no SM time.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import base_parser, device_name, emit, time_ms  # noqa: E402
from sp_attention.layout import ring_source, shard_ranges  # noqa: E402
from sp_attention.softmax.backends import get_backend  # noqa: E402
from sp_attention.softmax.merge import merge_blocks_  # noqa: E402
from sp_attention.softmax.plan import ring_calls  # noqa: E402


def flops(B, H, T, D, fwd_bwd):
    return 4 * B * H * T * T * D * 0.5 * (3.5 if fwd_bwd else 1.0)


def _shard(x, rank, world, layout):
    """Rank ``rank``'s shard of ``x`` along dim 1 (no process group needed)."""
    return torch.cat([x[:, s:e] for s, e in shard_ranges(rank, world, x.shape[1], layout)],
                     1).contiguous()


def _calls(rank, world, layout):
    """(step, src, call) of one rank's ring, in execution order."""
    return [(s, ring_source(rank, world, s), c) for s in range(world)
            for c in ring_calls(rank, ring_source(rank, world, s), world, layout, True)]


def ring_forward_local(q, kv, rank, world, layout, be, merge: bool):
    ls = q.shape[1] // 2 if layout == "zigzag" else q.shape[1]
    out = lse = None
    for step, src, c in _calls(rank, world, layout):
        rows, n = slice(c.q_start * ls, c.q_stop * ls), c.keys * ls
        o, l_ = be.forward(q[:, rows], kv[src][0][:, :n], kv[src][1][:, :n], c.causal, None)
        if not merge:
            continue
        if step == 0:
            out, lse = o.float(), l_
        else:
            merge_blocks_(out[:, rows], lse[:, :, rows], o, l_)
    return out, lse


def ring_backward_local(do, q, kv, out, lse, rank, world, layout, be, accumulate: bool,
                        groups: int = 1):
    """The ring backward's calls and fp32 accumulations; the last step by ``groups`` KV-head
    groups when ``groups > 1`` (as ``bwd_ring`` does)."""
    ls = q.shape[1] // 2 if layout == "zigzag" else q.shape[1]
    hkv = kv[rank][0].shape[2]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv = {s: torch.zeros((2,) + tuple(kv[s][0].shape), dtype=torch.float32, device=q.device)
           for s in range(world)}
    for step, src, c in _calls(rank, world, layout):
        rows, n = slice(c.q_start * ls, c.q_stop * ls), c.keys * ls
        last = step == world - 1 and groups > 1
        hq, hk = q.shape[2] // (groups if last else 1), hkv // (groups if last else 1)
        for g in range(groups if last else 1):
            hs, ks = slice(g * hq, (g + 1) * hq), slice(g * hk, (g + 1) * hk)
            dq_c, dk_c, dv_c = be.backward(do[:, rows, hs], q[:, rows, hs],
                                           kv[src][0][:, :n, ks], kv[src][1][:, :n, ks],
                                           out[:, rows, hs], lse[:, hs, rows], c.causal, None)
            if accumulate:
                dq[:, rows, hs].add_(dq_c)
                dkv[src][0][:, :n, ks].add_(dk_c)
                dkv[src][1][:, :n, ks].add_(dv_c)
    return dq


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="ranks P of the emulated ring")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous"])
    a = p.parse_args()
    dev = a.device
    device = torch.device("cuda", 0) if dev == "cuda" else torch.device("cpu")
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if dev == "cuda" else torch.float32)
    P, H, Hkv, D = a.world, a.heads, a.kv_heads, a.head_dim
    be = get_backend(None, device, dtype, D)
    for T_local in a.t_local or ([8192, 32768] if dev == "cuda" else [64]):
        T = P * T_local
        g = torch.Generator(device=device).manual_seed(5)
        q, do = (torch.randn(1, T, H, D, device=device, dtype=dtype, generator=g) for _ in range(2))
        k, v = (torch.randn(1, T, Hkv, D, device=device, dtype=dtype, generator=g) for _ in range(2))
        for mode in (a.timing if dev == "cuda" else ["eager"]):
            def timer(fn):
                return time_ms(fn, dev, a.warmup, a.iters, a.repeats, mode=mode)
            base = {"bench": "softmax_pieces", "world": P, "B": 1, "T_local": T_local, "H": H,
                    "Hkv": Hkv, "K": D, "dtype": str(dtype).replace("torch.", ""),
                    "device": device_name(dev), "backend": be.name, "timing": mode,
                    "layout": a.layout}
            ref, ref_fwd = {}, {}
            for name, Tq in (("single_global", T), ("single_t_local", T_local)):
                def fb(Tq=Tq):
                    o, l_ = be.forward(q[:, :Tq], k[:, :Tq], v[:, :Tq], True, None)
                    be.backward(do[:, :Tq], q[:, :Tq], k[:, :Tq], v[:, :Tq], o, l_, True, None)
                tf = timer(lambda Tq=Tq: be.forward(q[:, :Tq], k[:, :Tq], v[:, :Tq], True, None))
                tfb = timer(fb)
                ref[name] = flops(1, H, Tq, D, True) / tfb / 1e9
                ref_fwd[name] = flops(1, H, Tq, D, False) / tf / 1e9
                emit(dict(base, impl=name, T_local=Tq, ms_fwd=tf, ms_fwd_bwd=tfb,
                          tflops_per_gpu=ref[name], tflops_fwd=flops(1, H, Tq, D, False) / tf / 1e9,
                          ratio=1.0), a.out, 0)
            sh = [[_shard(t, r, P, a.layout) for t in (q, k, v, do)] for r in range(P)]
            kv = [(s[1], s[2]) for s in sh]
            groups = 4      # the last step by KV-head group, as bwd_ring ran it before 2026-11-23
            for r in range(P):
                ql, dol = sh[r][0], sh[r][3]
                o, l_ = ring_forward_local(ql, kv, r, P, a.layout, be, True)
                o = o.to(dtype)
                variants = {
                    "kernels": (False, False, 1),
                    "schedule": (True, True, 1),
                    "schedule_groups": (True, True, groups),
                }
                for name, (merge, acc, grp) in variants.items():
                    tf = timer(lambda: ring_forward_local(ql, kv, r, P, a.layout, be, merge))

                    def fb():
                        ring_forward_local(ql, kv, r, P, a.layout, be, merge)
                        ring_backward_local(dol, ql, kv, o, l_, r, P, a.layout, be, acc, grp)
                    tfb = timer(fb)
                    tp = flops(1, H, T, D, True) / P / tfb / 1e9
                    emit(dict(base, impl=f"rank{r}_{name}", rank=r, ms_fwd=tf, ms_fwd_bwd=tfb,
                              tflops_per_gpu=tp, baseline="single_global",
                              ratio=tp / ref["single_global"],
                              ratio_fwd=flops(1, H, T, D, False) / P / tf / 1e9
                              / ref_fwd["single_global"],
                              ratio_vs_t_local=tp / ref["single_t_local"]), a.out, 0)
        del q, k, v, do, sh, kv


if __name__ == "__main__":
    main()

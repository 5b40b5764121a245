"""Benchmark: the kernel work of one rank's ring schedule on ONE GPU, without communication.

    python benchmarks/softmax_pieces.py --t-local 8192 32768 [--world 2]

Every rank of a P-rank ring makes a fixed list of kernel calls (:func:`sp_attention.softmax.
plan.ring_calls`), merges blocks by LSE (forward) and accumulates dq / fp32 dK/dV (backward).
Here each rank's calls run on one GPU with K/V taken from the global tensors instead of
received, so the time is the schedule's ceiling with free communication. Next to it, the 1-GPU
kernel on the global causal problem (the strong-scaling baseline of `softmax_cp.py`) and on
T_local alone. Rows: per rank and variant — `kernels` (the calls alone) and `ring` (the
library's own `ring_forward` / `ring_backward`, unpatched: K/V hops, kernel calls, LSE
merges, dq / dK/dV accumulation and the hops' buffers, with the hops going through torch's fake
process-group backend, `fake_cp_group`: collectives and point-to-point calls return at once, no
data moves; the process emulates rank r through its SPContext). The received K/V buffers are
therefore whatever memory held (kernel time does not depend on the values); the backward is
given rank r's real ``out`` / LSE. The all-gather schedules run the same way: `allgather` (fwd
allgather + bwd allgather) and `ring_ag` (the ring forward + bwd allgather), one
row per `--strides` value (`stride`: KV heads per gather; default the library's) and the
backward's `--bwd-first` / `--bwd-last` stride splits.
`ratio` = per-GPU TFLOP/s of the variant ÷ the 1-GPU global kernel, i.e. what the CP step
could reach if every transfer were hidden and cost no SM time. `peak_mem_gb`: what one fwd+bwd
adds at its peak above its inputs (CUDA), for each rank's program and for the 1-GPU kernel on
the global sequence and on T_local (`single_t_local`: the same tokens per GPU).

    python benchmarks/softmax_pieces.py --summary FILE.jsonl   # table of the JSON lines
"""
from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import (base_parser, device_name, emit, host_ahead_lost,  # noqa: E402
                               kernel_table, peak_mem_gb, parse_or_summarize, time_ms)
from sp_attention import SPContext  # noqa: E402
from sp_attention.planning.layout import ring_source, shard_ranges  # noqa: E402
from sp_attention.softmax.bwd_allgather import allgather_backward  # noqa: E402
from sp_attention.softmax.bwd_ring import ring_backward  # noqa: E402
from sp_attention.softmax.fwd_allgather import allgather_forward  # noqa: E402
from sp_attention.softmax.fwd_ring import ring_forward  # noqa: E402
from sp_attention.softmax.attention import default_heads_k_stride  # noqa: E402
from sp_attention.softmax.backends import get_backend  # noqa: E402
from sp_attention.planning.softmax_plan import ring_calls  # noqa: E402


SUMMARY_COLS = ["impl", "layout", "world", "rank", "stride", "T_local", "timing", "ms_fwd",
                "ms_fwd_bwd", "tflops_per_gpu", "ratio", "ratio_fwd", "ratio_vs_t_local",
                "peak_mem_gb", "host_ahead_lost", "outputs_finite"]


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


def kernel_calls(q, kv, rank, world, layout, be, do=None, out=None, lse=None):
    """Rank ``rank``'s ring kernel calls alone (K/V of step s from the global tensors): the
    forward calls, or with ``do`` the backward calls given the rank's ``out`` / ``lse``."""
    ls = q.shape[1] // 2 if layout == "zigzag" else q.shape[1]
    for step, src, c in _calls(rank, world, layout):
        rows, n = slice(c.q_start * ls, c.q_stop * ls), c.keys * ls
        k, v = kv[src][0][:, :n], kv[src][1][:, :n]
        if do is None:
            be.forward(q[:, rows], k, v, c.causal, None)
        else:
            be.backward(do[:, rows], q[:, rows], k, v, out[:, rows], lse[:, :, rows], c.causal,
                        None)


@contextlib.contextmanager
def fake_cp_group(world: int):
    """The process group of the all-gather rows: torch's fake backend with ``world`` ranks, so
    the library's collectives run unpatched and move nothing over a network.

    Made only when no process group exists (and destroyed on exit); an existing fake group of
    the same size is reused. Any other existing group is refused: its collectives would be
    real, or sized for another world.
    """
    if dist.is_initialized():
        if dist.get_backend() != "fake" or dist.get_world_size() != world:
            raise ValueError(
                f"softmax_pieces: a {dist.get_backend()!r} process group of "
                f"{dist.get_world_size()} ranks is already initialised; the all-gather rows "
                f"need torch's fake backend with {world} ranks. Run the benchmark in a process "
                "without a process group, or pass --no-allgather")
        yield dist.group.WORLD
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore   # registers "fake"
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def allgather_rows(a, shard, be, timer, mem, ctx, ring_fwd, o_ref, lse_ref) -> dict:
    """``{(name, stride): (ms_fwd, ms_fwd_bwd, peak_gb, outputs_finite)}`` of rank ``r``'s
    all-gather schedules (``allgather``, ``ring_ag``: ``ring_fwd`` then the all-gather backward)
    per stride; ``shard`` is rank r's ``(q, k, v, do)``, ``ctx`` its context on the fake group.

    The library's ``allgather_forward`` / ``allgather_backward`` run as on rank ``r`` of a real
    group (packing, kernel calls, fp32 upcasts, reduce-scatter drains), with ``ctx.group`` the
    fake backend's: its collectives return at once. The gathered K/V are therefore not the other
    ranks' data. On torch 2.13 the fake all-gather writes P copies of this rank's send buffer
    into the receive buffer and the fake reduce-scatter copies one block (local device copies,
    about the bytes NCCL would write); a build whose fake backend left the library's
    ``torch.empty`` receive buffers untouched would feed the kernels whatever memory held, NaN
    included. Kernel time does not depend on the values; ``outputs_finite`` records whether
    the fwd output/LSE and dq/dK/dV came out finite. The backward is given the ring
    schedule's real ``out`` / LSE of rank ``r`` (``o_ref``, ``lse_ref``).
    """
    ql, kl, vl, dol = shard
    H, Hkv = ql.shape[2], kl.shape[2]
    strides = a.strides or [default_heads_k_stride(Hkv, H // Hkv)]
    out = {}
    for st in strides:
        def fwd(st=st):
            return allgather_forward(ql, kl, vl, ctx, be, causal=True, scale=None,
                                     heads_k_stride=st)

        def bwd(st=st):
            return allgather_backward(dol, ql, kl, vl, o_ref, lse_ref, ctx, be, causal=True,
                                      scale=None, heads_k_stride=st, first=a.bwd_first,
                                      last=a.bwd_last)

        def fb_ag():
            fwd()
            bwd()

        def fb_ring_ag():
            ring_fwd()
            bwd()
        finite = all(bool(torch.isfinite(t).all()) for t in (*fwd(), *bwd()))
        out[("allgather", st)] = (timer(fwd), timer(fb_ag), mem(fb_ag), finite)
        tf_ring = timer(ring_fwd)
        out[("ring_ag", st)] = (tf_ring, timer(fb_ring_ag), mem(fb_ring_ag), finite)
    return out


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="ranks P of the emulated ring")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous"])
    p.add_argument("--strides", type=int, nargs="+",
                   help="heads_k_stride values of the all-gather rows (default: the library's)")
    p.add_argument("--bwd-first", type=int, help="bwd_head_first_stride of the all-gather bwd")
    p.add_argument("--bwd-last", type=int, help="bwd_head_last_stride of the all-gather bwd")
    p.add_argument("--no-allgather", action="store_true", help="no all-gather rows")
    p.add_argument("--pack-kv", action="store_true",
                   help="also `ring_packed` rows: the ring with K/V packed into one buffer per "
                        "hop (SoftmaxTuning.pack_kv, the A/B of sending them as two messages)")
    p.add_argument("--profile", action="store_true",
                   help="CUDA: print each rank's kernels, calls alone vs the ring schedule")
    a = parse_or_summarize(p, SUMMARY_COLS)
    if a is None:
        return
    dev = a.device
    device = torch.device("cuda", 0) if dev == "cuda" else torch.device("cpu")
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if dev == "cuda"
                                                     else torch.float32)
    be = get_backend(None, device, dtype, a.head_dim)
    with fake_cp_group(a.world) as group:
        for T_local in a.t_local or ([8192, 32768] if dev == "cuda" else [64]):
            for mode in (a.timing if dev == "cuda" else ["eager"]):
                run_t(a, T_local, mode, device, dtype, be, group)


def run_t(a, T_local: int, mode: str, device, dtype, be, group) -> None:
    dev, P, H, Hkv, D = device.type, a.world, a.heads, a.kv_heads, a.head_dim
    T = P * T_local
    g = torch.Generator(device=device).manual_seed(5)
    q, do = (torch.randn(1, T, H, D, device=device, dtype=dtype, generator=g) for _ in range(2))
    k, v = (torch.randn(1, T, Hkv, D, device=device, dtype=dtype, generator=g) for _ in range(2))

    def timer(fn):
        return time_ms(fn, dev, a.warmup, a.iters, a.repeats, mode=mode)

    def mem(fn):
        return peak_mem_gb(fn, dev)
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
                  ratio=1.0, peak_mem_gb=mem(fb)), a.out, 0)

    def row(name, r, tf, tfb, peak, **extra):
        tp = flops(1, H, T, D, True) / P / tfb / 1e9
        emit(dict(base, impl=f"rank{r}_{name}", rank=r, ms_fwd=tf, ms_fwd_bwd=tfb,
                  tflops_per_gpu=tp, baseline="single_global", ratio=tp / ref["single_global"],
                  ratio_fwd=flops(1, H, T, D, False) / P / tf / 1e9 / ref_fwd["single_global"],
                  ratio_vs_t_local=tp / ref["single_t_local"], peak_mem_gb=peak,
                  host_ahead_lost=host_ahead_lost(), **extra), a.out, 0)
    sh = [[_shard(t, r, P, a.layout) for t in (q, k, v, do)] for r in range(P)]
    kv = [(s[1], s[2]) for s in sh]
    o_all, lse_all = be.forward(q, k, v, True, None)   # every rank's real out / LSE
    for r in range(P):
        ql, kl, vl, dol = sh[r]
        ctx = SPContext(group, r, P, tuple(range(P)), a.layout)
        o = _shard(o_all, r, P, a.layout)                 # the backward rows' inputs
        l_ = _shard(lse_all.transpose(1, 2), r, P, a.layout).transpose(1, 2).contiguous()
        programs = {   # (forward, backward) of rank r: its kernel calls alone; the library's ring
            "kernels": (lambda: kernel_calls(ql, kv, r, P, a.layout, be),
                        lambda: kernel_calls(ql, kv, r, P, a.layout, be, dol, o, l_)),
            "ring": (lambda: ring_forward(ql, kl, vl, ctx, be, causal=True, scale=None),
                     lambda: ring_backward(dol, ql, kl, vl, o, l_, ctx, be, causal=True,
                                           scale=None))}
        if a.pack_kv:
            programs["ring_packed"] = (
                lambda: ring_forward(ql, kl, vl, ctx, be, causal=True, scale=None, pack_kv=True),
                lambda: ring_backward(dol, ql, kl, vl, o, l_, ctx, be, causal=True, scale=None,
                                      pack_kv=True))
        for name, (fwd, bwd) in programs.items():
            def fb(fwd=fwd, bwd=bwd):
                fwd()
                bwd()
            row(name, r, timer(fwd), timer(fb), mem(fb),
                **({"comm": "fake_pg"} if name.startswith("ring") else {}))
            if a.profile and dev == "cuda":
                kernel_table(fwd, f"rank {r} {name} fwd, T_local {T_local}")
                kernel_table(bwd, f"rank {r} {name} bwd, T_local {T_local}")
        if not a.no_allgather:
            for (name, st), (tf, tfb, peak, fin) in allgather_rows(
                    a, sh[r], be, timer, mem, ctx, programs["ring"][0], o, l_).items():
                row(name, r, tf, tfb, peak, stride=st, bwd_first=a.bwd_first,
                    bwd_last=a.bwd_last, comm="fake_pg", outputs_finite=fin)

if __name__ == "__main__":
    main()

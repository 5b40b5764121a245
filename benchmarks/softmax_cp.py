"""Benchmark: context-parallel causal GQA softmax attention (Llama-3-8B attention shape).

    torchrun --standalone --nproc-per-node 2 benchmarks/softmax_cp.py --out softmax.jsonl
    torchrun --standalone --nproc-per-node 8 benchmarks/softmax_cp.py --device cpu   # gloo dry run

Per T_local: the single-GPU kernel (our fastest backend, cuDNN on Hopper) on the *global*
causal problem T = P·T_local (the same total work; its per-GPU throughput is the strong-scaling
baseline) and on T_local alone; every fwd × bwd pair and preset of `context_parallel_attention`;
and torch's `context_parallel` (SDPA, cuDNN) in the same run. FLOPs: forward 4·B·H·T²·D·½
(causal), fwd+bwd 3.5× forward; CP per-GPU TFLOP/s = global FLOPs / P / time.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import (COMM_VARIANTS, base_parser, cp_groups, device_name,  # noqa: E402
                               emit, init_dist, time_ms)
from sp_attention import build_sp_context, shard_sequence  # noqa: E402
from sp_attention.softmax import context_parallel_attention  # noqa: E402
from sp_attention.planning.schedules import PRESETS  # noqa: E402
from sp_attention.softmax.backends import get_backend  # noqa: E402

PAIRS = list(PRESETS.values())      # every preset's (fwd, bwd)


def flops(B, H, T, D, causal, fwd_bwd):
    f = 4 * B * H * T * T * D * (0.5 if causal else 1.0)
    return f * (3.5 if fwd_bwd else 1.0)


def _single_gpu(backend, q, k, v, do, causal, timer):
    def fwd():
        return backend.forward(q, k, v, causal, None)

    def fwd_bwd():
        o, l_ = backend.forward(q, k, v, causal, None)
        backend.backward(do, q, k, v, o, l_, causal, None)
    return timer(fwd), timer(fwd_bwd)


def _torch_cp(world, q, k, v, do, H, causal, timer, device):
    """torch.distributed.tensor.experimental.context_parallel on global [B, H, T, D] inputs
    (it shards them in place; GQA K/V expanded to H heads since its SDPA path needs equal heads)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel
    mesh = init_device_mesh(device, (world,))
    rep = H // k.shape[2]
    qt = q.transpose(1, 2).contiguous()
    kt = k.repeat_interleave(rep, 2).transpose(1, 2).contiguous()
    vt = v.repeat_interleave(rep, 2).transpose(1, 2).contiguous()
    dot = do.transpose(1, 2).contiguous()
    bufs = [qt, kt, vt, dot]
    backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION] if device == "cuda" else \
        [SDPBackend.MATH]
    with sdpa_kernel(backends), context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2] * 4,
                                                 no_restore_buffers=set(bufs)):
        for t in (qt, kt, vt):
            t.requires_grad_(True)

        def step(backward):
            o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            if backward:
                o.backward(dot)
        return timer(lambda: step(False)), timer(lambda: step(True))


def _profile(step, out_dir: str, tag: str, rank: int) -> None:
    """One profiled fwd+bwd step: Chrome trace per rank, top-kernel table from rank 0."""
    from torch.profiler import ProfilerActivity, profile
    os.makedirs(out_dir, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    prof.export_chrome_trace(os.path.join(out_dir, f"trace_{tag}_rank{rank}.json"))
    if rank == 0:
        key = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        print(f"# profile {tag}\n" + prof.key_averages().table(sort_by=key, row_limit=12),
              file=sys.stderr, flush=True)


def main() -> None:
    p = base_parser(__doc__.splitlines()[1])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--non-causal", action="store_true")
    p.add_argument("--strides", nargs="+", default=["default", "1", "2", "2:1:1"],
                   help="all-gather backward stride patterns 'stride[:first:last]'")
    p.add_argument("--pairs", nargs="+", default=None,
                   help="fwd/bwd pairs to run, e.g. ring/ring ring/allgather (default: all)")
    p.add_argument("--no-torch-cp", action="store_true")
    p.add_argument("--comm-variants", nargs="+", default=["default"],
                   choices=[v for v in COMM_VARIANTS if v != "side0"],
                   help="rows per communication setting, side by side: 'default' (a plain "
                        "dist.new_group), 'nccl-hp' (the CP group's NCCL kernels on a "
                        "high-priority stream: new_cp_group with CPGroupOptions("
                        "high_priority_stream=True)); impl suffix '+VARIANT'")
    p.add_argument("--profile", metavar="DIR",
                   help="also write a torch-profiler Chrome trace of one fwd+bwd step per pair "
                        "(first T_local) to DIR and print its top kernels: the timeline that "
                        "shows what overlaps what")
    a = p.parse_args()
    dev = a.device
    rank, world = init_dist(dev)
    device = torch.device("cuda", torch.cuda.current_device()) if dev == "cuda" else torch.device("cpu")
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if dev == "cuda" else torch.float32)
    t_locals = a.t_local or ([8192, 32768] if dev == "cuda" else [64])
    B, H, Hkv, D, causal = a.batch, a.heads, a.kv_heads, a.head_dim, not a.non_causal
    groups = cp_groups(a.comm_variants, world)
    ctx = build_sp_context(groups["default"], layout="zigzag")
    backend = get_backend(None, device, dtype, D)

    mode = a.timing[0] if dev == "cuda" else "eager"   # softmax steps are GPU-bound: one mode

    def timer(fn):
        return time_ms(fn, dev, a.warmup, a.iters, a.repeats, mode=mode)

    for T_local in t_locals:
        T = world * T_local
        g = torch.Generator(device=device).manual_seed(99)   # same global tensors on every rank
        q = torch.randn(B, T, H, D, device=device, dtype=dtype, generator=g)
        k, v = (torch.randn(B, T, Hkv, D, device=device, dtype=dtype, generator=g) for _ in range(2))
        do = torch.randn(B, T, H, D, device=device, dtype=dtype, generator=g)
        base = {"bench": "softmax_cp", "world": world, "B": B, "T_local": T_local, "H": H,
                "Hkv": Hkv, "K": D, "V": D, "dtype": str(dtype).replace("torch.", ""),
                "causal": causal, "layout": "zigzag", "device": device_name(dev),
                "backend": backend.name, "timing": mode}
        # single-GPU baselines (no communication): the global problem, and T_local alone
        ref = {}
        for name, Tq in (("single_global", T), ("single_t_local", T_local)):
            tf, tfb = _single_gpu(backend, q[:, :Tq], k[:, :Tq], v[:, :Tq], do[:, :Tq], causal, timer)
            ref[name] = (flops(B, H, Tq, D, causal, False) / tf / 1e9,
                         flops(B, H, Tq, D, causal, True) / tfb / 1e9)
            emit(dict(base, impl=name, world=1, T_local=Tq, ms_fwd=tf, ms_fwd_bwd=tfb,
                      tflops_per_gpu=ref[name][1], tflops_fwd=ref[name][0], baseline="self",
                      ratio=1.0), a.out, rank)
        ql, kl, vl, dol = (shard_sequence(t, ctx, 1).contiguous() for t in (q, k, v, do))
        ql, kl, vl = (t.requires_grad_(True) for t in (ql, kl, vl))
        fl_f, fl_fb = flops(B, H, T, D, causal, False) / world, flops(B, H, T, D, causal, True) / world
        pairs = [tuple(x.split("/")) for x in a.pairs] if a.pairs else PAIRS
        runs = [(f, b, "default", c) for c in a.comm_variants for f, b in pairs]
        if ("ring", "allgather") in pairs:
            runs += [("ring", "allgather", s, "default") for s in a.strides if s != "default"]
        for fwd, bwd, stride, comm in runs:
            cctx = build_sp_context(groups[comm], layout="zigzag")
            name = f"{fwd}/{bwd}" + ("" if comm == "default" else f"+{comm}")
            kw = {}
            if stride != "default":
                parts = [int(x) for x in stride.split(":")]
                kw["heads_k_stride"] = parts[0]
                if len(parts) == 3:
                    kw["bwd_head_first_stride"], kw["bwd_head_last_stride"] = parts[1], parts[2]

            def step(backward):
                o = context_parallel_attention(ql, kl, vl, ctx=cctx, fwd=fwd, bwd=bwd,
                                               causal=causal, **kw)
                if backward:
                    o.backward(dol)
            try:
                tf, tfb = timer(lambda: step(False)), timer(lambda: step(True))
            except (ValueError, RuntimeError) as e:  # e.g. a stride the head count cannot take
                emit(dict(base, impl=name, stride=stride, comm=comm, error=str(e)[:300]),
                     a.out, rank)
                continue
            if a.profile and T_local == t_locals[0]:
                _profile(lambda: step(True), a.profile,
                         f"{fwd}-{bwd}-{stride}" + ("" if comm == "default" else f"-{comm}"), rank)
            tp_f, tp_fb = fl_f / tf / 1e9, fl_fb / tfb / 1e9
            emit(dict(base, impl=name, stride=stride, comm=comm, ms_fwd=tf, ms_fwd_bwd=tfb,
                      tflops_per_gpu=tp_fb, tflops_fwd=tp_f, baseline="single_global",
                      ratio=tp_fb / ref["single_global"][1], ratio_fwd=tp_f / ref["single_global"][0],
                      ratio_vs_t_local=tp_fb / ref["single_t_local"][1]), a.out, rank)
        if not a.no_torch_cp and world > 1:
            try:
                tf, tfb = _torch_cp(world, q, k, v, do, H, causal, timer, dev)
                emit(dict(base, impl="torch_context_parallel", ms_fwd=tf, ms_fwd_bwd=tfb,
                          tflops_per_gpu=fl_fb / tfb / 1e9, tflops_fwd=fl_f / tf / 1e9,
                          baseline="single_global", ratio=fl_fb / tfb / 1e9 / ref["single_global"][1]),
                     a.out, rank)
            except Exception as e:  # noqa: BLE001 - report the peer's failure, keep the run
                emit(dict(base, impl="torch_context_parallel", error=f"{type(e).__name__}: {e}"[:400]),
                     a.out, rank)
        del q, k, v, do, ql, kl, vl, dol
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Benchmark: context-parallel causal GQA softmax attention (Llama-3-8B attention shape).

    torchrun --standalone --nproc-per-node 4 benchmarks/softmax_cp.py --out results/softmax.jsonl
    torchrun --standalone --nproc-per-node 4 benchmarks/softmax_cp.py --strides default \\
        --fwd-bwd-only --out results/softmax.jsonl          # the P = 4 sweep in ~3 minutes
    torchrun --standalone --nproc-per-node 8 benchmarks/softmax_cp.py --device cpu   # gloo dry run

Per T_local: the single-GPU kernel (our fastest backend, cuDNN on Hopper) on the *global*
causal problem T = P·T_local (the same total work; its per-GPU throughput is the strong-scaling
baseline) and on T_local alone; every fwd × bwd pair of `context_parallel_attention` (with the
all-gather stride patterns of ``--strides``), the all-to-all presets (``a2a``; ``a2a_ring`` for
every ``--a2a-sizes``) and ``auto`` (its pick in the row's ``resolved``); and two anchors in the
same run: torch's `context_parallel` (SDPA, cuDNN; ``impl: torch_context_parallel``) and
Ulysses through yunchang's all-to-all (``SeqAllToAll4D`` on contiguous shards, cuDNN SDPA with
``enable_gqa`` locally; ``impl: yunchang_ulysses``, its ratio against its own one-GPU baseline,
that SDPA call on the global sequence, ``impl: yunchang_single_global``). yunchang (0.6.4, pure
Python) is imported only for its rows; without it they say why. FLOPs: forward 4·B·H·T²·D·½
(causal), fwd+bwd 3.5× forward; CP per-GPU TFLOP/s = global FLOPs / P / time.

``--packed``: packed documents instead (rows ``packed: true``): one row of P·T_local tokens cut
into the log-normal document mix of the linear benchmark (median 720 tokens, seed 7), every
run above with ``cu_seqlens=plan_packing(cu, ctx)``; one-GPU baselines on the whole packed row:
torch's varlen FlashAttention-2 kernels (those of ``torch.nn.attention.varlen.varlen_attn``;
``impl: torch_varlen_single_global``) and our op at P = 1 (``single_global_packed``), the
faster of the two the ratio's; FLOPs summed per document. No anchors (neither takes documents).
"""
from __future__ import annotations

import os
import random
import sys
from dataclasses import replace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import (COMM_VARIANTS, base_parser, cp_groups, device_name,  # noqa: E402
                               emit, host_profile, init_dist, time_ms)
from benchmarks.packed_linear import lognormal_cu  # noqa: E402
from sp_attention import (SoftmaxTuning, build_sp_context, plan_packing,  # noqa: E402
                          shard_sequence)
from sp_attention.planning.softmax_a2a import head_chunks  # noqa: E402
from sp_attention.softmax import context_parallel_attention  # noqa: E402
from sp_attention.softmax.backends import get_backend  # noqa: E402

PAIRS = [("ring", "allgather"), ("ring", "ring"), ("allgather", "allgather"), ("allgather", "ring")]
PRESETS = ("a2a", "a2a_ring", "auto")


def flops(B, H, T, D, causal, fwd_bwd):
    f = 4 * B * H * T * T * D * (0.5 if causal else 1.0)
    return f * (3.5 if fwd_bwd else 1.0)


def _single_gpu(backend, q, k, v, do, causal, timer):
    def fwd():
        return backend.forward(q, k, v, causal, None)

    def fwd_bwd():
        o, l_ = backend.forward(q, k, v, causal, None)
        backend.backward(do, q, k, v, o, l_, causal, None)
    return timer(fwd, fwd=True), timer(fwd_bwd)


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
        return timer(lambda: step(False), fwd=True), timer(lambda: step(True))


def _sdpa_gqa(q, k, v, causal, device):
    """One SDPA call on ``[B, T, h, D]`` tensors with native GQA: cuDNN on CUDA (flash if cuDNN
    refuses the call), math on CPU; returns ``(out [B, T, h, D], kernel name)``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    order = [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)] \
        if device == "cuda" else [("math", SDPBackend.MATH)]
    err = None
    for name, kind in order:
        try:
            with sdpa_kernel([kind]):
                o = torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                    enable_gqa=True)
            return o.transpose(1, 2), name
        except RuntimeError as e:
            err = e
    raise err


def _yunchang(group, world, rank, q, k, v, do, causal, timer, device):
    """Ulysses as a yunchang user writes it: contiguous shards, ``SeqAllToAll4D`` to head
    shards (scatter heads, gather the sequence), the local SDPA with native GQA, back.
    Returns ``(fwd ms, fwd+bwd ms, single fwd ms, single fwd+bwd ms, kernel)``."""
    from yunchang.comm.all_to_all import SeqAllToAll4D   # optional: only for these rows
    T_local = q.shape[1] // world
    rows = slice(rank * T_local, (rank + 1) * T_local)
    ql, kl, vl = (t[:, rows].contiguous().requires_grad_(True) for t in (q, k, v))
    dol = do[:, rows].contiguous()
    kernel = []

    def step(backward):
        qh, kh, vh = (SeqAllToAll4D.apply(group, t, 2, 1, False) for t in (ql, kl, vl))
        o, name = _sdpa_gqa(qh, kh, vh, causal, device)
        kernel.append(name)
        out = SeqAllToAll4D.apply(group, o, 1, 2, False)
        if backward:
            out.backward(dol)
    tf, tfb = timer(lambda: step(False), fwd=True), timer(lambda: step(True))
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))

    def single(backward):
        o, _ = _sdpa_gqa(qg, kg, vg, causal, device)
        if backward:
            o.backward(do)
    return (tf, tfb, timer(lambda: single(False), fwd=True), timer(lambda: single(True)),
            kernel[-1])


def _per_gpu(flop: float, ms):
    """TFLOP/s of ``flop`` in ``ms`` (None when not timed)."""
    return flop / ms / 1e9 if ms else None


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
        if torch.cuda.is_available():       # and where the host's time went
            print(f"# profile {tag} (host)\n" + prof.key_averages().table(
                sort_by="cpu_time_total", row_limit=15), file=sys.stderr, flush=True)


def _parser():
    p = base_parser(__doc__.splitlines()[1])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--non-causal", action="store_true")
    p.add_argument("--strides", nargs="+", default=["default", "1", "2", "2:1:1"],
                   help="all-gather backward stride patterns 'stride[:first:last]' (ring/"
                        "allgather rows; 'default' alone: none beyond the library's)")
    p.add_argument("--pairs", nargs="*", default=None,
                   help="fwd/bwd pairs to run, e.g. ring/ring ring/allgather (default: all; "
                        "none after the flag: presets only)")
    p.add_argument("--presets", nargs="*", default=list(PRESETS), choices=PRESETS,
                   help="the all-to-all presets and auto to run (default: all)")
    p.add_argument("--a2a-sizes", type=int, nargs="*", default=None,
                   help="a2a_ring group sizes (default: every 1 < U < P dividing P and H)")
    p.add_argument("--a2a-chunks", type=int, nargs="*", default=[],
                   help="also run preset a2a with each of these SoftmaxTuning.a2a_head_chunks "
                        "(rows 'a2a C=n', under each --comm-variants: e.g. fewer NCCL CTAs "
                        "beside cuDNN; the plain 'a2a' row runs the default)")
    p.add_argument("--a2a-direct", action="store_true",
                   help="also run every all-to-all row with SoftmaxTuning(a2a_direct=True) "
                        "(rows '<preset> direct': each piece sent straight into its place, "
                        "no index gathers)")
    p.add_argument("--copy-engine", action="store_true",
                   help="also run every all-to-all row (the 'a2a C=n' rows too) with "
                        "SoftmaxTuning(a2a_transport='copy_engine') (rows '<name> copy_engine': "
                        "the blocks pulled from the peers' symmetric memory by copy engines, "
                        "no NCCL kernels beside the attention kernels)")
    p.add_argument("--pack-kv", action="store_true",
                   help="also run every ring/ring row with SoftmaxTuning(pack_kv=True) (rows "
                        "'<pair> pack_kv': K and V copied into one buffer and sent as one "
                        "message per hop — fewer NCCL calls for a host-bound row, two copies more)")
    p.add_argument("--own-last", action="store_true",
                   help="also run every ring/ring row with SoftmaxTuning(ring_backward_order="
                        "'own_last') (rows '<pair> own_last': the backward starts on the block "
                        "the forward kept and runs the own block last)")
    p.add_argument("--layouts", nargs="+", default=["zigzag"], choices=["zigzag", "contiguous"],
                   help="the CP rows' sequence layouts, each row once per layout (default: "
                        "zigzag; the all-to-all presets reorder zigzag shards on every "
                        "exchange, contiguous ones arrive in order)")
    p.add_argument("--bracket", action="store_true",
                   help="time the one-GPU global baseline again after every other row (row "
                        "'single_global_end', 'drift': its throughput ÷ the first's): the "
                        "GPUs' clocks fall as a sweep heats them, so the first baseline can "
                        "flatter the ratio's denominator")
    p.add_argument("--reverse-rows", action="store_true",
                   help="time the CP rows in the reverse order (a row's place in the process "
                        "can move it by several %%: run an A/B both ways)")
    p.add_argument("--fwd-bwd-only", action="store_true",
                   help="time fwd+bwd only (the ratio's measure): a shorter sweep")
    p.add_argument("--packed-dense-min", type=int, nargs="*", default=[], metavar="N",
                   help="--packed: also run our one-GPU baseline and every ring/ring row with "
                        "SoftmaxTuning(packed_dense_min=N) (rows '<impl> dense_min=N': fewer, "
                        "larger varlen calls for a larger N; a huge N puts every pair in varlen "
                        "calls)")
    p.add_argument("--packed-dense-after", type=int, default=0, metavar="N",
                   help="--packed: SoftmaxTuning(packed_dense_after=N) in every packed row "
                        "(default 0: dense calls from the first call, the steady state of a "
                        "layout that recurs, as these rows' one layout does; a huge N: what "
                        "training on varied documents runs, every pair varlen)")
    p.add_argument("--packed", action="store_true",
                   help="packed documents (the log-normal mix) instead of one sequence; "
                        "baselines: torch's varlen kernel and our op on one GPU (batch 1)")
    p.add_argument("--no-torch-cp", action="store_true")
    p.add_argument("--no-yunchang", action="store_true")
    p.add_argument("--comm-variants", nargs="+", default=["default"],
                   choices=[v for v in COMM_VARIANTS if v != "side0"],
                   help="rows per communication setting, side by side: 'default' (a plain "
                        "dist.new_group), 'nccl-hp' (the CP group's NCCL kernels on a "
                        "high-priority stream: new_cp_group with CPGroupOptions("
                        "high_priority_stream=True)); impl suffix '+VARIANT'")
    p.add_argument("--host-profile", type=int, default=0, metavar="N",
                   help="--packed: also cProfile N eager fwd+bwd calls of every packed row at "
                        "the first T_local (every rank runs them, rank 0 prints where Python's "
                        "time goes, by cumulative time: the host side of a host-bound row)")
    p.add_argument("--profile", metavar="DIR",
                   help="also write a torch-profiler Chrome trace of one fwd+bwd step per run "
                        "(first T_local) to DIR and print its top kernels: the timeline that "
                        "shows what overlaps what")
    return p


def _runs(a, world, H):
    """(impl name, kwargs of context_parallel_attention, communication variant) to time."""
    pairs = PAIRS if a.pairs is None else [tuple(x.split("/")) for x in a.pairs]
    runs = [(f"{f}/{b}" + ("" if c == "default" else f"+{c}"), dict(fwd=f, bwd=b), c)
            for c in a.comm_variants for f, b in pairs]
    if ("ring", "allgather") in pairs:
        for s in a.strides:
            if s == "default":
                continue
            parts = [int(x) for x in s.split(":")]
            kw = dict(fwd="ring", bwd="allgather", heads_k_stride=parts[0])
            if len(parts) == 3:
                kw.update(bwd_head_first_stride=parts[1], bwd_head_last_stride=parts[2])
            runs.append((f"ring/allgather stride={s}", kw, "default"))
    sizes = a.a2a_sizes if a.a2a_sizes is not None else [
        u for u in range(2, world) if world % u == 0 and H % u == 0]
    for preset in a.presets:
        if preset == "a2a_ring":
            runs += [(f"a2a_ring U={u}", dict(preset="a2a_ring", a2a_size=u), "default")
                     for u in sizes]
        elif preset == "auto":
            kw = dict(preset="auto")
            if sizes:
                kw["a2a_size"] = sizes[0]
            runs.append(("auto", kw, "default"))
        else:
            runs.append((preset, dict(preset=preset), "default"))
            if preset == "a2a":     # each chunk count under every communication setting
                runs += [(f"a2a C={c}" + ("" if v == "default" else f"+{v}"),
                          dict(preset="a2a", tuning=SoftmaxTuning(a2a_head_chunks=c)), v)
                         for v in a.comm_variants for c in a.a2a_chunks]
    if a.a2a_direct:
        runs += [(f"{name} direct", dict(kw, tuning=SoftmaxTuning(a2a_direct=True)), v)
                 for name, kw, v in list(runs)
                 if kw.get("preset") in ("a2a", "a2a_ring") and "tuning" not in kw]
    if a.copy_engine:   # every all-to-all row again, its blocks moved by copy engines
        runs += [(f"{name} copy_engine", dict(kw, tuning=replace(
                     kw.get("tuning", SoftmaxTuning()), a2a_transport="copy_engine")), v)
                 for name, kw, v in list(runs) if kw.get("preset") in ("a2a", "a2a_ring")]
    if a.pack_kv:       # the ring pair with K and V as one message per hop, beside it
        runs += _ring_variants(runs, "pack_kv", SoftmaxTuning(pack_kv=True))
    if a.own_last:      # the ring pair with the own block last in its backward, beside it
        runs += _ring_variants(runs, "own_last", SoftmaxTuning(ring_backward_order="own_last"))
    return runs[::-1] if a.reverse_rows else runs


def _ring_variants(runs: list, suffix: str, tuning: SoftmaxTuning) -> list:
    """Rows ``'<name> <suffix>'``: every plain ring/ring row of ``runs`` (no tuning of its own)
    again with ``tuning``."""
    return [(f"{name} {suffix}", dict(kw, tuning=tuning), v) for name, kw, v in runs
            if kw.get("fwd") == "ring" == kw.get("bwd") and "tuning" not in kw]


def _resolved(kw, ctx, q, k, causal):
    """The preset ``auto`` runs for these tensors (its row's ``resolved``)."""
    if kw.get("preset") != "auto" or ctx.world_size == 1:
        return None
    from sp_attention.cost.auto import auto_softmax_preset
    return auto_softmax_preset(ctx, q, k, causal=causal, a2a_size=kw.get("a2a_size")).name


def _anchors(a, world, rank, q, k, v, do, base, ref, fl, timer, dev, groups):
    """The rows of torch's context_parallel and of yunchang's Ulysses (or why not)."""
    B, T, H, D = q.shape
    causal = base["causal"]
    fl_f, fl_fb = fl
    if not a.no_torch_cp:
        try:
            tf, tfb = _torch_cp(world, q, k, v, do, H, causal, timer, dev)
            emit(dict(base, impl="torch_context_parallel", ms_fwd=tf, ms_fwd_bwd=tfb,
                      tflops_per_gpu=fl_fb / tfb / 1e9, tflops_fwd=_per_gpu(fl_f, tf),
                      baseline="single_global", ratio=fl_fb / tfb / 1e9 / ref[1]), a.out, rank)
        except Exception as e:  # noqa: BLE001 - report the peer's failure, keep the run
            emit(dict(base, impl="torch_context_parallel",
                      error=f"{type(e).__name__}: {e}"[:400]), a.out, rank)
    if a.no_yunchang:
        return
    try:
        import yunchang
    except ImportError as e:
        emit(dict(base, impl="yunchang_ulysses", skipped=f"yunchang not installed ({e}); "
                  "pip install yunchang==0.6.4 (pure Python)"), a.out, rank)
        return
    if H % world or k.shape[2] % world:
        emit(dict(base, impl="yunchang_ulysses", skipped=f"yunchang's all-to-all splits heads "
                  f"evenly: H {H} and Hkv {k.shape[2]} must be multiples of P {world}"),
             a.out, rank)
        return
    try:
        tf, tfb, sf, sfb, kernel = _yunchang(groups["default"], world, rank, q, k, v, do,
                                             causal, timer, dev)
    except Exception as e:  # noqa: BLE001 - a failed anchor is a row, not an aborted sweep
        emit(dict(base, impl="yunchang_ulysses", error=f"{type(e).__name__}: {e}"[:400]),
             a.out, rank)
        return
    one_f, one_fb = flops(B, H, T, D, causal, False), flops(B, H, T, D, causal, True)
    single = one_fb / sfb / 1e9
    emit(dict(base, impl="yunchang_single_global", world=1, T_local=T, ms_fwd=sf,
              ms_fwd_bwd=sfb, tflops_per_gpu=single, tflops_fwd=_per_gpu(one_f, sf),
              baseline="self", ratio=1.0, kernel=kernel, version=yunchang.__version__),
         a.out, rank)
    emit(dict(base, impl="yunchang_ulysses", ms_fwd=tf, ms_fwd_bwd=tfb,
              tflops_per_gpu=fl_fb / tfb / 1e9, tflops_fwd=_per_gpu(fl_f, tf),
              baseline="yunchang_single_global", ratio=fl_fb / tfb / 1e9 / single,
              ratio_vs_single_global=fl_fb / tfb / 1e9 / ref[1], kernel=kernel,
              version=yunchang.__version__), a.out, rank)


def _sweep(a, T_local, world, rank, device, dtype, backend, groups, timer, mode):
    """Every row of one T_local."""
    B, H, Hkv, D, causal = a.batch, a.heads, a.kv_heads, a.head_dim, not a.non_causal
    dev = device.type
    T = world * T_local
    g = torch.Generator(device=device).manual_seed(99)   # same global tensors on every rank
    q = torch.randn(B, T, H, D, device=device, dtype=dtype, generator=g)
    k, v = (torch.randn(B, T, Hkv, D, device=device, dtype=dtype, generator=g) for _ in range(2))
    do = torch.randn(B, T, H, D, device=device, dtype=dtype, generator=g)
    base = {"bench": "softmax_cp", "world": world, "B": B, "T_local": T_local, "H": H,
            "Hkv": Hkv, "K": D, "V": D, "dtype": str(dtype).replace("torch.", ""),
            "causal": causal, "layout": "zigzag", "device": device_name(dev), "backend": backend.name,
            "timing": mode}
    ref = {}          # single-GPU baselines (no communication): the global problem, T_local
    for name, Tq in (("single_global", T), ("single_t_local", T_local)):
        tf, tfb = _single_gpu(backend, q[:, :Tq], k[:, :Tq], v[:, :Tq], do[:, :Tq], causal,
                              timer)
        ref[name] = (_per_gpu(flops(B, H, Tq, D, causal, False), tf),
                     flops(B, H, Tq, D, causal, True) / tfb / 1e9)
        emit(dict(base, impl=name, world=1, T_local=Tq, ms_fwd=tf, ms_fwd_bwd=tfb,
                  tflops_per_gpu=ref[name][1], tflops_fwd=ref[name][0], baseline="self",
                  ratio=1.0), a.out, rank)
    fl = (flops(B, H, T, D, causal, False) / world, flops(B, H, T, D, causal, True) / world)
    for layout, (impl, kw, comm) in ((lay, r) for lay in a.layouts for r in _runs(a, world, H)):
        cctx = build_sp_context(groups[comm], layout=layout)
        ql, kl, vl, dol = (shard_sequence(t, cctx, 1).contiguous() for t in (q, k, v, do))
        ql, kl, vl = (t.requires_grad_(True) for t in (ql, kl, vl))

        def step(backward):
            o = context_parallel_attention(ql, kl, vl, ctx=cctx, causal=causal, **kw)
            if backward:
                o.backward(dol)
        try:
            tf, tfb = timer(lambda: step(False), fwd=True), timer(lambda: step(True))
            resolved = _resolved(kw, cctx, ql, kl, causal)
        except (ValueError, RuntimeError) as e:  # e.g. a stride the head count cannot take
            emit(dict(base, impl=impl, comm=comm, layout=layout, error=str(e)[:300]), a.out,
                 rank)
            continue
        if a.profile and T_local == (a.t_local or [T_local])[0]:
            _profile(lambda: step(True), a.profile, impl.replace("/", "-").replace(" ", "_"),
                     rank)
        tp_fb = fl[1] / tfb / 1e9
        row = dict(base, impl=impl, comm=comm, layout=layout, ms_fwd=tf, ms_fwd_bwd=tfb,
                   tflops_per_gpu=tp_fb, baseline="single_global",
                   ratio=tp_fb / ref["single_global"][1],
                   ratio_vs_t_local=tp_fb / ref["single_t_local"][1])
        if tf:
            row.update(tflops_fwd=fl[0] / tf / 1e9,
                       ratio_fwd=fl[0] / tf / 1e9 / ref["single_global"][0])
        if resolved:
            row["resolved"] = resolved
        if (resolved or kw.get("preset")) == "a2a":     # the head chunks it ran in
            row["a2a_chunks"] = head_chunks(H, Hkv, world, kw.get(
                "tuning", SoftmaxTuning()).a2a_head_chunks)
        emit(row, a.out, rank)
    if world > 1:
        _anchors(a, world, rank, q, k, v, do, base, ref["single_global"], fl, timer, dev,
                 groups)
    if a.bracket:       # the baseline again, as warm as the rows after it ran
        tf, tfb = _single_gpu(backend, q, k, v, do, causal, timer)
        emit(dict(base, impl="single_global_end", world=1, T_local=T, ms_fwd=tf, ms_fwd_bwd=tfb,
                  tflops_per_gpu=flops(B, H, T, D, causal, True) / tfb / 1e9,
                  baseline="single_global",
                  drift=flops(B, H, T, D, causal, True) / tfb / 1e9 / ref["single_global"][1]),
             a.out, rank)


def _packed_sweep(a, T_local, world, rank, device, dtype, groups, timer, mode):
    """``--packed``: the rows of one T_local over packed documents (fwd+bwd only)."""
    if a.batch != 1 or a.non_causal:
        raise SystemExit("--packed runs one causal packed row: drop --batch and --non-causal")
    H, Hkv, D, dev = a.heads, a.kv_heads, a.head_dim, device.type
    T = world * T_local
    cu = lognormal_cu(T, random.Random(7))
    lens = [e - s for s, e in zip(cu, cu[1:])]
    fl = sum(flops(1, H, n, D, True, True) for n in lens)          # the global row's fwd+bwd
    g = torch.Generator(device=device).manual_seed(99)
    q, do = (torch.randn(1, T, H, D, device=device, dtype=dtype, generator=g) for _ in range(2))
    k, v = (torch.randn(1, T, Hkv, D, device=device, dtype=dtype, generator=g) for _ in range(2))
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    base = {"bench": "softmax_cp", "packed": True, "docs": len(lens),
            "doc_median": sorted(lens)[len(lens) // 2], "doc_max": max(lens), "world": world,
            "B": 1, "T_local": T_local, "H": H, "Hkv": Hkv, "K": D, "V": D,
            "dtype": str(dtype).replace("torch.", ""), "causal": True, "layout": "zigzag",
            "device": device_name(dev), "timing": mode,
            "packed_dense_after": a.packed_dense_after}
    refs = {}
    if dev == "cuda":                  # torch's varlen kernels on the whole packed row
        from sp_attention.softmax.backend_cuda import flash_varlen_bwd, flash_varlen_fwd
        q0, k0, v0, do0 = (t[0].contiguous() for t in (q, k, v, do))
        n, scale = max(lens), D ** -0.5

        def varlen():
            out, lse = flash_varlen_fwd(q0, k0, v0, cu_t, cu_t, n, n, True, scale)
            flash_varlen_bwd(do0, q0, k0, v0, out, lse, cu_t, cu_t, n, n, True, scale)
        refs["torch_varlen_single_global"] = timer(varlen)
    xs = [t.clone().requires_grad_(True) for t in (q, k, v)]

    def after(tuning=None):             # every packed row: the layout's dense calls from call N
        return replace(tuning or SoftmaxTuning(), packed_dense_after=a.packed_dense_after)

    def single(tuning=None):
        context_parallel_attention(*xs, ctx=None, causal=True, cu_seqlens=cu_t,
                                   tuning=after(tuning)).backward(do)
    refs["single_global_packed"] = timer(single)
    for n_min in a.packed_dense_min:      # the baseline is the fastest one-GPU way
        refs[f"single_global_packed dense_min={n_min}"] = timer(
            lambda n_min=n_min: single(SoftmaxTuning(packed_dense_min=n_min)))
    for name, t in refs.items():
        emit(dict(base, impl=name, world=1, T_local=T, ms_fwd_bwd=t,
                  tflops_per_gpu=fl / t / 1e9, baseline="self", ratio=1.0), a.out, rank)
    best = min(refs, key=refs.get)
    runs = _runs(a, world, H)
    for n_min in a.packed_dense_min:
        runs += _ring_variants(runs, f"dense_min={n_min}",
                               SoftmaxTuning(packed_dense_min=n_min))
    for impl, kw, comm in runs:
        cctx = build_sp_context(groups[comm], layout="zigzag")
        plan = plan_packing(cu_t, cctx)
        ql, kl, vl, dol = (plan.shard(t, cctx.rank, 1).contiguous() for t in (q, k, v, do))
        ql, kl, vl = (t.requires_grad_(True) for t in (ql, kl, vl))

        kw = dict(kw, tuning=after(kw.get("tuning")))

        def step():
            context_parallel_attention(ql, kl, vl, ctx=cctx, causal=True, cu_seqlens=plan,
                                       **kw).backward(dol)
        try:
            t = timer(step)
        except (ValueError, RuntimeError) as e:
            emit(dict(base, impl=impl, comm=comm, error=str(e)[:300]), a.out, rank)
            continue
        if a.profile and T_local == (a.t_local or [T_local])[0]:
            _profile(step, a.profile, "packed_" + impl.replace("/", "-").replace(" ", "_"), rank)
        if a.host_profile and T_local == (a.t_local or [T_local])[0]:
            host_profile(step, f"packed {impl}, T_local {T_local}, rank {rank}",
                         iters=a.host_profile, show=rank == 0)
        tp = fl / world / t / 1e9
        emit(dict(base, impl=impl, comm=comm, ms_fwd_bwd=t, tflops_per_gpu=tp, baseline=best,
                  ratio=tp / (fl / refs[best] / 1e9), local_len=plan.local_len), a.out, rank)


def main() -> None:
    a = _parser().parse_args()
    dev = a.device
    rank, world = init_dist(dev)
    device = torch.device("cuda", torch.cuda.current_device()) if dev == "cuda" else \
        torch.device("cpu")
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if dev == "cuda" else
                                                     torch.float32)
    groups = cp_groups(a.comm_variants, world)
    backend = get_backend(None, device, dtype, a.head_dim)
    mode = a.timing[0] if dev == "cuda" else "eager"   # softmax steps are GPU-bound: one mode

    def timer(fn, fwd=False):
        if fwd and a.fwd_bwd_only:
            return None
        return time_ms(fn, dev, a.warmup, a.iters, a.repeats, mode=mode)

    for T_local in a.t_local or ([8192, 32768] if dev == "cuda" else [64]):
        if a.packed:
            _packed_sweep(a, T_local, world, rank, device, dtype, groups, timer, mode)
        else:
            _sweep(a, T_local, world, rank, device, dtype, backend, groups, timer, mode)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

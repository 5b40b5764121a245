"""Benchmark: packed documents, each rank's softmax program on ONE GPU, against the single-GPU
varlen kernels on the same documents; plus a bf16 correctness check against fp32.

    python benchmarks/packed_pieces.py --t-local 8192 32768 --world 2 --out packed.jsonl
    python benchmarks/packed_pieces.py --dry-run          # CPU, fp64, small: the logic only

Rows (``impl``), per T_local, for one packed row of ``P · T_local`` tokens with log-normal
document lengths (median 1K, σ 1.25, truncated at the row's end; ``docs`` in the row):

* Single-GPU kernels on the whole row, fwd+bwd, every one returning the LSE a CP merge needs:
  ``varlen_attn`` (``torch.nn.attention.varlen.varlen_attn``; torch 2.11 has no
  ``enable_gqa``, so K/V are expanded there), ``flash_varlen`` (the same FlashAttention-2
  kernels through ``aten._flash_attention_forward`` with native GQA: the library's varlen
  call), ``flex`` (compiled FlexAttention with a document causal block mask,
  ``return_lse``), ``cudnn_ragged`` (``aten._cudnn_attention_forward`` with ``cum_seq``, if
  this torch/cuDNN takes ragged input; else an ``error`` row). ``baseline`` = the fastest of
  them; ``dense_cudnn`` (causal attention over the whole row as if one document) is context.
* ``lib_p1_dm<N>``: the public op on the whole row at CP = 1 (one varlen causal call over the
  documents, documents with at least ``N`` query × key tokens as dense calls:
  ``SoftmaxTuning.packed_dense_min``), per ``--dense-min``.
* Per rank ``r`` of a P-rank zigzag plan: ``rank{r}_kernels`` (its own block and the calls on
  the other ranks' travel windows taken from their real shards, with the LSE merges: the rank's
  GPU work without communication), ``rank{r}_ring`` / ``_allgather`` / ``_ring_ag`` (the
  library's packed schedules, hops through torch's fake process group as in
  ``softmax_pieces.py``: collectives return at once, no data moves).

``tflops_per_gpu`` counts document FLOPs (causal, 4·H·D per visible query–key pair, ×3.5 for
fwd+bwd) of the global row ÷ P; ``ratio`` = that ÷ the baseline's (target ≥ 0.95).

Check rows (``check_*``): every rank's kernel program (real data) assembled into the global
out, lse, dq, dk, dv, and the CP = 1 public op, vs an fp32 per-document reference (each
document alone through SDPA in fp32, autograd): relative RMS, also of the baseline kernel, and
the script exits non-zero if the library's error exceeds ``max(2 × baseline's, 1e-2)`` or
anything is not finite.
"""
from __future__ import annotations

import inspect
import math
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import (base_parser, device_name, emit, host_ahead_lost,  # noqa: E402
                               parse_or_summarize, peak_mem_gb, time_ms)
from benchmarks.softmax_pieces import fake_cp_group  # noqa: E402
from sp_attention import SoftmaxTuning, SPContext, context_parallel_attention  # noqa: E402
from sp_attention.planning.packing import causal_work, plan_packing  # noqa: E402
from sp_attention.softmax.backends import get_backend  # noqa: E402
from sp_attention.softmax.merge import merge_blocks_  # noqa: E402
from sp_attention.softmax.naive import packed_attention_reference  # noqa: E402
from sp_attention.softmax.packed_allgather import (packed_allgather_backward,  # noqa: E402
                                                   packed_allgather_forward)
from sp_attention.planning.softmax_packed import (CallPolicy, PackedCall, Pair,  # noqa: E402
                                                  own_calls, step_calls, travel)
from sp_attention.softmax.packed_ring import packed_ring_backward, packed_ring_forward  # noqa
from sp_attention.softmax.varlen import call_backward, call_forward  # noqa: E402
from sp_attention.testing import rel_rms  # noqa: E402

SUMMARY_COLS = ["impl", "world", "rank", "T", "T_local", "docs", "ms_fwd", "ms_fwd_bwd",
                "tflops_per_gpu", "ratio", "peak_mem_gb", "rel_rms", "baseline_rel_rms",
                "error"]


def draw_lengths(T: int, seed: int, median: int = 1024) -> list[int]:
    rng = random.Random(seed)
    out, tot = [], 0
    while tot < T:
        n = max(1, min(T - tot, int(rng.lognormvariate(math.log(median), 1.25))))
        out.append(n)
        tot += n
    return out


def doc_flops(cu, H, D, fwd_bwd: bool) -> float:
    pairs = sum(causal_work(0, b - a) for a, b in zip(cu[:-1], cu[1:]))
    return 4.0 * H * D * pairs * (3.5 if fwd_bwd else 1.0)


# --------------------------------------------------------------------------------------------
# Single-GPU baselines on the whole row
# --------------------------------------------------------------------------------------------

def row_call(cu) -> PackedCall:
    """The library's varlen call over the whole row in its global order, one causal pair per
    document (what a single GPU would run)."""
    return PackedCall(tuple(Pair(a, b - a, a, b - a) for a, b in zip(cu[:-1], cu[1:])), True)


def baselines(q, k, v, do, cu, be, dry: bool, cudnn_ragged: bool = False) -> dict:
    """``{name: (fwd, fwd_bwd)}`` of the single-GPU kernels on the whole row (module doc)."""
    group = q.shape[2] // k.shape[2]
    cu_t = torch.tensor(cu, dtype=torch.int32, device=q.device)
    max_len = max(b - a for a, b in zip(cu[:-1], cu[1:]))
    out: dict = {}
    call = row_call(cu)

    def lib_fwd():
        return call_forward(be, q, k, v, call, None)

    def lib_fb():
        o, l_ = lib_fwd()
        call_backward(be, do, q, k, v, o, l_, call, None)
    out["flash_varlen" if not dry else "math_varlen"] = (lib_fwd, lib_fb)
    if dry:
        return out
    out["varlen_attn"] = _safe(lambda: _varlen_attn(q, k, v, do, cu_t, max_len, group))
    out["flex"] = _safe(lambda: _flex(q, k, v, do, cu))
    if cudnn_ragged:
        out["cudnn_ragged"] = _safe(lambda: _cudnn_ragged(q, k, v, do, cu_t, max_len))
    return out


def _safe(make):
    """``make()``, or a pair of calls raising what it raised (an error row, not a crash)."""
    try:
        return make()
    except Exception as e:  # noqa: BLE001 - a kernel this torch lacks is a row
        def fail(e=e):
            raise e
        return fail, fail


def _varlen_attn(q, k, v, do, cu_t, max_len, group):
    from torch.nn.attention import varlen as tv
    params = inspect.signature(tv.varlen_attn).parameters
    gqa = "enable_gqa" in params
    kx = k if gqa else k.repeat_interleave(group, dim=2)
    vx = v if gqa else v.repeat_interleave(group, dim=2)
    q3, k3, v3, do3 = (t[0].detach().requires_grad_(True) for t in (q, kx, vx, do))
    kw = dict(return_aux=tv.AuxRequest(lse=True))
    if gqa:
        kw["enable_gqa"] = True
    if "is_causal" in params:
        kw["is_causal"] = True
    else:
        kw["window_size"] = (-1, 0)

    def va_fwd():
        return tv.varlen_attn(q3, k3, v3, cu_t, cu_t, max_len, max_len, **kw)

    def va_fb():
        o, _ = va_fwd()
        torch.autograd.grad(o, (q3, k3, v3), do3)
    return va_fwd, va_fb


def _flex(q, k, v, do, cu):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    T = q.shape[1]
    doc = torch.zeros(T, dtype=torch.int32, device=q.device)
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        doc[a:b] = i

    def mask(b, h, qi, ki):
        return (doc[qi] == doc[ki]) & (ki <= qi)
    bm = create_block_mask(mask, None, None, T, T, device=q.device)
    fn = torch.compile(flex_attention, dynamic=False)
    qh, kh, vh = (t.transpose(1, 2).detach().requires_grad_(True) for t in (q, k, v))
    doh = do.transpose(1, 2)

    def fwd():
        return fn(qh, kh, vh, block_mask=bm, enable_gqa=True, return_lse=True)

    def fb():
        o, _ = fwd()
        torch.autograd.grad(o, (qh, kh, vh), doh)
    return fwd, fb


def _cudnn_ragged(q, k, v, do, cu_t, max_len):
    q3, k3, v3, do3 = (t[0] for t in (q, k, v, do))

    def fwd():
        return torch.ops.aten._cudnn_attention_forward(
            q3, k3, v3, None, cu_t, cu_t, max_len, max_len, True, 0.0, True, False)

    def fb():
        r = fwd()
        torch.ops.aten._cudnn_attention_backward(
            do3, q3, k3, v3, r[0], r[1], r[6], r[7], None, cu_t, cu_t, max_len, max_len, 0.0,
            True)
    return fwd, fb


# --------------------------------------------------------------------------------------------
# A rank's packed program without communication, on real data
# --------------------------------------------------------------------------------------------

def rank_kernels(plan, r, shards, be, policy):
    """``(fwd, bwd)`` of rank r's own calls and its calls on every other rank's travel window
    (from their real shards), with the merges: ``fwd() -> (out, lse)``; ``bwd(out, lse) ->
    (dq, dk_own, dv_own, {src: (dk_window, dv_window)})``."""
    q, k, v, do = shards[r]
    tr = travel(plan)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    srcs = [(s, step_calls(plan, r, s, policy)) for s in range(plan.world_size) if s != r]
    srcs = [(s, c) for s, c in srcs if c]

    def window(s):
        a = tr.starts[s]
        return shards[s][1][:, a:a + tr.length], shards[s][2][:, a:a + tr.length]

    def fwd():
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), -math.inf, dtype=acc,
                         device=q.device)
        for c in own_calls(plan, r, policy):
            rows = slice(c.q_start, c.q_stop)
            o, l_ = call_forward(be, q[:, rows], k[:, rows], v[:, rows], c, None)
            out[:, rows].copy_(o)
            lse[:, :, rows].copy_(l_)
        for s, calls in srcs:
            kw, vw = window(s)
            for c in calls:
                rows, keys = slice(c.q_start, c.q_stop), slice(c.k_start, c.k_stop)
                o, l_ = call_forward(be, q[:, rows], kw[:, keys], vw[:, keys], c, None)
                merge_blocks_(out[:, rows], lse[:, :, rows], o, l_)
        return out.to(q.dtype), lse

    def bwd(out, lse):
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        for c in own_calls(plan, r, policy):
            rows = slice(c.q_start, c.q_stop)
            g = call_backward(be, do[:, rows], q[:, rows], k[:, rows], v[:, rows],
                              out[:, rows], lse[:, :, rows], c, None)
            dq[:, rows] += g[0]
            dk[:, rows] += g[1]
            dv[:, rows] += g[2]
        other = {}
        for s, calls in srcs:
            kw, vw = window(s)
            dkw = torch.zeros(kw.shape, dtype=acc, device=q.device)
            dvw = torch.zeros(vw.shape, dtype=acc, device=q.device)
            for c in calls:
                rows, keys = slice(c.q_start, c.q_stop), slice(c.k_start, c.k_stop)
                g = call_backward(be, do[:, rows], q[:, rows], kw[:, keys], vw[:, keys],
                                  out[:, rows], lse[:, :, rows], c, None)
                dq[:, rows] += g[0]
                dkw[:, keys] += g[1]
                dvw[:, keys] += g[2]
            other[s] = (dkw, dvw)
        return dq, dk, dv, other
    return fwd, bwd


def assemble(plan, progs, shape_q, shape_k, device):
    """Every rank's kernel program → global out, lse, dq, dk, dv (fp32/fp64)."""
    tr = travel(plan)
    res = [fwd() for fwd, _ in progs]
    grads = [bwd(*res[r]) for r, (_, bwd) in enumerate(progs)]
    dks = [g[1].clone() for g in grads]
    dvs = [g[2].clone() for g in grads]
    for r, g in enumerate(grads):
        for s, (dkw, dvw) in g[3].items():
            a = tr.starts[s]
            dks[s][:, a:a + tr.length] += dkw
            dvs[s][:, a:a + tr.length] += dvw
    return (plan.unshard([o for o, _ in res]), plan.unshard([l_ for _, l_ in res], dim=2),
            plan.unshard([g[0] for g in grads]), plan.unshard(dks), plan.unshard(dvs))


def reference(q, k, v, do, cu, dry: bool):
    """fp32 (fp64 in the dry run) per-document reference: out, dq, dk, dv (and lse when the
    reference computes it)."""
    dt = torch.float64 if dry else torch.float32
    qg, kg, vg = (t.to(dt).detach().requires_grad_(True) for t in (q, k, v))
    if dry:
        o, lse = packed_attention_reference(qg, kg, vg, cu)
    else:
        group = q.shape[2] // k.shape[2]
        outs = []
        for a, b in zip(cu[:-1], cu[1:]):
            qh = qg[:, a:b].transpose(1, 2)
            kh = kg[:, a:b].repeat_interleave(group, 2).transpose(1, 2)
            vh = vg[:, a:b].repeat_interleave(group, 2).transpose(1, 2)
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                qh, kh, vh, is_causal=True).transpose(1, 2))
        o, lse = torch.cat(outs, 1), None
    o.backward(do.to(dt))
    return o.detach(), lse, qg.grad, kg.grad, vg.grad


# --------------------------------------------------------------------------------------------

def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--world", type=int, nargs="+", default=[2])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dense-min", type=int, nargs="+",
                   default=[1 << 20, 1 << 18, 1 << 22, 1 << 60],
                   help="packed_dense_min values of the CP = 1 rows; the first also runs the "
                        "rank programs (default first: SoftmaxTuning's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention (compiles)")
    p.add_argument("--cudnn-ragged", action="store_true",
                   help="also try aten._cudnn_attention_forward with cum_seq (torch's own "
                        "varlen_attn keeps it off; run it in a process of its own)")
    p.add_argument("--baselines-only", action="store_true",
                   help="only the single-GPU kernel rows (e.g. with --cudnn-ragged)")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, fp64, small shapes, one iteration: checks the logic")
    a = parse_or_summarize(p, SUMMARY_COLS)
    if a is None:
        return
    if a.dry_run:
        a.device, a.dtype, a.warmup, a.iters, a.repeats = "cpu", "float64", 0, 1, 1
        a.heads, a.kv_heads, a.head_dim = 4, 2, 8
        a.t_local = a.t_local or [48]
        a.world = [w for w in a.world if w <= 4] or [2]
        a.dense_min = [256, 1 << 60]
    failures = []
    for P in a.world:
        for T_local in a.t_local or [8192, 32768]:
            failures += run_one(a, P, T_local)
    if failures:
        print("FAILED: " + "; ".join(failures), file=sys.stderr)
        sys.exit(1)


def run_one(a, P: int, T_local: int) -> list[str]:
    dry = a.dry_run
    dev = a.device
    device = torch.device("cuda", 0) if dev == "cuda" else torch.device("cpu")
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if dev == "cuda"
                                                     else torch.float32)
    H, Hkv, D, T = a.heads, a.kv_heads, a.head_dim, P * T_local
    be = get_backend(None, device, dtype, D)
    lengths = draw_lengths(T, a.seed + T, 8 if dry else 1024)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    g = torch.Generator(device=device).manual_seed(7)
    q, do = (torch.randn(1, T, H, D, device=device, dtype=dtype, generator=g) for _ in range(2))
    k, v = (torch.randn(1, T, Hkv, D, device=device, dtype=dtype, generator=g) for _ in range(2))
    mode = a.timing[-1] if dev == "cuda" else "eager"
    timer = (lambda fn: time_ms(fn, dev, a.warmup, a.iters, a.repeats, mode=mode))
    fl, fl_fwd = doc_flops(cu, H, D, True), doc_flops(cu, H, D, False)
    base = {"bench": "packed_pieces", "world": P, "B": 1, "T_local": T_local, "T": T, "H": H,
            "Hkv": Hkv, "K": D, "dtype": str(dtype).replace("torch.", ""), "docs": len(lengths),
            "device": device_name(dev), "backend": be.name, "timing": mode, "layout": "zigzag"}
    # single-GPU kernels on the whole row
    best = best_fwd = 0.0
    for name, (fwd, fb) in baselines(q, k, v, do, cu, be, dry, a.cudnn_ragged).items():
        if name == "flex" and a.no_flex:
            continue
        try:
            tf, tfb = timer(fwd), timer(fb)
        except Exception as e:  # noqa: BLE001 - an unsupported kernel is a row, not a crash
            emit(dict(base, impl=name, error=f"{type(e).__name__}: {str(e)[:200]}"), a.out, 0)
            continue
        best = max(best, fl / tfb / 1e9)
        best_fwd = max(best_fwd, fl_fwd / tf / 1e9)
        emit(dict(base, impl=name, world=1, ms_fwd=tf, ms_fwd_bwd=tfb,
                  tflops_per_gpu=fl / tfb / 1e9, tflops_fwd=fl_fwd / tf / 1e9,
                  peak_mem_gb=peak_mem_gb(fb, dev)), a.out, 0)
    if not dry:
        def dense():
            o, l_ = be.forward(q, k, v, True, None)
            be.backward(do, q, k, v, o, l_, True, None)
        td = timer(dense)
        emit(dict(base, impl="dense_cudnn", world=1, ms_fwd_bwd=td,
                  tflops_per_gpu=4 * H * D * T * T / 2 * 3.5 / td / 1e9,
                  note="whole row as one document (not the packed problem)"), a.out, 0)
    emit(dict(base, impl="baseline", world=1, tflops_per_gpu=best, tflops_fwd=best_fwd),
         a.out, 0)
    if a.baselines_only:
        return []

    def row(name, tf, tfb, peak, **extra):
        tp = fl / P / tfb / 1e9
        emit(dict(base, impl=name, ms_fwd=tf, ms_fwd_bwd=tfb, tflops_per_gpu=tp,
                  ratio=tp / best, ratio_fwd=fl_fwd / P / tf / 1e9 / best_fwd,
                  peak_mem_gb=peak, host_ahead_lost=host_ahead_lost(), **extra), a.out, 0)
    # CP = 1: the public op on the whole row, per dense threshold
    plan1 = plan_packing(cu, 1)
    leaves = [plan1.shard(t, 0).requires_grad_(True) for t in (q, k, v)]
    do1 = plan1.shard(do, 0)
    for dm in a.dense_min:
        tun = SoftmaxTuning(packed_dense_min=dm, packed_dense_after=0)   # dense from call 1

        def op(tun=tun):
            return context_parallel_attention(*leaves, cu_seqlens=plan1, tuning=tun)

        def op_fb(op=op):
            torch.autograd.grad(op(), leaves, do1)
        tp = fl / timer(op_fb) / 1e9
        emit(dict(base, world=1, impl=f"lib_p1_dm{dm}", ms_fwd=timer(op),
                  ms_fwd_bwd=fl / tp / 1e9, tflops_per_gpu=tp, ratio=tp / best,
                  peak_mem_gb=peak_mem_gb(op_fb, dev)), a.out, 0)
    failures, base_err = check(a, base, q, k, v, do, cu, plan1, be, P, dry)
    # per rank of a P-rank plan
    plan = plan_packing(cu, P)
    pol = CallPolicy(a.dense_min[0])
    shards = [[plan.shard(t, r) for t in (q, k, v, do)] for r in range(P)]
    progs = [rank_kernels(plan, r, shards, be, pol) for r in range(P)]
    with fake_cp_group(P) as group:
        for r in range(P):
            ql, kl, vl, dol = shards[r]
            fwd, bwd = progs[r]
            o, l_ = fwd()
            ctx = SPContext(group, r, P, tuple(range(P)), "zigzag")
            stride = max(1, min(2, Hkv))
            programs = {
                "kernels": (fwd, lambda: bwd(o, l_)),
                "ring": (lambda: packed_ring_forward(ql, kl, vl, ctx, plan, be, scale=None,
                                                     policy=pol),
                         lambda: packed_ring_backward(dol, ql, kl, vl, o, l_, ctx, plan, be,
                                                      scale=None, policy=pol)),
                "allgather": (lambda: packed_allgather_forward(
                    ql, kl, vl, ctx, plan, be, scale=None, heads_k_stride=stride, policy=pol),
                    lambda: packed_allgather_backward(dol, ql, kl, vl, o, l_, ctx, plan, be,
                                                      scale=None, heads_k_stride=stride,
                                                      policy=pol))}
            programs["ring_ag"] = (programs["ring"][0], programs["allgather"][1])
            for name, (f, b) in programs.items():
                def fb(f=f, b=b):
                    f()
                    b()
                row(f"rank{r}_{name}", timer(f), timer(fb), peak_mem_gb(fb, dev), rank=r,
                    travel_len=travel(plan).length, crossing=len(plan.crossing_docs),
                    **({"comm": "fake_pg"} if name != "kernels" else {}))
    failures += check_ranks(a, base, q, k, v, do, cu, plan, progs, dry, "", base_err)
    # the same calls without gaps inside varlen calls (SoftmaxTuning.packed_varlen_gaps=False)
    no_gaps = [rank_kernels(plan, r, shards, be, CallPolicy(pol.dense_min, False))
               for r in range(P)]
    return failures + check_ranks(a, base, q, k, v, do, cu, plan, no_gaps, dry, "_nogaps",
                                  base_err)


_REF: dict = {}


def _ref(q, k, v, do, cu, dry):
    key = (q.shape, tuple(cu))
    if key not in _REF:
        _REF.clear()
        _REF[key] = reference(q, k, v, do, cu, dry)
    return _REF[key]


def _compare(a, base, name, got, ref, base_err, dry) -> list[str]:
    tol = 1e-10 if dry else None
    fails = []
    for what, x, y in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        if x is None or y is None:
            continue
        finite = bool(torch.isfinite(x[torch.isfinite(y)]).all())
        err = rel_rms(torch.where(torch.isfinite(y), x, 0), torch.where(torch.isfinite(y), y, 0))
        be_ = base_err.get(what)
        lim = tol if dry else max(2 * (be_ or 0.0), 1e-2)
        ok = finite and err <= lim
        emit(dict(base, impl=f"check_{name}_{what}", rel_rms=err, baseline_rel_rms=be_,
                  limit=lim, finite=finite, ok=ok), a.out, 0)
        if not ok:
            fails.append(f"{name} {what} rel_rms {err:.2e} > {lim:.1e} (finite={finite})")
    return fails


def check(a, base, q, k, v, do, cu, plan1, be, P, dry) -> tuple[list[str], dict]:
    """The CP = 1 public op and the baseline kernel vs the fp32 reference: (failures, the
    baseline's errors)."""
    ref = _ref(q, k, v, do, cu, dry)
    call = row_call(cu)                     # the single-GPU varlen kernel on the row
    o, l_ = call_forward(be, q, k, v, call, None)
    g = call_backward(be, do, q, k, v, o, l_, call, None)
    base_err = {what: rel_rms(x, y) for what, x, y in
                zip(("out", "dq", "dk", "dv"), (o, *g), (ref[0], *ref[2:]))}
    emit(dict(base, impl="baseline_error", **{f"rel_rms_{n}": e for n, e in base_err.items()}),
         a.out, 0)
    fails = [f"baseline {n} rel_rms {e:.2e}" for n, e in base_err.items()
             if not e <= (1e-10 if dry else 2e-2)]
    leaves = [plan1.shard(t, 0).requires_grad_(True) for t in (q, k, v)]
    o, l_ = context_parallel_attention(*leaves, cu_seqlens=plan1, return_lse=True)
    grads = torch.autograd.grad(o, leaves, plan1.shard(do, 0))
    got = (plan1.unshard([o]), plan1.unshard([l_], dim=2), *(plan1.unshard([g]) for g in grads))
    return fails + _compare(a, base, "lib_p1", got, ref, base_err, dry), base_err


def check_ranks(a, base, q, k, v, do, cu, plan, progs, dry, tag, base_err) -> list[str]:
    """Every rank's kernel program, assembled, vs the fp32 reference."""
    ref = _ref(q, k, v, do, cu, dry)
    got = assemble(plan, progs, q.shape, k.shape, q.device)
    return _compare(a, base, f"ranks_p{plan.world_size}{tag}", got, ref, base_err, dry)


if __name__ == "__main__":
    main()

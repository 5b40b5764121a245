"""GPU check and benchmark of gated (per-token) decay on ONE GPU: correctness, then speed.

    python benchmarks/gated_check.py --out-dir $OUT                 # on the H200
    python benchmarks/gated_check.py --out-dir $OUT --phases fp32   # a second call
    python benchmarks/gated_check.py --dry-run                      # CPU: the logic, tiny shapes

Most of a first run is fla's autotuning of its gated kernels (a new key per dtype: dozens of
configs each); the ``seeds`` phase saves what it found, so later runs (or users, once shipped)
skip it.

Phases (``--phases``; the default runs perf, bf16, seeds in this order):

``sweep``  every launch config of our ``chunk_dqkdg`` (one and two K tiles) and of
           ``decayed_state_sum`` (gated and fixed) at the perf shape: time and error (to
           choose the tuned sets).
``perf``   bf16, B 1, H 16, K = V 128, T ``--t`` (32K): fla ``chunk_simple_gla`` forward with
           ``g`` and with ``g_gamma`` (fwd+bwd too: fla 0.6.0 refuses the gated backward on
           Hopper with Triton < 3.7.1, fla #640), each kernel of our gated path beside the
           fla kernel it stands for, and the assembled one-leaf gated step (fwd, fwd+bwd;
           gradients by ``torch.autograd.grad``, no ``.grad`` accumulation, for ours and fla
           alike).
           Runs first so that the autotuners pick their configs at the timed shape.
``profile`` torch.profiler tables of our P = 1 gated fwd+bwd and fla's fixed-slope one
           (CUDA time per kernel).
``bf16``   T 4096 at the perf shape (the configs just tuned): fla's gated kernels and ours
           against fp64 torch references, and the one-leaf step (with an incoming state and
           an arriving gradient) against fla's own ``naive_recurrent_simple_gla`` in fp32 by
           autograd; every launch config of our three kernels forced once.
``fp32``   the same at small shapes (T 300 and 64: partial and whole chunks, K = V 128) in
           fp32: our kernels fed exact states within 1e-5 (IEEE fp32 dots), fla's
           gated kernels within their TF32 error.
``seeds``  the Triton autotune results this run made, as ``gated_autotune.tgz`` in
           ``--out-dir`` (to ship beside ``sp_attention/linear/tuned``).

Every measurement is one JSON line (stdout and ``--out-dir/gated_check.jsonl``); a failed
check prints its line with ``"ok": false`` and the script exits 1 at the end. Gates per head:
slow (−0.001·u), medium (−0.05·u), fla's test gate (logsigmoid(x)/16) and underflowing
(−30 − u: a chunk's decay is exactly 0).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tarfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

_T0 = time.time()
_FAILED: list = []
_OUT: list = [None]


def emit(rec: dict) -> None:
    rec.setdefault("elapsed_s", round(time.time() - _T0, 1))
    line = json.dumps(rec, sort_keys=True)
    print(line, flush=True)
    if _OUT[0]:
        with open(_OUT[0], "a") as f:
            f.write(line + "\n")


def check(name: str, err: float, tol: float, **kw) -> None:
    ok = bool(err <= tol)       # NaN fails
    if not ok:
        _FAILED.append(name)
    emit(dict(kw, bench="gated_check", check=name, err=err, tol=tol, ok=ok))


def rel(a, b) -> float:
    import torch
    a, b = a.detach().double(), b.detach().double()
    if not torch.isfinite(a).all():
        return float("nan")
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def rel_dg(dg, ref, q, dq_ref) -> float:
    """dg's error relative to the larger of |dg| and the per-token terms q·dq whose
    differences form it (see tests/linear/test_gated_local.py::assert_dg_close)."""
    import torch
    if not torch.isfinite(dg).all():
        return float("nan")
    scale = max(ref.double().norm(), (q.double() * dq_ref.double()).sum(-1).norm())
    return float((dg.double() - ref.double()).norm() / max(scale, 1e-300))


def make_gates(B, T, H, device, gen):
    import torch
    u = torch.rand(B, T, H, device=device, generator=gen)
    x = torch.randn(B, T, H, device=device, generator=gen)
    kinds = [-0.001 * u, -0.05 * u, torch.nn.functional.logsigmoid(x) / 16, -30.0 - u]
    return torch.stack([kinds[h % 4][..., h] for h in range(H)], -1).contiguous()


class Kernels:
    """fla's gated kernels (``fla``) or their pure-torch stand-ins (``torch``, dry runs), with
    our three kernels."""

    def __init__(self, real: bool):
        from sp_attention.linear import gated_naive as gn
        from sp_attention.linear.torch_ops import chunked_gated_core
        from sp_attention.linear.dqk_kernel import chunk_dqkdg
        from sp_attention.linear.gates import gate_sums
        from sp_attention.linear.kernels import decayed_state_sum, output_from_states
        self.real = real
        if real:
            from fla.ops.common.chunk_h import chunk_bwd_dh, chunk_fwd_h
            from fla.ops.common.chunk_o import chunk_bwd_dv, chunk_fwd_o
            self.fwd_h, self.bwd_dh, self.bwd_dv, self.fwd_o = (chunk_fwd_h, chunk_bwd_dh,
                                                                chunk_bwd_dv, chunk_fwd_o)
        else:
            self.fwd_h, self.bwd_dh, self.bwd_dv, self.fwd_o = (
                gn.fla_chunk_fwd_h, gn.fla_chunk_bwd_dh, gn.fla_chunk_bwd_dv, gn.fla_chunk_fwd_o)
        self.gate_sums, self.dqkdg = gate_sums, chunk_dqkdg
        self.output, self.state_sum = output_from_states, decayed_state_sum


def library_kernels(real: bool):
    """The kernel set the library's fla path runs: fla's and ours, or (dry run) the pure-torch
    stand-ins of ``tests/linear/test_fla_gated_packed.py``."""
    if real:
        from sp_attention.linear.kernel_set import fla_kernels
        return fla_kernels()
    sys.path.insert(0, os.path.join(ROOT, "tests", "linear"))
    import test_fla_gated_packed as standins
    standins._no_streams(setattr)
    return standins.fake_kernels()


def leaf_forward(kern, q, k, v, g, S_in, scale):
    """One gated leaf entered with ``S_in`` through the library's multi-leaf fla path
    (:func:`sp_attention.linear.leaves.leaves_output`, the scan replaced by ``S_in``):
    returns (o, b, A) — the end state and transition the scan was handed."""
    from sp_attention.linear.decay import Decay
    from sp_attention.linear.leaves import leaves_output
    seen = {}

    def scan(b, A):
        seen["b"], seen["A"] = b, A
        return S_in
    o, _ = leaves_output(q, k, v, Decay(g=g), scale, scan, kern)
    return o, seen["b"], seen["A"]


def leaf_backward(kern, q, k, v, g, S_in, do, D, scale):
    """(dq, dk, dv, dg, d) of the leaf entered with ``S_in`` whose end receives ``D``, through
    :func:`sp_attention.linear.leaves.leaves_backward` (``d``: what its reverse scan got)."""
    from sp_attention.linear.decay import Decay
    from sp_attention.linear.leaves import leaves_backward
    seen = {}

    def scan(d, A):
        seen["d"] = d
        return D
    grads = leaves_backward(q, k, v, Decay(g=g), scale, S_in, do, scan, kern)
    return (*grads, seen["d"])


def inputs(B, T, H, K, V, dtype, device, seed=0):
    import torch
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v, do = (torch.randn(B, T, H, d, device=device, generator=gen).to(dtype)
                   for d in (K, K, V, V))
    S, D = (torch.randn(B, H, K, V, device=device, generator=gen) for _ in range(2))
    return q, k, v, do, make_gates(B, T, H, device, gen), S, D


def check_kernels(kern, shape, dtype, device, tag, configs):
    """fla's gated kernels and ours vs fp64 references; our kernels fed exact fp64 states."""
    import torch
    from sp_attention.linear import gated_naive as gn
    from sp_attention.linear.torch_ops import chunked_gated_core
    B, T, H, K, V = shape
    q, k, v, do, g, S, D = inputs(B, T, H, K, V, dtype, device)
    scale = K ** -0.5
    f64 = [x.double() for x in (q, k, v, do, g)]
    qd, kd, vd, dod, gd = f64
    kw = dict(phase=tag, dtype=str(dtype).replace("torch.", ""), shape=list(shape))
    tol_fla = 2e-3 if dtype == torch.float32 else 1.5e-2
    tol_ours = 1e-5 if dtype == torch.float32 else 1.5e-2
    gs = kern.gate_sums(g, 64)
    h_ref = gn.gated_chunk_states(kd, vd, gd, 64, S.double())              # from S
    o_ref, S_end = chunked_gated_core(qd, kd, vd, gd, scale, S.double(), 64)
    h, ht = kern.fwd_h(k=k, v=v, g=gs.gc, h0=S, output_final_state=True, chunk_size=64,
                       states_in_fp32=True)
    check("fla chunk_fwd_h(g) states", rel(h, h_ref), tol_fla, **kw)
    check("fla chunk_fwd_h(g) final state", rel(ht, S_end), tol_fla, **kw)
    h0, b = kern.fwd_h(k=k, v=v, g=gs.gc, h0=None, output_final_state=True, chunk_size=64)
    S_end0 = chunked_gated_core(kd, kd, vd, gd, 1.0, None, 64)[1]
    check("fla chunk_fwd_h(g) zero start, final state = b", rel(b, S_end0), tol_fla, **kw)
    check("fla chunk_fwd_o(g)", rel(kern.fwd_o(q=q, k=k, v=v, h=h.to(q.dtype), g=gs.gc,
                                                scale=scale, chunk_size=64), o_ref), tol_fla,
          **kw)
    # chunk-end gradients by the fp64 reference of fla's chunk_bwd_dh
    dh_ref, dS_ref = gn.fla_chunk_bwd_dh(qd, kd, vd, dod, S.double(), D.double(), scale,
                                         g=gs.gc.double())
    dh, dh0 = kern.bwd_dh(q=q, k=k, v=v, do=do, h0=S, dht=D, scale=scale, g=gs.gc,
                          chunk_size=64, states_in_fp32=True)
    check("fla chunk_bwd_dh(g) chunk-end gradients", rel(dh, dh_ref), tol_fla, **kw)
    check("fla chunk_bwd_dh(g) dh0", rel(dh0, dS_ref), tol_fla, **kw)
    ref = gn.dqkdg_ref(qd, kd, vd, dod, h_ref, dh_ref, gd, scale)          # dq, dk, dv, dg
    check("fla chunk_bwd_dv(g)", rel(kern.bwd_dv(q=q, k=k, do=do, dh=dh, g=gs.gc, scale=scale,
                                                 chunk_size=64), ref[2]), tol_fla, **kw)
    # ours, fed exact states (their own error only), every config listed
    h0_ref = gn.gated_chunk_states(kd, vd, gd, 64).float().contiguous()
    for cfg in configs["output"]:
        o = kern.output(q, k, v, h0_ref, S, None, scale, 64, cfg, gates=gs)
        check("ours output_from_states(gates)", rel(o, o_ref), tol_ours, config=cfg, **kw)
    d_ref = gn.gated_state_grad_ref(qd, dod, gd, scale)
    for cfg in configs["state"]:
        d = kern.state_sum(q, do, None, 0, 1, None, scale, cfg, gates=gs)
        check("ours decayed_state_sum(gates)", rel(d, d_ref), tol_ours, config=cfg, **kw)
        bb = kern.state_sum(k, v, None, 0, -1, None, 1.0, cfg, gates=gs)
        check("ours decayed_state_sum(gates) end state", rel(bb, S_end0), tol_ours, config=cfg,
              **kw)
    hf, dhf = h_ref.float().contiguous(), dh_ref.float().contiguous()
    for cfg in configs["dqk"]:
        dq, dk, dg = kern.dqkdg(q, k, v, do, hf, dhf, gs.gc, scale, 64, cfg)
        check("ours chunk_dqkdg dq", rel(dq, ref[0]), tol_ours, config=cfg, **kw)
        check("ours chunk_dqkdg dk", rel(dk, ref[1]), tol_ours, config=cfg, **kw)
        check("ours chunk_dqkdg dg", rel_dg(dg, ref[3], qd, ref[0]), tol_ours, config=cfg,
              **kw)


def check_leaf(kern, shape, dtype, device, tag):
    """The library's one-leaf gated step (multi-leaf fla path) and the public op at world size
    1 vs fla's naive recurrent simple_gla (fp32 autograd): o, the end state, dq, dk, dv, dg
    and dS_in (= d + A·D)."""
    import torch
    B, T, H, K, V = shape
    q, k, v, do, g, S, D = inputs(B, T, H, K, V, dtype, device, seed=1)
    scale = K ** -0.5
    if kern.real:
        from fla.ops.simple_gla.naive import naive_recurrent_simple_gla as naive
    else:
        from sp_attention.linear.gated_naive import recurrent_gated_attention

        def naive(q, k, v, g, scale, initial_state, output_final_state):
            return recurrent_gated_attention(q, k, v, g, scale=scale, initial_state=initial_state,
                                             output_final_state=output_final_state)
    xs = [x.detach().float().requires_grad_(True) for x in (q, k, v, g, S)]
    o_r, S_r = naive(*xs[:4], scale=scale, initial_state=xs[4], output_final_state=True)
    grads = torch.autograd.grad((o_r * do.float()).sum() + (S_r * D).sum(), xs)
    lib = library_kernels(kern.real)
    o, b, A = leaf_forward(lib, q, k, v, g, S, scale)
    dq, dk, dv, dg, d = leaf_backward(lib, q, k, v, g, S, do, D, scale)
    kw = dict(phase=tag, dtype=str(dtype).replace("torch.", ""), shape=list(shape))
    tol = 2e-3 if dtype == torch.float32 else 1.5e-2
    check("leaf o vs fla naive fp32", rel(o, o_r), tol, **kw)
    check("leaf end state A·S_in + b vs fla naive", rel(A[..., None, None] * S + b, S_r), tol,
          **kw)
    for name, x, r in (("dq", dq, grads[0]), ("dk", dk, grads[1]), ("dv", dv, grads[2])):
        check(f"leaf {name} vs fla naive fp32", rel(x, r), tol, **kw)
    check("leaf dg vs fla naive fp32", rel_dg(dg, grads[3], xs[0].detach(), grads[0]), tol, **kw)
    check("leaf dS_in = d + A·D vs fla naive", rel(d + A[..., None, None] * D, grads[4]), tol,
          **kw)
    if kern.real:      # the public op, one leaf (fla's forward, our gated backward)
        from sp_attention.linear import lightning_attention
        ys = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g)]
        o_r0, _ = naive(*xs[:4], scale=scale, initial_state=None, output_final_state=False)
        g0 = torch.autograd.grad((o_r0 * do.float()).sum(), xs[:4])
        o1 = lightning_attention(*ys[:3], g=ys[3], scale=scale)
        o1.backward(do.to(o1.dtype))
        check("op o vs fla naive fp32", rel(o1, o_r0), tol, **kw)
        for name, x, r in zip(("dq", "dk", "dv"), ys[:3], g0[:3]):
            check(f"op {name} vs fla naive fp32", rel(x.grad, r), tol, **kw)
        check("op dg vs fla naive fp32", rel_dg(ys[3].grad, g0[3], xs[0].detach(), g0[0]), tol,
              **kw)


def timer(fn, device, a):
    from benchmarks.common import time_ms
    fn()
    if device == "cuda":
        import torch
        torch.cuda.synchronize()
    return time_ms(fn, device, a.warmup, a.iters, a.repeats,
                   mode="queued" if device == "cuda" else "eager")


def grads_of(out, inputs, grad):
    """Gradients by ``torch.autograd.grad``: the op's own backward, without ``.grad``
    accumulation (three or four extra memory-bound adds per call that fla's composed
    baseline does not run either)."""
    import torch
    return torch.autograd.grad(out, inputs, grad)


def perf(kern, a, device, dtype):
    """Per-kernel and one-leaf step times at the perf shape (queued timing on CUDA)."""
    import torch
    B, H, K, V, T = 1, a.heads, a.head_dim, a.head_dim, a.t
    q, k, v, do, g, S, D = inputs(B, T, H, K, V, dtype, device, seed=2)
    scale = K ** -0.5
    slopes = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)], device=device)
    gg = (-slopes / math.log(2)).contiguous()
    base = dict(bench="gated_check", phase="perf", T=T, H=H, K=K, dtype=str(dtype)[6:],
                timing="queued" if device == "cuda" else "eager")
    rows = {}

    def row(name, fn, **kw):
        rows[name] = timer(fn, device, a)
        emit(dict(base, impl=name, ms=rows[name], **kw))
    from benchmarks import common
    if kern.real:
        from fla.ops.common.chunk_o import chunk_bwd_dqkwg
        from fla.ops.simple_gla import chunk_simple_gla
        from fla.ops.utils import chunk_local_cumsum
        qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))
        row("fla fwd g", lambda: chunk_simple_gla(q, k, v, g=g, scale=scale))
        row("fla fwd g_gamma", lambda: chunk_simple_gla(q, k, v, g_gamma=-slopes, scale=scale))
        row("fla fwd+bwd g_gamma", lambda: grads_of(chunk_simple_gla(
            qg, kg, vg, g_gamma=-slopes, scale=scale)[0], (qg, kg, vg), do))
        row("fla chunk_local_cumsum", lambda: chunk_local_cumsum(g, 64, scale=1 / math.log(2)))
    gs = kern.gate_sums(g, 64)
    from sp_attention.linear.gates import chunk_local_sums
    row("ours chunk_local_sums", lambda: chunk_local_sums(g, 64))     # all one leaf needs
    row("ours gate_sums", lambda: kern.gate_sums(g, 64))              # + prefixes, totals
    h0, _ = kern.fwd_h(k=k, v=v, g=gs.gc, h0=None, output_final_state=True, chunk_size=64)
    h0 = h0.contiguous()
    row("fla chunk_fwd_h(g)", lambda: kern.fwd_h(k=k, v=v, g=gs.gc, h0=None,
                                                output_final_state=True, chunk_size=64))
    row("fla chunk_fwd_o(g)", lambda: kern.fwd_o(q=q, k=k, v=v, h=h0, g=gs.gc, scale=scale,
                                                chunk_size=64))
    row("ours output_from_states(gates)",
        lambda: kern.output(q, k, v, h0, S, None, scale, 64, gates=gs))
    if kern.real:
        row("ours output_from_states(g_gamma)",
            lambda: kern.output(q, k, v, h0, S, gg, scale, 64))
    row("ours decayed_state_sum(gates)",
        lambda: kern.state_sum(q, do, None, 0, 1, None, scale, gates=gs))
    dh, _ = kern.bwd_dh(q=q, k=k, v=v, do=do, h0=None, dht=D, scale=scale, g=gs.gc,
                        chunk_size=64, states_in_fp32=True)
    h, _ = kern.fwd_h(k=k, v=v, g=gs.gc, h0=S, output_final_state=False, chunk_size=64,
                      states_in_fp32=True)
    row("fla chunk_bwd_dh(g)", lambda: kern.bwd_dh(q=q, k=k, v=v, do=do, h0=None, dht=D,
                                                  scale=scale, g=gs.gc, chunk_size=64,
                                                  states_in_fp32=True))
    row("fla chunk_bwd_dv(g)", lambda: kern.bwd_dv(q=q, k=k, do=do, dh=dh, g=gs.gc, scale=scale,
                                                  chunk_size=64))
    row("ours chunk_dqkdg", lambda: kern.dqkdg(q, k, v, do, h, dh, gs.gc, scale))
    if kern.real:      # the kernel ours stands in for, as fla runs it with fixed slopes
        row("fla chunk_bwd_dqkwg(g_gamma)", lambda: chunk_bwd_dqkwg(
            q=q, k=k, v=v, do=do, h=h, dh=dh, g_gamma=gg, scale=scale, chunk_size=64))
        row("fla chunk_bwd_dqkwg(g) timing only",
            lambda: common.fla_gated_dqkwg_timing_only(q, k, v, do, h, dh, gs.gc, scale))

        def fla_bwd_g():      # chunk_simple_gla_bwd with g, its steps in its order
            hh, _ = kern.fwd_h(k=k, v=v, g=gs.gc, h0=None, output_final_state=False,
                               chunk_size=64, states_in_fp32=True)
            dhh, _ = kern.bwd_dh(q=q, k=k, v=v, do=do, h0=None, dht=None, scale=scale,
                                 g=gs.gc, chunk_size=64, states_in_fp32=True)
            common.fla_gated_dqkwg_timing_only(q, k, v, do, hh, dhh, gs.gc, scale)
            kern.bwd_dv(q=q, k=k, do=do, dh=dhh, g=gs.gc, scale=scale, chunk_size=64)
        row("fla bwd g composed (dqkwg timing only)", fla_bwd_g)
    from sp_attention.linear import lightning_attention
    backend = "fla" if kern.real else "torch"
    ys = [x.clone().requires_grad_(True) for x in (q, k, v, g)]
    row("ours P=1 fwd g", lambda: lightning_attention(q, k, v, g=g, scale=scale,
                                                      backend=backend))
    row("ours P=1 fwd+bwd g", lambda: grads_of(lightning_attention(
        *ys[:3], g=ys[3], scale=scale, backend=backend), ys, do))
    row("ours P=1 fwd slopes", lambda: lightning_attention(q, k, v, slopes, scale=scale,
                                                           backend=backend))
    row("ours P=1 fwd+bwd slopes", lambda: grads_of(lightning_attention(
        *ys[:3], slopes, scale=scale, backend=backend), ys[:3], do))
    if kern.real:
        emit(dict(base, impl="summary",
                  p1_fwd_g_vs_fla=rows["ours P=1 fwd g"] / rows["fla fwd g"],
                  p1_fwd_slopes_vs_fla=rows["ours P=1 fwd slopes"] / rows["fla fwd g_gamma"],
                  p1_fwd_bwd_slopes_vs_fla=rows["ours P=1 fwd+bwd slopes"]
                  / rows["fla fwd+bwd g_gamma"],
                  p1_fwd_bwd_g_vs_fla_g_gamma=rows["ours P=1 fwd+bwd g"]
                  / rows["fla fwd+bwd g_gamma"],
                  p1_fwd_bwd_g_vs_fla_g_composed=rows["ours P=1 fwd+bwd g"]
                  / (rows["fla fwd g"] + rows["fla bwd g composed (dqkwg timing only)"]),
                  dqkdg_vs_fla_g=rows["ours chunk_dqkdg"]
                  / rows["fla chunk_bwd_dqkwg(g) timing only"]))


def sweep(kern, a, device, dtype):
    """Every launch config of ``chunk_dqkdg`` (:data:`DQK_CANDIDATES`) with one and two K
    tiles at the perf shape: time, and the error against the fp32 (IEEE dots) result."""
    import torch
    from sp_attention.linear.dqk_kernel import DQK_CANDIDATES
    B, H, K, V, T = 1, a.heads, a.head_dim, a.head_dim, a.t
    q, k, v, do, g, S, D = inputs(B, T, H, K, V, dtype, device, seed=3)
    scale = K ** -0.5
    gs = kern.gate_sums(g, 64)
    h, _ = kern.fwd_h(k=k, v=v, g=gs.gc, h0=S, output_final_state=False, chunk_size=64,
                      states_in_fp32=True)
    dh, _ = kern.bwd_dh(q=q, k=k, v=v, do=do, h0=None, dht=D, scale=scale, g=gs.gc,
                        chunk_size=64, states_in_fp32=True)
    ref = kern.dqkdg(*(x.float() for x in (q, k, v, do)), h, dh, gs.gc, scale, config=0)
    base = dict(bench="gated_check", phase="sweep", T=T, H=H, K=K, dtype=str(dtype)[6:],
                timing="queued" if device == "cuda" else "eager")
    if "state" in a.sweep:
        _sweep_state_sum(kern, a, device, (q, k, v, do), gs, scale, base)
    if "dqk" not in a.sweep:
        return
    from sp_attention.linear.dqk_kernel import MIN_BLOCK_K
    for bk in (None, K // 2) if K // 2 >= MIN_BLOCK_K else (None,):   # no K tile below 32
        for i, cfg in enumerate(DQK_CANDIDATES):
            rec = dict(base, config=i, block_k=bk or min(K, 128), BV=cfg.kwargs["BV"],
                       dk_rows=cfg.kwargs["DK_ROWS"], warps=cfg.num_warps,
                       stages=cfg.num_stages)
            try:
                out = kern.dqkdg(q, k, v, do, h, dh, gs.gc, scale, config=i, block_k=bk)
                rec["err"] = max(rel(x, r) for x, r in zip(out, ref))
                rec["ms"] = timer(lambda: kern.dqkdg(q, k, v, do, h, dh, gs.gc, scale,
                                                     config=i, block_k=bk), device, a)
            except Exception as e:          # a config the compiler refuses (resources)
                rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            emit(rec)


def _sweep_state_sum(kern, a, device, xs, gs, scale, base):
    """Every :data:`STATE_CANDIDATES` config of ``decayed_state_sum``: the gated state-gradient
    sum (q, dO), the gated end state (k, v) and the fixed-slope state gradient; error against
    config 0."""
    import torch
    from sp_attention.linear.kernels import STATE_CANDIDATES
    q, k, v, do = xs
    H = q.shape[2]
    gg = torch.tensor([-(8 * (h + 1) / H) for h in range(H)], device=device)  # log2 rates
    cases = {"d gated": lambda c: kern.state_sum(q, do, None, 0, 1, None, scale, c, gates=gs),
             "b gated": lambda c: kern.state_sum(k, v, None, 0, -1, None, 1.0, c, gates=gs),
             "d slopes": lambda c: kern.state_sum(q, do, gg / 64, 1, 1, None, scale, c)}
    for what, fn in cases.items():
        ref = fn(0)
        for i, cfg in enumerate(STATE_CANDIDATES):
            rec = dict(base, kernel="decayed_state_sum", case=what, config=i, warps=cfg.num_warps,
                       stages=cfg.num_stages, **cfg.kwargs)
            try:
                rec["err"] = rel(fn(i), ref)
                rec["ms"] = timer(lambda: fn(i), device, a)
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            emit(rec)


def profile(kern, a, device, dtype):
    """The kernels of our P = 1 gated fwd+bwd and of fla's fixed-slope fwd+bwd
    (:func:`benchmarks.common.kernel_table`, printed to the log; CUDA only)."""
    if device != "cuda":
        return
    import torch

    from benchmarks.common import kernel_table
    from sp_attention.linear import lightning_attention
    B, H, K, V, T = 1, a.heads, a.head_dim, a.head_dim, a.t
    q, k, v, do, g, S, D = inputs(B, T, H, K, V, dtype, device, seed=2)
    slopes = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)], device=device)
    ys = [x.clone().requires_grad_(True) for x in (q, k, v, g)]
    kernel_table(lambda: grads_of(lightning_attention(*ys[:3], g=ys[3], scale=K ** -0.5), ys,
                                  do), "ours P=1 fwd+bwd g", top=25)
    if kern.real:
        from fla.ops.simple_gla import chunk_simple_gla
        kernel_table(lambda: grads_of(chunk_simple_gla(*ys[:3], g_gamma=-slopes,
                                                       scale=K ** -0.5)[0], ys[:3], do),
                     "fla fwd+bwd g_gamma", top=25)


def export_seeds(out_dir: str, since: float) -> None:
    """The ``*.autotune.json`` files Triton's cache gained during this run, as a tgz."""
    try:
        import triton
        root = os.environ.get("TRITON_CACHE_DIR") or triton.knobs.cache.dir
    except Exception as e:  # noqa: BLE001
        emit(dict(bench="gated_check", phase="seeds", error=str(e)))
        return
    files = []
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            if n.endswith(".autotune.json") and os.path.getmtime(p) >= since:
                files.append(p)
    path = os.path.join(out_dir, "gated_autotune.tgz")
    with tarfile.open(path, "w:gz") as tar:
        for p in files:
            tar.add(p, arcname=os.path.relpath(p, root))
    emit(dict(bench="gated_check", phase="seeds", files=len(files), path=path))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phases", nargs="+", default=["perf", "bf16", "seeds"],
                   choices=["sweep", "perf", "profile", "bf16", "fp32", "seeds"])
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, tiny shapes, fla replaced by pure-torch stand-ins, our kernels in "
                        "Triton's interpreter (set here)")
    p.add_argument("--out-dir", default=os.environ.get("OUT"))
    p.add_argument("--t", type=int, default=32768, help="perf sequence length")
    p.add_argument("--sweep", nargs="+", default=["dqk", "state"], choices=["dqk", "state"],
                   help="the kernels the sweep phase runs")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    if a.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        a.t, a.heads, a.head_dim, a.warmup, a.iters, a.repeats = 128, 2, 16, 0, 1, 1
    import torch
    device = "cpu" if a.dry_run else "cuda"
    if a.out_dir:
        os.makedirs(a.out_dir, exist_ok=True)
        _OUT[0] = os.path.join(a.out_dir, "gated_check.jsonl")
    started = time.time()
    kern = Kernels(real=not a.dry_run)
    emit(dict(bench="gated_check", phase="env", device=torch.cuda.get_device_name()
              if device == "cuda" else "cpu", torch=torch.__version__,
              triton=__import__("triton").__version__, dry_run=a.dry_run))
    from sp_attention.linear.dqk_kernel import DQK_CANDIDATES
    from sp_attention.linear.kernels import OUTPUT_CANDIDATES, STATE_CANDIDATES
    every = {"output": range(len(OUTPUT_CANDIDATES)), "state": range(len(STATE_CANDIDATES)),
             "dqk": range(len(DQK_CANDIDATES))}
    tuned = {"output": [None], "state": [None], "dqk": [None]}
    # Triton's CPU interpreter computes bf16 dots wrongly (our fixed-slope kernels too):
    # the dry run takes fp32 where the GPU takes bf16
    low = torch.float32 if a.dry_run else torch.bfloat16
    if "sweep" in a.phases:
        sweep(kern, a, device, low)
    if "perf" in a.phases:
        perf(kern, a, device, low)
    if "profile" in a.phases:
        profile(kern, a, device, low)
    if "bf16" in a.phases:
        shape = (1, 256 if a.dry_run else 4096, a.heads, a.head_dim, a.head_dim)
        check_kernels(kern, shape, low, device, "bf16", tuned)
        check_kernels(kern, (1, 130, 2, 16, 16) if a.dry_run else (1, 256, 4, 128, 128), low,
                      device, "bf16 configs", every)
        check_leaf(kern, shape, low, device, "bf16")
    if "fp32" in a.phases:
        # one head dim (each new (dtype, K, V) costs fla a full autotune of its kernels)
        for shape in ((2, 300, 4, 128, 128), (1, 64, 3, 128, 128)):
            if a.dry_run:
                shape = (shape[0], shape[1] // 2, 2, 16, 16)
            check_kernels(kern, shape, torch.float32, device, "fp32", tuned)
            check_leaf(kern, shape, torch.float32, device, "fp32")
    if "seeds" in a.phases and a.out_dir and not a.dry_run:
        export_seeds(a.out_dir, started)
    emit(dict(bench="gated_check", phase="done", failed=_FAILED))
    return 1 if _FAILED else 0


if __name__ == "__main__":
    sys.exit(main())

"""Very negative but finite gates (a token that resets the state): the gate floor, and every
path's sums against the plain fp64 token recurrence.

One gate of −1e2 … −1e30 among moderate ones must only make the state before it forgotten.
Unclamped, the running sums of g after it in its chunk are huge and a decay between two later
tokens, their difference, cancels catastrophically (fp32: ~1e-2 error at −1e6; fp64: wrong at
−1e16). Here: the floor itself, one device through the public call (fp64 and fp32), the torch
chunked pieces (in ``test_gated_local.py``, gate kind ``big``) and our Triton kernels in
Triton's CPU interpreter. Context parallel (P = 1 and 3, both layouts, every schedule, packed
documents, fp32 at P = 1 and 3) runs in the per-world spawns of ``test_linear_cp.py``
(``packed_cases``: gate kind ``big``, ``big_gate_fp32``; the fla path's stand-ins at P = 3).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from sp_attention.linear import lightning_attention
from sp_attention.linear.gated_naive import recurrent_gated_attention
from sp_attention.linear.gates import GATE_FLOOR, RCP_LN2, clamp_gates
from sp_attention.testing import rel_rms, run_process

from local_cases import apply, gpu
from packed_cases import (BIG_GATES, assert_dg_close, make_inputs, per_document_reference,
                          with_big_gates)


@pytest.mark.parametrize("dt", [torch.float32, torch.float64])
def test_gate_floor_is_where_exp_is_zero(dt):
    """At and below the floor ``exp`` (and ``exp2`` of the log2 value) is exactly 0, so the
    clamp changes no decay; a little above it ``exp`` is not yet 0 (the floor is not far
    below the underflow, so it bounds a chunk's sums about as tightly as any clamp can).
    ``clamp_gates``: identity above the floor, no gradient below it; 16-bit gates in fp32."""
    floor = GATE_FLOOR[dt]
    below = torch.tensor([floor, floor - 0.5, 2 * floor, -1e30, torch.finfo(dt).min], dtype=dt)
    assert (below.exp() == 0).all() and (torch.exp2(below * RCP_LN2) == 0).all()
    assert torch.tensor(floor + 10.0, dtype=dt).exp() > 0
    g = torch.tensor([0.0, -1.0, floor + 1, floor, floor - 1, -1e30], dtype=dt,
                     requires_grad=True)
    c = clamp_gates(g)
    assert c.dtype == dt and torch.equal(c[:4], g[:4].detach()) and (c[4:] == floor).all()
    c.sum().backward()
    assert g.grad.tolist() == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    half = clamp_gates(torch.tensor([-1e4, -2.0], dtype=torch.bfloat16))
    assert half.dtype == torch.float32 and half.tolist() == [GATE_FLOOR[torch.float32], -2.0]


def _run(q, k, v, g, do, dt, ref: bool):
    xs = [x.to(dt).clone().requires_grad_(True) for x in (q, k, v, g)]
    if ref:
        o, _ = recurrent_gated_attention(*xs, scale=0.6)
    else:
        o = lightning_attention(*xs[:3], g=xs[3], scale=0.6, backend="torch")
    (o * do.to(dt)).sum().backward()
    return [o.detach()] + [x.grad for x in xs]


def test_public_call_with_big_gates_matches_recurrence():
    """One device, the public call (torch backend, T = 150: a partial last chunk): three gates
    of each of −1e2 … −1e30 among moderate ones. fp64: o, dq, dk, dv within 1e-10 of the
    token recurrence, dg too (scaled as ``assert_dg_close``); a gate below the floor gets
    dg = 0 exactly. fp32: every error at most twice the moderate gates' error."""
    q, k, v, do, g = make_inputs(2, 150, 3, 8, 8, "mixed", 3)
    ref = _run(q, k, v, g, do, torch.float64, True)
    base = [rel_rms(a, b) for a, b in zip(_run(q, k, v, g, do, torch.float32, False), ref)]
    assert max(base) < 1e-6, base
    for x in BIG_GATES:
        gb = with_big_gates(g, (x,) * 3)
        ref = _run(q, k, v, gb, do, torch.float64, True)
        got = _run(q, k, v, gb, do, torch.float64, False)
        for a, b, what in zip(got[:4], ref[:4], ("o", "dq", "dk", "dv")):
            err = rel_rms(a, b)
            assert torch.isfinite(a).all() and err < 1e-10, f"fp64 gate {x} {what}: {err:.2e}"
        assert_dg_close(got[4], ref[4], q, ref[1], 1e-10, f"fp64 gate {x} dg")
        if x < GATE_FLOOR[torch.float64]:
            assert (got[4][gb <= x] == 0).all()
        f32 = _run(q, k, v, gb, do, torch.float32, False)
        for a, b, b0, what in zip(f32, ref, base, ("o", "dq", "dk", "dv", "dg")):
            err = rel_rms(a, b)
            assert err <= 2 * b0, f"fp32 gate {x} {what}: {err:.2e} > 2 x {b0:.2e} (moderate)"


_INTERPRETER_CHECK = r"""
import sys, torch
from sp_attention.linear.gated_naive import (chunk_end_grads, dqkdg_ref, gated_chunk_states,
                                             gated_state_grad_ref, recurrent_gated_attention)
from sp_attention.linear.gates import GATE_FLOOR, chunk_local_sums, gate_sums, gate_sums_torch
from sp_attention.linear.dqk_kernel import DQK_CANDIDATES, chunk_dqkdg
from sp_attention.linear.kernels import decayed_state_sum, output_from_states
torch.manual_seed(0)
worst = {}
def err(name, a, b):
    assert torch.isfinite(a).all(), name
    e = float((a.double() - b.double()).norm() / b.double().norm())
    worst[name] = max(worst.get(name, 0.0), e)
B, T, H, K, V = 1, 200, 2, 16, 16
q, k, v, do = (torch.randn(B, T, H, d) for d in (K, K, V, V))
g0 = -torch.rand(B, T, H) * torch.tensor([0.05, 0.5])
S, D = torch.randn(B, H, K, V), torch.randn(B, H, K, V)
for big in (-1e2, -1e6, -1e30):
    g = g0.clone()
    g[:, 3, 0] = big; g[:, 70, 1] = big; g[:, 150, :] = big
    gs = gate_sums(g, 64)
    for a, b in zip(gs, gate_sums_torch(g, 64)):       # the kernel clamps as torch does
        err("gate sums", a, b)
    assert float(gs.gc.min()) >= 2 * GATE_FLOOR[torch.float32] * 1.4427
    qd, kd, vd, dod, gd, Sd = (x.double() for x in (q, k, v, do, g, S))
    h0 = gated_chunk_states(kd, vd, gd, 64).float().contiguous()
    o = output_from_states(q, k, v, h0, S, None, 0.5, 64, gates=gs)
    err("output", o, recurrent_gated_attention(qd, kd, vd, gd, scale=0.5, initial_state=Sd)[0])
    end = recurrent_gated_attention(kd, kd, vd, gd, output_final_state=True)[1]
    for sc in (0, 9, 15, 17):          # BL 64 (x / y weighted), 128, 256 tokens per dot
        err("state grad", decayed_state_sum(q, do, None, 0, 1, 2, 0.3, sc, gates=gs),
            gated_state_grad_ref(qd, dod, gd, 0.3))
        err("end state", decayed_state_sum(k, v, None, 0, -1, 2, 1.0, sc, gates=gs), end)
    h = gated_chunk_states(kd, vd, gd, 64, Sd)
    dh, _ = chunk_end_grads(qd, dod, gd, D.double(), 0.3, 64)
    ref = dqkdg_ref(qd, kd, vd, dod, h, dh, gd, 0.3, 64)
    for c in (0, len(DQK_CANDIDATES) // 2):            # dkᵀ kept transposed / dsᵀ dot
        dq, dk, dg = chunk_dqkdg(q, k, v, do, h.float().contiguous(), dh.float().contiguous(),
                                 gs.gc, 0.3, 64, c)
        err("dq", dq, ref[0]); err("dk", dk, ref[1]); err("dg", dg, ref[3])
    # fla's varlen layout: the sums restart per sequence, clamped alike
    cu = (0, 60, 61, 190)
    gc_v, tot_v = chunk_local_sums(g, 64, cu)
    ref_v = torch.cat([gate_sums_torch(g[:, a:b], 64).gc for a, b in zip(cu, cu[1:])], 1)
    err("varlen sums", gc_v[:, :cu[-1]], ref_v)
print(worst)
sys.exit(0 if max(worst.values()) < 5e-5 else 1)
"""


def test_kernels_with_big_gates_in_triton_interpreter():
    """Our Triton kernels on CPU (``TRITON_INTERPRET=1``, fp32) with gates of −1e2, −1e6 and
    −1e30 among moderate ones (mid-chunk, in the first and the last chunk, one head and both):
    the gate-sum kernel clamps as the torch sums do (dense and varlen), and the output,
    state-sum (both directions, 64 to 256 tokens per dot) and dq/dk/dg kernels stay within 5e-5
    of the fp64 references (fp32 running sums of magnitude ~160 in log2 units resolve 1.5e-5;
    unclamped, −1e6 gives 0.2 to 0.5 and −1e30 O(1))."""
    pytest.importorskip("triton", reason="triton is in the `test` extra; install it to run this")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    r = run_process([sys.executable, "-c", _INTERPRETER_CHECK], env=env, timeout=600)
    assert r.returncode == 0, f"relative errors {r.stdout.strip()}\n{r.stderr[-3000:]}"


@apply(gpu)
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("packed", [False, True])
def test_big_gates_fla_path_gpu(layout, packed):
    """GPU, the fla path (one leaf, two leaves at world size 1, or fla's varlen kernels for
    packed documents) with two gates of each of −1e2 … −1e30 among moderate ones, fp32 and
    bf16 (gates fp32) against the fp64 recurrence on the same rounded inputs: every error at
    most twice the moderate gates' error plus 1e-4 (fp32 running sums of magnitude ~160 in log2
    units resolve 1.5e-5; unclamped, these gates give errors of O(1))."""
    from sp_attention import SPContext, plan_packing
    T, H = 300, 4
    q, k, v, do, g = make_inputs(1, T, H, 64, 64, "mixed", 5)
    g = torch.nn.functional.logsigmoid(g * 40 + 2) / 4               # a realistic gate, ≤ 0
    rows = {"moderate": g, "big": with_big_gates(g, BIG_GATES + BIG_GATES[::-1])}
    ctx = SPContext(None, 0, 1, (0,), layout)
    cu = [0, 1, 40, 170, T] if packed else [0, T]
    plan = plan_packing(cu, ctx, row_len=T) if packed else None
    sh = (lambda t: plan.shard(t, 0, 1)) if packed else (lambda t: t)   # noqa: E731
    for dt in (torch.float32, torch.bfloat16):
        errs = {}
        for name, gg in rows.items():
            xs = [t.to(dt).double() for t in (q, k, v)] + [gg.float().double()]
            ref = per_document_reference(*xs[:3], do.to(dt).double(), xs[3], cu, 0.125)
            ins = [sh(t).cuda().to(dt if i < 3 else torch.float32).requires_grad_(True)
                   for i, t in enumerate(xs)]
            o = lightning_attention(*ins[:3], g=ins[3], ctx=ctx, cu_seqlens=plan, scale=0.125,
                                    backend="fla")
            o.backward(sh(do).cuda().to(o.dtype))
            got = [o] + [x.grad for x in ins]
            assert all(torch.isfinite(x).all() for x in got), (dt, name)
            errs[name] = [rel_rms(a.double(), sh(b)) for a, b in zip(got, ref)]
        for what, a, b in zip(("o", "dq", "dk", "dv", "dg"), errs["moderate"], errs["big"]):
            assert b <= 2 * a + 1e-4, f"{dt} {layout} packed={packed} {what}: {b:.2e} vs {a:.2e}"

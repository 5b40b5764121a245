"""Gated (per-token) decay on one device: the references against the token recurrence and
autograd (fp64), the gate sums, and our Triton kernels in Triton's CPU interpreter.

Gate kinds: mixed rates, ``g ≈ 0`` (A near 1), ``g ≪ 0`` (a chunk's and a leaf's transition
underflow to exactly 0 in fp64), all zeros, ``big``: mixed with single gates of −1e2 … −1e30
(``test_gate_clamp.py``).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from sp_attention.linear.gated_naive import (dqkdg_ref, gated_chunk_states,
                                             gated_output_from_states_ref,
                                             gated_state_grad_ref, recurrent_gated_attention)
from sp_attention.linear.torch_ops import chunked_gated_attention
from sp_attention.linear.gates import gate_sums_torch
from sp_attention.testing import assert_close, run_process

F64 = torch.float64
TOL = 1e-10


def gates(kind: str, B: int, T: int, H: int, seed: int = 0) -> torch.Tensor:
    """``[B, T, H]`` log-decays ≤ 0 of one kind (fp64)."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(B, T, H, generator=gen, dtype=F64)
    if kind == "mixed":     # per head: slow, medium, fast (some tokens near a reset)
        rates = torch.tensor([0.01, 1.0, 30.0, 0.2], dtype=F64)[:H].repeat(H // 4 + 1)[:H]
        return -u * rates
    if kind == "near_zero":
        return -u * 1e-9
    if kind == "underflow":  # exp(-50·64) = 0 in fp64: a chunk's A is exactly 0
        return -50.0 - u
    if kind == "zero":
        return torch.zeros(B, T, H, dtype=F64)
    if kind == "big":
        from packed_cases import with_big_gates
        return with_big_gates(gates("mixed", B, T, H, seed))
    raise ValueError(kind)


def _inputs(B, T, H, K, V, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(B, T, H, d, generator=gen, dtype=F64) for d in (K, K, V, V))
    S0, D = (torch.randn(B, H, K, V, generator=gen, dtype=F64) for _ in range(2))
    return q, k, v, do, S0, D


def assert_dg_close(dg, ref, q, dq_ref, tol=TOL, name="dg"):
    """dg against its reference, relative to the larger of the reference and the per-token
    terms ``q_i·dq_i`` whose differences form it: where every decay underflows (g ≪ 0) the
    true dg is ~exp(g) (1e-22), and any chunked form (fla's too) computes it as a difference
    of O(1) terms, exact only to O(eps) in absolute terms."""
    from sp_attention.testing import rel_rms
    terms = (q * dq_ref).sum(-1)
    err = rel_rms(dg, ref) * max(ref.norm(), 1e-300) / max(ref.norm(), terms.norm())
    assert torch.isfinite(dg).all() and err <= tol, f"{name}: scaled error {err:.3e} > {tol}"


def _autograd(fn, q, k, v, g, S0, do, D, scale):
    """(o, S_end, dq, dk, dv, dg, dS0) of ``fn`` for the loss ⟨o, do⟩ + ⟨S_end, D⟩."""
    xs = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g, S0)]
    o, S = fn(*xs[:4], scale=scale, initial_state=xs[4], output_final_state=True)
    grads = torch.autograd.grad((o * do).sum() + (S * D).sum(), xs)
    return (o.detach(), S.detach()) + grads


@pytest.mark.parametrize("kind", ["mixed", "near_zero", "underflow", "zero", "big"])
@pytest.mark.parametrize("T,chunk", [(64, 64), (150, 64), (37, 16), (5, 64)])
def test_chunked_gated_matches_recurrence_and_autograd(kind, T, chunk):
    """The chunked form = the token recurrence in o, the final state and every gradient
    (q, k, v, g, the initial state), fp64, 1e-10, incl. T not a multiple of the chunk."""
    B, H, K, V = 2, 3, 4, 5
    q, k, v, do, S0, D = _inputs(B, T, H, K, V)
    g = gates(kind, B, T, H)
    ref = _autograd(recurrent_gated_attention, q, k, v, g, S0, do, D, 0.3)
    got = _autograd(lambda *a, **kw: chunked_gated_attention(*a, chunk_size=chunk, **kw),
                    q, k, v, g, S0, do, D, 0.3)
    for name, a, b in zip(("o", "S", "dq", "dk", "dv", "dS0"), got[:5] + got[6:],
                          ref[:5] + ref[6:]):
        assert torch.isfinite(a).all(), name
        assert_close(a, b, TOL, name)
    assert_dg_close(got[5], ref[5], q, ref[2])


def test_fixed_slopes_are_constant_gates():
    """Fixed slopes are the case g_t = −s: the gated recurrence equals the fixed-slope one."""
    from sp_attention.linear.naive import recurrent_linear_attention
    q, k, v, _, S0, _ = _inputs(2, 40, 3, 4, 5)
    slopes = torch.tensor([0.0, 0.3, 50.0], dtype=F64)
    o1, s1 = recurrent_linear_attention(q, k, v, slopes, scale=0.7, initial_state=S0,
                                        output_final_state=True)
    o2, s2 = recurrent_gated_attention(q, k, v, -slopes.expand(2, 40, 3), scale=0.7,
                                       initial_state=S0, output_final_state=True)
    assert_close(o2, o1, TOL)
    assert_close(s2, s1, TOL)


@pytest.mark.parametrize("kind", ["mixed", "underflow", "big"])
def test_leaf_pieces(kind):
    """The pieces the CP path composes, fp64: output from the zero-start chunk states plus the
    carried S_in = the chunked form entered with S_in; the state-gradient contribution = the
    gradient on S_in through the outputs; the dq/dk/dv/dg reference fed the true chunk states
    and chunk-end gradients = autograd through the whole recurrence."""
    B, T, H, K, V, C = 2, 150, 4, 4, 5, 64
    q, k, v, do, S0, D = _inputs(B, T, H, K, V, seed=1)
    g = gates(kind, B, T, H, seed=1)
    ref = _autograd(recurrent_gated_attention, q, k, v, g, S0, do, D, 0.3)
    h0 = gated_chunk_states(k, v, g, C)
    assert_close(gated_output_from_states_ref(q, k, v, h0, S0, g, 0.3, C), ref[0], TOL, "o")
    # d = scale Σ exp(G_i) q_iᵀ do_i is dL/dS_in through the outputs (no D)
    S_in = S0.clone().requires_grad_(True)
    o, _ = recurrent_gated_attention(q, k, v, g, scale=0.3, initial_state=S_in)
    (d_ref,) = torch.autograd.grad((o * do).sum(), S_in)
    assert_close(gated_state_grad_ref(q, do, g, 0.3), d_ref, TOL, "d")
    # chunk states from S0 and the gradients at every chunk end (right to left)
    h = gated_chunk_states(k, v, g, C, S0)
    N, dh, cur = h.shape[1], [], D
    for n in reversed(range(N)):
        dh.insert(0, cur)
        sl = slice(n * C, min((n + 1) * C, T))
        cur = g[:, sl].sum(1).exp()[..., None, None] * cur \
            + gated_state_grad_ref(q[:, sl], do[:, sl], g[:, sl], 0.3)
    assert_close(cur, ref[6], TOL, "dS0")
    got = dqkdg_ref(q, k, v, do, h, torch.stack(dh, 1), g, 0.3, C)
    for name, a, b in zip(("dq", "dk", "dv"), got, ref[2:5]):
        assert_close(a, b, TOL, name)
    assert_dg_close(got[3], ref[5], q, ref[2])


def test_gate_sums_torch():
    """Chunk-local sums, inclusive chunk prefixes and totals of g / ln 2 (fp32; fp64 for fp64
    gates) against fp64 sums, a partial last chunk included."""
    import math
    g = gates("mixed", 2, 150, 4)
    G = g / math.log(2.0)
    for dt, tol in ((torch.float32, 1e-6), (torch.float64, 1e-13)):
        s = gate_sums_torch(g.to(dt), 64)      # fp32 sums, fp64 for fp64 gates
        assert s.gc.dtype == s.prefix.dtype == s.total.dtype == dt
        for n, (a, b) in enumerate(((0, 64), (64, 128), (128, 150))):
            assert_close(s.gc[:, a:b].double(), G[:, a:b].cumsum(1), tol)
            assert_close(s.prefix[:, n].double(), G[:, :b].sum(1), tol)
        assert_close(s.total.double(), G.sum(1), tol)


_INTERPRETER_CHECK = r"""
import sys, torch
from sp_attention.linear.gated_naive import dqkdg_ref, gated_chunk_states, gated_state_grad_ref
from sp_attention.linear.torch_ops import chunked_gated_core
from sp_attention.linear.gates import gate_sums, gate_sums_torch
from sp_attention.linear.dqk_kernel import DQK_CANDIDATES, chunk_dqkdg
from sp_attention.linear.kernels import add_entering_state, decayed_state_sum, output_from_states
torch.manual_seed(0)
worst = {}
def err(name, a, b):
    e = float((a.double() - b.double()).norm() / b.double().norm())
    worst[name] = max(worst.get(name, 0.0), e)
for B, T, H, K, V, cfg, bk in ((1, 64, 1, 16, 16, 0, None), (2, 100, 3, 32, 16, 1, None),
                               (1, 130, 3, 16, 32, 2, None)):
    q, k, v, do = (torch.randn(B, T, H, d) for d in (K, K, V, V))
    g = -torch.rand(B, T, H) * torch.tensor([0.001, 0.5, 40.0])[:H]
    S, D = torch.randn(B, H, K, V), torch.randn(B, H, K, V)
    gs = gate_sums(g, 64)
    for a, b in zip(gs, gate_sums_torch(g, 64)):
        err("gate_sums", a, b)
    qd, kd, vd, dod, gd = (x.double() for x in (q, k, v, do, g))
    h0 = gated_chunk_states(k, v, g, 64).float().contiguous()
    o = output_from_states(q, k, v, h0, S, None, 0.5, 64, cfg, gates=gs)
    err("output", o, chunked_gated_core(qd, kd, vd, gd, 0.5, S.double())[0])
    # the other order: the zero-start output, then the entering state's part added in place
    o = add_entering_state(output_from_states(q, k, v, h0, torch.zeros_like(S), None, 0.5, 64,
                                              cfg, gates=gs), q, S, None, 0.5, 64, cfg, gates=gs)
    err("output zero-start + entering state", o,
        chunked_gated_core(qd, kd, vd, gd, 0.5, S.double())[0])
    for sc in (cfg, 9 + cfg):                          # x weighted / y weighted
        d = decayed_state_sum(q, do, None, 0, 1, None, 0.3, sc, gates=gs)
        err("state_sum", d, gated_state_grad_ref(qd, dod, gd, 0.3))
        b = decayed_state_sum(k, v, None, 0, -1, None, 1.0, sc, gates=gs)
        err("state_sum end state", b, chunked_gated_core(kd, kd, vd, gd, 1.0, None, 64)[1])
    h = gated_chunk_states(kd, vd, gd, 64, S.double())
    N, dh, cur = h.shape[1], [], D.double()
    for n in reversed(range(N)):
        dh.insert(0, cur)
        sl = slice(n * 64, min((n + 1) * 64, T))
        cur = gd[:, sl].sum(1).exp()[..., None, None] * cur \
            + gated_state_grad_ref(qd[:, sl], dod[:, sl], gd[:, sl], 0.3)
    dh = torch.stack(dh, 1)
    ref = dqkdg_ref(qd, kd, vd, dod, h, dh, gd, 0.3, 64)
    for c in (cfg, cfg + len(DQK_CANDIDATES) // 2):     # dkᵀ kept transposed / dsᵀ dot
        assert DQK_CANDIDATES[c].kwargs["DK_ROWS"] == (c != cfg)
        dq, dk, dg = chunk_dqkdg(q, k, v, do, h.float().contiguous(), dh.float().contiguous(),
                                 gs.gc, 0.3, 64, c, bk)
        assert dq.dtype == dk.dtype == dg.dtype == torch.float32
        err("dq", dq, ref[0]); err("dk", dk, ref[1]); err("dg", dg, ref[3])
# BL > 64 (2 or 4 gate chunks per iteration, x or y weighted): T = 600 no multiple of BL,
# 3 splits (the last one partial), 2 rows
from sp_attention.linear.kernels import STATE_CANDIDATES
q, k, v, do = (torch.randn(2, 600, 2, 16) for _ in range(4))
g = -torch.rand(2, 600, 2) * torch.tensor([0.002, 0.03])
gs = gate_sums(g, 64)
qd, kd, vd, dod, gd = (x.double() for x in (q, k, v, do, g))
for sc, wy in ((15, 0), (17, 0), (23, 1)):
    assert STATE_CANDIDATES[sc].kwargs["BL"] > 64 and STATE_CANDIDATES[sc].kwargs["WEIGHT_Y"] == wy
    d = decayed_state_sum(q, do, None, 0, 1, 3, 0.3, sc, gates=gs)
    err("state_sum BL", d, gated_state_grad_ref(qd, dod, gd, 0.3))
    b = decayed_state_sum(k, v, None, 0, -1, 3, 1.0, sc, gates=gs)
    err("state_sum end state BL", b, chunked_gated_core(kd, kd, vd, gd, 1.0, None, 64)[1])
# varlen: several sequences in one row (fla's layout), one of length 1, padding after them
from sp_attention.linear.gated_naive import fla_chunk_bwd_dh
from sp_attention.linear.varlen import chunk_indices, cu_seqlens_tensor
cu, H, K, V = (0, 30, 130, 131, 200), 2, 16, 16
q, k, v, do = (torch.randn(1, 205, H, d) for d in (K, K, V, V))
g = -torch.rand(1, 205, H) * torch.tensor([0.3, 5.0])
hs, dhs, gcs, refs = [], [], [], []
for n in range(len(cu) - 1):
    sl = slice(cu[n], cu[n + 1])
    qd, kd, vd, dod, gd = (x[:, sl].double() for x in (q, k, v, do, g))
    S, D = (torch.randn(1, H, K, V, dtype=torch.float64) for _ in range(2))
    hs.append(gated_chunk_states(kd, vd, gd, 64, S))
    dhs.append(fla_chunk_bwd_dh(qd, kd, vd, dod, None, D, 0.3, g=gate_sums_torch(gd, 64).gc)[0])
    gcs.append(gate_sums(g[:, sl], 64).gc)
    refs.append(dqkdg_ref(qd, kd, vd, dod, hs[-1], dhs[-1], gd, 0.3))
from sp_attention.linear.gates import chunk_local_sums
gc_v, tot_v = chunk_local_sums(g, 64, cu)
ref_gc = torch.cat([gate_sums_torch(g[:, a:b], 64).gc for a, b in zip(cu, cu[1:])], 1)
err("chunk sums varlen", gc_v[:, :cu[-1]], ref_gc)
assert float(gc_v[:, cu[-1]:].abs().max()) == 0.0
ref_tot = torch.cat([gate_sums_torch(g[:, a:b], 64).prefix.diff(dim=1, prepend=torch.zeros(
    1, 1, 2)) for a, b in zip(cu, cu[1:])], 1)
err("chunk totals varlen", tot_v, ref_tot)
cpu = torch.device("cpu")
for c in (0, len(DQK_CANDIDATES) // 2):
    dq, dk, dg = chunk_dqkdg(q, k, v, do, torch.cat(hs, 1).float().contiguous(),
                             torch.cat(dhs, 1).float().contiguous(),
                             torch.cat(gcs + [torch.zeros(1, 5, H)], 1).contiguous(), 0.3,
                             config=c, cu_seqlens=cu_seqlens_tensor(cu, cpu),
                             chunk_indices=chunk_indices(cu, 64, cpu))
    for n in range(len(cu) - 1):
        sl = slice(cu[n], cu[n + 1])
        err("dq varlen", dq[:, sl], refs[n][0]); err("dk varlen", dk[:, sl], refs[n][1])
        err("dg varlen", dg[:, sl], refs[n][3])
print(worst)
sys.exit(0 if max(worst.values()) < 1e-5 else 1)
"""


def test_gated_kernels_in_triton_interpreter():
    """Our Triton kernels with per-token gates on CPU (``TRITON_INTERPRET=1``, fp32, partial
    last chunks, 1 and 3 heads, K ≠ V, slow / medium / fast gates, three launch configs, state
    sums over 128 and 256 tokens per iteration in three splits; two K tiles of dq/dk/dg:
    ``test_late_gradient.py``, the smallest tile being 32): the
    gate sums vs torch, the output (also as the zero-start output plus the entering state's
    part) and state-sum kernels vs the fp64 chunked form, and the
    dq/dk/dg kernel vs autograd through the fp64 chunk pieces, also in fla's varlen layout
    (sequences of 30, 100, 1 and 69 tokens, padding after them)."""
    pytest.importorskip("triton", reason="triton is in the `test` extra; install it to run this")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    r = run_process([sys.executable, "-c", _INTERPRETER_CHECK], env=env, timeout=600)
    assert r.returncode == 0, f"relative errors {r.stdout.strip()}\n{r.stderr[-3000:]}"

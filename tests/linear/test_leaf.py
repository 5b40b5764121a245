"""One leaf (``sp_attention/linear/leaf.py``): leaf forward/backward, inter term and state
gradient = autograd through the recurrence (fp64, 1e-10), incl. λ^C underflow, λ ≈ 1, slope 0,
T not a multiple of the chunk, one and three heads; three leaves chained = one piece. GPU
(``-m gpu``): the fla backend in bf16 / fp32 vs the torch backend in fp32."""

from __future__ import annotations

import pytest
import torch

from local_cases import F64, TOL, apply, gpu, inputs, reference_grads, slopes_of
from sp_attention.linear.fla_ops import resolve_backend
from sp_attention.linear.leaf import (inter_output, leaf_backward, leaf_forward, leaf_output,
                                      leaf_state, state_grad_local)
from sp_attention.linear.naive import chunk_decay, recurrent_linear_attention
from sp_attention.testing import assert_close


@pytest.mark.parametrize("kind", ["mixed", "huge", "zero"])
def test_leaf_forward_plus_inter_matches_recurrence(kind):
    q, k, v, S0, _, _ = inputs(T=100, H=3, K=8)
    slopes = slopes_of(kind, 3)
    o_ref, S_ref = recurrent_linear_attention(q, k, v, slopes, scale=0.5, initial_state=S0, output_final_state=True)
    o_zero, b = leaf_forward(q, k, v, slopes, 0.5, "torch")
    o = o_zero + inter_output(q, slopes, 0.5, S0)
    S_end = chunk_decay(slopes, 100, dtype=F64)[None, :, None, None] * S0 + b
    assert_close(o, o_ref, TOL)
    assert_close(S_end, S_ref, TOL)
    # Zero start: b is the end state of the recurrence without an initial state.
    assert_close(b, recurrent_linear_attention(q, k, v, slopes, output_final_state=True)[1], TOL)


@pytest.mark.parametrize("with_init,with_G", [(True, True), (False, True), (True, False), (False, False)])
@pytest.mark.parametrize("kind", ["mixed", "huge"])
def test_leaf_backward_matches_autograd(with_init, with_G, kind):
    T, H = 70, 3
    q, k, v, S0, do, G = inputs(T=T, H=H, K=6)
    slopes = slopes_of(kind, H)
    S0 = S0 if with_init else None
    G = G if with_G else None
    _, _, dq_r, dk_r, dv_r, dS0_r = reference_grads(q, k, v, slopes, 0.9, S0, do, G)
    dq, dk, dv, _ = leaf_backward(q, k, v, slopes, 0.9, S0, do, G, "torch")
    assert_close(dq, dq_r, TOL)
    assert_close(dk, dk_r, TOL)
    assert_close(dv, dv_r, TOL)
    if with_init:
        dS_in = state_grad_local(q, do, slopes, 0.9)
        if G is not None:
            dS_in = dS_in + chunk_decay(slopes, T, dtype=F64)[None, :, None, None] * G
        assert_close(dS_in, dS0_r, TOL)


def test_three_leaves_chained_equal_one_piece():
    sizes = [30, 25, 35]
    T, H, scale = sum(sizes), 3, 0.8
    q, k, v, S0, do, G = inputs(T=T, H=H, K=5)
    slopes = torch.tensor([0.02, 0.3, 50.0], dtype=F64)
    o_r, S_r, dq_r, dk_r, dv_r, dS0_r = reference_grads(q, k, v, slopes, scale, S0, do, G)
    bounds = [0, 30, 55, 90]
    pieces = [slice(bounds[i], bounds[i + 1]) for i in range(3)]
    A = [chunk_decay(slopes, n, dtype=F64)[None, :, None, None] for n in sizes]

    # Forward: S_in(l+1) = lam^C_l S_in(l) + b_l.
    S_in, outs = [S0], []
    for l, sl in enumerate(pieces):
        o_zero, b = leaf_forward(q[:, sl], k[:, sl], v[:, sl], slopes, scale, "torch")
        outs.append(o_zero + inter_output(q[:, sl], slopes, scale, S_in[l]))
        S_in.append(A[l] * S_in[l] + b)
    assert_close(torch.cat(outs, 1), o_r, TOL)
    assert_close(S_in[-1], S_r, TOL)

    # Backward: G_l = dL/dS_end(l) = dS_in(l+1) = d_{l+1} + lam^C G_{l+1}, right to left.
    Gs, grads = [None] * 3, [None] * 3
    g_next = G
    for l in reversed(range(3)):
        sl = pieces[l]
        Gs[l] = g_next
        grads[l] = leaf_backward(q[:, sl], k[:, sl], v[:, sl], slopes, scale, S_in[l], do[:, sl], Gs[l], "torch")
        g_next = state_grad_local(q[:, sl], do[:, sl], slopes, scale) + A[l] * Gs[l]
    for i, ref in enumerate((dq_r, dk_r, dv_r)):
        assert_close(torch.cat([g[i] for g in grads], 1), ref, TOL)
    assert_close(g_next, dS0_r, TOL)


@pytest.mark.parametrize("kind", ["mixed", "zero", "tiny", "huge"])
@pytest.mark.parametrize("T", [1, 50, 64, 130])
def test_leaf_state_and_output_match_recurrence(kind, T):
    """leaf_state = the zero-start end state; leaf_output(S_in) = the recurrence entered with
    S_in (the path the CP forward takes: GEMM state, scan, one kernel call per leaf)."""
    q, k, v, S0, _, _ = inputs(B=2, T=T, H=3)
    slopes = slopes_of(kind, 3)
    _, b_ref = recurrent_linear_attention(q, k, v, slopes, output_final_state=True)
    assert_close(leaf_state(k, v, slopes), b_ref, TOL, "leaf_state")
    o_ref, _ = recurrent_linear_attention(q, k, v, slopes, scale=0.3, initial_state=S0)
    assert_close(leaf_output(q, k, v, slopes, 0.3, S0, "torch"), o_ref, TOL, "leaf_output")
    o0, _ = recurrent_linear_attention(q, k, v, slopes, scale=0.3)
    assert_close(leaf_output(q, k, v, slopes, 0.3, None, "torch"), o0, TOL, "leaf_output S_in=None")


def test_leaf_forward_of_16bit_inputs_is_fp32():
    q, k, v, S0, _, _ = inputs(T=20, dtype=torch.float32)
    slopes = slopes_of("mixed", 2)
    o_z, b = leaf_forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), slopes, 1.0, "torch")
    assert o_z.dtype == torch.float32 and b.dtype == torch.float32


@apply(gpu)
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("T", [256, 300])
def test_fla_backend_matches_torch_bf16(with_state, T):
    """fla on bf16 inputs vs the torch backend in fp32 on the same (bf16-rounded) inputs."""
    H, K, V, scale = 4, 64, 64, 64**-0.5
    q, k, v, S0, do, G = inputs(B=2, T=T, H=H, K=K, V=V, dtype=torch.bfloat16, device="cuda")
    slopes = torch.tensor([0.0, 0.01, 0.3, 50.0], device="cuda")
    S0 = S0.float() if with_state else None
    G = G.float() if with_state else None
    do = do.bfloat16()
    assert resolve_backend(None, q, k, v) == "fla"

    o_f, b_f = leaf_forward(q, k, v, slopes, scale, "fla")
    q32, k32, v32 = q.float(), k.float(), v.float()
    o_t, b_t = leaf_forward(q32, k32, v32, slopes, scale, "torch")
    assert b_f.dtype == torch.float32
    assert_close(o_f.float(), o_t, 3e-3)
    assert_close(b_f, b_t, 3e-3)

    dq_f, dk_f, dv_f, _ = leaf_backward(q, k, v, slopes, scale, S0, do, G, "fla")
    dq_t, dk_t, dv_t, _ = leaf_backward(q32, k32, v32, slopes, scale, S0, do.float(), G, "torch")
    assert dq_f.dtype == torch.bfloat16
    assert_close(dq_f.float(), dq_t, 3e-3)
    assert_close(dk_f.float(), dk_t, 3e-3)
    assert_close(dv_f.float(), dv_t, 3e-3)


@apply(gpu)
def test_fla_backend_fp32_exact_composition():
    """fp32 fla: leaf_forward + inter_output equals the fp64 recurrence with an initial state."""
    q, k, v, S0, do, G = inputs(B=2, T=200, H=3, K=32, V=16, dtype=torch.float32, device="cuda")
    slopes = torch.tensor([0.0, 0.2, 50.0], device="cuda")
    o_zero, b = leaf_forward(q, k, v, slopes, 1.0, "fla")
    o = o_zero.float() + inter_output(q, slopes, 1.0, S0.float())
    S_end = chunk_decay(slopes, 200)[None, :, None, None] * S0.float() + b
    ref = reference_grads(q.double(), k.double(), v.double(), slopes.double(), 1.0, S0, do, G)
    assert_close(o, ref[0], 3e-3)
    assert_close(S_end, ref[1], 3e-3)
    dq, dk, dv, _ = leaf_backward(q, k, v, slopes, 1.0, S0.float(), do.float(), G.float(), "fla")
    for got, exp in zip((dq, dk, dv), ref[2:5]):
        assert_close(got, exp, 3e-3)


@apply(gpu)
@pytest.mark.parametrize("T", [256, 300])
def test_fla_leaf_output_and_gemm_state_bf16(T):
    """GPU path of the CP forward: bf16 GEMM state (fp32 out) and fla output entered with S_in,
    vs the torch backend in fp32 on the same bf16-rounded inputs."""
    H, K, V = 4, 64, 64
    q, k, v, S0, do, _ = inputs(B=2, T=T, H=H, K=K, V=V, dtype=torch.bfloat16, device="cuda")
    slopes = torch.tensor([0.0, 0.01, 0.3, 50.0], device="cuda")
    q32, k32, v32 = q.float(), k.float(), v.float()
    b = leaf_state(k, v, slopes)
    assert b.dtype == torch.float32
    assert_close(b, leaf_state(k32, v32, slopes), 3e-3, "bf16 GEMM state")
    o = leaf_output(q, k, v, slopes, 0.125, S0.float(), "fla")
    assert_close(o.float(), leaf_output(q32, k32, v32, slopes, 0.125, S0.float(), "torch"), 3e-3)
    d = state_grad_local(q, do.bfloat16(), slopes, 0.125)
    assert d.dtype == torch.float32
    assert_close(d, state_grad_local(q32, do.float(), slopes, 0.125), 3e-3, "bf16 GEMM dS_in")

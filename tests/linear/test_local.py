"""Single-device linear attention with decay: chunked vs recurrent, and the per-leaf local op.

CPU tests run in fp64 against autograd through the token-by-token recurrence (the spec);
GPU tests (-m gpu) compare the fla backend in bf16 against the torch backend in fp32.
"""

from __future__ import annotations

import pytest
import torch

from sp_attention import LinearTuning
from sp_attention.linear.fla_ops import fla_import_error, resolve_backend
from sp_attention.linear.leaf import (inter_output, leaf_backward, leaf_forward, leaf_output,
                                      leaf_state, state_grad_local)
from sp_attention.linear.leaves import leaves_backward, leaves_output
from sp_attention.linear.naive import chunk_decay
from sp_attention.linear.naive import (chunk_start_states, chunked_linear_attention,
                                       decayed_state_sum_ref, output_from_states_ref,
                                       recurrent_linear_attention)
from sp_attention.testing import assert_close, rel_rms

F64 = torch.float64
TOL = 1e-10


def _slopes(kind: str, H: int) -> torch.Tensor:
    table = {
        "mixed": [0.05, 0.5, 0.0, 2.0][:H] + [0.1] * max(0, H - 4),
        "zero": [0.0] * H,
        "tiny": [1e-6] * H,
        "huge": [50.0] * H,  # lam^64 = exp(-3200) underflows to exactly 0 in fp64
    }
    return torch.tensor(table[kind], dtype=F64)


def _inputs(B=2, T=50, H=2, K=4, V=5, dtype=F64, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g, dtype=F64)
    k = torch.randn(B, T, H, K, generator=g, dtype=F64)
    v = torch.randn(B, T, H, V, generator=g, dtype=F64)
    S0 = torch.randn(B, H, K, V, generator=g, dtype=F64)
    do = torch.randn(B, T, H, V, generator=g, dtype=F64)
    G = torch.randn(B, H, K, V, generator=g, dtype=F64)
    cast = lambda x: x.to(device=device, dtype=dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), S0.to(device), do.to(device), G.to(device)


def _reference_grads(q, k, v, slopes, scale, S0, do, G):
    """(o, S_end, dq, dk, dv, dS0) by autograd through the recurrence; loss = <o,do> + <S_end,G>."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    s0 = None if S0 is None else S0.detach().clone().requires_grad_(True)
    o, S = recurrent_linear_attention(*leaves, slopes, scale=scale, initial_state=s0, output_final_state=True)
    loss = (o * do).sum() + (0.0 if G is None else (S * G).sum())
    grads = torch.autograd.grad(loss, leaves + ([s0] if s0 is not None else []))
    dS0 = grads[3] if s0 is not None else None
    return o.detach(), S.detach(), grads[0], grads[1], grads[2], dS0


CASES = [  # (T, H, chunk_size, slope kind)
    (50, 2, 16, "mixed"),  # T not a multiple of the chunk
    (10, 3, 64, "mixed"),  # T < chunk, odd head count
    (64, 1, 16, "mixed"),  # one head, exact multiple
    (37, 2, 8, "zero"),
    (37, 2, 8, "tiny"),
    (70, 3, 16, "huge"),
]


@pytest.mark.parametrize("T,H,chunk,kind", CASES)
@pytest.mark.parametrize("with_init", [False, True])
def test_chunked_matches_recurrent(T, H, chunk, kind, with_init):
    q, k, v, S0, _, _ = _inputs(T=T, H=H)
    slopes = _slopes(kind, H)
    init = S0 if with_init else None
    o_r, S_r = recurrent_linear_attention(q, k, v, slopes, scale=0.7, initial_state=init, output_final_state=True)
    o_c, S_c = chunked_linear_attention(
        q, k, v, slopes, scale=0.7, initial_state=init, output_final_state=True, chunk_size=chunk
    )
    assert o_c.dtype == F64 and S_c.dtype == F64
    assert_close(o_c, o_r, TOL)
    assert_close(S_c, S_r, TOL)
    assert chunked_linear_attention(q, k, v, slopes)[1] is None


def test_chunked_autograd_matches_recurrent():
    q, k, v, S0, do, G = _inputs(T=45, H=3)
    slopes = _slopes("mixed", 3)
    ref = _reference_grads(q, k, v, slopes, 1.3, S0, do, G)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, S0)]
    o, S = chunked_linear_attention(
        *leaves[:3], slopes, scale=1.3, initial_state=leaves[3], output_final_state=True, chunk_size=16
    )
    grads = torch.autograd.grad((o * do).sum() + (S * G).sum(), leaves)
    for got, exp in zip(grads, ref[2:]):
        assert_close(got, exp, TOL)


def test_fp32_inputs_keep_dtypes():
    q, k, v, S0, _, _ = _inputs(T=20, dtype=torch.float32)
    slopes = _slopes("mixed", 2)
    o, S = chunked_linear_attention(q, k, v, slopes, initial_state=S0.float(), output_final_state=True)
    assert o.dtype == torch.float32 and S.dtype == torch.float32
    o_z, b = leaf_forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), slopes, 1.0, "torch")
    assert o_z.dtype == torch.float32 and b.dtype == torch.float32


@pytest.mark.parametrize("kind", ["mixed", "huge", "zero"])
def test_leaf_forward_plus_inter_matches_recurrence(kind):
    q, k, v, S0, _, _ = _inputs(T=100, H=3, K=8)
    slopes = _slopes(kind, 3)
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
    q, k, v, S0, do, G = _inputs(T=T, H=H, K=6)
    slopes = _slopes(kind, H)
    S0 = S0 if with_init else None
    G = G if with_G else None
    _, _, dq_r, dk_r, dv_r, dS0_r = _reference_grads(q, k, v, slopes, 0.9, S0, do, G)
    dq, dk, dv = leaf_backward(q, k, v, slopes, 0.9, S0, do, G, "torch")
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
    q, k, v, S0, do, G = _inputs(T=T, H=H, K=5)
    slopes = torch.tensor([0.02, 0.3, 50.0], dtype=F64)
    o_r, S_r, dq_r, dk_r, dv_r, dS0_r = _reference_grads(q, k, v, slopes, scale, S0, do, G)
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


def test_backend_resolution():
    q = torch.zeros(1, 4, 1, 2)
    assert resolve_backend(None, q) == "torch"
    assert resolve_backend("torch", q) == "torch"
    with pytest.raises(ValueError, match="valid"):
        resolve_backend("triton", q)
    with pytest.raises(ValueError, match="gpu"):
        resolve_backend("fla", q)
    with pytest.raises(ValueError, match="backend='torch'"):
        leaf_forward(q, q, q, torch.zeros(1), 1.0, "fla")


# ----------------------------------------------------------------------------- GPU (fla)


def _fla_ready() -> bool:
    return torch.cuda.is_available() and fla_import_error() is None


gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not _fla_ready(), reason="needs fla-core (the `gpu` extra)"),
]


def _apply(marks):
    def deco(fn):
        for m in reversed(marks):
            fn = m(fn)
        return fn

    return deco


@_apply(gpu)
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("T", [256, 300])
def test_fla_backend_matches_torch_bf16(with_state, T):
    """fla on bf16 inputs vs the torch backend in fp32 on the same (bf16-rounded) inputs."""
    H, K, V, scale = 4, 64, 64, 64**-0.5
    q, k, v, S0, do, G = _inputs(B=2, T=T, H=H, K=K, V=V, dtype=torch.bfloat16, device="cuda")
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

    dq_f, dk_f, dv_f = leaf_backward(q, k, v, slopes, scale, S0, do, G, "fla")
    dq_t, dk_t, dv_t = leaf_backward(q32, k32, v32, slopes, scale, S0, do.float(), G, "torch")
    assert dq_f.dtype == torch.bfloat16
    assert_close(dq_f.float(), dq_t, 3e-3)
    assert_close(dk_f.float(), dk_t, 3e-3)
    assert_close(dv_f.float(), dv_t, 3e-3)


@_apply(gpu)
def test_fla_backend_fp32_exact_composition():
    """fp32 fla: leaf_forward + inter_output equals the fp64 recurrence with an initial state."""
    q, k, v, S0, do, G = _inputs(B=2, T=200, H=3, K=32, V=16, dtype=torch.float32, device="cuda")
    slopes = torch.tensor([0.0, 0.2, 50.0], device="cuda")
    o_zero, b = leaf_forward(q, k, v, slopes, 1.0, "fla")
    o = o_zero.float() + inter_output(q, slopes, 1.0, S0.float())
    S_end = chunk_decay(slopes, 200)[None, :, None, None] * S0.float() + b
    ref = _reference_grads(q.double(), k.double(), v.double(), slopes.double(), 1.0, S0, do, G)
    assert_close(o, ref[0], 3e-3)
    assert_close(S_end, ref[1], 3e-3)
    dq, dk, dv = leaf_backward(q, k, v, slopes, 1.0, S0.float(), do.float(), G.float(), "fla")
    for got, exp in zip((dq, dk, dv), ref[2:5]):
        assert_close(got, exp, 3e-3)


@pytest.mark.parametrize("kind", ["mixed", "zero", "tiny", "huge"])
@pytest.mark.parametrize("T", [1, 50, 64, 130])
def test_leaf_state_and_output_match_recurrence(kind, T):
    """leaf_state = the zero-start end state; leaf_output(S_in) = the recurrence entered with
    S_in (the path the CP forward takes: GEMM state, scan, one kernel call per leaf)."""
    q, k, v, S0, _, _ = _inputs(B=2, T=T, H=3)
    slopes = _slopes(kind, 3)
    _, b_ref = recurrent_linear_attention(q, k, v, slopes, output_final_state=True)
    assert_close(leaf_state(k, v, slopes), b_ref, TOL, "leaf_state")
    o_ref, _ = recurrent_linear_attention(q, k, v, slopes, scale=0.3, initial_state=S0)
    assert_close(leaf_output(q, k, v, slopes, 0.3, S0, "torch"), o_ref, TOL, "leaf_output")
    o0, _ = recurrent_linear_attention(q, k, v, slopes, scale=0.3)
    assert_close(leaf_output(q, k, v, slopes, 0.3, None, "torch"), o0, TOL, "leaf_output S_in=None")


@_apply(gpu)
@pytest.mark.parametrize("T", [256, 300])
def test_fla_leaf_output_and_gemm_state_bf16(T):
    """GPU path of the CP forward: bf16 GEMM state (fp32 out) and fla output entered with S_in,
    vs the torch backend in fp32 on the same bf16-rounded inputs."""
    H, K, V = 4, 64, 64
    q, k, v, S0, do, _ = _inputs(B=2, T=T, H=H, K=K, V=V, dtype=torch.bfloat16, device="cuda")
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


# ------------------------------------------- chunk states + S_in -> output (the CP forward)


@pytest.mark.parametrize("kind", ["mixed", "zero", "huge"])
@pytest.mark.parametrize("T", [1, 64, 130])
def test_output_from_states_reference_matches_recurrence(kind, T):
    """Linearity the CP forward relies on: the zero-start chunk states plus ``λ^(n·C) S_in``
    give the output of the recurrence entered with ``S_in`` (fp64, exact)."""
    q, k, v, S0, _, _ = _inputs(B=2, T=T, H=3)
    slopes = _slopes(kind, 3)
    o_ref, _ = recurrent_linear_attention(q, k, v, slopes, scale=0.3, initial_state=S0)
    h = chunk_start_states(k, v, slopes, 64)
    assert h.shape == (2, -(-T // 64), 3, 4, 5)
    assert_close(output_from_states_ref(q, k, v, h, S0, slopes, 0.3), o_ref, TOL)
    assert_close(chunk_start_states(k, v, slopes, 64, S0)[:, 0], S0, TOL, "first chunk = S_in")
    # the one-pass state sums: end state from zero, and the state-gradient contribution
    assert_close(decayed_state_sum_ref(k, v, slopes, T - 1, -1), leaf_state(k, v, slopes), TOL)
    assert_close(0.3 * decayed_state_sum_ref(q, v, slopes, 1, 1),
                 state_grad_local(q, v, slopes, 0.3), TOL)


_INTERPRETER_CHECK = r"""
import math, sys, torch
from sp_attention.linear.kernels import OUTPUT_CANDIDATES, output_from_states
from sp_attention.linear.naive import chunk_start_states, chunked_core
torch.manual_seed(0)
worst = 0.0
for T, B, H, K, V in ((64, 1, 1, 16, 16), (100, 2, 3, 32, 16), (200, 1, 3, 16, 48)):
    q, k, v = (torch.randn(B, T, H, d) for d in (K, K, V))
    slopes = torch.tensor([0.0, 0.05, 60.0][:H])
    S = torch.randn(B, H, K, V)
    h = chunk_start_states(k, v, slopes, 64).float().contiguous()
    ref = chunked_core(q.double(), k.double(), v.double(), slopes.double(), 0.5, S.double())[0]
    for cfg in range(len(OUTPUT_CANDIDATES)):     # every candidate config
        o = output_from_states(q, k, v, h, S, (-slopes / math.log(2)).float(), 0.5, 64, cfg)
        worst = max(worst, ((o.double() - ref).norm() / ref.norm()).item())
        assert o.dtype == torch.float32 and o.shape == (B, T, H, V)
from sp_attention.linear.kernels import STATE_CANDIDATES, decayed_state_sum
from sp_attention.linear.naive import decayed_state_sum_ref
for T, splits in ((64, None), (200, 3), (130, 1)):
    x, y = torch.randn(2, T, 3, 32), torch.randn(2, T, 3, 16)
    slopes = torch.tensor([0.0, 0.05, 60.0])
    for cfg in range(len(STATE_CANDIDATES)):       # every candidate config
        base, step = ((T - 1, -1), (1, 1))[cfg % 2]
        got = decayed_state_sum(x, y, (-slopes / math.log(2)).float(), base, step, splits, 0.3,
                                cfg)
        ref = 0.3 * decayed_state_sum_ref(x.double(), y.double(), slopes.double(), base, step)
        assert got.dtype == torch.float32 and got.shape == (2, 3, 32, 16)
        worst = max(worst, ((got.double() - ref).norm() / ref.norm()).item())
# strided rows: every other leaf of a batch of leaves, read in place
x, y = torch.randn(4, 96, 3, 32)[1::2], torch.randn(4, 96, 3, 16)[1::2]
assert not x.is_contiguous() and x[0].is_contiguous()
got = decayed_state_sum(x, y, (-slopes / math.log(2)).float(), 95, -1, 2)
ref = decayed_state_sum_ref(x.double(), y.double(), slopes.double(), 95, -1)
worst = max(worst, ((got.double() - ref).norm() / ref.norm()).item())
print(worst)
sys.exit(0 if worst < 1e-5 else 1)
"""


def test_output_from_states_kernel_in_triton_interpreter():
    """The Triton kernels on CPU (``TRITON_INTERPRET=1``, fp32, partial last chunks, one and
    three heads, K != V, slopes 0 / small / underflowing, several sequence splits): the output
    kernel vs the fp64 chunked form, the state-sum kernel vs its fp64 reference. Runs in a
    subprocess: the interpreter is chosen when the kernel module is imported."""
    pytest.importorskip("triton", reason="triton is in the `test` extra; install it to run this")
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _INTERPRETER_CHECK], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, f"relative error {r.stdout.strip()}\n{r.stderr[-3000:]}"


@_apply(gpu)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [256, 300])
def test_output_from_states_kernel_gpu(dtype, T):
    """On the GPU: fla's zero-start chunk states equal the reference ones, and the output
    kernel fed with them and S_in equals the torch form entered with S_in. fp32 inputs run
    the kernel's dots in IEEE fp32: fed the exact reference chunk states it is within 1e-5
    (TF32 gave 1.5e-3 on an H200); fed fla's states (TF32 inside fla), within 1e-3."""
    import math

    from fla.ops.common.chunk_h import chunk_fwd_h

    from sp_attention.linear.kernels import output_from_states

    q, k, v, S0, _, _ = _inputs(B=2, T=T, H=4, K=64, V=64, dtype=dtype, device="cuda")
    slopes = torch.tensor([0.0, 0.01, 0.3, 50.0], device="cuda")
    gg = (-slopes / math.log(2)).float()
    h, _ = chunk_fwd_h(k=k, v=v, g_gamma=gg, h0=None, chunk_size=64)
    q32, k32, v32 = q.float(), k.float(), v.float()
    assert_close(h.float(), chunk_start_states(k32, v32, slopes, 64).float(), 5e-3, "chunk_fwd_h")
    o = output_from_states(q, k, v, h, S0.float().contiguous(), gg, 0.125)
    assert o.dtype == dtype
    ref = leaf_output(q32, k32, v32, slopes, 0.125, S0.float(), "torch")
    assert_close(o.float(), ref, 3e-3 if dtype == torch.bfloat16 else 1e-3)
    if dtype == torch.float32:      # the kernel alone, on exact fp32 chunk states
        h_ref = chunk_start_states(k32, v32, slopes, 64).float().contiguous()
        o = output_from_states(q, k, v, h_ref, S0.float().contiguous(), gg, 0.125)
        assert_close(o, ref, 1e-5, "fp32 output kernel (IEEE)")


@_apply(gpu)
@pytest.mark.parametrize("concurrent", [True, False])
@pytest.mark.parametrize("T", [256, 300])
def test_fla_leaves_overlapped_match_torch_bf16(T, concurrent):
    """leaves_output / leaves_backward (fla; the scan callback runs on the side stream) vs the
    torch backend in fp32, with states entering and gradients arriving; the states handed to
    the scans are the leaves' end states and state-gradient contributions (T = 256: the end
    state comes from fla's recurrence; T = 300: from the one-pass kernel). The backward runs
    with its two chunk recurrences on two streams and on one (``concurrent``)."""
    tuning = LinearTuning(concurrent_recurrences=concurrent)
    q, k, v, S0, do, G = _inputs(B=2, T=T, H=4, K=64, V=64, dtype=torch.bfloat16, device="cuda")
    slopes = torch.tensor([0.0, 0.01, 0.3, 50.0], device="cuda")
    S0, G, do = S0.float(), G.float(), do.bfloat16()
    q32, k32, v32 = q.float(), k.float(), v.float()
    seen = {}

    def scan_f(b):
        seen["b"] = b.clone()
        return S0 * 1.0

    def scan_b(d):
        seen["d"] = d.clone()
        return G * 1.0
    o, S = leaves_output(q, k, v, slopes, 0.125, scan_f, "fla", tuning=tuning)
    assert_close(S, S0, 0.0)
    assert_close(seen["b"], leaf_state(k32, v32, slopes), 3e-3, "end state")
    assert_close(o.float(), leaf_output(q32, k32, v32, slopes, 0.125, S0, "torch"), 3e-3)
    grads = leaves_backward(q, k, v, slopes, 0.125, S0, do, scan_b, "fla", tuning=tuning)
    assert_close(seen["d"], state_grad_local(q32, do.float(), slopes, 0.125), 3e-3, "d")
    refs = leaf_backward(q32, k32, v32, slopes, 0.125, S0, do.float(), G, "torch")
    for name, got, ref in zip(("dq", "dk", "dv"), grads, refs):
        assert got.dtype == torch.bfloat16
        assert_close(got.float(), ref, 3e-3, name)


@_apply(gpu)
def test_fla_two_leaves_on_one_gpu_match_one_leaf():
    """World size 1 with the zigzag layout: two leaves on one GPU, scanned locally through the
    overlapped path, equal the plain one-leaf fla call (bf16, relative RMS)."""
    from sp_attention import SPContext
    from sp_attention.linear import lightning_attention
    from sp_attention.testing import rel_rms

    q, k, v, _, do, _ = _inputs(B=1, T=2000, H=4, K=64, V=64, dtype=torch.bfloat16, device="cuda")
    slopes = torch.tensor([0.0, 0.01, 0.3, 50.0], device="cuda")
    one = [t.clone().requires_grad_(True) for t in (q, k, v)]
    two = [t.clone().requires_grad_(True) for t in (q, k, v)]
    o1 = lightning_attention(*one, slopes)
    o1.backward(do.bfloat16())
    zz = SPContext(None, 0, 1, (0,), "zigzag")
    for impl in ("blelloch", "allgather", "ring"):
        for t in two:
            t.grad = None
        o2 = lightning_attention(*two, slopes, ctx=zz, impl=impl)
        o2.backward(do.bfloat16())
        for name, a, b in zip(("o", "dq", "dk", "dv"), (o2, *(t.grad for t in two)),
                              (o1, *(t.grad for t in one))):
            assert torch.isfinite(a).all(), (impl, name)
            assert rel_rms(a, b) < 5e-3, (impl, name, rel_rms(a, b))


@_apply(gpu)
@pytest.mark.parametrize("concurrent", [True, False])
@pytest.mark.parametrize("T", [256, 300])
def test_fla_first_and_last_leaf_paths_match_torch_bf16(T, concurrent):
    """The paths of a rank holding only the sequence's first leaf (``zero_in``: fla's own output
    kernel, the scan joined afterwards) and only its last leaf (``zero_grad``: the gradient
    recurrence starts without waiting for the scan) vs the torch backend in fp32; the states
    handed to the scans are checked too."""
    tuning = LinearTuning(concurrent_recurrences=concurrent)
    q, k, v, S0, do, _ = _inputs(B=2, T=T, H=4, K=64, V=64, dtype=torch.bfloat16, device="cuda")
    slopes = torch.tensor([0.0, 0.01, 0.3, 50.0], device="cuda")
    S0, do = S0.float(), do.bfloat16()
    q32, k32, v32 = q.float(), k.float(), v.float()
    seen = {}

    def scan_first(b):          # what any scan returns to the first leaf: zeros
        seen["b"] = b.clone()
        return torch.zeros_like(b)

    def scan_last(d):           # ... and to the last leaf in reverse
        seen["d"] = d.clone()
        return torch.zeros_like(d)
    o, S = leaves_output(q, k, v, slopes, 0.125, scan_first, "fla", zero_in=True,
                         tuning=tuning)
    assert_close(seen["b"], leaf_state(k32, v32, slopes), 3e-3, "end state")
    assert float(S.abs().max()) == 0.0
    assert_close(o.float(), leaf_output(q32, k32, v32, slopes, 0.125, None, "torch"), 3e-3)
    grads = leaves_backward(q, k, v, slopes, 0.125, S0, do, scan_last, "fla",
                            zero_grad=True, tuning=tuning)
    assert_close(seen["d"], state_grad_local(q32, do.float(), slopes, 0.125), 3e-3, "d")
    refs = leaf_backward(q32, k32, v32, slopes, 0.125, S0, do.float(), None, "torch")
    for name, got, ref in zip(("dq", "dk", "dv"), grads, refs):
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
        assert_close(got.float(), ref, 3e-3, name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_our_kernels_every_config_gpu(dtype):
    """Every config the autotuners may pick, forced one at a time on the GPU, vs the fp64
    references: the state-sum kernel (x read transposed or as stored; contiguous and strided
    rows; partial last chunk) and the output kernel (fp32: IEEE dots, held to 1e-5). The
    interpreter cannot show a config that compiles wrong on the GPU; this does."""
    import math

    from sp_attention.linear.kernels import (OUTPUT_CANDIDATES, STATE_CANDIDATES,
                                             decayed_state_sum, output_from_states)
    from sp_attention.linear.naive import chunk_start_states, decayed_state_sum_ref
    tol = 3e-3
    bad = []                  # every failing candidate is listed, not just the first

    def check(got, ref, what):
        try:
            assert_close(got, ref, tol, what)
        except AssertionError as e:
            bad.append(str(e).splitlines()[0][:200])
    for B, T, H, K in ((2, 300, 4, 64), (1, 2048, 16, 128)):
        q, k, v, S0, do, _ = _inputs(B=B, T=T, H=H, K=K, V=K, dtype=dtype, device="cuda")
        slopes = torch.tensor([0.0, 0.01, 0.3, 50.0] * (H // 4), device="cuda")
        gg = (-slopes / math.log(2)).float()
        s64 = slopes.double().cpu()
        if dtype != torch.float32:        # the state kernel takes 16-bit inputs only
            wide = torch.cat([q, q], 0)[::2]           # strided rows, each row contiguous
            for i in range(len(STATE_CANDIDATES)):
                for x, y, base, step in ((k, v, T - 1, -1), (q, do.to(dtype), 1, 1),
                                         (wide, do.to(dtype), 1, 1)):
                    got = decayed_state_sum(x, y, gg, base, step, None, 0.5, i)
                    ref = 0.5 * decayed_state_sum_ref(x.double().cpu(), y.double().cpu(), s64,
                                                      base, step)
                    check(got.double().cpu(), ref, f"state cfg {i} T {T} base {base}")
        h = chunk_start_states(k.float(), v.float(), slopes, 64).to(dtype).contiguous()
        ref = leaf_output(q.float(), k.float(), v.float(), slopes, 0.25, S0.float(), "torch")
        for i in range(len(OUTPUT_CANDIDATES)):
            try:
                o = output_from_states(q, k, v, h, S0.float().contiguous(), gg, 0.25, 64, i)
            except Exception as e:        # a config that cannot compile here (out of resources)
                if "OutOfResources" in type(e).__name__ or "out of resource" in str(e):
                    continue
                raise
            if dtype == torch.float32:
                err = rel_rms(o, ref)
                if not err <= 1e-5:
                    bad.append(f"output cfg {i} T {T} fp32: relative RMS {err:.3e} > 1e-5")
            else:
                check(o.float(), ref, f"output cfg {i} T {T} {dtype}")
    assert not bad, "candidate configs off the reference:\n" + "\n".join(bad)

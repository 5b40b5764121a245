"""Our Triton kernels (``sp_attention/linear/kernels.py``) against their fp64 references: in
Triton's CPU interpreter (every CI run) and, with ``-m gpu``, on the GPU with every config the
autotuners may pick."""

from __future__ import annotations

import pytest
import torch

from local_cases import apply, gpu, inputs
from sp_attention.linear.leaf import leaf_output
from sp_attention.linear.naive import chunk_start_states
from sp_attention.testing import assert_close, rel_rms, run_process


_INTERPRETER_CHECK = r"""
import math, sys, torch
from sp_attention.linear.kernels import OUTPUT_CANDIDATES, output_from_states
from sp_attention.linear.naive import chunk_start_states
from sp_attention.linear.torch_ops import chunked_core
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
    # the other order: the zero-start output, then the entering state's part added in place
    # (every candidate; slope 60 underflows after the first chunk: those chunks are skipped)
    from sp_attention.linear.kernels import ENTERING_CANDIDATES, add_entering_state
    gg = (-slopes / math.log(2)).float()
    for cfg in range(len(ENTERING_CANDIDATES)):
        o = output_from_states(q, k, v, h, torch.zeros_like(S), gg, 0.5, 64,
                               cfg % len(OUTPUT_CANDIDATES))
        assert add_entering_state(o, q, S, gg, 0.5, 64, cfg) is o
        worst = max(worst, ((o.double() - ref).norm() / ref.norm()).item())
from sp_attention.linear.kernels import STATE_CANDIDATES, decayed_state_sum
from sp_attention.linear.naive import decayed_state_sum_ref
for T, splits in ((64, None), (600, 3), (130, 1), (1000, None)):
    x, y = torch.randn(2, T, 3, 32), torch.randn(2, T, 3, 16)
    slopes = torch.tensor([0.0, 0.05, 60.0])
    for cfg in range(len(STATE_CANDIDATES)):       # every candidate config
        base, step = ((T - 1, -1), (1, 1))[cfg % 2]
        got = decayed_state_sum(x, y, (-slopes / math.log(2)).float(), base, step, splits, 0.3,
                                cfg)
        ref = 0.3 * decayed_state_sum_ref(x.double(), y.double(), slopes.double(), base, step)
        assert got.dtype == torch.float32 and got.shape == (2, 3, 32, 16)
        worst = max(worst, ((got.double() - ref).norm() / ref.norm()).item())
# pieces: token ranges of every row summed each on its own in one launch (packed documents'
# crossing segments), end states (step −1: each piece's own base) and state gradients
x, y = torch.randn(2, 700, 3, 32), torch.randn(2, 700, 3, 16)
pieces = ((0, 1), (5, 130), (200, 500), (640, 60))
for cfg in (0, 19, 17):
    for base, step in ((None, -1), (1, 1)):
        got = decayed_state_sum(x, y, (-slopes / math.log(2)).float(), base or 0, step, 3, 0.3,
                                cfg, pieces=pieces)
        assert got.shape == (2, 4, 3, 32, 16)
        for j, (a, n) in enumerate(pieces):
            ref = 0.3 * decayed_state_sum_ref(x[:, a:a + n].double(), y[:, a:a + n].double(),
                                              slopes.double(), n - 1 if step < 0 else base,
                                              step)
            worst = max(worst, ((got[:, j].double() - ref).norm() / ref.norm()).item())
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
    kernel vs the fp64 chunked form, and so the zero-start output plus the entering state's
    part (``add_entering_state``, every candidate), the state-sum kernel vs its fp64 reference (every
    candidate, so every BL; 600 tokens in 3 splits, the last one partial). Runs in a
    subprocess: the interpreter is chosen when the kernel module is imported."""
    pytest.importorskip("triton", reason="triton is in the `test` extra; install it to run this")
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    r = run_process([sys.executable, "-c", _INTERPRETER_CHECK], env=env, timeout=600)
    assert r.returncode == 0, f"relative error {r.stdout.strip()}\n{r.stderr[-3000:]}"


@apply(gpu)
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

    q, k, v, S0, _, _ = inputs(B=2, T=T, H=4, K=64, V=64, dtype=dtype, device="cuda")
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_our_kernels_every_config_gpu(dtype):
    """Every config the autotuners may pick, forced one at a time on the GPU, vs the fp64
    references: the state-sum kernel (x read transposed or as stored; contiguous and strided
    rows; partial last chunk), the output kernel and the entering state's part added to the
    zero-start output (fp32: IEEE dots, held to 1e-5). The
    interpreter cannot show a config that compiles wrong on the GPU; this does."""
    import math

    from sp_attention.linear.kernels import (ENTERING_CANDIDATES, OUTPUT_CANDIDATES,
                                             STATE_CANDIDATES, add_entering_state,
                                             decayed_state_sum, output_from_states)
    from sp_attention.linear.naive import chunk_start_states, decayed_state_sum_ref
    tol = 3e-3
    bad = []                  # every failing candidate is listed, not just the first

    def check(got, ref, what):
        try:
            assert_close(got, ref, tol, what)
        except AssertionError as e:
            bad.append(str(e).splitlines()[0][:200])

    def check_output(o, ref, what):       # fp32: IEEE dots, held to 1e-5
        if o.dtype == torch.float32:
            err = rel_rms(o, ref)
            if not err <= 1e-5:
                bad.append(f"{what} fp32: relative RMS {err:.3e} > 1e-5")
        else:
            check(o.float(), ref, f"{what} {o.dtype}")
    for B, T, H, K in ((2, 300, 4, 64), (1, 2048, 16, 128)):
        q, k, v, S0, do, _ = inputs(B=B, T=T, H=H, K=K, V=K, dtype=dtype, device="cuda")
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
            check_output(o, ref, f"output cfg {i} T {T}")
        # the other order: zero-start output, then the entering state's part, every candidate
        for i in range(len(ENTERING_CANDIDATES)):
            o = add_entering_state(output_from_states(q, k, v, h, torch.zeros_like(S0).float(),
                                                      gg, 0.25),
                                   q, S0.float().contiguous(), gg, 0.25, 64, i)
            check_output(o, ref, f"entering cfg {i} T {T}")
    assert not bad, "candidate configs off the reference:\n" + "\n".join(bad)


@apply(gpu)
@pytest.mark.parametrize("gated", [False, True])
def test_varlen_state_launchers_equal_fla_gpu(gated):
    """Our launchers of fla's chunk-state kernels (:mod:`sp_attention.linear.fla_states`,
    varlen without a device sync) give fla's own results bit for bit: states and final states
    from h0, state gradients from dht, bf16 and fp32 states, fixed rates and gates."""
    import math

    from fla.ops.common import chunk_h

    from sp_attention.linear import fla_states
    from sp_attention.linear.varlen import (chunk_offsets, chunk_offsets_tensor,
                                            cu_seqlens_tensor)

    cu = (0, 70, 71, 200, 640, 700)
    T, H, K, V = cu[-1], 4, 64, 64
    q, k, v, _, do, _ = inputs(B=1, T=T, H=H, K=K, V=V, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(3)
    N = len(cu) - 1
    h0 = torch.randn(N, H, K, V, device="cuda", generator=gen)
    dht = torch.randn(N, H, K, V, device="cuda", generator=gen)
    if gated:
        g = -torch.rand(1, T, H, device="cuda", generator=gen)   # chunk-local sums as fla's
        from sp_attention.linear.gates import chunk_local_sums
        fkw = dict(g=chunk_local_sums(g, 64, cu)[0], g_gamma=None)
    else:
        fkw = dict(g=None, g_gamma=(-torch.tensor([0.0, 0.01, 0.3, 50.0], device="cuda")
                                    / math.log(2)).float())
    cu_t = cu_seqlens_tensor(cu, q.device)
    host = dict(split_offsets=chunk_offsets_tensor(cu, 64, q.device),
                num_splits=chunk_offsets(cu, 64)[-1])
    do = do.to(q.dtype)                 # as the op passes it (inputs() keeps do in fp64)
    bad = []

    def compare(what, got, ref):        # every mismatch, named, with its size
        for name, a, b in zip(("states", "final/initial"), got, ref):
            if a.shape != b.shape or a.dtype != b.dtype:
                bad.append(f"{what} {name}: {a.shape} {a.dtype} vs fla {b.shape} {b.dtype}")
            # bit for bit, NaN where fla has NaN: fla's final state of the rate-50 head is NaN
            # (its exp2 overflows to inf times 0; measured on H100, 2026-11-27), ours must be too
            elif not bool(((a == b) | (a.isnan() & b.isnan())).all()):
                diff = (a.double() - b.double()).abs()
                bad.append(f"{what} {name}: max |diff| {diff.nan_to_num(float('inf')).max():.3g}"
                           f" at {diff.argmax().item()} of {diff.numel()}, nan "
                           f"{int(a.isnan().sum())} vs {int(b.isnan().sum())}")

    for fp32 in (False, True):
        ref = chunk_h.chunk_fwd_h(k=k, v=v, h0=h0, output_final_state=True, cu_seqlens=cu_t,
                                  chunk_size=64, states_in_fp32=fp32, **fkw)
        got = fla_states.chunk_fwd_h(k=k, v=v, h0=h0, output_final_state=True,
                                     cu_seqlens=cu_t, chunk_size=64, states_in_fp32=fp32,
                                     **host, **fkw)
        compare(f"fwd fp32={fp32}", got, ref)
        ref = chunk_h.chunk_bwd_dh(q=q, k=k, v=v, do=do, h0=h0, dht=dht, scale=0.3,
                                   cu_seqlens=cu_t, chunk_size=64, states_in_fp32=fp32, **fkw)
        got = fla_states.chunk_bwd_dh(q=q, k=k, v=v, do=do, h0=h0, dht=dht, scale=0.3,
                                      cu_seqlens=cu_t, chunk_size=64, states_in_fp32=fp32,
                                      **host, **fkw)
        compare(f"bwd fp32={fp32}", got, ref)
    assert not bad, "\n".join(bad)

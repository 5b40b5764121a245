"""Pure-torch references for linear attention with a gated (per-token) decay.

Per batch row and head, with a log-decay ``g_t ≤ 0`` per token (natural log; ``[B, T, H]``)::

    S_t = exp(g_t)·S_{t−1} + k_tᵀ v_t          o_t = scale · q_t S_t            (the spec)

Fixed slopes are the case ``g_t = −s``. Within a piece of tokens (a chunk, a leaf) with
``G_i = Σ_{t ≤ i} g_t`` (inclusive, from the piece's start) and ``Γ = G_last``::

    S_i   = exp(G_i) S_in + Σ_{j ≤ i} exp(G_i − G_j) k_jᵀ v_j
    o_i   = scale q_i S_i
    S_end = exp(Γ) S_in + b,      b = Σ_j exp(Γ − G_j) k_jᵀ v_j,      A = exp(Γ)

Every decay is ``exp`` of a (non-positive) sum of the gates it spans, in fp32 (fp64 for fp64
inputs): ``G_i − G_j`` is summed as the segment ``Σ_{j<t≤i} g_t`` itself (and ``Γ − G_j`` as
the suffix ``Σ_{t>j} g_t``), never subtracted from two running sums, which cancel
catastrophically once a very negative gate precedes both; the exponent of a masked-out
(acausal) pair is 0 before ``exp`` so that it never overflows, and nothing divides by a decay
(``A`` may underflow to 0). The chunked forms clamp each gate at
:data:`.gates.GATE_FLOOR` (where ``exp`` is 0: no decay changes; no gradient below it); the
token recurrence, the spec, takes ``g`` as it is.

Shapes: q, k ``[B, T, H, K]``; v ``[B, T, H, V]``; g ``[B, T, H]``; states ``[B, H, K, V]``.
These are references: the token recurrence (the spec) and the specifications of our gated
kernels and of fla's gated kernels (stand-ins the CPU tests run the fla path with). The torch
backend's chunked form they build on is production code and lives in :mod:`.torch_ops`
(``chunked_gated_core``), checked against the token recurrence.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..precision import acc_dtype
from .gates import clamp_gates
from .torch_ops import (check_gated_shapes, chunk_rows, chunked_gated_core, gated_chunk_decays,
                        gated_chunk_outputs)

__all__ = ["recurrent_gated_attention", "gated_chunk_states", "gated_output_from_states_ref", "gated_state_grad_ref",
           "dqkdg_ref", "gate_from_chunk_sums", "chunk_end_grads", "fla_chunk_fwd_h",
           "fla_chunk_bwd_dh", "fla_chunk_bwd_dv", "fla_chunk_fwd_o"]


def recurrent_gated_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              g: torch.Tensor, *, scale: float = 1.0,
                              initial_state: Optional[torch.Tensor] = None,
                              output_final_state: bool = False,
                              ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Token-by-token spec: ``S_t = exp(g_t) S_{t−1} + k_tᵀ v_t``, ``o_t = scale q_t S_t``.

    Returns (o ``[B, T, H, V]`` in ``q.dtype``, final state ``[B, H, K, V]`` fp32/fp64 or
    None). Differentiable in every input, ``g`` included. A Python loop over T: tests only.
    """
    check_gated_shapes(q, k, v, g)
    dt = acc_dtype(q, k, v, g, initial_state)
    B, T, H, K = q.shape
    qf, kf, vf, gf = (x.to(dt) for x in (q, k, v, g))
    S = q.new_zeros(B, H, K, v.shape[-1], dtype=dt) if initial_state is None \
        else initial_state.to(dt)
    outs = []
    for t in range(T):
        S = gf[:, t, :, None, None].exp() * S + kf[:, t, :, :, None] * vf[:, t, :, None, :]
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", qf[:, t], S))
    o = torch.stack(outs, 1) if T else q.new_zeros(B, 0, H, v.shape[-1], dtype=dt)
    return o.to(q.dtype), (S if output_final_state else None)


def gated_chunk_states(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, chunk_size: int = 64,
                       initial_state: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The state entering each chunk, ``[B, N, H, K, V]`` (fla's ``h`` layout), fp32/fp64:
    reference of fla's ``chunk_fwd_h`` with ``g``."""
    check_gated_shapes(k, k, v, g)
    dt = acc_dtype(k, v, g, initial_state)
    kc, vc = chunk_rows(k, chunk_size, dt), chunk_rows(v, chunk_size, dt)
    _, total, _, E = gated_chunk_decays(g, chunk_size, dt)
    b = torch.einsum("bhnjk,bhnjv->bhnkv", kc * E[..., None], vc)
    S = kc.new_zeros(kc.shape[0], kc.shape[1], kc.shape[-1], vc.shape[-1]) \
        if initial_state is None else initial_state.to(dt)
    out = []
    for n in range(kc.shape[2]):
        out.append(S)
        S = total[:, :, n, None, None].exp() * S + b[:, :, n]
    return torch.stack(out, 1)


def gated_output_from_states_ref(q, k, v, h, S_in, g, scale: float, chunk_size: int = 64):
    """A leaf's output from its zero-start chunk states ``h [B, N, H, K, V]`` and the state
    entering it: the true state entering chunk n is ``h_n + exp(P_n) S_in`` with ``P_n`` the
    sum of g over the leaf's tokens before chunk n. Reference of
    :func:`sp_attention.linear.kernels.output_from_states` with gates. fp32/fp64."""
    check_gated_shapes(q, k, v, g)
    dt = acc_dtype(q, k, v, g, S_in)
    qc, kc, vc = (chunk_rows(x, chunk_size, dt) for x in (q, k, v))
    Gc, total, D, _ = gated_chunk_decays(g, chunk_size, dt)
    P = torch.nn.functional.pad(total.cumsum(-1), (1, 0))[..., :-1]   # [B, H, N], exclusive
    S_start = h.to(dt).transpose(1, 2) + P.exp()[..., None, None] * S_in.to(dt)[:, :, None]
    return gated_chunk_outputs(qc, kc, vc, Gc, D, S_start, scale, q.shape[1])


def gated_state_grad_ref(q: torch.Tensor, do: torch.Tensor, g: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """A leaf's gradient on its incoming state through its own outputs,
    ``scale Σ_i exp(G_i) q_iᵀ do_i`` (``G`` inclusive from the leaf's start) ``[B, H, K, V]``,
    fp32/fp64."""
    dt = acc_dtype(q, do, g)
    w = clamp_gates(g, dt).cumsum(1).exp()                            # [B, T, H]
    return scale * torch.einsum("bthk,bthv->bhkv", q.to(dt) * w[..., None], do.to(dt))


def dqkdg_ref(q, k, v, do, h, dh, g, scale: float, chunk_size: int = 64):
    """Reference of the dq/dk/dg kernel (:mod:`sp_attention.linear.dqk_kernel`): every chunk
    n taken alone as a piece entered with ``h_n`` whose end receives the gradient ``dh_n``
    (``[B, N, H, K, V]`` both: the true state entering each chunk and the gradient at each
    chunk's end). Returns ``(dq, dk, dv, dg)`` by autograd, fp32/fp64; ``dg`` is the
    gradient of the natural-log ``g`` (its chunk-local reverse sums included)."""
    check_gated_shapes(q, k, v, g)
    dt = acc_dtype(q, k, v, g, h, dh)
    B, T, H = g.shape
    C = chunk_size
    N = max(1, -(-T // C))

    def rows(x):    # [B, T, H, *] -> [B·N, C, H, *]: one chunk per row, zero-padded
        x = x.to(dt)
        if N * C - T:
            x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, N * C - T))
        return x.reshape(B * N, C, *x.shape[2:])
    with torch.enable_grad():
        qr, kr, vr, gr = (rows(x).detach().requires_grad_(True) for x in (q, k, v, g))
        s_in = h.to(dt).reshape(B * N, H, *h.shape[3:])
        o, S_end = chunked_gated_core(qr, kr, vr, gr, scale, s_in, C)
        grads = torch.autograd.grad((o, S_end), (qr, kr, vr, gr),
                                    (rows(do), dh.to(dt).reshape(B * N, H, *dh.shape[3:])))
    return tuple(x.reshape(B, N * C, *x.shape[2:])[:, :T] for x in grads)


# ------------------------------------------------------------------------------------------
# fla 0.6's gated chunk kernels in pure torch, with their keyword signatures: they take the
# gate as fla does (``g``: chunk-local inclusive log2 sums, :func:`.gates.gate_sums`). Used as
# stand-ins where fla cannot run (CPU dry runs of the GPU path, orchestration tests).

def gate_from_chunk_sums(gc: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """The natural-log per-token gate ``g [B, T, H]`` (fp64) whose chunk-local log2 sums are
    ``gc`` (differences of consecutive sums inside each chunk, times ln 2)."""
    import math
    x = gc.to(torch.float64)
    prev = torch.nn.functional.pad(x, (0, 0, 1, 0))[:, :-1]
    starts = (torch.arange(x.shape[1], device=x.device) % chunk_size) == 0
    return (x - torch.where(starts[None, :, None], torch.zeros_like(prev), prev)) * math.log(2.0)


def fla_chunk_fwd_h(k, v, g=None, g_gamma=None, gk=None, gv=None, h0=None,
                    output_final_state=False, state_v_first=False, cu_seqlens=None,
                    chunk_size=64, split_size=None, states_in_fp32=False):
    """``(h [B, N, H, K, V], final state or None)`` as fla's ``chunk_fwd_h`` with ``g``."""
    assert g is not None and g_gamma is None and cu_seqlens is None
    nat = gate_from_chunk_sums(g, chunk_size)
    h = gated_chunk_states(k, v, nat, chunk_size, h0)
    ht = chunked_gated_core(k, k, v, nat, 1.0, h0, chunk_size)[1] if output_final_state else None
    return h, ht


def chunk_end_grads(q, do, g, dht, scale: float, chunk_size: int = 64):
    """``(dh [B, N, H, K, V], dh0)``: the gradient at each chunk's end (from ``dht`` at the
    sequence's end and the later chunks' outputs) and at the sequence's start; fp32/fp64."""
    T, C = q.shape[1], chunk_size
    N = max(1, -(-T // C))
    dt = acc_dtype(q, do, g, dht)
    cur = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], do.shape[3], dtype=dt) \
        if dht is None else dht.to(dt)
    dh = []
    for n in reversed(range(N)):
        dh.insert(0, cur)
        sl = slice(n * C, min((n + 1) * C, T))
        cur = clamp_gates(g[:, sl], dt).sum(1).exp()[..., None, None] * cur \
            + gated_state_grad_ref(q[:, sl], do[:, sl], g[:, sl], scale)
    return torch.stack(dh, 1), cur


def fla_chunk_bwd_dh(q, k, v, do, h0, dht, scale, g=None, g_gamma=None, gk=None, gv=None,
                     state_v_first=False, cu_seqlens=None, chunk_size=64, split_size=None,
                     states_in_fp32=False):
    """``(dh [B, N, H, K, V], dh0 or None)`` as fla's ``chunk_bwd_dh`` with ``g``: the
    gradient at each chunk's end (from ``dht`` and the later chunks' outputs)."""
    assert g is not None and g_gamma is None and cu_seqlens is None
    dh, dh0 = chunk_end_grads(q, do, gate_from_chunk_sums(g, chunk_size), dht, scale,
                              chunk_size)
    return dh, (dh0 if h0 is not None else None)


def fla_chunk_bwd_dv(q, k, do, dh, g=None, g_gamma=None, scale=None, state_v_first=False,
                     cu_seqlens=None, chunk_size=64, chunk_indices=None):
    """dv as fla's ``chunk_bwd_dv`` with ``g`` (from the chunk-end gradients ``dh``)."""
    assert g is not None and g_gamma is None and cu_seqlens is None
    nat = gate_from_chunk_sums(g, chunk_size)
    h = torch.zeros_like(dh)            # dv does not depend on the chunk states
    return dqkdg_ref(q, k, torch.zeros_like(do), do, h, dh, nat, scale, chunk_size)[2]


def fla_chunk_fwd_o(q, k, v, h, g=None, g_gamma=None, scale=None, state_v_first=False,
                    cu_seqlens=None, chunk_size=64, chunk_indices=None):
    """o as fla's ``chunk_fwd_o`` with ``g`` from the states entering each chunk ``h``."""
    assert g is not None and g_gamma is None and cu_seqlens is None
    nat = gate_from_chunk_sums(g, chunk_size)
    zero = h.new_zeros(h.shape[0], *h.shape[2:])
    return gated_output_from_states_ref(q, k, v, h, zero, nat, scale, chunk_size)

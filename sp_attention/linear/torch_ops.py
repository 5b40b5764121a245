"""The "torch" backend's local kernel: chunked linear attention with decay in pure torch.

Production code (any device and float dtype, fp64 capable, differentiable by autograd): the
one-leaf ops of :mod:`.leaf` run it on CPU and wherever fla cannot. Its references (the
token-by-token recurrence, the spec) live in :mod:`.naive`; ``tests/linear/test_torch_ops.py``
holds the two to 1e-10 in fp64. The math is in ``sp_attention/linear/README.md``.

Per batch b and head h with slope s_h >= 0 and decay lam_h = exp(-s_h)::

    S_t = lam_h * S_{t-1} + k_t^T v_t          # state [K, V], S_{-1} = initial_state (or 0)
    o_t = scale * q_t @ S_t                     # scale defaults to 1.0 (no 1/sqrt(K))

Shapes: q, k [B, T, H, K]; v [B, T, H, V]; slopes [H]; states [B, H, K, V]. Everything is
computed in fp32 (fp64 when any input is fp64, :func:`sp_attention.precision.acc_dtype`).
Every power of lam is formed as exp(-s * n) with n an integer held in the compute dtype:
never as lam**n, never by dividing by lam^C (which underflows to 0 for fast heads).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..precision import acc_dtype
from .gates import clamp_gates

__all__ = ["chunked_core", "chunked_linear_attention", "decay_powers", "check_shapes",
           "chunked_gated_core", "chunked_gated_attention", "check_gated_shapes", "chunk_rows",
           "gated_chunk_decays", "gated_chunk_outputs",
           "chunk_layout", "chunk_starts", "chunk_outputs"]


def decay_powers(
    slopes: torch.Tensor,
    n: int,
    offset: int = 0,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
) -> torch.Tensor:
    """lam^(offset + i) for i in [0, n) as exp(-s * (offset + i)): [H, n] in `dtype`."""
    device = slopes.device if device is None else device
    s = slopes.to(device=device, dtype=dtype)
    idx = torch.arange(n, device=device, dtype=dtype) + offset
    return torch.exp(-s[:, None] * idx[None, :])


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor) -> None:
    """``ValueError`` unless q, k ``[B, T, H, K]``, v ``[B, T, H, V]`` and slopes ``[H]``."""
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"expected q, k [B, T, H, K] and v [B, T, H, V] with equal B, T, H; got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if slopes.shape != (q.shape[2],):
        raise ValueError(f"slopes must have shape [H] = [{q.shape[2]}], got {tuple(slopes.shape)}")


def chunk_layout(x: torch.Tensor, C: int, dt: torch.dtype) -> torch.Tensor:
    """[B, T, H, D] -> [B, H, N, C, D] in `dt`, zero-padded at the end of the
    last chunk (zero k/v add nothing to any state; padded q rows are dropped)."""
    B, T, H, D = x.shape
    N = max(1, -(-T // C))
    x = x.to(dt).transpose(1, 2)
    if N * C - T:
        x = torch.nn.functional.pad(x, (0, 0, 0, N * C - T))
    return x.reshape(B, H, N, C, D)


def chunk_starts(kc: torch.Tensor, vc: torch.Tensor, s: torch.Tensor, T: int,
                 initial_state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """States entering each chunk ``[B, H, N, K, V]`` and the final state ``[B, H, K, V]``.

    Chunk n of true length L_n: S_{n+1} = lam^(L_n) S_n + sum_j lam^(L_n-1-j) k_j^T v_j.
    """
    B, H, N, C, K = kc.shape
    dt, dev = kc.dtype, kc.device
    idx = torch.arange(C, device=dev, dtype=dt)
    lengths = torch.full((N,), C, device=dev, dtype=dt)
    lengths[-1] = T - (N - 1) * C
    k_exp = (lengths[:, None] - 1 - idx[None, :]).clamp(min=0)  # [N, C]; padded rows have k = 0
    k_dec = torch.exp(-s[:, None, None] * k_exp[None])  # [H, N, C]
    b = torch.einsum("bhnjk,bhnjv->bhnkv", kc * k_dec[None, ..., None], vc)  # zero-start chunk states
    A = torch.exp(-s[:, None] * lengths[None, :])  # [H, N]
    # Sequential scan over chunks (N is small); a list keeps it autograd-friendly.
    S = kc.new_zeros(B, H, K, vc.shape[-1]) if initial_state is None else initial_state.to(dt)
    starts = []
    for n in range(N):
        starts.append(S)
        S = A[None, :, n, None, None] * S + b[:, :, n]
    return torch.stack(starts, dim=2), S


def chunk_outputs(qc: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, s: torch.Tensor,
                  S_start: torch.Tensor, scale: float, T: int) -> torch.Tensor:
    """o [B, T, H, V] from chunked q, k, v and the state entering each chunk ``S_start``:
    intra ``scale Σ_{j<=i} lam^(i-j) (q_i.k_j) v_j`` + inter ``scale lam^(i+1) q_i S_n``."""
    B, H, N, C, _ = qc.shape
    idx = torch.arange(C, device=qc.device, dtype=qc.dtype)
    # Intra-chunk decay mask lam^(i-j) for j <= i; the exponent is clamped at 0 before exp
    # so the masked-out upper triangle never holds inf (inf * 0 = NaN for fast heads).
    diff = idx[:, None] - idx[None, :]
    D = torch.exp(-s[:, None, None] * diff.clamp(min=0)) * (diff >= 0)  # [H, C, C]
    scores = torch.einsum("bhnik,bhnjk->bhnij", qc, kc) * D[None, :, None]
    o = torch.einsum("bhnij,bhnjv->bhniv", scores, vc)
    q_dec = torch.exp(-s[:, None] * (idx + 1)[None, :])  # [H, C]: lam^(i+1)
    o = o + torch.einsum("bhnik,bhnkv->bhniv", qc * q_dec[None, :, None, :, None], S_start)
    return (scale * o).reshape(B, H, N * C, -1)[:, :, :T].transpose(1, 2)


def chunked_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked form; returns (o [B, T, H, V], final state [B, H, K, V]) both in fp32/fp64.

    The sequence is cut into N chunks of chunk_size (the last one possibly shorter; it is
    zero-padded, and zero k/v add nothing to any state). Within chunk n, with local index
    i, j and true chunk length L_n:
        intra   o_i += scale * sum_{j<=i} lam^(i-j) (q_i . k_j) v_j
        inter   o_i += scale * lam^(i+1) q_i @ S_n                (S_n: state before chunk n)
        state   S_{n+1} = lam^(L_n) S_n + sum_j lam^(L_n-1-j) k_j^T v_j
    Differentiable by autograd (also w.r.t. initial_state and, in principle, slopes).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    check_shapes(q, k, v, slopes)
    dt = acc_dtype(q, k, v, initial_state)
    T = q.shape[1]
    qc, kc, vc = (chunk_layout(x, chunk_size, dt) for x in (q, k, v))
    s = slopes.to(device=q.device, dtype=dt)
    S_start, S = chunk_starts(kc, vc, s, T, initial_state)
    return chunk_outputs(qc, kc, vc, s, S_start, scale, T), S


def chunked_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor,
    *,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked pure-torch form of S_t = lam S_{t-1} + k_t^T v_t, o_t = scale q_t S_t.

    Any T (not only multiples of chunk_size). Returns (o [B, T, H, V] in q.dtype, final
    state [B, H, K, V] in fp32/fp64 or None). Differentiable by torch autograd, including
    w.r.t. initial_state.
    """
    o, S = chunked_core(q, k, v, slopes, scale, initial_state, chunk_size)
    return o.to(q.dtype), (S if output_final_state else None)


# ----------------------------------------------------------------------- per-token gates

def check_gated_shapes(q, k, v, g) -> None:
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"expected q, k [B, T, H, K] and v [B, T, H, V] with equal B, T, H; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if tuple(g.shape) != tuple(q.shape[:3]):
        raise ValueError(f"g must be [B, T, H] = {tuple(q.shape[:3])}, got {tuple(g.shape)}")


def chunk_rows(x: torch.Tensor, C: int, dt: torch.dtype) -> torch.Tensor:
    """``[B, T, H, *D]`` -> ``[B, H, N, C, *D]`` in ``dt``, zero-padded at the end (a padded
    token has ``g = 0``, ``k = v = 0``: it changes no state; its outputs are dropped)."""
    B, T = x.shape[:2]
    N = max(1, -(-T // C))
    x = x.to(dt)
    if N * C - T:
        x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, N * C - T))
    x = x.reshape(B, N, C, *x.shape[2:])
    return x.permute(0, 3, 1, 2, *range(4, x.dim())) if x.dim() > 4 else x.permute(0, 3, 1, 2)


def gated_chunk_decays(g: torch.Tensor, C: int, dt: torch.dtype):
    """From ``g [B, T, H]`` (clamped at the floor of ``dt``): the chunk-local inclusive sums
    ``Gc [B, H, N, C]``, the chunk totals ``Γ [B, H, N]``, the masked intra-chunk decays
    ``exp(Σ_{j<t≤i} g_t)·[j ≤ i]`` ``[B, H, N, C, C]`` and the end weights
    ``exp(Σ_{t>j} g_t)`` ``[B, H, N, C]`` (= ``exp(Γ − Gc_j)``). The exponents are segment
    sums (row i of column j sums the gates j+1 … i; the last row gives the end weights): a
    cumulative sum down the strictly lower triangle, 0 elsewhere (never an overflow)."""
    x = chunk_rows(clamp_gates(g, dt), C, dt)                                # [B, H, N, C]
    strict = torch.ones(C, C, dtype=torch.bool, device=g.device).tril(-1)
    seg = x[..., :, None].expand(*x.shape, C).masked_fill(~strict, 0.0).cumsum(-2)
    D = seg.exp() * torch.ones_like(strict).tril()
    Gc = x.cumsum(-1)
    return Gc, Gc[..., -1], D, seg[..., -1, :].exp()


def chunked_gated_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       scale: float, initial_state: Optional[torch.Tensor],
                       chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked form: ``(o [B, T, H, V], final state [B, H, K, V])``, both fp32/fp64.

    Within chunk n (local i, j; sums ``Gc`` from the chunk's start, total ``Γ_n``):
    intra ``scale Σ_{j≤i} exp(Gc_i − Gc_j)(q_i·k_j) v_j``, inter ``scale exp(Gc_i) q_i S_n``,
    state ``S_{n+1} = exp(Γ_n) S_n + Σ_j exp(Γ_n − Gc_j) k_jᵀ v_j``. Differentiable by
    autograd in q, k, v, g and the initial state."""
    check_gated_shapes(q, k, v, g)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    dt = acc_dtype(q, k, v, g, initial_state)
    T = q.shape[1]
    qc, kc, vc = (chunk_rows(x, chunk_size, dt) for x in (q, k, v))
    Gc, total, D, E = gated_chunk_decays(g, chunk_size, dt)
    B, H, N = qc.shape[:3]
    kd = kc * E[..., None]                                           # exp(Γ − Gc_j) k_j
    b = torch.einsum("bhnjk,bhnjv->bhnkv", kd, vc)                   # zero-start chunk states
    S = qc.new_zeros(B, H, qc.shape[-1], vc.shape[-1]) if initial_state is None \
        else initial_state.to(dt)
    starts = []
    for n in range(N):
        starts.append(S)
        S = total[:, :, n, None, None].exp() * S + b[:, :, n]
    S_start = torch.stack(starts, 2)                                 # [B, H, N, K, V]
    return gated_chunk_outputs(qc, kc, vc, Gc, D, S_start, scale, T), S


def gated_chunk_outputs(qc, kc, vc, Gc, D, S_start, scale, T) -> torch.Tensor:
    scores = torch.einsum("bhnik,bhnjk->bhnij", qc, kc) * D
    o = torch.einsum("bhnij,bhnjv->bhniv", scores, vc)
    o = o + torch.einsum("bhnik,bhnkv->bhniv", qc * Gc.exp()[..., None], S_start)
    B, H, N, C = Gc.shape
    return (scale * o).reshape(B, H, N * C, -1)[:, :, :T].transpose(1, 2)


def chunked_gated_attention(q, k, v, g, *, scale: float = 1.0,
                            initial_state: Optional[torch.Tensor] = None,
                            output_final_state: bool = False, chunk_size: int = 64):
    """:func:`chunked_gated_core` with the output in ``q.dtype`` (the reference's signature)."""
    o, S = chunked_gated_core(q, k, v, g, scale, initial_state, chunk_size)
    return o.to(q.dtype), (S if output_final_state else None)

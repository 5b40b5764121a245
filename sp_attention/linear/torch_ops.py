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

import torch

from ..precision import acc_dtype

__all__ = ["chunked_core", "chunked_linear_attention", "decay_powers", "check_shapes",
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

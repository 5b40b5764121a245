"""Pure-torch references for linear attention with a constant per-head decay (tests only).

Recurrence (the spec; the math is in ``sp_attention/linear/README.md``), per batch b and head
h with slope s_h >= 0 and decay lam_h = exp(-s_h):

    S_t = lam_h * S_{t-1} + k_t^T v_t          # state [K, V], S_{-1} = initial_state (or 0)
    o_t = scale * q_t @ S_t                     # scale defaults to 1.0 (no 1/sqrt(K))

so o_t = scale * sum_{j<=t} lam^(t-j) (q_t . k_j) v_j + scale * lam^(t+1) q_t @ S_{-1}.

Shapes: q, k [B, T, H, K]; v [B, T, H, V]; slopes [H]; states [B, H, K, V].
Everything is computed in fp32 (fp64 when any input is fp64); outputs are cast back to
q.dtype once, states stay in the compute dtype.

Here: the token-by-token recurrence, and the references of the fast ops that are not
themselves checked against it directly: fla's chunk recurrence (:func:`chunk_start_states`)
and our two Triton kernels (:func:`output_from_states_ref`, :func:`decayed_state_sum_ref`).
The torch backend's production kernel is :mod:`.torch_ops` (``chunked_core``); the two
chunk-form references here are built from its pieces, which ``tests/linear/test_torch_ops.py``
holds to the recurrence.

Every power of lam is formed as exp(-s * n) with n an integer held in the compute dtype:
never as lam**n, never by dividing by lam^C (which underflows to 0 for fast heads).
"""

from __future__ import annotations

import torch

from ..precision import acc_dtype
from .torch_ops import check_shapes, chunk_layout, chunk_outputs, chunk_starts

__all__ = [
    "recurrent_linear_attention",
    "chunk_decay",
    "compute_dtype",
    "chunk_start_states",
    "output_from_states_ref",
    "decayed_state_sum_ref",
]


# The library's one precision rule (sp_attention.precision), under the name this module's
# docstrings use: fp64 if any given tensor is fp64, else fp32.
compute_dtype = acc_dtype


def chunk_decay(
    slopes: torch.Tensor,
    C: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
) -> torch.Tensor:
    """lam^C = exp(-s * C): [H] in `dtype` (the scan's transition A for a leaf of C tokens)."""
    device = slopes.device if device is None else device
    return torch.exp(-slopes.to(device=device, dtype=dtype) * C)


def recurrent_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               slopes: torch.Tensor, *, scale: float = 1.0,
                               initial_state: torch.Tensor | None = None,
                               output_final_state: bool = False,
                               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token reference: S_t = lam S_{t-1} + k_t^T v_t, o_t = scale q_t S_t.

    Returns (o [B, T, H, V] in q.dtype, final state [B, H, K, V] in fp32/fp64 or None).
    Slow (a Python loop over T); for tests and as the spec.
    """
    check_shapes(q, k, v, slopes)
    dt = compute_dtype(q, k, v, initial_state)
    B, T, H, K = q.shape
    V = v.shape[-1]
    qf, kf, vf = (x.to(dt) for x in (q, k, v))
    lam = chunk_decay(slopes, 1, dtype=dt, device=q.device)[None, :, None, None]  # [1, H, 1, 1]
    if initial_state is None:
        S = q.new_zeros(B, H, K, V, dtype=dt)
    else:
        S = initial_state.to(dt)
    outs = []
    for t in range(T):
        S = lam * S + kf[:, t, :, :, None] * vf[:, t, :, None, :]  # [B, H, K, V]
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", qf[:, t], S))
    o = torch.stack(outs, dim=1) if T > 0 else q.new_zeros(B, 0, H, V, dtype=dt)
    return o.to(q.dtype), (S if output_final_state else None)


def chunk_start_states(k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor,
                       chunk_size: int = 64,
                       initial_state: torch.Tensor | None = None) -> torch.Tensor:
    """The state entering each chunk, ``[B, N, H, K, V]`` (fla's ``h`` layout), fp32/fp64.

    Reference for the chunk recurrence that fla's ``chunk_fwd_h`` runs (N = ceil(T / chunk)).
    """
    check_shapes(k, k, v, slopes)
    dt = compute_dtype(k, v, initial_state)
    kc, vc = chunk_layout(k, chunk_size, dt), chunk_layout(v, chunk_size, dt)
    s = slopes.to(device=k.device, dtype=dt)
    return chunk_starts(kc, vc, s, k.shape[1], initial_state)[0].transpose(1, 2)


def output_from_states_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h: torch.Tensor,
                           S_in: torch.Tensor, slopes: torch.Tensor, scale: float,
                           chunk_size: int = 64) -> torch.Tensor:
    """Output of a leaf from its zero-start chunk states and the state entering it.

    ``h [B, N, H, K, V]`` are the states entering each chunk when the leaf starts from zero;
    by linearity the true ones are ``h_n + lam^(n·chunk) S_in``, and ``o`` follows as in
    :func:`sp_attention.linear.torch_ops.chunked_core`. Pure-torch reference of the Triton
    kernel :func:`sp_attention.linear.kernels.output_from_states`. Returns ``[B, T, H, V]``
    in fp32/fp64.
    """
    check_shapes(q, k, v, slopes)
    dt = compute_dtype(q, k, v, S_in)
    T, C = q.shape[1], chunk_size
    qc, kc, vc = (chunk_layout(x, C, dt) for x in (q, k, v))
    s = slopes.to(device=q.device, dtype=dt)
    N = qc.shape[2]
    carry = torch.exp(-s[:, None] * (torch.arange(N, device=q.device, dtype=dt) * C))  # [H, N]
    S_start = h.to(dt).transpose(1, 2) + carry[None, :, :, None, None] * S_in.to(dt)[:, :, None]
    return chunk_outputs(qc, kc, vc, s, S_start, scale, T)


def decayed_state_sum_ref(x: torch.Tensor, y: torch.Tensor, slopes: torch.Tensor, base: int,
                          step: int) -> torch.Tensor:
    """``Σ_t λ^(base + step·t) x_tᵀ y_t`` -> ``[B, H, K, V]`` in fp32/fp64: a leaf's zero-start
    end state (x = k, y = v, base = C−1, step = −1) or its state-gradient contribution
    (x = q, y = dO, base = 1, step = +1). Reference of
    :func:`sp_attention.linear.kernels.decayed_state_sum`."""
    dt = compute_dtype(x, y)
    n = base + step * torch.arange(x.shape[1], device=x.device, dtype=dt)
    w = torch.exp(-slopes.to(device=x.device, dtype=dt)[:, None] * n[None, :])   # [H, T]
    return torch.einsum("bthk,bthv->bhkv", x.to(dt) * w.t()[None, :, :, None], y.to(dt))

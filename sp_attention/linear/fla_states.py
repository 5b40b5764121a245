"""fla's two chunk-state kernels launched by us: no device sync for varlen rows, and the host
cost of a remembered launch.

fla 0.6's ``chunk_fwd_h`` and ``chunk_bwd_dh`` compute, for varlen sequences, each sequence's
first chunk (``split_offsets``) on the device and then read the total on the host
(``split_offsets[-1].item()``) to size their output: a device sync in every call, which stops
the host from queueing ahead of the GPU (three per packed linear layer's forward + backward).
The packing plan knows the boundaries on the host already (:mod:`.varlen`), so these launchers
take ``split_offsets`` (the device tensor) and ``num_splits`` (their total) as two more
keywords. With them, and for fixed-length rows at one split per chunk (fla's default), they
launch fla's own Triton kernels (``chunk_fwd_kernel_h``, ``chunk_bwd_kernel_dh``) with exactly
the arguments fla's wrappers pass, through :func:`sp_attention.triton_launch.launch` (Triton's
per-call Python once per call signature). Otherwise (varlen rows without the split counts,
other split sizes) they are fla's functions. The GPU test (``tests/linear/test_kernels.py``,
``-m gpu``) checks them bit for bit against fla's.
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch

from ..triton_launch import launch

__all__ = ["chunk_fwd_h", "chunk_bwd_dh"]


def _ours(cu_seqlens, split_offsets, num_splits, chunk_size, split_size) -> bool:
    """Whether we launch the kernel: fixed-length rows at one split per chunk, or varlen rows
    whose split counts the host knows."""
    if cu_seqlens is None:
        return split_size in (None, chunk_size)
    if split_offsets is None or num_splits is None:
        return False
    if split_size not in (None, chunk_size):
        raise ValueError(f"split_offsets are per chunk: split_size must be None or chunk_size "
                         f"({chunk_size}), got {split_size}")
    return True


def _counts(B: int, T: int, chunk_size: int, cu_seqlens, num_splits) -> tuple[int, int]:
    """(sequences N, splits NS): fla's ``N, NS`` for one split per chunk."""
    if cu_seqlens is None:
        return B, -(-T // chunk_size)
    return cu_seqlens.numel() - 1, num_splits


def _grid(K: int, V: int, N: int, H: int):
    import triton

    def grid(meta):
        return (triton.cdiv(K, meta["BK"]) * triton.cdiv(V, meta["BV"]) * N * H,)
    return grid


def chunk_fwd_h(k: torch.Tensor, v: torch.Tensor, g=None, g_gamma=None, gk=None, gv=None,
                h0=None, output_final_state: bool = False, state_v_first: bool = False,
                cu_seqlens=None, chunk_size: int = 64, split_size=None,
                states_in_fp32: bool = False, split_offsets: Optional[torch.Tensor] = None,
                num_splits: Optional[int] = None):
    """fla's ``chunk_fwd_h`` (same keywords, same results), launched by us (module doc)."""
    from fla.ops.common import chunk_h
    if not _ours(cu_seqlens, split_offsets, num_splits, chunk_size, split_size):
        return inspect.unwrap(chunk_h.chunk_fwd_h)(
            k, v, g=g, g_gamma=g_gamma, gk=gk, gv=gv, h0=h0,
            output_final_state=output_final_state, state_v_first=state_v_first,
            cu_seqlens=cu_seqlens, chunk_size=chunk_size, split_size=split_size,
            states_in_fp32=states_in_fp32)
    B, T, H, K, V = *k.shape, v.shape[-1]
    N, NS = _counts(B, T, chunk_size, cu_seqlens, num_splits)
    shape = (V, K) if state_v_first else (K, V)
    h = k.new_empty(B, NS, H, *shape,
                    dtype=torch.float if states_in_fp32 else k.dtype)
    ht = k.new_empty(N, H, *shape, dtype=torch.float) if output_final_state else None
    launch(
        chunk_h.chunk_fwd_kernel_h, _grid(K, V, N, H), k=k, v=v, h=h, g=g, g_gamma=g_gamma,
        gk=gk, gv=gv, h0=h0, ht=ht, cu_seqlens=cu_seqlens, split_offsets=split_offsets, T=T, H=H, K=K, V=V,
        BT=chunk_size, BS=chunk_size, USE_G=g is not None, USE_G_GAMMA=g_gamma is not None,
        USE_GK=gk is not None, USE_GV=gv is not None, STATE_V_FIRST=state_v_first)
    return h, ht


def chunk_bwd_dh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, h0,
                 dht, scale: float, g=None, g_gamma=None, gk=None, gv=None,
                 state_v_first: bool = False, cu_seqlens=None, chunk_size: int = 64,
                 split_size=None, states_in_fp32: bool = False,
                 split_offsets: Optional[torch.Tensor] = None, num_splits: Optional[int] = None):
    """fla's ``chunk_bwd_dh`` (same keywords, same results), launched by us (module doc)."""
    from fla.ops.common import chunk_h
    if not _ours(cu_seqlens, split_offsets, num_splits, chunk_size, split_size):
        return inspect.unwrap(chunk_h.chunk_bwd_dh)(
            q, k, v, do, h0, dht, scale, g=g, g_gamma=g_gamma, gk=gk, gv=gv,
            state_v_first=state_v_first, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
            split_size=split_size, states_in_fp32=states_in_fp32)
    B, T, H, K, V = *k.shape, v.shape[-1]
    HQ = q.shape[2]
    N, NS = _counts(B, T, chunk_size, cu_seqlens, num_splits)
    shape = (V, K) if state_v_first else (K, V)
    dh = k.new_empty(B, NS, HQ, *shape,
                     dtype=torch.float if states_in_fp32 else k.dtype)
    dh0 = torch.empty_like(h0, dtype=torch.float) if h0 is not None else None
    launch(
        chunk_h.chunk_bwd_kernel_dh, _grid(K, V, N, H), q=q, g=g, g_gamma=g_gamma, gk=gk,
        gv=gv, do=do, dh=dh, dht=dht, dh0=dh0, cu_seqlens=cu_seqlens, split_offsets=split_offsets, scale=scale, T=T, HQ=HQ, H=H,
        K=K, V=V, BT=chunk_size, BS=chunk_size, NG=HQ // H, USE_G=g is not None,
        USE_G_GAMMA=g_gamma is not None, USE_GK=gk is not None, USE_GV=gv is not None,
        STATE_V_FIRST=state_v_first)
    return dh, dh0

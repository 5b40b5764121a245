"""Index tensors of fla's varlen layout (several sequences in one row), made on the host from
boundaries the packing plan already holds (no device sync), cached per (boundaries, device).

fla's varlen kernels take ``cu_seqlens`` (int32 ``[N+1]``) and enumerate the chunks of every
sequence in order: ``chunk_indices [NT, 2]`` holds (sequence, chunk within it) per chunk
(fla's ``prepare_chunk_indices``), and the chunk states ``h [1, NT, H, K, V]`` follow the same
order (sequence n's chunks start at ``chunk_offsets[n]``).
"""
from __future__ import annotations

import functools

import torch

from ..caches import to_device

__all__ = ["cu_seqlens_tensor", "chunk_indices", "chunk_offsets", "chunk_offsets_tensor"]


def _chunks(n: int, chunk: int) -> int:
    return -(-n // chunk)


@functools.lru_cache(maxsize=128)
def cu_seqlens_tensor(cu: tuple, device: torch.device) -> torch.Tensor:
    """``cu`` as an int32 tensor on ``device``."""
    return to_device(torch.tensor(cu, dtype=torch.int32), device)


@functools.lru_cache(maxsize=128)
def chunk_indices(cu: tuple, chunk: int, device: torch.device) -> torch.Tensor:
    """int32 ``[NT, 2]``: (sequence, chunk within the sequence) of every chunk, in order."""
    rows = [(n, c) for n in range(len(cu) - 1) for c in range(_chunks(cu[n + 1] - cu[n], chunk))]
    return to_device(torch.tensor(rows, dtype=torch.int32).reshape(-1, 2), device)


def chunk_offsets(cu: tuple, chunk: int) -> tuple:
    """The first chunk of every sequence in the varlen chunk order, and the total (``[N+1]``)."""
    out = [0]
    for n in range(len(cu) - 1):
        out.append(out[-1] + _chunks(cu[n + 1] - cu[n], chunk))
    return tuple(out)


@functools.lru_cache(maxsize=128)
def chunk_offsets_tensor(cu: tuple, chunk: int, device: torch.device) -> torch.Tensor:
    """:func:`chunk_offsets` as the int64 tensor fla's chunk-state kernels read
    (``split_offsets``: fla computes the same on the device and reads its last entry on the
    host, a device sync; :mod:`.fla_states` passes both from here)."""
    return to_device(torch.tensor(chunk_offsets(cu, chunk), dtype=torch.int64), device)

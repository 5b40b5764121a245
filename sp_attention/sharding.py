"""Split a global sequence over a CP group and put it back together.

Pure tensor functions (no communication): ``shard_sequence`` picks this rank's tokens for the
layout, ``unshard_sequence`` rebuilds the global tensor from every rank's shard. Labels are
shifted *before* sharding so that the token after a shard boundary is still the target.
"""
from __future__ import annotations

from typing import Sequence, Union

import torch

from .context import SPContext
from .planning.layout import leaves_of_rank, num_chunks, shard_ranges

__all__ = ["shard_sequence", "unshard_sequence", "shard_position_ids", "shift_labels",
           "pad_to_multiple", "pad_for_layout"]


def _rank_world_layout(ctx: SPContext) -> tuple[int, int, str]:
    if not isinstance(ctx, SPContext):
        raise TypeError(f"expected an SPContext, got {type(ctx).__name__}")
    return ctx.rank, ctx.world_size, ctx.layout


def shard_sequence(x: torch.Tensor, ctx: SPContext, dim: int = 1) -> torch.Tensor:
    """This rank's part of the global tensor ``x`` along the sequence ``dim``.

    zigzag: chunks ``r`` and ``2P−1−r`` of ``2P`` concatenated (a new tensor, a copy);
    contiguous: the ``r``-th of ``P`` pieces (a view of ``x``, sharing its memory and autograd
    graph; ``.contiguous()`` it if the layer needs dense memory). Differentiable either way.
    The sequence length must split evenly (see :func:`pad_for_layout`).
    """
    rank, world, layout = _rank_world_layout(ctx)
    dim = dim % x.dim()
    parts = [x.narrow(dim, s, e - s) for s, e in shard_ranges(rank, world, x.shape[dim], layout)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def unshard_sequence(shards: Sequence[torch.Tensor], layout: str, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: ``shards[r]`` is rank r's shard."""
    world = len(shards)
    if world < 1:
        raise ValueError("unshard_sequence needs at least one shard")
    dim = dim % shards[0].dim()
    n = num_chunks(world, layout)
    per_rank = n // world
    chunks: list = [None] * n
    for r, shard in enumerate(shards):
        if shard.shape != shards[0].shape:
            raise ValueError(f"shard {r} has shape {tuple(shard.shape)}, rank 0 has "
                             f"{tuple(shards[0].shape)}")
        for piece, leaf in zip(shard.chunk(per_rank, dim), leaves_of_rank(r, world, layout)):
            chunks[leaf] = piece
    return torch.cat(chunks, dim)


def shard_position_ids(seq_len: int, ctx: SPContext, device=None) -> torch.Tensor:
    """Global position ids ``[T_local]`` (int64) of this rank's tokens; pass these (not
    ``arange(T_local)``) to RoPE."""
    rank, world, layout = _rank_world_layout(ctx)
    return torch.cat([torch.arange(s, e, device=device)
                      for s, e in shard_ranges(rank, world, seq_len, layout)])


def shift_labels(labels: torch.Tensor, ignore_index: int = -100, dim: int = -1) -> torch.Tensor:
    """Next-token targets: ``out[..., t] = labels[..., t+1]``, the last one ``ignore_index``.

    Do this on the *global* sequence before sharding: after sharding, a shard's last token's
    target lives on another rank.
    """
    dim = dim % labels.dim()
    fill = torch.full_like(labels.narrow(dim, 0, 1), ignore_index)
    return torch.cat([labels.narrow(dim, 1, labels.shape[dim] - 1), fill], dim)


def pad_to_multiple(x: torch.Tensor, multiple: int, dim: int = 1, value: Union[int, float] = 0,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad ``x`` along ``dim`` to a multiple of ``multiple``.

    Returns ``(padded, valid)`` where ``valid`` is a bool ``[T_padded]`` mask, True at real
    tokens. Pad labels with ``ignore_index`` so padded positions carry no loss; with causal
    attention, right padding never changes the real tokens' outputs.
    """
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    dim = dim % x.dim()
    t = x.shape[dim]
    pad = (-t) % multiple
    valid = torch.zeros(t + pad, dtype=torch.bool, device=x.device)
    valid[:t] = True
    if pad == 0:
        return x, valid
    shape = list(x.shape)
    shape[dim] = pad
    filler = torch.full(shape, value, dtype=x.dtype, device=x.device)
    return torch.cat([x, filler], dim), valid


def pad_for_layout(x: torch.Tensor, ctx: SPContext, dim: int = 1, value: Union[int, float] = 0,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad the sequence so it splits for ``ctx``'s layout (multiple of 2P for zigzag, P for
    contiguous)."""
    return pad_to_multiple(x, num_chunks(ctx.world_size, ctx.layout), dim, value)


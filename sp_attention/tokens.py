"""A loss split over context-parallel (and data-parallel) ranks: each rank's share of the mean
over the global batch.

With the sequence split over CP (and the batch over DP), the loss of the global batch is
``Σ token losses / global count of real tokens``. Each rank computes its share: its *local*
sum divided by the *global* count. The shares add up to the global mean, so the gradient of
the global loss is the **sum** of every rank's local gradients over the DP × CP group — one
all-reduce (sum), no division by a world size (``sp_train.reduce.all_reduce_gradients``, or
Megatron's own DDP). Framework-free: the HF adapter, the Megatron-Core models and ``train.py``
use it alike.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["global_token_mean", "global_token_count", "require_real_tokens", "group_size"]


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    if group is None:
        return 1
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError("group must be a torch.distributed.ProcessGroup or None (single "
                        f"process); got {type(group).__name__} — is this rank a member of it?")
    return dist.get_world_size(group)


def global_token_mean(token_loss: torch.Tensor, mask: Optional[torch.Tensor] = None,
                      group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """This rank's share of the mean token loss over every rank of ``group``.

    Args:
        token_loss: per-token losses of this rank's tokens (any shape).
        mask: same shape, 1/True for real tokens (padding and ignored labels 0); None = all.
        group: the ranks whose tokens make up one global batch (CP, or DP × CP); None = this
            process only.

    Returns:
        ``Σ_local masked loss / Σ_group count`` (a 0-d tensor, differentiable through the
        local sum; the count is a constant). Summed over ``group`` it is the global mean: sum
        gradients over ``group`` (``sp_train.reduce.all_reduce_gradients``) and log the all-reduced value.
        Ranks with no real token contribute 0; a batch with no real token anywhere raises.
    """
    if mask is not None:
        if mask.shape != token_loss.shape:
            raise ValueError(f"mask {tuple(mask.shape)} must have the shape of token_loss "
                             f"{tuple(token_loss.shape)}")
        local_sum = (token_loss * mask.to(token_loss.dtype)).sum()
    else:
        local_sum = token_loss.sum()
    total = global_token_count(token_loss if mask is None else mask, group,
                               all_real=mask is None)
    return local_sum / total


def global_token_count(mask: torch.Tensor, group: Optional[dist.ProcessGroup] = None, *,
                       all_real: bool = False) -> float:
    """Real tokens over every rank of ``group``: ``Σ_group Σ mask`` (``all_real``: every element
    of ``mask`` counts). Divide a local loss *sum* by it for this rank's share of the global
    mean (:func:`global_token_mean` does). Raises when no rank has a real token."""
    if all_real:
        count = torch.tensor(float(mask.numel()), dtype=torch.float64, device=mask.device)
    else:
        count = mask.detach().to(torch.float64).sum()
    if group_size(group) > 1:
        count = count.clone()
        dist.all_reduce(count, group=group)
    return require_real_tokens(float(count.item()))


def require_real_tokens(total: float) -> float:
    """``total`` (a global count of real tokens), refused when it is not positive: a loss mean
    over no token. The same on every rank when ``total`` is an all-reduced count."""
    if total <= 0:
        raise ValueError("no real token in the global batch (every label is masked); check the "
                         "labels, the padding mask and ignore_index")
    return total

"""Cross-rank reductions a training loop needs around context-parallel attention.

With the sequence split over CP (and the batch over DP), the loss of the global batch is
``Σ token losses / global count of real tokens``. Each rank computes its share: its *local*
sum divided by the *global* count. The shares add up to the global mean, so the gradient of
the global loss is the **sum** of every rank's local gradients over the DP × CP group — one
all-reduce (sum), no division by a world size. Framework-free: used by the HF adapter, the
Megatron-Core models and ``train.py`` alike (Megatron's own optimizer/DDP do the same job on
GPUs; FSDP users reduce their way).
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist

from sp_attention.precision import acc_dtype

__all__ = ["global_token_mean", "global_token_count", "all_reduce_gradients"]


def _group_size(group: Optional[dist.ProcessGroup]) -> int:
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
        gradients over ``group`` (:func:`all_reduce_gradients`) and log the all-reduced value.
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
    if _group_size(group) > 1:
        count = count.clone()
        dist.all_reduce(count, group=group)
    total = float(count.item())
    if total <= 0:
        raise ValueError("no real token in the global batch (every label is masked); check the "
                         "labels, the padding mask and ignore_index")
    return total


def all_reduce_gradients(parameters: Iterable[torch.nn.Parameter],
                         group: Optional[dist.ProcessGroup], *, scale: float = 1.0) -> None:
    """Sum ``.grad`` of ``parameters`` over ``group`` in place, then multiply by ``scale``.

    Every rank of ``group`` must pass the same parameters in the same order (same shapes);
    parameters without a gradient are skipped on every rank alike only if they are skipped on
    all of them, so a missing gradient is treated as zeros. Gradients travel in fp32 flat
    buckets (fp64 for fp64 parameters; one all-reduce per device and dtype) and are written back in their own dtype.
    """
    params = [p for p in parameters if p.requires_grad]
    if _group_size(group) == 1:
        if scale != 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        return
    buckets: dict = {}
    for p in params:     # fp64 stays fp64, everything else travels in fp32
        acc = acc_dtype(p)
        buckets.setdefault((str(p.device), acc), []).append(p)
    for (_, acc), ps in sorted(buckets.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p))
                          .reshape(-1).to(acc) for p in ps])
        dist.all_reduce(flat, group=group)
        if scale != 1.0:
            flat.mul_(scale)
        offset = 0
        for p in ps:
            n = p.numel()
            g = flat[offset:offset + n].view_as(p).to(p.dtype)
            offset += n
            if p.grad is None:
                p.grad = g
            else:
                p.grad.copy_(g)

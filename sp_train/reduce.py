"""The gradient reduction of train.py's loop: each rank's gradient of its loss share
(:func:`sp_attention.tokens.global_token_mean`, re-exported here) summed over the DP × CP group
in fp32 buckets. Megatron's own optimizer/DDP do the same job on GPUs; FSDP users reduce their
way.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist

from sp_attention.precision import acc_dtype
from sp_attention.tokens import global_token_count, global_token_mean, group_size

__all__ = ["global_token_mean", "global_token_count", "all_reduce_gradients"]


def all_reduce_gradients(parameters: Iterable[torch.nn.Parameter],
                         group: Optional[dist.ProcessGroup], *, scale: float = 1.0) -> None:
    """Sum ``.grad`` of ``parameters`` over ``group`` in place, then multiply by ``scale``.

    Every rank of ``group`` must pass the same parameters in the same order (same shapes);
    parameters without a gradient are skipped on every rank alike only if they are skipped on
    all of them, so a missing gradient is treated as zeros. Gradients travel in fp32 flat
    buckets (fp64 for fp64 parameters; one all-reduce per device and dtype) and are written back in their own dtype.
    """
    params = [p for p in parameters if p.requires_grad]
    if group_size(group) == 1:
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

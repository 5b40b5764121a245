"""Input checks both public ops share: the context default, tensor types, the local length
the layout must split, and the hint for ``[B, H, T, D]`` tensors (the SDPA / HF layout) passed
where ``[B, T, H, D]`` is expected."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .context import SPContext
from .planning.layout import PAD_HELPER

__all__ = ["PAD_HELPER", "is_int", "resolve_ctx", "check_tensors", "check_local_length",
           "sdpa_hint", "autocast_inputs", "autocast_off"]


def autocast_inputs(*tensors):
    """SDPA's mixed-precision rule for both public ops: under ``torch.autocast`` for the
    tensors' device type, floating inputs are cast to the autocast dtype (HF's RoPE hands
    over q and k in fp32 with v in bf16 there); outside autocast they are returned as they
    are (mismatched dtypes then stay an error of the op's checks). Casting here, outside the
    autograd Function, sends the gradients back in each input's own dtype. Non-tensors pass
    through (their type errors are reported by the checks)."""
    first = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
    if first is None or not torch.is_autocast_enabled(first.device.type):
        return tensors
    dtype = torch.get_autocast_dtype(first.device.type)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                 for t in tensors)


def autocast_off(device: torch.device):
    """A context without autocast for ``device``'s type: the ops' kernels, states and merges
    run in the dtypes the ops chose (inputs in the autocast dtype, cross-rank math fp32),
    also when a caller runs backward inside an autocast region."""
    return torch.autocast(device_type=device.type, enabled=False)


def is_int(x) -> bool:
    """An int that is not a bool (``True`` is not a head count)."""
    return isinstance(x, int) and not isinstance(x, bool)


def resolve_ctx(ctx) -> SPContext:
    """``ctx`` itself, or a single-device context for None; a ``TypeError`` naming the fix for
    anything else (a process group, or the int ``dist.new_group`` returns to non-members)."""
    if ctx is None:
        return SPContext(None, 0, 1, (0,), "contiguous")
    if isinstance(ctx, SPContext):
        return ctx
    if isinstance(ctx, dist.ProcessGroup):
        raise TypeError("ctx must be an SPContext, got a ProcessGroup; build the context once "
                        "with sp_attention.build_sp_context(group, layout=...) and pass that")
    if isinstance(ctx, int) and ctx == dist.GroupMember.NON_GROUP_MEMBER:
        raise TypeError("ctx is GroupMember.NON_GROUP_MEMBER, what dist.new_group returns on a "
                        "process outside the group's ranks: this process is not a member of "
                        "the CP group; call the op only on member ranks, with their SPContext")
    raise TypeError(f"ctx must be an SPContext or None, got {type(ctx).__name__}")


def check_tensors(**named) -> None:
    """``TypeError`` for the first argument that is not a tensor."""
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def sdpa_hint(q: torch.Tensor, heads: Optional[int] = None) -> str:
    """A sentence for messages about ``q [B, T, H, D]`` when the shapes suggest ``[B, H, T, D]``
    was passed: ``heads`` (the head count known from elsewhere, e.g. slopes) sits in dim 1,
    not dim 2; or, with ``heads`` unknown, the empty string."""
    if heads is not None and q.dim() == 4 and q.shape[1] == heads != q.shape[2]:
        return (f" q {tuple(q.shape)} looks like [B, H, T, D] (the SDPA / HF layout: dim 1 "
                f"holds the {heads} heads); this op takes [B, T_local, H, D]: pass "
                "q.transpose(1, 2) (and k, v) and transpose the output back.")
    return ""


def check_local_length(q: torch.Tensor, ctx: SPContext) -> None:
    """The local length (dim 1) must be a positive multiple of the rank's chunk count."""
    n = len(ctx.leaves)
    t = q.shape[1]
    if t == 0 or t % n:
        hint = ""
        if q.dim() == 4 and q.shape[2] % n == 0 and q.shape[2] > q.shape[1]:
            hint = (f" If q {tuple(q.shape)} is [B, H, T, D] (the SDPA / HF layout), pass "
                    "q.transpose(1, 2) (and k, v) instead.")
        raise ValueError(f"the local sequence length {t} must be a positive multiple of {n} "
                         f"for layout {ctx.layout!r} (each rank holds {n} equal chunks); pad "
                         f"the global sequence with {PAD_HELPER} before sharding.{hint}")

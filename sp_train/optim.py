"""AdamW with fp32 master weights, TP-aware gradient-norm clipping and a step-indexed learning
rate: plain torch, so the same code runs on CPU/gloo and GPU/NCCL (Megatron's own optimizer
needs CUDA).

With fp32 parameters the master weights *are* the parameters; with bf16 parameters (GPU) the
optimizer keeps fp32 copies, steps those, and copies back — Megatron's mixed-precision recipe.
The learning rate is a pure function of the step (linear warmup, cosine decay), so a resumed run
needs no scheduler state.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from sp_attention.precision import acc_dtype

__all__ = ["MasterAdamW", "lr_at", "squared_norm", "clip_scale", "clip_", "init_adam_state"]


def lr_at(step: int, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """Learning rate of 0-based ``step``: linear warmup over ``warmup`` steps, then cosine from
    ``lr`` to ``min_lr`` at ``total``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * min(1.0, t)))


def squared_norm(params: list, grads: list, tp_rank: int) -> torch.Tensor:
    """The fp64 sum of squares of ``grads`` (one per entry of ``params``, None skipped): per
    tensor by one multi-tensor kernel that reads each gradient once, accumulating in fp32 (fp64
    for fp64 gradients). TP-split parameters (Megatron marks them ``tensor_model_parallel``)
    count on every TP rank, replicated ones on TP rank 0 only, so a sum over the TP group is
    the model's."""
    sq = torch.zeros((), dtype=torch.float64, device=params[0].device if params else "cpu")
    by_acc: dict = {}
    for p, g in zip(params, grads):
        counted = getattr(p, "tensor_model_parallel", False) or tp_rank == 0
        if g is not None and counted:
            by_acc.setdefault(acc_dtype(g), []).append(g.detach())
    for acc, gs in by_acc.items():
        norms = torch._foreach_norm(gs, 2.0, dtype=acc)
        sq += torch.stack(norms).to(torch.float64).pow(2).sum()
    return sq


def init_adam_state(opt: torch.optim.AdamW, masters: list, step: float = 0.0) -> None:
    """AdamW's state of ``masters`` that has none yet: zero moments, ``step`` (a float32
    scalar, on the device for CUDA masters, as fused AdamW keeps it)."""
    for m in masters:
        if m not in opt.state or not opt.state[m]:
            opt.state[m] = {
                "step": torch.tensor(float(step), dtype=torch.float32,
                                     device=m.device if m.is_cuda else "cpu"),
                "exp_avg": torch.zeros_like(m, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(m, memory_format=torch.preserve_format)}


def clip_scale(norm: torch.Tensor, clip_grad: float) -> Optional[torch.Tensor]:
    """The factor that clips a gradient of global norm ``norm`` (a 0-dim fp64 tensor) to
    ``clip_grad``: ``min(1, clip_grad / (norm + 1e-6))`` in fp64 — a 0-dim tensor on
    ``norm``'s device, so the step never waits for the GPU to read the norm (on CUDA that wait
    kept the host from launching the optimizer and the next step's work until the backward
    had finished); ``None`` when clipping is off (``clip_grad`` 0)."""
    if clip_grad <= 0:
        return None
    return torch.clamp(clip_grad / (norm + 1e-6), max=1.0)


def clip_(grads: list, norm: torch.Tensor, clip_grad: float) -> None:
    """Clip ``grads`` (one dtype) in place to global norm ``clip_grad`` (:func:`clip_scale`,
    rounded to their dtype as a Python float multiplying them would be; a factor of exactly 1
    leaves them bit for bit as they are, at the cost of one pass the host-side factor skipped)."""
    scale = clip_scale(norm, clip_grad)
    if scale is not None and grads:
        torch._foreach_mul_(grads, scale.to(grads[0].dtype))


class MasterAdamW:
    """AdamW over fp32 masters of ``named_params`` (a list of ``(name, param)``).

    ``tp_group``/``tp_rank`` make the gradient norm global: TP-split parameters (Megatron marks
    them ``tensor_model_parallel``) count on every TP rank, replicated ones once.
    """

    overlap_param_gather = False         # nothing to overlap: the parameters step in place

    def __init__(self, named_params, *, lr: float, betas, weight_decay: float,
                 tp_group: Optional[dist.ProcessGroup], tp_rank: int):
        self.names = [n for n, p in named_params if p.requires_grad]
        self.params = [p for _, p in named_params if p.requires_grad]
        self.master = [p if p.dtype == torch.float32
                       else p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.tp_group, self.tp_rank = tp_group, tp_rank
        fused = all(p.is_cuda for p in self.master) or None
        decay = [m for n, m in zip(self.names, self.master) if m.dim() > 1]
        no_decay = [m for n, m in zip(self.names, self.master) if m.dim() <= 1]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=lr, betas=tuple(betas), eps=1e-8, fused=fused)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for m, p in zip(self.master, self.params):
            if m is not p:
                m.grad = None

    def settle(self) -> None:
        """Nothing travels after a step here (:meth:`ShardedAdamW.settle
        <sp_train.sharded_optim.ShardedAdamW.settle>` finishes its parameter gathers)."""

    def grad_norm(self, grads: Optional[list] = None) -> torch.Tensor:
        """The global L2 norm of the gradients (``.grad``, or ``grads`` aligned with
        ``params``): :func:`squared_norm`, summed over the TP group; a 0-dim fp64 tensor on
        the gradients' device (read it after the step's agreement: no wait of its own)."""
        grads = [p.grad for p in self.params] if grads is None else grads
        sq = squared_norm(self.params, grads, self.tp_rank)
        if self.tp_group is not None and dist.get_world_size(self.tp_group) > 1:
            dist.all_reduce(sq, group=self.tp_group)
        return sq.sqrt()

    def step(self, lr: float, clip_grad: float, grads: Optional[list] = None) -> torch.Tensor:
        """Clip to ``clip_grad`` (0 = off), step at ``lr``; returns the gradient norm. The
        gradients are ``.grad``, or ``grads`` (one per parameter, in ``params`` order; fp32, as
        :class:`sp_train.reduce.GradientReducer` returns them: the masters step from them
        without a cast)."""
        if grads is not None and len(grads) != len(self.params):
            raise ValueError(f"grads: {len(grads)} tensors for {len(self.params)} parameters")
        norm = self.grad_norm(grads)
        given = grads if grads is not None else [p.grad for p in self.params]
        grads = []
        for m, p, g in zip(self.master, self.params, given):
            g = g if g is not None else torch.zeros_like(m)
            m.grad = g.to(m.dtype) if g.dtype != m.dtype else g
            grads.append(m.grad)
        clip_(grads, norm, clip_grad)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        low = [(p, m) for m, p in zip(self.master, self.params) if m is not p]
        if low:
            with torch.no_grad():
                torch._foreach_copy_([p for p, _ in low], [m for _, m in low])
        self.zero_grad()
        return norm

    def init_state(self) -> None:
        """Create Adam's state (zeros) so a checkpoint can be loaded into it in place."""
        init_adam_state(self.opt, self.master)

    def state_tensors(self) -> dict:
        """``{name: tensor}`` of everything a resume needs (Adam moments, step, fp32 masters):
        ``<param>.exp_avg``, ``.exp_avg_sq``, ``.step`` and, for 16-bit parameters,
        ``.master`` (the checkpoint format :class:`~sp_train.sharded_optim.ShardedAdamW` writes
        and reads too)."""
        out = {}
        for n, m, p in zip(self.names, self.master, self.params):
            for k, v in self.opt.state.get(m, {}).items():
                out[f"{n}.{k}"] = v
            if m is not p:
                out[f"{n}.master"] = m.data
        return out

    # the checkpoint's protocol (sp_train.checkpoint): what to save, what to load into, and
    # what to do once loaded
    def checkpoint_state(self) -> dict:
        return self.state_tensors()

    def checkpoint_targets(self) -> dict:
        self.init_state()
        return self.state_tensors()       # loaded in place

    def finish_load(self, loaded: dict) -> None:
        """After the checkpoint's tensors landed in :meth:`checkpoint_targets`: the 16-bit
        parameters from their fp32 masters."""
        with torch.no_grad():
            for m, p in zip(self.master, self.params):
                if m is not p:
                    p.copy_(m)


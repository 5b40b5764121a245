"""The distributed optimizer (ZeRO-1, Megatron's ``--use-distributed-optimizer``): AdamW whose
fp32 masters and moments are sharded over the DP × CP ranks.

The gradient reducer's buckets (:func:`sp_train.reduce.make_buckets`) are padded to ``world``
equal slices; rank r owns slice r of every bucket. The backward's gradient sum is a
reduce-scatter (:class:`~sp_train.reduce.GradientReducer` ``shard=True``: half the bytes of an
all-reduce), each rank steps AdamW on its slices only (1/world of the optimizer's time and
memory), and the updated 16-bit parameters are all-gathered bucket by bucket. The math is
:class:`~sp_train.optim.MasterAdamW`'s: the same clipping norm (each element counted once over
DP × CP, the TP rule of :func:`~sp_train.optim.squared_norm`), the same per-element update.

With ``overlap_param_gather`` (Megatron's ``--overlap-param-gather``) the step only launches
the all-gathers, bucket by bucket in the order the next forward needs them, and returns; a
forward pre-hook on each module that owns parameters (:meth:`ShardedAdamW.attach`) waits for
its buckets and copies them in, so the gathers travel beside the next forward's first layers
instead of before it. Anything that reads the parameters outside the model's forward calls
:meth:`ShardedAdamW.settle` first (the model's own forward ends with it, for a loss that reads
the output weight after the model; checkpoints and the next step call it).

Each rank's masters of a bucket are views of one flat fp32 slice (zeros past the bucket's
end), so a bucket's gather input is one cast of that slice.

Checkpoints keep MasterAdamW's per-parameter format (``<param>.exp_avg`` …, full tensors), so
a run resumes with or without the distributed optimizer, at any DP × CP: on save each
parameter's state is gathered to one rank (parameters dealt round-robin), which writes it; on
load each rank reads its dealt parameters and a reduce-scatter hands every rank its slices.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from sp_attention.comm import all_gather_single, reduce_scatter_single

from .cuda_graphs import GRAPHED
from .optim import clip_, init_adam_state, squared_norm
from .reduce import group_size, shard_size

__all__ = ["ShardedAdamW"]


class _Bucket:
    """One bucket's layout on this rank: its parameters, their offsets in the flat bucket,
    the slice this rank owns and the pieces of parameters inside it."""

    def __init__(self, params: list, world: int, rank: int):
        self.params = params
        self.offsets, n = [], 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        self.size = shard_size(n, world)
        dtypes = {p.dtype for p in params}     # the all-gather's: fp32 where dtypes mix
        self.dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        lo, hi = rank * self.size, min((rank + 1) * self.size, n)
        # (parameter index, start, end in the parameter's flat view, start in the slice)
        self.pieces = []
        for i, (p, off) in enumerate(zip(params, self.offsets)):
            a, b = max(lo, off), min(hi, off + p.numel())
            if a < b:
                self.pieces.append((i, a - off, b - off, a - lo))


class ShardedAdamW:
    """AdamW over fp32 masters of ``named_params``, each rank holding its slices of
    ``buckets`` (the reducer's, :attr:`GradientReducer.buckets`) over ``group`` (DP × CP).

    :meth:`step` takes the reducer's slices (``GradientReducer(shard=True).finish()``).
    ``tp_group``/``tp_rank``: as :class:`~sp_train.optim.MasterAdamW` (TP-split parameters
    count on every TP rank in the gradient norm). ``overlap_param_gather``: the step launches
    the parameters' all-gathers and the next forward waits for each bucket where it first
    needs it (call :meth:`attach` with the model once).
    """

    def __init__(self, named_params, buckets: list, group: Optional[dist.ProcessGroup], *,
                 lr: float, betas, weight_decay: float, tp_group: Optional[dist.ProcessGroup],
                 tp_rank: int, overlap_param_gather: bool = False):
        self.names = [n for n, p in named_params if p.requires_grad]
        self.params = [p for _, p in named_params if p.requires_grad]
        ids = {id(p) for b in buckets for p in b}
        if ids != {id(p) for p in self.params} or sum(len(b) for b in buckets) != len(ids):
            raise ValueError("ShardedAdamW: the buckets must hold every trainable parameter "
                             "once (pass the GradientReducer's buckets for the same params)")
        self.group, self.tp_group, self.tp_rank = group, tp_group, tp_rank
        self.world = group_size(group)
        self.rank = dist.get_rank(group) if self.world > 1 else 0
        self._name = {id(p): n for n, p in zip(self.names, self.params)}
        self.buckets = [_Bucket(b, self.world, self.rank) for b in buckets]
        self._first = [sum(len(b) for b in buckets[:j]) for j in range(len(buckets))]
        # this rank's fp32 masters: one flat slice per bucket (zeros past the bucket's end),
        # one leaf view of it per piece
        self.flat = []
        self.master = []
        for bk in self.buckets:
            dev = bk.params[0].device
            flat = torch.zeros(bk.size, dtype=torch.float32, device=dev)
            ms = []
            for i, s, e, o in bk.pieces:
                m = flat[o:o + e - s].detach()
                m.copy_(bk.params[i].detach().reshape(-1)[s:e])
                ms.append(m.requires_grad_(True))
            self.flat.append(flat)
            self.master.append(ms)
        decay, no_decay = [], []
        for bk, ms in zip(self.buckets, self.master):
            for (i, *_), m in zip(bk.pieces, ms):
                (decay if bk.params[i].dim() > 1 else no_decay).append(m)
        groups = [g for g in ({"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
        fused = all(m.is_cuda for m in decay + no_decay) or None
        self.opt = (torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=1e-8, fused=fused)
                    if groups else None)
        self.steps = 0
        self.overlap_param_gather = overlap_param_gather and self.world > 1
        self._bucket_of = {id(p): b for b, bk in enumerate(self.buckets) for p in bk.params}
        self._pending: dict = {}             # bucket -> (work, gathered flat buffer)
        self._hooks: list = []

    # -- the step ------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for ms in self.master:
            for m in ms:
                m.grad = None

    def _piece_grads(self, shards: list) -> list:
        return [[shard[o:o + (e - s)] for _, s, e, o in bk.pieces]
                for bk, shard in zip(self.buckets, shards)]

    def grad_norm(self, shards: list) -> torch.Tensor:
        """The global L2 norm: each rank's slices, summed over DP × CP and TP; a 0-dim fp64
        tensor on the device (no host sync)."""
        pieces = self._piece_grads(shards)
        params = [bk.params[i] for bk in self.buckets for i, *_ in bk.pieces]
        sq = squared_norm(params, [g for gs in pieces for g in gs], self.tp_rank)
        sq = sq.to(shards[0].device) if shards else sq
        if self.world > 1:
            dist.all_reduce(sq, group=self.group)
        if self.tp_group is not None and dist.get_world_size(self.tp_group) > 1:
            dist.all_reduce(sq, group=self.tp_group)
        return sq.sqrt()

    def step(self, lr: float, clip_grad: float, grads: Optional[list]) -> torch.Tensor:
        """Clip to ``clip_grad`` (0 = off), step at ``lr``, all-gather the parameters; returns
        the gradient norm. ``grads``: the reducer's slices, one per bucket."""
        if grads is None or len(grads) != len(self.buckets):
            raise ValueError(f"ShardedAdamW.step needs one gradient slice per bucket "
                             f"({len(self.buckets)}), as GradientReducer(shard=True) returns")
        norm = self.grad_norm(grads)
        pieces = [g for gs in self._piece_grads(grads) for g in gs]
        masters = [m for ms in self.master for m in ms]
        pieces = [g if g.dtype == torch.float32 else g.to(torch.float32) for g in pieces]
        for m, g in zip(masters, pieces):
            m.grad = g
        clip_(pieces, norm, clip_grad)
        if self.opt is not None:
            for group in self.opt.param_groups:
                group["lr"] = lr
            self.opt.step()
        self.steps += 1
        if self.overlap_param_gather:
            self._start_gather()
        else:
            self._gather_params()
        self.zero_grad()
        return norm

    def _own_slices(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s slice of this rank, from the masters, in the bucket's dtype."""
        return self.flat[b].to(self.buckets[b].dtype)

    def _copy_in(self, b: int, full: torch.Tensor) -> None:
        bk = self.buckets[b]
        torch._foreach_copy_(bk.params, [full[off:off + p.numel()].view_as(p)
                                         for p, off in zip(bk.params, bk.offsets)])

    @torch.no_grad()
    def _gather_params(self) -> None:
        """Every rank's updated slices into every rank's 16-bit (or fp32) parameters."""
        for b in range(len(self.buckets)):
            self._copy_in(b, self._all_gather(self._own_slices(b)))

    @torch.no_grad()
    def _start_gather(self) -> None:
        """Launch every bucket's all-gather in the order the forward reaches them (the buckets
        run in reverse parameter order); :meth:`_wait` finishes one."""
        self.settle()
        for b in reversed(range(len(self.buckets))):
            own = self._own_slices(b)
            full = own.new_empty(own.numel() * self.world)
            work = all_gather_single(full, own, group=self.group, async_op=True)
            self._pending[b] = (work, full)

    @torch.no_grad()
    def _wait(self, b: int) -> None:
        work, full = self._pending.pop(b)
        work.wait()                          # NCCL: the current stream waits, not the host
        self._copy_in(b, full)

    def _wait_for(self, buckets: tuple) -> None:
        for b in buckets:
            if b in self._pending:
                self._wait(b)

    def settle(self) -> None:
        """Finish the parameters' all-gathers still in flight (``overlap_param_gather``): call
        before reading the parameters outside the model's forward."""
        self._wait_for(sorted(self._pending, reverse=True))

    def attach(self, model: torch.nn.Module) -> None:
        """With ``overlap_param_gather``: a forward pre-hook on every module of ``model`` that
        owns parameters waits for their buckets, and the model's own forward ends with
        :meth:`settle` (a loss that reads the output weight after the model sees it updated).
        Without it, nothing."""
        self.detach()
        if not self.overlap_param_gather:
            return
        # a layer replayed from a CUDA graph (train.py --cuda-graphs) runs no hooks inside it:
        # it waits for all of its parameters before it
        graphed = [m for m in model.modules() if getattr(m, GRAPHED, False)]
        inside = {id(x) for m in graphed for x in m.modules() if x is not m}
        for module in model.modules():
            if id(module) in inside:
                continue
            whole = getattr(module, GRAPHED, False)
            mine = tuple(sorted({self._bucket_of[id(p)] for p in module.parameters(recurse=whole)
                                 if id(p) in self._bucket_of}))
            if mine:
                self._hooks.append(module.register_forward_pre_hook(
                    lambda _m, _args, mine=mine: self._wait_for(mine)))
        self._hooks.append(model.register_forward_hook(lambda *_: self.settle()))

    def detach(self) -> None:
        """Drop :meth:`attach`'s hooks (the gathers in flight finished first)."""
        self.settle()
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _all_gather(self, own: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return own
        full = own.new_empty(own.numel() * self.world)
        all_gather_single(full, own, group=self.group)
        return full

    # -- state and checkpoints -------------------------------------------------------------------
    def init_state(self) -> None:
        """Create Adam's state (zeros) so a run that cannot fit fails in its first step."""
        if self.opt is not None:
            init_adam_state(self.opt, [m for ms in self.master for m in ms], self.steps)

    def _kinds(self, p: torch.Tensor) -> tuple:
        return ("exp_avg", "exp_avg_sq") + (("master",) if p.dtype != torch.float32 else ())

    def _piece_state(self, m: torch.Tensor, kind: str) -> torch.Tensor:
        return m if kind == "master" else self.opt.state[m][kind]

    def _dealt(self, bucket_index: int, i: int) -> bool:
        """Whether this rank writes / reads parameter ``i`` of a bucket (round robin)."""
        return (self._first[bucket_index] + i) % self.world == self.rank

    @torch.no_grad()
    def checkpoint_state(self) -> dict:
        """The full per-parameter state of the parameters dealt to this rank (MasterAdamW's
        keys), gathered bucket by bucket (one bucket's fp32 copy in flight at a time); host
        copies, so the device holds no second optimizer."""
        self.settle()
        self.init_state()
        out = {}
        for b, (bk, ms) in enumerate(zip(self.buckets, self.master)):
            dealt = [i for i in range(len(bk.params)) if self._dealt(b, i)]
            for kind in ("exp_avg", "exp_avg_sq", "master"):
                if all(kind not in self._kinds(p) for p in bk.params):
                    continue
                own = torch.zeros(bk.size, dtype=torch.float32, device=bk.params[0].device)
                for (_, s, e, o), m in zip(bk.pieces, ms):
                    own[o:o + e - s].copy_(self._piece_state(m, kind))
                full = self._all_gather(own)
                for i in dealt:
                    p, off = bk.params[i], bk.offsets[i]
                    if kind in self._kinds(p):
                        out[f"{self._name[id(p)]}.{kind}"] = \
                            full[off:off + p.numel()].view(p.shape).cpu()
            for i in dealt:
                out[f"{self._name[id(bk.params[i])]}.step"] = torch.tensor(
                    float(self.steps), dtype=torch.float32)
        return out

    def checkpoint_targets(self) -> dict:
        """Host tensors for the state of the parameters dealt to this rank (called before the
        model is loaded: nothing in flight may overwrite it after)."""
        self.settle()
        self.init_state()
        out = {}
        for b, bk in enumerate(self.buckets):
            for i, p in enumerate(bk.params):
                if self._dealt(b, i):
                    name = self._name[id(p)]
                    for kind in self._kinds(p):
                        out[f"{name}.{kind}"] = torch.empty(p.shape, dtype=torch.float32)
                    out[f"{name}.step"] = torch.zeros((), dtype=torch.float32)
        return out

    def finish_load(self, loaded: dict) -> None:
        """Hand every rank its slices of the loaded state (one reduce-scatter per bucket and
        kind), then the parameters from the masters (16-bit) — fp32 parameters are their own
        masters, loaded with the model."""
        self.settle()
        steps = torch.tensor([max([float(v) for k, v in loaded.items() if k.endswith(".step")]
                                  or [0.0])], dtype=torch.float64)
        dev = self.params[0].device
        if self.world > 1:
            steps = steps.to(dev)
            dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=self.group)
        self.steps = int(steps.item())
        with torch.no_grad():
            for b, (bk, ms) in enumerate(zip(self.buckets, self.master)):
                for kind in ("exp_avg", "exp_avg_sq", "master"):
                    if all(kind not in self._kinds(p) for p in bk.params):
                        continue
                    full = torch.zeros(bk.size * self.world, dtype=torch.float32, device=dev)
                    for i, (p, off) in enumerate(zip(bk.params, bk.offsets)):
                        if self._dealt(b, i) and kind in self._kinds(p):
                            full[off:off + p.numel()].copy_(
                                loaded[f"{self._name[id(p)]}.{kind}"].reshape(-1))
                    own = self._scatter(full)
                    for (_, s, e, o), m in zip(bk.pieces, ms):
                        self._piece_state(m, kind).copy_(own[o:o + e - s])
                for (i, s, e, _), m in zip(bk.pieces, ms):
                    p = bk.params[i]
                    if "master" not in self._kinds(p):    # fp32: the loaded model weights
                        m.copy_(p.detach().reshape(-1)[s:e])
                    if self.opt is not None:
                        self.opt.state[m]["step"].fill_(float(self.steps))
            self._gather_params()

    def _scatter(self, full: torch.Tensor) -> torch.Tensor:
        """Each rank's slice of ``full``, summed over the ranks (only the dealt rank wrote
        each element, the others hold zeros)."""
        if self.world == 1:
            return full
        own = full.new_empty(full.numel() // self.world)
        reduce_scatter_single(own, full, group=self.group)
        return own

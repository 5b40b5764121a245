"""The gradient reduction of train.py's loop: each rank's gradient of its loss share
(:func:`sp_attention.tokens.global_token_mean`, re-exported here) summed over the DP × CP group
in fp32 buckets. Megatron's own optimizer/DDP do the same job on GPUs; FSDP users reduce their
way.

:class:`GradientReducer` overlaps the reduction with the backward, as DDP and Megatron's
``--overlap-grad-reduce`` do: armed before the backward whose gradients are final (the last
micro-batch's), it starts a bucket's all-reduce as soon as every gradient in it is accumulated
(``register_post_accumulate_grad_hook``), buckets in their fixed order on every rank (a bucket
that fills early waits for the ones before it, so the ranks' collectives match), and writes
the sums back while later buckets travel. :func:`all_reduce_gradients` is the same reduction
after the backward.
"""
from __future__ import annotations

from collections import deque
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from sp_attention.comm import reduce_scatter_single
from sp_attention.precision import acc_dtype
from sp_attention.tokens import global_token_count, global_token_mean, group_size

__all__ = ["global_token_mean", "global_token_count", "all_reduce_gradients",
           "GradientReducer", "BUCKET_ELEMENTS", "make_buckets", "shard_size"]

# elements per bucket (fp32: 100 MB): large enough for NCCL's bandwidth, small enough that
# the first buckets travel while most of the backward still runs (DDP's default is 25 MB)
BUCKET_ELEMENTS = 25_000_000
# buckets travelling at once: launching bucket i writes bucket i − IN_FLIGHT back, so the fp32
# copies alive during the backward stay a few buckets
IN_FLIGHT = 2


class GradientReducer:
    """Sum ``.grad`` of ``parameters`` over ``group`` in fp32 buckets (fp64 for fp64
    parameters), multiplied by ``scale``, written back in each gradient's dtype.

    Every rank of ``group`` must pass the same parameters in the same order (same shapes). A
    parameter without a gradient counts as zeros (on every rank that has none). Buckets hold
    parameters in reverse order (the backward makes the last layers' gradients first), up to
    ``bucket_elements`` each (a larger parameter is a bucket of its own), one device and dtype
    per bucket.

    Use: ``arm(scale)`` before the backward whose gradients are final, ``finish()`` after it
    (before anything reads ``.grad``). With ``overlap=False`` (or a group of one rank) nothing
    happens during the backward and ``finish`` does all the work.

    ``write_back=True`` writes the sums into ``.grad`` (rounded to its dtype).
    ``write_back=False`` keeps them in fp32 (fp64): ``.grad`` is dropped as soon as its bucket
    has left (its memory freed during the backward) and ``finish()`` returns the sums, one per
    parameter in the order given, for an optimizer with fp32 masters to step from
    (:meth:`sp_train.optim.MasterAdamW.step` ``grads=``): no rounding of the summed gradient to
    16 bits, and two passes over the gradients fewer. A gradient accumulated twice
    in one armed backward (a parameter reached by two separate backward passes, e.g. a tied
    weight across reentrant checkpoints) is an error: its bucket may already have travelled.

    ``shard=True`` (with ``write_back=False``; the distributed optimizer,
    :class:`sp_train.sharded_optim.ShardedAdamW`): each bucket is padded to ``world`` equal
    slices and reduce-scattered, so rank r receives only the sum of its slice
    (:func:`shard_size`), half the bytes of an all-reduce; ``finish()`` returns one slice per
    bucket, in bucket order.
    """

    def __init__(self, parameters: Iterable[torch.nn.Parameter],
                 group: Optional[dist.ProcessGroup], *, overlap: bool = True,
                 write_back: bool = True, bucket_elements: int = BUCKET_ELEMENTS,
                 shard: bool = False):
        params = [p for p in parameters if p.requires_grad]
        self.params = params
        self.write_back = write_back
        self.group = group
        self.reduce = group_size(group) > 1
        self.shard = shard and self.reduce
        if shard and write_back:
            raise ValueError("GradientReducer(shard=True) returns each rank's shard of the "
                             "sums: pass write_back=False (the sharded optimizer steps from "
                             "them)")
        self.buckets = make_buckets(params, bucket_elements)
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._hooks = ([p.register_post_accumulate_grad_hook(self._ready) for p in params]
                       if overlap and self.reduce else [])
        self._armed = False

    def arm(self, scale: float = 1.0) -> None:
        """The next backward's gradients are final: reduce each bucket as it fills."""
        self._scale = scale
        self._filled = [set() for _ in self.buckets]
        self._next = 0                       # the next bucket to launch, in order
        self._inflight: deque = deque()
        self._sums: dict = {}
        self._armed = True

    def finish(self) -> Optional[list]:
        """Launch what has not travelled (gradients the backward did not reach count as zeros),
        wait for every bucket and write the sums back; with ``write_back=False`` return them
        (None for a group of one rank: ``.grad`` holds the gradients, scaled)."""
        if not self._armed:
            raise RuntimeError("GradientReducer.finish() without arm(): call arm(scale) before "
                               "the backward whose gradients are final")
        self._armed = False
        if not self.reduce:
            if self._scale != 1.0:
                for p in self.params:
                    if p.grad is not None:
                        p.grad.mul_(self._scale)
            return None
        while self._next < len(self.buckets):
            self._launch()
        while self._inflight:
            self._write_back()
        if self.write_back:
            return None
        sums, self._sums = self._sums, {}
        if self.shard:
            return [sums[i] for i in range(len(self.buckets))]
        return [sums[id(p)] for p in self.params]

    def remove(self) -> None:
        """Drop the gradient hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _ready(self, p: torch.Tensor) -> None:
        if not self._armed:
            return
        i = self._bucket_of[id(p)]
        if id(p) in self._filled[i]:
            raise RuntimeError(
                f"a gradient of shape {tuple(p.shape)} was accumulated twice in one backward "
                "while its bucket was being reduced (a parameter reached by two separate "
                "backward passes): reduce after the backward instead (train.py: "
                "--no-overlap-grad-reduce)")
        self._filled[i].add(id(p))
        while (self._next < len(self.buckets)
               and len(self._filled[self._next]) == len(self.buckets[self._next])):
            self._launch()

    def _launch(self) -> None:
        i, ps = self._next, self.buckets[self._next]
        self._next += 1
        n = sum(p.numel() for p in ps)
        world = group_size(self.group)
        padded = shard_size(n, world) * world if self.shard else n
        flat = torch.empty(padded, dtype=acc_dtype(ps[0]), device=ps[0].device)
        # cast on the way, one pass: one multi-tensor kernel (a cast by torch.cat or copy_
        # runs element by element, at a third of the bandwidth)
        torch._foreach_copy_(flat[:n].split([p.numel() for p in ps]),
                             [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                              for p in ps])
        flat[n:].zero_()
        if not self.write_back:
            for p in ps:
                p.grad = None
        if self.shard:                       # each rank receives the sum of its slice
            out = flat.new_empty(padded // world)
            work = reduce_scatter_single(out, flat, group=self.group, async_op=True)
            flat = out
        else:
            work = dist.all_reduce(flat, group=self.group, async_op=True)
        self._inflight.append((i, ps, flat, work))
        while len(self._inflight) > IN_FLIGHT:
            self._write_back()

    def _write_back(self) -> None:
        i, ps, flat, work = self._inflight.popleft()
        work.wait()                          # NCCL: the current stream waits, not the host
        if self._scale != 1.0:
            flat.mul_(self._scale)
        if self.shard:
            self._sums[i] = flat
            return
        offset = 0
        for p in ps:
            n = p.numel()
            g = flat[offset:offset + n].view_as(p)
            offset += n
            if not self.write_back:
                self._sums[id(p)] = g
            elif p.grad is None:
                p.grad = g.to(p.dtype, copy=True)
            else:
                p.grad.copy_(g)


def make_buckets(params: list, bucket_elements: int = BUCKET_ELEMENTS) -> list[list]:
    """``params`` in buckets: reverse order (the backward makes the last layers' gradients
    first), up to ``bucket_elements`` each (a larger parameter is a bucket of its own), one
    device and accumulation dtype per bucket. The reducer and the sharded optimizer share it."""
    buckets: list[list] = []
    open_: dict = {}
    for p in reversed(params):
        key = (p.device, acc_dtype(p))
        b = open_.get(key)
        if b is None or sum(q.numel() for q in b) + p.numel() > bucket_elements:
            b = open_[key] = []
            buckets.append(b)
        b.append(p)
    return buckets


def shard_size(n: int, world: int) -> int:
    """Elements of each rank's slice of an ``n``-element bucket (the bucket padded to
    ``world`` equal slices; rank r holds ``[r·size, (r+1)·size)``)."""
    return -(-n // world)


def all_reduce_gradients(parameters: Iterable[torch.nn.Parameter],
                         group: Optional[dist.ProcessGroup], *, scale: float = 1.0) -> None:
    """Sum ``.grad`` of ``parameters`` over ``group`` in place after the backward, then
    multiply by ``scale`` (the rules: :class:`GradientReducer`)."""
    reducer = GradientReducer(parameters, group, overlap=False)
    reducer.arm(scale)
    reducer.finish()

"""Explicit-group communication: fixed-shape collectives (all-gather, reduce-scatter,
all-to-all), autograd-aware gather/scatter, a ring p2p helper and an async fp32 reduce-scatter
manager.

Every function takes an :class:`~sp_attention.context.SPContext`; nothing defaults to WORLD.
Collectives move flat, fixed-shape buffers with dim-0 concatenation (the only form gloo
supports), so the same code runs on gloo/CPU and NCCL/GPU. Point-to-point peers are group ranks
mapped to global ranks through ``ctx.global_ranks``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .caches import LRU
from .context import SPContext
from .planning.layout import ring_neighbors

__all__ = [
    "all_gather_flat", "reduce_scatter_flat", "all_gather_along", "reduce_scatter_along",
    "gather_along", "scatter_reduce_along", "pad_flat", "p2p_exchange", "RingComm",
    "AsyncReduceScatter", "check_collective_input", "all_to_all_flat",
]

# torch 2.13 renamed the fixed-shape collectives to `*_single` and deprecated the `*_tensor`
# names; torch 2.11 (the GPU image) only has the old names. One shim, chosen once (not in
# __all__: the trainer's gradient and parameter collectives use it too).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                         or dist.reduce_scatter_tensor)


def _flat_collective(name: str, fn, out: torch.Tensor, inp: torch.Tensor, ctx: SPContext,
                     async_op: bool, per_rank: torch.Tensor, whole: torch.Tensor):
    """The rule both flat collectives share: ``whole`` holds ``P`` blocks of ``per_rank``'s
    size; a group of one copies; others pass 1-D views (gloo only accepts dim-0
    concatenation)."""
    if whole.numel() != ctx.world_size * per_rank.numel():
        raise ValueError(f"{name}: {'output' if whole is out else 'input'} has {whole.numel()} "
                         f"elements, expected {ctx.world_size} × {per_rank.numel()}")
    if ctx.world_size == 1:
        out.view(-1).copy_(inp.reshape(-1))
        return None
    return fn(out.view(-1), inp.contiguous().view(-1), group=ctx.group, async_op=async_op)


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, ctx: SPContext,
                    async_op: bool = False):
    """All-gather ``inp`` of every rank into ``out`` (``out.numel() == P · inp.numel()``,
    rank-major). Returns the work handle when ``async_op``."""
    return _flat_collective("all_gather_flat", all_gather_single, out, inp, ctx, async_op, inp,
                            out)


def reduce_scatter_flat(out: torch.Tensor, inp: torch.Tensor, ctx: SPContext,
                        async_op: bool = False):
    """Sum ``inp`` (rank-major, ``P · out.numel()`` elements) over ranks; rank r receives block r."""
    return _flat_collective("reduce_scatter_flat", reduce_scatter_single, out, inp, ctx,
                            async_op, out, inp)


def all_to_all_flat(out: torch.Tensor, inp: torch.Tensor, ctx: SPContext,
                    async_op: bool = False):
    """All-to-all of equal blocks: ``inp`` holds ``P`` blocks (destination-major, block ``j``
    for group rank ``j``), ``out`` receives ``P`` blocks of the same size (source-major, block
    ``j`` from group rank ``j``); ``out.numel() == inp.numel()``, any shapes, one dtype.
    ``dist.all_to_all_single`` on 1-D views (gloo runs it on CPU tensors, NCCL on GPU
    tensors); a group of one copies. Returns the work handle when ``async_op``. Not
    differentiable: the schedules that use it run inside their own autograd Function."""
    if out.numel() != inp.numel() or inp.numel() % ctx.world_size:
        raise ValueError(f"all_to_all_flat: input {inp.numel()} and output {out.numel()} "
                         f"elements must be equal and a multiple of the group size "
                         f"{ctx.world_size}")
    if out.dtype != inp.dtype:
        raise ValueError(f"all_to_all_flat: input {inp.dtype} and output {out.dtype} differ")
    if ctx.world_size == 1:
        out.view(-1).copy_(inp.reshape(-1))
        return None
    return dist.all_to_all_single(out.view(-1), inp.contiguous().view(-1), group=ctx.group,
                                  async_op=async_op)


def pad_flat(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Flatten and zero-pad to a multiple of ``multiple`` elements."""
    flat = x.reshape(-1)
    pad = (-flat.numel()) % multiple
    return torch.nn.functional.pad(flat, (0, pad)) if pad else flat


def check_collective_input(x: torch.Tensor, ctx: SPContext, name: str = "tensor") -> None:
    """Cheap local checks before a fixed-shape collective (the shapes of other ranks cannot be
    seen without communicating; this catches what one rank can know)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ctx.world_size > 1 and ctx.group is None:
        raise ValueError(f"{name}: the context has world size {ctx.world_size} but no group")


def all_gather_along(x: torch.Tensor, ctx: SPContext, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's ``x`` (same shape everywhere) along ``dim``, in rank order."""
    check_collective_input(x, ctx, "all_gather_along input")
    if ctx.world_size == 1:
        return x
    dim = dim % x.dim()
    buf = torch.empty((ctx.world_size,) + tuple(x.shape), dtype=x.dtype, device=x.device)
    all_gather_flat(buf, x, ctx)
    # [P, ..., n, ...] -> [..., P·n, ...]
    return buf.movedim(0, dim).flatten(dim, dim + 1)


def reduce_scatter_along(x: torch.Tensor, ctx: SPContext, dim: int = 0,
                         reduce_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's ``1/P`` slice along ``dim``.

    ``reduce_dtype`` (e.g. ``torch.float32``) upcasts before reducing (never downcasts); the
    result is returned in that dtype so callers decide when to cast back.
    """
    check_collective_input(x, ctx, "reduce_scatter_along input")
    dim = dim % x.dim()
    if x.shape[dim] % ctx.world_size:
        raise ValueError(f"reduce_scatter_along: dim {dim} has size {x.shape[dim]}, not a "
                         f"multiple of the group size {ctx.world_size}")
    # Never reduce in less precision than the input (fp64 stays fp64).
    dtype = torch.promote_types(reduce_dtype, x.dtype) if reduce_dtype else x.dtype
    if ctx.world_size == 1:
        return x.to(dtype)
    n = x.shape[dim] // ctx.world_size
    # world-major copy: [P, ..., n, ...]
    src = x.unflatten(dim, (ctx.world_size, n)).movedim(dim, 0).to(dtype).contiguous()
    out = torch.empty(src.shape[1:], dtype=dtype, device=x.device)
    reduce_scatter_flat(out, src, ctx)
    return out


class _GatherAlong(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, ctx, dim, grad_dtype):
        fctx.sp, fctx.dim, fctx.grad_dtype = ctx, dim, grad_dtype
        return all_gather_along(x, ctx, dim)

    @staticmethod
    def backward(fctx, g):
        dtype = fctx.grad_dtype or g.dtype
        return reduce_scatter_along(g, fctx.sp, fctx.dim, dtype).to(g.dtype), None, None, None


class _ScatterReduceAlong(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, ctx, dim, reduce_dtype):
        fctx.sp, fctx.dim = ctx, dim
        return reduce_scatter_along(x, ctx, dim, reduce_dtype).to(x.dtype)

    @staticmethod
    def backward(fctx, g):
        return all_gather_along(g.contiguous(), fctx.sp, fctx.dim), None, None, None


def gather_along(x: torch.Tensor, ctx: SPContext, dim: int = 0,
                 grad_dtype: Optional[torch.dtype] = torch.float32) -> torch.Tensor:
    """Differentiable all-gather along ``dim``; backward reduce-scatters the gradient (in
    ``grad_dtype``, fp32 by default, then casts back)."""
    return _GatherAlong.apply(x, ctx, dim % x.dim(), grad_dtype)


def scatter_reduce_along(x: torch.Tensor, ctx: SPContext, dim: int = 0,
                         reduce_dtype: Optional[torch.dtype] = torch.float32) -> torch.Tensor:
    """Differentiable reduce-scatter along ``dim`` (sum in ``reduce_dtype``); backward
    all-gathers the gradient."""
    return _ScatterReduceAlong.apply(x, ctx, dim % x.dim(), reduce_dtype)


def p2p_exchange(sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]],
                 ctx: SPContext) -> list:
    """Post sends ``(tensor, dst_group_rank)`` and receives ``(tensor, src_group_rank)`` as one
    batch; returns the work handles (wait on them before reading receives).

    Messages between one pair of ranks are matched in posting order, so callers must post them
    in an order every rank agrees on (e.g. sorted by a global message id).

    On a backend that coalesces point-to-point operations (NCCL) the batch is one group of the
    process group's own ``send``/``recv`` (one kernel launch, one work handle): what
    ``dist.batch_isend_irecv`` does, without its per-call Python bookkeeping, which costs a
    GPU step's host tens of µs per message. Elsewhere (gloo) each message is posted on its
    own. Peers are group ranks.
    """
    for _, r in list(sends) + list(recvs):
        if r == ctx.rank or not 0 <= r < ctx.world_size:
            raise ValueError(f"p2p_exchange: peer {r} is not another rank of a group of size "
                             f"{ctx.world_size} (this rank is {ctx.rank})")
    if not sends and not recvs:
        return []
    pg = ctx.group
    device = (sends[0] if sends else recvs[0])[0].device
    mode = _p2p_mode(pg, device)
    if mode != "batch":     # the process group's own ranks (a context may span part of it)
        peer = _pg_ranks(ctx)
    if mode == "coalesced":
        pg._start_coalescing(device)
        for t, r in sends:
            pg.send([t], peer[r], 0)
        for t, r in recvs:
            pg.recv([t], peer[r], 0)
        return [pg._end_coalescing(device)]
    if mode == "direct":
        return [pg.send([t], peer[r], 0) for t, r in sends] + \
            [pg.recv([t], peer[r], 0) for t, r in recvs]
    ops = [dist.P2POp(dist.isend, t, ctx.global_rank(r), pg) for t, r in sends]
    ops += [dist.P2POp(dist.irecv, t, ctx.global_rank(r), pg) for t, r in recvs]
    return dist.batch_isend_irecv(ops)


# (group, device type) -> how p2p_exchange posts on that group: decided once per group
_P2P_MODES = LRU(64)
# context -> the rank in its process group of each of its ranks (the identity unless the
# context spans part of its group, e.g. the ring across a2a_ring's groups)
_PG_RANKS = LRU(64)


def _pg_ranks(ctx: SPContext) -> tuple:
    return _PG_RANKS.get(ctx, lambda: tuple(dist.get_group_rank(ctx.group, g)
                                            for g in ctx.global_ranks))


def _p2p_mode(pg, device: torch.device) -> str:
    """``"coalesced"`` (the group's own send/recv between ``_start_coalescing`` and
    ``_end_coalescing``, as ``batch_isend_irecv`` does on NCCL), ``"direct"`` (its own send/recv
    one by one, as ``batch_isend_irecv`` does on gloo) or ``"batch"`` (``batch_isend_irecv``
    itself, for a process-group object without those methods)."""
    return _P2P_MODES.get((pg, device.type), lambda: _probe_p2p_mode(pg, device))


def _probe_p2p_mode(pg, device: torch.device) -> str:
    if type(pg) is not dist.ProcessGroup or not (hasattr(pg, "send") and hasattr(pg, "recv")):
        return "batch"
    try:
        coalesces = bool(pg._get_backend(device).supports_coalescing)
    except (AttributeError, RuntimeError):
        return "batch"
    if not coalesces:
        return "direct"
    return "coalesced" if hasattr(pg, "_start_coalescing") and hasattr(pg, "_end_coalescing") \
        else "batch"


class RingComm:
    """One ring hop at a time: send to the next rank, receive from the previous one.

    Usage per step: ``nxt = ring.send_recv(buf)`` (any number of tensors), ``ring.commit()``
    (launch), compute on the current block, ``ring.wait()``, then use ``nxt``. Misuse (commit
    with nothing posted, posting after commit, waiting before commit) raises ``RuntimeError``
    instead of deadlocking.
    """

    def __init__(self, ctx: SPContext, reverse: bool = False):
        if ctx.world_size < 2:
            raise ValueError("RingComm needs a group of at least 2 ranks")
        self.ctx = ctx
        self.prev, self.next = ring_neighbors(ctx.rank, ctx.world_size)
        if reverse:           # the ring the other way: send to the previous rank
            self.prev, self.next = self.next, self.prev
        self._sends: list[torch.Tensor] = []
        self._recvs: list[torch.Tensor] = []
        self._works: Optional[list] = None

    def send_recv(self, t: torch.Tensor, recv_buf: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Queue ``t`` for the next rank and a receive of the same shape from the previous one."""
        if self._works is not None:
            raise RuntimeError("RingComm.send_recv after commit(): call wait() first")
        t = t.contiguous()
        buf = torch.empty_like(t) if recv_buf is None else recv_buf
        self._sends.append(t)
        self._recvs.append(buf)
        return buf

    def commit(self) -> None:
        if self._works is not None:
            raise RuntimeError("RingComm.commit() called twice without wait()")
        if not self._sends:
            raise RuntimeError("RingComm.commit() with nothing posted")
        self._works = p2p_exchange([(t, self.next) for t in self._sends],
                                   [(t, self.prev) for t in self._recvs], self.ctx)

    def wait(self) -> None:
        if self._works is None:
            raise RuntimeError("RingComm.wait() before commit()")
        for w in self._works:
            w.wait()
        self._works = None
        self._sends, self._recvs = [], []

    @property
    def pending(self) -> bool:
        return self._works is not None


class AsyncReduceScatter:
    """Asynchronous fp32 reduce-scatters in a few reusable slots.

    ``buffer(slot, shape)`` hands out a world-major fp32 buffer ``[P, *shape]`` (allocated once
    per slot and shape: "two slots per width"). ``launch(slot, dest)`` starts the
    reduce-scatter of that buffer; ``dest`` (shape ``shape``, any dtype) receives this rank's
    sum, *added*, when the slot is drained. A slot holds at most one pending operation: asking
    for its buffer again first drains it, so a buffer is never overwritten while the network
    reads it. Pack several tensors (dK and dV) into one buffer to coalesce them into one
    collective.
    """

    def __init__(self, ctx: SPContext, num_slots: int = 2, dtype: torch.dtype = torch.float32):
        if num_slots < 1:
            raise ValueError("AsyncReduceScatter needs at least one slot")
        self.ctx, self.num_slots, self.dtype = ctx, num_slots, dtype
        self._bufs: dict[tuple, torch.Tensor] = {}
        self._outs: dict[tuple, torch.Tensor] = {}
        self._pending: dict[int, tuple] = {}

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is outside 0..{self.num_slots - 1}")

    def buffer(self, slot: int, shape: Sequence[int], device) -> torch.Tensor:
        """World-major fp32 buffer ``[P, *shape]`` of ``slot`` (drains the slot first)."""
        self._check_slot(slot)
        self.drain(slot)
        key = (slot, tuple(shape), str(device))
        buf = self._bufs.get(key)
        if buf is None:
            buf = torch.empty((self.ctx.world_size,) + tuple(shape), dtype=self.dtype, device=device)
            self._bufs[key] = buf
            self._outs[key] = torch.empty(tuple(shape), dtype=self.dtype, device=device)
        return buf

    def launch(self, slot: int, shape: Sequence[int], device, dest: torch.Tensor) -> None:
        """Start reducing the slot's buffer; the result is added into ``dest`` on drain."""
        self._check_slot(slot)
        key = (slot, tuple(shape), str(device))
        if key not in self._bufs:
            raise RuntimeError(f"launch on slot {slot} before buffer() handed out its buffer")
        if slot in self._pending:
            raise RuntimeError(f"slot {slot} already has a pending reduce-scatter")
        if tuple(dest.shape) != tuple(shape):
            raise ValueError(f"destination shape {tuple(dest.shape)} != slot shape {tuple(shape)}")
        out = self._outs[key]
        work = reduce_scatter_flat(out, self._bufs[key], self.ctx, async_op=True)
        self._pending[slot] = (work, out, dest)

    def drain(self, slot: int) -> None:
        """Wait for the slot's reduce-scatter (if any) and add it into its destination."""
        item = self._pending.pop(slot, None)
        if item is None:
            return
        work, out, dest = item
        if work is not None:
            work.wait()
        dest.add_(out.to(dest.dtype) if dest.dtype != out.dtype else out)

    def drain_all(self) -> None:
        for slot in sorted(self._pending):
            self.drain(slot)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

"""Tensor side of the all-gather schedules: double-buffered K/V gathers of a few heads, the
arrangement of gathered pieces into kernel-ready keys, and the scatter of dK/dV back into the
world-major reduce-scatter layout. The rules (which piece goes where) live in :mod:`.plan`.

Buffer layout, per rank and unit (KV heads ``[h0, h1)`` = ``s`` heads, key pieces
``[p0, p1)`` = ``n`` pieces of ``Ls`` tokens)::

    send   [B, n·Ls, 2, s, D]          K and V interleaved per token: one message per gather
    recv   [P, B, n·Ls, 2, s, D]       rank-major (what all_gather_into_tensor writes)
    keys   [B, L·Ls, 2, s, D]          arranged key pieces (a view of recv when possible)
    slot   [P, B, n·Ls, 2, s, D] fp32  dK/dV world-major: block r = the keys rank r owns

K = keys[:, :, 0], V = keys[:, :, 1]: [B, T, s, D] views with unit stride in D, the layout of
a packed-QKV projection, which every kernel backend takes without copying.
"""
from __future__ import annotations

from dataclasses import dataclass
import torch

from ..comm import all_gather_flat
from ..context import SPContext
from ..planning.softmax_plan import GatherPlan, Run

__all__ = ["Unit", "KVGather", "arrange_keys", "scatter_key_grads", "max_unit_numel"]


@dataclass(frozen=True)
class Unit:
    """One step of an all-gather pipeline: KV heads ``[h0, h1)``, key pieces ``[p0, p1)``."""

    h0: int
    h1: int
    p0: int
    p1: int

    @property
    def heads(self) -> int:
        return self.h1 - self.h0

    @property
    def pieces(self) -> int:
        return self.p1 - self.p0


def _carve(flat: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A contiguous ``shape`` view at the start of a preallocated flat buffer."""
    n = 1
    for s in shape:
        n *= s
    return flat[:n].view(shape)


class KVGather:
    """Two send and two receive buffers, allocated once per call for the widest unit and
    reused: unit ``i`` uses slot ``i % 2``, so unit ``i + 1`` can be gathered while unit ``i``
    computes. A slot is refilled only after its previous gather was waited on (the caller
    waits unit ``i`` before starting unit ``i + 1``)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, ctx: SPContext, piece_len: int,
                 max_numel: int):
        self.k, self.v, self.ctx, self.ls = k, v, ctx, piece_len
        self._send = [torch.empty(max_numel, dtype=k.dtype, device=k.device) for _ in range(2)]
        self._recv = [torch.empty(ctx.world_size * max_numel, dtype=k.dtype, device=k.device)
                      for _ in range(2)]
        self._pending: dict[int, tuple] = {}

    def shape(self, u: Unit) -> tuple[int, ...]:
        b, _, _, d = self.k.shape
        return (b, u.pieces * self.ls, 2, u.heads, d)

    def start(self, i: int, u: Unit) -> None:
        """Pack unit ``u``'s K/V and launch its all-gather into slot ``i % 2``."""
        slot = i % 2
        if slot in self._pending:
            raise RuntimeError(f"KVGather slot {slot} still holds an unwaited gather")
        shape = self.shape(u)
        send = _carve(self._send[slot], shape)                        # [B, n·Ls, 2, s, D]
        rows = slice(u.p0 * self.ls, u.p1 * self.ls)
        send[:, :, 0].copy_(self.k[:, rows, u.h0:u.h1])
        send[:, :, 1].copy_(self.v[:, rows, u.h0:u.h1])
        recv = _carve(self._recv[slot], (self.ctx.world_size,) + shape)
        self._pending[slot] = (all_gather_flat(recv, send, self.ctx, async_op=True), recv)

    def wait(self, i: int) -> torch.Tensor:
        """Wait for slot ``i % 2``'s gather; returns ``[P, B, n·Ls, 2, s, D]``."""
        work, recv = self._pending.pop(i % 2)
        if work is not None:
            work.wait()     # on NCCL: the current stream waits, the host does not
        return recv


def _run_view(buf: torch.Tensor, run: Run, ls: int) -> torch.Tensor:
    """Run ``run`` of a rank-major ``[P, B, n·Ls, ...]`` buffer as ``[B, count, Ls, ...]``."""
    if run.along_ranks:
        block = buf[run.rank:run.rank + run.count, :, run.pos * ls:(run.pos + 1) * ls]
        return block.movedim(0, 1)
    block = buf[run.rank, :, run.pos * ls:(run.pos + run.count) * ls]
    return block.unflatten(1, (run.count, ls))


def arrange_keys(recv: torch.Tensor, plan: GatherPlan, ls: int,
                 scratch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[B, L·Ls, s, D]`` in ``plan.order`` from the gather buffer.

    A view when the arrangement is the gather buffer itself (batch 1, or one rank's pieces);
    else one strided copy per run into ``scratch`` (flat, reused across units).
    """
    p, b, n_tok, _, s, d = recv.shape
    n_keys = len(plan.order) * ls
    if plan.flat_start is not None and (b == 1 or plan.single_rank):
        if plan.single_rank:
            r, pos = plan.order[0]
            keys = recv[r, :, pos * ls:pos * ls + n_keys]
        else:   # batch 1: consecutive rank-major pieces are consecutive tokens
            keys = recv.view(1, p * n_tok, 2, s, d)[:, plan.flat_start * ls:][:, :n_keys]
    else:
        keys = _carve(scratch, (b, n_keys, 2, s, d))
        for run in plan.runs:
            dst = keys[:, run.start * ls:(run.start + run.count) * ls]
            dst.unflatten(1, (run.count, ls)).copy_(_run_view(recv, run, ls))
    return keys[:, :, 0], keys[:, :, 1]


def scatter_key_grads(slot: torch.Tensor, plan: GatherPlan, ls: int, n_pieces: int,
                      dk: torch.Tensor, dv: torch.Tensor) -> None:
    """Add ``dk``/``dv`` ``[B, n_pieces·Ls, s, D]`` (the first ``n_pieces`` arranged key
    pieces) into the world-major ``slot`` ``[P, B, n·Ls, 2, s, D]`` at the pieces they belong
    to, upcast on the fly (no fp32 temporaries)."""
    for run in plan.runs:
        part = run.clip(n_pieces)
        if part is None:
            break
        dst = _run_view(slot, part, ls)                                # [B, c, Ls, 2, s, D]
        rows = slice(part.start * ls, (part.start + part.count) * ls)
        dst[:, :, :, 0].add_(dk[:, rows].unflatten(1, (part.count, ls)))
        dst[:, :, :, 1].add_(dv[:, rows].unflatten(1, (part.count, ls)))


def max_unit_numel(units: list[Unit], batch: int, piece_len: int, head_dim: int) -> int:
    """Elements of the largest unit's send buffer ``[B, n·Ls, 2, s, D]``."""
    return max(batch * u.pieces * piece_len * 2 * u.heads * head_dim for u in units)

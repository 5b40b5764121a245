"""The K/V blocks both ring schedules (:mod:`.fwd_ring`, :mod:`.bwd_ring`) pass around."""
from __future__ import annotations

import torch

from ..comm import RingComm
from ..context import SPContext

__all__ = ["KVRing"]


class KVRing:
    """Where the K/V block of each ring step lives, and its hop to the next rank.

    Unpacked (the default): step 0's block is this rank's ``k`` and ``v`` themselves, sent as
    two messages with no copy; the blocks that arrive alternate over one receive pair
    (``P = 2``) or two. Packed (``SoftmaxTuning.pack_kv``, the A/B): one ``[2, B, T, Hkv, D]``
    buffer per hop, one message, at the cost of copying K and V into it first (two ~9 µs
    copies per pass at T_local 8K, Hkv 8, D 128 on an H200). Usage per step ``s``: ``post(s)``
    (if a next block exists), compute on ``block(s)``, then ``wait()``.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, ctx: SPContext, pack: bool = False,
                 reverse: bool = False):
        # reverse: blocks come from the next rank and go to the previous one, starting from a
        # received block (the own-block-last backward): P − 2 hops instead of P − 1
        hops = ctx.world_size - (2 if reverse else 1)
        self.comm = RingComm(ctx, reverse=reverse) if hops else None
        self.pack = pack and hops > 0
        if self.pack:
            bufs = [torch.empty((2,) + tuple(k.shape), dtype=k.dtype, device=k.device)
                    for _ in range(2)]
            bufs[0][0].copy_(k)
            bufs[0][1].copy_(v)
            self._slots = [(b,) for b in bufs]
        else:
            own = (k.contiguous(), v.contiguous())
            n_recv = min(2, hops)
            self._slots = [own] + [(torch.empty_like(own[0]), torch.empty_like(own[1]))
                                   for _ in range(n_recv)]

    def _slot(self, step: int) -> tuple[torch.Tensor, ...]:
        if self.pack:
            return self._slots[step % 2]
        return self._slots[0 if step == 0 else 1 + (step - 1) % (len(self._slots) - 1)]

    def block(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` of the block held at ``step`` (after the previous step's ``wait``)."""
        s = self._slot(step)
        return (s[0][0], s[0][1]) if self.pack else (s[0], s[1])

    def post(self, step: int) -> None:
        """Send the block of ``step`` to the next rank and receive the next step's block from
        the previous one (reverse: to the previous, from the next; launched at once, overlaps
        the calls on ``block(step)``)."""
        for t, buf in zip(self._slot(step), self._slot(step + 1)):
            self.comm.send_recv(t, buf)
        self.comm.commit()

    def wait(self) -> None:
        self.comm.wait()

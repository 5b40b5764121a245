"""All-to-all by copy engines: every rank pulls its blocks from its peers' symmetric memory.

Why: NCCL's all-to-all runs as kernels on the SMs. Overlapped with the attention kernels (the
all-to-all presets' head chunks, :mod:`sp_attention.softmax.a2a`), it took SMs from cuDNN and
lost more than it hid (4 × H200, P = 4, 8K per GPU: one chunk 0.893 of one GPU, two chunks
0.849, with a high-priority stream 0.863, `sp_attention/softmax/README.md`). A copy between
two GPUs' memories over NVLink (``cudaMemcpyAsync`` on peer addresses) runs on the copy
engines and takes no SM.

Protocol of one exchange of ``send [U, ...]`` (destination-major blocks) in a group of ``U``
ranks, on one of ``REGIONS`` regions of a symmetric workspace (each rank's region ``r`` at the
same offset of its own memory):

1. the caller's stream waits until region ``r`` is free (its previous exchange has passed
   step 4 on every rank), then copies ``send`` into it;
2. on the copy stream: a barrier — every rank has written its region;
3. the copy stream pulls block ``me`` of each peer's region into ``recv[peer]`` (a contiguous
   copy from a peer address: a copy engine) and copies its own block locally;
4. a barrier — every rank has pulled from every region — after which region ``r`` is free.

The caller waits for the exchange (:meth:`Pending.wait`) before it reads ``recv``. Every rank
makes the same exchanges in the same order (the schedules' rule for every collective), so the
barriers pair up. Barriers of region ``r`` use channels ``2r`` and ``2r + 1``.

Memory: :class:`CudaPeerMemory` (``torch.distributed._symmetric_memory``: a workspace of
``REGIONS`` × the largest exchange, grown collectively when an exchange needs more; no
multicast is used). :class:`EmulatedPeerMemory` runs the same protocol on CPU over gloo (a
barrier snapshots every rank's workspace by an all-gather; a pull reads the snapshot) so the
schedules' use of it is tested on CPU; it is for tests only.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from .caches import LRU
from .context import SPContext

__all__ = ["PeerExchange", "peer_exchange", "check_device", "CudaPeerMemory",
           "EmulatedPeerMemory", "REGIONS"]

REGIONS = 4             # exchanges in flight per group: a head chunk's K/V, Q and output, ...
# the memory of CPU tensors: None (the copy-engine exchange needs CUDA devices); the tests set
# EmulatedPeerMemory in their worker processes
CPU_MEMORY = None


def check_device(device: torch.device) -> None:
    """Raise ``ValueError`` unless the copy-engine exchange can run on ``device``."""
    if device.type != "cuda" and CPU_MEMORY is None:
        raise ValueError("SoftmaxTuning(a2a_transport='copy_engine') needs CUDA devices with "
                         f"peer access (NVLink), got {device.type} tensors; pass "
                         "a2a_transport='nccl'")


def _element_offset(offset: int, dtype: torch.dtype) -> int:
    """Byte ``offset`` in elements of ``dtype`` (it must fall on one)."""
    if offset % dtype.itemsize:
        raise ValueError(f"offset {offset} is not a multiple of {dtype}'s size")
    return offset // dtype.itemsize


def _bytes_view(buf: torch.Tensor, offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
    """``shape``/``dtype`` at byte ``offset`` of the byte tensor ``buf``."""
    _element_offset(offset, dtype)
    return buf[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)


class CudaPeerMemory:
    """A symmetric workspace of ``nbytes`` on every rank of ``ctx``'s group (one CUDA device
    each): views of this rank's bytes and of a peer's, and the group barrier."""

    def __init__(self, ctx: SPContext, nbytes: int, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the copy-engine exchange cannot allocate its workspace inside a "
                               "CUDA graph capture: pass SoftmaxTuning(a2a_transport='nccl') or "
                               "run one call before capturing")
        self.nbytes = nbytes
        name = ctx.group.group_name
        if not symm_mem.is_symm_mem_enabled_for_group(name):
            with warnings.catch_warnings():     # deprecated (not needed) from torch 2.12 on
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(name)
        self.local_bytes = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.local_bytes, ctx.group)

    def view(self, rank: Optional[int], offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
        """``shape``/``dtype`` at byte ``offset`` of this rank's workspace (``rank`` None) or
        of group rank ``rank``'s (a tensor on this device whose storage is the peer's)."""
        if rank is None:
            return _bytes_view(self.local_bytes, offset, shape, dtype)
        return self.handle.get_buffer(rank, tuple(shape), dtype, _element_offset(offset, dtype))

    def barrier(self, channel: int) -> None:
        self.handle.barrier(channel=channel)


class EmulatedPeerMemory:
    """:class:`CudaPeerMemory`'s interface on CPU over gloo, for tests: a barrier all-gathers
    every rank's workspace into a snapshot, and a peer's view reads that snapshot — what a
    pull after the protocol's first barrier sees on GPUs."""

    def __init__(self, ctx: SPContext, nbytes: int, device: torch.device):
        self.ctx, self.nbytes = ctx, nbytes
        self.local_bytes = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.snapshot = torch.zeros(ctx.world_size, nbytes, dtype=torch.uint8, device=device)

    def view(self, rank: Optional[int], offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
        return _bytes_view(self.local_bytes if rank is None else self.snapshot[rank], offset,
                           shape, dtype)

    def barrier(self, channel: int) -> None:
        dist.all_gather_into_tensor(self.snapshot.view(-1), self.local_bytes, group=self.ctx.group)


class Pending:
    """An exchange in flight: :meth:`wait` makes the caller's stream wait for its pulls."""

    def __init__(self, event):
        self.event = event

    def wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


class PeerExchange:
    """Copy-engine all-to-alls inside groups of ``U`` consecutive ranks of ``ctx``'s group
    (U = P: the whole group), on a workspace of :data:`REGIONS` regions (module doc)."""

    def __init__(self, ctx: SPContext, device: torch.device):
        self.ctx, self.device = ctx, device
        check_device(device)
        self.memory_type = CudaPeerMemory if device.type == "cuda" else CPU_MEMORY
        self.memory = None
        self.region_bytes = 0
        self.next_region = 0
        self.free: list = [None] * REGIONS
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _room(self, nbytes: int) -> None:
        """Grow the workspace to regions of at least ``nbytes`` (collective: every rank asks
        at the same exchange, the shapes being the same on every rank)."""
        if nbytes <= self.region_bytes:
            return
        size = 1 << max(16, (nbytes - 1).bit_length())         # ≥ 64 KiB, a power of two
        if self.memory is not None and self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            torch.cuda.synchronize(self.device)                 # nothing reads the old one
        self.memory = self.memory_type(self.ctx, REGIONS * size, self.device)
        self.region_bytes, self.next_region, self.free = size, 0, [None] * REGIONS

    def exchange(self, send: torch.Tensor, group_size: int) -> tuple[torch.Tensor, Pending]:
        """Start the all-to-all of ``send [U, ...]`` (block ``j`` for the group's rank ``j``;
        the group: the ``U`` consecutive ranks holding this one) -> ``(recv [U, ...]
        source-major, pending)``; ``recv`` is valid after ``pending.wait()``, and the caller
        keeps it referenced until then (it is written on the copy stream; no
        ``record_stream``, as in the linear op's streams). ``send`` is read on the caller's
        stream only."""
        U = group_size
        if send.shape[0] != U:
            raise ValueError(f"send has {send.shape[0]} blocks for a group of {U}")
        if send.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the copy-engine exchange cannot run inside a CUDA graph "
                               "capture (its barriers and stream events do not replay): pass "
                               "SoftmaxTuning(a2a_transport='nccl') for captured steps")
        send = send.contiguous()
        self._room(send.numel() * send.element_size())
        r = self.next_region
        self.next_region = (r + 1) % REGIONS
        base = r * self.region_bytes
        me, g0 = self.ctx.rank % U, self.ctx.rank - self.ctx.rank % U
        block = send[0].numel() * send.element_size()
        cuda = self.stream is not None
        main = torch.cuda.current_stream(self.device) if cuda else None
        if cuda and self.free[r] is not None:
            main.wait_event(self.free[r])                       # step 4 of its last use
        mine = self.memory.view(None, base, send.shape, send.dtype)
        mine.copy_(send)
        recv = torch.empty_like(send)
        if cuda:
            self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream) if cuda else contextlib.nullcontext():
            self.memory.barrier(2 * r)
            for j in range(U):
                if j == me:
                    recv[j].copy_(mine[j])
                else:
                    recv[j].copy_(self.memory.view(g0 + j, base + me * block, send.shape[1:],
                                                   send.dtype))
            self.memory.barrier(2 * r + 1)
            if cuda:
                self.free[r] = torch.cuda.Event()
                self.free[r].record(self.stream)
        return recv, Pending(self.free[r] if cuda else None)


# one exchange per (process group, device); a process meets a few
_EXCHANGES = LRU(8)


def peer_exchange(ctx: SPContext, device: torch.device) -> PeerExchange:
    """The :class:`PeerExchange` of ``ctx``'s group on ``device`` (made once)."""
    return _EXCHANGES.get((ctx.group, tuple(ctx.global_ranks), device, CPU_MEMORY),
                          lambda: PeerExchange(ctx, device))

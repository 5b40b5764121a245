"""``LinearTuning(op_graphs=True)``: the op's whole forward and whole backward on this rank
replayed from one CUDA graph each, per call signature.

A layer called eagerly pays the host for every launch of the CP op (the local chunk kernels
through Triton's launcher, the scan, the row folds, the stream forks): about 2–3.5 ms per
forward + backward at P = 4, more than the GPU's own time at 8K per GPU and about as much at
32K, so an eager step waits on the host. A replay is one launch. Per signature (shapes, dtypes,
device, group, layout, scan, tuning) and direction: the first call runs eagerly (Triton
autotunes, NCCL connects), the second copies its tensor inputs into static buffers, captures
the body on them and replays it, later calls copy in and replay; outputs are cloned out of the
graph's buffers (the next replay writes over them). The copies are the price: the inputs
(q, k, v, gates; backward also dO and the saved states) in, the outputs out — eleven
``[B, T_local, H, K]`` tensors per forward + backward, 0.21 ms at 8K and 0.72 ms at 32K per GPU
on an H200 (about a third of the op's GPU time), which a host running ahead of the GPU does not
pay without graphs: hence off by default.

Every rank makes the same calls, so every rank captures at the same call (NCCL's scans are
inside). Under a capture of the caller's own (``train.py --cuda-graphs``, a whole step) the
body runs eagerly into that capture. Memory: per signature the static inputs and each graph's
private pool (the intermediates of one forward, one backward); at most :data:`MAX_SIGNATURES`
signatures are kept (least recently used dropped, captured again when met again).
:func:`sp_attention.release_cuda_graphs` drops them with the scans' graphs.
"""
from __future__ import annotations

from typing import Callable, Hashable

import torch

from ..caches import LRU
from .scan_common import register_graphs

__all__ = ["OpGraphs", "CudaGraph", "MAX_SIGNATURES"]

MAX_SIGNATURES = 8


class CudaGraph:
    """One ``torch.cuda.CUDAGraph``: ``capture(fn)`` records ``fn()`` and returns its
    outputs (the graph's buffers), ``replay()`` runs it again."""

    def __init__(self):
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], tuple]) -> tuple:
        with torch.cuda.graph(self.graph):     # synchronizes the device once
            return fn()

    def replay(self) -> None:
        self.graph.replay()


class _Entry:
    __slots__ = ("calls", "graph", "inputs", "outputs")

    def __init__(self):
        self.calls, self.graph, self.inputs, self.outputs = 0, None, None, None


def _static(t):
    """A buffer holding ``t``'s values (contiguous), or ``t`` itself off the graph's device
    (a CPU scalar the body does not read on the GPU) or None."""
    if not isinstance(t, torch.Tensor) or t.device.type == "cpu" and t.dim() == 0:
        return t
    return torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)


class OpGraphs:
    """The graphs of one body (the op's forward or backward; a scan with its row folds), by
    signature. ``graph_type``: what records and replays a body (:class:`CudaGraph`; the CPU
    tests pass a stand-in that re-runs the body)."""

    def __init__(self, graph_type=CudaGraph, maxsize: int = MAX_SIGNATURES):
        self.graph_type = graph_type
        self.entries = LRU(maxsize)
        register_graphs(self)

    def __call__(self, key: Hashable, fn: Callable[..., tuple], inputs: tuple) -> tuple:
        """``fn(*inputs)`` (a tuple of tensors / None): eagerly at the first call of ``key``,
        captured at the second, replayed after; tensor outputs are fresh tensors."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return fn(*inputs)
        e = self.entries.get(key, _Entry)
        e.calls += 1
        if e.calls == 1:
            return fn(*inputs)
        if e.graph is None:
            e.inputs = tuple(_static(t) for t in inputs)
            graph = self.graph_type()
            try:
                e.outputs = graph.capture(lambda: fn(*e.inputs))
            except RuntimeError as err:
                self.entries.clear()
                raise RuntimeError(f"capturing the linear op in a CUDA graph failed ({err}); "
                                   "run it without graphs: LinearTuning(op_graphs=False, "
                                   "scan_graphs=False)") from err
            e.graph = graph
        else:
            for buf, t in zip(e.inputs, inputs):
                if isinstance(buf, torch.Tensor) and buf is not t:
                    buf.copy_(t)
        e.graph.replay()
        return tuple(o.clone() if isinstance(o, torch.Tensor) and o.dim() else o
                     for o in e.outputs)

    def graphs(self) -> int:
        return sum(1 for e in self.entries.values() if e.graph is not None)

    def release(self) -> None:
        self.entries.clear()

"""Host-side cost proxy: aten ops dispatched per fwd+bwd step of each softmax pair and stride
(world size 1, tiny shapes, math backend), and per linear-attention step per scan.

    python benchmarks/host_ops.py

Every aten op costs the host a few µs; when a schedule dispatches thousands per step at a
sequence length where the GPU work is a few ms, the step becomes host-bound. Runs on CPU.
"""
from __future__ import annotations

import os
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sp_attention import SPContext  # noqa: E402
from sp_attention.linear import lightning_attention  # noqa: E402
from sp_attention.softmax import context_parallel_attention  # noqa: E402


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _measure(step) -> tuple[int, float]:
    with _Count() as c:
        step()
    t0 = time.perf_counter()
    for _ in range(10):
        step()
    return c.n, (time.perf_counter() - t0) * 100


def main() -> None:
    ctx = SPContext(None, 0, 1, (0,), "zigzag")
    B, T, H, Hkv, D = 1, 64, 32, 8, 8
    q = torch.randn(B, T, H, D, requires_grad=True)
    k, v = (torch.randn(B, T, Hkv, D, requires_grad=True) for _ in range(2))
    do = torch.randn(B, T, H, D)
    print(f"{'softmax fwd/bwd':<28}{'stride':<8}{'aten ops':>9}{'host ms (CPU)':>15}")
    for fwd, bwd, stride in [("ring", "ring", None), ("ring", "allgather", None),
                             ("ring", "allgather", 1), ("ring", "allgather", 8),
                             ("allgather", "ring", None), ("allgather", "allgather", None)]:
        def step():
            o = context_parallel_attention(q, k, v, ctx=ctx, fwd=fwd, bwd=bwd, backend="math",
                                           heads_k_stride=stride)
            o.backward(do)
        n, ms = _measure(step)
        print(f"{fwd + '/' + bwd:<28}{str(stride or 'default'):<8}{n:>9}{ms:>15.2f}")
    ql, kl, vl = (torch.randn(1, T, 16, 16, requires_grad=True) for _ in range(3))
    slopes = torch.linspace(0.01, 1, 16)
    for impl in ("blelloch", "allgather", "ring"):
        def lstep():
            lightning_attention(ql, kl, vl, slopes, ctx=ctx, impl=impl, backend="torch").sum().backward()
        n, ms = _measure(lstep)
        print(f"{'linear ' + impl:<36}{n:>9}{ms:>15.2f}")


if __name__ == "__main__":
    main()

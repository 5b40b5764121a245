"""What every part of the cost model shares: the layer shapes, where the ranks sit
(:class:`Topology`), the predicted times (:class:`StepTime`, :class:`Choice`), the kernels'
FLOP counts and times, and a state combine."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ..planning.schedules import CHUNK
from .machine import Link, Machine


def _positive_ints(obj, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{type(obj).__name__}.{n} must be a positive int, got {v!r}")


@dataclass(frozen=True)
class LinearShape:
    """One linear-attention layer on one rank: ``q, k [B, T_local, H, K]``, ``v [.., V]``;
    ``itemsize`` of the inputs (2 bf16/fp16, 4 fp32, 8 fp64)."""

    B: int
    T_local: int
    H: int
    K: int
    V: int
    itemsize: int = 2

    def __post_init__(self) -> None:
        _positive_ints(self, "B", "T_local", "H", "K", "V", "itemsize")

    @property
    def state_bytes(self) -> int:
        """One packed scan element ``(A [B, H], b [B, H, K, V])`` in fp32 (fp64 for fp64)."""
        return (8 if self.itemsize == 8 else 4) * self.B * self.H * (self.K * self.V + 1)


@dataclass(frozen=True)
class SoftmaxShape:
    """One causal GQA softmax layer on one rank: ``q [B, T_local, H, D]``, ``k, v [.., Hkv,
    D]``."""

    B: int
    T_local: int
    H: int
    Hkv: int
    D: int
    itemsize: int = 2
    causal: bool = True

    def __post_init__(self) -> None:
        _positive_ints(self, "B", "T_local", "H", "Hkv", "D", "itemsize")
        if self.H % self.Hkv:
            raise ValueError(f"SoftmaxShape: H={self.H} must be a multiple of Hkv={self.Hkv}")

    @property
    def kv_bytes(self) -> int:
        """This rank's K and V: what one ring hop carries."""
        return 2 * self.B * self.T_local * self.Hkv * self.D * self.itemsize


@dataclass(frozen=True)
class Topology:
    """Which node each rank of the CP group sits on (``nodes[r]`` for group rank r)."""

    nodes: tuple[int, ...]

    @staticmethod
    def single_node(world: int) -> "Topology":
        return Topology((0,) * world)

    @staticmethod
    def of_ranks(global_ranks: Sequence[int], ranks_per_node: int) -> "Topology":
        """From the group's global ranks and the ranks (GPUs) per node (torchrun's
        ``LOCAL_WORLD_SIZE``; TP-inner layouts give CP groups strided global ranks)."""
        return Topology(tuple(int(g) // ranks_per_node for g in global_ranks))

    @staticmethod
    def packed(world: int, per_node: int) -> "Topology":
        """``world`` CP ranks filling nodes of ``per_node`` CP ranks each in order."""
        return Topology(tuple(r // per_node for r in range(world)))

    @property
    def world(self) -> int:
        return len(self.nodes)

    @property
    def spans_nodes(self) -> bool:
        return len(set(self.nodes)) > 1

    def link(self, machine: Machine, a: int, b: int) -> Link:
        return machine.intra if self.nodes[a] == self.nodes[b] else machine.inter

    def collective_link(self, machine: Machine) -> Link:
        return machine.inter if self.spans_nodes else machine.intra


@dataclass(frozen=True)
class StepTime:
    """Predicted times of one layer's step (ms, slowest rank): ``compute_ms`` is the kernels'
    share, ``comm_ms`` every transfer as if alone (hidden or not)."""

    fwd_ms: float
    bwd_ms: float
    compute_ms: float
    comm_ms: float

    @property
    def total_ms(self) -> float:
        return self.fwd_ms + self.bwd_ms

    @property
    def exposed_ms(self) -> float:
        """What the schedule adds over its kernels (exposed transfers, bookkeeping)."""
        return max(self.total_ms - self.compute_ms, 0.0)


@dataclass(frozen=True)
class Choice:
    """What ``auto`` picked and the predicted time of every alternative (name -> StepTime)."""

    name: str
    predicted: Mapping[str, StepTime] = field(hash=False)
    excluded: Mapping[str, str] = field(default_factory=dict, hash=False)
    why: str = ""       # a fixed rule's reason, when nothing was predicted

    def describe(self) -> str:
        if not self.predicted:
            return f"{self.name} ({self.why or 'the fixed CPU rule: no time model'})"
        ranked = sorted(self.predicted.items(), key=lambda kv: kv[1].total_ms)
        parts = [f"{n} {t.total_ms:.3g} (fwd {t.fwd_ms:.3g})" for n, t in ranked]
        out = f"{self.name}; predicted fwd+bwd ms: " + ", ".join(parts)
        if self.excluded:
            out += "; excluded: " + ", ".join(f"{n} ({why})" for n, why in self.excluded.items())
        return out


# ----------------------------------------------------------------------------- FLOPs
def linear_flops(shape: LinearShape) -> float:
    """fwd + bwd FLOPs of the chunked linear kernel on one rank: forward
    ``2·B·T·H·(2·K·V + C·(K + V))`` (states ``kᵀv``, output ``q·S``, the intra-chunk
    ``q·kᵀ`` and its product with ``v``, chunk C = 64), backward twice the forward."""
    s = shape
    return 3 * 2 * s.B * s.T_local * s.H * (2 * s.K * s.V + CHUNK * (s.K + s.V))


def softmax_flops(B: int, H: int, rows: int, keys: int, D: int, causal_diag: bool) -> float:
    """Forward FLOPs of one attention call, ``4·B·H·D·rows·keys``; a bottom-right causal call
    skips the upper triangle of its last ``rows`` keys. Backward = 2.5 × forward (the benchmarks'
    convention)."""
    pairs = rows * keys - (rows * (rows - 1) / 2 if causal_diag else 0)
    return 4.0 * B * H * D * pairs


def softmax_kernel_ms(machine: Machine, B: int, H: int, rows: int, keys: int, D: int,
                      causal_diag: bool) -> tuple[float, float]:
    """(fwd, bwd) ms of one attention call's pairs on one rank alone, without the call's fixed
    cost: the FLOPs of :func:`softmax_flops` (a GPU kernel skips the masked triangle) at the
    kernels' rates."""
    k = machine.kernels
    f = softmax_flops(B, H, rows, keys, D, causal_diag)
    return f / (k.softmax_fwd_tflops * 1e9), 2.5 * f / (k.softmax_bwd_tflops * 1e9)


def combine_ms(machine: Machine, nbytes: float) -> float:
    """``A·x + b`` on one state: reads two, writes one."""
    k = machine.kernels
    return k.op_us * 1e-3 + 3 * nbytes / k.mem_gbps * 1e-6

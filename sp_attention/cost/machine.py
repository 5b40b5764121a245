"""What the cost model knows about a GPU machine: link latencies and bandwidths, local-kernel
rates, overlap; the built-in figures and the calibration file.

Pure Python (no torch): :mod:`sp_attention.cost` predicts from a :class:`Machine`, and
``python -m sp_attention.calibrate`` measures one on GPUs and saves it as JSON (default
``$SP_ATTENTION_CALIBRATION`` or ``~/.cache/sp_attention/calibration.json``, under
``$XDG_CACHE_HOME`` when set). :func:`load_machine` returns the saved calibration when it
matches the device, else the built-in figures (:func:`default_machine`: the calibrations of
4 × H200 and 2 × H100, :data:`H200_NVLINK_4GPU`, :data:`H100_NVLINK_2GPU`; the older
:data:`H200_NVLINK_IB400` from a 2 × H200 link probe and one-GPU kernel runs stays as a fixed
reference), and **InfiniBand figures that are not calibrated here**: 400 Gb/s is 50 GB/s
per direction per NIC (one NIC per GPU), taken as 40 GB/s after protocol overhead, with the
intra-node latency plus 15 µs (network and NCCL proxy).

There is no CPU machine: CPU timing on shared cores does not repeat within the model's
tolerance, so on CPU ``auto`` follows the fixed rule of :mod:`sp_attention.cost.choose`.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Optional

from .plausible import implausible

__all__ = ["Link", "Kernels", "Machine", "H200_NVLINK_IB400", "H200_NVLINK_4GPU",
           "H100_NVLINK_2GPU", "default_machine",
           "calibration_path", "load_machine", "save_machine", "machine_from_dict"]


@dataclass(frozen=True)
class Link:
    """One link class (inside a node, or across nodes).

    Attributes:
        alpha_p2p_us: latency of one point-to-point round (``batch_isend_irecv`` + wait),
            the fixed part of a ring hop or a tree-scan round.
        p2p_gbps: point-to-point bandwidth per direction per rank, GB/s (1e9 bytes).
        alpha_coll_us: latency of one all-gather / reduce-scatter among 2 ranks.
        coll_gbps: bytes each rank receives (all-gather) or sends (reduce-scatter) per
            second in a collective, GB/s.
        step_us: latency each further rank adds to a collective (ring algorithm: P − 1 steps).
    """

    alpha_p2p_us: float
    p2p_gbps: float
    alpha_coll_us: float
    coll_gbps: float
    step_us: float

    def __post_init__(self) -> None:
        for name in ("alpha_p2p_us", "alpha_coll_us", "step_us"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"Link.{name} must be >= 0 µs, got {getattr(self, name)!r}")
        for name in ("p2p_gbps", "coll_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Link.{name} must be > 0 GB/s, got {getattr(self, name)!r}")

    def p2p_ms(self, nbytes: float) -> float:
        """One message (or one round of simultaneous messages) of ``nbytes``: ``α + n/β``."""
        return self.alpha_p2p_us * 1e-3 + nbytes / self.p2p_gbps * 1e-6

    def collective_ms(self, world: int, recv_bytes: float) -> float:
        """All-gather / reduce-scatter over ``world`` ranks in which each rank receives (or
        sends) ``recv_bytes``: ``α + (P − 2)·step + bytes/β``."""
        return ((self.alpha_coll_us + max(world - 2, 0) * self.step_us) * 1e-3
                + recv_bytes / self.coll_gbps * 1e-6)


@dataclass(frozen=True)
class Kernels:
    """Local-kernel figures of one GPU (the time model is ``call + FLOPs / rate``).

    Attributes:
        linear_tflops: effective rate of the local linear kernel's fwd + bwd, by the FLOP
            convention of :func:`sp_attention.cost.linear_flops`.
        linear_call_ms: fixed time of one linear fwd + bwd (launch tails; per rank step).
        linear_fwd_share: forward's share of the linear fwd + bwd time.
        linear_rank_contiguous, linear_rank_zigzag: a CP rank's kernel work at P > 1 (its
            leaves, the state passes, what the scan's side stream takes from them) ÷ the
            plain kernel on the same tokens: ``contiguous`` where the rank runs its tokens as
            one row, ``zigzag`` where as several (zigzag's two leaves, or a leaf split into
            rows by ``LinearTuning.row_splits``' rule: :func:`sp_attention.cost.linear.
            rank_factor`). Built in: each rank's program alone on one H200
            (``benchmarks/linear_rank_programs.py``, the slowest rank); the probe fits them to
            a linear CP step across the GPUs it runs on.
        sms: the GPU's SM count (the row-split rule reads it; H100 / H200 SXM: 132).
        softmax_fwd_tflops, softmax_bwd_tflops: attention kernel rates over the (query, key)
            pairs a call keeps (a causal kernel skips the masked triangle); backward FLOPs are
            2.5 × forward.
        softmax_call_ms: fixed time of one attention kernel call (each direction).
        softmax_ag_call_fwd_ms, softmax_ag_call_bwd_ms, softmax_ag_rate: the all-gather
            schedules' calls (a head stride each: fewer query heads per call, keys arranged
            per chunk, dK/dV scattered into fp32 slots) cost this much more per call and run
            at this share of the full-width rate (fitted to one-H200 ``softmax_pieces`` rows
            of each rank's all-gather program, 8K and 32K).
        mem_gbps: effective bandwidth of element-wise passes (merges, adds, folds), GB/s.
        op_us: fixed cost of one small element-wise op (a state combine, a copy).
        softmax_bwd_workspace: bytes per query element (``B·T·H·D``) the kernel backward
            allocates beyond dq, dk, dv (cuDNN: fp32 dq accumulation and friends).
    """

    linear_tflops: float
    linear_call_ms: float
    linear_fwd_share: float
    softmax_fwd_tflops: float
    softmax_bwd_tflops: float
    softmax_call_ms: float
    mem_gbps: float
    op_us: float
    softmax_bwd_workspace: float = 8.0
    softmax_ag_call_fwd_ms: float = 0.0
    softmax_ag_call_bwd_ms: float = 0.0
    softmax_ag_rate: float = 1.0
    linear_rank_contiguous: float = 1.0
    linear_rank_zigzag: float = 1.0
    sms: int = 132

    def __post_init__(self) -> None:
        for name in ("linear_tflops", "softmax_fwd_tflops", "softmax_bwd_tflops", "mem_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Kernels.{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 < self.linear_fwd_share < 1:
            raise ValueError("Kernels.linear_fwd_share must be in (0, 1), got "
                             f"{self.linear_fwd_share!r}")


@dataclass(frozen=True)
class Machine:
    """Everything the cost model needs about where the ranks run.

    Attributes:
        name: what this is (``"h200-nvlink-ib400"``, a calibrated device).
        source: where the numbers come from (the probe and its date, or "default: ...").
        kernels: the local kernels' figures (:class:`Kernels`).
        intra: link inside a node; ``inter``: across nodes.
        gpus_per_node: ranks per node (for topologies built from global ranks).
        overlap_cost: ms the kernels lose per ms of transfer that runs beside them, the
            transfer's bytes counted at the node's own p2p rate (``intra.p2p_gbps``: NCCL
            kernels take SMs and memory bandwidth from the attention kernels; a slower network
            does not lengthen that; 0 = free). Built in: 3, fitted to 2 × H200 softmax CP
            runs; the probe fits it to a softmax ring step across the GPUs it runs on.
        device: the device string this was measured on (``torch.cuda.get_device_name``);
            :func:`load_machine` uses a calibration only on a matching device.
    """

    name: str
    source: str
    kernels: Kernels
    intra: Link
    inter: Link
    gpus_per_node: int = 8
    overlap_cost: float = 0.0
    device: str = ""
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"Machine.gpus_per_node must be a positive int, got "
                             f"{self.gpus_per_node!r}")
        if not self.overlap_cost >= 0:
            raise ValueError(f"Machine.overlap_cost must be >= 0, got {self.overlap_cost!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# Fields of calibrations written before the model became a GPU model (CPU/gloo host terms);
# a GPU calibration held them at neutral values, so they are dropped when it is read.
_DROPPED = {"kernels": ("cores", "corun", "msg_us", "scan_msg_us", "fold_us", "msg_cpu_us",
                        "resume_us", "softmax_mask", "softmax_bwd_call_ms"),
            "machine": ("scan_hidden", "links_world")}


def machine_from_dict(d: dict) -> Machine:
    """Inverse of :meth:`Machine.to_dict` (unknown keys are refused with their names)."""
    d = {k: v for k, v in d.items() if k not in _DROPPED["machine"]}
    try:
        kernels = Kernels(**{k: v for k, v in d.pop("kernels").items()
                             if k not in _DROPPED["kernels"]})
        intra, inter = Link(**d.pop("intra")), Link(**d.pop("inter"))
        return Machine(kernels=kernels, intra=intra, inter=inter, **d)
    except TypeError as e:
        raise ValueError(f"not a calibration of this sp_attention version ({e}); re-run "
                         "`python -m sp_attention.calibrate` on the GPUs") from e


# NVLink (2 x H200, NV18, torch 2.11 + NCCL 2.28.3): p2p 1/8/32/128 MiB 0.071/0.071/0.151/
# 0.470 ms, all-gather 0.026/0.056/0.158/0.552 ms (received bytes), fitted by relative least
# squares. Kernels (one H200): fla chunk_simple_gla B1 H16 K=V=128 bf16 fwd+bwd 1.114 / 2.164
# ms at 16K / 32K, fwd 0.237 / 0.457 ms; cuDNN causal Llama-3-8B attention fwd 620-660, bwd
# ~526 TFLOP/s; merge kernel 88 us per 8K-row bf16 merge (~2.3 TB/s); cuDNN backward working
# memory of 353 MiB at 8K tokens = dq/dk/dv (96 MiB) + 8.0 bytes per query element; a CP
# rank's linear kernels 0.984 (contiguous) / 0.917 (zigzag) of fla's on T_local at 32K.
H200_NVLINK_IB400 = Machine(
    name="h200-nvlink-ib400",
    source="default: 2 x H200 NVLink probes and one-H200 kernel runs; InfiniBand 400 Gb/s "
           "assumed, not calibrated here",
    kernels=Kernels(linear_tflops=73.0, linear_call_ms=0.064, linear_fwd_share=0.212,
                    softmax_fwd_tflops=625.0, softmax_bwd_tflops=530.0, softmax_call_ms=0.02,
                    mem_gbps=2300.0, op_us=6.0, softmax_bwd_workspace=8.0,
                    softmax_ag_call_fwd_ms=0.08, softmax_ag_call_bwd_ms=0.2,
                    softmax_ag_rate=0.96, linear_rank_contiguous=0.984,
                    linear_rank_zigzag=0.917),
    intra=Link(alpha_p2p_us=58.0, p2p_gbps=352.0, alpha_coll_us=22.0, coll_gbps=250.0,
               step_us=2.0),
    inter=Link(alpha_p2p_us=73.0, p2p_gbps=40.0, alpha_coll_us=37.0, coll_gbps=40.0,
               step_us=8.0),
    gpus_per_node=8, overlap_cost=3.0, device="NVIDIA H200")


# The same machine fitted by ``python -m sp_attention.calibrate`` on 4 × H200 (NVLink, torch
# 2.11, NCCL 2.28.3; links among 2 and 4 ranks; 2026-11-26,
# benchmarks/results/2026-11-26_h200x4_calibration.json): the built-in figures of H200s.
H200_NVLINK_4GPU = Machine(
    name="h200-nvlink-4gpu",
    source="default: calibrated on 4 x H200 NVLink (2026-11-26); InfiniBand 400 Gb/s assumed, "
           "not calibrated here",
    kernels=Kernels(linear_tflops=84.4, linear_call_ms=0.0419, linear_fwd_share=0.243,
                    softmax_fwd_tflops=657.0, softmax_bwd_tflops=553.0, softmax_call_ms=0.0475,
                    mem_gbps=4290.0, op_us=2.34, softmax_bwd_workspace=8.0,
                    softmax_ag_call_fwd_ms=0.08, softmax_ag_call_bwd_ms=0.2,
                    softmax_ag_rate=0.96, linear_rank_contiguous=1.29,
                    linear_rank_zigzag=1.15),
    intra=Link(alpha_p2p_us=25.2, p2p_gbps=236.0, alpha_coll_us=24.9, coll_gbps=287.0,
               step_us=7.54),
    inter=H200_NVLINK_IB400.inter, gpus_per_node=8, overlap_cost=1.7, device="NVIDIA H200")

# Calibrated on 2 × H100 80GB HBM3 (NVLink; links among 2 ranks; 2026-11-26,
# benchmarks/results/2026-11-26_h100x2_calibration.json): the built-in figures of H100s.
H100_NVLINK_2GPU = Machine(
    name="h100-nvlink-2gpu",
    source="default: calibrated on 2 x H100 NVLink (2026-11-26); InfiniBand 400 Gb/s assumed, "
           "not calibrated here",
    kernels=Kernels(linear_tflops=66.4, linear_call_ms=0.0296, linear_fwd_share=0.236,
                    softmax_fwd_tflops=656.0, softmax_bwd_tflops=548.0, softmax_call_ms=0.0453,
                    mem_gbps=3020.0, op_us=2.41, softmax_bwd_workspace=8.0,
                    softmax_ag_call_fwd_ms=0.08, softmax_ag_call_bwd_ms=0.2,
                    softmax_ag_rate=0.96, linear_rank_contiguous=1.14,
                    linear_rank_zigzag=1.11),
    intra=Link(alpha_p2p_us=22.9, p2p_gbps=277.0, alpha_coll_us=23.6, coll_gbps=236.0,
               step_us=2.0),
    inter=H200_NVLINK_IB400.inter, gpus_per_node=8, overlap_cost=1.47,
    device="NVIDIA H100 80GB HBM3")


def _gpu_only(device: str) -> None:
    if device == "cpu":
        raise ValueError("the cost model is a GPU model: on CPU `auto` follows the fixed rule "
                         "of sp_attention.cost.choose (cpu_linear_scan, cpu_softmax_preset)")


def default_machine(device: str) -> Machine:
    """The built-in figures for a CUDA device name: an H100 gets :data:`H100_NVLINK_2GPU`, any
    other GPU :data:`H200_NVLINK_4GPU` (both calibrated on this project's machines; calibrate
    yours to be sure). ``"cpu"`` raises (no CPU model)."""
    _gpu_only(device)
    return H100_NVLINK_2GPU if "H100" in device else H200_NVLINK_4GPU


def calibration_path(path: Optional[str] = None) -> str:
    """Where the calibration lives: ``path``, else ``$SP_ATTENTION_CALIBRATION``, else
    ``$XDG_CACHE_HOME/sp_attention/calibration.json`` (``~/.cache`` when unset)."""
    if path:
        return path
    env = os.environ.get("SP_ATTENTION_CALIBRATION")
    if env:
        return env
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "sp_attention", "calibration.json")


def save_machine(machine: Machine, path: Optional[str] = None) -> str:
    """Write ``machine`` as JSON (atomically: a temporary file renamed); returns the path."""
    path = calibration_path(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"version": 1, "machine": machine.to_dict()}, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return path


def load_machine(device: str, path: Optional[str] = None) -> Machine:
    """The calibration at :func:`calibration_path` if it exists and was measured on the CUDA
    device ``device`` (exact name), else :func:`default_machine`. A file that is not a usable
    calibration (unreadable, or figures no GPU can have: :func:`~.plausible.implausible`)
    raises ``ValueError`` naming it and what is wrong."""
    _gpu_only(device)
    path = calibration_path(path)
    if not os.path.exists(path):
        return default_machine(device)
    try:
        with open(path) as f:
            data = json.load(f)
        machine = machine_from_dict(data["machine"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a usable sp_attention calibration ({e}); delete it or "
                         "re-run `python -m sp_attention.calibrate` on the GPUs") from e
    if machine.device != device:
        return default_machine(device)
    problems = implausible(machine)
    if problems:
        raise ValueError(f"{path} holds figures no {device} can have ({'; '.join(problems)}); "
                         "delete it or re-run `python -m sp_attention.calibrate` on the GPUs")
    return machine

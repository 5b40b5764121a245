"""What the cost model knows about a machine: link latencies and bandwidths, local-kernel
throughput, overlap; defaults and the calibration file.

Pure Python (no torch): :mod:`sp_attention.cost` predicts from a :class:`Machine`, and
``python -m sp_attention.calibrate`` measures one and saves it as JSON (default
``$SP_ATTENTION_CALIBRATION`` or ``~/.cache/sp_attention/calibration.json``, under
``$XDG_CACHE_HOME`` when set). :func:`load_machine` returns the saved calibration when it
matches the device, else the default for the device kind:

* ``H200_NVLINK_IB400``: NVLink figures fitted to the recorded 2 × H200 link probe
  (``benchmarks/results/2026-11-22_h200x2_link_probe.jsonl``), one-GPU kernel figures from the
  recorded H200 runs (``2026-11-23_h200_s6_*``), the overlap cost fitted to the 2 × H200 CP
  runs of 2026-11-23, and **InfiniBand figures that are not calibrated here**: 400 Gb/s is
  50 GB/s per direction per NIC (one NIC per GPU); we assume 40 GB/s after protocol overhead,
  and per-message latency of the intra-node figure plus 15 µs (network + NCCL proxy).
* ``CPU_GLOO``: this project's 2-core CPU machine through gloo, from the probe
  (``benchmarks/results/2026-11-24_cpu_gloo_calibration.json`` and the CPU validation runs).
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Optional

__all__ = ["Link", "Kernels", "Machine", "H200_NVLINK_IB400", "CPU_GLOO", "default_machine",
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
    """Local-kernel figures of one device (the time model is ``call + FLOPs / rate``).

    Attributes:
        linear_tflops: effective rate of the local linear kernel's fwd + bwd, by the FLOP
            convention of :func:`sp_attention.cost.linear_flops`.
        linear_call_ms: fixed time of one linear fwd + bwd (launch tails; per rank step).
        linear_fwd_share: forward's share of the linear fwd + bwd time.
        linear_rank_contiguous, linear_rank_zigzag: a CP rank's own kernel work (its
            leaves, the state passes) ÷ the plain kernel on the same tokens, by layout
            (``benchmarks/linear_rank_programs.py``; the slowest rank).
        softmax_fwd_tflops, softmax_bwd_tflops: attention kernel rates (backward 2.5 ×
            forward; a causal call's FLOPs as ``softmax_mask`` says).
        softmax_call_ms: fixed time of one attention kernel call.
        softmax_ag_call_fwd_ms, softmax_ag_call_bwd_ms, softmax_ag_rate: the all-gather
            schedules' calls (a head stride each: fewer query heads per call, keys arranged
            per chunk, dK/dV scattered into fp32 slots) cost this much more per call and run
            at this share of the full-width rate (fitted to the one-H200 ``softmax_pieces``
            rows of each rank's all-gather program, 8K and 32K).
        mem_gbps: effective bandwidth of element-wise passes (merges, adds, folds), GB/s.
        op_us: fixed cost of one small element-wise op (a state combine, a copy).
        softmax_bwd_workspace: bytes per query element (``B·T·H·D``) the kernel backward
            allocates beyond dq, dk, dv (cuDNN: fp32 dq accumulation and friends).
        cores: CPU cores the ranks of one machine share (None: one device per rank). With P
            ranks on ``cores`` cores each rank computes at ``min(1, cores / P)`` of its rate;
            a fraction when other work holds part of the cores.
        softmax_bwd_call_ms: fixed time of one attention backward call (None: the forward's
            ``softmax_call_ms``). On CPU the math backward is about twice the forward's ops
            (probe: 0.18 ms forward, 0.27 ms backward); the ring makes one call per step and
            direction, the all-gather schedules one per local chunk and stride.
        msg_us: host work of one point-to-point message a rank posts (a send or a receive:
            the ``P2POp``, the work object, the backend's hand-off to its I/O thread and
            back), CPU time on the cores the ranks share. Probe: the slope of a
            ``batch_isend_irecv`` of 1, 2, 4, 8 messages each way. 0 on a GPU, where the host
            runs ahead of the device.
        scan_msg_us: a linear scan's own host work per message it posts, on top of
            ``msg_us`` (packing and unpacking the elements, the receive buffer, the schedule's
            Python; the tree scan packs a round's elements for one peer into one message).
            Probe: the library's tree scan on two ranks (zigzag), the value at which the
            model's time for it equals the measured one.
        fold_us: host work of the all-gather scan's local fold (about 16 small torch ops plus
            5 per local element, and the gather's buffers). Probe: the library's all-gather
            scan on two ranks, likewise.
        corun: how much slower a rank computes while the other ranks compute beside it
            (shared caches and memory bandwidth) than alone; CPU: the plain linear kernel on
            every rank of the probe's group at once ÷ on one. Applies from two ranks on.
        msg_cpu_us: CPU time one point-to-point message costs its two processes in all (the
            posting at both ends, the backend's I/O threads, the wake-up of a receiver that
            slept), counted only in the work-conserving bound: where the ranks have cores to
            spare it runs beside the others, where they outnumber the cores it takes theirs
            (each message end at least ``msg_us``). Probe: process time of both ends over
            messages to a receiver that has been waiting. 0 on a GPU.
        resume_us: CPU time a received message costs its receiver on top of
            ``msg_cpu_us`` where the ranks outnumber the cores: the other ranks ran on its
            core while it waited, and it resumes with its caches refilled by their work.
            Counted only in the work-conserving bound, only from ``cores`` + 1 ranks on.
            Probe: a receiver's process time per message from a sender that computes the
            plain kernel on the receiver's own core before each send, less the same from a
            sender on another core. 0 on a GPU.
        softmax_mask: how a causal attention call is costed. None: the kernel skips the
            masked triangle (flash, cuDNN), and a causal call's FLOPs are the pairs it keeps.
            A number m: the kernel computes every (query, key) pair of the call's block and
            then masks it (the ``math`` backend of every CPU run), so a causal call costs the
            full block plus ``m`` × the full block's forward time in each direction (building
            and applying the mask). Probe: causal and non-causal calls of the same sizes.
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
    cores: Optional[float] = None
    softmax_bwd_call_ms: Optional[float] = None
    msg_us: float = 0.0
    scan_msg_us: float = 0.0
    fold_us: float = 0.0
    corun: float = 1.0
    softmax_mask: Optional[float] = None
    msg_cpu_us: float = 0.0
    resume_us: float = 0.0

    @property
    def bwd_call_ms(self) -> float:
        """Fixed time of one attention backward call (``softmax_call_ms`` when not set)."""
        return self.softmax_call_ms if self.softmax_bwd_call_ms is None else \
            self.softmax_bwd_call_ms

    def __post_init__(self) -> None:
        for name in ("linear_tflops", "softmax_fwd_tflops", "softmax_bwd_tflops", "mem_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Kernels.{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 < self.linear_fwd_share < 1:
            raise ValueError("Kernels.linear_fwd_share must be in (0, 1), got "
                             f"{self.linear_fwd_share!r}")
        if self.softmax_mask is not None and not self.softmax_mask >= 0:
            raise ValueError(f"Kernels.softmax_mask must be None or >= 0, got "
                             f"{self.softmax_mask!r}")
        if self.cores is not None and (isinstance(self.cores, bool) or not isinstance(
                self.cores, (int, float)) or not self.cores > 0):
            raise ValueError(f"Kernels.cores must be None or a positive number, got "
                             f"{self.cores!r}")


@dataclass(frozen=True)
class Machine:
    """Everything the cost model needs about where the ranks run.

    Attributes:
        name: what this is (``"h200-nvlink-ib400"``, ``"cpu-gloo"``, a calibrated device).
        source: where the numbers come from (a file and date, or "default: ...").
        kernels: the local kernels' figures (:class:`Kernels`).
        intra: link inside a node; ``inter``: across nodes.
        gpus_per_node: ranks per node (for topologies built from global ranks).
        overlap_cost: ms the kernels lose per ms of transfer that runs beside them, the
            transfer's bytes counted at the node's own p2p rate (``intra.p2p_gbps``: NCCL
            kernels take SMs and memory bandwidth from the attention kernels; a slower network
            does not lengthen that; 0 = free). Fitted to the 2 × H200 softmax CP runs: 3 (a
            hop of K/V costs about three times its NVLink time in slower kernels); 1 on CPU
            (gloo copies on the cores).
        scan_hidden: the linear backward's state scan runs beside the chunk-state
            recomputation (a GPU side stream); False on CPU, where it is serial.
        device: the device string this was measured on (``torch.cuda.get_device_name`` or
            ``"cpu"``); :func:`load_machine` uses a calibration only on a matching device.
        links_world: the number of ranks the links were measured among (0: not measured, or
            the figures hold for any group size); see :meth:`comm_share`.
    """

    name: str
    source: str
    kernels: Kernels
    intra: Link
    inter: Link
    gpus_per_node: int = 8
    overlap_cost: float = 0.0
    scan_hidden: bool = True
    device: str = ""
    links_world: int = 0
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"Machine.gpus_per_node must be a positive int, got "
                             f"{self.gpus_per_node!r}")
        if not self.overlap_cost >= 0:
            raise ValueError(f"Machine.overlap_cost must be >= 0, got {self.overlap_cost!r}")

    def core_share(self, world: int) -> float:
        """Share of a core each of ``world`` co-located ranks gets (CPU ranks time-share
        ``kernels.cores``; GPUs have one device per rank)."""
        cores = self.kernels.cores
        return 1.0 if cores is None else min(1.0, cores / max(world, 1))

    def compute_share(self, world: int) -> float:
        """Share of one rank's rate alone each of ``world`` co-located ranks computes at: its
        share of the cores (:meth:`core_share`), slowed by ``kernels.corun`` when two or more
        run at once (CPU only; a GPU rank has its own device)."""
        share = self.core_share(world)
        return share if self.kernels.cores is None or world < 2 else share / self.kernels.corun

    def comm_share(self, world: int) -> float:
        """What a communication round in which ``world`` ranks take part gets of the links'
        calibrated speed: their share of the cores, unless the links were measured among
        exactly ``world`` ranks (``links_world``), which already includes the sharing."""
        return 1.0 if self.links_world == world else self.core_share(world)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# Kernels fields added after calibrations were first saved (see machine_from_dict); a
# calibration without ``softmax_mask`` had its attention rates fitted to causal FLOPs counted
# at half the square, so it keeps the field's default (None), which reads them that way.
_LATER_KERNEL_FIELDS = ("softmax_bwd_call_ms", "msg_us", "scan_msg_us", "fold_us", "corun",
                        "msg_cpu_us", "resume_us")


def machine_from_dict(d: dict) -> Machine:
    """Inverse of :meth:`Machine.to_dict` (unknown keys are refused with their names)."""
    d = dict(d)
    try:
        # a calibration written before a field existed: that field from the device's default
        base = default_machine(d.get("device", "cpu")).kernels
        kernels = Kernels(**{**{f: getattr(base, f) for f in _LATER_KERNEL_FIELDS},
                             **d.pop("kernels")})
        intra, inter = Link(**d.pop("intra")), Link(**d.pop("inter"))
        return Machine(kernels=kernels, intra=intra, inter=inter, **d)
    except TypeError as e:
        raise ValueError(f"not a calibration of this sp_attention version ({e}); re-run "
                         "`python -m sp_attention.calibrate`") from e


# 2 x H200 NVLink (NV18), torch 2.11 + NCCL 2.28.3, 2026-11-22 link probe: p2p 1/8/32/128 MiB
# 0.071/0.071/0.151/0.470 ms, all-gather 0.026/0.056/0.158/0.552 ms (received bytes); fitted
# by relative least squares (benchmarks/report.py recomputes the fit and its errors).
# Kernels: fla chunk_simple_gla B1 H16 K=V=128 bf16 fwd+bwd 1.114 / 2.164 ms at 16K / 32K,
# fwd 0.237 / 0.457 ms; cuDNN causal Llama-3-8B attention fwd 620-660, bwd ~526 TFLOP/s;
# merge kernel 88 us per 8K-row bf16 merge (~2.3 TB/s); cuDNN backward working memory of
# 353 MiB at 8K tokens = dq/dk/dv (96 MiB) + 8.0 bytes per query element; a CP rank's linear
# kernels 0.984 (contiguous) / 0.917 (zigzag) of fla's on T_local at 32K (s6 rank programs).
H200_NVLINK_IB400 = Machine(
    name="h200-nvlink-ib400",
    source="default: 2 x H200 NVLink probes and one-H200 kernel runs of 2026-11-22/23 "
           "(benchmarks/results); InfiniBand 400 Gb/s assumed, not calibrated here",
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
    gpus_per_node=8, overlap_cost=3.0, scan_hidden=True, device="NVIDIA H200")

# This project's CPU machine (2 cores, gloo over loopback, one thread per process): the
# medians of `python -m sp_attention.calibrate` and the three `benchmarks/cost_cpu.py` runs
# (benchmarks/results/2026-11-24_cpu_gloo_*), taken while other jobs loaded the machine; the
# host terms (call costs per direction, msg_us, scan_msg_us, fold_us) from the probe of
# 2026-11-24 15:34 (load ~3), corun 1.08 from the quiet run's plain kernel on 2 ranks at
# once ÷ alone (2026-11-24_quiet_cpu_gloo_cost.jsonl, median of 3 runs); the attention
# call's figures (every pair of a block computed, the mask 0.8 × the block's forward on
# top) from two quiet probes of causal and non-causal calls at T = 32…256, 2026-11-24 19:01;
# a message's CPU (both processes, every thread, to a receiver that waited 2 ms) 165–238 µs
# in four probes at 2, 4, 8 processes (19:50-20:10): 200; what a receive costs more where
# the sender's kernel ran on the receiver's core (the `resume` probe, 2026-11-24 21:00-21:10,
# eight probes from -11 to 153 µs, median ~60): 60.
CPU_GLOO = Machine(
    name="cpu-gloo",
    source="default: the project's 2-core CPU machine, gloo (benchmarks/results/"
           "2026-11-24_cpu_gloo_*)",
    kernels=Kernels(linear_tflops=0.026, linear_call_ms=1.05, linear_fwd_share=0.265,
                    softmax_fwd_tflops=0.032, softmax_bwd_tflops=0.043, softmax_call_ms=0.15,
                    mem_gbps=66.0, op_us=2.5, softmax_bwd_workspace=8.0,
                    linear_rank_contiguous=1.11, linear_rank_zigzag=1.08, cores=2,
                    softmax_bwd_call_ms=0.24, msg_us=24.0, scan_msg_us=18.0, fold_us=108.0,
                    corun=1.08, softmax_mask=0.8, msg_cpu_us=200.0, resume_us=60.0),
    intra=Link(alpha_p2p_us=84.0, p2p_gbps=2.4, alpha_coll_us=160.0, coll_gbps=1.3,
               step_us=160.0),
    inter=Link(alpha_p2p_us=84.0, p2p_gbps=2.4, alpha_coll_us=160.0, coll_gbps=1.3,
               step_us=160.0),
    gpus_per_node=1024, overlap_cost=1.0, scan_hidden=False, device="cpu", links_world=2)


def default_machine(device: str) -> Machine:
    """The built-in figures for ``device`` (``"cpu"`` or a CUDA device name); any GPU gets
    the H200 figures (H100 NVLink is in the same range; calibrate to be sure)."""
    return CPU_GLOO if device == "cpu" else H200_NVLINK_IB400


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


def load_machine(device: str = "cpu", path: Optional[str] = None) -> Machine:
    """The calibration at :func:`calibration_path` if it exists and was measured on
    ``device`` (exact name), else :func:`default_machine`. A file that is not a calibration
    raises ``ValueError`` naming it."""
    path = calibration_path(path)
    if not os.path.exists(path):
        return default_machine(device)
    try:
        with open(path) as f:
            data = json.load(f)
        machine = machine_from_dict(data["machine"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a usable sp_attention calibration ({e}); delete it or "
                         "re-run `python -m sp_attention.calibrate`") from e
    return machine if machine.device == device else default_machine(device)

"""Which machine figures a GPU can have: the checks ``python -m sp_attention.calibrate`` runs on
its own fits before it writes anything, and :func:`~.machine.load_machine` on a file it reads.

A fit that no GPU can produce (a rate above the device's peak, a negative or absurd latency,
a non-finite number) means the measurement went wrong (a busy machine, a probe that timed
nothing): the figures are refused with a message naming each one, never saved or used.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

__all__ = ["DevicePeak", "DEVICE_PEAKS", "UNKNOWN_PEAK", "device_peak", "check_figures",
           "implausible"]


@dataclass(frozen=True)
class DevicePeak:
    """A GPU's data-sheet peaks: dense bf16 tensor-core TFLOP/s, memory GB/s, and the GPU's
    link bandwidth per direction to its peers in GB/s (NVLink)."""

    tflops: float
    mem_gbps: float
    link_gbps: float


# First name found in the device string wins (so "GH200" before "H200", "H200" before "H20").
DEVICE_PEAKS: tuple[tuple[str, DevicePeak], ...] = (
    ("GH200", DevicePeak(989.0, 4900.0, 450.0)),
    ("H200", DevicePeak(989.0, 4800.0, 450.0)),
    ("H100", DevicePeak(989.0, 3350.0, 450.0)),
    ("H800", DevicePeak(989.0, 3350.0, 200.0)),
    ("A100", DevicePeak(312.0, 2039.0, 300.0)),
    ("B200", DevicePeak(2250.0, 8000.0, 900.0)),
)
# A device not in the table: bounds no GPU of this decade reaches.
UNKNOWN_PEAK = DevicePeak(5000.0, 20000.0, 2000.0)

_MAX_LATENCY_US = 10_000.0      # a link's latency or a small op's cost: 10 ms is absurd
_MAX_CALL_MS = 10.0             # a kernel call's fixed cost
_MAX_OVERLAP = 20.0             # ms the kernels lose per ms of transfer beside them
_MAX_RANK_FACTOR = 10.0         # a CP rank's kernel work ÷ the plain kernel's


def device_peak(device: str) -> DevicePeak:
    """The peaks of ``device`` (a ``torch.cuda.get_device_name``), :data:`UNKNOWN_PEAK` when
    the table does not know it."""
    name = device.upper()
    return next((p for key, p in DEVICE_PEAKS if key in name), UNKNOWN_PEAK)


def _bounded(out: list, what: str, value, low: float, high: float, unit: str,
             why_high: str, low_open: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        out.append(f"{what} = {value!r} is not a finite number")
    elif value < low or (low_open and value == low):
        out.append(f"{what} = {value:.4g}{unit} is {'not positive' if low_open else 'negative'}")
    elif value > high:
        out.append(f"{what} = {value:.4g}{unit} is above {why_high} ({high:.4g}{unit})")


def check_figures(kernels: Mapping, links: Mapping[str, Mapping], overlap_cost: float,
                  device: str) -> list[str]:
    """What is implausible in these figures for ``device`` (empty: nothing): ``kernels`` and
    ``links`` (``{"intra": …, "inter": …}``) by the field names of
    :class:`~.machine.Kernels` and :class:`~.machine.Link`."""
    peak, out = device_peak(device), []
    name = f"the {device}'s peak" if peak is not UNKNOWN_PEAK else "any GPU's peak"
    for f in ("linear_tflops", "softmax_fwd_tflops", "softmax_bwd_tflops"):
        _bounded(out, f"Kernels.{f}", kernels[f], 0.0, peak.tflops, " TFLOP/s", name, True)
    _bounded(out, "Kernels.mem_gbps", kernels["mem_gbps"], 0.0, peak.mem_gbps, " GB/s",
             f"{name} memory bandwidth", True)
    for f in ("linear_call_ms", "softmax_call_ms", "softmax_ag_call_fwd_ms",
              "softmax_ag_call_bwd_ms"):
        _bounded(out, f"Kernels.{f}", kernels.get(f, 0.0), 0.0, _MAX_CALL_MS, " ms",
                 "any kernel call's fixed cost")
    _bounded(out, "Kernels.op_us", kernels["op_us"], 0.0, _MAX_LATENCY_US, " µs",
             "any small op's cost")
    _bounded(out, "Kernels.linear_fwd_share", kernels["linear_fwd_share"], 0.0, 1.0, "",
             "1 (the forward faster than fwd + bwd)", True)
    if kernels["linear_fwd_share"] == 1.0:
        out.append("Kernels.linear_fwd_share = 1: fwd + bwd no slower than its forward")
    for f in ("linear_rank_contiguous", "linear_rank_zigzag", "softmax_ag_rate"):
        _bounded(out, f"Kernels.{f}", kernels.get(f, 1.0), 0.0, _MAX_RANK_FACTOR, "",
                 "any rank program's share", True)
    _bounded(out, "Kernels.softmax_bwd_workspace", kernels.get("softmax_bwd_workspace", 0.0),
             0.0, 1e3, " bytes per element", "any kernel's workspace")
    for which, link in links.items():
        for f in ("alpha_p2p_us", "alpha_coll_us", "step_us"):
            _bounded(out, f"Link({which}).{f}", link[f], 0.0, _MAX_LATENCY_US, " µs",
                     "any link's latency")
        for f in ("p2p_gbps", "coll_gbps"):
            _bounded(out, f"Link({which}).{f}", link[f], 0.0, peak.link_gbps, " GB/s",
                     f"{name} link bandwidth", True)
    _bounded(out, "Machine.overlap_cost", overlap_cost, 0.0, _MAX_OVERLAP, "",
             "any overlap cost")
    return out


def implausible(machine) -> list[str]:
    """:func:`check_figures` of a :class:`~.machine.Machine`."""
    return check_figures(vars(machine.kernels),
                         {"intra": vars(machine.intra), "inter": vars(machine.inter)},
                         machine.overlap_cost, machine.device)

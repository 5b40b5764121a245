"""Per-rank working memory of the schedules' own buffers (:func:`linear_memory`,
:func:`softmax_memory`) and a TP × CP × DP rank's total with a model-level estimate
(:func:`rank_memory`)."""
from __future__ import annotations

from typing import Mapping, Optional

from ..planning.layout import num_chunks
from ..planning.schedules import CHUNK, default_heads_k_stride
from .common import LinearShape, SoftmaxShape
from .machine import Machine


def linear_memory(shape: LinearShape, world: int, layout: str, schedule: str) -> dict:
    """Working memory (bytes) of one fwd + bwd of the linear op on a rank, inputs excluded.

    Kernel part (fla's backward, the peak): the output ``o`` the caller keeps, chunk states
    ``h`` and their gradients ``dh`` (fp32, ``[B, T/64, H, K, V]`` each) and ``dq, dk, dv``.
    CP part: ``S_in`` per leaf saved for backward, ``G`` per leaf, and the scan's temporaries
    (ring: two states; tree: one per leaf and two; all-gather: every rank's elements and the
    fold's weights), alive while the chunk states are recomputed, before ``dh`` exists.
    """
    s = shape
    n = num_chunks(world, layout) // world
    rows = s.B * s.T_local * s.H
    chunks = n * -(-(s.T_local // n) // CHUNK)
    states = s.B * chunks * s.H * s.K * s.V * 4
    state = s.state_bytes
    L = n * world
    scan = {"ring": 2 * state, "blelloch": (n + 2) * state,
            "allgather": (world * n + n) * state + n * L * s.B * s.H * 4}[schedule]
    out = {"o": rows * s.V * s.itemsize, "h": states, "dh": states,
           "dq_dk_dv": rows * (2 * s.K + s.V) * s.itemsize, "S_in": n * state, "G": n * state,
           "scan": scan}
    out["peak"] = max(out["o"] + out["h"] + out["S_in"] + scan,
                      sum(v for k, v in out.items() if k != "scan"))
    return out


def _call_bwd_bytes(s: SoftmaxShape, rows: int, keys: int, heads: int, machine: Machine) -> float:
    """One kernel backward over ``rows`` queries and ``keys`` keys of ``heads`` query heads:
    dq, dk, dv and the kernel's workspace (``Kernels.softmax_bwd_workspace`` bytes per query
    element, half of it counted per key element: fitted to cuDNN's peaks on an H200)."""
    kv_heads = heads * s.Hkv // s.H
    ws = machine.kernels.softmax_bwd_workspace / 2
    return s.B * (rows * heads * s.D * (s.itemsize + ws) + keys * heads * s.D * ws
                  + 2 * keys * kv_heads * s.D * s.itemsize)


def softmax_memory(shape: SoftmaxShape, world: int, layout: str, fwd: str, bwd: str,
                   machine: Machine, heads_k_stride: Optional[int] = None) -> dict:
    """Working memory (bytes) of one fwd + bwd on a rank: the larger of the forward's and
    the backward's peak, inputs and the saved ``out``/LSE excluded (the schedule's buffers:
    K/V ring slots, accumulators in flight, gathered strides, fp32 reduce-scatter slots)."""
    s = shape
    wide = 8 if s.itemsize == 8 else 4
    q_bytes = s.B * s.T_local * s.H * s.D * s.itemsize
    lse = s.B * s.H * s.T_local * wide
    out = {}
    if fwd == "ring":
        slots = min(2, world - 1) * s.kv_bytes
        acc = (q_bytes * wide / s.itemsize + lse) if world > 2 else 0
        out["fwd"] = slots + acc + q_bytes + lse
    else:        # out, LSE, send / receive buffers and the arrangement scratch
        stride = heads_k_stride or default_heads_k_stride(s.Hkv, s.H // s.Hkv)
        unit = 2 * s.B * s.T_local * stride * s.D * s.itemsize
        out["fwd"] = 2 * unit + 3 * world * unit + 2 * (q_bytes + lse)
    if bwd == "ring":
        slots = min(2, world - 1) * s.kv_bytes
        in_flight = 2 * s.kv_bytes * wide / s.itemsize if world > 2 else 0
        dq_acc = q_bytes * wide / s.itemsize if world > 2 else 0
        first = _call_bwd_bytes(s, s.T_local, s.T_local, s.H, machine)
        later = 0.0 if world == 1 else (
            q_bytes + dq_acc + s.kv_bytes + in_flight
            + _call_bwd_bytes(s, s.T_local, s.T_local // 2 if layout == "zigzag"
                              else s.T_local, s.H, machine))
        out["bwd"] = slots + max(first, later)
    else:
        # dq, the fp32 dK/dV sums, two send and two receive buffers of the widest unit, the
        # arrangement scratch, two fp32 reduce-scatter slots; then the unit's calls: each
        # keeps its dK/dV until the unit scatters them, and the kernel gets contiguous copies
        # of its strided head slices of q, dout and out
        stride = heads_k_stride or default_heads_k_stride(s.Hkv, s.H // s.Hkv)
        unit = 2 * s.B * s.T_local * stride * s.D                  # one rank's unit, elements
        heads = stride * s.H // s.Hkv
        per_chunk = s.T_local * world // num_chunks(world, layout)
        keys = s.T_local * world - per_chunk
        calls = num_chunks(world, layout) // world
        held = (q_bytes + s.kv_bytes * wide / s.itemsize + 2 * unit * s.itemsize
                + 3 * world * unit * s.itemsize + 2 * world * unit * wide)
        parts = 2 * s.B * (calls * keys) * stride * s.D * s.itemsize
        copies = 3 * s.B * per_chunk * heads * s.D * s.itemsize
        out["bwd"] = held + parts + copies + _call_bwd_bytes(s, per_chunk, keys, heads,
                                                             machine)
    out["peak"] = max(out["fwd"], out["bwd"])
    return out


def rank_memory(attention_bytes: float, model=None) -> dict:
    """Per-rank total of a TP × CP × DP layout: the attention schedule's working memory (per
    layer, from :func:`linear_memory` / :func:`softmax_memory` with the rank's shapes: heads
    ÷ TP, tokens ÷ CP, micro-batch; layers run one at a time) with the model-level estimate
    ``model``: an :class:`sp_train.memory.MemoryEstimate` (weights, gradients, optimizer
    states, activations by recompute setting, loss, and ``workspace``, the largest transient
    of one layer's backward), a mapping with ``total`` (and optionally ``workspace``), or a
    number of bytes. The schedule's buffers are such a transient too, so the peak takes the
    larger of the two rather than their sum. Returns ``{"attention", "model", "total"}``."""
    if model is None:
        total, workspace = 0.0, 0.0
    elif isinstance(model, (int, float)):
        total, workspace = float(model), 0.0
    elif isinstance(model, Mapping):
        total, workspace = float(model["total"]), float(model.get("workspace", 0.0))
    else:
        total, workspace = float(model.total), float(getattr(model, "workspace", 0.0))
    attention = float(attention_bytes)
    return {"attention": attention, "model": total,
            "total": total - workspace + max(workspace, attention)}

"""From probe rows to a :class:`~.machine.Machine`: the fits ``python -m sp_attention.calibrate``
runs on what it measured, and the checks it runs on them before it writes anything. Pure
functions of the rows (tested on synthetic rows without a GPU).

Row kinds (the ``what`` field): ``p2p`` and ``all_gather`` (one per size and group size:
``world``, ``bytes_moved``, ``ms``), ``linear`` and ``softmax`` (one kernel per size: ``ms_fwd``,
``ms_fwd_bwd``, FLOPs, peak bytes), ``memory`` (element-wise bandwidth), ``softmax_ring`` (a
softmax ``ring`` step across the group: what the overlap cost is fitted to), ``linear_step``
(a linear CP step per layout: what a CP rank's kernel factors are fitted to).
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Optional, Sequence

from ..planning.schedules import PRESETS
from .common import LinearShape, SoftmaxShape, Topology
from .linear import linear_step, rank_factor
from .machine import Kernels, Link, Machine
from .plausible import check_figures
from .softmax import softmax_step

__all__ = ["fit_latency_rate", "fit_link", "fit_kernels", "fit_overlap", "fit_rank_factors",
           "check_rows", "fit_machine"]

# A fitted latency below zero by at most this share of the smallest measured time is noise:
# it is taken as 0 and the rest refitted. Further below zero, the fit is refused.
NOISE = 0.05


def _wls(X: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """Least squares in *relative* error (each point weighs 1 / y²: a small message's latency
    counts as much as a large one's bandwidth); Gaussian elimination on the normal equations
    (a handful of unknowns)."""
    n = len(X[0])
    A = [[0.0] * (n + 1) for _ in range(n)]
    for row, m in zip(X, y):
        w = 1.0 / (m * m)
        for i in range(n):
            for j in range(n):
                A[i][j] += w * row[i] * row[j]
            A[i][n] += w * row[i] * m
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(A[r][c]))
        A[c], A[p] = A[p], A[c]
        if A[c][c] == 0:
            raise ValueError("the probe's points do not determine the fit (all sizes equal?)")
        for r in range(n):
            if r != c:
                f = A[r][c] / A[c][c]
                A[r] = [a - f * b for a, b in zip(A[r], A[c])]
    return [A[i][n] / A[i][i] for i in range(n)]


def _fit(X: list[list[float]], y: list[float], latencies: Sequence[int]) -> list[float]:
    """:func:`_wls` whose latency coefficients (indices ``latencies``) are set to 0 where they
    come out negative within :data:`NOISE` (the others refitted without them)."""
    keep = list(range(len(X[0])))
    while True:
        coef = _wls([[r[i] for i in keep] for r in X], y)
        full = dict(zip(keep, coef))
        noise = [i for i in keep if i in latencies and full[i] < 0
                 and -full[i] * max(abs(r[i]) for r in X) <= NOISE * min(y)]
        if not noise or len(keep) == 1:
            return [full.get(i, 0.0) for i in range(len(X[0]))]
        keep.remove(noise[0])


def fit_latency_rate(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Fit ``ms = a + x·b`` to ``(x, ms)`` points in relative error; returns ``(a, b)``
    unclamped (a negative latency beyond the noise, or ``b <= 0``, is for the checks to
    refuse)."""
    if len(points) < 2:
        raise ValueError(f"fit_latency_rate needs >= 2 points, got {len(points)}")
    a, b = _fit([[1.0, float(x)] for x, _ in points], [float(m) for _, m in points], (0,))
    return a, b


def _rate(per_unit: float, scale: float) -> float:
    """A rate from a fitted time per unit (``inf`` where the fit says no time at all)."""
    return scale / per_unit if per_unit else math.inf


def fit_link(rows: Sequence[dict], base: Link) -> dict:
    """:class:`~.machine.Link` fields from ``p2p`` and ``all_gather`` rows of one or more
    group sizes: p2p α and β from the bytes of one hop; the collective's ``α + (P − 2)·step +
    bytes/β`` from the bytes each rank receives (``step_us`` kept from ``base`` when one group
    size was probed)."""
    p2p = [(r["bytes_moved"], r["ms"]) for r in rows if r["what"] == "p2p"]
    coll = [r for r in rows if r["what"] == "all_gather"]
    a, b = fit_latency_rate(p2p)
    out = dict(alpha_p2p_us=a * 1e3, p2p_gbps=_rate(b, 1e-6), step_us=base.step_us)
    if len({r["world"] for r in coll}) > 1:
        c = _fit([[1.0, r["world"] - 2.0, float(r["bytes_moved"])] for r in coll],
                 [float(r["ms"]) for r in coll], (0, 1))
        out.update(alpha_coll_us=c[0] * 1e3, step_us=c[1] * 1e3, coll_gbps=_rate(c[2], 1e-6))
    else:
        a, b = fit_latency_rate([(r["bytes_moved"], r["ms"]) for r in coll])
        out.update(alpha_coll_us=a * 1e3, coll_gbps=_rate(b, 1e-6))
    return out


def fit_kernels(rows: Sequence[dict], base: Kernels) -> dict:
    """:class:`~.machine.Kernels` fields that ``linear``, ``softmax`` and ``memory`` rows imply
    (the others kept from ``base``): the linear fwd + bwd's fixed time and rate and the
    forward's share; the attention call's fixed time and forward rate, the backward's rate;
    the backward's workspace from the largest call's peak; element-wise bandwidth."""
    lin = [r for r in rows if r["what"] == "linear"]
    soft = [r for r in rows if r["what"] == "softmax"]
    mem = [r for r in rows if r["what"] == "memory"]
    kw = dataclasses.asdict(base)
    if lin:
        call, per = fit_latency_rate([(r["flops_fwd_bwd"], r["ms_fwd_bwd"]) for r in lin])
        kw.update(linear_call_ms=call, linear_tflops=_rate(per, 1e-9),
                  linear_fwd_share=statistics.median(r["ms_fwd"] / r["ms_fwd_bwd"] for r in lin))
    if soft:
        call, per_f = fit_latency_rate([(r["flops_fwd"], r["ms_fwd"]) for r in soft])
        _, per_b = fit_latency_rate([(2.5 * r["flops_fwd"], r["ms_fwd_bwd"] - r["ms_fwd"])
                                     for r in soft])
        kw.update(softmax_call_ms=call, softmax_fwd_tflops=_rate(per_f, 1e-9),
                  softmax_bwd_tflops=_rate(per_b, 1e-9))
        big = max(soft, key=lambda r: r["T"])
        if big.get("peak_bytes"):
            it = 2 if big["dtype"] in ("bfloat16", "float16") else 4
            elems = big["B"] * big["T"] * big["H"] * big["D"]
            kv = 2 * big["B"] * big["T"] * big["Hkv"] * big["D"] * it
            lse = big["B"] * big["H"] * big["T"] * 4
            kw["softmax_bwd_workspace"] = max(
                (big["peak_bytes"] - 2 * elems * it - kv - lse) / elems, 0.0)
    if mem:
        kw.update(mem_gbps=mem[0]["bytes_moved"] / mem[0]["ms"] * 1e-6,
                  op_us=mem[0]["op_ms"] * 1e3)
    return kw


def _ring_shape(row: dict) -> SoftmaxShape:
    return SoftmaxShape(row["B"], row["T_local"], row["H"], row["Hkv"], row["D"],
                        row.get("itemsize", 2))


def _solve(at, meas: float, low: float, high: float) -> float:
    """The ``x`` in ``[low, high]`` at which the non-decreasing ``at(x)`` equals ``meas``
    (bisection); ``low`` / ``high`` where ``meas`` lies beyond ``at`` of them."""
    if meas <= at(low):
        return low
    if meas >= at(high):
        return high
    lo, hi = low, high
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if at(mid) < meas else (lo, mid)
    return (lo + hi) / 2


def fit_overlap(row: dict, machine: Machine, high: float = 40.0) -> float:
    """``Machine.overlap_cost`` at which the model's ``ring`` step (fwd + bwd, zigzag, one
    node) equals the measured one in ``row`` (``softmax_ring``): 0 where the model without it
    is already as slow; ``high`` (refused by the checks) where no value up to it explains the
    step."""
    shape, P = _ring_shape(row), row["world"]

    def at(x: float) -> float:
        m = dataclasses.replace(machine, overlap_cost=x)
        return softmax_step(shape, P, "zigzag", *PRESETS["ring"], m,
                            Topology.single_node(P)).total_ms
    return _solve(at, row["ms_fwd_bwd"], 0.0, high)


def fit_rank_factors(rows: Sequence[dict], machine: Machine, high: float = 40.0) -> dict:
    """``Kernels.linear_rank_*`` at which the model's linear step (fwd + bwd, one node, the
    row's scan) equals each ``linear_step`` row (the median per factor: one row or several
    per rank, :func:`sp_attention.cost.linear.rank_factor`); ``high``
    (refused by the checks) where no factor up to it explains the step."""
    got: dict = {}
    for r in rows:
        shape = LinearShape(r["B"], r["T_local"], r["H"], r["K"], r["V"], r.get("itemsize", 2))
        field = rank_factor(shape, r["world"], r["layout"], machine.kernels.sms,
                            r.get("row_splits"))

        def at(x: float, r=r, shape=shape, field=field) -> float:
            m = dataclasses.replace(machine, kernels=dataclasses.replace(machine.kernels,
                                                                         **{field: x}))
            return linear_step(shape, r["world"], r["layout"], r["scan"], m,
                               Topology.single_node(r["world"]), r.get("row_splits")).total_ms
        got.setdefault(field, []).append(_solve(at, r["ms_fwd_bwd"], 0.0, high))
    return {f: statistics.median(v) for f, v in got.items()}


def check_rows(rows: Sequence[dict]) -> list[str]:
    """What is implausible in the measured rows themselves: a time that is not a positive
    finite number, a fwd + bwd no slower than its forward."""
    out = []
    for r in rows:
        what = " ".join([r["what"]] + [f"{k}={r[k]}" for k in ("world", "T", "T_local", "bytes")
                                       if k in r])
        for f in ("ms", "ms_fwd", "ms_fwd_bwd", "op_ms"):
            v = r.get(f)
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v)
                                      and v > 0):
                out.append(f"{what}: {f} = {v!r} is not a positive time")
        f, fb = r.get("ms_fwd"), r.get("ms_fwd_bwd")
        if isinstance(f, (int, float)) and isinstance(fb, (int, float)) and 0 < fb <= f:
            out.append(f"{what}: fwd + bwd {fb:.4g} ms is no slower than its forward "
                       f"{f:.4g} ms")
    return out


def fit_machine(base: Machine, device: str, link_rows: Sequence[dict],
                kernel_rows: Sequence[dict], step_rows: Sequence[dict] = (),
                source: str = "") -> tuple[Optional[Machine], list[str]]:
    """The machine the rows describe on top of ``base`` (what they do not inform: the
    inter-node link, the all-gather calls' overheads; without several ranks also the
    intra-node link, the overlap cost and a CP rank's kernel factors), and what is implausible
    about it: ``(machine, [])``, or ``(None, problems)`` (nothing fitted is usable then).
    ``step_rows``: ``softmax_ring`` and ``linear_step`` rows (the overlap cost is fitted
    first, then the linear factors with it)."""
    problems = check_rows(list(link_rows) + list(kernel_rows) + list(step_rows))
    if problems:
        return None, problems
    try:
        kernels = fit_kernels(kernel_rows, base.kernels)
        link = fit_link(link_rows, base.intra) if link_rows else dataclasses.asdict(base.intra)
    except (ValueError, ZeroDivisionError) as e:
        return None, [f"the fit failed: {e}"]
    problems = check_figures(kernels, {"intra": link}, base.overlap_cost, device)
    if problems:
        return None, problems
    machine = dataclasses.replace(base, name=f"calibrated {device}", device=device,
                                  kernels=Kernels(**kernels), intra=Link(**link),
                                  source=source or base.source)
    ring = [r for r in step_rows if r["what"] == "softmax_ring"]
    if ring:
        cost = statistics.median(fit_overlap(r, machine) for r in ring)
        problems = check_figures(kernels, {"intra": link}, cost, device)
        if problems:
            return None, problems
        machine = dataclasses.replace(machine, overlap_cost=cost)
    factors = fit_rank_factors([r for r in step_rows if r["what"] == "linear_step"], machine)
    if factors:
        kernels.update(factors)
        problems = check_figures(kernels, {"intra": link}, machine.overlap_cost, device)
        if problems:
            return None, problems
        machine = dataclasses.replace(machine, kernels=Kernels(**kernels))
    return machine, []

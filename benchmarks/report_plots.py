"""The plots of ``benchmarks/report.py`` (matplotlib, written as PNG): predicted vs measured
step times, throughput and ratio to the single-GPU kernel per schedule vs tokens per rank (the
2 × H200 runs and the model's curves), and the projected CP efficiency for P = 2…1024."""
from __future__ import annotations

from collections import defaultdict

from sp_attention.cost import (LINEAR_SCANS, SOFTMAX_PRESETS, LinearShape, SoftmaxShape,
                               linear_step, softmax_step)

TOLERANCE = 0.20
PRESET_OF = {f"{f}/{b}": name for name, (f, b) in SOFTMAX_PRESETS.items()}


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _measured_series(rows):
    """{(kind, layout, schedule): [(T_local, per-GPU throughput, ratio)]} of the 2-GPU runs."""
    out = defaultdict(list)
    fla = {(r["_file"], r["T_local"], r["timing"]): r["ms_fwd_bwd"] for r in rows
           if r.get("bench") == "linear_cp" and r.get("impl") == "fla_chunk_simple_gla"}
    for r in rows:
        if r.get("world") != 2 or "ms_fwd_bwd" not in r:
            continue
        bench, impl = r.get("bench"), r.get("impl")
        if bench == "linear_cp" and r.get("timing") == "queued" and impl in LINEAR_SCANS:
            base = fla.get((r["_file"], r["T_local"], "queued"))
            out[("linear", r["layout"], r["impl"])].append(
                (r["T_local"], r["T_local"] / r["ms_fwd_bwd"] / 1e3,
                 base / r["ms_fwd_bwd"] if base else None))
        elif bench == "softmax_cp" and impl in PRESET_OF and r.get("stride") == "default":
            out[("softmax", "zigzag", PRESET_OF[r["impl"]])].append(
                (r["T_local"], r["tflops_per_gpu"], r.get("ratio_vs_t_local")))
    return out


def _predicted_curve(kind, layout, sched, Ts, machine):
    """[(T_local, per-GPU throughput, ratio to the 1-GPU kernel on T_local)] at P = 2."""
    m, out = machine, []
    for T in Ts:
        if kind == "linear":
            t = linear_step(LinearShape(1, T, 16, 128, 128), 2, layout, sched, m)
            one = linear_step(LinearShape(1, T, 16, 128, 128), 1, "contiguous", sched, m)
            out.append((T, T / t.total_ms / 1e3, one.total_ms / t.total_ms))
        else:
            sh = SoftmaxShape(1, T, 32, 8, 128)
            t = softmax_step(sh, 2, "zigzag", *SOFTMAX_PRESETS[sched], m)
            one = softmax_step(sh, 1, "zigzag", "ring", "ring", m)
            per_gpu = 3.5 * 4 * 32 * 128 * (2 * T) ** 2 * 0.5 / 2
            one_gpu = 3.5 * 4 * 32 * 128 * T * T * 0.5
            tp, tp1 = per_gpu / t.total_ms / 1e9, one_gpu / one.total_ms / 1e9
            out.append((T, tp, tp / tp1))
    return out


def plot_measured(rows, path_tp, path_ratio, machine) -> None:
    """Throughput (and ratio to the 1-GPU kernel) vs tokens per rank per schedule: the
    2 × H200 measurements (points) and the model (dashed)."""
    plt = _plt()
    series = _measured_series(rows)
    Ts = [2 ** k for k in range(11, 17)]
    for path, col, ylab in ((path_tp, 1, ("Mtokens/s per GPU", "TFLOP/s per GPU")),
                            (path_ratio, 2, ("÷ 1-GPU fla on T_local",
                                             "÷ 1-GPU cuDNN on T_local"))):
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for ax, kind, yl in zip(axes, ("linear", "softmax"), ylab):
            keys = sorted(k for k in series if k[0] == kind)
            for i, key in enumerate(keys):
                pts = sorted(p for p in series[key] if p[col] is not None)
                label = f"{key[2]}" + ("" if kind == "softmax" else f" {key[1]}")
                ax.plot([p[0] for p in pts], [p[col] for p in pts], "o", color=f"C{i}",
                        label=f"{label} measured")
                curve = _predicted_curve(kind, key[1], key[2], Ts, machine)
                ax.plot([c[0] for c in curve], [c[col] for c in curve], "--", color=f"C{i}",
                        alpha=0.7, label=f"{label} model")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tokens per rank (T_local)")
            ax.set_ylabel(yl)
            ax.set_title(f"{kind}, CP = 2 on 2 x H200, 2026-11-23"
                         + (" (queued timing)" if kind == "linear" else ""))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def plot_pred_vs_meas(points, path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 6))
    kinds = sorted({p["source"].split(" ")[0] for p in points})
    for i, k in enumerate(kinds):
        ps = [p for p in points if p["source"].split(" ")[0] == k]
        ax.plot([p["measured"] for p in ps], [p["predicted"] for p in ps], "o", ms=4,
                color=f"C{i}", label=f"{k} ({len(ps)})", alpha=0.8)
    lo = min(min(p["measured"], p["predicted"]) for p in points) * 0.7
    hi = max(max(p["measured"], p["predicted"]) for p in points) * 1.4
    for f, style in ((1.0, "-"), (1 + TOLERANCE, ":"), (1 - TOLERANCE, ":")):
        ax.plot([lo, hi], [lo * f, hi * f], style, color="gray")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured fwd+bwd (ms)")
    ax.set_ylabel("predicted fwd+bwd (ms)")
    ax.set_title("cost model: predicted vs measured (dotted: ±20 %)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_projection(proj, path) -> None:
    plt = _plt()
    Ts = sorted({r["T_local"] for r in proj})
    fig, axes = plt.subplots(2, len(Ts), figsize=(5 * len(Ts), 8), squeeze=False)
    for j, T in enumerate(Ts):
        for i, (kind, layout) in enumerate((("linear", "zigzag"), ("softmax", "zigzag"))):
            ax = axes[i][j]
            rs = sorted((r for r in proj if r["kind"] == kind and r["layout"] == layout
                         and r["T_local"] == T), key=lambda r: r["P"])
            names = LINEAR_SCANS if kind == "linear" else tuple(SOFTMAX_PRESETS)
            for k, n in enumerate(names):
                pts = [(r["P"], r["eff"][n]) for r in rs if n in r["eff"]]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=3, color=f"C{k}",
                        label=n)
            ax.axvline(8.5, color="gray", ls=":", lw=1)
            ax.set_xscale("log", base=2)
            ax.set_ylim(0, 1.05)
            ax.set_xlabel("CP size P (8 GPUs per node; dotted: node edge)")
            ax.set_ylabel("CP efficiency (kernel time ÷ step)")
            ax.set_title(f"{kind} {layout}, T_local {T // 1024}K")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

"""The cost model against measured CP steps: the prediction error of every row and whether
``auto``'s pick is within 5 % of the best measured schedule.

    python benchmarks/report.py ROWS.jsonl ... [--calibration calibration.json]

Reads the JSON lines of ``benchmarks/linear_cp.py`` and ``benchmarks/softmax_cp.py`` (``bench,
world, T_local, impl, layout, timing, ms_fwd_bwd, device`` and the shapes) at any P, predicts
every CP row from the calibration (``--calibration``: a file ``python -m
sp_attention.calibrate`` wrote; rows of another device, and all rows without it, take the
built-in figures of :func:`sp_attention.cost.default_machine`) and prints, per row, measured
and predicted fwd + bwd and the error; per configuration (bench, device, P, T_local, layout,
shape), the best measured schedule, the one ``auto`` runs there, and how much slower that one
measured. Acceptance: every error within ±20 %, every pick within 5 % of the best. CPU rows
are skipped (no CPU model: ``auto`` follows a fixed rule there).

The same goes, with a projection of ``auto``'s picks to P = 2…1024 on 8-GPU nodes, to
``--out-dir/cost_report.md`` (default ``benchmarks/reports/``, git-ignored: a report is
generated, never committed). ``--strict`` exits 1 when the acceptance fails.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sp_attention.cost import (LinearShape, SoftmaxShape, Topology,  # noqa: E402
                               choose_linear_scan, choose_softmax_preset, cp_efficiency,
                               default_machine, linear_step, load_machine, softmax_step)
from sp_attention.cost.softmax import MODELLED  # noqa: E402
from sp_attention.cost.softmax_a2a import A2A_PRESETS, a2a_step  # noqa: E402
from sp_attention.planning.softmax_a2a import head_chunks  # noqa: E402
from sp_attention.planning.schedules import DEFAULT_PRESET, LINEAR_SCANS, PRESETS  # noqa: E402

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reports")
ERROR_TOLERANCE = 0.20
PICK_TOLERANCE = 0.05
PRESET_OF = {f"{f}/{b}": name for name, (f, b) in PRESETS.items() if name not in A2A_PRESETS}
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}
PROJECTION_P = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
PROJECTION_T = (2048, 8192, 32768)
ATTN_MEMORY_BUDGET = 16 * 2 ** 30


def load(paths) -> list[dict]:
    return [json.loads(line) for p in paths for line in open(p) if line.strip()]


def _schedule(r: dict):
    """(kind, schedule name, layout, shape) of a CP row the model predicts, or None."""
    if r.get("error") or "ms_fwd_bwd" not in r or r.get("cuda_graph"):
        return None
    if r.get("comm", "default") != "default" or r.get("device", "cpu") == "cpu":
        return None
    size = _ITEMSIZE.get(r.get("dtype", "bfloat16"), 2)
    if r.get("bench") == "linear_cp" and r.get("impl") in LINEAR_SCANS \
            and r.get("decay", "fixed") == "fixed" and not r.get("packed"):
        return ("linear", r["impl"], r["layout"],
                LinearShape(r["B"], r["T_local"], r["H"], r["K"], r["V"], size))
    impl = r.get("impl", "")
    if r.get("bench") == "softmax_cp" and (impl == "a2a" or impl.startswith("a2a C=")):
        # head chunks: the row's (rows before 2026-11-27 ran one chunk: all there was)
        chunks = int(impl.partition("C=")[2]) if "C=" in impl else r.get("a2a_chunks", 1)
        return ("softmax", f"a2a C={chunks}", r.get("layout", "zigzag"),
                SoftmaxShape(r["B"], r["T_local"], r["H"], r["Hkv"], r["K"], size,
                             bool(r.get("causal", True))))
    if r.get("bench") == "softmax_cp" and impl.startswith("a2a_ring U="):   # a2a_ring U=size
        return ("softmax", impl.replace(" ", ""), r.get("layout", "zigzag"),
                SoftmaxShape(r["B"], r["T_local"], r["H"], r["Hkv"], r["K"], size,
                             bool(r.get("causal", True))))
    if r.get("bench") == "softmax_cp" and r.get("impl") in PRESET_OF \
            and r.get("stride", "default") == "default" \
            and all(x in MODELLED for x in PRESETS[PRESET_OF[r["impl"]]]):
        return ("softmax", PRESET_OF[r["impl"]], r.get("layout", "zigzag"),
                SoftmaxShape(r["B"], r["T_local"], r["H"], r["Hkv"], r["K"], size,
                             bool(r.get("causal", True))))
    return None


def machine_for(device: str, calibration) -> object:
    """The calibration when it was measured on ``device``, else the built-in figures."""
    return calibration if calibration is not None and calibration.device == device \
        else default_machine(device)


def predict(kind: str, name: str, layout: str, shape, world: int, machine):
    """The model's step of schedule ``name`` (``a2a_ringU=u``: a2a_ring with groups of u;
    ``a2a C=c``: a2a in c head chunks)."""
    topo = Topology.single_node(world)
    if kind == "linear":
        return linear_step(shape, world, layout, name, machine, topo)
    if name.startswith("a2a C="):
        return a2a_step(shape, world, layout, machine, topo, world,
                        int(name.partition("C=")[2]))
    if name == "a2a" or name.startswith("a2a_ring"):
        size = world if name == "a2a" else int(name.partition("U=")[2])
        return a2a_step(shape, world, layout, machine, topo, size)
    return softmax_step(shape, world, layout, *PRESETS[name], machine, topo)


def accumulated_grads_ms(r: dict, kind: str, shape, machine) -> float:
    """What a linear row measured beyond the op: rows without ``grads: autograd.grad``
    (``linear_cp.py`` before 2026-11-26 evening) ran ``o.backward(do)`` on leaf q, k, v, so
    each step also added dq, dk, dv into their ``.grad`` (read two, write one, on both the op
    and its baseline): the model predicts the op, plus that element-wise work here."""
    if kind != "linear" or r.get("grads") == "autograd.grad":
        return 0.0
    elems = shape.B * shape.T_local * shape.H * (2 * shape.K + shape.V)
    return 3 * elems * shape.itemsize / (machine.kernels.mem_gbps * 1e9) * 1e3


def auto_pick(kind: str, layout: str, shape, world: int, machine,
              a2a_size=None) -> str:
    """What ``auto`` runs: one rank, nothing crosses (linear ``ring``, the default preset);
    otherwise the model's cheapest (softmax: ``a2a_ring`` considered with ``a2a_size``, as the
    benchmark's ``auto`` row passes it)."""
    if kind == "linear":
        return "ring" if world == 1 else choose_linear_scan(
            shape, world, layout, machine, Topology.single_node(world)).name
    if world == 1:
        return DEFAULT_PRESET
    name = choose_softmax_preset(shape, world, layout, machine, Topology.single_node(world),
                                 a2a_size=a2a_size).name
    if name == "a2a":                   # in the default head chunks
        return f"a2a C={head_chunks(shape.H, shape.Hkv, world, None)}"
    return f"a2a_ringU={a2a_size}" if name == "a2a_ring" else name


def points(rows, calibration=None, timing: str = "queued") -> list[dict]:
    """One point per predicted row (rows of another timing mode skipped; a row without the
    field counts as ``timing``)."""
    out = []
    for r in rows:
        got = _schedule(r)
        if got is None or r.get("timing", timing) != timing:
            continue
        kind, name, layout, shape = got
        m = machine_for(r["device"], calibration)
        pred = predict(kind, name, layout, shape, r["world"], m).total_ms \
            + accumulated_grads_ms(r, kind, shape, m)
        out.append(dict(kind=kind, schedule=name, layout=layout, shape=shape,
                        world=r["world"], device=r["device"], measured=r["ms_fwd_bwd"],
                        predicted=pred, error=pred / r["ms_fwd_bwd"] - 1.0))
    return out


def auto_checks(pts, calibration=None) -> list[dict]:
    """Per configuration measured with two or more schedules: the best measured, ``auto``'s
    pick and how much slower the pick measured (None: the pick was not measured)."""
    groups = defaultdict(dict)
    for p in pts:
        key = (p["kind"], p["device"], p["world"], p["layout"], p["shape"])
        groups[key][p["schedule"]] = min(p["measured"], groups[key].get(p["schedule"], 1e300))
    out = []
    for (kind, device, world, layout, shape), meas in groups.items():
        if len(meas) < 2:
            continue
        best = min(meas, key=meas.get)
        sizes = sorted(int(n.partition("U=")[2]) for n in meas if n.startswith("a2a_ring"))
        pick = auto_pick(kind, layout, shape, world, machine_for(device, calibration),
                         sizes[0] if sizes else None)
        slower = meas[pick] / meas[best] - 1.0 if pick in meas else None
        out.append(dict(kind=kind, device=device, world=world, layout=layout,
                        T_local=shape.T_local, best=best, pick=pick, slower=slower,
                        ok=slower is not None and slower <= PICK_TOLERANCE, n=len(meas)))
    return sorted(out, key=lambda c: (c["kind"], c["world"], c["T_local"], c["layout"]))


def _table(header, rows) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def _pct(x) -> str:
    return "not measured" if x is None else f"{x * 100:+.1f} %"


def summary(pts, checks) -> list[str]:
    within = sum(abs(p["error"]) <= ERROR_TOLERANCE for p in pts)
    ok = sum(c["ok"] for c in checks)
    worst = max((abs(p["error"]) for p in pts), default=0.0)
    passed = within == len(pts) and ok == len(checks) and bool(pts)
    return [f"predictions: {within}/{len(pts)} rows within ±{ERROR_TOLERANCE:.0%} (worst "
            f"{worst:.1%}); auto: {ok}/{len(checks)} configurations within "
            f"{PICK_TOLERANCE:.0%} of the best measured schedule",
            f"acceptance: {'PASS' if passed else 'FAIL'}"]


def tables(pts, checks) -> list[str]:
    rows = [(p["kind"], p["device"], p["world"], p["shape"].T_local, p["layout"], p["schedule"],
             f"{p['measured']:.4g}", f"{p['predicted']:.4g}", _pct(p["error"]))
            for p in sorted(pts, key=lambda p: (p["kind"], p["world"], p["shape"].T_local,
                                                p["layout"], p["schedule"]))]
    out = ["## Predicted vs measured fwd + bwd (ms)", ""]
    out += _table(["kind", "device", "P", "T_local", "layout", "schedule", "measured",
                   "predicted", "error"], rows)
    out += ["", "## `auto` against the best measured schedule", ""]
    out += _table(["kind", "device", "P", "T_local", "layout", "measured best", "auto",
                   "auto slower by", "within 5 %"],
                  [(c["kind"], c["device"], c["world"], c["T_local"], c["layout"], c["best"],
                    c["pick"], _pct(c["slower"]), "yes" if c["ok"] else "NO") for c in checks])
    return out


def projection(machine, Ps=PROJECTION_P, Ts=PROJECTION_T) -> list[str]:
    """``auto``'s pick and its CP efficiency (kernel time ÷ step) for P = 2…1024, CP ranks
    filling 8-GPU nodes in order: linear (H 16, K = V 128) both layouts, Llama-3-8B softmax
    attention zigzag; softmax presets whose buffers exceed 16 GiB per rank excluded."""
    out = ["## Projection: auto's pick (CP efficiency), 8 GPUs per node", ""]
    body = []
    for T in Ts:
        for P in Ps:
            topo = Topology.packed(P, machine.gpus_per_node)
            cells = [P, T]
            for layout in ("contiguous", "zigzag"):
                c = choose_linear_scan(LinearShape(1, T, 16, 128, 128), P, layout, machine, topo)
                cells.append(f"{c.name} ({cp_efficiency(c.predicted[c.name]):.2f})")
            c = choose_softmax_preset(SoftmaxShape(1, T, 32, 8, 128), P, "zigzag", machine,
                                      topo, memory_limit_bytes=ATTN_MEMORY_BUDGET)
            cells.append(f"{c.name} ({cp_efficiency(c.predicted[c.name]):.2f})")
            body.append(cells)
    return out + _table(["P", "T_local", "linear contiguous", "linear zigzag",
                         "softmax zigzag"], body)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", help="JSON lines of linear_cp.py / softmax_cp.py")
    p.add_argument("--calibration", help="a calibration JSON of python -m sp_attention.calibrate")
    p.add_argument("--timing", default="queued", choices=["queued", "eager"],
                   help="which rows to check (the model predicts the GPU's own time: queued)")
    p.add_argument("--out-dir", default=OUT_DIR)
    p.add_argument("--no-projection", action="store_true")
    p.add_argument("--strict", action="store_true", help="exit 1 when the acceptance fails")
    a = p.parse_args(argv)
    calibration = None
    if a.calibration:
        with open(a.calibration) as f:
            device = json.load(f)["machine"]["device"]
        calibration = load_machine(device, a.calibration)
    rows = load(a.files)
    pts = points(rows, calibration, a.timing)
    checks = auto_checks(pts, calibration)
    cpu = sum(r.get("device") == "cpu" for r in rows)
    head = ([f"{cpu} CPU rows skipped (no CPU model: auto follows a fixed rule there)"]
            if cpu else []) + summary(pts, checks)
    body = tables(pts, checks)
    print("\n".join(body + [""] + head))
    machine = calibration or default_machine("NVIDIA H200")
    files = ", ".join(f"`{os.path.basename(x)}`" for x in a.files)
    md = ["# Cost model report", "",
          f"Generated by `python benchmarks/report.py` from {files}; machine: {machine.name} "
          f"({machine.source}).", ""] + head + [""] + body
    if not a.no_projection:
        md += [""] + projection(machine)
    os.makedirs(a.out_dir, exist_ok=True)
    path = os.path.join(a.out_dir, "cost_report.md")
    with open(path, "w") as f:
        f.write("\n".join(md) + "\n")
    print(f"wrote {path}")
    if a.strict and head[-1].endswith("FAIL"):
        raise SystemExit(1)
    return dict(points=pts, checks=checks, summary=head, path=path)


if __name__ == "__main__":
    main()

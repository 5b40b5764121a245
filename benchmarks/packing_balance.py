"""Benchmark (CPU, no GPU): how evenly a packed row's causal attention work spreads over the CP
ranks, and what it costs in padding and cuts, for three ways to lay documents out:

* ``zigzag`` — this library's balanced plan (:func:`sp_attention.plan_packing`): short
  documents whole, the fewest long ones cut in zigzag pieces over as many ranks as they need.
* ``te_2p`` — TransformerEngine's THD split: every document padded to a multiple of ``2P``
  and cut into ``2P`` pieces, rank ``r`` holding pieces ``r`` and ``2P−1−r`` of each.
* ``contiguous`` — the row cut into ``P`` equal pieces (this library's ``contiguous`` plan).

Rows: ``lognormal`` (document lengths log-normal, median 1K tokens, σ 1.25, truncated at the
row's end: a tail up to the whole row), ``one_doc`` (one document per row), ``tiny32``
(thousands of 32-token documents); row lengths 32K … 512K; P = 2, 4, 8, 16. Per (draw, T, P,
layout) one JSON line; the columns:

* ``imbalance``: max ÷ mean per-rank causal attention work (visible query–key pairs; FLOPs ∝).
* ``padding``: padding tokens ÷ all tokens the ranks hold.
* ``scan_elems``: max over ranks of its segments of crossing documents (one linear-attention
  scan element each); ``per_cut``: max over ranks of those ÷ the cuts inside documents at
  the rank's own tokens: ≤ 2 means cross-rank traffic
  grows with cuts, not documents; ``cuts``: cuts inside documents in the whole row (where a
  document passes from one rank to the next).
* ``plan_ms``: time to build the plan (host, this machine).

    python benchmarks/packing_balance.py --out results.jsonl --table results.md
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from datetime import date

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sp_attention.planning.packing import causal_work, plan_packing  # noqa: E402

LAYOUTS = ("zigzag", "te_2p", "contiguous")


def draw(kind: str, T: int, rng: random.Random) -> list[int]:
    """Document lengths of one row of ``T`` tokens."""
    if kind == "one_doc":
        return [T]
    if kind == "tiny32":
        return [32] * (T // 32) + ([T % 32] if T % 32 else [])
    out, tot = [], 0
    while tot < T:
        n = max(1, min(T - tot, int(rng.lognormvariate(math.log(1024), 1.25))))
        out.append(n)
        tot += n
    return out


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def te_segments(lengths: list[int], P: int) -> list[list[tuple[int, int, int, bool]]]:
    """TE's THD split: per rank ``(doc, offset, real_tokens, crossing)``, the padded pieces."""
    out: list[list] = [[] for _ in range(P)]
    for d, n in enumerate(lengths):
        piece = -(-n // (2 * P))
        for i in range(2 * P):
            r = i if i < P else 2 * P - 1 - i
            real = max(0, min(piece, n - i * piece))
            out[r].append((d, i * piece, real, piece))
    return out


def _cut_stats(holder: list[int], doc: list[int], elems: list[int], P: int) -> tuple[int, float]:
    """Cuts inside documents (consecutive tokens of one document on different ranks: the only
    places a linear-attention state crosses ranks) and the max over ranks of its crossing
    segments ÷ the cuts next to its tokens."""
    adj = [0] * P
    cuts = 0
    for t in range(1, len(holder)):
        if holder[t] != holder[t - 1] and doc[t] == doc[t - 1] >= 0:
            cuts += 1
            adj[holder[t]] += 1
            adj[holder[t - 1]] += 1
    ratio = max((elems[r] / adj[r]) if adj[r] else (0.0 if elems[r] == 0 else math.inf)
                for r in range(P))
    return cuts, ratio


def measure(lengths: list[int], P: int, layout: str) -> dict:
    T = sum(lengths)
    t0 = time.perf_counter()
    if layout == "te_2p":
        segs = te_segments(lengths, P)
        ms = (time.perf_counter() - t0) * 1e3
        work = [sum(causal_work(off, real) for _, off, real, _ in s if real) for s in segs]
        held = sum(piece for s in segs for *_, piece in s)
        elems = [sum(1 for _, _, real, _ in s if real) if P > 1 else 0 for s in segs]
        holder, doc = [], []
        for d, n in enumerate(lengths):           # the padded row, piece by piece
            piece = -(-n // (2 * P))
            for i in range(2 * P):
                holder += [i if i < P else 2 * P - 1 - i] * piece
                doc += [d] * piece
    else:
        plan = plan_packing(_cu(lengths), P, layout="zigzag" if layout == "zigzag"
                            else "contiguous")
        ms = (time.perf_counter() - t0) * 1e3
        work = plan.rank_work()
        held = P * plan.local_len
        elems = [len(plan.crossing_segments(r)) for r in range(P)]
        holder, doc = [0] * held, [-1] * held
        for r, ss in enumerate(plan.segments):
            for s in ss:
                holder[s.start:s.stop] = [r] * s.length
                doc[s.start:s.stop] = [s.doc] * s.length
    mean = sum(work) / P
    cuts, per_cut = _cut_stats(holder, doc, elems, P)
    return dict(imbalance=max(work) / mean if mean else 1.0, padding=(held - T) / held,
                scan_elems=max(elems), per_cut=per_cut, cuts=cuts, plan_ms=ms)


def run(args) -> list[dict]:
    rows = []
    for kind in args.kinds:
        for T in args.rows:
            for P in args.worlds:
                draws = args.draws if kind == "lognormal" else 1
                for seed in range(draws):
                    lengths = draw(kind, T, random.Random(1000 * seed + T + P))
                    for layout in LAYOUTS:
                        m = measure(lengths, P, layout)
                        row = dict(bench="packing_balance", kind=kind, T=T, world=P,
                                   layout=layout, seed=seed, docs=len(lengths), **m)
                        rows.append(row)
                        print(json.dumps({k: round(v, 5) if isinstance(v, float) else v
                                          for k, v in row.items()}), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    """Markdown: per (kind, T, P) the worst draw's figures, three layouts side by side."""
    keys = sorted({(r["kind"], r["T"], r["world"]) for r in rows},
                  key=lambda k: (["lognormal", "one_doc", "tiny32"].index(k[0]), k[1], k[2]))
    head = ("| row | T | P | docs | " + " | ".join(
        f"{lay} imbalance / padding / scan elems (per cut)" for lay in LAYOUTS)
        + " | zigzag plan ms |")
    lines = [head, "|" + "---|" * (5 + len(LAYOUTS))]
    for kind, T, P in keys:
        cells = []
        sel = [r for r in rows if (r["kind"], r["T"], r["world"]) == (kind, T, P)]
        docs = statistics.median(r["docs"] for r in sel)
        for lay in LAYOUTS:
            rs = [r for r in sel if r["layout"] == lay]
            imb = max(r["imbalance"] for r in rs)
            pad = max(r["padding"] for r in rs)
            el = max(r["scan_elems"] for r in rs)
            pc = max(r["per_cut"] for r in rs)
            cells.append(f"{imb:.3f} / {100 * pad:.2f} % / {el} ({pc:.2f})")
        ms = max(r["plan_ms"] for r in sel if r["layout"] == "zigzag")
        lines.append(f"| {kind} | {T // 1024}K | {P} | {docs:g} | " + " | ".join(cells)
                     + f" | {ms:.1f} |")
    return "\n".join(lines)


def table_from_file(path: str) -> str:
    with open(path) as f:
        return table([json.loads(line) for line in f if line.strip()])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[32768, 131072, 524288])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--kinds", nargs="+", default=["lognormal", "one_doc", "tiny32"],
                   choices=["lognormal", "one_doc", "tiny32"])
    p.add_argument("--draws", type=int, default=8, help="log-normal rows per (T, P)")
    p.add_argument("--out", help="write the JSON lines here")
    p.add_argument("--table", help="write the markdown table here")
    args = p.parse_args(argv)
    rows = run(args)
    cmd = "python benchmarks/packing_balance.py " + " ".join(sys.argv[1:] if argv is None
                                                             else argv)
    if args.out:
        with open(args.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    text = (f"# Packed-row balance ({date.today()}, {platform.node() or 'host'} CPU, "
            f"planner only)\n\n`{cmd}`\n\nWorst of {args.draws} log-normal draws per row "
            "(one draw for the others). Targets: imbalance ≤ 1.05, padding ≤ 2 %, scan "
            "elements per cut ≤ 2.\n\n" + table(rows) + "\n")
    if args.table:
        with open(args.table, "w") as f:
            f.write(text)
    print(text, file=sys.stderr)
    return rows


if __name__ == "__main__":
    main()

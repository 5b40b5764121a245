"""Longest context per GPU: train.py's 1B presets at growing sequence lengths with no,
selective and full activation recompute — tokens/s, MFU, measured peak memory beside the
memory estimate — in one process on one GPU, within a time budget.

    python benchmarks/long_context.py --budget-s 480 --out results.jsonl
    python benchmarks/long_context.py --dry-run          # the plan: rows, estimates, times

Every row calls ``train.main`` (CP = 1, the copy task with Llama-3's 128256-token vocabulary,
bf16) and writes one JSON line: ``kind``, ``seq``, ``recompute`` (flags), ``micro_batch``,
``global_batch``, ``loss_impl``, ``status`` (``ok`` | ``out of memory`` | ``refused by the
estimate`` | ``skipped: time budget``), ``tokens_per_s`` and ``mfu`` (mean over the steps after
the first; model FLOPs, recompute not counted), ``step_time_s``, ``mem_gib`` (peak
``torch.cuda.max_memory_allocated``), ``estimate_gib`` and ``estimate_over_measured``,
``first_loss`` and ``wall_s``. Rows run in priority order; a row whose predicted time does not
fit the remaining budget is skipped (FLOPs at ``--assumed-tflops``, + the model build). A
recomputed run's first-step loss must equal the same row's loss without recompute bit for bit
(the forward is the same computation): checked at the end, exit 1 if not.
"""
from __future__ import annotations

import argparse
import gc
import json
import subprocess
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

K = 1024
VOCAB = 128256
SELECTIVE = {"softmax": ["mlp"], "hybrid": ["core_attn", "mlp"]}
RECOMPUTE = ("none", "selective", "full")


def recompute_flags(kind: str, mode: str) -> list:
    if mode == "none":
        return []
    if mode == "full":
        return ["--recompute-granularity", "full"]
    return ["--recompute-granularity", "selective", "--recompute-modules", *SELECTIVE[kind]]


def plan(part: int, longest_hybrid: int = 0, longest_softmax: int = 0) -> list:
    """Rows in priority order: (kind, seq, mode, micro_batch, global_batch, loss, steps).
    Part 1 (~6 min on an H200): 32K and 4K with every recompute setting, the full-logits loss
    beside ours at 32K, 256K with full recompute and the longest hybrid; part 2 (~3 min, + ~4
    with the longest softmax): 64K, 128K and 256K with every setting (rows the estimate refuses
    cost nothing: train.py stops before building the model)."""
    if part == 1:
        rows = [("softmax", 32 * K, "none", 1, 2, "chunked", 4),      # the MFU figure
                ("softmax", 32 * K, "none", 1, 2, "megatron", 3)]     # before: full logits
        rows += [(k, 32 * K, m, 1, 2, "chunked", 3) for k in ("softmax", "hybrid")
                 for m in RECOMPUTE if (k, m) != ("softmax", "none")]
        rows += [(k, 4 * K, m, 4, 8, "chunked", 3) for k in ("softmax", "hybrid")
                 for m in RECOMPUTE]
        rows += [(k, 256 * K, "full", 1, 1, "chunked", 2) for k in ("softmax", "hybrid")]
        if longest_hybrid:
            rows.append(("hybrid", longest_hybrid, "full", 1, 1, "chunked", 1))
        return rows
    rows = []
    for seq in (64 * K, 128 * K, 256 * K):
        rows += [(k, seq, m, 1, 1, "chunked", 2) for k in ("softmax", "hybrid")
                 for m in RECOMPUTE if (seq, m) != (256 * K, "full")]
    if longest_softmax:
        rows.append(("softmax", longest_softmax, "full", 1, 1, "chunked", 1))
    return rows


def longest_by_estimate(kind: str, capacity_gib: float, step: int = 32 * K) -> int:
    """The longest multiple of ``step`` whose full-recompute estimate stays within
    ``capacity_gib`` (pass a margin below the device)."""
    seq = step
    while estimate_gib((kind, seq + step, "full", 1, 1, "chunked", 1)) <= capacity_gib:
        seq += step
    return seq


def argv_of(row, log_dir: str) -> list:
    kind, seq, mode, mb, gbs, loss, steps = row
    return ["--preset", "1b", "--sp-model-kind", kind, "--context-parallel-size", "1",
            "--vocab-size", str(VOCAB), "--seq-length", str(seq), "--micro-batch-size", str(mb),
            "--global-batch-size", str(gbs), "--train-iters", str(steps),
            "--lr-warmup-iters", "1", "--log-interval", "1", "--no-progress-bar",
            "--loss-impl", loss, "--log-dir", log_dir, *recompute_flags(kind, mode)]


def predicted_s(row, tflops: float, build_s: float, capacity_gib: float = 139.0) -> float:
    """Wall time guess: model FLOPs (+ a forward for full recompute, + the MLP forward for
    selective) at ``tflops``, plus the build; ~0 for a row the estimate refuses."""
    if estimate_gib(row) > capacity_gib:
        return 0.5
    from sp_train.args import parse_args
    from sp_train.progress import flops_per_token
    kind, seq, mode, mb, gbs, loss, steps = row
    a = parse_args(argv_of(row, "/tmp"))
    fpt = flops_per_token(num_layers=a.num_layers, hidden_size=a.hidden_size,
                          ffn_hidden_size=a.ffn_hidden_size,
                          num_attention_heads=a.num_attention_heads,
                          num_query_groups=a.num_query_groups, vocab_size=VOCAB,
                          seq_length=seq, layer_kinds=a.layer_kinds())
    factor = {"none": 1.0, "full": 4 / 3, "selective": 1.15}[mode]
    return build_s + steps * gbs * seq * fpt * factor / (tflops * 1e12)


def estimate_gib(row) -> float:
    from sp_train.args import parse_args
    from sp_train.data import pad_vocab
    from sp_train.setup import memory_estimate
    a = parse_args(argv_of(row, "/tmp"))
    return memory_estimate(a, a.layout(1), pad_vocab(VOCAB, 1), bf16=True)[2].total / 2**30


def run_row(row, log_dir: str) -> dict:
    import torch
    import train
    kind, seq, mode, mb, gbs, loss, steps = row
    out = {"bench": "long_context", "kind": kind, "seq": seq, "recompute": mode,
           "recompute_flags": " ".join(recompute_flags(kind, mode)), "micro_batch": mb,
           "global_batch": gbs, "loss_impl": loss, "steps": steps,
           "estimate_gib": estimate_gib(row),
           "command": "python train.py " + " ".join(argv_of(row, "runs"))}
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        hist = train.main(argv_of(row, log_dir))
        steady = hist[1:] or hist
        out.update(status="ok", first_loss=hist[0]["loss"],
                   tokens_per_s=sum(r["tokens_per_s"] for r in steady) / len(steady),
                   mfu=sum(r.get("mfu", 0.0) for r in steady) / len(steady),
                   step_time_s=sum(r["step_time_s"] for r in steady) / len(steady))
    except torch.OutOfMemoryError as e:
        out["status"] = "out of memory"
        out["oom"] = str(e).split(". GPU")[0][:200]
    except ValueError as e:
        msg = str(e)
        out["status"] = "refused by the estimate" if "device holds" in msg else f"error: {msg}"
    except Exception as e:      # noqa: BLE001 - a failing row is recorded, the sweep goes on
        out["status"] = f"error: {type(e).__name__}: {str(e)[:500]}"
    out["wall_s"] = time.perf_counter() - t0
    out["mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if out["status"] == "ok":
        out["estimate_over_measured"] = out["estimate_gib"] / out["mem_gib"]
    gc.collect()
    torch.cuda.empty_cache()
    return out


def run_row_in_subprocess(row, log_dir: str) -> dict:
    """:func:`run_row` in a fresh process: rows run one after another in one process kept the
    earlier rows' memory (the 256K rows ran out of memory after the 32K ones; alone they fit)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--run-row", json.dumps(list(row)),
           "--log-dir", log_dir]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    sys.stderr.write(proc.stderr[-4000:])
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{") and '"bench": "long_context"' in line:
            return json.loads(line)
    kind, seq, mode, mb, gbs, loss, steps = row
    return {"bench": "long_context", "kind": kind, "seq": seq, "recompute": mode,
            "loss_impl": loss, "status": f"error: exit {proc.returncode}: "
            + (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}


def check_first_losses(rows: list) -> list:
    """Rows whose first-step loss differs from the same row without recompute."""
    base = {}
    for r in rows:
        if r.get("status") == "ok" and r["recompute"] == "none":
            base[(r["kind"], r["seq"], r["micro_batch"], r["global_batch"], r["loss_impl"])] = \
                r["first_loss"]
    bad = []
    for r in rows:
        key = (r["kind"], r["seq"], r["micro_batch"], r["global_batch"], r["loss_impl"])
        if r.get("status") == "ok" and r["recompute"] != "none" and key in base \
                and r["first_loss"] != base[key]:
            bad.append((key, r["recompute"], r["first_loss"], base[key]))
    return bad


def table(path: str) -> None:
    """Print the rows of a results file (this script's and loss_bench.py's) as a table."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for r in rows:
        if r.get("bench") == "loss":
            print(f"loss {r['impl']:14} T {r['T'] // K:3}K  {r['status'][:14]:14} "
                  f"{r.get('ms_fwd_bwd', 0):8.1f} ms  {r.get('peak_gib', 0):6.2f} GiB  "
                  f"loss err {r.get('loss_rel_err', 0):.1e}  grad rms {r.get('grad_rel_rms', 0):.1e}")
        elif "seq" in r:
            print(f"{r['kind']:8} {r['seq'] // K:4}K {r['recompute']:9} {r['loss_impl']:8} "
                  f"{r['status'][:24]:24} {r.get('tokens_per_s', 0):8.0f} tok/s  MFU "
                  f"{100 * r.get('mfu', 0):5.1f}%  peak {r.get('mem_gib', 0):6.1f}  estimate "
                  f"{r.get('estimate_gib', 0):6.1f} GiB  est/peak "
                  f"{r.get('estimate_over_measured', 0):.3f}")
        else:
            print(json.dumps(r))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="stop starting rows whose predicted time would pass this (seconds)")
    p.add_argument("--assumed-tflops", type=float, default=400.0)
    p.add_argument("--build-s", type=float, default=7.0, help="model build + first-call guess")
    p.add_argument("--capacity-gib", type=float, default=139.7,
                   help="the GPU's memory (H200: 139.7 GiB) for the plan's guesses")
    p.add_argument("--margin", type=float, default=0.9,
                   help="the longest rows: the longest length whose estimate is within this "
                   "share of --capacity-gib")
    p.add_argument("--part", type=int, choices=[1, 2], default=1,
                   help="1: 4K, 32K, 256K full, longest hybrid; 2: 64K, 128K, 256K, longest "
                   "softmax")
    p.add_argument("--longest", nargs="*", default=["hybrid", "softmax"],
                   choices=["hybrid", "softmax"],
                   help="add a 1-step full-recompute row at the longest length the estimate "
                   "allows (hybrid in part 1, ~1 min; softmax in part 2, ~4 min)")
    p.add_argument("--only", nargs="+", default=None,
                   help="run only rows 'kind:seqK:mode' (e.g. softmax:512K:full)")
    p.add_argument("--dry-run", action="store_true", help="print the plan with estimates")
    p.add_argument("--table", metavar="FILE", help="print FILE's rows as a table and exit")
    p.add_argument("--out")
    p.add_argument("--run-row", help=argparse.SUPPRESS)     # one row, in this process
    p.add_argument("--log-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.run_row:
        print(json.dumps(run_row(tuple(json.loads(args.run_row)), args.log_dir)), flush=True)
        return 0
    if args.table:
        table(args.table)
        return 0
    cap = args.margin * args.capacity_gib
    rows = plan(args.part, *(longest_by_estimate(k, cap) if k in args.longest else 0
                             for k in ("hybrid", "softmax")))
    if args.only:
        want = set(args.only)
        rows = [r for r in rows if f"{r[0]}:{r[1] // K}K:{r[2]}" in want] or \
            [(k, int(s[:-1]) * K, m, 1, 1, "chunked", 1)
             for k, s, m in (o.split(":") for o in args.only)]
    if args.dry_run:
        total = 0.0
        for r in rows:
            t = predicted_s(r, args.assumed_tflops, args.build_s, args.capacity_gib)
            total += t
            print(json.dumps({"row": list(r), "estimate_gib": round(estimate_gib(r), 1),
                              "predicted_s": round(t, 1), "cumulative_s": round(total, 1)}))
        return 0
    start = time.perf_counter()
    results = []
    longest = {r for r in rows if r[6] == 1 and r[2] == "full"}
    for r in rows:
        left = args.budget_s - (time.perf_counter() - start)
        need = predicted_s(r, args.assumed_tflops, args.build_s, args.capacity_gib)
        if need > left:
            res = {"bench": "long_context", "kind": r[0], "seq": r[1], "recompute": r[2],
                   "loss_impl": r[5], "status": "skipped: time budget",
                   "predicted_s": need, "left_s": left, "estimate_gib": estimate_gib(r)}
        else:
            res = run_row_in_subprocess(r, f"/tmp/long_context/{r[0]}_{r[1] // K}K_{r[2]}_{r[5]}")
        results.append(res)
        if r in longest and res["status"] == "out of memory":    # one retry, 1/16 shorter
            shorter = r[1] - r[1] // 16
            rows.append((r[0], shorter - shorter % (32 * K)) + r[2:])
        line = json.dumps(res)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
    bad = check_first_losses(results)
    pair = {r["loss_impl"]: r["first_loss"] for r in results if r.get("status") == "ok"
            and (r["kind"], r["seq"], r["recompute"]) == ("softmax", 32 * K, "none")}
    if len(pair) == 2:      # the chunked loss vs Megatron's on the same first batch
        diff = abs(pair["chunked"] - pair["megatron"]) / abs(pair["megatron"])
        print(json.dumps({"bench": "long_context", "first_loss_chunked_vs_megatron_rel": diff}))
        if diff > 2e-3:
            bad.append(("chunked vs megatron first loss", diff))
    if bad:
        print(json.dumps({"bench": "long_context", "error": "first-step loss differs under "
                          "recompute", "rows": bad}), flush=True)
    errors = [r for r in results if str(r.get("status", "")).startswith("error")]
    return 1 if bad or errors else 0


if __name__ == "__main__":
    sys.exit(main())

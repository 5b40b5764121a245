"""Print a compact table from benchmark JSON lines: python benchmarks/summarize.py FILE..."""
import json
import sys

COLS = ["bench", "impl", "timing", "nccl_env", "layout", "stride", "world", "T_local", "ms", "host_us",
        "ms_fwd", "ms_fwd_bwd", "ms_host_fwd_bwd", "host_ahead_lost", "mtok_s",
        "tflops_per_gpu", "ratio", "ratio_fwd", "ratio_vs_t_local", "scan_share", "ms_state_fwd", "ms_local_fwd",
        "ms_scan_fwd", "ms_inter_fwd", "ms_state_grad_bwd", "ms_scan_bwd", "ms_local_bwd", "baseline",
        "workload", "transport", "mib", "order", "ms_compute_alone", "ms_hop_alone", "gb_s",
        "received_ok", "ms_compute", "ms_hop_landed", "slowdown", "ms_step",
        "graph_error", "error"]


def fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return " ".join(f"{k}={x}" for k, x in sorted(v.items()))
    return "" if v is None else str(v)


def main(paths):
    rows = [json.loads(line) for p in paths for line in open(p) if line.strip()]
    cols = [c for c in COLS if any(c in r for r in rows)]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(fmt(r.get(c)) for c in cols) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])

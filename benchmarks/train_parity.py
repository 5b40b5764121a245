"""bf16 parity of a whole train.py run: CP = P against CP = 1, same seed and data, beside two
CP = 1 runs that differ only in their kernels' nondeterminism (their spread is the yardstick).

    python benchmarks/train_parity.py --cp 4 --kind hybrid --train-iters 300 \
        --png parity.png --out parity.jsonl
    python benchmarks/train_parity.py --device cpu --preset tiny --cp 2 --train-iters 20 \
        --seq-length 256                                   # CPU / gloo dry run

The data (``--data repo``, the default) is this checkout's own ``.py`` and ``.md`` files as a
``.jsonl`` corpus (one document per file, sorted paths, UTF-8 bytes), so the loss keeps falling
for hundreds of steps and a drift has room to show; ``--data copy`` is train.py's copy task,
which at 8K sits at chance (ln 32) after ~40 steps (2 × H100, 2026-11-26).

The two CP = 1 runs go side by side (GPUs 0 and 1), then the CP run on GPUs 0 … P−1. Every run
is ``train.py --seed S --context-parallel-size c`` with one sequence per step, so all three see
the same batches. Differences are taken between ``--window``-step moving averages of the loss:
``spread`` = mean |CP1a − CP1b|, ``cp_vs_cp1`` = mean |CP − (CP1a + CP1b)/2|, and their maxima;
``bias`` = mean signed (CP − CP1 mean). ``verdict``: ``within`` when ``cp_vs_cp1`` ≤
``--tolerance`` × ``spread`` + ``--atol`` (a CP mistake shows as a drift or a bias far outside
the spread).
One JSON line (``bench: "train_parity"``) and a PNG of the three curves.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def moving_average(xs: list, w: int) -> list:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= w:
            acc -= xs[i - w]
        out.append(acc / min(i + 1, w))
    return out


SKIP_DIRS = ("probe", "results", "build", "device-out", "runs", "__pycache__")


def repo_corpus(path: str) -> str:
    """This checkout's ``.py`` and ``.md`` files (not hidden, virtual-env, result or scratch
    folders) written to ``path`` as ``.jsonl``, one ``{"text": …}`` per file in sorted order."""
    files = []
    for d, dirs, names in os.walk(ROOT):
        dirs[:] = sorted(x for x in dirs if not x.startswith(".") and x not in SKIP_DIRS
                         and "venv" not in x and not x.endswith(".egg-info"))
        files += [os.path.join(d, n) for n in sorted(names) if n.endswith((".py", ".md"))]
    with open(path, "w", encoding="utf-8") as f:
        for name in files:
            with open(name, encoding="utf-8", errors="replace") as src:
                f.write(json.dumps({"text": src.read()}) + "\n")
    return path


def compare(a: list, b: list, c: list, window: int) -> dict:
    """Statistics of three equal-length loss curves (two CP = 1 runs a, b; the CP run c)."""
    a, b, c = (moving_average(x, window) for x in (a, b, c))
    mid = [(x + y) / 2 for x, y in zip(a, b)]
    spread = [abs(x - y) for x, y in zip(a, b)]
    dev = [abs(z - m) for z, m in zip(c, mid)]
    n = len(a)
    return {"spread": sum(spread) / n, "spread_max": max(spread),
            "cp_vs_cp1": sum(dev) / n, "cp_vs_cp1_max": max(dev),
            "bias": sum(z - m for z, m in zip(c, mid)) / n}


def main() -> int:
    from sp_attention.testing import kill_tree
    from sp_train.progress import plot_losses, read_log
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from train_scaling import emit, train_command
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cp", type=int, default=4)
    p.add_argument("--kind", default="hybrid", choices=["softmax", "linear", "gated", "hybrid"])
    p.add_argument("--data", choices=["repo", "copy"], default="repo",
                   help="repo: this checkout's .py and .md files, bytes (the loss keeps "
                   "falling); copy: train.py's copy task")
    p.add_argument("--preset", default="1b")
    p.add_argument("--num-layers", type=int, default=4,
                   help="fewer layers than the preset's keep 300 steps short (default 4)")
    p.add_argument("--seq-length", type=int, default=8192)
    p.add_argument("--train-iters", type=int, default=300)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--tolerance", type=float, default=2.0)
    p.add_argument("--atol", type=float, default=1e-4,
                   help="absolute allowance (deterministic kernels have no spread)")
    p.add_argument("--timeout", type=float, default=400)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--png", default="train_parity.png")
    p.add_argument("--out", help="append the JSON line to this file too")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more train.py flags")
    a = p.parse_args()
    a.extra = [x for x in a.extra if x != "--"]
    tmp = tempfile.mkdtemp(prefix="train_parity_")
    data = ([] if a.data == "copy" else
            ["--data-path", repo_corpus(os.path.join(tmp, "corpus.jsonl")), "--packing", "none"])

    def launch(name: str, cp: int, gpus: str, port: int) -> tuple:
        cmd = train_command(a.kind, {"tp": 1, "cp": cp, "dp": 1}, preset=a.preset,
                            seq_length=a.seq_length, train_iters=a.train_iters,
                            log_dir=os.path.join(tmp, name), port=port,
                            extra=["--num-layers", str(a.num_layers), "--seed", str(a.seed)]
                            + data + a.extra)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="" if a.device == "cpu" else gpus)
        log = open(os.path.join(tmp, name + ".log"), "w")
        return name, cmd, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                           cwd=ROOT)

    def finish(runs: list) -> None:
        t0 = time.time()
        for name, cmd, proc in runs:
            try:
                rc = proc.wait(timeout=max(1.0, a.timeout - (time.time() - t0)))
            except subprocess.TimeoutExpired:
                kill_tree(proc)
                proc.wait()
                rc = "timeout"
            if rc != 0:
                tail = open(os.path.join(tmp, name + ".log")).read()[-1500:]
                raise SystemExit(f"{name} ({' '.join(cmd)}) ended with {rc}:\n{tail}")

    finish([launch("cp1_a", 1, "0", 29611), launch("cp1_b", 1, "1", 29612)])
    finish([launch(f"cp{a.cp}", a.cp, ",".join(map(str, range(a.cp))), 29613)])
    curves = {name: read_log(os.path.join(tmp, name, "log.jsonl"))[1]
              for name in ("cp1_a", "cp1_b", f"cp{a.cp}")}
    n = min(len(c) for c in curves.values())
    if n < a.train_iters:
        raise SystemExit(f"a run logged only {n} of {a.train_iters} steps: see {tmp}")
    stats = compare(*(c[:n] for c in curves.values()), window=a.window)
    label = {"cp1_a": "CP 1 (run a)", "cp1_b": "CP 1 (run b)", f"cp{a.cp}": f"CP {a.cp}"}
    png = plot_losses({label[k]: (list(range(1, n + 1)), v[:n]) for k, v in curves.items()},
                      a.png, title=f"train.py {a.kind}, {a.preset} ({a.num_layers} layers), "
                      f"{a.seq_length} tokens, {a.data} data: CP {a.cp} vs CP 1")
    import torch
    rec = {"bench": "train_parity", "model_kind": a.kind, "preset": a.preset, "data": a.data,
           "num_layers": a.num_layers, "seq_length": a.seq_length, "cp": a.cp, "steps": n,
           "window": a.window, **{k: round(v, 5) for k, v in stats.items()},
           "verdict": "within" if stats["cp_vs_cp1"] <= a.tolerance * stats["spread"] + a.atol
           else "outside", "tolerance": a.tolerance, "atol": a.atol,
           "last_loss": {k: round(v[n - 1], 4) for k, v in curves.items()},
           "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
           "date": time.strftime("%Y-%m-%d"), "png": png,
           "command": "python benchmarks/train_parity.py " + " ".join(sys.argv[1:])}
    emit(rec, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

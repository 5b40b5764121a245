"""train.py at several parallel layouts on one machine: MFU, tokens/s and peak memory per run, as
JSON lines (``bench: "train"``), for strong scaling (the same sequence on 1 GPU and on P).

    python benchmarks/train_scaling.py --kinds softmax hybrid --layouts cp1 cp4 tp2cp2 dp2cp2 \
        --seq-length 32768 --train-iters 10 --out train.jsonl
    python benchmarks/train_scaling.py --device cpu --preset tiny --seq-length 256 \
        --layouts cp1 cp2 --train-iters 3          # CPU / gloo dry run

A layout is ``[tpN][cpN][dpN]`` (missing factors 1); each run is ``torchrun --standalone
--nproc-per-node tp·cp·dp train.py --preset … --context-parallel-size … --micro-batch-size 1
--global-batch-size dp``, so every layout of one ``--seq-length`` trains the same sequences per
step. Runs on one GPU go side by side, one per GPU (``--no-side-by-side`` to run them one
after the other). ``mfu``, ``tokens_per_s``, ``step_time_s``: means over the steps after the
first (``step_time_median_s`` beside: a step that compiled a kernel moves the mean, not the
median; ``step_times_ms``: every step's time, the first included);
``mem_gb``: the largest peak of any step (``mem_estimate_gb``: train.py's estimate printed
before the run, ``estimate_over_measured``); ``first_step_s``: from the launch to the end of the
first step (imports, model, the kernels' first compilation; ``--fresh-triton-cache`` gives
each run empty Triton and Inductor caches, as on a fresh machine); ``command``: what ran. A run that
fails or outlasts ``--timeout`` is recorded with its ``status`` and train.py's error.
``--against TREE --repeats N``: every configuration also with another checkout's train.py, the
two trees alternately (A B B A …), rows marked ``tree`` (an A/B of a change on one machine).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from sp_attention.testing import kill_tree  # noqa: E402


def parse_layout(name: str) -> dict:
    """``"tp2cp2"`` -> ``{"tp": 2, "cp": 2, "dp": 1}``."""
    got = dict(re.findall(r"(tp|cp|dp)(\d+)", name))
    if not got or "".join(f"{k}{v}" for k, v in re.findall(r"(tp|cp|dp)(\d+)", name)) != name:
        raise ValueError(f"layout {name!r}: write it as tpNcpNdpN (e.g. cp4, tp2cp2, dp2cp2)")
    return {k: int(got.get(k, 1)) for k in ("tp", "cp", "dp")}


def train_command(kind: str, lay: dict, *, preset: str, seq_length: int, train_iters: int,
                  log_dir: str, log_json: Optional[str] = None, vocab_size: Optional[int] = None,
                  port: Optional[int] = None, extra=(), launcher=(), tree: str = ROOT) -> list:
    """``torchrun … train.py`` at layout ``lay`` with one sequence per DP rank per step (so
    every layout of one ``seq_length`` trains the same sequences); ``port``: a rendezvous port
    of its own (runs side by side), else ``--standalone``; ``launcher``: more torchrun flags
    (e.g. ``--numa-binding node``); ``tree``: the checkout whose train.py runs (its packages
    first on the path: a script's folder is). The training benchmarks' one train.py command
    line."""
    world = lay["tp"] * lay["cp"] * lay["dp"]
    launch = ["torchrun", "--nproc-per-node", str(world)]
    launch += ["--master-port", str(port)] if port else ["--standalone"]
    launch += list(launcher)
    cmd = launch + [os.path.join(tree, "train.py"), "--preset", preset,
                    "--sp-model-kind", kind, "--seq-length", str(seq_length),
                    "--tensor-model-parallel-size", str(lay["tp"]),
                    "--context-parallel-size", str(lay["cp"]), "--micro-batch-size", "1",
                    "--global-batch-size", str(lay["dp"]), "--train-iters", str(train_iters),
                    "--log-interval", "1", "--no-progress-bar", "--log-dir", log_dir]
    if log_json:
        cmd += ["--log-json", log_json]
    if vocab_size:
        cmd += ["--vocab-size", str(vocab_size)]
    return cmd + list(extra)


def fresh_caches(root: str) -> dict:
    """The environment of a fresh machine's caches under ``root`` (created empty): Triton's
    default folder ``root/home/.triton/cache`` (through ``TRITON_HOME``; ``TRITON_CACHE_DIR``
    stays unset, as a user has it, so torch's Inductor moves it to its own per-device folder
    on its first compiled kernel, as it does there) and Inductor's ``root/inductor``."""
    os.makedirs(root, exist_ok=False)
    env = {"TRITON_HOME": os.path.join(root, "home"),
           "TORCHINDUCTOR_CACHE_DIR": os.path.join(root, "inductor")}
    for d in env.values():
        os.makedirs(d)
    return env


def summarize(log_json: str, t0: float = 0.0) -> dict:
    recs = [json.loads(line) for line in open(log_json) if line.strip()] \
        if os.path.exists(log_json) else []
    recs = [r for r in recs if "tokens_per_s" in r]
    if not recs:
        return {}
    steady = recs[1:] or recs
    out = {"steps": len(recs), "mem_gb": max(r.get("mem_gb", 0) for r in recs),
           "first_loss": recs[0].get("loss"), "last_loss": recs[-1].get("loss")}
    if t0 and "time" in recs[0]:
        out["first_step_s"] = round(recs[0]["time"] - t0, 1)
    for key in ("tokens_per_s", "mfu", "step_time_s"):
        vals = [r[key] for r in steady if key in r]
        if vals:
            out[key] = sum(vals) / len(vals)
    times = [r["step_time_s"] for r in recs if "step_time_s" in r]
    if times:
        out["step_times_ms"] = [round(1000 * t, 1) for t in times]
        later = sorted(times[1:] or times)
        out["step_time_median_s"] = (later[(len(later) - 1) // 2] + later[len(later) // 2]) / 2
    return out


def ab_order(trees: list, repeats: int) -> list:
    """``(repeat, tree)`` in run order: the trees in turn, reversed every other repeat (A B B
    A …), so a drift of the machine over the sweep falls on both alike."""
    out = []
    for r in range(repeats):
        out += [(r, t) for t in (trees if r % 2 == 0 else trees[::-1])]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", nargs="+", default=["softmax", "hybrid"],
                   choices=["softmax", "linear", "gated", "hybrid"])
    p.add_argument("--layouts", nargs="+", default=["cp1", "cp4"])
    p.add_argument("--preset", default="1b")
    p.add_argument("--seq-length", type=int, default=32768)
    p.add_argument("--vocab-size", type=int, default=128256)
    p.add_argument("--train-iters", type=int, default=10)
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--no-side-by-side", action="store_true")
    p.add_argument("--fresh-triton-cache", nargs="?", const="", default=None, metavar="DIR",
                   help="each run gets its own empty caches under DIR/<kind>_<layout> "
                        "(default: a temporary folder) as on a fresh machine: Triton's "
                        "default folder (TRITON_HOME=…/home, TRITON_CACHE_DIR unset, as a "
                        "user has it) and Inductor's (TORCHINDUCTOR_CACHE_DIR=…/inductor, "
                        "where Inductor moves Triton's cache on its first compiled kernel); "
                        "the package still installs its shipped autotune results")
    p.add_argument("--out", help="append the JSON lines to this file too")
    p.add_argument("--torchrun-args", default="", metavar="'FLAGS'",
                   help="more torchrun flags for every run, one string (e.g. '--numa-binding "
                        "node': each rank's threads on the CPUs near its GPU); rows record them")
    p.add_argument("--log-root", help="keep each run's log and log folder here (default: a "
                                      "temporary folder)")
    p.add_argument("--against", metavar="TREE",
                   help="another checkout (e.g. `git worktree add /tmp/old HEAD~1`): every run "
                        "also with its train.py, the two alternately (this tree first, then "
                        "A B B A … over --repeats), rows marked `tree: this | against`; one run "
                        "at a time")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each configuration (with --against: of each tree)")
    p.add_argument("extra", nargs=argparse.REMAINDER,
                   help="after --: more train.py flags for every run (e.g. --recompute-...)")
    a = p.parse_args()
    a.extra = [x for x in a.extra if x != "--"]
    lays = [(name, parse_layout(name)) for name in a.layouts]
    ngpu = 0
    if a.device == "cuda":
        import torch
        ngpu = torch.cuda.device_count()
    if a.repeats < 1:
        p.error("--repeats must be >= 1")
    if a.against and not os.path.exists(os.path.join(a.against, "train.py")):
        p.error(f"--against {a.against}: no train.py there (give a checkout of this project)")
    trees = [("this", ROOT)] + ([("against", os.path.abspath(a.against))] if a.against else [])
    runs = [(kind, name, lay, tree, r) for kind in a.kinds for name, lay in lays
            for r, tree in ab_order(trees, a.repeats)]
    tmp = a.log_root or tempfile.mkdtemp(prefix="train_scaling_")
    os.makedirs(tmp, exist_ok=True)
    batches, single = [], [r for r in runs if r[2]["tp"] * r[2]["cp"] * r[2]["dp"] == 1]
    if single and ngpu > 1 and not a.no_side_by_side and len(trees) == 1:
        for i in range(0, len(single), ngpu):
            batches.append(single[i:i + ngpu])
        runs = [r for r in runs if r not in single]
    batches += [[r] for r in runs]
    failed, order = 0, 0
    for batch in batches:
        procs = []
        for slot, (kind, name, lay, (which, tree), r) in enumerate(batch):
            tag = f"{kind}_{name}" + (f"_{which}" if a.against else "") + \
                (f"_{r + 1}" if a.repeats > 1 else "")
            log_json, log = os.path.join(tmp, tag + ".jsonl"), os.path.join(tmp, tag + ".log")
            cmd = train_command(kind, lay, preset=a.preset, seq_length=a.seq_length,
                                train_iters=a.train_iters, log_dir=os.path.join(tmp, tag),
                                log_json=log_json, vocab_size=a.vocab_size, extra=a.extra,
                                port=29600 + slot if len(batch) > 1 else None,
                                launcher=a.torchrun_args.split(), tree=tree)
            env = dict(os.environ)
            if a.fresh_triton_cache is not None:
                env.update(fresh_caches(os.path.join(
                    a.fresh_triton_cache or os.path.join(tmp, "triton"), tag)))
                env.pop("TRITON_CACHE_DIR", None)
            if len(batch) > 1:
                env["CUDA_VISIBLE_DEVICES"] = str(slot)
            if a.device == "cpu":
                env["CUDA_VISIBLE_DEVICES"] = ""
            procs.append((kind, name, lay, which, tree, cmd, log_json, log, time.time(),
                          subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                           env=env, cwd=tree)))
        for kind, name, lay, which, tree, cmd, log_json, log, t0, proc in procs:
            try:
                rc = proc.wait(timeout=max(1.0, a.timeout - (time.time() - t0)))
                status = "ok" if rc == 0 else f"exit {rc}"
            except subprocess.TimeoutExpired:
                kill_tree(proc)          # torchrun and its workers (their own sessions)
                proc.wait()
                status = "timeout"
            rec = {"bench": "train", "model_kind": kind, "layout": name,
                   "world": lay["tp"] * lay["cp"] * lay["dp"], **lay,
                   "seq_length": a.seq_length, "preset": a.preset, "vocab_size": a.vocab_size,
                   "status": status, "wall_s": round(time.time() - t0, 1),
                   "device": _device(a.device), "date": time.strftime("%Y-%m-%d"),
                   "command": " ".join(cmd[cmd.index(os.path.join(tree, "train.py")):]
                                       ).replace(tree + "/", ""), **summarize(log_json, t0)}
            if a.against:
                rec.update(tree=which, tree_path=tree, order=order)
            order += 1
            if a.torchrun_args:
                rec["torchrun_args"] = a.torchrun_args
            if os.environ.get("SP_ATTENTION_PLAIN_LAUNCHES") == "1":
                rec["launches"] = "triton"      # Triton's own path (sp_attention.triton_launch)
            rec.update(_estimate(log, rec.get("mem_gb")))
            text = open(log).read() if os.path.exists(log) else None
            if text is not None:         # --cuda-graphs is on by default for some runs: say so
                rec["cuda_graphs"] = "layers replayed from CUDA graphs" in text
            if status != "ok":
                failed += 1
                rec["log_tail"] = error_tail(text or "")
            emit(rec, a.out)
    return 1 if failed else 0


def _estimate(log: str, mem_gb: Optional[float]) -> dict:
    """train.py's memory estimate of the run and estimate ÷ measured peak: the ``summary:``
    line at the end of its log, or (a run stopped at its time limit) the ``memory estimate per
    rank`` line it prints before building the model."""
    text = open(log).read() if os.path.exists(log) else ""
    lines = [x for x in text.splitlines() if x.startswith("summary: ")]
    est = json.loads(lines[-1][len("summary: "):]).get("mem_estimate_gb") if lines else None
    if est is None:
        m = re.search(r"memory estimate per rank[^:]*: ([0-9.]+) (GiB|MiB)", text)
        if not m:
            return {}
        est = float(m.group(1)) / (1024 if m.group(2) == "MiB" else 1)
    out = {"mem_estimate_gb": est}
    if est and mem_gb:
        out["estimate_over_measured"] = round(est / mem_gb, 3)
    return out


def emit(rec: dict, out) -> None:
    """Print one JSON line and append it to ``out`` (when given)."""
    line = json.dumps(rec, sort_keys=True)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def error_tail(text: str, n: int = 1200) -> str:
    """The end of a failed run's log before torchrun's own failure report (which names only
    exit codes): where train.py's error or traceback is."""
    marks = [i for i in (text.find(m) for m in ("] failed (exitcode:",
                                                  "elastic.multiprocessing.errors")) if i > 0]
    cut = text.rfind("\n", 0, min(marks)) if marks else len(text)
    return text[max(0, cut - n):cut]


def _device(device: str) -> str:
    if device != "cuda":
        return "cpu"
    import torch
    return torch.cuda.get_device_name()


if __name__ == "__main__":
    sys.exit(main())

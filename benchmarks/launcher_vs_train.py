"""The Megatron launcher (``megatron_patches.pretrain_gpt`` on ``megatron.training``) against
train.py on the same model, layout and sequence: tokens/s per GPU side by side, as JSON lines
(``bench: "launcher_vs_train"``). Needs megatron-core 0.19.x with ``megatron.training``.

    python benchmarks/launcher_vs_train.py --kinds softmax hybrid --layouts cp4 tp2cp2 \
        --seq-length 16384 --train-iters 12 --out launcher.jsonl

Both run the 1B shape (Llama-3.2-1B: 16 layers, d2048, 32 heads, 8 KV heads, FFN 8192, vocab
128256), bf16, one sequence per DP rank per step, the hybrid as LLLS with
``--context-parallel-impl blelloch``. The launcher trains on Megatron's mock data with
``--transformer-impl local`` (TransformerEngine cannot be installed without compiling here);
train.py on its default data. tokens/s: the mean over the steps after the first two (the
launcher: from its ``elapsed time per iteration``); ``ratio`` = launcher ÷ train.py.
The launcher runs with the Megatron flags of what train.py does by default on GPUs (the
gradient sum overlapped with the backward: ``--overlap-grad-reduce``; the distributed optimizer
with its gather overlapped: ``--use-distributed-optimizer --overlap-param-gather``; the fused
SwiGLU); train.py runs its layers eagerly as the launcher does (``--no-cuda-graphs``);
``--megatron-defaults`` runs it with Megatron's own defaults instead (the rows before the
eighteenth session), ``--launcher-extra`` adds flags (recorded in each row).
``--resume-check``: the launcher saves Megatron's checkpoint on those GPUs and a second run
resumes from it (``bench: "launcher_resume"``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_scaling import (ROOT, emit, error_tail, kill_tree, parse_layout,  # noqa: E402
                           train_command)
from sp_train.args import SHAPES  # noqa: E402

SHAPE = dict(SHAPES["1b"], vocab_size=128256)       # train.py's --preset 1b, Llama 3's vocab
HYBRID = ["--sp-hybrid-pattern", "LLLS", "--context-parallel-impl", "blelloch"]


# Megatron's flags for what train.py does by default on GPUs: the gradient sum overlapped with
# the backward bucket by bucket, the distributed optimizer with its parameter gather overlapped
# with the next forward (since the nineteenth session), the SwiGLU fused (Megatron's defaults:
# the sum after the backward, no distributed optimizer; the launcher's runs before the
# eighteenth session passed --no-bias-swiglu-fusion as well)
MATCH_TRAIN = ["--overlap-grad-reduce", "--use-distributed-optimizer", "--overlap-param-gather"]
# train.py's flags for the pairing: the launcher runs its layers eagerly (Megatron's own CUDA
# graphs are not tried here), so train.py does too — its layer graphs, on by default at CP > 1
# since the twenty-third session, would compare the graphs, not the integrations
TRAIN_FLAGS = ["--no-cuda-graphs"]


def settings_flags(match_train: bool) -> list:
    """The launcher's flags for the pairing: :data:`MATCH_TRAIN`, or Megatron's defaults with
    the unfused SwiGLU of the runs before the eighteenth session."""
    return MATCH_TRAIN if match_train else ["--no-bias-swiglu-fusion"]


def launcher_cmd(kind: str, lay: dict, seq: int, iters: int, port: int,
                 layers: int = 0, match_train: bool = True, extra=()) -> list:
    """The launcher's command line (``layers``: fewer layers than the 1B shape's, 0: all;
    ``match_train``: :data:`MATCH_TRAIN` and the fused SwiGLU, else Megatron's defaults and
    ``--no-bias-swiglu-fusion``; ``extra``: more Megatron flags, appended)."""
    world = lay["tp"] * lay["cp"] * lay["dp"]
    s = SHAPE
    cmd = ["torchrun", "--nproc-per-node", str(world), "--master-port", str(port),
           "-m", "megatron_patches.pretrain_gpt",
           "--num-layers", str(layers or s["num_layers"]), "--hidden-size", str(s["hidden_size"]),
           "--ffn-hidden-size", str(s["ffn_hidden_size"]),
           "--num-attention-heads", str(s["num_attention_heads"]), "--group-query-attention",
           "--num-query-groups", str(s["num_query_groups"]),
           "--seq-length", str(seq), "--max-position-embeddings", str(seq),
           "--micro-batch-size", "1", "--global-batch-size", str(lay["dp"]),
           "--tensor-model-parallel-size", str(lay["tp"]),
           "--context-parallel-size", str(lay["cp"]),
           "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine",
           "--lr-warmup-iters", "2", "--train-iters", str(iters), "--weight-decay", "0.1",
           "--clip-grad", "1.0", "--bf16", "--seed", "1234",
           "--mock-data", "--tokenizer-type", "NullTokenizer",
           "--vocab-size", str(s["vocab_size"]),
           "--transformer-impl", "local", "--no-persist-layer-norm", "--no-rope-fusion",
           "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
           "--no-bias-dropout-fusion",
           "--no-create-attention-mask-in-dataloader", "--attention-dropout", "0",
           "--hidden-dropout", "0", "--position-embedding-type", "rope",
           "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
           "--untie-embeddings-and-output-weights",
           "--sp-model-kind", kind, "--log-interval", "1", "--eval-iters", "0",
           "--eval-interval", "1000000"]
    cmd += settings_flags(match_train)
    return cmd + (HYBRID if kind == "hybrid" else []) + list(extra)


def launcher_tokens_per_s(log: str, tokens_per_step: int, skip: int = 2) -> tuple:
    """(tokens/s over the iterations after ``skip``, iterations seen) from Megatron's log."""
    ms = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", log)]
    steady = ms[skip:] or ms
    return (tokens_per_step / (sum(steady) / len(steady) / 1e3) if steady else None), len(ms)


def resume_check(lay: dict, name: str, seq: int, tmp: str, timeout: float, device: str,
                 every: int = 3, layers: int = 4) -> dict:
    """The launcher's save and resume on ``lay``'s GPUs (the LLLS hybrid, ``layers`` layers),
    as a preempted job and its requeue see it: one command for ``3·every`` iterations saving
    Megatron's checkpoint every ``every``, stopped after ``2·every`` (``--exit-interval``),
    then the same command with ``--load``; the record says where the second run started and
    its losses beside the first run's. (Both runs keep ``--train-iters``: Megatron refuses a
    checkpoint whose learning-rate schedule was made for another length.)"""
    ckpt = os.path.join(tempfile.mkdtemp(prefix="launcher_ckpt_"), name)  # never in the logs
    logs = {}
    for label, extra in (("first", ["--exit-interval", str(2 * every)]),
                         ("resumed", ["--load", ckpt])):
        cmd = launcher_cmd("hybrid", lay, seq, 3 * every, 29623, layers) + [
            "--save", ckpt, "--save-interval", str(every)] + extra
        status, wall, log = run(cmd, os.path.join(tmp, f"resume_{name}_{label}.log"), timeout)
        logs[label] = dict(status=status, wall_s=wall, log=log)
    loaded = re.findall(r"successfully loaded checkpoint from .* at iteration (\d+)",
                        logs["resumed"]["log"])
    losses = {k: [float(x) for x in re.findall(r"lm loss: ([0-9.Ee+-]+)", v["log"])]
              for k, v in logs.items()}
    rec = {"bench": "launcher_resume", "model_kind": "hybrid", "layout": name, **lay,
           "world": lay["tp"] * lay["cp"] * lay["dp"], "seq_length": seq, "num_layers": layers,
           "save_interval": every, "first_status": logs["first"]["status"],
           "resumed_status": logs["resumed"]["status"],
           "resumed_from_iteration": int(loaded[-1]) if loaded else None,
           "first_losses": losses["first"], "resumed_losses": losses["resumed"],
           "ok": bool(loaded) and int(loaded[-1]) == 2 * every
           and len(losses["resumed"]) == every and logs["resumed"]["status"] == "ok",
           "device": device, "date": time.strftime("%Y-%m-%d"),
           "command": "python benchmarks/launcher_vs_train.py " + " ".join(sys.argv[1:])}
    for label, v in logs.items():
        if v["status"] != "ok" or not rec["ok"]:
            rec[f"{label}_log_tail"] = error_tail(v["log"])
    return rec


def run(cmd: list, log_path: str, timeout: float) -> tuple:
    t0 = time.time()
    with open(log_path, "w") as log:
        env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            rc = proc.wait(timeout=timeout)
            status = "ok" if rc == 0 else f"exit {rc}"
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            proc.wait()
            status = "timeout"
    return status, round(time.time() - t0, 1), open(log_path).read()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", nargs="+", default=["softmax", "hybrid"],
                   choices=["softmax", "hybrid"])
    p.add_argument("--layouts", nargs="+", default=["cp4", "tp2cp2"])
    p.add_argument("--seq-length", type=int, default=16384)
    p.add_argument("--train-iters", type=int, default=12)
    p.add_argument("--timeout", type=float, default=200)
    p.add_argument("--out")
    p.add_argument("--resume-check", action="store_true",
                   help="then the launcher's save + resume on the first layout's GPUs (the "
                        "hybrid, 4 layers: one command for 9 iterations saving every 3, "
                        "stopped at 6 by --exit-interval, then rerun with --load)")
    p.add_argument("--no-compare", action="store_true", help="only the --resume-check")
    p.add_argument("--warm", type=float, default=0, metavar="SECONDS",
                   help="first run train.py for 2 iterations per model and layout, untimed, "
                        "under this limit: on a fresh machine the first run compiles the "
                        "Triton kernels both runs use (a TP 2 · CP 2 train.py run did not "
                        "reach its first step in 110 s), so the timed runs start warm")
    p.add_argument("--log-root", help="keep every run's log here (default: a temporary "
                                      "folder; the resume check's checkpoint stays in one)")
    p.add_argument("--megatron-defaults", action="store_true",
                   help="run the launcher with Megatron's defaults where train.py's differ "
                        "(the gradient sum after the backward, no fused SwiGLU), as the rows "
                        "before the eighteenth session; default: train.py's settings")
    p.add_argument("--launcher-extra", default="", metavar="FLAGS",
                   help="more Megatron flags for the launcher's runs, one string, given "
                        "with '=' (e.g. --launcher-extra=\"--use-distributed-optimizer "
                        "--overlap-param-gather\")")
    a = p.parse_args()
    extra = shlex.split(a.launcher_extra)
    tmp = a.log_root or tempfile.mkdtemp(prefix="launcher_vs_train_")
    os.makedirs(tmp, exist_ok=True)
    import torch
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    for kind in ([] if a.no_compare else a.kinds):
        for name in a.layouts:
            lay = parse_layout(name)
            world = lay["tp"] * lay["cp"] * lay["dp"]
            tokens = a.seq_length * lay["dp"]
            tag = f"{kind}_{name}"
            warm = None
            if a.warm:
                w_cmd = train_command(kind, lay, preset="1b", seq_length=a.seq_length,
                                      train_iters=2, log_dir=os.path.join(tmp, tag + "_warm"),
                                      vocab_size=SHAPE["vocab_size"], port=29620,
                                      extra=TRAIN_FLAGS + (HYBRID if kind == "hybrid" else []))
                w_status, w_wall, _ = run(w_cmd, os.path.join(tmp, tag + "_warm.log"), a.warm)
                warm = {"status": w_status, "wall_s": w_wall}
            t_cmd = train_command(kind, lay, preset="1b", seq_length=a.seq_length,
                                  train_iters=a.train_iters, log_dir=os.path.join(tmp, tag),
                                  vocab_size=SHAPE["vocab_size"], port=29621,
                                  extra=TRAIN_FLAGS + (HYBRID if kind == "hybrid" else []))
            t_status, t_wall, t_log = run(t_cmd, os.path.join(tmp, tag + "_train.log"),
                                          a.timeout)
            recs = [json.loads(x) for x in open(os.path.join(tmp, tag, "log.jsonl"))
                    ] if os.path.exists(os.path.join(tmp, tag, "log.jsonl")) else []
            steady = recs[2:] or recs
            t_tps = (sum(r["tokens_per_s"] for r in steady) / len(steady)) if steady else None
            l_cmd = launcher_cmd(kind, lay, a.seq_length, a.train_iters, 29622,
                                 match_train=not a.megatron_defaults, extra=extra)
            l_status, l_wall, l_log = run(l_cmd, os.path.join(tmp, tag + "_launcher.log"),
                                          a.timeout)
            l_tps, l_iters = launcher_tokens_per_s(l_log, tokens)
            rec = {"bench": "launcher_vs_train", "model_kind": kind, "layout": name,
                   "world": world, **lay, "seq_length": a.seq_length,
                   "train_status": t_status, "launcher_status": l_status,
                   "train_tokens_per_s_per_gpu": t_tps and t_tps / world,
                   "launcher_tokens_per_s_per_gpu": l_tps and l_tps / world,
                   "ratio": (l_tps / t_tps) if (l_tps and t_tps) else None,
                   "launcher_iterations": l_iters, "train_wall_s": t_wall,
                   "launcher_wall_s": l_wall, "warm_run": warm, "device": device,
                   "launcher_settings": "megatron_defaults" if a.megatron_defaults
                   else "match_train", "launcher_extra": a.launcher_extra or None,
                   "launcher_flags": settings_flags(not a.megatron_defaults),
                   "train_flags": TRAIN_FLAGS,
                   "date": time.strftime("%Y-%m-%d"),
                   "command": "python benchmarks/launcher_vs_train.py " + " ".join(sys.argv[1:])}
            for label, status, log in (("train", t_status, t_log), ("launcher", l_status, l_log)):
                if status != "ok":
                    rec[f"{label}_log_tail"] = error_tail(log)
            emit(rec, a.out)
    if a.resume_check:
        name = a.layouts[0]
        emit(resume_check(parse_layout(name), name, a.seq_length, tmp, a.timeout, device), a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

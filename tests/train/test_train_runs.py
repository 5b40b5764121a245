"""train.py end to end on CPU/gloo.

- Parallelism invariance: the first steps' losses of (TP, CP, DP) = (1,1,1), (1,2,1), (2,2,1),
  (1,2,2) agree within 1e-5 for every model kind, unpacked and with packed documents
  (``--packing documents``: the packed copy task) (three spawns: worlds 1, 2, 4).
- In the world-4 spawn: bad input fails on every rank before training; a checkpoint resumes
  under another CP/DP layout and is refused under another TP layout.
- In the world-4 spawn also: a checkpoint with a flipped byte is refused on every rank with
  the same error (checksums verified across ranks); ``--ckpt-step`` picks a step; the
  distributed optimizer (its parameter gather overlapped with the next forward; the default
  on GPUs) trains the same losses at CP 2 · DP 2 and TP 2 · CP 2, and its checkpoint resumes
  without it under another layout.
- Real launches (torchrun): two ``--nnodes 2`` launches rendezvous on localhost (c10d) and
  train; a SLURM-like preemption through scripts/slurm/train.sbatch (stand-in srun/scontrol,
  our torchrun launcher, a real SIGTERM to the job's processes) saves, writes the plot and
  summary, ends with one line, exits 75 and requeues; a kill in the middle of a later save
  leaves the last complete checkpoint in charge; the resumed losses equal the uninterrupted
  run's bit for bit; a truncated shard of the newest checkpoint gives one error naming it.
- A plain ``python train.py`` stopped by SIGTERM exits 75 with its plot and summary.
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import shutil

import pytest

from sp_train.launch import TrainHooks
from sp_attention.testing import Stall, finish_process, run_distributed

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
KINDS = ("softmax", "linear", "gated", "hybrid")
PACKINGS = ("none", "documents")
STEPS = 4


def _argv(kind, tp, cp, log_dir, steps=STEPS, extra=()):
    return ["--sp-model-kind", kind, "--tensor-model-parallel-size", str(tp),
            "--context-parallel-size", str(cp), "--seq-length", "32", "--global-batch-size", "4",
            "--train-iters", str(steps), "--lr-warmup-iters", "1", "--no-progress-bar",
            "--log-interval", "100", *extra] + (["--log-dir", log_dir] if log_dir else [])


def _losses(history):
    return [r["loss"] for r in history]


def _run_layouts(rank, world, tmp, layouts, extra_checks):
    import train
    out = {}
    for kind in KINDS:
        for tp, cp in layouts:
            for packing in PACKINGS:
                out[(kind, tp, cp, packing)] = _losses(train.main(_argv(
                    kind, tp, cp, f"{tmp}/{kind}{tp}{cp}{packing}",
                    extra=("--packing", packing))))
    if extra_checks:
        out["extra"] = _extra_checks(rank, tmp)
    if world == 1:
        out["bf16_dtypes"] = _bf16_param_dtypes()
    return out


def _bf16_param_dtypes():
    """A bf16 model holds every parameter in bf16, norm weights included (Megatron's
    Float16Module does the same; an fp32 norm weight keeps torch off its fused RMSNorm)."""
    import torch
    from sp_train.args import parse_args
    from sp_train.setup import build_model, init_groups
    args = parse_args(["--preset", "tiny", "--sp-model-kind", "hybrid"])
    layout = args.layout(1)
    model = build_model(args, layout, init_groups(layout), 64, bf16=True,
                        device=torch.device("cpu"))
    return {str(p.dtype) for p in model.parameters()}


def _expect_error(argv, needle):
    import train
    try:
        train.main(argv)
    except ValueError as e:
        assert needle in str(e), str(e)
        return str(e)
    raise AssertionError(f"no error for {argv}")


def _extra_checks(rank, tmp):
    """World 4: bad input on every rank; checkpoints across layouts."""
    import train
    base = _argv("softmax", 1, 2, f"{tmp}/bad")
    _expect_error(base + ["--tensor-model-parallel-size", "4"], "not divisible by TP×CP")
    _expect_error(base + ["--seq-length", "30"], "divisible by 2·CP")
    _expect_error(base + ["--tensor-model-parallel-size", "4", "--context-parallel-size", "1",
                          "--num-attention-heads", "2"], "--num-attention-heads 2 and "
                  "--num-query-groups 2 must be divisible by --tensor-model-parallel-size 4")
    _expect_error(base + ["--data-path", f"{tmp}/missing.txt"], "does not exist")
    _expect_error(base + ["--context-parallel-impl", "blelloch"], "does not fit")
    _expect_error(base + ["--recompute-granularity", "full"], "needs a GPU")
    _expect_error(base + ["--loss-impl", "liger"], "CUDA only")
    _expect_error(base + ["--overlap-param-gather"], "add --use-distributed-optimizer")   # CPU
    _expect_error(base + ["--overlap-param-gather", "--no-distributed-optimizer"],
                  "drop --no-distributed-optimizer")
    _expect_error(base + ["--recompute-granularity", "selective", "--recompute-num-layers",
                          "2"], "full only")
    ck = f"{tmp}/ck"
    # a real SIGTERM through the real handler after step STEPS - 1: save and stop
    term = TrainHooks(after_step=lambda s: os.kill(os.getpid(), signal.SIGTERM)
                      if s == STEPS - 1 else None)
    train.main(_argv("softmax", 1, 2, f"{tmp}/s", extra=["--save", ck]), hooks=term)
    # same TP, CP 2 -> 4 and DP 2 -> 1: loads and continues
    resumed = _losses(train.main(_argv("softmax", 1, 4, f"{tmp}/r",
                                       extra=["--load", ck, "--ckpt-step", str(STEPS - 1)])))
    msg = _expect_error(_argv("softmax", 2, 2, f"{tmp}/t", extra=["--load", ck]),
                        "saved with layout TP1·CP2·DP2; this run is TP2·CP2·DP1")
    bad = f"{tmp}/bad_ck"
    if rank == 0:               # one byte of one shard flipped: same size, other checksum
        shutil.copytree(ck, bad)
        shard = max((os.path.join(root, n) for root, _, names in os.walk(bad)
                     for n in names if n.endswith(".distcp")), key=os.path.getsize)
        data = bytearray(open(shard, "rb").read())
        data[len(data) // 2] ^= 1
        open(shard, "wb").write(bytes(data))
    import torch.distributed as dist
    dist.barrier()
    damaged = _expect_error(_argv("softmax", 1, 2, f"{tmp}/d", extra=["--load", bad]),
                            "does not match its checksum")
    # the distributed optimizer (CP 2 · DP 2) with its parameter gather overlapped with the
    # next forward: the same losses as the replicated one, and its checkpoint resumes without
    # it at CP 4
    zck = f"{tmp}/zck"
    zero = _losses(train.main(_argv("hybrid", 1, 2, f"{tmp}/z", extra=[
        "--use-distributed-optimizer", "--overlap-param-gather", "--save", zck,
        "--save-interval", "2"])))
    moved = _losses(train.main(_argv("hybrid", 1, 4, f"{tmp}/zr",
                                     extra=["--load", zck, "--ckpt-step", "2"])))
    # the GPUs' default (the distributed optimizer, its gather overlapped: the overlap follows
    # the flag) under TP 2 · CP 2
    tp_zero = _losses(train.main(_argv("hybrid", 2, 2, f"{tmp}/tz",
                                       extra=["--use-distributed-optimizer"])))
    return {"resumed": resumed, "msg": msg, "damaged": damaged, "zero": zero, "moved": moved,
            "tp_zero": tp_zero}


def _rel(a, b):
    return abs(a - b) / abs(b)


def test_parallelism_invariance_errors_and_layout_changes(tmp_path):
    ref = run_distributed(_run_layouts, 1, str(tmp_path / "w1"), [(1, 1)], False,
                          timeout=300)[0]
    w2 = run_distributed(_run_layouts, 2, str(tmp_path / "w2"), [(1, 2)], False,
                         timeout=300)[0]
    w4 = run_distributed(_run_layouts, 4, str(tmp_path / "w4"), [(2, 2), (1, 2)], True,
                         timeout=400)
    assert ref["bf16_dtypes"] == {"torch.bfloat16"}
    for kind in KINDS:
        for packing in PACKINGS:
            want = ref[(kind, 1, 1, packing)]
            assert len(want) == STEPS and want[-1] < want[0], (kind, packing, want)   # it trains
            for got in (w2[(kind, 1, 2, packing)], w4[0][(kind, 2, 2, packing)],
                        w4[0][(kind, 1, 2, packing)]):
                assert max(_rel(a, b) for a, b in zip(got, want)) < 1e-5, (kind, packing, got,
                                                                           want)
    extra = [w["extra"] for w in w4]
    assert len({e["msg"] for e in extra}) == 1                          # every rank, same error
    assert len({e["damaged"] for e in extra}) == 1
    resumed = extra[0]["resumed"]
    assert len(resumed) == 1 and _rel(resumed[0], ref[("softmax", 1, 1, "none")][STEPS - 1]) < 1e-5
    hybrid = ref[("hybrid", 1, 1, "none")]
    assert max(_rel(a, b) for a, b in zip(extra[0]["zero"], hybrid)) < 1e-5
    assert max(_rel(a, b) for a, b in zip(extra[0]["tp_zero"], hybrid)) < 1e-5
    assert len(extra[0]["moved"]) == STEPS - 2
    assert max(_rel(a, b) for a, b in zip(extra[0]["moved"], hybrid[2:])) < 1e-5


# --- real launches ----------------------------------------------------------------------
def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(args, env=None, nnodes=1, nproc=2, port=None, module="torch.distributed.run",
              script=os.path.join(ROOT, "train.py")):
    cmd = [sys.executable, "-m", module, "--nproc-per-node", str(nproc)]
    if nnodes > 1:
        cmd += ["--nnodes", str(nnodes), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "sp-test"]
    else:
        cmd += ["--standalone"]
    e = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.Popen(cmd + [script] + args, cwd=ROOT, env=e,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(p, timeout=240):
    # timeout: a hang detector (seconds in which torchrun and its workers used no CPU)
    out, _ = finish_process(p, timeout)
    return p.returncode, out


def _log(path):
    with open(path) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def _tree(pid):
    """``pid`` and every process below it."""
    from sp_train.torchrun import children
    out = [pid]
    for c in children(pid):
        out += _tree(c)
    return out


def _wait_for_steps(path, k, proc, timeout=240):
    stall = Stall(timeout, lambda: [proc.pid], tree=True)       # a hang detector
    while proc.poll() is None and stall.expired() is None:
        if os.path.exists(path) and sum(1 for _ in open(path)) >= k:
            return
        time.sleep(0.5)
    raise AssertionError(f"no {k} steps in {path} (process status {proc.poll()})")


def _fake_slurm(tmp_path, port):
    """scontrol and srun stand-ins: the node list is this host; srun runs its command here."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "scontrol").write_text(
        '#!/bin/sh\nif [ "$1" = requeue ]; then echo "$@" > ' + str(tmp_path / "requeue.txt")
        + '; exit 0; fi\necho localhost\n')
    (bindir / "srun").write_text('#!/bin/sh\nwhile [ "${1#--}" != "$1" ]; do shift; done\n'
                                 'exec "$@"\n')        # drop srun's options, run the task
    for f in bindir.iterdir():
        f.chmod(0o755)
    return dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", OMP_NUM_THREADS="1",
                SLURM_JOB_NODELIST="localhost", SLURM_JOB_NUM_NODES="1", SLURM_JOB_ID="4242",
                SLURM_GPUS_ON_NODE="2", RDZV_PORT=str(port), PYTHON=sys.executable,
                TRAIN_PY=os.path.join(ROOT, "train.py"), REQUEUE="1")


def _preempt_through_sbatch(tmp_path, argv):
    """scripts/slurm/train.sbatch with our torchrun launcher; once 3 steps are logged, SIGTERM
    to every process of the job, as SLURM's preemption sends it. Returns (status, output)."""
    env = _fake_slurm(tmp_path, _port())
    p = subprocess.Popen(["bash", os.path.join(ROOT, "scripts", "slurm", "train.sbatch"), *argv],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    _wait_for_steps(argv[argv.index("--log-dir") + 1] + "/log.jsonl", 3, p)
    for pid in _tree(p.pid):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    return _finish(p)


def test_torchrun_two_nodes_sigterm_resume_and_kill_mid_save(tmp_path):
    n = 30
    common = _argv("softmax", 1, 2, None, steps=n)

    def args(name, *extra):
        return common + ["--log-dir", str(tmp_path / name), *extra]

    # two "nodes" on localhost: one worker each, c10d rendezvous -> world 2 (CP 2)
    port = _port()
    nodes = [_torchrun(args("ref"), nnodes=2, nproc=1, port=port) for _ in range(2)]
    results = [_finish(p) for p in nodes]
    assert all(rc == 0 for rc, _ in results), results[0][1][-3000:] + results[1][1][-3000:]
    assert "TP1·CP2·DP1 (world 2)" in results[0][1] + results[1][1]
    ref = _log(tmp_path / "ref" / "log.jsonl")
    assert sorted(ref) == list(range(1, n + 1)) and ref[n] < ref[1]

    # preemption: saves, plot + summary, one last line, status 75, the job requeued
    ck = str(tmp_path / "ck")
    rc, out = _preempt_through_sbatch(tmp_path, args("a", "--save", ck, "--save-interval", "2"))
    m = re.search(r"\nstopped by SIGTERM after step (\d+): checkpoint (\S+), loss curve (\S+); "
                  rf"resume with --load {ck}\n", out)
    assert rc == 75 and m and "Traceback" not in out, (rc, out[-3000:])
    stop = int(m.group(1))
    assert m.group(2) == os.path.join(ck, f"iter_{stop:07d}") and 3 <= stop < n
    assert m.group(3) == str(tmp_path / "a" / "loss.png") and os.path.getsize(m.group(3)) > 0
    assert json.load(open(tmp_path / "a" / "summary.json"))["loss_last"] == _log(
        tmp_path / "a" / "log.jsonl")[stop]
    assert out.rstrip().splitlines()[-1].startswith("sp-train: train.py saved a checkpoint "
                                                    "and stopped (status 75): requeueing")
    assert (tmp_path / "requeue.txt").read_text().split() == ["requeue", "4242"]
    assert open(os.path.join(ck, "latest")).read().strip() == str(stop)

    # a kill in the middle of the next save: the previous checkpoint stays in charge
    rc, out = _finish(_torchrun([str(stop + 1)] + args("b", "--load", ck, "--save", ck,
                                                       "--save-interval", "1"),
                                script=os.path.join(HERE, "train_die_in_save.py")))
    assert rc != 0 and os.path.isdir(os.path.join(ck, f"iter_{stop + 1:07d}.tmp")), out[-3000:]
    assert open(os.path.join(ck, "latest")).read().strip() == str(stop)
    rc, out = _finish(_torchrun(args("c", "--load", ck, "--save", ck)))
    assert rc == 0 and f"resumed from {ck}/iter_{stop:07d}" in out, out[-3000:]
    a, b, c = (_log(tmp_path / x / "log.jsonl") for x in "abc")
    assert sorted(c) == list(range(stop + 1, n + 1))
    assert [a[s] for s in range(1, stop + 1)] == [ref[s] for s in range(1, stop + 1)]
    assert b[stop + 1] == ref[stop + 1]                                 # bit-identical
    assert [c[s] for s in range(stop + 1, n + 1)] == [ref[s] for s in range(stop + 1, n + 1)]
    assert not os.path.exists(os.path.join(ck, f"iter_{stop + 1:07d}.tmp"))  # cleaned up

    # the newest checkpoint damaged: one error naming it, the file and the way back
    newest = os.path.join(ck, f"iter_{n:07d}")
    shard = max((os.path.join(newest, f) for f in os.listdir(newest) if f.endswith(".distcp")),
                key=os.path.getsize)
    open(shard, "r+b").truncate(os.path.getsize(shard) // 2)
    rc, out = _finish(_torchrun(args("d", "--load", ck),
                                module="sp_train.torchrun"))
    assert rc == 2 and out.count(f"checkpoint {newest} is damaged") == 1, out[-3000:]
    assert os.path.basename(shard) in out and f"--ckpt-step {stop}" in out, out[-3000:]
    assert "Traceback" not in out and "EOFError" not in out, out[-3000:]


def test_plain_python_sigterm_saves_plots_and_exits_75(tmp_path):
    log_dir = str(tmp_path / "run")
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"),
                          *_argv("softmax", 1, 1, log_dir, steps=400),
                          "--save", str(tmp_path / "ck"),
                          # auto recompute resolves to none on CPU (Megatron's needs CUDA)
                          "--recompute-granularity", "auto"], cwd=ROOT,
                         env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    _wait_for_steps(f"{log_dir}/log.jsonl", 2, p)
    p.send_signal(signal.SIGTERM)
    rc, out = _finish(p)
    last = out.rstrip().splitlines()[-1]
    assert rc == 75 and last.startswith("stopped by SIGTERM after step "), (rc, out[-3000:])
    assert f"loss curve {log_dir}/loss.png" in last and "Traceback" not in out
    assert os.path.exists(f"{log_dir}/loss.png") and os.path.exists(f"{log_dir}/summary.json")
    assert "recompute auto: none (on CPU)" in out and "| no recompute," in out, out[-3000:]


def test_sbatch_as_two_nodes_on_one_host_trains_and_resumes(tmp_path):
    """scripts/slurm/one_host.sh runs the real sbatch script as 2 nodes × 1 process on this
    host (stand-in srun starts one launcher per "node", c10d rendezvous at the head node): it
    trains and saves, and a second job resumes from the checkpoint to the end."""
    ck, env = str(tmp_path / "ck"), dict(os.environ, OMP_NUM_THREADS="1",
                                         PYTHON=sys.executable, RDZV_PORT=str(_port()))
    script = os.path.join(ROOT, "scripts", "slurm", "one_host.sh")

    def job(steps, log, *extra):
        p = subprocess.Popen(["bash", script, "2", "1", *_argv("softmax", 1, 2, str(tmp_path / log),
                                                             steps=steps),
                              "--save", ck, "--save-interval", "2", *extra],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        return _finish(p)
    rc, out = job(4, "a")
    assert rc == 0 and "sp-train: 2 node(s) x 1 GPU(s)" in out, out[-3000:]
    assert "TP1·CP2·DP1 (world 2)" in out, out[-3000:]
    assert sorted(_log(tmp_path / "a" / "log.jsonl")) == [1, 2, 3, 4]
    env["RDZV_PORT"] = str(_port())
    rc, out = job(6, "b", "--load", ck)
    assert rc == 0 and f"resumed from {ck}/iter_0000004" in out, out[-3000:]
    assert sorted(_log(tmp_path / "b" / "log.jsonl")) == [5, 6]

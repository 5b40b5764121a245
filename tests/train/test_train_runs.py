"""train.py end to end on CPU/gloo.

- Parallelism invariance: the first steps' losses of (TP, CP, DP) = (1,1,1), (1,2,1), (2,2,1),
  (1,2,2) agree within 1e-5 for every model kind (three spawns: worlds 1, 2, 4).
- In the world-4 spawn: bad input fails on every rank before training; a checkpoint resumes
  under another CP/DP layout and is refused under another TP layout.
- Real launches (torchrun): two ``--nnodes 2`` launches rendezvous on localhost (c10d) and
  train; a SIGTERM at step k saves and exits; a kill in the middle of a later save leaves the
  last complete checkpoint in charge; the resumed losses equal the uninterrupted run's bit for
  bit.
"""
import json
import os
import socket
import subprocess
import sys

import pytest

from sp_attention.testing import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KINDS = ("softmax", "linear", "hybrid")
STEPS = 4


def _argv(kind, tp, cp, log_dir, steps=STEPS, extra=()):
    return ["--model-kind", kind, "--tensor-model-parallel-size", str(tp),
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
            out[(kind, tp, cp)] = _losses(train.main(_argv(kind, tp, cp, f"{tmp}/{kind}{tp}{cp}")))
    if extra_checks:
        out["extra"] = _extra_checks(rank, tmp)
    if world == 1:
        out["bf16_dtypes"] = _bf16_param_dtypes()
    return out


def _bf16_param_dtypes():
    """A bf16 model holds every parameter in bf16, norm weights included (Megatron's
    Float16Module does the same; an fp32 norm weight keeps torch off its fused RMSNorm)."""
    import torch
    from megatron_patches.trainer.args import parse_args
    from megatron_patches.trainer.setup import build_model, init_groups
    args = parse_args(["--preset", "tiny", "--model-kind", "hybrid"])
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
    _expect_error(base + ["--tensor-model-parallel-size", "3"], "not divisible by TP×CP")
    _expect_error(base + ["--seq-length", "30"], "divisible by 2·CP")
    _expect_error(base + ["--tensor-model-parallel-size", "4", "--context-parallel-size", "1",
                          "--num-attention-heads", "2"], "--num-attention-heads 2 is not "
                  "divisible by TP = 4")
    _expect_error(base + ["--data-path", f"{tmp}/missing.txt"], "does not exist")
    _expect_error(base + ["--context-parallel-impl", "blelloch"], "does not fit")
    _expect_error(base + ["--recompute-granularity", "full"], "needs a GPU")
    _expect_error(base + ["--loss-impl", "liger"], "CUDA only")
    _expect_error(base + ["--recompute-granularity", "selective", "--recompute-num-layers",
                          "2"], "full only")
    ck = f"{tmp}/ck"
    os.environ["SP_TRAIN_TEST_SIGTERM_AT"] = str(STEPS - 1)       # SIGTERM: save and stop
    try:
        train.main(_argv("softmax", 1, 2, f"{tmp}/s", extra=["--save", ck]))
    finally:
        del os.environ["SP_TRAIN_TEST_SIGTERM_AT"]
    # same TP, CP 2 -> 4 and DP 2 -> 1: loads and continues
    resumed = _losses(train.main(_argv("softmax", 1, 4, f"{tmp}/r", extra=["--load", ck])))
    msg = _expect_error(_argv("softmax", 2, 2, f"{tmp}/t", extra=["--load", ck]),
                        "saved with layout TP1·CP2·DP2; this run is TP2·CP2·DP1")
    return {"resumed": resumed, "msg": msg}


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
        want = ref[(kind, 1, 1)]
        assert len(want) == STEPS and want[-1] < want[0], (kind, want)   # it trains
        for got in (w2[(kind, 1, 2)], w4[0][(kind, 2, 2)], w4[0][(kind, 1, 2)]):
            assert max(_rel(a, b) for a, b in zip(got, want)) < 1e-5, (kind, got, want)
    extra = [w["extra"] for w in w4]
    assert len({e["msg"] for e in extra}) == 1                          # every rank, same error
    resumed = extra[0]["resumed"]
    assert len(resumed) == 1 and _rel(resumed[0], ref[("softmax", 1, 1)][STEPS - 1]) < 1e-5


# --- real launches ----------------------------------------------------------------------
def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(args, env=None, nnodes=1, nproc=2, port=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    if nnodes > 1:
        cmd += ["--nnodes", str(nnodes), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "sp-test"]
    else:
        cmd += ["--standalone"]
    e = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.Popen(cmd + [os.path.join(ROOT, "train.py")] + args, cwd=ROOT, env=e,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(p, timeout=240):
    out, _ = p.communicate(timeout=timeout)
    return p.returncode, out


def _log(path):
    with open(path) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def test_torchrun_two_nodes_sigterm_resume_and_kill_mid_save(tmp_path):
    n = 8
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

    ck = str(tmp_path / "ck")
    rc, out = _finish(_torchrun(args("a", "--save", ck, "--save-interval", "2"),
                                env={"SP_TRAIN_TEST_SIGTERM_AT": "3"}))
    assert rc == 0 and "stopped by a signal after step 3" in out, out[-3000:]
    assert sorted(os.listdir(ck)) == ["iter_0000002", "iter_0000003", "latest"]
    rc, out = _finish(_torchrun(args("b", "--load", ck, "--save", ck, "--save-interval", "2"),
                                env={"SP_TRAIN_TEST_DIE_IN_SAVE": "4"}))
    assert rc != 0 and os.path.isdir(os.path.join(ck, "iter_0000004.tmp")), out[-3000:]
    assert open(os.path.join(ck, "latest")).read().strip() == "3"
    rc, out = _finish(_torchrun(args("c", "--load", ck, "--save", ck)))
    assert rc == 0 and "resumed from" in out and "iter_0000003" in out, out[-3000:]
    a, b, c = (_log(tmp_path / x / "log.jsonl") for x in "abc")
    assert sorted(c) == list(range(4, n + 1))
    assert [a[s] for s in (1, 2, 3)] == [ref[s] for s in (1, 2, 3)]    # bit-identical
    assert b[4] == ref[4] and [c[s] for s in range(4, n + 1)] == [ref[s] for s in range(4, n + 1)]
    assert not os.path.exists(os.path.join(ck, "iter_0000004.tmp"))     # cleaned by a later save

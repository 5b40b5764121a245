"""train.py's pieces that need no process group: arguments and their errors, data, SLURM
environment mapping and the sbatch script (fake SLURM), atomic checkpoints in one process,
learning rate, FLOP count, logs and the loss PNG."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from sp_train import checkpoint as ckpt
from sp_train.args import TrainArgs, default_context_parallel_size, parse_args
from sp_train.data import CopyTask, TokenFile, pad_vocab
from sp_train.launch import first_host, map_slurm_env
from sp_train.optim import MasterAdamW, lr_at
from sp_train.progress import flops_per_token, plot_losses, read_log

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --- arguments: every bad input names its fix ------------------------------------------------
@pytest.mark.parametrize("argv, world, needle", [
    (["--tensor-model-parallel-size", "2", "--context-parallel-size", "2"], 6,
     "not divisible by TP×CP"),
    (["--seq-length", "250", "--context-parallel-size", "2"], 2, "multiple of 4"),
    (["--global-batch-size", "6", "--context-parallel-size", "1"], 4, "multiple of"),
])
def test_layout_errors_name_the_fix(argv, world, needle):
    args = parse_args(argv)
    with pytest.raises(ValueError, match=needle):
        args.layout(world)


@pytest.mark.parametrize("argv, needle", [
    (["--data-path", "/nonexistent/corpus.jsonl"], "does not exist"),
    (["--sp-model-kind", "linear", "--context-parallel-impl", "ring_ag"],
     "the softmax schedule is --softmax-cp-preset"),
    (["--sp-model-kind", "softmax", "--context-parallel-impl", "blelloch"], "does not fit"),
    (["--load", "/nonexistent/ckpt"], "is not a directory"),
    (["--hidden-size", "62"], "not divisible by --num-attention-heads"),
    (["--sp-model-kind", "hybrid", "--num-layers", "6", "--sp-hybrid-pattern", "LLLS"],
     "must divide 6: e.g. 'LLS'"),
    (["--sp-model-kind", "hybrid", "--sp-hybrid-pattern", "LLLS"], "must divide 2: e.g. 'LS'"),
    (["--context-parallel-impl", "megatron"], "Megatron-LM launcher"),
    (["--tensor-model-parallel-size", "3"], "must be divisible by --tensor-model-parallel-size 3"),
    (["--sp-model-kind", "linear", "--softmax-cp-preset", "ring_ag"], "no softmax layer"),
    (["--preset", "tiny-linear"], "invalid choice"),
])
def test_argument_errors_name_the_fix(argv, needle):
    with pytest.raises(ValueError, match=needle):
        parse_args(argv)


def test_packing_defaults():
    """--packing: documents for --data-path, none for the copy task; a packed micro-batch is
    one row unless --micro-batch-size says more (Megatron's rule for packed sequences)."""
    assert parse_args([]).packing == "none"
    a = parse_args(["--packing", "documents"])
    assert a.layout(4).micro_batch_size == 1 and a.layout(4).num_micro_batches == 8
    assert parse_args(["--packing", "documents", "--micro-batch-size", "4"]).layout(
        4).micro_batch_size == 4
    assert TrainArgs(data_path=__file__).packing == "documents"
    with pytest.raises(ValueError, match="invalid choice"):
        parse_args(["--packing", "rows"])


def test_defaults_and_layout():
    a = parse_args([])
    assert (a.sp_model_kind, a.num_layers, a.hidden_size, a.seq_length) == ("softmax", 2, 64, 256)
    lay = a.layout(4)
    assert (lay.tp, lay.cp, lay.dp, lay.micro_batch_size, lay.num_micro_batches) == (1, 2, 2, 8, 1)
    assert a.layout(1).cp == 1          # plain `python train.py` runs as one process
    lin = parse_args(["--sp-model-kind", "linear"])
    assert lin.hidden_size // lin.num_attention_heads >= 32   # linear needs head dim >= 32
    hyb = parse_args(["--sp-model-kind", "hybrid", "--num-layers", "4"])
    assert hyb.layer_kinds() == "LLLS"
    acc = parse_args(["--micro-batch-size", "2", "--context-parallel-size", "1"]).layout(2)
    assert (acc.dp, acc.num_micro_batches) == (2, 4)
    big = parse_args(["--preset", "1b"])
    assert (big.num_layers, big.hidden_size, big.num_query_groups) == (16, 2048, 8)
    assert parse_args(["--save", "/tmp/x_never", "--load", "/tmp/x_never"]).load  # requeue


def test_default_layout_uses_cp_at_any_world_size():
    """No --context-parallel-size: CP >= 2 at every world size >= 2 (TP1·CP2·DP2 at 4, the
    quickstart); the preset's sequence length rounds up to the layout's chunks."""
    got = {w: parse_args([]).layout(w) for w in range(1, 9)}
    assert {w: (x.cp, x.dp) for w, x in got.items()} == {
        1: (1, 1), 2: (2, 1), 3: (3, 1), 4: (2, 2), 5: (5, 1), 6: (6, 1), 7: (7, 1), 8: (2, 4)}
    assert default_context_parallel_size(6, 48) == 2 and default_context_parallel_size(9, 16) == 9
    assert default_context_parallel_size(4, 16, 8) == 2 and default_context_parallel_size(4, 8, 8) == 4
    a = parse_args([])
    assert (a.layout(3).cp, a.seq_length) == (3, 258)            # 256 -> a multiple of 2·3
    assert (a.layout(4).cp, a.seq_length) == (2, 256)
    assert parse_args(["--tensor-model-parallel-size", "2"]).layout(6).cp == 3


@pytest.mark.parametrize("argv, world, needle", [
    (["--context-parallel-size", "1"], 3,
     r"--global-batch-size \(default\) 16 is not divisible by DP = 3 .*multiple of 3 or another "
     "--context-parallel-size"),
    (["--global-batch-size", "10", "--micro-batch-size", "2", "--context-parallel-size", "1"], 3,
     r"--global-batch-size 10 is not divisible by --micro-batch-size × DP = 2×3"),
    (["--seq-length", "256"], 3, r"not divisible by 2·CP = 6 .*CP 3 is the default for this "
     "world size; --context-parallel-size picks another"),
])
def test_layout_errors_name_the_flags_given_or_the_default(argv, world, needle):
    with pytest.raises(ValueError, match=needle) as e:
        parse_args(argv).layout(world)
    if "--micro-batch-size" not in argv:
        assert "micro-batch" not in str(e.value)


# --- data ---------------------------------------------------------------------------------
def test_copy_task_is_deterministic_and_dp_splits_the_global_batch():
    d = CopyTask(16, 8, seed=3)
    tok, lab, mask, cu = d.batch(5, 4)
    assert cu is None
    assert tok.shape == lab.shape == mask.shape == (4, 16)
    assert torch.equal(tok[:, 1:], lab[:, :-1])                      # labels are shifted
    assert torch.equal(lab[:, 8:], tok[:, :8])                        # the copy
    assert tok[0, 8] == d.sep and mask[:, :8].sum() == 0 and mask[:, 8:].all()
    halves = [d.batch(5, 4, r, 2) for r in range(2)]
    assert torch.equal(torch.cat([h[0] for h in halves]), tok)       # DP sees the same batch
    assert not torch.equal(d.batch(6, 4)[0], tok)
    assert d.vocab_size % 128 == 0 and pad_vocab(300, 2) == 384 and pad_vocab(300, 5) == 640


def test_packed_copy_task():
    """Rows of copy documents of random lengths (a block of p − 1 random tokens and a
    separator, repeated; p = T/4): boundaries per row, labels the next token inside each
    document, the loss on every repeat (each the token p back), DP sees the same batch."""
    d = CopyTask(64, 8, seed=3, packed=True)
    rows = d.batch(5, 4)
    p = d.period
    assert p == 16 and rows.tokens.shape == (4, 64)
    for r, cu in enumerate(rows.cu_seqlens):
        assert cu[0] == 0 and cu[-1] == 64 and len(cu) >= 3          # several documents
        for a, b in zip(cu[:-1], cu[1:]):
            doc, lab = rows.tokens[r, a:b], rows.labels[r, a:b]
            assert lab[-1] == -100 and torch.equal(lab[:-1], doc[1:])
            loss = rows.loss_mask[r, a:b].bool()
            if loss.any():                 # a copy document: the loss is the repeats
                assert b - a >= p + p // 2 and doc[p - 1] == d.sep
                assert loss.nonzero().squeeze(1).tolist() == list(range(p - 1, b - a - 1))
                t = torch.arange(p - 1, b - a - 1)
                assert torch.equal(lab[t], doc[t + 1 - p])            # the token p back
            else:                          # what is left: separators, no loss
                assert b - a < p + p // 2 and bool((doc == d.sep).all())
    halves = [d.batch(5, 4, r, 2) for r in range(2)]
    assert torch.equal(torch.cat([h.tokens for h in halves]), rows.tokens)
    assert halves[1].cu_seqlens == rows.cu_seqlens[2:]
    assert "packed documents" in d.description


def test_packed_text_data_and_micro_batches(tmp_path):
    """--packing documents on a file: a sample's documents end at the end-of-document token,
    which predicts nothing; a micro-batch's rows are cut by their plan (CP 1: in order)."""
    from sp_train.data import Rows, packed_micro_batch
    from sp_attention import build_sp_context
    js = tmp_path / "d.jsonl"
    js.write_text("\n".join(json.dumps({"text": "ab" * (i + 1)}) for i in range(30)))
    d = TokenFile(str(js), 16, seed=0, packed=True)
    rows = d.batch(0, 2)
    for r, cu in enumerate(rows.cu_seqlens):
        ends = (rows.tokens[r] == 256).nonzero().squeeze(1).tolist()
        assert cu == sorted({0, 16} | {e + 1 for e in ends})
        assert all(rows.labels[r, e] == -100 and rows.loss_mask[r, e] == 0 for e in ends)
    ctx = build_sp_context(None)
    tok, pos, lab, msk, params = packed_micro_batch(rows, slice(0, 2), ctx, "cpu")
    assert torch.equal(tok[0], rows.tokens.reshape(-1))           # one rank: the rows in order
    assert params.qkv_format == "thd" and params.cu_seqlens_q[-1] == 32
    starts = set(params.cu_seqlens_q[:-1].tolist())
    assert all((pos[0, t] == 0) == (t in starts) for t in range(32))
    assert isinstance(rows, Rows)


@pytest.mark.parametrize("packing", ["none", "documents"])
def test_host_micro_batches_then_upload_are_the_step_s_batches(packing):
    """train.py makes the next step's micro-batches on the host while the GPU runs the step
    before and counts their loss tokens there: the same tensors, and the same count, as the
    uploaded batches give; packing parameters stay on the host."""
    from types import SimpleNamespace
    from sp_attention import build_sp_context
    from sp_train.data import host_micro_batches, local_micro_batches, upload_micro_batches
    from sp_train.loss import local_token_count
    args = parse_args(["--seq-length", "64", "--global-batch-size", "4", "--micro-batch-size",
                       "2", "--packing", packing])
    data = CopyTask(64, args.copy_vocab, 0, 1, None, packing == "documents")
    layout = SimpleNamespace(dp=1, micro_batch_size=2, num_micro_batches=2)
    groups = SimpleNamespace(dp_rank=0)
    ctx = build_sp_context(None)
    host = host_micro_batches(data, 3, args, layout, groups, ctx)
    up = upload_micro_batches(host, torch.device("cpu"))
    ref = local_micro_batches(data, 3, args, layout, groups, ctx, torch.device("cpu"))
    assert len(host) == len(ref) == 2
    for h, u, r in zip(host, up, ref):
        for a, b, c in zip(h[:4], u[:4], r[:4]):
            assert a.device.type == "cpu" and torch.equal(a, b) and torch.equal(b, c)
        assert (h[4] is None) == (packing == "none") and u[4] is h[4]
    assert float(local_token_count(host)) == float(local_token_count(ref)) > 0


def test_text_and_jsonl_data(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("hello world, " * 50)
    d = TokenFile(str(txt), 16, seed=1)
    tok, lab, mask, _ = d.batch(0, 4, 1, 2)
    assert tok.shape == (2, 16) and torch.equal(tok[:, 1:], lab[:, :-1]) and mask.all()
    assert d.vocab_size == 384 and int(tok.max()) <= 256
    assert torch.equal(TokenFile(str(txt), 16, seed=1).batch(7, 4)[0], d.batch(7, 4)[0])
    js = tmp_path / "b.jsonl"
    js.write_text("\n".join(json.dumps({"text": f"doc {i} " * 9}) for i in range(20)))
    assert TokenFile(str(js), 8, seed=0).num_samples > 10
    bad = tmp_path / "c.jsonl"
    bad.write_text('{"body": 1}\n')
    with pytest.raises(ValueError, match="text"):
        TokenFile(str(bad), 8, seed=0)
    with pytest.raises(ValueError, match="shorter --seq-length"):
        TokenFile(str(txt), 100000, seed=0)


def test_data_errors_name_file_and_line_and_bytes_are_explicit(tmp_path):
    """Invalid text is an error naming the file and line unless --data-encoding bytes."""
    import random
    junk = tmp_path / "junk.txt"
    junk.write_bytes(b"line one\nline two \xff\n" + random.Random(0).randbytes(20000))
    with pytest.raises(ValueError, match=rf"{junk}:2: not valid UTF-8 .*--data-encoding bytes"):
        TokenFile(str(junk), 16, seed=0)
    raw = TokenFile(str(junk), 16, seed=0, encoding="bytes")        # asked for: raw bytes
    assert raw.tokens.numel() == junk.stat().st_size + 1 and "raw bytes" in raw.description
    js = tmp_path / "bad.jsonl"
    js.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=rf"{js}:2: not valid UTF-8"):
        TokenFile(str(js), 2, seed=0)
    assert TokenFile(str(js), 2, seed=0, encoding="bytes").tokens.tolist() == (
        list(b"fine") + [256] + list(b"caf\xe9") + [256])
    js.write_text('{"text": "fine"}\n{"text": "unterminated\n')
    with pytest.raises(ValueError, match=rf"{js}:2: not valid JSON \(Unterminated string"):
        TokenFile(str(js), 2, seed=0)
    for body in ("", "\n\n", '{"text": ""}\n'):
        empty = tmp_path / ("empty.jsonl" if body else "empty.txt")
        empty.write_text(body)
        with pytest.raises(ValueError, match=f"{empty} holds no text"):
            TokenFile(str(empty), 2, seed=0)
    with pytest.raises(ValueError, match="--data-encoding 'latin-1'"):
        TrainArgs(data_encoding="latin-1")
    with pytest.raises(ValueError, match="needs text"):
        parse_args(["--data-encoding", "bytes", "--tokenizer-model", "gpt2"])
    assert parse_args(["--data-encoding", "bytes"]).data_encoding == "bytes"


# --- launch / SLURM -------------------------------------------------------------------------
def test_slurm_env_mapping():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
           "SLURM_NTASKS_PER_NODE": "8(x2)", "SLURM_JOB_NODELIST": "gpu[007-008]",
           "SLURM_JOB_ID": "123456"}
    out = map_slurm_env(env)
    assert out == {"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8",
                   "MASTER_ADDR": "gpu007", "MASTER_PORT": str(20000 + 123456 % 20000)}
    assert map_slurm_env(dict(env, RANK="0")) == {}                  # torchrun's variables win
    assert map_slurm_env({}) == {}
    assert "MASTER_ADDR" not in map_slurm_env(dict(env, MASTER_ADDR="h"))
    assert first_host("node1") == "node1" and first_host("a[3-5,9],b2") == "a3"


def test_stop_exit_statuses(monkeypatch):
    """75 after SIGTERM (requeue), 130 after Ctrl-C, 0 otherwise; 0 under torchrun, whose
    agent reads any other worker status as a crash (our launcher returns the stop's)."""
    import signal
    from sp_train.launch import StopSignals
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    s = StopSignals()
    s.restore()
    assert s.exit_status == 0 and s.name == "no signal"
    s.stopped_by = signal.SIGTERM
    assert s.exit_status == 75 and s.name == "SIGTERM"
    s.stopped_by = signal.SIGINT
    assert s.exit_status == 130
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert s.exit_status == 0


def test_stop_wait_ends_at_a_signal_or_the_timeout():
    """``StopSignals.wait``: a worker that leaves a bad-input line to its node's first rank
    waits for the agent's SIGTERM (sent once that rank has said it and exited), bounded."""
    import signal
    import threading
    import time
    from sp_train.launch import StopSignals
    s = StopSignals()
    try:
        t0 = time.monotonic()
        assert not s.wait(0.2) and time.monotonic() - t0 >= 0.2
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM)).start()
        t0 = time.monotonic()
        assert s.wait(30) and s.signum == signal.SIGTERM and time.monotonic() - t0 < 10
    finally:
        s.restore()


def _fake_slurm(tmp_path, hostnames='echo nodeA\necho nodeB'):
    """Stand-in scontrol/srun that record their arguments; the environment to run with."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "scontrol").write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] || exit 1\n'
                                     f'{hostnames}\n')
    (bindir / "srun").write_text('#!/bin/sh\necho "MASTER=$MASTER_ADDR:$MASTER_PORT" '
                                 f'> {tmp_path}/srun.txt\necho "$@" >> {tmp_path}/srun.txt\n')
    for f in bindir.iterdir():
        f.chmod(0o755)
    return dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="node[A-B]",
                SLURM_JOB_NUM_NODES="2", SLURM_JOB_ID="4242", SLURM_GPUS_ON_NODE="4",
                SLURM_SUBMIT_DIR="/repo")


SBATCH = os.path.join(ROOT, "scripts", "slurm", "train.sbatch")


def test_sbatch_script_with_fake_slurm(tmp_path):
    """Runs the real sbatch script with stand-in scontrol/srun that record their arguments."""
    env = _fake_slurm(tmp_path)
    subprocess.run(["bash", SBATCH, "--preset", "1b"], env=env, check=True, capture_output=True)
    lines = (tmp_path / "srun.txt").read_text().splitlines()
    assert lines[1] == ("--ntasks-per-node=1 --kill-on-bad-exit=1 python -m "
                        "sp_train.torchrun --nnodes 2 "
                        "--nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint nodeA:24242 "
                        "--rdzv-id 4242 /repo/train.py --preset 1b")
    subprocess.run(["bash", SBATCH], env=dict(env, LAUNCHER="srun"), check=True,
                   capture_output=True)
    lines = (tmp_path / "srun.txt").read_text().splitlines()
    assert lines == ["MASTER=nodeA:24242",
                     "--ntasks-per-node=4 --kill-on-bad-exit=1 python /repo/train.py"]


def test_sbatch_head_node_does_not_depend_on_pipe_timing(tmp_path):
    """The head node comes from scontrol's whole output: `scontrol | head -n 1` under
    pipefail failed with SIGPIPE (141) now and then for two hosts, and always for many."""
    many = _fake_slurm(tmp_path, hostnames='seq -f "node%g" 1 20000')
    for _ in range(3):
        out = subprocess.run(["bash", SBATCH], env=many, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert "--rdzv-endpoint node1:24242" in (tmp_path / "srun.txt").read_text()
    env = _fake_slurm(tmp_path)     # two hosts, the head-node logic 100 times in one shell
    loop = f'for i in $(seq 100); do bash "{SBATCH}" > /dev/null || exit $?; done'
    out = subprocess.run(["bash", "-c", loop], env=env, capture_output=True, text=True)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])


# --- checkpoints (one process; the multi-process kill/resume runs in test_train_runs) -------
def _model_and_opt(seed):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    o = MasterAdamW(list(m.named_parameters()), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1,
                    tp_group=None, tp_rank=0)
    return m, o


def _steps(m, o, n, start=0):
    losses = []
    for i in range(start, start + n):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(i))
        loss = m(x).pow(2).mean()
        loss.backward()
        o.step(lr_at(i, 1e-2, 1e-3, 2, 10), 1.0)
        losses.append(loss.item())
    return losses


def test_checkpoint_atomic_resume_and_half_written(tmp_path):
    meta = {"tp": 1, "cp": 2, "dp": 1, "model": {"hidden_size": 8}}
    m, o = _model_and_opt(0)
    ref = _steps(m, o, 6)
    m, o = _model_and_opt(0)
    _steps(m, o, 3)
    root = str(tmp_path / "ck")
    ckpt.save_checkpoint(root, 3, m, o, tp_rank=0, meta=meta, group=None)
    # a save killed after writing its shards leaves a .tmp dir: ignored
    os.makedirs(os.path.join(root, "iter_0000005.tmp"))
    assert ckpt.find_latest(root).endswith("iter_0000003")
    m2, o2 = _model_and_opt(1)                                        # different init
    assert ckpt.load_checkpoint(ckpt.find_latest(root), m2, o2, tp_rank=0, group=None) == 3
    assert _steps(m2, o2, 3, start=3) == ref[3:]                      # bit-identical
    assert ckpt.find_latest(str(tmp_path / "none")) is None
    info = ckpt.read_meta(ckpt.find_latest(root))
    ckpt.check_compatible(info, "p", tp=1, cp=4, dp=2, model={"hidden_size": 8})  # CP/DP free
    with pytest.raises(ValueError, match=r"TP1·CP2·DP1; this run is TP2·CP2·DP1.*"
                                         r"--tensor-model-parallel-size 1"):
        ckpt.check_compatible(info, "p", tp=2, cp=2, dp=1, model={"hidden_size": 8})
    with pytest.raises(ValueError, match="different model"):
        ckpt.check_compatible(info, "p", tp=1, cp=2, dp=1, model={"hidden_size": 16})


def _largest_shard(path):
    return max((os.path.join(path, n) for n in os.listdir(path) if n.endswith(".distcp")),
               key=os.path.getsize)


def test_damaged_checkpoint_is_named_with_the_way_back(tmp_path):
    """Every save records its files' sizes and CRC-32s; a damaged checkpoint raises one
    CheckpointError naming the directory, the file and --ckpt-step of the previous one."""
    meta = {"tp": 1, "cp": 1, "dp": 1, "model": {}}
    m, o = _model_and_opt(0)
    root = str(tmp_path / "ck")
    for step in (2, 3):
        _steps(m, o, 1)
        ckpt.save_checkpoint(root, step, m, o, tp_rank=0, meta=meta, group=None)
    newest, older = ckpt.find_latest(root), os.path.join(root, "iter_0000002")
    files = ckpt.verify_checkpoint(newest)["files"]
    assert ".metadata" in files and any(n.endswith(".distcp") for n in files)
    assert all(set(r) == {"bytes", "crc32"} for r in files.values())
    ckpt.verify_checksums(newest, ckpt.read_meta(newest))              # intact: passes
    assert ckpt.resume_path(root) == newest and ckpt.resume_path(root, 2) == older
    assert ckpt.resume_path(older) == older                            # --load DIR/iter_N
    with pytest.raises(ckpt.CheckpointError, match=r"--ckpt-step 7: there is no .*steps in "
                                                   r".*: 2, 3\)"):
        ckpt.resume_path(root, 7)
    shard = _largest_shard(newest)
    data = open(shard, "rb").read()
    open(shard, "r+b").truncate(len(data) // 2)                        # truncated shard
    way_back = (rf"checkpoint {newest} is damaged: {os.path.basename(shard)} has "
                rf"{len(data) // 2:,} bytes, the save wrote {len(data):,} .*--ckpt-step 2 "
                rf"\({older}\)")
    with pytest.raises(ckpt.CheckpointError, match=way_back):
        ckpt.verify_checkpoint(newest)
    m2, o2 = _model_and_opt(1)
    with pytest.raises(ckpt.CheckpointError, match=rf"checkpoint {newest} is damaged: reading"):
        ckpt.load_checkpoint(newest, m2, o2, tp_rank=0, group=None)   # DCP's error, named
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    open(shard, "wb").write(bytes(flipped))                            # same size, one bit off
    ckpt.verify_checkpoint(newest)
    with pytest.raises(ckpt.CheckpointError, match=r"does not match its checksum.*--ckpt-step"):
        ckpt.verify_checksums(newest, ckpt.read_meta(newest))
    text = open(os.path.join(newest, "meta.json")).read()
    open(os.path.join(newest, "meta.json"), "w").write(text[:len(text) // 2])
    with pytest.raises(ckpt.CheckpointError, match=r"meta.json is not valid JSON.*--ckpt-step 2"):
        ckpt.verify_checkpoint(ckpt.find_latest(root))                 # never iter 2 silently
    os.remove(os.path.join(older, ".metadata"))
    with pytest.raises(ckpt.CheckpointError, match=r"\.metadata is missing.*no earlier "
                                                   r"checkpoint in .*move .* away to start"):
        ckpt.verify_checkpoint(older)
    with pytest.raises(ValueError, match="--ckpt-step picks a checkpoint under --load"):
        parse_args(["--ckpt-step", "2"])
    fast = ckpt.save_checkpoint(str(tmp_path / "fast"), 1, m, o, tp_rank=0, meta=meta,
                                group=None, checksums=False)
    assert all(set(r) == {"bytes"} for r in ckpt.read_meta(fast)["files"].values())


def test_bf16_masters_and_lr():
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 4).to(torch.bfloat16)
    o = MasterAdamW(list(m.named_parameters()), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0,
                    tp_group=None, tp_rank=0)
    assert o.master[0].dtype == torch.float32 and o.master[0] is not o.params[0]
    m(torch.ones(2, 4, dtype=torch.bfloat16)).sum().backward()
    o.step(1e-2, 0.0)
    assert torch.equal(m.weight, o.master[0].to(torch.bfloat16))
    assert "weight.master" in o.state_tensors()
    assert lr_at(0, 1.0, 0.1, 4, 20) == 0.25 and abs(lr_at(20, 1.0, 0.1, 4, 20) - 0.1) < 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_master_adamw_matches_plain_clipped_adamw(dtype):
    """The multi-tensor norm, clip and copy-back are the textbook step: the norm in fp64 of
    every gradient, scale min(1, clip / (norm + 1e-6)), AdamW on fp32 masters (decay on
    matrices only; fp32 parameters are their own masters), the parameters rounded from them."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3)).to(dtype)
    ref = [p.detach().float().requires_grad_() for p in m.parameters()]   # fp32 masters
    o = MasterAdamW(list(m.named_parameters()), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1,
                    tp_group=None, tp_rank=0)
    plain = torch.optim.AdamW([{"params": [r for r in ref if r.dim() > 1], "weight_decay": 0.1},
                               {"params": [r for r in ref if r.dim() <= 1],
                                "weight_decay": 0.0}], lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    for i in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(i)).to(dtype)
        (m(x).pow(2).sum() * 10).backward()
        want = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in m.parameters()))
        scale = min(1.0, 0.5 / (want + 1e-6))
        for r, p in zip(ref, m.parameters()):
            r.grad = p.grad.to(r.dtype) * scale
        norm = o.step(1e-2, 0.5)
        plain.step()
        assert abs(norm - want) <= 1e-6 * want
        assert scale < 1.0                                 # the clip is exercised
        tol = 2 ** -8 if dtype == torch.bfloat16 else 1e-6
        for r, p in zip(ref, m.parameters()):      # bf16: at most one rounding step apart
            assert torch.allclose(p.detach().to(r.dtype), r.detach(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("norm", [0.37, 1.0, 5.123456789])
def test_clip_on_the_device_is_the_python_float_clip_bit_for_bit(dtype, norm):
    """``clip_`` scales by min(1, clip / (norm + 1e-6)) computed in fp64 on the norm's device
    (no host read of the norm) and gives exactly what multiplying by that Python float did —
    below the threshold, at it, above it, fp32 and fp64 gradients."""
    from sp_train.optim import clip_, clip_scale
    g = [torch.randn(7, 5, generator=torch.Generator().manual_seed(1)).to(dtype),
         torch.randn(3, generator=torch.Generator().manual_seed(2)).to(dtype)]
    t = torch.tensor(norm, dtype=torch.float64)
    want = [x.clone() for x in g]
    scale = min(1.0, 1.0 / (norm + 1e-6))
    if scale != 1.0:
        torch._foreach_mul_(want, scale)
    clip_(g, t, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(g, want))
    assert clip_scale(t, 0.0) is None
    assert float(clip_scale(t, 1.0)) == scale


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")
def test_the_optimizer_step_does_not_wait_for_the_gpu():
    """MasterAdamW's step (norm, clip, fused AdamW, copy back) issues no host sync: the host
    goes on to the next step's work while the GPU finishes this one."""
    m = torch.nn.Linear(64, 64).cuda().to(torch.bfloat16)
    o = MasterAdamW(list(m.named_parameters()), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1,
                    tp_group=None, tp_rank=0)
    m(torch.ones(2, 64, device="cuda", dtype=torch.bfloat16)).float().pow(2).sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        norm = o.step(1e-2, 0.1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert norm.is_cuda and float(norm) > 0.1


def test_master_adamw_steps_from_given_fp32_gradients():
    """``step(grads=)`` (the reducer's fp32 sums) steps the masters as ``.grad`` would."""
    models, opts = [], []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(torch.nn.Linear(4, 3).to(torch.bfloat16))
        opts.append(MasterAdamW(list(models[-1].named_parameters()), lr=1e-2, betas=(0.9, 0.95),
                                weight_decay=0.1, tp_group=None, tp_rank=0))
    for i in range(2):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        for m in models:
            m(x).float().pow(2).sum().backward()
        given = [p.grad.float() for p in models[1].parameters()]
        for p in models[1].parameters():
            p.grad = None
        assert opts[0].step(1e-2, 0.1) == opts[1].step(1e-2, 0.1, grads=given)
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match="1 tensors for 2 parameters"):
        opts[0].step(1e-2, 0.1, grads=[given[0]])


# --- progress ----------------------------------------------------------------------------
def test_flops_log_and_plot(tmp_path):
    f = flops_per_token(num_layers=16, hidden_size=2048, ffn_hidden_size=8192,
                        num_attention_heads=32, num_query_groups=8, vocab_size=128256,
                        seq_length=4096, layer_kinds="S" * 16)
    assert 6 * 1.2e9 < f < 6 * 1.7e9        # ~6 N per token plus attention (Llama-3.2-1B)
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"step": s, "loss": l}) + "\n"
                           for s, l in [(1, 3.0), (2, 2.0), (2, 1.5), (3, 1.0)]))
    assert read_log(str(log)) == ([1, 2, 3], [3.0, 1.5, 1.0])
    png = plot_losses({"a": read_log(str(log))}, str(tmp_path / "p" / "l.png"), chance=3.4)
    assert png and open(png, "rb").read(4) == b"\x89PNG"


def test_train_py_is_short():
    assert sum(1 for _ in open(os.path.join(ROOT, "train.py"))) <= 300
    out = subprocess.run([sys.executable, "-c", "import sp_train.args, "
                          "sp_train.data, sys; "
                          "print('megatron.core' in sys.modules)"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "False"     # argument checks do not wait for Megatron


def test_unreachable_tokenizer_fails_at_once_in_one_line(monkeypatch):
    pytest.importorskip("transformers")
    from huggingface_hub import constants
    from sp_train.args import UsageError
    from sp_train.data import load_tokenizer
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)       # as when the hub is unreachable
    with pytest.raises(UsageError, match="hub is unreachable") as e:
        load_tokenizer("no-such-org/no-such-tokenizer")
    assert "\n" not in str(e.value)


def test_progress_tells_of_allocator_retries(monkeypatch, capsys):
    """On CUDA each step's record carries the allocator's retries (``num_alloc_retries``), and
    the first step that has some prints one warning naming the remedies, once. (The CUDA calls
    are stand-ins here.)"""
    import torch
    from sp_train.progress import Progress
    stats = {"num_alloc_retries": 0}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: dict(stats))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 100 * 2**30)
    p = Progress(enabled=True, total=4, start=0, tokens_per_step=1, flops_per_token=1.0,
                 peak=None, device=torch.device("cuda", 0), log_interval=100, log_json=None,
                 tensorboard_dir=None, bar=False)
    assert p.step(1, 1.0, 1.0, 1e-3)["alloc_retries"] == 0
    stats["num_alloc_retries"] = 3
    assert p.step(2, 1.0, 1.0, 1e-3)["alloc_retries"] == 3
    stats["num_alloc_retries"] = 5
    assert p.step(3, 1.0, 1.0, 1e-3)["alloc_retries"] == 5
    out = capsys.readouterr().out
    assert out.count("warning: by step 2 the CUDA allocator") == 1
    assert "3 time(s)" in out and "--recompute-granularity full" in out
    assert "expandable_segments" in out
    cpu = Progress(enabled=True, total=1, start=0, tokens_per_step=1, flops_per_token=1.0,
                   peak=None, device=torch.device("cpu"), log_interval=1, log_json=None,
                   tensorboard_dir=None, bar=False)
    assert "alloc_retries" not in cpu.step(1, 1.0, 1.0, 1e-3)


def test_train_installs_the_shipped_kernels_on_gpus_only(monkeypatch):
    """train.py installs the package's shipped Triton results and kernels at its start on GPUs
    (a softmax-only model has no linear call that would), nothing on CPU."""
    from sp_train import setup
    calls = []
    monkeypatch.setattr(setup, "install_once", lambda: calls.append(1))
    setup.install_shipped_kernels(torch.device("cpu"))
    assert calls == []
    setup.install_shipped_kernels(torch.device("cuda", 0))
    assert calls == [1]


def _agree_worker(rank, world, tp):
    import signal
    from sp_train.launch import agree_step
    share = torch.tensor(0.1 * (rank + 1), dtype=torch.float64)
    tokens = torch.tensor(1000003.0 + rank // tp, dtype=torch.float64)   # alike in a TP group
    signum = signal.SIGINT if rank == world - 1 else None
    return agree_step(share, signum, tp, tokens)


@pytest.mark.parametrize("world,tp", [(2, 1), (3, 3)])
def test_agree_step_loss_next_tokens_and_stop(world, tp):
    """The step's one all-reduce: the loss (each share counted once per TP group), the next
    step's loss tokens summed over DP × CP — a whole count, exact at TP 3 where the per-rank
    thirds round — and a stop signal any one rank got, the same on every rank."""
    import signal
    from sp_attention.testing import run_distributed
    got = run_distributed(_agree_worker, world, tp)
    want_tokens = sum(1000003.0 + r // tp for r in range(world)) / tp
    for loss, tokens, stop in got:
        assert loss == pytest.approx(sum(0.1 * (r + 1) for r in range(world)) / tp)
        assert tokens == want_tokens
        assert stop == signal.SIGINT


def _agree_sync_worker(rank, world):
    import warnings
    from sp_train.launch import agree_step
    share = torch.ones((), dtype=torch.float64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = agree_step(share, None, 1, torch.tensor(7.0, dtype=torch.float64))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return out, sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")
def test_the_agreement_waits_for_the_gpu_once():
    """agree_step on NCCL: the host's numbers travel in one queued copy; the one wait for the
    GPU is the read of the all-reduced vector (each extra wait leaves the GPU idle while the
    host catches up, at every step's boundary)."""
    from sp_attention.testing import run_distributed
    (out, syncs), = run_distributed(_agree_sync_worker, 1, backend="nccl", timeout=120)
    assert out == (1.0, 7.0, None) and syncs == 1


def _data_error_worker(rank, world):
    from sp_train.launch import agree_step
    error = ValueError("label id 300 at row 0 is outside the vocabulary") if rank == 1 else None
    try:
        agree_step(torch.zeros((), dtype=torch.float64), None, 1,
                   torch.tensor(3.0, dtype=torch.float64), data_error=error)
    except ValueError as e:
        return str(e)
    return "went on"


def test_agree_step_stops_every_rank_when_one_could_not_make_its_data():
    """A rank whose next step's data failed its checks raises its own error in the step's
    agreement and every other rank a ValueError saying so — nobody waits for it."""
    from sp_attention.testing import run_distributed
    got = run_distributed(_data_error_worker, 3)
    assert got[1] == "label id 300 at row 0 is outside the vocabulary"
    assert got[0] == got[2] and "1 rank(s) could not make the next step's data" in got[0]

"""CPU dry runs of the one-GPU rank-program benchmarks: every row is produced, and the programs
they time compute what the library computes (so a timing is of the right work)."""
import json
import math
import os
import sys

import pytest
import torch
import torch.distributed as dist

from benchmarks import linear_rank_programs as lrp
from benchmarks import softmax_pieces as sp
from sp_attention import comm, lightning_attention
from sp_attention.softmax import bwd_allgather, bwd_ring, fwd_allgather, fwd_ring, gather


def _rows(module, argv, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["x", "--device", "cpu", "--warmup", "0", "--iters", "1",
                                      "--repeats", "1"] + argv)
    module.main()
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]


def test_linear_rank_programs_rows(capsys, monkeypatch):
    rows = _rows(lrp, ["--t-local", "64", "--heads", "2", "--head-dim", "8"], capsys,
                 monkeypatch)
    prog = [r for r in rows if r["impl"] == "rank program"]
    got = {(r["layout"], r["world"], r["rank"], r["scan"]) for r in prog}
    want = {("zigzag", 1, 0, s) for s in ("ring", "blelloch", "allgather")}
    want |= {(lay, P, r, "-") for lay in ("contiguous", "zigzag") for P in (2, 4)
             for r in range(P)}
    assert got == want
    for r in prog:
        assert r["ms_fwd"] > 0 and r["ms_bwd"] > 0 and r["ms_fwd_bwd"] > 0
        key = ("layout", "world", "scan")
        same = [x["ratio"] for x in prog if all(x[c] == r[c] for c in key)]
        assert r["ratio_slowest"] == max(same) and 0 < r["ratio"] < 1e3
    assert any(r["impl"] == "torch fwd+bwd" and r["ratio"] == 1.0 for r in rows)
    assert sum(r["impl"].startswith("rank1 bwd") for r in rows) == 4      # the A/B rows


def test_linear_rank_program_is_the_library_step():
    """P = 1 zigzag: the program (real scan) equals lightning_attention, outputs and grads."""
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, 32, 2, 8, dtype=torch.float64) * 0.3 for _ in range(4))
    slopes = torch.tensor([0.1, 0.5], dtype=torch.float64)
    fwd, bwd, _ = lrp.rank_program(0, 1, "zigzag", q, k, v, do, slopes, "torch",
                                   lrp.LinearTuning(), "blelloch")
    o, S = fwd()
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref = lightning_attention(qg, kg, vg, slopes, backend="torch")
    ref.backward(do)
    torch.testing.assert_close(o.reshape(ref.shape), ref.detach())
    for g, r in zip(bwd(S), (qg.grad, kg.grad, vg.grad)):
        torch.testing.assert_close(g.reshape(r.shape), r)
    for P, layout in ((2, "contiguous"), (4, "zigzag")):     # stand-in scans: shapes only
        for rank in range(P):
            fwd, bwd, fb = lrp.rank_program(rank, P, layout, q, k, v, do, slopes, "torch",
                                            lrp.LinearTuning())
            assert fwd()[0].numel() == q.numel()
            assert all(g.numel() == q.numel() for g in fb()[:3])


def test_softmax_pieces_rows(capsys, monkeypatch):
    """Every row, finite; the ring and all-gather rows ran the library unpatched on the fake backend
    (no name in the library's modules was reassigned) and left no process group behind."""
    mods = (comm, gather, fwd_allgather, bwd_allgather, fwd_ring, bwd_ring)
    names = {m: list(vars(m)) for m in mods}

    def ids():
        return {(m.__name__, k): id(getattr(m, k, None)) for m in mods for k in names[m]}
    seen, time_ms = [], sp.time_ms

    def spy(*args, **kw):           # the library's names as each timed call sees them
        seen.append(ids())
        return time_ms(*args, **kw)
    ref = ids()
    monkeypatch.setattr(sp, "time_ms", spy)
    rows = _rows(sp, ["--t-local", "32", "--heads", "4", "--kv-heads", "2", "--head-dim", "8",
                      "--strides", "1", "2", "--pack-kv"], capsys, monkeypatch)
    assert len(seen) == len(rows) * 2 and all(x == ref for x in seen) and ids() == ref
    assert not dist.is_initialized()
    got = {(r["impl"], r.get("stride")) for r in rows}
    for r in range(2):
        for v in ("kernels", "ring", "ring_packed"):
            assert (f"rank{r}_{v}", None) in got
        for v in ("allgather", "ring_ag"):
            assert {(f"rank{r}_{v}", 1), (f"rank{r}_{v}", 2)} <= got
    for r in rows:
        assert all(math.isfinite(r[c]) and r[c] > 0 for c in ("ms_fwd", "ms_fwd_bwd", "ratio"))
    ag = [r for r in rows if r["impl"].endswith(("_allgather", "_ring_ag"))]
    assert len(ag) == 8 and all(r["comm"] == "fake_pg" and r["outputs_finite"] for r in ag)
    assert {"single_global", "single_t_local"} <= {r["impl"] for r in rows}


def test_linear_rank_programs_gated_rows(capsys, monkeypatch):
    """``--gated``: every rank's program with per-token gates, with its baselines."""
    rows = _rows(lrp, ["--t-local", "64", "--heads", "2", "--head-dim", "8", "--gated",
                       "--worlds", "1", "2"], capsys, monkeypatch)
    prog = [r for r in rows if r["impl"] == "rank program"]
    assert {(r["layout"], r["world"]) for r in prog} == {("zigzag", 1), ("contiguous", 2),
                                                         ("zigzag", 2)}
    assert all(r["decay"] == "g" and r["ratio"] > 0 and r["ratio_fwd"] > 0 for r in prog)
    assert {r["impl"] for r in rows} >= {"ours P=1 g", "torch fwd g"}


def test_training_benchmark_helpers():
    """train_parity's statistics (moving averages; the CP run against the CP 1 pair) and
    train_scaling's failure excerpt (train.py's error, not torchrun's report)."""
    from benchmarks import train_parity, train_scaling
    assert train_parity.moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    a, b = [2.0] * 10, [2.2] * 10
    s = train_parity.compare(a, b, [2.1] * 10, window=3)
    assert s["spread"] == s["spread_max"] == pytest.approx(0.2)
    assert s["cp_vs_cp1"] == pytest.approx(0.0) and s["bias"] == pytest.approx(0.0)
    s = train_parity.compare(a, b, [2.6] * 10, window=3)
    assert s["cp_vs_cp1"] == pytest.approx(0.5) and s["bias"] == pytest.approx(0.5)
    log = ("step 1/2 ...\ntrain.py: error: CUDA out of memory\n"
           "E1126 12:00:00 api.py:1] failed (exitcode: 1) local_rank: 0\n"
           "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n====\n")
    tail = train_scaling.error_tail(log)
    assert tail.endswith("train.py: error: CUDA out of memory") and "exitcode" not in tail
    assert train_scaling.error_tail("no report\n") == "no report\n"
    assert train_scaling.parse_layout("tp2cp2") == {"tp": 2, "cp": 2, "dp": 1}


def test_fresh_caches_are_a_users_defaults(tmp_path, monkeypatch):
    """--fresh-triton-cache: empty Triton and Inductor folders, TRITON_CACHE_DIR unset (as a
    user has it), so Triton's default folder is the fresh one until Inductor moves it."""
    pytest.importorskip("triton")
    from benchmarks import train_scaling
    env = train_scaling.fresh_caches(str(tmp_path / "run"))
    assert sorted(env) == ["TORCHINDUCTOR_CACHE_DIR", "TRITON_HOME"]
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    import triton
    assert triton.knobs.cache.dir == str(tmp_path / "run" / "home" / ".triton" / "cache")
    assert not any((tmp_path / "run" / "inductor").iterdir())
    with pytest.raises(FileExistsError):
        train_scaling.fresh_caches(str(tmp_path / "run"))


def test_train_scaling_reads_the_estimate_of_a_run_cut_short(tmp_path):
    """The memory estimate beside the measured peak: from the ``summary:`` line of a finished
    run, else from the line train.py prints before building the model (a run stopped at its
    time limit still has it)."""
    from benchmarks import train_scaling
    log = tmp_path / "run.log"
    log.write_text("memory estimate per rank (the model's tensors): 63.5 GiB of 139.8 GiB at "
                   "the backward peak (weights 2.8, ...)\nstep 1/3 | loss 12.1\n")
    assert train_scaling._estimate(str(log), 50.8) == {"mem_estimate_gb": 63.5,
                                                       "estimate_over_measured": 1.25}
    log.write_text(log.read_text() + 'summary: {"mem_estimate_gb": 63.49}\n')
    assert train_scaling._estimate(str(log), None) == {"mem_estimate_gb": 63.49}
    log.write_text("memory estimate per rank: 512.0 MiB of 23.0 GiB at the forward peak\n")
    assert train_scaling._estimate(str(log), 1.0)["mem_estimate_gb"] == 0.5
    assert train_scaling._estimate(str(tmp_path / "missing.log"), 1.0) == {}


def test_train_scaling_summary_keeps_every_step(tmp_path):
    """A run's row: means over the steps after the first, the median beside them (one slow
    step — a kernel compiled mid-run — moves the mean only) and every step's time."""
    from benchmarks import train_scaling
    log = tmp_path / "log.jsonl"
    times = [5.0, 0.21, 0.20, 0.65, 0.20]
    log.write_text("".join(json.dumps({"step": i + 1, "loss": 9.0 - i, "tokens_per_s": 1.0,
                                       "mfu": 0.3, "step_time_s": t, "mem_gb": 20.0}) + "\n"
                           for i, t in enumerate(times)))
    row = train_scaling.summarize(str(log))
    assert row["step_times_ms"] == [5000.0, 210.0, 200.0, 650.0, 200.0]
    assert row["step_time_s"] == pytest.approx(0.315)
    assert row["step_time_median_s"] == pytest.approx(0.205)
    assert row["steps"] == 5 and row["first_loss"] == 9.0 and row["last_loss"] == 5.0


def test_train_scaling_against_another_tree_alternates(tmp_path, monkeypatch):
    """--against TREE --repeats 2: each configuration runs this tree's train.py and the other's
    in the order A B B A, one at a time, each in its tree, its rows marked with the tree."""
    from benchmarks import train_scaling
    other = tmp_path / "old"
    other.mkdir()
    (other / "train.py").write_text("# the other checkout's train.py\n")
    ran = []

    class FakeRun:
        def __init__(self, cmd, stdout, stderr, env, cwd):
            ran.append((cmd[cmd.index("--nproc-per-node") + 3], cwd))
            log_json = cmd[cmd.index("--log-json") + 1]
            with open(log_json, "w") as f:
                for i in range(3):
                    f.write(json.dumps({"step": i + 1, "loss": 1.0, "tokens_per_s": 1.0,
                                        "mfu": 0.1, "step_time_s": 0.1}) + "\n")

        def wait(self, timeout=None):
            return 0
    monkeypatch.setattr(train_scaling.subprocess, "Popen", FakeRun)
    out = tmp_path / "rows.jsonl"
    monkeypatch.setattr(sys, "argv", ["train_scaling.py", "--device", "cpu", "--kinds", "hybrid",
                                      "--layouts", "cp1", "cp2", "--against", str(other),
                                      "--repeats", "2", "--out", str(out), "--log-root",
                                      str(tmp_path / "logs")])
    assert train_scaling.main() == 0
    root = train_scaling.ROOT
    want = [root, str(other), str(other), root]
    assert [cwd for _, cwd in ran] == want * 2
    assert [script for script, _ in ran] == [os.path.join(d, "train.py") for d in want * 2]
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(r["layout"], r["tree"]) for r in rows] == [
        (lay, t) for lay in ("cp1", "cp2") for t in ("this", "against", "against", "this")]
    assert [r["order"] for r in rows] == list(range(8))
    assert all(r["status"] == "ok" and r["command"].startswith("train.py") for r in rows)
    assert all(r["cuda_graphs"] is False for r in rows)     # read off each run's log
    monkeypatch.setattr(sys, "argv", ["train_scaling.py", "--device", "cpu", "--against",
                                      str(tmp_path)])
    with pytest.raises(SystemExit):
        train_scaling.main()


def test_launcher_resume_check_reads_megatrons_logs(tmp_path, monkeypatch):
    """launcher_vs_train --resume-check: the second run's command loads the first run's
    checkpoint; the record says where it started (Megatron's load line) and the losses."""
    from benchmarks import launcher_vs_train as lvt
    calls = []

    def fake_run(cmd, log_path, timeout):
        calls.append(cmd)
        if "--load" not in cmd:
            return "ok", 1.0, "".join(f" iteration {i}/ 6 | lm loss: {9 - i}.0E+00 |\n"
                                      for i in range(1, 7))
        return "ok", 1.0, ("  successfully loaded checkpoint from /x [ t 1/1, gtp_remat 1/1, "
                           "p 1/1 ] at iteration 6\n" + "".join(
                               f" iteration {i}/ 9 | lm loss: {9 - i}.0E+00 |\n"
                               for i in range(7, 10)))
    monkeypatch.setattr(lvt, "run", fake_run)
    rec = lvt.resume_check({"tp": 1, "cp": 4, "dp": 1}, "cp4", 8192, str(tmp_path), 10.0, "x")
    assert rec["ok"] and rec["resumed_from_iteration"] == 6
    assert rec["first_losses"] == [8.0, 7.0, 6.0, 5.0, 4.0, 3.0]
    assert rec["resumed_losses"] == [2.0, 1.0, 0.0]
    first, second = calls
    assert "--load" not in first and second[second.index("--load") + 1] == \
        first[first.index("--save") + 1]
    assert first[first.index("--num-layers") + 1] == "4" and "--nproc-per-node" in first
    # one command, as a preempted job and its requeue: the same length (Megatron refuses a
    # schedule made for another), the first run stopped at 6
    assert first[first.index("--train-iters") + 1] == second[second.index("--train-iters") + 1] \
        == "9"
    assert first[first.index("--exit-interval") + 1] == "6" and "--exit-interval" not in second


def test_train_profile_timeline_splits_the_wall(tmp_path):
    """train_profile --trace: compute, NCCL alone, NCCL beside compute and idle per step, from
    the kernels of a Chrome trace (overlapping kernels counted once)."""
    from benchmarks import train_profile as tp
    trace = {"traceEvents": [
        {"cat": "kernel", "name": "gemm", "ts": 0, "dur": 40},
        {"cat": "kernel", "name": "flash_fwd", "ts": 30, "dur": 30},         # overlaps gemm
        {"cat": "kernel", "name": "ncclDevKernel_AllGather", "ts": 50, "dur": 30},  # 10 hidden
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},          # not a kernel
        {"cat": "kernel", "name": "ncclDevKernel_ReduceScatter", "ts": 150, "dur": 20}]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    kernels = tp.trace_kernels(str(path))
    assert len(kernels) == 4
    got = tp.timeline(kernels, wall_us=400.0, steps=1)
    # compute [0, 60]; NCCL [50, 80] + [150, 170]: hidden 10, exposed 40; busy 100
    assert got == {"compute": 0.06, "nccl_exposed": 0.04, "nccl_hidden": 0.01, "idle": 0.3}
    assert tp.timeline(kernels, wall_us=800.0, steps=2)["idle"] == 0.35     # per step
    # the exposed 40 µs by collective: AllGather 20 of its 30, ReduceScatter all 20
    assert tp.nccl_exposed_by_op(kernels, steps=1) == {"AllGather": 0.02, "ReduceScatter": 0.02}
    assert tp.nccl_op("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 2500.0) == "ReduceScatter long"
    assert tp.nccl_op("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 30.0) == "SendRecv"


def test_train_profile_splits_the_step_boundary():
    """train_profile's ``boundary_ms``: from a backward's last GEMM to the next forward's first
    around AdamW's kernels, split into the optimizer, other kernels, NCCL alone by collective
    and idle; a boundary without a GEMM after it (the last profiled step) does not count."""
    from benchmarks import train_profile as tp
    ad = "multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>, FusedAdamMathFunctor"
    kernels = [(0, 100, "nvjet_gemm"),                                   # the backward's last
               (100, 300, "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL"),  # 200 alone
               (300, 350, "multi_tensor_apply_kernel<LpNormFunctor>"),   # the norm: optimizer
               (350, 450, ad),
               (450, 460, "bfloat16_copy_kernel"),
               (460, 560, "ncclDevKernel_AllGather_RING_LL"),            # 100 alone
               # 560-600 idle
               (600, 620, "embedding_gather"), (620, 700, "nvjet_gemm"),   # the next forward
               (900, 950, ad)]                                           # no GEMM after it
    got = tp.step_boundary(kernels)
    assert got == {"count": 1, "window": 0.52, "optimizer": 0.15, "other_compute": 0.03,
                   "idle": 0.04, "nccl_only": {"ReduceScatter": 0.2, "AllGather": 0.1}}
    assert tp.step_boundary([(0, 10, "nvjet_gemm")]) == {"count": 0}


def test_train_profile_counts_the_hosts_waits_and_the_idle_after_them(tmp_path):
    """train_profile --trace: each stream/event sync of the host per step, named by the GPU op
    launched just before it, and the GPU idle within the window after it returned (windows
    that overlap counted once); the profiler's own device syncs are not counted."""
    from benchmarks import train_profile as tp
    rt = lambda name, ts, dur, corr=None: {"cat": "cuda_runtime", "name": name, "ts": ts,  # noqa
                                            "dur": dur, "args": {"correlation": corr}}
    trace = {"traceEvents": [
        rt("cudaMemcpyAsync", 0, 5, corr=1),
        {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "ts": 100, "dur": 2,
         "args": {"correlation": 1, "bytes": 128}},
        rt("cudaStreamSynchronize", 6, 100),                      # returns at 106
        rt("cudaLaunchKernel", 110, 5, corr=2),
        {"cat": "kernel", "name": "gemm", "ts": 400, "dur": 1000, "args": {"correlation": 2}},
        rt("cudaStreamSynchronize", 300, 10),                     # returns at 310
        rt("cudaDeviceSynchronize", 2000, 10),                    # the profiler's: not counted
        {"cat": "kernel", "name": "gemm", "ts": 5000, "dur": 10, "args": {"correlation": 9}}]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    got = tp.host_syncs(str(path), steps=2, window_us=500.0)
    # windows [106, 606] and [310, 810] -> [106, 810]; busy [400, 1400]: idle 294 us
    assert got == {"count": 1.0, "idle_after_ms": 0.15,
                   "by_op": {"Memcpy HtoD (Pageable -> Device) 128B": 0.5, "gemm": 0.5}}
    assert tp.kind_of("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "nccl"
    assert tp.kind_of("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<"
                      "Flash_bwd_kernel_traits<64, 128, 128, 8, 4, 4, cutlass::bfloat16_t>>") \
        == "attention"


def test_train_profile_analyzes_a_trace_written_elsewhere(tmp_path, capsys):
    """train_profile --analyze: a gzipped trace (Megatron's profiler writes rank-R.json.gz)
    read like its own; the wall spans the ProfilerStep marks, the tables are per step."""
    import gzip
    from benchmarks import train_profile as tp
    trace = {"traceEvents": [
        {"cat": "user_annotation", "name": "ProfilerStep#6", "ts": 0, "dur": 500},
        {"cat": "user_annotation", "name": "ProfilerStep#7", "ts": 500, "dur": 500},
        {"cat": "kernel", "name": "sm90_xmma_gemm", "ts": 0, "dur": 300},
        {"cat": "kernel", "name": "ncclDevKernel_AllReduce", "ts": 200, "dur": 200},
        {"cat": "kernel", "name": "sm90_xmma_gemm", "ts": 500, "dur": 300}]}
    path = tmp_path / "rank-0.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(trace, f)
    rows = tmp_path / "rows.jsonl"
    got = tp.analyze(str(path), steps=2, out=str(rows))
    # wall 1000 us over 2 steps; compute 600, NCCL 200 of which 100 hidden, idle 300
    assert got == {"compute": 0.3, "nccl_exposed": 0.05, "nccl_hidden": 0.05, "idle": 0.15}
    out = capsys.readouterr().out
    assert '"gemm": 0.3' in out and '"nccl": 0.1' in out and "wall 0.5" in out
    # --out: one JSON line with what the tables printed (a device call brings it back)
    row = json.loads(rows.read_text())
    assert row["bench"] == "train_profile" and row["by_kind_ms"] == {"gemm": 0.3, "nccl": 0.1}
    assert row["top_kernels"][0] == [0.3, 1.0, "gemm", "sm90_xmma_gemm"]
    assert row["timeline_ms"] == got and row["wall_ms"] == 0.5 and row["steps"] == 2


def test_parity_corpus_is_the_checkout_text(tmp_path):
    """train_parity's default data: one JSON document per .py/.md file of the checkout, in a
    fixed order, none from hidden or result folders; train.py reads it."""
    import json
    from benchmarks import train_parity
    from sp_train.data import TokenFile
    path = train_parity.repo_corpus(str(tmp_path / "c.jsonl"))
    docs = [json.loads(line)["text"] for line in open(path)]
    assert len(docs) > 50 and any(d.startswith("# sp-attention") or "train.py" in d
                                  for d in docs)
    assert open(path).read() == open(train_parity.repo_corpus(str(tmp_path / "d.jsonl"))).read()
    assert TokenFile(path, 8192, seed=1).num_samples > 200     # 300 steps: about one epoch


def test_launcher_vs_train_warm_run_comes_first(monkeypatch, tmp_path):
    """launcher_vs_train --warm: an untimed 2-iteration train.py run per model and layout
    before the timed pair (a fresh machine compiles there), its status in the record."""
    import json
    import sys

    from benchmarks import launcher_vs_train as lvt
    calls = []

    def fake_run(cmd, log_path, timeout):
        calls.append((cmd, timeout))
        return "ok", 1.0, "".join(f" elapsed time per iteration (ms): {100 + i}.0 |\n"
                                  for i in range(4))
    monkeypatch.setattr(lvt, "run", fake_run)
    out = tmp_path / "rows.jsonl"
    monkeypatch.setattr(sys, "argv", ["launcher_vs_train.py", "--kinds", "hybrid", "--layouts",
                                      "tp2cp2", "--warm", "77", "--out", str(out),
                                      "--log-root", str(tmp_path)])
    assert lvt.main() == 0
    (warm, t_warm), (timed, _), (launcher, _) = calls
    assert t_warm == 77 and warm[warm.index("--train-iters") + 1] == "2"
    assert timed[timed.index("--train-iters") + 1] == "12" and "train.py" in " ".join(timed)
    assert "--no-cuda-graphs" in timed and "--no-cuda-graphs" in warm   # eager, as the launcher
    assert "megatron_patches.pretrain_gpt" in launcher
    # train.py's settings on GPUs by default: the overlapped gradient sum, the distributed
    # optimizer with its gather overlapped, the fused SwiGLU
    assert "--overlap-grad-reduce" in launcher and "--no-bias-swiglu-fusion" not in launcher
    assert "--use-distributed-optimizer" in launcher and "--overlap-param-gather" in launcher
    rec = json.loads(out.read_text().splitlines()[-1])
    assert rec["warm_run"] == {"status": "ok", "wall_s": 1.0} and rec["tp"] == 2
    assert rec["launcher_settings"] == "match_train" and rec["launcher_extra"] is None
    assert rec["launcher_flags"] == lvt.MATCH_TRAIN
    calls.clear()
    monkeypatch.setattr(sys, "argv", ["launcher_vs_train.py", "--kinds", "hybrid", "--layouts",
                                      "cp4", "--megatron-defaults", "--launcher-extra",
                                      "--use-distributed-optimizer --overlap-param-gather",
                                      "--out", str(out), "--log-root", str(tmp_path)])
    assert lvt.main() == 0
    launcher = calls[-1][0]
    assert "--overlap-grad-reduce" not in launcher and "--no-bias-swiglu-fusion" in launcher
    assert launcher.count("--use-distributed-optimizer") == 1     # only the extra flag's
    assert launcher[-2:] == ["--use-distributed-optimizer", "--overlap-param-gather"]
    rec = json.loads(out.read_text().splitlines()[-1])
    assert rec["launcher_settings"] == "megatron_defaults"
    assert rec["launcher_extra"] == "--use-distributed-optimizer --overlap-param-gather"


def test_softmax_cp_packed_rows(capsys, monkeypatch):
    """``softmax_cp.py --packed`` on one CPU rank: the P = 1 baseline and a row per preset, each
    over the same documents (FLOPs summed per document), finite and without errors."""
    from benchmarks import softmax_cp
    rows = _rows(softmax_cp, ["--packed", "--t-local", "600", "--heads", "4", "--kv-heads", "2",
                              "--head-dim", "8", "--pairs", "ring/ring", "--presets", "a2a",
                              "--strides", "default"], capsys, monkeypatch)
    assert not dist.is_initialized()
    impls = [r["impl"] for r in rows]
    assert impls == ["single_global_packed", "ring/ring", "a2a"], impls
    assert all(r["packed"] and r["docs"] > 1 and "error" not in r for r in rows)
    assert all(math.isfinite(r[c]) and r[c] > 0 for r in rows for c in ("ms_fwd_bwd", "ratio"))
    assert {r["baseline"] for r in rows[1:]} == {"single_global_packed"}


def test_softmax_cp_rows_per_layout(capsys, monkeypatch):
    """``softmax_cp.py --layouts zigzag contiguous`` on one CPU rank: the baselines once, then
    each CP row once per layout, the layout in the row."""
    from benchmarks import softmax_cp
    rows = _rows(softmax_cp, ["--t-local", "64", "--heads", "4", "--kv-heads", "2",
                              "--head-dim", "8", "--pairs", "ring/ring", "--presets", "a2a",
                              "--strides", "default", "--layouts", "zigzag", "contiguous",
                              "--fwd-bwd-only", "--no-torch-cp", "--no-yunchang"],
                 capsys, monkeypatch)
    cp = [(r["impl"], r["layout"]) for r in rows if not r["impl"].startswith("single")]
    assert cp == [("ring/ring", "zigzag"), ("a2a", "zigzag"), ("ring/ring", "contiguous"),
                  ("a2a", "contiguous")], cp
    assert all("error" not in r and math.isfinite(r["ratio"]) for r in rows)

"""The kernels that take the gradient arriving at a row's end in-kernel (``G``,
``LinearTuning.backward_schedule`` other than ``"scan_first"``): our dv kernel
(:mod:`sp_attention.linear.dv_kernel`) and the dq/dk(/dg) kernel's fixed-rate and ``G`` modes
(:mod:`sp_attention.linear.dqk_kernel`), against autograd through the fp64 chunk pieces
(:func:`sp_attention.linear.gated_naive.dqkdg_ref`) given the true gradient at every chunk's
end. Fed the zero-end recurrence plus ``G``, they must equal the same kernels fed the
recurrence from ``G`` and the reference: fixed rates and gates, partial last chunks, 1 and 3
heads, K ≠ V, one and two K tiles (K = 16 as one masked tile of 32), both dk accumulations. On CPU in Triton's interpreter
(every CI run); with ``-m gpu`` every config the autotuners may pick, on the GPU.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from local_cases import apply, gpu
from sp_attention.linear.dqk_kernel import (DQK_CANDIDATES, DQK_TUNED, MIN_BLOCK_K, block_k_of,
                                            chunk_dqkdg, dsT_four_warps, tuned_configs)
from sp_attention.linear.dv_kernel import DV_TUNED
from sp_attention.testing import finish_process, run_process

# (B, T, H, K, V, interpreter's dq/dk config, block_k): K = 16 as one masked K tile of 32,
# two K tiles (block_k 32), 1 and 3 heads, K != V, partial last chunks
CASES = ((1, 64, 1, 16, 16, 0, None), (2, 100, 3, 64, 16, 1, 32), (1, 130, 3, 16, 32, 2, None))
# on the GPU also the head dims models use (32: the HF example; 64: the 1B models; 128), one
# and two K tiles
GPU_CASES = ((1, 1000, 4, 128, 128, 0, None), (1, 300, 2, 32, 32, 0, None),
             (1, 300, 2, 64, 64, 0, None), (1, 300, 2, 64, 64, 0, 32))

_CHECK = f"CASES, GPU_CASES = {CASES!r}, {GPU_CASES!r}\n" + r"""
import math, sys, torch
from sp_attention.linear.gated_naive import dqkdg_ref, gated_chunk_states, chunk_end_grads
from sp_attention.linear.gates import gate_sums, suffix_sums
from sp_attention.linear.dqk_kernel import (DQK_CANDIDATES, block_k_of, chunk_dqkdg,
                                            tuned_configs)
from sp_attention.linear.dv_kernel import DV_TUNED, chunk_dv
dev, dtype, tol = sys.argv[1], getattr(torch, sys.argv[2]), float(sys.argv[3])
# one (case, decay, kernel) of the lists: part // 2 the (case, decay), part % 2 dq/dk or dv
part = int(sys.argv[4]) if len(sys.argv) > 4 else None
# and one config of that kernel's list (the index into it), or all
only = int(sys.argv[5]) if len(sys.argv) > 5 else None
every = dev == "cuda"          # every config the autotuners may pick on the GPU; a few here
torch.manual_seed(0)
worst = {}
def err(name, a, b):
    e = float((a.double().cpu() - b.double()).norm() / b.double().norm())
    worst[name] = max(worst.get(name, 0.0), e)
cases = CASES + (GPU_CASES if every else ())
for i, (B, T, H, K, V, cfg, bk) in enumerate(cases):
    q, k, v, do = (torch.randn(B, T, H, d) for d in (K, K, V, V))
    S, D = torch.randn(B, H, K, V), torch.randn(B, H, K, V)
    for gated in (True, False):
        if part is not None and part // 2 != 2 * i + (not gated):
            continue
        if gated:
            g = -torch.rand(B, T, H) * torch.tensor([0.001, 0.5, 40.0, 0.05])[:H]
        else:
            s = torch.tensor([0.001, 0.05, 0.3, 2.0])[:H]
            g = (-s).expand(B, T, H).contiguous()
        qd, kd, vd, dod, gd = (x.double() for x in (q, k, v, do, g))
        h = gated_chunk_states(kd, vd, gd, 64, S.double())
        dh_true, _ = chunk_end_grads(qd, dod, gd, D.double(), 0.3, 64)
        dh_zero, _ = chunk_end_grads(qd, dod, gd, None, 0.3, 64)
        ref = dqkdg_ref(qd, kd, vd, dod, h, dh_true, gd, 0.3, 64)
        x = [t.to(dev, dtype) for t in (q, k, v, do)]
        gs = gate_sums(g.to(dev), 64)
        kw = dict(gc=gs.gc) if gated else dict(g_gamma=(-s / math.log(2)).float().to(dev))
        suf = suffix_sums(gs.tot).contiguous() if gated else None
        tag = "gated" if gated else "fixed"
        hf = h.float().contiguous().to(dev)
        # on the GPU what may run: the autotuner's set for the K tile
        dqk_cfgs = (tuned_configs(block_k_of(K, bk)) if every
                    else (cfg, cfg + len(DQK_CANDIDATES) // 2))
        if part is not None and part % 2:
            dqk_cfgs = ()
        if only is not None:
            dqk_cfgs = dqk_cfgs[only:only + 1]
        for c in dqk_cfgs:
            for late in (False, True):
                dh_in = (dh_zero if late else dh_true).float().contiguous().to(dev)
                extra = dict(G=D.contiguous().to(dev), suffix=suf) if late else {}
                try:
                    dq, dk, dg = chunk_dqkdg(*x, hf, dh_in, kw.get("gc"), 0.3, 64, c, bk,
                                             g_gamma=kw.get("g_gamma"), **extra)
                except Exception as e:     # a config that cannot compile here
                    if "OutOfResources" in type(e).__name__ or "out of resource" in str(e):
                        continue
                    raise
                err(f"dq {tag}", dq, ref[0]); err(f"dk {tag} G={late}", dk, ref[1])
                if gated:
                    err(f"dg G={late}", dg, ref[3])
                else:
                    assert dg is None
        dv_cfgs = (DV_TUNED if every else (0, 1, 5)) if part is None or part % 2 else ()
        for c in (dv_cfgs if only is None else dv_cfgs[only:only + 1]):
            for late in (False, True):
                dh_in = (dh_zero if late else dh_true).float().contiguous().to(dev)
                extra = dict(G=D.contiguous().to(dev), suffix=suf) if late else {}
                try:
                    dv = chunk_dv(*x[:2], x[3], dh_in, 0.3, 64, config=c, **kw, **extra)
                except Exception as e:
                    if "OutOfResources" in type(e).__name__ or "out of resource" in str(e):
                        continue
                    raise
                err(f"dv {tag} G={late}", dv, ref[2])
print(worst)
assert worst, "nothing was checked: a job of no (case, decay, kernel, config)"
sys.exit(0 if max(worst.values()) < tol else 1)
"""


def _configs(part: int) -> int:
    """How many configs the GPU check forces for ``part`` (of ``CASES + GPU_CASES``: case
    ``part // 4``, decay, kernel ``part % 2``): the dq/dk kernel's autotuned set for the case's
    K tile; the dv kernel's set."""
    if part % 2:
        return len(DV_TUNED)
    _, _, _, K, _, _, bk = (CASES + GPU_CASES)[part // 4]
    return len(tuned_configs(block_k_of(K, bk)))


# processes per GPU at once: 64 on one H100 ran out of GPU memory in fp32 (each holds a CUDA
# context, the fp64-checked tensors and what its forced configs spill)
PER_GPU = 12


def _visible_gpus() -> list:
    """The GPUs a job may take (``CUDA_VISIBLE_DEVICES``'s entries, else every device)."""
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    if seen:
        return [g.strip() for g in seen.split(",") if g.strip()]
    return [str(i) for i in range(max(1, torch.cuda.device_count()))]


def _on_gpu(env: dict, gpu) -> dict:
    return env if gpu is None else dict(env, CUDA_VISIBLE_DEVICES=gpu)


def _run(device: str, dtype: str, tol: float, interpret: bool, parts: int = 0,
         every_config: bool = True) -> None:
    """The check in a fresh process; ``parts`` > 0: as processes, one per (case, decay,
    kernel) and config of that kernel's list (:func:`_configs`), as many at once as the
    machine has cores and :data:`PER_GPU` per GPU, spread over the GPUs (every config of every
    case compiles on the GPU: 16 processes of 12 compiles each did not finish in 330 s on 64
    cores; one per config took 175 s for 96 jobs on one H200's 16 cores, 259 s for 148 on
    one H100 beside 64)."""
    pytest.importorskip("triton", reason="triton is in the `test` extra; install it to run this")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, "-c", _CHECK, device, dtype, str(tol)]
    if not parts:
        r = run_process(cmd, env=env, timeout=900)
        assert r.returncode == 0, f"relative errors {r.stdout.strip()}\n{r.stderr[-3000:]}"
        return
    jobs = [(i, c) for i in range(parts) for c in range(_configs(i) if every_config else 1)]
    gpus = _visible_gpus() if device == "cuda" else [None]
    width = max(1, min(len(jobs), os.cpu_count() or 1, PER_GPU * len(gpus)))
    bad = []                    # every failing (part, config), not only the first
    for start in range(0, len(jobs), width):
        wave = jobs[start:start + width]
        procs = [subprocess.Popen(cmd + [str(i), str(c)], env=_on_gpu(env, gpus[n % len(gpus)]),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for n, (i, c) in enumerate(wave)]
        for (i, c), p in zip(wave, procs):
            out, err = finish_process(p, 900)
            if p.returncode != 0:
                bad.append(f"part {i} config {c}: relative errors {out.strip()} "
                           f"{err.strip()[-600:]}")
                print(bad[-1], file=sys.stderr, flush=True)   # seen with -s if cut off
        print(f"late-gradient check: {start + len(wave)} of {len(jobs)} jobs run, "
              f"{len(bad)} failed", file=sys.stderr, flush=True)
    assert not bad, f"{len(bad)} of {len(jobs)} failed:\n" + "\n".join(bad)


def test_late_gradient_kernels_in_triton_interpreter():
    """fp32 in Triton's CPU interpreter: within 1e-5 of the fp64 reference."""
    _run("cpu", "float32", 1e-5, True)


@apply(gpu)
def test_late_gradient_kernels_every_config_gpu():
    """Every config the autotuners may pick, forced one at a time on the GPU in bf16 (the
    dtype models train in; a miscompiled config is off by tens of %, far beyond bf16's
    rounding), also at the head dims models use; at a K tile of 32 the dq/dk kernel's set
    without the configs miscompiled there (``tuned_configs``). One process per case, decay,
    kernel and config, as many at once as there are cores; each failing one is printed as it
    ends. 148 jobs in 259 s on 4 x H100."""
    _run("cuda", "bfloat16", 1e-2, False, parts=4 * len(CASES + GPU_CASES))


@apply(gpu)
def test_late_gradient_kernels_ieee_fp32_gpu():
    """The same cases in fp32 with IEEE dots, within 1e-5 of fp64: the kernels' arithmetic on
    the real compiler, the first config of each kernel's list: 28 jobs, 202 s on 4 x H200
    (every config in fp32 did not finish its first wave of 48 jobs in 270 s there: IEEE-fp32
    dots compile and run several times slower; the math of every config is the interpreter
    test's, the compilation of every config the bf16 test's)."""
    _run("cuda", "float32", 1e-5, False, parts=4 * len(CASES + GPU_CASES), every_config=False)


def test_no_k_tile_below_32():
    """K tiles of 16 faulted on Hopper in every config (an out-of-range shared-memory access
    inside the kernel): K = 16 runs as one masked tile of 32 — exact in the interpreter (the
    first case of ``_CHECK``) — and a ``block_k`` below 32, or not a power of two, raises before
    any launch, naming the fix."""
    assert MIN_BLOCK_K == 32
    assert block_k_of(16) == block_k_of(32) == 32 and block_k_of(64) == 64
    assert block_k_of(256) == 128 and block_k_of(64, 32) == 32
    q = torch.zeros(1, 64, 1, 32)
    h = torch.zeros(1, 1, 1, 32, 32)
    for bad in (16, 48, 256):
        with pytest.raises(ValueError, match="power of two from 32 to 128"):
            chunk_dqkdg(q, q, q, q, h, h, torch.zeros(1, 64, 1), 1.0, 64, 0, bad)


def test_tile_32_never_offers_the_miscompiled_configs():
    """At a K tile of 32 the autotuner is offered the tuned set without the dsᵀ-dot 4-warp
    configs (wrong dk / dg on Hopper there), pruned per launch; at 64 and 128 the whole set, so
    the shipped autotune results of those keys stay valid."""
    from sp_attention.linear.dqk_kernel import _dqkdg_tuned, _prune
    bad = [i for i in DQK_TUNED if dsT_four_warps(DQK_CANDIDATES[i])]
    assert bad == [11, 20]
    assert tuned_configs(32) == [i for i in DQK_TUNED if i not in bad]
    assert tuned_configs(64) == tuned_configs(128) == DQK_TUNED
    configs = [DQK_CANDIDATES[i] for i in DQK_TUNED]
    assert _prune(configs, {}, BK=32) == [DQK_CANDIDATES[i] for i in tuned_configs(32)]
    assert _prune(configs, {}, BK=64) is configs and _prune(configs, {}, BK=128) is configs
    assert _dqkdg_tuned.early_config_prune is _prune


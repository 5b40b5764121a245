"""Train a small random HF Llama (softmax, linear, gated or hybrid) with context parallelism.

CPU (gloo), 4 processes = DP 2 x CP 2:
    torchrun --nproc-per-node 4 examples/hf_llama_cp.py --cp 2 [--model linear|gated|hybrid]
GPUs (NCCL, one GPU per process, bf16 autocast), CP 4 and the same data at CP 1:
    torchrun --nproc-per-node 4 examples/hf_llama_cp.py --cp 4 --device cuda --model hybrid
    torchrun --nproc-per-node 1 examples/hf_llama_cp.py --cp 1 --device cuda --model hybrid

The task is copying: each row is 31 random tokens of 32, a separator, then the same tokens
again; the loss counts only the copy, which a model can predict only by attending 32 tokens
back — across CP ranks. Chance is ln 32 = 3.47. With the defaults (2 layers, d128: head dim
32; RoPE theta 30, whose faster rotations tell a 63-token sequence's positions apart) every
--model falls far below chance in the default 150 steps. Measured with the CPU command above
(4 processes on a 2-core machine, about a minute each): final loss llama 0.002, hybrid
0.004, linear 0.04, gated 0.06. (With Llama's theta 10000 and d64, linear ended 100 steps at
3.00 and gated at chance.) Rank 0 prints the global loss every 10 steps and a last line with
the mean of the last 10 steps. The initial weights (seed 0) and the data (seed 1000 + DP
index) depend only on the DP index, so a CP 4 run and a one-process CP 1 run see the same
batches: their losses agree up to the kernels' rounding (bf16 on GPUs).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout, uninstalled

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from models.hf import (LinearLlamaConfig, LinearLlamaForCausalLM, causal_lm_loss,
                       global_loss_value, hybrid_layer_kinds, prepare_cp_batch,
                       prepare_model_for_cp)  # noqa: E402
from sp_attention import SoftmaxSchedule, release_cuda_graphs  # noqa: E402
from sp_attention.linear import IMPLS  # noqa: E402
from sp_attention.linear.attention import resolve_impl  # noqa: E402
from sp_train.reduce import all_reduce_gradients  # noqa: E402
from sp_attention.softmax.schedule import PRESET_NAMES  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cp", type=int, default=2, help="context-parallel size (divides world)")
    p.add_argument("--model", choices=("llama", "linear", "gated", "hybrid"), default="llama")
    p.add_argument("--softmax-cp-preset", choices=PRESET_NAMES, default=None,
                   help="softmax layers' schedule (default: auto, the cost model's pick; on CPU "
                   "the library's DEFAULT_PRESET)")
    p.add_argument("--context-parallel-impl", choices=IMPLS, default=None,
                   help="linear layers' scan (default: the library's DEFAULT_IMPL)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--copy-len", type=int, default=31, help="tokens to copy (T = 2 * this + 1)")
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--batch", type=int, default=8, help="rows per DP rank")
    p.add_argument("--hidden", type=int, default=128, help="model width (4 heads)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--rope-theta", type=float, default=30.0,
                   help="RoPE base (Llama's is 10000; 30 suits this short sequence)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    return p.parse_args()


def build_model(args) -> torch.nn.Module:
    cfg = dict(vocab_size=args.vocab + 1, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
               num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=4 * args.copy_len + 8, use_cache=False,
               rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta})
    if args.model == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        return LlamaForCausalLM(LlamaConfig(**cfg))
    kinds = {"linear": None, "gated": ["gated"] * args.layers}.get(
        args.model, hybrid_layer_kinds(args.layers, 2))
    return LinearLlamaForCausalLM(LinearLlamaConfig(layer_kinds=kinds, **cfg))


def copy_batch(args, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, 2L+1]`` rows ``x, SEP, x``; labels ignore everything but the copy."""
    x = torch.randint(0, args.vocab, (args.batch, args.copy_len), generator=generator)
    sep = torch.full((args.batch, 1), args.vocab)
    ids = torch.cat([x, sep, x], dim=1)
    labels = ids.clone()
    labels[:, :args.copy_len + 1] = -100      # targets are the copied tokens only
    return ids, labels


def main():
    args = parse_args()
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.cp:
        raise SystemExit(f"--cp {args.cp} must divide the world size {world}")
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dp_index = rank // args.cp
    # Every rank creates every group in the same order (torch.distributed requires it).
    cp_groups = [dist.new_group(list(range(d * args.cp, (d + 1) * args.cp)))
                 for d in range(world // args.cp)]
    cp_group = cp_groups[dp_index]
    dp_cp_group = dist.new_group(list(range(world)))   # gradients and token counts: DP x CP

    torch.manual_seed(0)                               # same initial weights on every rank
    model = build_model(args).to(device)
    schedule = SoftmaxSchedule(preset=args.softmax_cp_preset) if args.softmax_cp_preset else None
    handle = prepare_model_for_cp(model, cp_group, schedule=schedule,
                                  context_parallel_impl=args.context_parallel_impl)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    data = torch.Generator().manual_seed(1000 + dp_index)   # CP ranks share their DP row's data
    if rank == 0:
        attention = []
        if args.model in ("llama", "hybrid"):
            sched = handle.schedule
            attention.append("softmax auto (cost model)" if sched.is_auto
                             else f"softmax {sched.fwd}/{sched.bwd}")
        if args.model in ("linear", "gated", "hybrid"):
            scan = resolve_impl(args.context_parallel_impl, handle.ctx)
            attention.append(f"linear scan {'auto (cost model)' if scan == 'auto' else scan}")
        print(f"world {world} = DP {world // args.cp} x CP {args.cp}, model {args.model}, "
              f"{' + '.join(attention)}, chance {math.log(args.vocab):.3f}", flush=True)
    start, last = time.perf_counter(), []
    for step in range(1, args.steps + 1):
        ids, labels = copy_batch(args, data)
        batch = prepare_cp_batch(ids.to(device), handle.ctx, labels=labels.to(device))
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.device == "cuda"):
            logits = model(**batch.model_inputs()).logits
        share = causal_lm_loss(logits, batch.labels, dp_cp_group)
        optim.zero_grad(set_to_none=True)
        share.backward()
        all_reduce_gradients(model.parameters(), dp_cp_group)
        optim.step()
        loss = global_loss_value(share, dp_cp_group)
        last = (last + [loss])[-10:]
        if rank == 0 and (step % 10 == 0 or step == 1):
            print(f"step {step:4d}  loss {loss:.4f}  ({time.perf_counter() - start:.1f} s)",
                  flush=True)
    if rank == 0:
        mean, chance = sum(last) / len(last), math.log(args.vocab)
        verdict = "far below chance" if mean < 0.5 * chance else "not below half of chance"
        print(f"final loss {mean:.4f} (mean of the last {len(last)} steps; chance {chance:.3f}: "
              f"{verdict})", flush=True)
    release_cuda_graphs()       # the linear scans' CUDA graphs hold NCCL: drop them first
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

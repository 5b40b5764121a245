#!/usr/bin/env python3
"""Train a GPT — softmax Llama, linear attention with decay, or a hybrid of the two — with
data × context × tensor parallelism (DP × CP × TP) on Megatron-Core models.

    torchrun --nproc-per-node 4 train.py                  # CPU: TP1·CP2·DP2, generated copy task
    torchrun --nproc-per-node 4 train.py --local-attention-only   # baseline: no cross-rank attention
    torchrun --nproc-per-node 8 train.py --preset 1b --context-parallel-size 2 --data-path c.jsonl
    sbatch scripts/slurm/train.sbatch --preset 8b ...     # many nodes

One step: every DP rank takes its rows of the global batch (the labels are shifted on the whole
sequence), keeps its CP rank's shard of each sequence (in the model's layout, zigzag by
default; packed documents: a micro-batch's rows end to end, cut by their packing plan), runs
forward and backward over its micro-batches, sums the gradients over DP × CP and steps AdamW.
The default data is a copy task that only a model whose attention crosses CP ranks can learn,
so the run itself shows that context parallelism is correct. gloo on CPU, NCCL + bf16 on GPUs; nothing is patched globally.
Reusable pieces live in ``sp_train/`` (see its README).
"""
from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Optional, Sequence

# Megatron-Core announces at import, once per process, that it falls back to torch where
# TransformerEngine/Apex are absent (always true on CPU): expected here, so not repeated.
for _msg in ("Transformer Engine and Apex are not installed", "Apex is not installed",
             "full scope is deprecated", "If you are using transformer_engine"):
    warnings.filterwarnings("ignore", message=_msg, category=UserWarning)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from sp_train import checkpoint as ckpt  # noqa: E402
from sp_train.args import TrainArgs, UsageError, parse_args  # noqa: E402
from sp_train.cuda_graphs import LayerGraphs
from sp_train.data import (build_dataset, host_micro_batches, local_micro_batches,
                           plan_digests, upload_micro_batches)
from sp_train.launch import (BAD_INPUT_EXIT_STATUS, StopSignals, TrainHooks, agree_step,
                             init_distributed, say_bad_input)
from sp_train.loss import (check_loss_impl, local_token_count, micro_batch_loss,
                           step_token_count)
from sp_train.manual_gc import ManualGC
from sp_train.optim import lr_at
from sp_train.progress import (Progress, claim_logs, describe_attention, flops_per_token,
                               peak_flops, plot_losses, read_log, release_log_dir)
from sp_train.setup import (build_model, build_optimizer, check_memory, count_params, init_groups,
                            install_shipped_kernels, load_hf, memory_capacity,
                            memory_margin_warning, model_vocab, planned_softmax_preset,
                            resolve_auto_recompute, schedule_picks)
from sp_attention import build_sp_context, release_cuda_graphs
from sp_attention.call_check import note_agreed_plans
from sp_attention.tokens import require_real_tokens


def rank0_print(*a) -> None:
    if dist.get_rank() == 0:
        print(*a, flush=True)


def checked_resume_point(args: TrainArgs, layout) -> Optional[str]:
    """The checkpoint to resume from (None: start fresh), refused now if it is damaged or
    cannot be loaded into this run: on every rank, sizes and layout before any collective,
    then the checksums (one all-gather, every rank alike)."""
    path = ckpt.resume_path(args.load, args.ckpt_step)
    ckpt.require_checkpoint(args.load, args.save, path)
    if path is not None:
        meta = ckpt.verify_checkpoint(path)
        ckpt.check_compatible(meta, path, tp=layout.tp, cp=layout.cp, dp=layout.dp,
                              model=args.model_signature())
        if not args.no_checkpoint_checksums:
            ckpt.verify_checksums(path, meta)
    return path


def train_step(model, optimizer, reducer, micro_batches, count: float, groups, args, lr,
               clip: float, graphs: Optional[LayerGraphs] = None):
    """Forward/backward over the micro-batches (``count``: the step's loss tokens over all
    ranks), gradient sum over DP × CP (``reducer``: in the last backward), optimizer step.
    Returns (this rank's loss share, gradient norm). ``graphs``: the layers replayed from CUDA
    graphs (``--cuda-graphs``), if any."""
    require_real_tokens(count)              # refused before any of the step's work
    share = torch.zeros((), dtype=torch.float64, device=micro_batches[0][0].device)
    for i, (tok, pos, lab, msk, packed) in enumerate(micro_batches):
        # this rank's share of the step's global token mean (--loss-impl picks the loss)
        loss = micro_batch_loss(model, tok, pos, lab, msk, impl=args.loss_impl,
                                tp_group=groups.tp, dp_cp_group=groups.dp_cp,
                                token_count=count, packed_seq_params=packed,
                                check_labels=False)     # checked on the host (data.py)
        if i == len(micro_batches) - 1:
            reducer.arm()                   # these gradients are final: buckets travel now
        loss.backward()
        if graphs is not None and i < len(micro_batches) - 1:
            graphs.own_grads()              # the next replay would write over these
        share += loss.detach().double()     # stays on the device: agree_step() reads it
    return share, optimizer.step(lr, clip, reducer.finish())   # fp32 sums, or None: .grad


def save(args, step, model, optimizer, groups, layout, hooks: TrainHooks, vocab: int) -> None:
    meta = {"tp": layout.tp, "cp": layout.cp, "dp": layout.dp, "model": args.model_signature(),
            "args": args.flag_values(), "hf_export": args.hf_export(vocab)}
    path = ckpt.save_checkpoint(args.save, step, model, optimizer, tp_rank=groups.tp_rank,
                                meta=meta, group=None,
                                checksums=not args.no_checkpoint_checksums,
                                after_write=hooks.after_checkpoint_write)
    rank0_print(f"saved checkpoint {path}")


def main(argv: Optional[Sequence[str]] = None, signals: Optional[StopSignals] = None,
         hooks: Optional[TrainHooks] = None) -> list:
    """Run training; returns rank 0's per-step records (other ranks: []). ``signals``: the
    SIGTERM/SIGINT flag (the caller's, to read its exit status; default: one of main's own).
    ``hooks``: callbacks into the run (:class:`TrainHooks`; tests and tools)."""
    hooks = TrainHooks() if hooks is None else hooks
    args = parse_args(argv)                       # bad flags fail here, on every rank
    rank, world, device = init_distributed(args.distributed_timeout_minutes)
    install_shipped_kernels(device)               # before anything compiles
    layout = args.layout(world)                   # world-size checks, still before collectives
    auto_recompute = args.recompute_granularity == "auto"
    if not auto_recompute:
        args.recompute().check_device(device.type == "cuda")
    args.check_graph_flags(device.type == "cuda")
    args.resolve_optimizer(device.type == "cuda")
    check_loss_impl(args.loss_impl, layout.tp, device)
    resume_from = checked_resume_point(args, layout)
    if device.type != "cuda" or rank != 0:
        # Megatron's TP layers advise a CUDA setting, once per process: moot on CPU, once is enough
        warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS")
    bf16 = device.type == "cuda" if args.bf16 is None else args.bf16
    data = build_dataset(args, layout.tp)
    vocab = model_vocab(args, data, layout.tp)
    # printed before anything is allocated; a layout that cannot fit (the GPU's memory, or the
    # RAM available to each rank on CPU) stops here on every rank
    capacity, where = memory_capacity(device)
    mem = dict(bf16=bf16, softmax_preset=planned_softmax_preset(args, layout, device, bf16=bf16))
    if auto_recompute:          # the same pick on every rank: the smallest capacity of all
        if capacity is not None and world > 1:
            smallest = torch.tensor([capacity], dtype=torch.float64, device=device)
            dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
            capacity = float(smallest)
        rank0_print(resolve_auto_recompute(args, layout, vocab, capacity=capacity,
                                           on_gpu=device.type == "cuda", **mem))
    args.resolve_cuda_graphs(device.type == "cuda", layout.cp)    # recompute is known now
    estimate = check_memory(args, layout, vocab, capacity=capacity, where=where,
                            on_gpu=device.type == "cuda", **mem)
    rank0_print(f"memory estimate per rank (the model's tensors): "
                f"{estimate.summary(capacity)} — {where}")
    if device.type == "cuda":
        margin = memory_margin_warning(args, layout, vocab, estimate, capacity=capacity, **mem)
        if margin:
            rank0_print(margin)
    claim_logs(args.log_json, {"model": args.model_signature(), "data": data.description,
                               "local_attention_only": args.local_attention_only,
                               "save": os.path.abspath(args.save) if args.save else None},
               fresh=resume_from is None)

    groups = init_groups(layout, local_attention_only=args.local_attention_only)
    model = build_model(args, layout, groups, vocab, bf16=bf16, device=device)
    if args.hf is not None and resume_from is None:     # a resumed run has its own weights
        load_hf(model, args, groups, layout.tp)
    # the data is split like the model's attention and RoPE expect: the model's one context (the
    # baseline's model sees a CP group of one; its data is still split over the real group)
    cp_ctx = (build_sp_context(groups.cp, layout=model.sp_context.layout)
              if args.local_attention_only else model.sp_context)
    # layers replayed from CUDA graphs are marked before the optimizer hooks the model
    graphs = LayerGraphs(model.decoder.layers) if args.cuda_graphs else None
    optimizer, reducer = build_optimizer(model, args, groups)   # Adam's state exists now
    start = 0
    if resume_from is not None:
        start = ckpt.load_checkpoint(resume_from, model, optimizer, tp_rank=groups.tp_rank,
                                     group=None)

    if hooks.on_model is not None:
        hooks.on_model(model, start)
    n_params = count_params(model, layout.tp)
    picks = schedule_picks(model, args, layout, cp_ctx, bf16=bf16, device=device)
    attn = describe_attention(args.sp_options, cp_ctx, args.local_attention_only, picks)
    rope = f"RoPE θ {args.rotary_base:g}" + (
        f", {args.rope_scaling['rope_type']} scaling ×{args.rope_scaling['factor']:g}"
        if args.rope_scaling else "")
    rank0_print(
        f"train.py | {args.sp_model_kind} {args.num_layers}L d{args.hidden_size} "
        f"{args.num_attention_heads}h ({n_params / 1e6:.2f}M params) | {layout.summary()} | "
        f"attention {attn}, {rope} | {dist.get_backend()} on {device.type}, "
        f"{'bf16' if bf16 else 'fp32'} | {args.recompute().describe()}, {args.loss_impl} loss"
        f"{', distributed optimizer' if reducer.shard else ''}"
        f"{' (parameter gather overlapped)' if optimizer.overlap_param_gather else ''}"
        f"{', layers replayed from CUDA graphs' if graphs is not None else ''}"
        f"{' (--no-cuda-graphs: eager)' if graphs is not None else ''} | "
        f"{data.description} | steps {start + 1}..{args.train_iters}"
        f" × {args.global_batch_size} seqs × {args.seq_length} tokens"
        + (f" | resumed from {resume_from}" if resume_from else
           f" | weights from {args.load_hf}" if args.hf is not None else ""))

    fpt = flops_per_token(num_layers=args.num_layers, hidden_size=args.hidden_size,
                          ffn_hidden_size=args.ffn_hidden_size,
                          num_attention_heads=args.num_attention_heads,
                          num_query_groups=args.num_query_groups, vocab_size=vocab,
                          seq_length=args.seq_length, layer_kinds=args.layer_kinds())
    progress = Progress(enabled=rank == 0, total=args.train_iters, start=start,
                        tokens_per_step=args.global_batch_size * args.seq_length,
                        flops_per_token=fpt, peak=peak_flops(device, args.peak_tflops),
                        device=device, log_interval=args.log_interval,
                        log_json=args.log_json, tensorboard_dir=args.tensorboard_dir,
                        bar=not args.no_progress_bar)
    own_signals = signals is None
    signals = StopSignals() if own_signals else signals
    step, stopped = start, False
    model.train()
    try:
        with ManualGC(args.manual_gc, args.manual_gc_interval) as collector:
            if step < args.train_iters:     # the first step's data and loss tokens, all ranks
                batches = local_micro_batches(data, step, args, layout, groups, cp_ctx, device)
                count = step_token_count(batches, groups.dp_cp)
            while step < args.train_iters and not stopped:
                lr = lr_at(step, args.lr, args.min_lr, args.lr_warmup_iters, args.train_iters)
                share, gnorm = train_step(model, optimizer, reducer, batches, count, groups,
                                          args, lr, args.clip_grad, graphs)
                step += 1
                if hooks.after_step is not None:
                    hooks.after_step(step)
                # the next step's data made while the GPU finishes this one, its token count
                # and packing plans agreed with the loss, uploaded after (no host work of its
                # own between the steps, no check of its plans in the layers)
                nxt, error = batches, None
                try:                                # a data error stops every rank, below
                    if step < args.train_iters:
                        nxt = host_micro_batches(data, step, args, layout, groups, cp_ctx)
                except ValueError as e:
                    error = e
                plans = plan_digests(nxt, args.local_attention_only, layout.dp)
                batches = upload_micro_batches(nxt, device)     # queued: the host waits below
                loss, count, signals.stopped_by = agree_step(
                    share, signals.signum, layout.tp, local_token_count(nxt), plans,
                    groups.dp_rank, layout.dp, error)
                note_agreed_plans(cp_ctx, plans or ())
                stopped = signals.stopped_by is not None
                progress.step(step, loss, float(gnorm), lr)     # computed by now: no wait
                collector.after_step(step)
                periodic = args.save_interval and step % args.save_interval == 0
                if args.save and (periodic or stopped or step == args.train_iters):
                    save(args, step, model, optimizer, groups, layout, hooks, vocab)
    finally:
        progress.close()
        if graphs is not None:
            graphs.release()            # the layers run their own forwards again; NCCL let go
        if rank == 0:
            release_log_dir(args.log_json)
    optimizer.settle()                  # the last step's parameter gathers, if still in flight
    if hooks.on_model is not None:
        hooks.on_model(model, step)
        if own_signals:
            signals.restore()
    if rank == 0 and progress.history:          # means of the steady steps, for benchmarks
        summary = dict(progress.summary(), model_kind=args.sp_model_kind, preset=args.preset,
                       seq_length=args.seq_length, loss_impl=args.loss_impl,
                       recompute=args.recompute().describe(),
                       mem_estimate_gb=estimate.total / 2**30,
                       layout=layout.summary(), params=n_params, device=str(device),
                       gpu=torch.cuda.get_device_name() if device.type == "cuda" else None)
        with open(os.path.join(os.path.dirname(os.path.abspath(args.log_json)),
                               "summary.json"), "w") as f:
            json.dump(summary, f, indent=1, ensure_ascii=False)
        print("summary: " + json.dumps(summary, ensure_ascii=False), flush=True)
    png = None
    if rank == 0 and os.path.exists(args.log_json):
        chance = getattr(data, "chance_loss", None) if args.data_path is None else None
        label = "local attention only" if args.local_attention_only else "CP attention"
        png = plot_losses({label: read_log(args.log_json)}, args.loss_png, chance=chance,
                          title=f"{args.sp_model_kind}, {layout.summary().split(' (')[0]}")
    if stopped:                      # the last line of a preempted run: what and how to go on
        rank0_print(f"stopped by {signals.name} after step {step}"
                    + (f": checkpoint {ckpt.find_latest(args.save)}" if args.save else
                       ": no checkpoint (no --save)")
                    + (f", loss curve {png}" if png else "")
                    + (f"; resume with --load {args.save}" if args.save else ""))
    elif png:
        rank0_print(f"loss curve: {png}")
    return progress.history


if __name__ == "__main__":
    stop = StopSignals()     # SIGTERM/SIGINT from the start: a stop, never a kill mid-save
    try:
        main(sys.argv[1:], stop)
    except ckpt.CheckpointError as e:    # raised alike on every rank: said once
        if (dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))) == 0:
            print(f"train.py: error: {e}", file=sys.stderr, flush=True)
        sys.exit(BAD_INPUT_EXIT_STATUS)
    except ValueError as e:              # bad input: the fix is in the message, on every rank
        say_bad_input(e, isinstance(e, UsageError), stop)
        sys.exit(BAD_INPUT_EXIT_STATUS)
    finally:
        if dist.is_initialized():
            release_cuda_graphs()        # a live CUDA graph holding NCCL blocks the destroy
            dist.destroy_process_group()
    sys.exit(stop.exit_status)           # 0, or 75 after SIGTERM (requeue), 130 after SIGINT

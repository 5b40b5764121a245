"""Megatron-Core pieces train.py puts together: process groups, the TransformerConfig of a
Llama-style model, and the model itself (``megatron_patches.model.build_gpt_model``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import os

import torch
import torch.distributed as dist

from megatron_patches.weights import load_hf_into, padded_vocab
from sp_attention import DEFAULT_LAYOUT
from sp_attention.cost.auto import softmax_preset_for_shape
from sp_attention.cost.common import SoftmaxShape, Topology
from sp_attention.linear.autotune_seeds import install_once

from .args import Layout, TrainArgs, UsageError
from .loss import default_chunk_tokens
from .memory import GIB, ModelShape, StepShape, estimate_memory
from .optim import MasterAdamW
from .progress import layer_forward_flops
from .reduce import GradientReducer, group_size
from .sharded_optim import ShardedAdamW

__all__ = ["Groups", "init_groups", "build_optimizer", "transformer_config", "build_model",
           "count_params", "memory_estimate", "check_memory", "memory_margin_warning",
           "GPU_HEADROOM", "memory_capacity", "model_vocab", "load_hf", "schedule_picks"]


@dataclass
class Groups:
    """This rank's groups (Megatron's ``parallel_state``, order tp-cp-ep-dp-pp) and ranks."""
    tp: Optional[dist.ProcessGroup]
    cp: Optional[dist.ProcessGroup]
    dp_cp: Optional[dist.ProcessGroup]     # gradients and the loss are reduced over DP × CP
    tp_rank: int
    cp_rank: int
    dp_rank: int
    model_pgs: Any = None                  # ProcessGroupCollection for the model (baseline)


def init_groups(layout: Layout, *, local_attention_only: bool = False) -> Groups:
    """``initialize_model_parallel(TP, CP)`` on every rank (collective). With
    ``local_attention_only`` (the baseline that breaks CP on purpose) the model gets a CP group
    of one rank each, so attention never looks at another rank's tokens; the data is still
    split over the real CP group and gradients still reduced over DP × CP."""
    from megatron.core import parallel_state as ps
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=layout.tp,
                                 context_parallel_size=layout.cp)
    g = Groups(tp=ps.get_tensor_model_parallel_group(), cp=ps.get_context_parallel_group(),
               dp_cp=ps.get_data_parallel_group(with_context_parallel=True),
               tp_rank=ps.get_tensor_model_parallel_rank(),
               cp_rank=ps.get_context_parallel_rank(),
               dp_rank=ps.get_data_parallel_rank())
    if local_attention_only:
        from megatron.core.process_groups_config import ProcessGroupCollection
        me = dist.get_rank()
        solo = None
        for r in range(dist.get_world_size()):       # new_group is collective: all ranks, all
            grp = dist.new_group([r])
            solo = grp if r == me else solo
        pgs = ProcessGroupCollection.use_mpu_process_groups()
        pgs.cp = solo
        g.model_pgs = pgs
    return g


def transformer_config(args: TrainArgs, layout: Layout, *, bf16: bool, on_gpu: bool):
    """A Llama-style config: RMSNorm, SwiGLU, no biases, no dropout, GQA. CPU: fp32 and CPU
    initialisation (the full weight is drawn then split, so every TP size starts from the same
    model); GPU: bf16 parameters initialised on the device."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig
    dtype = torch.bfloat16 if bf16 else torch.float32
    # the baseline's model sees a CP group of one: its shard is all the sequence it knows
    cp = 1 if args.local_attention_only else layout.cp
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        ffn_hidden_size=args.ffn_hidden_size, kv_channels=args.hidden_size
        // args.num_attention_heads,
        tensor_model_parallel_size=layout.tp, context_parallel_size=cp,
        sequence_parallel=False, normalization="RMSNorm", layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        bf16=bf16, params_dtype=dtype, pipeline_dtype=dtype,
        use_cpu_initialization=not on_gpu, perform_initialization=True,
        bias_activation_fusion=on_gpu, masked_softmax_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        cross_entropy_loss_fusion=on_gpu,   # Megatron's native fused CE (--loss-impl megatron)
        **args.recompute().config_kwargs())


def build_model(args: TrainArgs, layout: Layout, groups: Groups, vocab_size: int, *,
                bf16: bool, device: torch.device) -> torch.nn.Module:
    """The model for ``args.sp_model_kind`` on ``device`` (same seed on every rank: TP ranks draw
    the same full weights and keep their slices; CP/DP replicas are identical)."""
    from megatron_patches.model import build_gpt_model
    on_gpu = device.type == "cuda"
    torch.manual_seed(args.seed)
    if on_gpu:
        from megatron.core import tensor_parallel
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    config = transformer_config(args, layout, bf16=bf16, on_gpu=on_gpu)
    kw = {} if groups.model_pgs is None else {"pg_collection": groups.model_pgs}
    model = build_gpt_model(config, args.sp_options, vocab_size=vocab_size,
                            max_sequence_length=args.seq_length,
                            rotary_base=args.rotary_base, rope_scaling=args.rope_scaling,
                            share_embeddings_and_output_weights=args.tie_embeddings,
                            return_hidden_states=args.loss_impl != "megatron", **kw)
    if bf16:
        # What Megatron's Float16Module does to the model: every parameter in bf16. Megatron's
        # torch norms ignore params_dtype, and an fp32 norm weight on bf16 activations keeps
        # torch from its fused RMSNorm (the unfused one cost ~0.2 s of a 1.3 s 1B step).
        model = model.bfloat16()
    return model.to(device)


def schedule_picks(model, args: TrainArgs, layout: Layout, cp_ctx, *, bf16: bool,
                   device: torch.device) -> dict:
    """What each layer kind's schedule resolves to for this run's shape (``auto``: the cost
    model's or the CPU rule's pick): :func:`megatron_patches.model.auto_picks`."""
    from megatron_patches.model import auto_picks
    return auto_picks(model.sp_options, cp_ctx, micro_batch_size=layout.micro_batch_size,
                      seq_length=args.seq_length,
                      head_dim=args.hidden_size // args.num_attention_heads,
                      dtype=torch.bfloat16 if bf16 else torch.float32, device=device)


def count_params(model: torch.nn.Module, tp: int) -> int:
    """Parameters of the whole model (TP-split ones counted over all TP ranks)."""
    return sum(p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1)
               for p in model.parameters())


def planned_softmax_preset(args: TrainArgs, layout: Layout, device: torch.device, *,
                           bf16: bool) -> Optional[str]:
    """The preset this run's softmax layers will run, resolved from sizes before anything
    exists (``auto``: the cost model on GPUs, the fixed rule on CPU, as the op resolves it for
    the same per-rank shape, group and nodes); None without softmax layers or CP.
    The memory estimate needs it: the all-to-all presets save other tensors."""
    options = args.sp_options
    if "S" not in options.pattern or layout.cp == 1 or args.local_attention_only:
        return None
    s = options.softmax_schedule         # SPOptions fills in the default
    if not s.is_auto:
        return s.preset_name
    heads = args.num_attention_heads // layout.tp
    kv = max(1, args.num_query_groups // layout.tp)
    shape = SoftmaxShape(layout.micro_batch_size, args.seq_length // layout.cp, heads, kv,
                         args.hidden_size // args.num_attention_heads, 2 if bf16 else 4, True)
    # the first CP group's global ranks (Megatron orders TP innermost, then CP) over torchrun's
    # nodes, and the a2a_ring size the op would consider (as sp_attention.softmax does)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    topology = Topology.of_ranks(range(0, layout.cp * layout.tp, layout.tp), per_node) \
        if per_node > 0 else None
    return softmax_preset_for_shape(device, shape, layout.cp, DEFAULT_LAYOUT, topology,
                                    heads_k_stride=s.heads_k_stride,
                                    a2a_size=s.auto_a2a_size(layout.cp, heads),
                                    packed=args.packing == "documents").name


def _a2a_group(args: TrainArgs, layout: Layout, preset: Optional[str]) -> int:
    """Ranks per all-to-all group of ``preset`` (1: not an all-to-all preset)."""
    if preset == "a2a":
        return layout.cp
    if preset == "a2a_ring":
        return args.sp_options.softmax_schedule.a2a_size or 1
    return 1


def memory_estimate(args: TrainArgs, layout: Layout, vocab_size: int, *, bf16: bool,
                    softmax_preset: Optional[str] = None):
    """``sp_train.memory.estimate_memory`` for this run (pure: no device, no collective);
    ``softmax_preset``: what the softmax layers run (:func:`planned_softmax_preset`; None: a
    ring or all-gather schedule)."""
    rc = args.recompute()
    model = ModelShape(args.num_layers, args.hidden_size, args.ffn_hidden_size,
                       args.num_attention_heads, args.num_query_groups, vocab_size,
                       args.layer_kinds(), tied_embeddings=args.tie_embeddings)
    step = StepShape(tp=layout.tp, cp=layout.cp, dp=layout.dp,
                     micro_batch_size=layout.micro_batch_size,
                     num_micro_batches=layout.num_micro_batches, seq_length=args.seq_length,
                     param_bytes=2 if bf16 else 4, recompute=rc.granularity,
                     recompute_method=rc.method, recompute_num_layers=rc.num_layers,
                     recompute_modules=rc.modules or ("core_attn",), loss=args.loss_impl,
                     loss_chunk_tokens=default_chunk_tokens(vocab_size // layout.tp),
                     grad_reduce_overlap=not args.no_overlap_grad_reduce,
                     distributed_optimizer=bool(args.use_distributed_optimizer),
                     overlap_param_gather=bool(args.overlap_param_gather),
                     softmax_a2a_group=_a2a_group(args, layout, softmax_preset))
    return model, step, estimate_memory(model, step)


def memory_capacity(device: torch.device) -> tuple[Optional[float], str]:
    """``(bytes one rank may use, what that is)``: the GPU's memory, or on CPU the RAM the
    kernel reports available (``MemAvailable`` of ``/proc/meminfo``, else psutil) shared by
    the ranks of this node (torchrun's ``LOCAL_WORLD_SIZE``)."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory), "the GPU's memory"
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    avail = None
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f
                         if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        try:
            import psutil
            avail = psutil.virtual_memory().available
        except ImportError:
            pass
    if avail is None:
        return None, "RAM (unknown: no /proc/meminfo, no psutil; not checked)"
    share = f" / {ranks} ranks on this node" if ranks > 1 else ""
    return avail / ranks, f"available RAM per rank (MemAvailable {avail / GIB:.1f} GiB{share})"


def install_shipped_kernels(device: torch.device) -> None:
    """On GPUs, the package's shipped Triton autotune results and compiled kernels into this
    process's Triton caches before anything compiles (``sp_attention.linear.autotune_seeds``):
    the softmax merge's and the loss's kernels too, which a model without linear layers — the
    only other caller is the linear path's first call — would otherwise compile anew."""
    if device.type == "cuda":
        install_once()


def model_vocab(args: TrainArgs, data, tp: int) -> int:
    """The model's vocabulary (embedding and output rows over all TP ranks): the data's
    (padded, :func:`sp_train.data.pad_vocab`), or a ``--load-hf`` checkpoint's padded to a
    multiple of TP only, which must hold every token the data uses."""
    if args.hf is None:
        return data.vocab_size
    if data.tokens_used > args.hf.vocab_size:
        raise UsageError(f"the data uses {data.tokens_used} token ids but the --load-hf "
                         f"checkpoint's vocabulary has {args.hf.vocab_size}: pass its tokenizer "
                         f"(--tokenizer-model {args.load_hf}) or a smaller --copy-vocab")
    return padded_vocab(args.hf.vocab_size, tp)


def load_hf(model: torch.nn.Module, args: TrainArgs, groups: Groups, tp: int) -> None:
    """``--load-hf``'s weights into the freshly built ``model`` (this rank's TP slices)."""
    load_hf_into(model, args.load_hf, args.hf, tp_rank=groups.tp_rank, tp_size=tp)


def check_memory(args: TrainArgs, layout: Layout, vocab_size: int, *, bf16: bool,
                 capacity: Optional[float], where: str = "the device holds",
                 on_gpu: bool = True, softmax_preset: Optional[str] = None):
    """The run's :class:`~sp_train.memory.MemoryEstimate`; raises :class:`UsageError` (the
    same on every rank) naming the fixes (more CP, recompute on GPUs, a smaller micro-batch,
    each with its own estimate) when it exceeds ``capacity`` bytes (``where``: what that is;
    None: no limit) and ``--no-memory-check`` is not given."""
    model, step, est = memory_estimate(args, layout, vocab_size, bf16=bf16,
                                       softmax_preset=softmax_preset)
    line = f"memory estimate per rank: {est.summary(capacity)}"
    if capacity is None or est.total <= capacity or args.no_memory_check:
        return est
    raise UsageError(f"the {line}: more than {where}. Fixes (their estimates): "
                     + "; ".join(_memory_fixes(args, layout, model, step, capacity, on_gpu))
                     + ". (--no-memory-check starts anyway.)")


# What a GPU process holds outside PyTorch's tensors (CUDA context, cuDNN/cuBLAS/NCCL/Triton
# state) plus what fragmentation strands: 8.9 GiB outside PyTorch and 2.2 GiB reserved but
# unallocated when the 1B hybrid at 32K ran out of memory on an 80 GB H100 (2026-11-26), its
# tensors' peak (68.75 GB) equal to the estimate (69.2 GiB).
GPU_HEADROOM = 12 * GIB


def memory_margin_warning(args: TrainArgs, layout: Layout, vocab_size: int, est, *,
                          bf16: bool, capacity: Optional[float],
                          softmax_preset: Optional[str] = None) -> Optional[str]:
    """A warning when a GPU run's estimate fits the card but leaves less than
    :data:`GPU_HEADROOM` for the memory outside its tensors (None otherwise)."""
    if capacity is None or est.total > capacity or capacity - est.total >= GPU_HEADROOM:
        return None
    model, step, _ = memory_estimate(args, layout, vocab_size, bf16=bf16,
                                     softmax_preset=softmax_preset)
    fixes = _memory_fixes(args, layout, model, step, capacity - GPU_HEADROOM, True)
    return (f"warning: the estimate leaves {(capacity - est.total) / GIB:.1f} GiB of the GPU for "
            f"CUDA, cuDNN, NCCL and fragmentation (about {GPU_HEADROOM / GIB:.0f} GiB seen in "
            "use): this run may run out of memory. More room (their estimates): "
            + "; ".join(fixes) + ".")


def _memory_fixes(args: TrainArgs, layout: Layout, model, step, capacity: float,
                  on_gpu: bool) -> list:
    """The layout and recompute changes that shrink the estimate, each with its estimate."""
    import dataclasses
    fixes = []
    cp = 2 * layout.cp            # the smallest CP (doubling) that fits, or the last tried
    while cp < 64 and estimate_memory(model, dataclasses.replace(step, cp=cp)).total > capacity:
        cp *= 2
    unit = "GPUs" if on_gpu else "ranks"
    options = [(f"--context-parallel-size {cp} ({cp // layout.cp}x the {unit})", dict(cp=cp))]
    if on_gpu and step.recompute != "full":
        options.append(("--recompute-granularity full",
                        dict(recompute="full", recompute_method=None,
                             recompute_num_layers=None)))
    if on_gpu and step.recompute is None:
        options.append(("--recompute-granularity selective --recompute-modules core_attn mlp",
                        dict(recompute="selective", recompute_modules=("core_attn", "mlp"))))
    if layout.micro_batch_size > 1:
        options.append((f"--micro-batch-size {layout.micro_batch_size // 2}",
                        dict(micro_batch_size=layout.micro_batch_size // 2)))
    for flag, change in options:
        if args.seq_length % (2 * change.get("cp", 1)):
            continue
        alt = estimate_memory(model, dataclasses.replace(step, **change))
        fixes.append(f"{flag}: {alt.total / GIB:.1f} GiB")
    return fixes


def recompute_candidates(num_layers: int) -> list:
    """Every recompute setting ``--recompute-granularity auto`` weighs, as the flags' values
    ``(granularity, method, num_layers, modules)``: none, selective with each module set,
    full on the first N layers (block) for N = 1 … L − 1, and full on every layer."""
    out = [(None, None, None, None)]
    out += [("selective", None, None, m) for m in (("core_attn",), ("mlp",), ("core_attn", "mlp"))]
    out += [("full", "block", n, None) for n in range(1, num_layers)]
    return out + [("full", "uniform", 1, None)]


def layer_flops(args: TrainArgs) -> list:
    """:func:`~sp_train.progress.layer_forward_flops` of this run's layers."""
    return layer_forward_flops(hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
                               num_attention_heads=args.num_attention_heads,
                               num_query_groups=args.num_query_groups,
                               seq_length=args.seq_length, layer_kinds=args.layer_kinds())


def recomputed_flops(layers: list, rc) -> float:
    """Forward FLOPs per token a step spends again under recompute ``rc`` (a
    :class:`~sp_train.recompute.Recompute`) over ``layers`` (:func:`layer_flops`): the
    replayed modules (selective) or layers (full: the first ``num_layers`` with ``block``, all
    with ``uniform``)."""
    if rc.granularity is None:
        return 0.0
    if rc.granularity == "selective":
        return sum(("mlp" in rc.modules) * mlp + ("core_attn" in rc.modules) * attn
                   for _, mlp, attn in layers)
    return sum(sum(layer) for layer in layers[:rc.recomputed_layers()])


def resolve_auto_recompute(args: TrainArgs, layout: Layout, vocab_size: int, *, bf16: bool,
                           capacity: Optional[float], on_gpu: bool,
                           softmax_preset: Optional[str] = None) -> str:
    """``--recompute-granularity auto``: set ``args``' recompute flags to the setting that
    replays the fewest forward FLOPs among those whose memory estimate leaves
    :data:`GPU_HEADROOM` of ``capacity`` (:func:`recompute_candidates`; the least memory when
    none does, so that the memory check names the fixes); none on CPU (Megatron's checkpoint
    needs the CUDA RNG) or without a capacity. Pure arithmetic on sizes: every rank picks the
    same when given the same capacity. Returns the line to print."""
    def set_flags(values) -> None:
        g, method, n, modules = values
        args.recompute_granularity, args.recompute_method, args.recompute_num_layers = g, method, n
        args.recompute_modules = None if modules is None else list(modules)
    if not on_gpu or capacity is None:
        set_flags((None,) * 4)
        why = "on CPU" if not on_gpu else "the device's memory is unknown"
        return f"recompute auto: none ({why})"
    room, layers = capacity - GPU_HEADROOM, layer_flops(args)
    tried = []
    for values in recompute_candidates(args.num_layers):
        set_flags(values)
        rc = args.recompute()
        _, _, est = memory_estimate(args, layout, vocab_size, bf16=bf16,
                                    softmax_preset=softmax_preset)
        tried.append((recomputed_flops(layers, rc), est.total, values, rc))
    fits = [t for t in tried if t[1] <= room]
    flops, total, values, rc = min(fits, key=lambda t: (t[0], t[1])) if fits else \
        min(tried, key=lambda t: t[1])
    set_flags(values)
    forward = sum(sum(layer) for layer in layers)
    return (f"recompute auto: {rc.describe()} — estimate {total / GIB:.1f} GiB per rank "
            + (f"within {room / GIB:.1f} GiB (the GPU's {capacity / GIB:.1f} less "
               f"{GPU_HEADROOM / GIB:.0f} GiB outside the tensors)" if fits else
               f"(the least of every setting; {room / GIB:.1f} GiB available)")
            + f"; replays {100 * flops / forward:.0f} % of the layers' forward FLOPs")


def build_optimizer(model: torch.nn.Module, args, groups):
    """train.py's optimizer and gradient reducer: :class:`~sp_train.optim.MasterAdamW` with
    the fp32 sums of an (overlapped) all-reduce, or with ``--use-distributed-optimizer`` over
    more than one DP × CP rank :class:`~sp_train.sharded_optim.ShardedAdamW` with a
    reduce-scatter. Adam's state exists on return, so a run that cannot fit fails in its
    first step."""
    named = list(model.named_parameters())
    kw = dict(lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
              weight_decay=args.weight_decay, tp_group=groups.tp, tp_rank=groups.tp_rank)
    shard = bool(args.use_distributed_optimizer) and group_size(groups.dp_cp) > 1
    reducer = GradientReducer([p for _, p in named], groups.dp_cp, write_back=False,
                              overlap=not args.no_overlap_grad_reduce, shard=shard)
    if shard:
        optimizer = ShardedAdamW(named, reducer.buckets, groups.dp_cp, **kw,
                                 overlap_param_gather=bool(args.overlap_param_gather))
        optimizer.attach(model)          # --overlap-param-gather: the forward waits per bucket
    else:
        optimizer = MasterAdamW(named, **kw)
    optimizer.init_state()
    return optimizer, reducer

"""Megatron-LM's GPT pretraining with ``--context-parallel-impl`` (megatron-core >= 0.18 wheel).

    torchrun --nproc-per-node N -m megatron_patches.pretrain_gpt <Megatron-LM pretrain args> \\
        --transformer-impl local --no-rope-fusion --no-create-attention-mask-in-dataloader \\
        --attention-dropout 0 --sp-model-kind hybrid --context-parallel-impl blelloch

Mirrors Megatron-LM's ``pretrain_gpt.py`` on the wheel's ``megatron.training`` (which ships
without Megatron-LM's root scripts): Megatron's own argument parsing (plus ours,
:mod:`megatron_patches.args`), ``pretrain`` with its optimizer, schedules, DDP,
checkpointing, logging and mock / indexed GPT datasets. Only the model provider is ours
(:func:`megatron_patches.model.build_gpt_model`) and the batch's CP split uses the library's
sharding in the model's layout (``sp_attention.DEFAULT_LAYOUT``, zigzag: identical to Megatron's
``get_batch_on_this_cp_rank``). With ``--reset-attention-mask --reset-position-ids`` each
micro-batch becomes a THD row of documents split at EOD, cut by our packing plan
(:func:`get_batch`).

Importing this module imports nothing from ``megatron.training`` (so it is safe on
megatron-core 0.16, which has none); :func:`main` needs it, and says so once (not once per
rank) where it is missing: Python 3.11 resolves megatron-core 0.16.1, the last release for it.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from functools import partial
from typing import Optional

_PROGRAM_START = time.time()

from sp_attention import release_cuda_graphs  # noqa: E402 (after the start time)

MIN_CORE = (0, 18)          # parse_and_validate_args(extra_args_provider=) arrived in 0.18


def missing_requirement(python: tuple, core_version: Optional[str],
                        has_training: bool) -> Optional[str]:
    """What this launcher lacks (None: nothing), as one message with the fix; pure."""
    try:
        core = tuple(int(x) for x in (core_version or "0.0").split(".")[:2])
    except ValueError:
        core = (0, 0)
    if has_training and core >= MIN_CORE:
        return None
    have = (f"this is Python {'.'.join(map(str, python[:3]))} with "
            + (f"megatron-core {core_version}" if core_version else "no megatron-core"))
    fix = ('pip install "megatron-core>=0.18" on Python >= 3.12' if python[:2] >= (3, 12) else
           'a Python >= 3.12 environment, then pip install "megatron-core>=0.18" (on Python '
           '3.11 pip stops at megatron-core 0.16.1, which has no megatron.training)')
    return ("megatron_patches.pretrain_gpt runs Megatron-LM's trainer (megatron.training), "
            f"which needs megatron-core >= 0.18 and Python >= 3.12; {have}. Install: {fix}. "
            "On this Python, train.py trains the same models on megatron-core 0.16: "
            "torchrun --nproc-per-node 4 train.py --sp-model-kind hybrid")


def _exit_unless_supported() -> None:
    """Exit 2 with one message (printed by rank 0 alone) if megatron.training is unusable."""
    import importlib.metadata
    import importlib.util
    try:
        version: Optional[str] = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        version = None
    try:
        has_training = importlib.util.find_spec("megatron.training") is not None
    except ModuleNotFoundError:        # no megatron package at all
        has_training = False
    msg = missing_requirement(sys.version_info, version, has_training)
    if msg is None:
        return
    if os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0":
        print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage=None,
                   config=None, pg_collection=None):
    """Megatron ``model_provider``: our GPT (softmax / linear / hybrid) from the parsed args."""
    from megatron.training import get_args, print_rank_0
    from megatron.training.arguments import core_transformer_config_from_args

    from megatron.core import parallel_state

    from .args import hf_architecture, options_of, rope_scaling_of
    from .model import auto_picks, build_gpt_model
    from .weights import load_hf_into

    args = get_args()
    options = options_of(args)          # what main's validate_args built, once
    if config is None:
        config = core_transformer_config_from_args(args)
    common = dict(vocab_size=args.padded_vocab_size,
                  max_sequence_length=args.max_position_embeddings,
                  pre_process=pre_process, post_process=post_process,
                  fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
                  parallel_output=True,
                  share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                  position_embedding_type=args.position_embedding_type,
                  rotary_percent=args.rotary_percent)
    if options.megatron_attention:      # Megatron's own attention, local spec
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        print_rank_0("building Megatron's GPT model (--context-parallel-impl megatron)")
        return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(
            normalization=args.normalization), rotary_base=args.rotary_base,
            pg_collection=pg_collection, vp_stage=vp_stage, **common)
    arch = hf_architecture(args)        # checked in validate_args; None without --load-hf
    model = build_gpt_model(config, options, pg_collection=pg_collection,
                            rotary_base=args.rotary_base, vp_stage=vp_stage,
                            rope_scaling=rope_scaling_of(args, arch), **common)
    picks = auto_picks(options, model.sp_context, micro_batch_size=args.micro_batch_size,
                       seq_length=args.seq_length, head_dim=config.kv_channels,
                       dtype=config.params_dtype, device=next(model.parameters()).device)
    print_rank_0(f"building {options.model_kind} GPT, layers {options.pattern}: "
                 + ", ".join(f"{k} {'auto → ' if _is_auto(options, k) else ''}{v}"
                             for k, v in picks.items()))
    if arch is not None:
        load_hf_into(model, args.load_hf, arch,
                     tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                     tp_size=args.tensor_model_parallel_size)
        print_rank_0(f"initialised from --load-hf {args.load_hf} (a checkpoint under --load "
                     "replaces these weights)")
    return model


def _is_auto(options, kind: str) -> bool:
    """Whether the layer kind's schedule was left to ``auto`` (the header says what it picked)."""
    import sp_attention.linear.attention as linear
    if kind == "softmax":
        return options.softmax_schedule.is_auto
    return (options.context_parallel_impl or linear.DEFAULT_IMPL) == "auto"


def model_context(model):
    """The ``SPContext`` the model's attention and RoPE use (``build_gpt_model`` stores it as
    ``sp_context`` on the GPTModel inside Megatron's wrappers); Megatron's own model (``megatron``
    impl): Megatron's CP group in Megatron's layout."""
    inner = model[0] if isinstance(model, list) else model
    while not hasattr(inner, "sp_context") and hasattr(inner, "module"):
        inner = inner.module
    if hasattr(inner, "sp_context"):
        return inner.sp_context
    from .model import cp_context
    from .specs import MEGATRON_LAYOUT
    return cp_context(layout=MEGATRON_LAYOUT)


def get_batch(data_iterator, ctx, *, eod: Optional[int] = None, device="cuda"):
    """Next micro-batch, split over CP by ``ctx`` (the model's context, so data, attention and
    RoPE share one layout) and moved to ``device``. Every rank reads the data itself; the
    datasets are built on every rank, see ``datasets_provider``.

    ``eod`` (``--reset-attention-mask --reset-position-ids``: the tokenizer's end-of-document
    id): the micro-batch's rows are laid end to end into one THD row whose documents end at
    each EOD (and at each row's end), cut by the batch's packing plan
    (:func:`megatron_patches.packing.pack_batch`; how that differs from Megatron's
    ``get_batch_on_this_cp_rank``: :mod:`megatron_patches.packing`); ``position_ids`` restart
    per document and ``packed_seq_params`` (THD) goes to the model. Without it,
    ``packed_seq_params`` is None."""
    import torch
    from sp_attention import shard_sequence

    from .packing import eod_cu_seqlens, pack_batch

    batch = next(data_iterator)
    if batch.get("attention_mask") is not None:
        raise ValueError("the dataset built an attention mask; pass "
                         "--no-create-attention-mask-in-dataloader")
    keys = ("tokens", "labels", "loss_mask")
    if eod is not None:
        out, params, _ = pack_batch({k: batch[k] for k in keys},
                                    eod_cu_seqlens(batch["tokens"], eod), ctx, device=device)
    else:
        out = {k: shard_sequence(batch[k].to(device, non_blocking=True), ctx, dim=1)
               for k in keys + ("position_ids",)}
        params = None
    out["tokens"] = out["tokens"].to(torch.long)
    out["packed_seq_params"] = params
    return out


def loss_func(loss_mask, output_tensor):
    """Sum of token losses, token count, and the report Megatron logs (as pretrain_gpt.py)."""
    import torch
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1),
                                                    num_tokens.view(1)])}


def forward_step(data_iterator, model):
    """Megatron ``forward_step``: one micro-batch through the model."""
    from megatron.training import get_args, get_timers, get_tokenizer
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    eod = get_tokenizer().eod if get_args().reset_attention_mask else None
    b = get_batch(data_iterator, model_context(model), eod=eod)
    timers("batch-generator").stop()
    out = model(b["tokens"], b["position_ids"], None, labels=b["labels"],
                loss_mask=b["loss_mask"], packed_seq_params=b["packed_seq_params"])
    return out, partial(loss_func, b["loss_mask"])


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron's GPT datasets (mock with ``--mock-data``, else indexed ``--data-path``)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import \
        BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer, print_rank_0
    from megatron.training.utils import get_blend_and_blend_per_split

    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend,
        blend_per_split=blend_per_split, split=args.split,
        path_to_cache=args.data_cache_path, tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader)
    cls = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building {cls.__name__} train/valid/test datasets")
    # every rank builds them (PP = 1), so no TP broadcast of batches is needed
    return BlendedMegatronDatasetBuilder(cls, train_val_test_num_samples, lambda: True,
                                         config).build()


@contextlib.contextmanager
def _prebuilt_dataset_helpers():
    """Skip ``megatron.training``'s dataset-helper compile step where it cannot run.

    ``initialize_megatron`` runs ``make`` in ``megatron/core/datasets`` on rank 0 and exits when
    it fails. The megatron-core wheel ships that helper already compiled
    (``helpers_cpp*.so``) but not its Makefile, so on a wheel install the step always fails
    (seen with 0.19.2: "Failed to compile the C++ dataset helper functions"). Only then, and
    only while ``pretrain`` runs in this launcher's process, the step becomes the barrier it
    ends with; a source checkout with its Makefile compiles as usual.
    """
    import os

    import torch
    import megatron.core.datasets as datasets
    from megatron.training import initialize

    has_makefile = os.path.exists(os.path.join(os.path.dirname(datasets.__file__), "Makefile"))
    try:
        import megatron.core.datasets.helpers_cpp  # noqa: F401  (the prebuilt extension)
        prebuilt = True
    except ImportError:
        prebuilt = False
    original = getattr(initialize, "_compile_dependencies", None)
    if has_makefile or not prebuilt or original is None:
        yield
        return
    initialize._compile_dependencies = lambda: torch.distributed.barrier()
    try:
        yield
    finally:
        initialize._compile_dependencies = original


def main(argv=None) -> None:
    """Parse Megatron-LM's arguments plus ours and run Megatron's ``pretrain``."""
    _exit_unless_supported()
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    from .args import add_arguments, validate_args

    if argv is not None:
        sys.argv = [sys.argv[0]] + list(argv)
    try:
        from megatron.training import set_startup_timestamps
        set_startup_timestamps(program_start=_PROGRAM_START, main_entry=time.time())
    except ImportError:     # older wheels
        pass
    args = parse_and_validate_args(extra_args_provider=add_arguments,
                                   args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    validate_args(args)     # fail before Megatron initialises anything; the options, once
    datasets_provider.is_distributed = True
    with _prebuilt_dataset_helpers():
        try:
            pretrain(pretrain_cfg_container_from_args(args), datasets_provider,
                     ModelType.encoder_or_decoder, forward_step, model_provider=model_provider)
        finally:    # also through Megatron's sys.exit (exit interval, duration, signal handler):
            release_cuda_graphs()       # the scans' graphs hold NCCL, which a teardown needs


if __name__ == "__main__":
    main()

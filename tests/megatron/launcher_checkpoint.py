"""Run by tests/megatron/test_launcher_hf.py under ``torchrun --nproc-per-node 2`` (Megatron's
checkpoint writer forks worker processes, which the test harness's daemonic ranks cannot):
for each HF checkpoint directory given, build the model the way the Megatron-LM launcher's
``model_provider`` does at TP 2 (``build_gpt_model`` from Megatron's arguments, then
``--load-hf``'s ``hf_architecture`` check and ``load_hf_into``), write its logits on fixed
tokens, and save it the way Megatron-LM saves (``dist_checkpointing.save`` of the model's
sharded state dict in the ``torch_dist`` format, the run's arguments in ``common.pt``,
``latest_checkpointed_iteration.txt``).

Test-only shims, because megatron-core 0.16.1's writer assumes CUDA: ``torch.cuda.synchronize``
and ``torch.cuda.current_device`` become CPU no-ops, and its memory logging does not need
psutil.

    torchrun --nproc-per-node 2 tests/megatron/launcher_checkpoint.py OUT_DIR HF_DIR...
"""
import argparse
import os
import sys
import warnings

import torch
import torch.distributed as dist

ITERATION = 3


def megatron_args(hf_dir: str, kinds: str) -> argparse.Namespace:
    """What Megatron-LM's parser gives for a model matching the HF config (the launcher's
    flags: --swiglu --normalization RMSNorm --disable-bias-linear ...)."""
    from megatron_patches.weights import HFArchitecture
    a = HFArchitecture.from_dir(hf_dir)
    hybrid = a.model_kind == "hybrid"
    return argparse.Namespace(
        num_layers=a.num_layers, hidden_size=a.hidden_size,
        num_attention_heads=a.num_attention_heads, group_query_attention=True,
        num_query_groups=a.num_query_groups, ffn_hidden_size=a.ffn_hidden_size,
        kv_channels=a.head_dim, norm_epsilon=a.norm_epsilon, swiglu=True,
        normalization="RMSNorm", add_bias_linear=False, position_embedding_type="rope",
        untie_embeddings_and_output_weights=not a.tie_word_embeddings,
        rotary_base=a.rotary_base, use_rope_scaling=False, rope_scaling_factor=8.0,
        sp_model_kind=a.model_kind, sp_hybrid_pattern=kinds if hybrid else None,
        sp_slope_schedule=a.slope_schedule if "L" in a.pattern else None,
        context_parallel_impl=None, softmax_cp_preset=None, softmax_heads_k_stride=None,
        softmax_bwd_head_first_stride=None, softmax_bwd_head_last_stride=None,
        tensor_model_parallel_size=2, padded_vocab_size=a.vocab_size + 64,
        max_position_embeddings=a.max_position_embeddings, load_hf=hf_dir)


def build_and_load(args):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_patches.args import hf_architecture, rope_scaling_of
    from megatron_patches.model import build_gpt_model
    from megatron_patches.options import SPOptions
    from megatron_patches.weights import load_hf_into
    # the launcher's validate_args builds these (its other checks need Megatron's whole namespace)
    options = SPOptions.from_flags(args, num_layers=args.num_layers,
                                   num_attention_heads=args.num_attention_heads,
                                   num_query_groups=args.num_query_groups,
                                   tensor_model_parallel_size=2)
    arch = hf_architecture(args, argv=[])
    cfg = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        ffn_hidden_size=args.ffn_hidden_size, kv_channels=args.kv_channels,
        layernorm_epsilon=args.norm_epsilon, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, attention_dropout=0.0,
        hidden_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float32,
        tensor_model_parallel_size=2)
    model = build_gpt_model(cfg, options, vocab_size=args.padded_vocab_size,
                            max_sequence_length=args.max_position_embeddings,
                            rotary_base=args.rotary_base,
                            rope_scaling=rope_scaling_of(args, arch),
                            share_embeddings_and_output_weights=not
                            args.untie_embeddings_and_output_weights)
    load_hf_into(model, args.load_hf, arch, tp_rank=dist.get_rank(), tp_size=2)
    return model


def logits(model, tokens) -> torch.Tensor:
    """The full ``[b, T, V]`` logits (TP pieces gathered; CP 1)."""
    from megatron.core import parallel_state as ps
    pos = torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1)
    with torch.no_grad():
        local = model(tokens, pos, attention_mask=None)                   # [b, s, V/TP]
    parts = [torch.empty_like(local) for _ in range(2)]
    dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def save(model, args, root: str) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    path = os.path.join(root, f"iter_{ITERATION:07d}")
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    state = {"model": model.sharded_state_dict(), "args": args, "iteration": ITERATION}
    dist_checkpointing.save(state, path, TorchDistSaveShardedStrategy("torch_dist", 1,
                                                                       thread_count=1))
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))
    dist.barrier()


def main() -> None:
    warnings.filterwarnings("ignore")
    torch.cuda.synchronize = lambda *a, **k: None           # test-only shims (see above)
    torch.cuda.current_device = lambda: "cpu"
    import megatron.core.dist_checkpointing.strategies.filesystem_async as fa
    fa._process_memory = lambda: 0
    dist.init_process_group("gloo")
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(2, 1)
    out, dirs = sys.argv[1], sys.argv[2:]
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    for hf_dir in dirs:
        name = os.path.basename(hf_dir)
        kinds = open(os.path.join(hf_dir, "pattern.txt")).read().strip()
        args = megatron_args(hf_dir, kinds)
        torch.manual_seed(0)
        model = build_and_load(args)
        got = logits(model, tokens)
        save(model, args, os.path.join(out, f"ck_{name}"))
        if dist.get_rank() == 0:
            torch.save({"tokens": tokens, "logits": got}, os.path.join(out, f"{name}.pt"))
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

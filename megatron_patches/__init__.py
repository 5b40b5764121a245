"""Megatron-Core integration: context-parallel softmax and linear attention without TE.

Modules (each imports megatron.core; nothing is imported here, so ``import megatron_patches``
stays cheap):

- :mod:`.model`: ``build_gpt_model`` (softmax / linear / hybrid ``GPTModel`` over Megatron's
  CP group), ``global_loss_share`` (the loss over real targets), ``tp_shard_state_dict``,
  ``grad_reduce_group``, ``cp_context``;
- :mod:`.core_attention`: ``SoftmaxCoreAttention``, ``LinearCoreAttention``, ``SoftmaxOptions``;
- :mod:`.specs`: ``patch_core_attention`` for any ModuleSpec tree, per-layer block specs,
  prebuilt specs for Megatron-LM's ``--spec megatron_patches.specs <name>``;
- :mod:`.rotary`: zigzag-aware RoPE that runs on any device;
- :mod:`.args`: ``--context-parallel-impl`` and friends (``extra_args_provider``) + validation;
- :mod:`.pretrain_gpt`: ``torchrun -m megatron_patches.pretrain_gpt`` on megatron.training.

See megatron_patches/README.md.
"""

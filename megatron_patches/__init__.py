"""Megatron-Core integration: context-parallel softmax and linear attention without TE.

Modules (each imports megatron.core; nothing is imported here, so ``import megatron_patches``
stays cheap):

- :mod:`.model`: ``build_gpt_model`` (softmax / linear / hybrid ``GPTModel`` over Megatron's
  CP group, one ``SPContext`` for its layers, RoPE and data), ``global_loss_share`` (the
  loss over real targets), ``tp_shard_state_dict``, ``grad_reduce_group``, ``cp_context``;
- :mod:`.core_attention`: ``SoftmaxCoreAttention`` (an ``sp_attention.SoftmaxSchedule``),
  ``LinearCoreAttention``;
- :mod:`.specs`: ``patch_core_attention`` for any ModuleSpec tree, per-layer block specs,
  prebuilt specs for Megatron-LM's ``--spec megatron_patches.specs <name>``;
- :mod:`.rotary`: RoPE in the model's CP layout, on any device;
- :mod:`.options` (no Megatron import): the table of our command-line options that builds both
  CLIs (train.py and the launcher), the layer-pattern rules, and ``SPOptions``, the one checked
  options value both build once and hand down;
- :mod:`.packing`: THD batches cut by the packing plan, which travels with the batch;
- :mod:`.args`: the options as Megatron-LM's ``extra_args_provider`` + validation;
- :mod:`.pretrain_gpt`: ``torchrun -m megatron_patches.pretrain_gpt`` on megatron.training.

train.py's trainer is the package ``sp_train`` (``megatron_patches.trainer`` is a deprecated
alias for one release). See megatron_patches/README.md.
"""

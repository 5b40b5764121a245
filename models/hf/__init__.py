"""HF transformers integration: context-parallel Llama (softmax, linear, hybrid) through
``AttentionInterface``, the CP batch/loss helpers, and the linear-attention Llama variant.

Needs the ``hf`` extra (``transformers>=5.0,<6``). See ``models/README.md``.
"""
from .attention import CPHandle, CPSchedule, make_cp_attention, prepare_model_for_cp
from .data import CPBatch, causal_lm_loss, global_loss_value, prepare_cp_batch
from .linear_llama import (LinearLlamaAttention, LinearLlamaConfig, LinearLlamaForCausalLM,
                           hybrid_layer_kinds, register_auto_classes)

__all__ = ["CPSchedule", "CPHandle", "prepare_model_for_cp", "make_cp_attention",
           "CPBatch", "prepare_cp_batch", "causal_lm_loss", "global_loss_value",
           "LinearLlamaConfig", "LinearLlamaAttention", "LinearLlamaForCausalLM",
           "hybrid_layer_kinds", "register_auto_classes"]

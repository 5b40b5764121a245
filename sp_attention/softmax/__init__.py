"""Causal GQA softmax attention split across a context-parallel group (ring and head-strided
all-gather schedules), with its single-device reference."""
from ..tuning import SoftmaxTuning
from .attention import context_parallel_attention
from .schedule import DEFAULT_PRESET, PRESETS, SoftmaxSchedule
from .naive import attention_reference

__all__ = ["context_parallel_attention", "PRESETS", "DEFAULT_PRESET", "SoftmaxSchedule",
           "SoftmaxTuning", "attention_reference"]

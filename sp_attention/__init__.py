"""sp_attention: context-parallel attention for long-sequence training.

Linear attention with per-head decay split over a CP group by a parallel prefix scan of one
fp32 state per sequence piece, and causal GQA softmax attention split by ring or head-strided
all-gather schedules. Every public function takes an explicit :class:`SPContext`.
"""
from .context import (DEFAULT_LAYOUT, LAYOUTS, CPGroupOptions, SPContext, build_sp_context,
                      new_cp_group)
from .linear import lightning_attention, release_cuda_graphs
from .planning.packing import PackingPlan, plan_packing
from .sharding import (pad_for_layout, pad_to_multiple, shard_position_ids, shard_sequence,
                       shift_labels, unshard_sequence)
from .softmax import SoftmaxSchedule, context_parallel_attention
from .tuning import LinearTuning, SoftmaxTuning

__version__ = "0.1.0"

__all__ = [
    "__version__", "LAYOUTS", "DEFAULT_LAYOUT", "SPContext", "build_sp_context", "CPGroupOptions", "new_cp_group",
    "lightning_attention", "context_parallel_attention", "SoftmaxSchedule",
    "shard_sequence", "unshard_sequence", "shard_position_ids", "shift_labels",
    "pad_to_multiple", "pad_for_layout", "LinearTuning", "SoftmaxTuning",
    "PackingPlan", "plan_packing", "release_cuda_graphs",
]

"""Linear attention with per-head decay, split across a CP group by a parallel prefix scan."""
from ..tuning import LinearTuning
from .attention import DEFAULT_IMPL, IMPLS, lightning_attention
from .naive import recurrent_linear_attention
from .scan_common import release_cuda_graphs
from .torch_ops import chunked_linear_attention

__all__ = ["lightning_attention", "IMPLS", "DEFAULT_IMPL", "LinearTuning", "recurrent_linear_attention",
           "chunked_linear_attention", "release_cuda_graphs"]

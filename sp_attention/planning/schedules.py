"""What the schedules are called, and the constants both the ops and the cost model plan with:
one home for each.

* Linear attention's scans across ranks (:data:`LINEAR_SCANS`; ``impl=`` also takes
  ``"auto"``, the cost model's pick: :data:`LINEAR_IMPLS`).
* Softmax attention's forward and backward schedules and the presets naming useful pairs
  (:data:`PRESETS`; ``preset=`` also takes ``"auto"``), and the default preset.
* The chunk length of the linear kernels (fla's ``BT`` and the torch backend's), which the
  local ops and the cost model's FLOP and memory counts share.
* The default KV-head stride of the all-gather schedules (:func:`default_heads_k_stride`).
"""
from __future__ import annotations

__all__ = ["LINEAR_SCANS", "AUTO", "LINEAR_IMPLS", "A2A_SCHEDULES", "FWD_SCHEDULES",
           "BWD_SCHEDULES", "PRESETS",
           "DEFAULT_PRESET", "AUTO_PRESET", "PRESET_NAMES", "CHUNK", "MIN_QUERY_HEADS_PER_CALL",
           "default_heads_k_stride"]

AUTO = "auto"      # the cost model's choice per layer shape (sp_attention.cost.auto)

# Linear scans, one file each in sp_attention/linear/: scan_blelloch.py, scan_allgather.py,
# scan_ring.py.
LINEAR_SCANS = ("blelloch", "allgather", "ring")
LINEAR_IMPLS = LINEAR_SCANS + (AUTO,)

# The all-to-all schedules run forward and backward as one (the backward reads the head shards
# the forward saved), so they pair only with themselves.
A2A_SCHEDULES = ("a2a", "a2a_ring")
FWD_SCHEDULES = ("ring", "allgather") + A2A_SCHEDULES
BWD_SCHEDULES = ("ring", "allgather") + A2A_SCHEDULES

PRESETS: dict[str, tuple[str, str]] = {
    # ring forward + all-gather / async fp32 reduce-scatter backward with head strides: the
    # product's "fwd-ring/bwd-flash". The forward overlaps P - 1 small hops with no exposed
    # gather; the backward overlaps everything but one stride's gather and reduce-scatter.
    "ring_ag": ("ring", "allgather"),
    "ring": ("ring", "ring"),                 # ring-flash-attention: p2p only, O(1) buffers
    "allgather": ("allgather", "allgather"),  # no LSE merge; best for small P within a node
    "ag_ring": ("allgather", "ring"),
    # Ulysses: all-to-all from sequence to head shards, the local kernel on the whole sequence
    "a2a": ("a2a", "a2a"),
    # USP / TransformerEngine's a2a+p2p: all-to-all inside groups of a2a_size consecutive
    # ranks, ring across the groups
    "a2a_ring": ("a2a_ring", "a2a_ring"),
}
# The fastest pair measured on 2 x H200 (Llama-3-8B attention) at T_local 8K and 32K; also what
# `auto` runs on CPU, where no time model applies (sp_attention.cost.choose).
DEFAULT_PRESET = "ring"
AUTO_PRESET = AUTO
PRESET_NAMES = tuple(PRESETS) + (AUTO_PRESET,)

CHUNK = 64      # chunk length of both linear backends (fla's BT; a power of two there)

# Query heads one all-gather kernel call should cover at least (the default of
# SoftmaxTuning.min_query_heads_per_call): 8 heads x 32 tiles of 128 rows at a 4K-token chunk
# = 256 CTAs, about two waves on 132 SMs.
MIN_QUERY_HEADS_PER_CALL = 8


def default_heads_k_stride(kv_heads: int, group: int, tuning=None) -> int:
    """Smallest divisor ``s`` of the local KV heads with ``s · group >=
    min_query_heads_per_call`` query heads per call (``tuning``'s, any object with that
    attribute, e.g. :class:`~sp_attention.SoftmaxTuning`; None: :data:`MIN_QUERY_HEADS_PER_CALL`);
    all local KV heads if none.

    Why: only the first gather and the last reduce-scatter of the all-gather schedules are
    exposed, and they move ``s / Hkv`` of the traffic, so ``s`` should be small; but each
    kernel call covers ``s · group`` query heads and must still fill the GPU. Llama-3-8B
    (8 local KV heads, group 4) gets ``s = 2`` (4 strides); group 8 gets ``s = 1``.
    """
    need = MIN_QUERY_HEADS_PER_CALL if tuning is None else tuning.min_query_heads_per_call
    for s in range(1, kv_heads + 1):
        if kv_heads % s == 0 and s * group >= need:
            return s
    return kv_heads

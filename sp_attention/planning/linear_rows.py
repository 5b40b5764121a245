"""How many rows a rank's linear-attention leaf runs as on the GPU (``LinearTuning.row_splits``):
the rule the op follows and the cost model predicts with, pure integers.

fla's chunk recurrences run one program per (64-wide K tile, 64-wide V tile, row, head) through
the whole row, so a leaf cut into ``m`` rows of whole chunks keeps ``m`` times the programs busy
for ``1/m`` of the length (the rows' states are combined on the rank around the cross-rank scan:
:func:`sp_attention.linear.leaves.split_rows_scan`). The rule doubles ``m``, up to
:data:`MAX_ROW_SPLITS`, while the rows' programs still fit the GPU's SMs once (per-token gates:
twice) and every row keeps at least :data:`MIN_SPLIT_ROW` tokens. Measured on 4 × H200, P = 4,
32K per GPU, queued (2026-11-27, ``benchmarks/results/2026-11-27_h200x4_linear_row_splits_ab.jsonl``):
fixed rates, one contiguous leaf 0.91 → 0.94 of fla's kernel as 2 rows, 0.93 as 4; gates 0.74–0.79
→ 0.85 as 2 rows, 0.87–0.89 as 4; zigzag (2 leaves) fixed 0.89–0.95 unchanged as 2 × 1, gated
0.82–0.85 → 0.84–0.89 as 2 × 2.
"""
from __future__ import annotations

from typing import Optional

from .schedules import CHUNK

__all__ = ["MIN_SPLIT_ROW", "MAX_ROW_SPLITS", "row_splits"]

MIN_SPLIT_ROW = 4096
MAX_ROW_SPLITS = 4


def row_splits(requested: Optional[int], rows: int, length: int, heads: int, k_dim: int,
               v_dim: int, sms: Optional[int], gated: bool = False) -> int:
    """Rows each of ``rows`` leaves (batch rows × leaves per rank) of ``length`` tokens runs as.
    ``requested``: ``LinearTuning.row_splits`` (None: the rule; an explicit value must cut
    every leaf into whole chunks); ``sms``: the GPU's SM count (None off the fla path, where
    the rule keeps one row); ``gated``: per-token gates."""
    if requested is not None:
        if length % (requested * CHUNK):
            raise ValueError(
                f"LinearTuning.row_splits={requested} needs each leaf's length ({length} tokens "
                f"here) to be a multiple of {requested} x {CHUNK}; pass row_splits=None (the "
                "built-in rule) or a divisor that fits")
        return requested
    if sms is None:
        return 1
    tiles = heads * -(-k_dim // 64) * -(-v_dim // 64)
    budget = sms * (2 if gated else 1)
    m = 1
    while (m * 2 <= MAX_ROW_SPLITS and rows * m * 2 * tiles <= budget
           and length % (m * 2 * CHUNK) == 0 and length // (m * 2) >= MIN_SPLIT_ROW):
        m *= 2
    return m

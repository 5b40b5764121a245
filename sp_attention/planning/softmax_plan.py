"""Pure rank arithmetic of the softmax schedules: which query piece meets which key piece, and
how gathered keys are arranged so that every kernel call reads one prefix.

Nothing here touches a tensor or a process group, so every rule is unit-tested for any P.

Vocabulary:
  * A rank's shard is its layout chunks (1 contiguous, 2 zigzag) in shard order, each cut into
    ``split`` equal **pieces**; a piece is addressed by ``(rank, pos)``, ``pos`` its index in
    the shard. Its **global id** ``chunk * split + j`` orders pieces along the sequence.
  * Causal (bottom-right) rule between a query piece ``a`` and a key piece ``b``: ``b < a`` the
    whole block is visible ("full"), ``b == a`` the diagonal block (causal triangle),
    ``b > a`` nothing.
  * Kernel calls are bottom-right causal, so one call can take full keys *followed by* the
    diagonal piece: the causal mask only touches the last ``Tq`` keys. Keys that are fully
    visible may come in any order (softmax attention is invariant to permuting keys together
    with their values); only the diagonal piece must be last.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .layout import leaves_of_rank

__all__ = ["Call", "Run", "GatherPlan", "piece_ids", "gather_plan", "ring_calls",
           "stride_widths"]


@dataclass(frozen=True)
class Call:
    """One kernel call: local query pieces ``[q_start, q_stop)`` (positions in this rank's
    shard) against the first ``keys`` key pieces (of the arranged buffer, or of the ring block),
    bottom-right causal when ``causal``."""

    q_start: int
    q_stop: int
    keys: int
    causal: bool


@dataclass(frozen=True)
class Run:
    """``count`` consecutive arranged key pieces starting at ``start`` that are one strided
    block of the rank-major gather buffer: pieces ``(rank + i, pos)`` when ``along_ranks``,
    else ``(rank, pos + i)``."""

    start: int
    count: int
    rank: int
    pos: int
    along_ranks: bool

    def clip(self, limit: int) -> "Run | None":
        """The part of the run below arranged position ``limit`` (None if empty)."""
        n = min(self.count, limit - self.start)
        if n <= 0:
            return None
        return self if n == self.count else Run(self.start, n, self.rank, self.pos,
                                                self.along_ranks)


@dataclass(frozen=True)
class GatherPlan:
    """How one rank arranges gathered key pieces and which calls read them.

    ``order[i] = (rank, pos)``: the i-th arranged key piece (``pos`` relative to the gathered
    key range). ``runs`` cover ``order`` with strided blocks (one copy each). ``calls`` read
    prefixes of the arrangement. ``flat_start`` is set when the arrangement is the gather
    buffer itself from that piece on (consecutive rank-major pieces): then, with batch 1, the
    keys are a view and nothing is copied.
    """

    order: tuple[tuple[int, int], ...]
    runs: tuple[Run, ...]
    calls: tuple[Call, ...]
    flat_start: int | None
    single_rank: bool


def piece_ids(rank: int, world: int, layout: str, split: int = 1) -> tuple[int, ...]:
    """Global ids of ``rank``'s pieces in shard order (ascending for both layouts)."""
    return tuple(c * split + j for c in leaves_of_rank(rank, world, layout) for j in range(split))


def _runs(order: tuple[tuple[int, int], ...]) -> tuple[Run, ...]:
    """Greedy cover of ``order`` by maximal strided blocks."""
    runs: list[Run] = []
    for i, (r, p) in enumerate(order):
        if runs:
            last = runs[-1]
            end_r = last.rank + (last.count if last.along_ranks else 1) - 1
            end_p = last.pos + (1 if last.along_ranks else last.count) - 1
            if (last.along_ranks or last.count == 1) and (r, p) == (end_r + 1, last.pos):
                runs[-1] = Run(last.start, last.count + 1, last.rank, last.pos, True)
                continue
            if (not last.along_ranks or last.count == 1) and (r, p) == (last.rank, end_p + 1):
                runs[-1] = Run(last.start, last.count + 1, last.rank, last.pos, False)
                continue
        runs.append(Run(i, 1, r, p, False))
    return tuple(runs)


def _merge_calls(calls: list[Call]) -> tuple[Call, ...]:
    """Fuse neighbouring query pieces that read the same keys the same way (one bigger call)."""
    out: list[Call] = []
    for c in calls:
        if out and out[-1].q_stop == c.q_start and (out[-1].keys, out[-1].causal) == (
                c.keys, c.causal):
            out[-1] = Call(out[-1].q_start, c.q_stop, c.keys, c.causal)
        else:
            out.append(c)
    return tuple(out)


@lru_cache(maxsize=1024)    # pure rank arithmetic: a few entries per layer shape
def gather_plan(rank: int, world: int, layout: str, split: int, key_start: int, key_stop: int,
                causal: bool) -> GatherPlan:
    """Arrangement of the gathered key pieces ``pos in [key_start, key_stop)`` of every rank.

    Non-causal: every query sees every key, in the gather buffer's own order (one call).
    Causal: with the local query pieces ``a_1 < … < a_n`` (global ids), the arrangement is the
    keys with id <= a_1 (the diagonal a_1 last), then those with a_1 < id <= a_2 (a_2 last),
    and so on; keys after a_n are never needed and not arranged. Query piece ``a_j`` then reads
    exactly its visible keys as one prefix, diagonal last (a bottom-right causal call), or, if
    its diagonal is not in the key range, the prefix of full keys (a non-causal call).
    """
    ids = [piece_ids(r, world, layout, split) for r in range(world)]
    keys = [(r, p - key_start) for r in range(world) for p in range(key_start, key_stop)]
    n_pos = key_stop - key_start
    if not causal:
        order = tuple(keys)
        calls: tuple[Call, ...] = (Call(0, len(ids[rank]), len(order), False),)
    else:
        arranged: list[tuple[int, int]] = []
        pending: list[Call] = []
        lo = -1
        for j, a in enumerate(ids[rank]):
            group = [(r, p) for r, p in keys if lo < ids[r][p + key_start] < a]
            diag = key_start <= j < key_stop
            arranged += group + ([(rank, j - key_start)] if diag else [])
            if arranged:
                pending.append(Call(j, j + 1, len(arranged), diag))
            lo = a
        order = tuple(arranged)
        calls = _merge_calls(pending)
    flat = [r * n_pos + p for r, p in order]
    contiguous = all(f == flat[0] + i for i, f in enumerate(flat))
    return GatherPlan(order, _runs(order), calls, flat[0] if flat and contiguous else None,
                      len({r for r, _ in order}) <= 1)


@lru_cache(maxsize=1024)    # pure rank arithmetic: P entries per (P, layout, causal)
def ring_calls(rank: int, src: int, world: int, layout: str, causal: bool) -> tuple[Call, ...]:
    """Calls of one ring step: this rank's query chunks against the K/V block of ``src``.

    A block's chunks are in ascending global order, so the chunks a query chunk may see are a
    prefix of the block: one non-causal call per query chunk, neighbours fused when they read
    the same prefix. The own block (``src == rank``) is one square causal call.
    """
    mine, theirs = piece_ids(rank, world, layout), piece_ids(src, world, layout)
    if not causal or src == rank:
        # Non-causal: everything. Own block (causal): both sides hold the same pieces in
        # ascending global order, so the square causal mask over the local shard equals the
        # global mask and one call covers every row (no split, nothing to merge at step 0).
        return (Call(0, len(mine), len(theirs), bool(causal)),)
    calls = []
    for j, a in enumerate(mine):
        n = sum(1 for b in theirs if b <= a)
        if n:
            calls.append(Call(j, j + 1, n, theirs[n - 1] == a))
    return _merge_calls(calls)


def stride_widths(kv_heads: int, stride: int, first: int | None = None,
                  last: int | None = None) -> list[int]:
    """KV-head widths of the all-gather backward's units.

    ``kv_heads // stride`` strides of ``stride`` heads; ``first`` splits the first stride into
    ``[first, stride - first]`` and ``last`` the last one into ``[stride - last, last]``, so the
    exposed first gather and last reduce-scatter move fewer heads. A single stride becomes
    ``[first, stride - first - last, last]`` (empty parts dropped). Arguments are assumed
    valid (the public function checks them).
    """
    n = kv_heads // stride
    if n == 1:
        parts = [first or 0, stride - (first or 0) - (last or 0), last or 0]
        return [w for w in parts if w > 0]
    head = [first, stride - first] if first else [stride]
    tail = [stride - last, last] if last else [stride]
    return head + [stride] * (n - 2) + tail

"""Tuning of the two public ops: frozen dataclasses passed explicitly (``tuning=``).

Every field only changes *how fast* a step runs or *when* a check runs, never the numbers it
produces: each setting is exact. Defaults are what the measurements in
``benchmarks/results/README.md`` support; the benchmarks' A/B flags pass other values here
instead of overwriting module variables. Every rank of a CP group must pass equal tuning (it
is part of the call signature the cross-rank check compares, see :mod:`sp_attention.call_check`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .planning.schedules import MIN_QUERY_HEADS_PER_CALL
from .planning.softmax_packed import PACKED_DENSE_AFTER
from .validation import is_int

__all__ = ["LinearTuning", "SoftmaxTuning"]


def _check_bools(obj, *names: str) -> None:
    for name in names:
        if not isinstance(getattr(obj, name), bool):
            raise TypeError(f"{type(obj).__name__}.{name} must be a bool, got "
                            f"{getattr(obj, name)!r}")


@dataclass(frozen=True)
class LinearTuning:
    """How :func:`sp_attention.lightning_attention` runs its step.

    Attributes:
        static_zero_paths: shorter local paths for a rank holding only the sequence's first
            leaf (no state enters: fla's own output kernel runs at once, the scan is joined
            afterwards) or only its last (no gradient arrives: the gradient recurrence starts
            without waiting for the scan). They cut those ranks' GPU work on one H200 (rank 0
            forward 0.53 -> 0.45 ms, rank P-1 backward 1.61 -> 1.41 ms at 32K) but the only
            2-GPU run with them gave a slower step (0.77 of 2 x fla vs 0.84, 2026-11-23), so
            off until an A/B on two GPUs (``benchmarks/linear_cp.py --ab-static-zero``).
        side_stream_priority: CUDA priority of the stream the cross-rank scan runs on (lower
            is higher; -1 is the highest torch offers). High, so the scan's few small kernels,
            which a peer rank waits on, start ahead of the queued blocks of the chunk kernels
            beside them. 0 is the A/B (``--comm-variants side0``).
        concurrent_recurrences: the backward's two chunk recurrences (the chunk states from
            ``S_in`` and the state gradients from ``G``) run on two streams: fla runs each with
            one program per (K tile, V tile, batch row, head), under half of an H100/H200's
            SMs at B 1, H 16, K = V = 128, so each takes the SMs the other leaves idle. False
            runs them one after the other; with ``recurrence_first`` the chunk states then run
            after the gradient recurrence, while the scan carries its start gradient (the
            scan's latency hidden instead of the recurrences' overlap). Off (default): with row
            splits filling the SMs the serial order was faster in every queued row at P = 2
            (2 × H200, 2026-11-27, ``benchmarks/linear_cp.py --ab serial``, every scan and
            layout): fixed 32K 0.98–1.00 → 1.03–1.06 of fla, 8K 0.82–0.87 → 0.85–0.92, gated
            32K 0.94–0.96 → 0.95–0.97. P = 4 not measured yet.
        check_every_call: run the cross-rank call check (one small all-gather) on every call
            instead of once per new call signature: catches a rank that repeats an
            already-checked call while another changes it, at one collective per call.
        early_end_states: the forward takes each leaf's end state ``b`` from the one-pass state
            kernel on the scan's side stream, beside the chunk recurrence on the main stream, so
            the scan travels while the recurrence runs (one more kernel); False takes ``b`` from
            the recurrence's final state, so the scan starts after it. Off: on 2 × H100 it was
            slower in every row (P = 2, 32K queued: 0.85–0.88 of fla vs 0.90–0.93; 2026-11-26),
            and at P = 4 (4 × H100, queued: 32K 0.76–0.81 vs 0.83–0.87, 8K 0.58–0.70 vs
            0.61–0.75; 2026-11-27): the state kernel's full-GPU pass over k and v delays the
            chunk recurrence by more than the scan it hides.
            The A/B: ``benchmarks/linear_cp.py --ab early``.
        scan_graphs: on CUDA, replay each scan (its rounds' NCCL kernels and combines; with
            row splits also the folds of each leaf's rows around it) from a CUDA graph captured
            on its second call: one launch per scan on the host instead of one batched
            exchange and a few combines per round and ~20 small fold ops (tens of µs each on
            these hosts; the folds inside the graph since the twelfth session, not yet timed).
            On (2 × H100, P = 2, eager: 0.42 → 0.67 of fla at 8K contiguous all-gather, 0.57 →
            0.87 at 32K zigzag Blelloch; queued unchanged; 2026-11-26). The graphs hold only
            the CP group's communicator. NCCL documents that graphs of *several* communicators
            launched from one thread can deadlock: if your step also replays CUDA graphs with
            other communicators (TP, DP), turn this off. Inside a capture of the caller's own (a
            whole step as a CUDA graph) the scan is captured with it instead. The A/B:
            ``--ab graphs``.
        check_gate_values: with per-token gates ``g``, check every new gate tensor for values
            > 0 or non-finite before the op communicates, and agree on the outcome across the
            group (a bad gate on one rank raises on every rank). Costs one device sync and,
            at P > 1, one small all-gather per call with a new gate tensor (a training step:
            every gated layer call). False skips both when the gates are non-positive by
            construction (``-softplus(x)·exp(A_log)``, ``logsigmoid(x)``).
        backward_schedule: how the backward meets the gradient ``G`` that arrives at a leaf's
            end from later ranks (rows of leaves; packed documents always run
            ``"scan_first"``). ``"scan_first"``: each leaf's state-gradient contribution ``d``
            by the one-pass state kernel, the scan, then fla's gradient recurrence from ``G``
            (the local backward waits for the scan). ``"recurrence_first"``: the gradient
            recurrence from zero at once; its start gradient is ``d``, which the scan then
            carries while the chunk states are recomputed, and ``G`` enters our dv and dq/dk
            kernels (:mod:`.linear.dv_kernel`): no state-kernel pass, no wait before the
            recurrence. ``"auto"``: ``recurrence_first`` — measured on 4 × H100 (2026-11-27,
            queued, P = 4, 32K per GPU): fixed rates 0.83–0.88 → 0.86–0.94 of fla (P = 2:
            0.86–0.91 → 0.90–0.98); with per-token gates, since the rows split and the
            recurrences share one stream, 0.834–0.909 → 0.842–0.923, better in 6 of 6 scans
            and layouts (4 × H200, P = 4, 2026-11-27, queued; before both changes it was
            neutral queued and lower eager, and ``auto`` kept gates on ``scan_first``). The
            A/B: ``benchmarks/linear_cp.py --ab backward``.
        forward_schedule: how the forward meets the state ``S_in`` entering a leaf from
            earlier ranks (rows of leaves on the fla path; packed documents and the torch
            path unaffected). ``"states_first"``: the output kernel waits for the scan and adds
            ``λ^(n·C) S_in`` to every chunk state before its GEMMs (one kernel after the
            scan). ``"output_first"``: the output from the zero-start chunk states runs while
            the scan is in flight (fla's output kernel; with gates ours from a zero state),
            and ``scale · λ^(t+1) q_t S_in`` is added afterwards
            (:func:`.linear.kernels.add_entering_state`: one more read of q and read and write
            of the output, chunks whose weights underflow to 0 skipped), so only that pass
            waits for the scan; the output is rounded once more (bf16: within the kernels'
            rounding). ``"auto"``: ``states_first``. Measured on 4 × H200 (P = 4, queued,
            2026-11-27, with gates an earlier build whose output kernel skipped the zero
            state's loads): gated 32K better in 6 of 6 scans and layouts (+0.4–1.2 %, the
            forward 10–21 µs shorter), fixed rates 32K within ±0.6 % but for one row
            (+1.8 %), 8K lower in 5 of 6 (−0.5 … −1.7 %). This build, A/B'd on a fresh
            4 × H200 (fifteenth session): no gain in any row (gated 32K −0.1 … −0.6 %, fixed
            8K −0.2 … −0.8 %), so ``auto`` stays ``states_first`` for gates too. The A/B:
            ``benchmarks/linear_cp.py --ab forward``.
        row_splits: on the fla path, each leaf runs as this many rows of equal length (whole
            chunks), the rows' states combined on the rank before and after the cross-rank
            scan (:func:`.linear.leaves.split_rows_scan`): fla's chunk recurrences run one
            program per (K tile, V tile, row, head), so at B 1 and 16 heads one row fills
            under half of an H100's SMs, and two rows of half the length take about half the
            time (4 × H200, 32K per GPU: the two-leaf zigzag shard's recurrences 375 + 231 µs
            against one contiguous leaf's 640 + 445). ``None``: the rule of
            :func:`.planning.linear_rows.row_splits` (split while the rows' programs leave SMs idle
            and each row keeps at least 4096 tokens); 1: never. Exact for every value. The
            A/B: ``benchmarks/linear_cp.py --ab row_splits``.
        op_graphs: on CUDA (the fla path, one sequence per row; packed documents run eagerly),
            replay this rank's whole forward and whole backward from one CUDA graph each per
            call signature (:mod:`.linear.op_graphs`): one launch instead of the op's ~100
            (kernels through Triton's launcher, the scan, the row folds, stream forks), for
            layers called eagerly, whose step waits on the host. The price: the inputs are
            copied into the graph's buffers and the outputs out of them on every call (eleven
            ``[B, T_local, H, K]`` tensors per forward + backward), and each signature keeps
            its buffers and two graph pools. Measured on 4 × H200 (P = 4, 2026-11-27,
            ``--ab op_graphs``): host per forward + backward 1.6–3.3 → 0.45–1.16 ms; eager
            8K 0.52–0.63 → 1.52–1.83 of fla (called eagerly), 32K about even; queued (host
            ahead) 8K 0.61–0.80 → 0.47–0.60, 32K 0.92–1.01 → 0.67–0.73 (the copies: 0.72 ms
            at 32K). So off by default; on for a layer whose step waits on the host. Inside
            a capture of the caller's own (``train.py --cuda-graphs``) the op is captured
            with it instead.
        fused_scan: the ``allgather`` scan of a rank's leaf rows on CUDA as two Triton
            kernels around the collective (:mod:`.linear.allgather_kernel`: the rows' fold and
            the staging in one, the gathered rows' fold and the spread back over the rows in
            the other) instead of ~12 small torch ops replayed from a CUDA graph; the same
            math up to the order of fp32 sums, for up to 32 gathered rows (P ≤ 16 with
            zigzag shards; beyond, the torch ops). Packed documents and the other scans are
            unaffected. With ``scan_graphs`` the rows are copied into the run's buffers and
            the kernels and the collective replay from one CUDA graph (a Triton launch costs
            0.1–0.4 ms of Python on the device hosts). On: 4 × H100, P = 4, queued, two runs
            (2026-11-28): zigzag rows 2–8 % faster (8K 0.78–0.82 → 0.84–0.87 of fla, gated
            32K 0.88–0.89 → 0.90–0.91), 32K contiguous 0.96–0.98 → 1.00–1.02; 8K
            contiguous 0.80 → 0.85 (4 × H200, the torch-ops row first: ``--ab fused
            --variants-first``; run after them it had read 0.73–0.76). The A/B:
            ``benchmarks/linear_cp.py --ab fused``.
    """

    static_zero_paths: bool = False
    side_stream_priority: int = -1
    concurrent_recurrences: bool = False
    check_every_call: bool = False
    check_gate_values: bool = True
    early_end_states: bool = False
    scan_graphs: bool = True
    backward_schedule: str = "auto"
    forward_schedule: str = "auto"
    row_splits: Optional[int] = None
    op_graphs: bool = False
    fused_scan: bool = True

    BACKWARD_SCHEDULES = ("auto", "scan_first", "recurrence_first")
    FORWARD_SCHEDULES = ("auto", "states_first", "output_first")

    def __post_init__(self) -> None:
        _check_bools(self, "static_zero_paths", "concurrent_recurrences", "check_every_call",
                     "check_gate_values", "early_end_states", "scan_graphs", "op_graphs",
                     "fused_scan")
        if self.backward_schedule not in self.BACKWARD_SCHEDULES:
            raise ValueError(f"LinearTuning.backward_schedule must be one of "
                             f"{self.BACKWARD_SCHEDULES}, got {self.backward_schedule!r}")
        if self.forward_schedule not in self.FORWARD_SCHEDULES:
            raise ValueError(f"LinearTuning.forward_schedule must be one of "
                             f"{self.FORWARD_SCHEDULES}, got {self.forward_schedule!r}")
        if self.row_splits is not None and (not is_int(self.row_splits) or self.row_splits < 1):
            raise ValueError("LinearTuning.row_splits must be a positive int (rows per leaf on "
                             f"the fla path) or None (the built-in rule), got {self.row_splits!r}")
        if not is_int(self.side_stream_priority) or self.side_stream_priority > 0:
            raise ValueError("LinearTuning.side_stream_priority must be an int <= 0 (CUDA: "
                             f"lower is higher priority), got {self.side_stream_priority!r}")


@dataclass(frozen=True)
class SoftmaxTuning:
    """How :func:`sp_attention.context_parallel_attention` runs its step.

    Attributes:
        min_query_heads_per_call: the default ``heads_k_stride`` is the smallest divisor of the
            local KV heads giving at least this many query heads per kernel call
            (:data:`sp_attention.planning.schedules.MIN_QUERY_HEADS_PER_CALL`, 8: why there).
        check_every_call: as :attr:`LinearTuning.check_every_call`.
        pack_kv: the ring schedules copy K and V into one buffer per hop and send one message,
            instead of sending them as two messages straight from their own storage (the
            default: no copies). Each rank's zigzag P = 2 ring forward at T_local 8K (Llama-3-8B
            attention, one H200, 2026-11-23) took 1.727 / 1.779 ms unpacked vs 1.751 / 1.802
            packed, with 34 MB less peak memory. The A/B: ``benchmarks/softmax_pieces.py
            --pack-kv``.
        packed_dense_min: packed documents (``cu_seqlens``): a document pair of at least this
            many query × key tokens runs as a dense kernel call of its own (cuDNN on Hopper);
            smaller ones are batched into varlen calls (:mod:`sp_attention.planning.
            softmax_packed`). None (default): 2^20 (a 1K-token document), or 2^24 (4K) when a
            rank's share of the row's attention is small (under ~1 ms of kernels), where each
            call's host time costs more than the dense kernel saves
            (:func:`sp_attention.planning.softmax_packed.auto_dense_min`: at 8K tokens per GPU
            on 4 x H200 the packed ring's eager step went from 10.36 to 6.42 ms).
        packed_dense_after: packed documents: a layout of documents (its ``cu_seqlens`` over
            the ranks) runs every pair in varlen calls for its first this many calls, dense
            calls (``packed_dense_min``) only from the next one on; 0: from the first. A dense
            call's cuDNN kernel builds an execution plan for each new shape (110-160 ms for
            a forward + backward, H200), so training on varied documents, a new layout every
            step, paid ~1 s a step (1B softmax at CP 4, 32K tokens of 12-24K-token documents,
            4 x H200: 1.19 s a step against 0.33 s with every pair varlen, 2026-11-28). The
            default, :data:`sp_attention.planning.softmax_packed.PACKED_DENSE_AFTER` (256),
            keeps a model's calls of one step varlen (up to 128 layers with recompute); a
            layout that recurs (fixed documents, benchmarks) turns dense after it, the plan
            builds paid once. Same numbers either way up to the kernels' rounding.
        packed_varlen_gaps: packed documents: one varlen call may skip query rows and keys
            between its document pairs (they become sequences without keys / queries, fewer
            calls); False starts a new call at every gap instead.
        a2a_head_chunks: the all-to-all presets run the heads in this many chunks, each its
            own exchange, kernel and exchange back, issued so that the exchanges of one chunk
            travel while the kernel runs on another (chunk ``c`` is the KV heads ``[c·Hkv/C,
            (c+1)·Hkv/C)`` and their query heads:
            :func:`sp_attention.planning.softmax_a2a.head_chunks`, which names the counts a
            shape takes). None: 1 — on NVLink the chunks lose: Llama-3-8B attention, zigzag,
            eager fwd+bwd ÷ one GPU's cuDNN on the whole sequence (4 × H100, 2026-11-27,
            ``benchmarks/results/2026-11-27_h100x4_softmax_a2a_chunks.jsonl``), C = 1 / 2 / 4:
            P = 4 8K 0.879 / 0.831 / 0.752, 32K 0.952 / 0.920 / 0.893; P = 2 8K 0.811 /
            0.768 / 0.554, 32K 0.939 / 0.921 / 0.888 — the NCCL kernels beside cuDNN and
            the smaller kernels cost more than the hidden exchanges save. For slower links
            (an all-to-all across nodes) measure it: ``benchmarks/softmax_cp.py --a2a-chunks
            1 2 4``.
        a2a_direct: the all-to-all presets exchange each run of a position's tokens as its
            own point-to-point message straight into its place (the head shard in sequence
            order on the way out, the position's own rows on the way back), instead of one
            ``all_to_all_single`` per tensor and an index gather on each side: about 40 % of
            the bytes copied go (at P = 4, 8K per GPU the re-sharding copies took ~0.8 ms of
            a 15.8 ms step, 4 × H200). Applies with one
            sequence per micro-batch and without packed documents (elsewhere the gathers
            stay). Off: measured no faster (4 × H200, P = 4, Llama-3-8B attention, zigzag,
            eager, one run, ``benchmarks/results/2026-11-27_h200x4_softmax_cp.jsonl``):
            ``a2a`` 8K 0.899 → 0.890, 32K 0.966 → 0.970; ``a2a_ring`` (groups of 2) 8K 0.869
            → 0.844, 32K 0.976 → 0.978 — the copies it saves are hidden behind the
            exchanges, and more, smaller messages cost what they save. Exact either way (the
            kernels see the same tensors); ``benchmarks/softmax_cp.py --a2a-direct``.
        a2a_transport: how the all-to-all presets move their blocks. ``"nccl"``: NCCL's
            all-to-all (or grouped sends and receives), kernels on the SMs. ``"copy_engine"``:
            every rank writes its blocks into a symmetric-memory workspace and pulls its own
            from each peer's by a copy between GPUs (:mod:`sp_attention.peer_copy`), which
            runs on the copy engines and takes no SM from the attention kernels of the head
            chunk beside it (``a2a_head_chunks``); CUDA devices with peer access (NVLink)
            only, not inside a CUDA graph's first capture, and the direct exchange
            (``a2a_direct``) is not used with it. Its workspace stays allocated: four times
            the largest exchange of a call (Q's blocks, rounded up to a power of two) per
            GPU. The same numbers either way (the kernels see the same tensors). Measured
            slower (4 × H200, P = 4, ``a2a``: 8K per GPU 0.875 of one GPU against NCCL's
            0.895, 32K 0.958 against 0.965; with 2 head chunks 0.870 and 0.957), so
            ``"nccl"`` (``benchmarks/softmax_cp.py --copy-engine``).
        ring_backward_order: when the ring backward (``bwd="ring"`` after ``fwd="ring"``: the
            ``ring`` preset) runs the rank's own block. ``"own_first"``: first, while the first
            remote block travels, so the last remote block's dK/dV accumulator goes home after
            every kernel, waited for. ``"own_last"``: the forward keeps the K/V block it held
            last (rank ``r + 1``'s: one more K/V block per layer until the backward), the
            backward starts on it, the remote blocks travel the other way round the ring (with
            P = 2 none travel at all), and the last accumulator hop goes home while the own
            block — the largest call — computes. Exact either way (P = 2: the same bits).
            Measured (4 × H100, Llama-3-8B attention, zigzag, fwd+bwd, each A/B timed in both
            row orders, ``benchmarks/results/2026-11-27_h100x4_softmax_own_last.jsonl``): P = 4,
            8K per GPU 17.16 → 16.92 ms (+1.4 %, both orders); P = 2 even within the noise
            (8K 8.17 → 8.12 ms, 32K 118.3 → 118.4 ms, means of the two orders; the row timed
            first read ~3 % faster either way). ``"auto"``: ``"own_first"`` — the kept block
            costs ``2·T_local·Hkv·D`` elements per layer until the backward (at 256K per GPU,
            the long-context runs' length, more than the gain is worth); opt in for short
            sequences at P > 2. Other pairs, packed documents and the all-to-all presets run
            the own block first.
    """

    min_query_heads_per_call: int = MIN_QUERY_HEADS_PER_CALL
    check_every_call: bool = False
    pack_kv: bool = False
    packed_dense_min: Optional[int] = None
    packed_dense_after: int = PACKED_DENSE_AFTER
    packed_varlen_gaps: bool = True
    a2a_head_chunks: Optional[int] = None
    a2a_direct: bool = False
    a2a_transport: str = "nccl"
    ring_backward_order: str = "auto"

    RING_BACKWARD_ORDERS = ("auto", "own_first", "own_last")
    A2A_TRANSPORTS = ("nccl", "copy_engine")

    def __post_init__(self) -> None:
        _check_bools(self, "check_every_call", "pack_kv", "packed_varlen_gaps", "a2a_direct")
        if self.a2a_transport not in self.A2A_TRANSPORTS:
            raise ValueError(f"SoftmaxTuning.a2a_transport must be one of "
                             f"{self.A2A_TRANSPORTS}, got {self.a2a_transport!r}")
        if self.ring_backward_order not in self.RING_BACKWARD_ORDERS:
            raise ValueError(f"SoftmaxTuning.ring_backward_order must be one of "
                             f"{self.RING_BACKWARD_ORDERS}, got {self.ring_backward_order!r}")
        if self.a2a_head_chunks is not None and (not is_int(self.a2a_head_chunks)
                                                 or self.a2a_head_chunks < 1):
            raise ValueError("SoftmaxTuning.a2a_head_chunks must be a positive int (head chunks "
                             f"of the all-to-all presets) or None, got {self.a2a_head_chunks!r}")
        if not is_int(self.min_query_heads_per_call) or self.min_query_heads_per_call < 1:
            raise ValueError("SoftmaxTuning.min_query_heads_per_call must be a positive int, "
                             f"got {self.min_query_heads_per_call!r}")
        if not is_int(self.packed_dense_after) or self.packed_dense_after < 0:
            raise ValueError("SoftmaxTuning.packed_dense_after must be an int >= 0 (0: dense "
                             f"calls from a layout's first call), got {self.packed_dense_after!r}")
        if self.packed_dense_min is not None and (not is_int(self.packed_dense_min)
                                                  or self.packed_dense_min < 1):
            raise ValueError("SoftmaxTuning.packed_dense_min must be a positive int or None "
                             f"(auto), got {self.packed_dense_min!r}")

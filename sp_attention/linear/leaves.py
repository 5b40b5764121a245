"""Several leaves at once, their cross-rank states overlapped with the chunk recurrence.

q, k, v, do here are ``[N, C, H, D]``: one row per leaf (a rank's leaves are equal-length
pieces of its shard, so ``[B, n·C, ...]`` is viewed as ``[B·n, C, ...]``); S_in and G are
``[N, H, K, V]`` (zeros where no state enters / no gradient arrives, which is exact). The
decay is fixed per-head rates or per-token gates ``[N, C, H]`` (a
:class:`~sp_attention.linear.decay.Decay`, or a slopes tensor). The ``scan(x, A)`` callbacks
map per-leaf states ``x`` with the leaves' transitions ``A [N, H]`` to the states entering the
leaves (forward) or the gradients arriving at their ends (backward); they run the cross-rank
communication.

On the fla path three CUDA streams take part: the main stream; a high-priority "side" stream
for the scan (latency-bound, a few small kernels and NCCL calls that a peer waits on); and, in
the backward, a "recurrence" stream for the chunk states from S_in. Memory across streams is
safe by ordering alone (no ``record_stream``, which makes every later allocation poll events):
every fork waits on main first, and main waits on every stream before returning.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Union

import torch

from ..caches import LRU
from ..planning.schedules import CHUNK
from ..precision import acc_dtype
from ..triton_launch import device_guard
from ..tuning import LinearTuning
from .kernel_set import FlaKernels, resolve_kernels
from .decay import Decay, as_decay
from .gates import suffix_sums
from .leaf import leaf_backward, leaf_output, leaf_state
from .local import LateGradient, chunk_states, local_backward
from .state_sum import decayed_sum

__all__ = ["leaves_output", "leaves_backward", "state_dtype", "sm_count", "split_rows_scan",
           "forward_schedule", "backward_schedule"]

_DEFAULT = LinearTuning()
# Streams made once per (stream factory, device, role, priority), not per call; the factory is
# part of the key so that streams made by a stand-in of torch.cuda.Stream (CPU tests) are never
# reused. Bounded: a process uses at most devices × 2 roles × 2 priorities of them (32 on an
# 8-GPU node); stand-ins churn through the rest. A dropped stream is only made again (torch
# hands out pooled streams, so nothing queued on it is lost).
_STREAMS = LRU(64)


def _stream(device: torch.device, role: str, priority: int = 0) -> "torch.cuda.Stream":
    idx = device.index if device.index is not None else torch.cuda.current_device()
    factory = torch.cuda.Stream
    return _STREAMS.get((factory, idx, role, priority),
                        lambda: factory(device=idx, priority=priority))


def _scan_on_side_stream(scan: Callable, x, device: torch.device, priority: int) -> tuple:
    """Start ``scan(x)`` on the side stream after the work queued so far, so that what the main
    stream queues next runs while the states travel. Returns (result, side stream); the caller
    makes the main stream wait on the side stream before it reads the result.

    Blocks made on main and read here can only be rewritten by main work queued after main
    waits on this stream (every caller does that before returning); blocks made here and read
    on main return to this stream's pool, whose next user first waits on everything main has
    queued (``side.wait_stream(main)``)."""
    main, side = torch.cuda.current_stream(device), _stream(device, "side", priority)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        out = scan(x)
    return out, side


def leaves_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay,
                  scale: float, scan: Callable, backend: Union[None, str, FlaKernels] = None,
                  zero_in: bool = False, *, tuning: LinearTuning = _DEFAULT
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs of N leaves: ``(o [N, C, H, V], S_in [N, H, K, V])`` where ``scan(b, A)`` maps
    the leaves' zero-start end states ``b`` (fp32) to the states entering them.

    fla: the chunk recurrence runs from zero (``chunk_fwd_h``); its final state is ``b`` when
    C is a multiple of the chunk or the decay is gated, otherwise ``b`` comes from the
    one-pass state kernel, run with the scan on the side stream beside the recurrence. The
    output kernel (:func:`sp_attention.linear.kernels.output_from_states`) then adds
    ``λ^(n·BT) S_in`` (gates: ``exp2(prefix) S_in``) to each chunk state; with
    ``tuning.forward_schedule`` ``"output_first"`` the zero-start output runs while the scan
    travels and ``kern.entering_state`` adds ``S_in``'s part after it. ``zero_in``: no state
    enters any leaf (this rank holds only the sequence's first leaf): the zero-start states
    are the states, fla's own output kernel runs at once and the scan (this rank only sends)
    is joined afterwards. torch: ``b``, the scan, then the chunked form.
    ``tuning.side_stream_priority``: the scan stream's priority. ``backend``: ``"torch"``,
    ``"fla"``, None (fla where it can run) or a
    :class:`~sp_attention.linear.kernel_set.FlaKernels` set the fla path runs instead of fla's.
    """
    decay = as_decay(decay)
    kern = resolve_kernels(backend, q, k, v)
    N, C = q.shape[:2]
    if kern is None:
        b = leaf_state(k, v, decay).to(state_dtype(q, decay, False))
        S_in = scan(b, decay.transition(N, C, b.dtype, q.device))
        return leaf_output(q, k, v, decay, scale, S_in, "torch"), S_in
    first = not zero_in and forward_schedule(tuning) == "output_first"
    if first and kern.entering_state is None:       # before anything is sent
        raise ValueError("LinearTuning.forward_schedule='output_first' needs a kernel set with "
                         "entering_state; pass forward_schedule='states_first'")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    fkw = decay.fla_kw(q.device)

    def with_A(x):          # the transitions in the states' dtype (fp32 on a GPU)
        x = x.to(state_dtype(q, decay, True))
        return scan(x, decay.fla_transition(N, C, x.dtype, q.device))
    main = torch.cuda.current_stream(q.device)
    prio = tuning.side_stream_priority
    with device_guard(q):
        # fla 0.6.0 turns the final state of a partial last chunk into NaN for fast fixed
        # rates (see leaf.leaf_forward; gates read g = 0 there, exactly), so only whole chunks
        # or gates take the final state from the recurrence.
        if (k.shape[1] % CHUNK == 0 or decay.gated) and not tuning.early_end_states:
            h, b = chunk_states(kern, k, v, fkw, final=True)
            S_in, side = _scan_on_side_stream(with_A, b, q.device, prio)
        else:   # b from the one-pass state kernel on the side stream, beside the recurrence
            # (tuning.early_end_states, or a partial last chunk: fla's final state is wrong)
            S_in, side = _scan_on_side_stream(
                lambda _: with_A(kern.state_sum(k, v, decay, k.shape[1] - 1, -1, 1.0)), None,
                q.device, prio)
            h, _ = chunk_states(kern, k, v, fkw)
        gates = decay.sums if decay.gated else None
        g_gamma = None if decay.gated else fkw["g_gamma"]
        if zero_in:
            o = kern.chunk_fwd_o(q=q, k=k, v=v, h=h, scale=float(scale), chunk_size=CHUNK,
                                 **fkw)
            main.wait_stream(side)          # the send finishes behind the output kernel
            return o, S_in
        if first:
            # the output from the zero-start states while the scan is in flight: fla's output
            # kernel, or with gates ours from a zero entering state (fla's gated one is
            # slower); then S_in's part
            if decay.gated:
                zero = torch.zeros(N, q.shape[2], k.shape[-1], v.shape[-1], device=q.device,
                                   dtype=torch.float32)
                o = kern.output_from_states(q, k, v, h, zero, None, scale, CHUNK, gates=gates)
            else:
                o = kern.chunk_fwd_o(q=q, k=k, v=v, h=h, scale=float(scale), chunk_size=CHUNK,
                                     **fkw)
            main.wait_stream(side)
            S_in = S_in.contiguous()
            return kern.entering_state(o, q, S_in, g_gamma, scale, CHUNK, gates=gates), S_in
        main.wait_stream(side)
        S_in = S_in.contiguous()
        return kern.output_from_states(q, k, v, h, S_in, g_gamma, scale, CHUNK,
                                       gates=gates), S_in


def forward_schedule(tuning: LinearTuning) -> str:
    """``tuning.forward_schedule`` with ``"auto"`` resolved: ``states_first`` for fixed rates
    and gates alike (why: :class:`~sp_attention.tuning.LinearTuning`)."""
    if tuning.forward_schedule != "auto":
        return tuning.forward_schedule
    return "states_first"


@functools.lru_cache(maxsize=64)      # one entry per CUDA device index
def sm_count(index: int) -> int:
    """The SM count of CUDA device ``index``."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def split_rows_scan(scan: Callable, m: int, reverse: bool) -> Callable:
    """A leaf-level ``scan(x, A)`` for leaves that run as ``m`` rows each (rows ``ℓ·m …
    ℓ·m + m − 1`` are leaf ``ℓ``'s, in order): the rows' states are combined on this rank into
    their leaf's, the leaf-level scan runs, and its result is spread back over the rows. ``a_j``
    is row ``j``'s transition (a scalar per head).

    Forward: from the rows' zero-start end states ``b_j``, the leaf's end state ``(…(b_1 a_2 +
    b_2) …) a_m + b_m`` and transition ``Π a_j``; from the state ``S`` entering the leaf, row 1
    is entered with ``S`` and row ``j + 1`` with ``a_j S_j + b_j``. Backward (``reverse``):
    from the rows' contributions ``d_j`` (gradients on their entering states), the leaf's
    ``d_1 + a_1 (d_2 + a_2 (… + a_{m−1} d_m))``; from the gradient ``G`` arriving at the leaf's
    end, row ``m`` receives ``G`` and row ``j`` receives ``d_{j+1} + a_{j+1} G_{j+1}``."""
    if m == 1:
        return scan

    def run(x: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
        xs = x.view(x.shape[0] // m, m, *x.shape[1:])
        As = A.view(A.shape[0] // m, m, A.shape[1])

        def a(j):
            return As[:, j, :, None, None]
        # forward: rows from the leaf's start; backward: from its end. The leaf's element is
        # folded along that order, and the scanned value enters its first row and is carried
        # along it.
        order = list(range(m - 1, -1, -1) if reverse else range(m))
        acc = xs[:, order[0]]
        for j in order[1:]:
            acc = torch.addcmul(xs[:, j], a(j), acc)
        leaf = scan(acc.contiguous(), As.prod(1).contiguous())
        out = torch.empty_like(xs)
        out[:, order[0]] = leaf
        for prev, j in zip(order, order[1:]):
            torch.addcmul(xs[:, prev], a(prev), out[:, prev], out=out[:, j])
        return out.view(x.shape)
    return run


def state_dtype(q: torch.Tensor, decay: Decay, fla: bool) -> torch.dtype:
    """The one dtype of the states a scan carries on this path, the same on every rank (the
    all-gather moves fixed-size buffers): fp32, fp64 for fp64 inputs; the torch path also
    follows fp64 gates (it sums them in their dtype), the fla path's kernels write fp32."""
    return acc_dtype(q) if fla else acc_dtype(q, decay.g)


def _state_grads(q: torch.Tensor, do: torch.Tensor, decay: Decay, scale: float,
                 needed: Optional[tuple], state_sum: Callable, fla: bool) -> torch.Tensor:
    """Per-row state-gradient contributions ``[N, H, K, V]`` (fp32) of ``N = B·n`` rows (batch
    row-major, ``n = len(needed)`` leaves per batch row), computed only for the leaves in
    ``needed`` (None: all). The others are read by nobody (the sequence's first leaf has no
    earlier leaf to send its contribution to); they are zeros, which keeps every scan's
    arithmetic finite. ``fla``: gates go to the kernel as their sums (strided per leaf)."""
    dt = state_dtype(q, decay, fla)
    if needed is None or all(needed):
        return state_sum(q, do, decay, 1, 1, scale).to(dt)
    n = len(needed)
    d = q.new_zeros((q.shape[0], q.shape[2], q.shape[3], do.shape[3]), dtype=dt)
    per_leaf = d.view(d.shape[0] // n, n, *d.shape[1:])
    for j in (j for j, keep in enumerate(needed) if keep):
        # leaf j of every batch row: a strided view of the rows, no copy
        rows = [x.view(x.shape[0] // n, n, *x.shape[1:])[:, j] for x in (q, do)]
        if decay.gated:
            dj = Decay(g=decay.g.view(decay.g.shape[0] // n, n, *decay.g.shape[1:])[:, j])
            kw = {"gates": decay.sums.leaf(n, j)} if fla else {}
            per_leaf[:, j] = state_sum(*rows, dj, 1, 1, scale, **kw)
        else:
            per_leaf[:, j] = state_sum(*rows, decay, 1, 1, scale)
    return d


def leaves_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay,
                    scale: float, S_in: torch.Tensor, do: torch.Tensor, scan: Callable,
                    backend: Union[None, str, FlaKernels] = None,
                    needed: Optional[tuple] = None, zero_grad: bool = False, *,
                    tuning: LinearTuning = _DEFAULT) -> tuple:
    """``(dq, dk, dv, dg)`` of N leaves entered with ``S_in`` (``dg`` None for fixed rates);
    ``scan(d, A)`` maps the leaves' state-gradient contributions ``d`` (fp32) to the gradients
    ``G`` arriving at their ends.

    ``needed``: per leaf of a batch row (rows are batch-major, ``len(needed)`` leaves each),
    whether anyone reads its contribution (None: all); the others are not computed.
    ``zero_grad``: no gradient arrives at any leaf (this rank holds only the sequence's last
    leaf), so the gradient recurrence starts at once instead of waiting for the scan (which
    here only sends ``d``); the scan is joined at the end.

    fla, three streams: the high-priority side stream forms ``d`` (the one-pass state kernel)
    and runs the scan, since a peer waits on it; the recurrence stream recomputes the chunk
    states from ``S_in`` (``chunk_fwd_h``, which needs no ``G``); the main stream runs fla's
    gradient recurrence from ``G`` (``chunk_bwd_dh``) beside it, then dv and, once the chunk
    states are in, dq and dk (fla's own backward, split up; gates: our dq/dk/dg kernel in
    place of fla's ``chunk_bwd_dqkwg``). ``tuning.concurrent_recurrences`` (off by default) runs
    the chunk states on their own stream beside it. That is ``tuning.backward_schedule``
    ``"scan_first"``; ``"recurrence_first"`` (``auto``'s pick) runs the
    gradient recurrence at once and takes ``G`` in-kernel (:func:`_late_leaves_backward`).
    """
    decay = as_decay(decay)
    kern = resolve_kernels(backend, q, k, v)
    N, C = q.shape[:2]
    if kern is None:
        d = _state_grads(q, do, decay, scale, needed, decayed_sum, False)
        G = scan(d, decay.transition(N, C, d.dtype, q.device))
        return leaf_backward(q, k, v, decay, scale, S_in, do, G, "torch")
    q, k, v, do = q.contiguous(), k.contiguous(), v.contiguous(), do.to(v.dtype).contiguous()
    fkw = decay.fla_kw(q.device)

    def grads_scanned(_):
        d = _state_grads(q, do, decay, scale, needed, kern.state_sum, True)
        return scan(d, decay.fla_transition(N, C, d.dtype, q.device))
    main = torch.cuda.current_stream(q.device)
    if backward_schedule(tuning) == "recurrence_first":
        return _late_leaves_backward(kern, q, k, v, do, decay, fkw, scale, S_in, scan,
                                     zero_grad, tuning)
    with device_guard(q):
        # d and the scan first, on the side stream: the peers' gradients wait on them.
        G, side = _scan_on_side_stream(grads_scanned, None, q.device,
                                       tuning.side_stream_priority)
        # the chunk states from S_in need no G: beside the gradient recurrence, which waits
        # for G (unless none can arrive: then it starts at once)
        rec = _stream(q.device, "recurrence") if tuning.concurrent_recurrences else None
        dq, dk, dv, dg = local_backward(
            kern, q, k, v, do, fkw, scale, S_in, None if zero_grad else (lambda: G.contiguous()),
            states_stream=rec, before_dh=None if zero_grad else (lambda: main.wait_stream(side)))
        main.wait_stream(side)          # joined (a no-op unless zero_grad)
    dg = None if dg is None else dg.to(decay.g.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg


def backward_schedule(tuning: LinearTuning) -> str:
    """``tuning.backward_schedule`` with ``"auto"`` resolved (the measured pick, fixed rates
    and gates alike: :class:`~sp_attention.tuning.LinearTuning`)."""
    if tuning.backward_schedule != "auto":
        return tuning.backward_schedule
    return "recurrence_first"


def _late_leaves_backward(kern, q, k, v, do, decay: Decay, fkw: dict, scale: float, S_in,
                          scan: Callable, zero_grad: bool, tuning: LinearTuning) -> tuple:
    """:func:`leaves_backward` on the fla path with ``G`` taken in-kernel
    (``"recurrence_first"``, :class:`~sp_attention.linear.local.LateGradient`): the gradient
    recurrence starts from zero at once on the main stream, the chunk states from ``S_in``
    beside it on the recurrence stream; the recurrence's start gradient is ``d``, which the
    scan takes on the side stream as soon as it is queued. Main waits for the scan only
    before dv."""
    N, C = q.shape[:2]
    main = torch.cuda.current_stream(q.device)
    got: dict = {}

    def send(d):                        # d: the recurrence's start gradient, fp32
        got["G"], got["side"] = _scan_on_side_stream(
            lambda x: scan(x, decay.fla_transition(N, C, x.dtype, q.device)), d, q.device,
            tuning.side_stream_priority)
    with device_guard(q):
        suffix = suffix_sums(decay.sums.tot).contiguous() if decay.gated and not zero_grad \
            else None
        rec = _stream(q.device, "recurrence") if tuning.concurrent_recurrences else None
        dq, dk, dv, dg = local_backward(
            kern, q, k, v, do, fkw, scale, S_in, None if zero_grad else (lambda: got["G"]),
            states_stream=rec, before_dh=None if zero_grad else (
                lambda: main.wait_stream(got["side"])), late=LateGradient(send, suffix))
        main.wait_stream(got["side"])   # joined (a no-op unless zero_grad)
    dg = None if dg is None else dg.to(decay.g.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg

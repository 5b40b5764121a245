"""Single-device "local op" of linear attention with decay, called once per leaf by the scan.

A leaf is a contiguous piece of C tokens. With S_in the state just before the leaf (local
position -1) and lam = exp(-s) per head, unrolling S_i = lam S_{i-1} + k_i^T v_i gives

    S_i = lam^(i+1) S_in + sum_{j<=i} lam^(i-j) k_j^T v_j         (local i = 0 .. C-1)
    o_i = scale q_i S_i = o_zero_i + scale lam^(i+1) q_i S_in       -> inter_output
    S_end = S_{C-1} = lam^C S_in + b,   b = sum_j lam^(C-1-j) k_j^T v_j   -> leaf_forward

Backward with do = dL/do and G = dL/dS_end (from later leaves):

    dL/dS_in = scale sum_i lam^(i+1) q_i^T do_i  +  lam^C G        -> state_grad_local, chunk_decay
    dq_i = intra + scale lam^(i+1) do_i S_in^T
    dk_j, dv_j = intra + lam^(C-1-j) (v_j G^T, k_j G)              -> leaf_backward

All decays are exp(-s * n) in fp32 (fp64 for fp64 inputs); nothing divides by lam^C.

Backends: "torch" (chunked pure torch, any device/dtype, backward by autograd on a
recomputed forward that lives only inside the call) and "fla" (fla-core's Triton
chunk_simple_gla kernels, CUDA, fp16/bf16/fp32). None picks fla when it can run.
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref

import torch

from sp_attention.linear.naive import chunk_decay, chunked_core, compute_dtype, decay_powers

__all__ = [
    "BACKENDS",
    "resolve_backend",
    "leaf_forward",
    "inter_output",
    "state_grad_local",
    "leaf_backward",
    "leaf_state",
    "leaf_output",
    "decay_powers",
    "chunk_decay",
    "slope_constant",
    "leaves_output",
    "leaves_backward",
]

BACKENDS = ("torch", "fla")
_FLA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_CHUNK = 64  # chunk size of both backends (fla's default BT; a power of two is required there)

# fla-core 0.6.0 convention (fla/ops/simple_gla/{naive,chunk}.py, fla/ops/common/chunk_{h,o}.py):
# its recurrence is S_t = exp(g_t) S_{t-1} + k_t^T v_t, o_t = scale q_t S_t, i.e. the decay is
# applied *before* adding the current token, exactly like our spec, so g_gamma = -s (natural
# log). The kernels form decays with exp2 from b_g = g_gamma * (i + 1) (the inter term
# q_i lam^(i+1) S_in, same exponent as ours) and the chunk end g_gamma * len (so the final
# state is lam^C S_in + b); the public chunk_simple_gla multiplies g_gamma by 1/ln2 before
# calling chunk_simple_gla_fwd/bwd, so calling those internals directly we must pass
# g_gamma = -s / ln 2 ourselves. scale defaults to K^-0.5 there: we always pass it. ht/dh0
# are fp32; h0/dht are read and upcast to fp32. The internals need contiguous [B, T, H, D]
# tensors and the right current CUDA device (the public wrapper's input_guard does both).
# chunk_simple_gla_bwd(initial_state=S_in, dht=G) returns dq (incl. the S_in term) and
# dk, dv (incl. the G terms) complete, plus dg=None and dh0 = dL/dS_in.


@functools.lru_cache(maxsize=1)
def _fla_import_error() -> str | None:
    """None if fla's simple_gla kernels import, else the reason (cached: imports are slow)."""
    try:
        import fla.ops.simple_gla.chunk  # noqa: F401
    except Exception as e:  # ImportError, or triton failing to initialise without a GPU
        return f"{type(e).__name__}: {e}"
    return None


@functools.lru_cache(maxsize=1)
def _fla_ops() -> dict:
    """fla's internal chunk kernels the CP step calls, without fla's backend-dispatch wrapper.

    fla 0.6 wraps these in a run-time backend selector (``fla.backends.dispatch``, itself under
    ``torch.compiler.disable``): per call it walks its backend registry before falling back to
    the Triton implementation. The conventions above were checked against that Triton
    implementation, so it is the one we call, directly (``inspect.unwrap``): no other backend
    can be swapped in underneath us, and the layer's host time, which bounds a lone layer's
    step, loses the selector's per-call cost.
    """
    import inspect

    from fla.ops.common.chunk_h import chunk_bwd_dh, chunk_fwd_h
    from fla.ops.common.chunk_o import chunk_bwd_dqkwg, chunk_bwd_dv, chunk_fwd_o
    return {f.__name__: inspect.unwrap(f) for f in (chunk_fwd_h, chunk_fwd_o, chunk_bwd_dh,
                                                    chunk_bwd_dqkwg, chunk_bwd_dv)}


def _fla_unusable_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    if not q.is_cuda:
        return f"inputs are on {q.device}, fla needs CUDA tensors"
    if q.dtype not in _FLA_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"fla needs q, k, v of one dtype in {_FLA_DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.dtype != torch.float32 and (q.shape[-1] % 2 or v.shape[-1] % 2):
        return f"fla's 16-bit backward needs even K and V, got K={q.shape[-1]}, V={v.shape[-1]}"
    err = _fla_import_error()
    if err is not None:
        return f"fla-core is not importable ({err})"
    return None


def resolve_backend(
    backend: str | None, q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None
) -> str:
    """Map None to "fla" when it can run on these inputs, else "torch"; validate explicit names."""
    k = q if k is None else k
    v = q if v is None else v
    if backend is None:
        return "fla" if _fla_unusable_reason(q, k, v) is None else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"unknown linear-attention backend {backend!r}; valid: {BACKENDS} or None (auto)")
    if backend == "fla":
        reason = _fla_unusable_reason(q, k, v)
        if reason is not None:
            raise ValueError(
                f"backend='fla' cannot run: {reason}. Install the `gpu` extra "
                f"(pip install 'sp_attention[gpu]', i.e. fla-core) on a CUDA machine, "
                f"or use backend='torch'."
            )
    return backend


def _no_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    # States and decays must stay fp32 even when the caller runs under autocast.
    return torch.autocast(device_type=device.type, enabled=False)


# id(slopes) -> (weakref to it, its _version, {key: derived tensor}). A finalizer drops the
# entry with the tensor; nothing is attached to the tensor itself (saving it saves only values).
# (A WeakKeyDictionary would compare tensors with ==, which is elementwise.)
_SLOPE_CONSTANTS: dict = {}


def slope_constant(slopes: torch.Tensor, key: tuple, make):
    """A tensor derived from ``slopes`` (decay powers, fla's g_gamma, a value check), made once
    per slopes tensor and version: rebuilding these small tensors on every call costs a handful
    of kernel launches each, and the CP step is launch-bound at short T_local. An in-place
    change of the slopes (a new ``_version``) drops the entry."""
    entry = _SLOPE_CONSTANTS.get(id(slopes))
    if entry is None or entry[0]() is not slopes or entry[1] != slopes._version:
        try:
            ref = weakref.ref(slopes)
        except TypeError:                       # not weak-referenceable: no caching
            return make()
        if entry is None or entry[0]() is not slopes:
            weakref.finalize(slopes, _SLOPE_CONSTANTS.pop, id(slopes), None)
        entry = _SLOPE_CONSTANTS[id(slopes)] = (ref, slopes._version, {})
    if key not in entry[2]:
        entry[2][key] = make()
    return entry[2][key]


def _fla_g_gamma(slopes: torch.Tensor, device: torch.device) -> torch.Tensor:
    # Natural-log decay -s converted to log2 units because fla's kernels use exp2 (see above).
    return slope_constant(slopes, ("fla_g_gamma", device), lambda: (
        -slopes.to(device=device, dtype=torch.float32) / math.log(2.0)).contiguous())


def _state_or_none(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.to(torch.float32).contiguous()


def leaf_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor,
    scale: float,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-start output and end state of one leaf.

    q, k [B, C, H, K], v [B, C, H, V], slopes [H]. Returns
      o_zero [B, C, H, V]: scale q_i sum_{j<=i} lam^(i-j) k_j^T v_j; fp32/fp64 for "torch",
                           v.dtype for "fla" (the kernel writes the input dtype);
      b [B, H, K, V]: sum_j lam^(C-1-j) k_j^T v_j; fp32 (fp64 for fp64 inputs).
    """
    backend = resolve_backend(backend, q, k, v)
    if backend == "fla":
        from fla.ops.simple_gla.chunk import chunk_simple_gla_fwd

        # fla 0.6.0 bug (seen on H200): in a partial last chunk, chunk_fwd_h scales the
        # zero-padded rows of v by exp2(g_last - g) > 1, which overflows to inf once
        # s * pad > ~88, and 0 * inf makes the final state NaN (o is unaffected). Leading
        # zero tokens are exact instead: the zero start state stays zero and zero k, v add
        # nothing, so pad at the front to a multiple of the chunk and drop those rows of o.
        pad = (-q.shape[1]) % _CHUNK
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, 0, pad, 0)) if pad else x for x in (q, k, v))
        with torch.cuda.device(q.device):
            o, b = chunk_simple_gla_fwd(
                q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g=None,
                g_gamma=_fla_g_gamma(slopes, q.device), scale=float(scale),
                initial_state=None, output_final_state=True, chunk_size=_CHUNK,
            )
        return o[:, pad:], b
    with _no_autocast(q.device):
        return chunked_core(q, k, v, slopes, scale, None, _CHUNK)


def inter_output(q: torch.Tensor, slopes: torch.Tensor, scale: float, S_in: torch.Tensor) -> torch.Tensor:
    """Contribution of the incoming state: scale * lam^(i+1) q_i @ S_in -> [B, C, H, V] fp32/fp64.

    Local position i = 0 sees S_in decayed once (S_0 = lam S_in + k_0^T v_0), hence i + 1.
    """
    dt = compute_dtype(q, S_in)
    with _no_autocast(q.device):
        dec = decay_powers(slopes, q.shape[1], 1, dtype=dt, device=q.device)  # [H, C]
        qd = q.to(dt) * dec.t()[None, :, :, None]  # [B, C, H, K]
        return scale * torch.einsum("bchk,bhkv->bchv", qd, S_in.to(dt))


def _weighted_outer_sum(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``sum_i w[h, i] x_i^T y_i`` per (batch, head) -> [B, H, K, V] in fp32 (fp64 for fp64).

    x [B, C, H, K], y [B, C, H, V], w [H, C] (decay weights); computed in the compute dtype.
    """
    dt = compute_dtype(x, y)
    with _no_autocast(x.device):
        return torch.einsum("bchk,bchv->bhkv", x.to(dt) * w.t().to(dt)[None, :, :, None], y.to(dt))


def _decayed_sum(x: torch.Tensor, y: torch.Tensor, slopes: torch.Tensor, base: int, step: int,
                 scale: float = 1.0) -> torch.Tensor:
    """``scale · Σ_t λ^(base + step·t) x_tᵀ y_t`` -> [B, H, K, V], fp32 (fp64 for fp64).

    16-bit CUDA inputs take the one-pass Triton kernel (fp32 accumulation, the weighted x
    rounded to the input dtype as the chunk kernels round their operands); everything else the
    compute-dtype einsum with the weights cached per slopes version.
    """
    if (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and y.dtype == x.dtype
            and _fla_import_error() is None):
        from sp_attention.linear.kernels import decayed_state_sum
        def rows(t):    # the kernel takes strided rows (every n-th leaf) as they are
            return t if t[0].is_contiguous() else t.contiguous()
        return decayed_state_sum(rows(x), rows(y), _fla_g_gamma(slopes, x.device), base, step,
                                 scale=scale)
    c, dt = x.shape[1], compute_dtype(x, y)
    w = slope_constant(slopes, ("state_weights", c, base, step, dt, x.device), lambda: torch.exp(
        -slopes.to(device=x.device, dtype=dt)[:, None]
        * (base + step * torch.arange(c, device=x.device, dtype=dt))[None, :]))   # [H, C]
    out = _weighted_outer_sum(x, w, y)
    return out if scale == 1.0 else scale * out


def leaf_state(k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor) -> torch.Tensor:
    """End state of a leaf from a zero start, b = sum_j lam^(C-1-j) k_j^T v_j -> [B, H, K, V].

    One pass over k and v (no chunk recurrence): what the scan needs before the leaf's output
    can be formed. fp32 (fp64 for fp64 inputs).
    """
    return _decayed_sum(k, v, slopes, k.shape[1] - 1, -1)


def leaf_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor,
                scale: float, S_in: torch.Tensor | None, backend: str | None = None) -> torch.Tensor:
    """Complete output of a leaf entered with state ``S_in`` (None = zero): one kernel call
    whose chunk states start from ``S_in``, so the inter term needs no extra pass.

    q, k [B, C, H, K], v [B, C, H, V] -> o [B, C, H, V] in the input dtype for "fla",
    fp32/fp64 for "torch".
    """
    backend = resolve_backend(backend, q, k, v)
    if backend == "fla":
        from fla.ops.simple_gla.chunk import chunk_simple_gla_fwd

        # No final state is requested, so fla's partial-last-chunk final-state bug (see
        # leaf_forward) cannot reach the output; no padding needed here.
        with torch.cuda.device(q.device):
            o, _ = chunk_simple_gla_fwd(
                q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g=None,
                g_gamma=_fla_g_gamma(slopes, q.device), scale=float(scale),
                initial_state=_state_or_none(S_in), output_final_state=False, chunk_size=_CHUNK,
            )
        return o
    with _no_autocast(q.device):
        s_in = None if S_in is None else S_in.to(compute_dtype(q, k, v, S_in))
        return chunked_core(q, k, v, slopes, scale, s_in, _CHUNK)[0]


def state_grad_local(q: torch.Tensor, do: torch.Tensor, slopes: torch.Tensor, scale: float) -> torch.Tensor:
    """dL/dS_in through this leaf's outputs only: scale sum_i lam^(i+1) q_i^T do_i -> [B, H, K, V].

    fp32 (fp64 for fp64 inputs); one pass over q and do. The full dL/dS_in adds
    chunk_decay(slopes, C) * G.
    """
    return _decayed_sum(q, do, slopes, 1, 1, scale)


def _torch_leaf_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor, scale: float,
    S_in: torch.Tensor | None, do: torch.Tensor, G: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Recompute the chunked forward from S_in under autograd and pull (do, G) back through it.
    # The graph (and its per-chunk states) is freed when this call returns.
    dt = compute_dtype(q, k, v, S_in)
    with torch.enable_grad(), _no_autocast(q.device):
        qd, kd, vd = (x.detach().to(dt).requires_grad_(True) for x in (q, k, v))
        s_in = None if S_in is None else S_in.detach().to(dt)
        o, S_end = chunked_core(qd, kd, vd, slopes.detach(), scale, s_in, _CHUNK)
        outs, grads = [o], [do.to(dt)]
        if G is not None:
            outs.append(S_end)
            grads.append(G.to(dt))
        dq, dk, dv = torch.autograd.grad(outs, (qd, kd, vd), grads)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def leaf_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor,
    scale: float,
    S_in: torch.Tensor | None,
    do: torch.Tensor,
    G: torch.Tensor | None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Complete dq, dk, dv of one leaf (in q/k/v dtypes).

    S_in [B, H, K, V]: state entering the leaf (None = zero). do [B, C, H, V]: dL/do of the
    leaf's full output (o_zero + inter). G [B, H, K, V]: dL/dS_end from later leaves (None =
    zero). Includes the intra terms, the S_in term of dq and the G terms of dk and dv.
    """
    backend = resolve_backend(backend, q, k, v)
    if backend == "fla":
        from fla.ops.simple_gla.chunk import chunk_simple_gla_bwd

        with torch.cuda.device(q.device):
            dq, dk, dv, _dg, _dh0 = chunk_simple_gla_bwd(
                q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g=None,
                g_gamma=_fla_g_gamma(slopes, q.device), initial_state=_state_or_none(S_in),
                do=do.to(v.dtype).contiguous(), dht=_state_or_none(G), scale=float(scale),
                chunk_size=_CHUNK,
            )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    return _torch_leaf_backward(q, k, v, slopes, scale, S_in, do, G)


# ---------------------------------------------------------------------------------------------
# Several leaves at once, their cross-rank states overlapped with the chunk recurrence.
# q, k, v, do here are [N, C, H, D]: one row per leaf (a rank's leaves are equal-length pieces
# of its shard, so [B, n·C, ...] is viewed as [B·n, C, ...]); S_in and G are [N, H, K, V]
# (zeros where no state enters / no gradient arrives, which is exact).

# Extra streams per (device, role, priority), made once: "side" for the cross-rank scan
# (latency-bound, few SMs), "recurrence" for the backward's chunk states (see below).
_STREAMS: dict = {}
# Priority of the scan's side stream (CUDA: lower is higher). High, so that the scan's few
# small kernels, which a peer rank waits on, start ahead of the queued CTAs of the chunk
# kernels running beside them on the main stream instead of after them. The scan's NCCL
# kernels run on the CP group's own stream: see sp_attention.CPGroupOptions. A/B in
# benchmarks/linear_cp.py --comm-variants (variant "side0" runs it at priority 0).
_SIDE_STREAM_PRIORITY = -1
# fla's chunk recurrences (chunk_fwd_h, chunk_bwd_dh) run one program per (K tile, V tile,
# batch row, head) through the whole sequence: 64 programs at B 1, H 16, K = V = 128, under half
# of an H100/H200's SMs, for 0.23-0.28 ms at 32K. The backward's two recurrences do not depend
# on each other (the chunk states from S_in, and the state gradients from G), so the first runs
# on the recurrence stream while the second runs on the main stream: each takes the SMs the
# other leaves idle. Normal priority; A/B with benchmarks/linear_cp.py --ab-concurrent.
_CONCURRENT_RECURRENCES = True


def _stream(device: torch.device, role: str, priority: int = 0) -> "torch.cuda.Stream":
    idx = device.index if device.index is not None else torch.cuda.current_device()
    key = (idx, role, priority)
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(device=idx, priority=priority)
    return _STREAMS[key]


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    return _stream(device, "side", _SIDE_STREAM_PRIORITY)


def _recurrence_stream(device: torch.device) -> "torch.cuda.Stream":
    return _stream(device, "recurrence")


def _scan_on_side_stream(scan, x: torch.Tensor, device: torch.device) -> tuple:
    """Start ``scan(x)`` (the cross-rank scan: latency-bound, a few small kernels and NCCL
    calls) on the side stream after the work queued so far, so that what the main stream
    queues next runs while the states travel. Returns (result, side stream); the caller makes
    the main stream wait on the side stream before it reads the result."""
    main, side = torch.cuda.current_stream(device), _side_stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        out = scan(x)
    # No record_stream (it makes every later allocation poll events): memory stays safe by
    # ordering alone. Blocks made on main and read here can only be rewritten by main work
    # queued after main waits on this stream (every caller does that before returning);
    # blocks made here and read on main return to this stream's pool, whose next user first
    # waits on everything main has queued (side.wait_stream(main) above).
    return out, side


def leaves_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor,
                  scale: float, scan, backend: str | None = None, zero_in: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs of N leaves: ``(o [N, C, H, V], S_in [N, H, K, V])`` where ``scan(b)`` maps the
    leaves' zero-start end states ``b`` (fp32) to the states entering them.

    fla: the chunk recurrence runs from zero (``chunk_fwd_h``), its final state is ``b``
    (when C is a multiple of the chunk; otherwise ``b`` comes from the one-pass state kernel,
    run with the scan on the side stream beside the recurrence), the scan runs on a side
    stream, and the
    output kernel (:func:`sp_attention.linear.kernels.output_from_states`) adds
    ``λ^(n·BT) S_in`` to each chunk state. ``zero_in``: no state enters any leaf (this rank
    holds only the sequence's first leaf): the zero-start states are the states, fla's own
    output kernel runs at once and the scan (this rank only sends) is joined afterwards.
    torch: ``b``, the scan, then the chunked form.
    """
    backend = resolve_backend(backend, q, k, v)
    if backend != "fla":
        S_in = scan(leaf_state(k, v, slopes))
        return leaf_output(q, k, v, slopes, scale, S_in, backend), S_in
    from sp_attention.linear.kernels import output_from_states
    ops = _fla_ops()
    chunk_fwd_h = ops["chunk_fwd_h"]

    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    gg = _fla_g_gamma(slopes, q.device)
    main = torch.cuda.current_stream(q.device)
    with torch.cuda.device(q.device):
        # fla 0.6.0 turns the final state of a partial last chunk into NaN for fast heads
        # (see leaf_forward), so only whole chunks take the final state from the recurrence.
        whole = k.shape[1] % _CHUNK == 0
        if whole:
            h, b = chunk_fwd_h(k=k, v=v, g=None, g_gamma=gg, h0=None, output_final_state=True,
                               chunk_size=_CHUNK)
            S_in, side = _scan_on_side_stream(scan, b, q.device)
        else:   # b from the one-pass state kernel on the side stream, beside the recurrence
            S_in, side = _scan_on_side_stream(lambda _: scan(leaf_state(k, v, slopes)), None,
                                              q.device)
            h, _ = chunk_fwd_h(k=k, v=v, g=None, g_gamma=gg, h0=None, output_final_state=False,
                               chunk_size=_CHUNK)
        if zero_in:
            o = ops["chunk_fwd_o"](q=q, k=k, v=v, h=h, g=None, g_gamma=gg, scale=float(scale),
                                   chunk_size=_CHUNK)
            main.wait_stream(side)          # the send finishes behind the output kernel
            return o, S_in
        main.wait_stream(side)
        S_in = S_in.contiguous()
        return output_from_states(q, k, v, h, S_in, gg, scale, _CHUNK), S_in


def _state_grads(q: torch.Tensor, do: torch.Tensor, slopes: torch.Tensor, scale: float,
                 needed: tuple | None) -> torch.Tensor:
    """Per-row state-gradient contributions ``[N, H, K, V]`` (fp32) of ``N = B·n`` rows (batch
    row-major, ``n = len(needed)`` leaves per batch row), computed only for the leaves in
    ``needed`` (None: all). The others are read by nobody (the sequence's first leaf has no
    earlier leaf to send its contribution to); they are zeros, which keeps every scan's
    arithmetic finite."""
    if needed is None or all(needed):
        return state_grad_local(q, do, slopes, scale)
    n = len(needed)
    d = q.new_zeros((q.shape[0], q.shape[2], q.shape[3], do.shape[3]),
                    dtype=compute_dtype(q, do))
    per_leaf = d.view(d.shape[0] // n, n, *d.shape[1:])
    for j in (j for j, keep in enumerate(needed) if keep):
        # leaf j of every batch row: a strided view of the rows, no copy
        rows = (x.view(x.shape[0] // n, n, *x.shape[1:])[:, j] for x in (q, do))
        per_leaf[:, j] = state_grad_local(*rows, slopes, scale)
    return d


def leaves_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor,
                    scale: float, S_in: torch.Tensor, do: torch.Tensor, scan,
                    backend: str | None = None, needed: tuple | None = None,
                    zero_grad: bool = False,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of N leaves entered with ``S_in``; ``scan(d)`` maps the leaves' state-gradient
    contributions ``d`` (fp32) to the gradients ``G`` arriving at their ends.

    ``needed``: per leaf of a batch row (rows are batch-major, ``len(needed)`` leaves each),
    whether anyone reads its contribution (None: all); the others are not computed.
    ``zero_grad``: no gradient arrives at any leaf (this rank holds only the sequence's last
    leaf), so the gradient recurrence starts at once instead of waiting for the scan (which
    here only sends ``d``); the scan is joined at the end.

    fla, three streams: the high-priority side stream forms ``d`` (the one-pass state kernel)
    and runs the scan, since a peer waits on it; the recurrence stream recomputes the chunk
    states from ``S_in`` (``chunk_fwd_h``, which needs no ``G``); the main stream runs fla's
    gradient recurrence from ``G`` (``chunk_bwd_dh``) beside it, then dv and, once the chunk
    states are in, dq and dk (fla's own backward, split up). ``_CONCURRENT_RECURRENCES =
    False`` runs the chunk states on the main stream first (the A/B).
    """
    backend = resolve_backend(backend, q, k, v)
    if backend != "fla":
        G = scan(_state_grads(q, do, slopes, scale, needed))
        return leaf_backward(q, k, v, slopes, scale, S_in, do, G, backend)
    ops = _fla_ops()
    chunk_fwd_h, chunk_bwd_dh = ops["chunk_fwd_h"], ops["chunk_bwd_dh"]
    chunk_bwd_dqkwg, chunk_bwd_dv = ops["chunk_bwd_dqkwg"], ops["chunk_bwd_dv"]

    q, k, v, do = q.contiguous(), k.contiguous(), v.contiguous(), do.to(v.dtype).contiguous()
    gg = _fla_g_gamma(slopes, q.device)
    main = torch.cuda.current_stream(q.device)
    with torch.cuda.device(q.device):
        # d and the scan first, on the side stream: the peers' gradients wait on them.
        # (Memory across the three streams is safe by ordering, as in _scan_on_side_stream:
        # every fork waits on main first, and main waits on every stream before returning.)
        G, side = _scan_on_side_stream(
            lambda _: scan(_state_grads(q, do, slopes, scale, needed)), None, q.device)
        concurrent = _CONCURRENT_RECURRENCES
        rec = _recurrence_stream(q.device) if concurrent else main
        if concurrent:
            rec.wait_stream(main)
        with torch.cuda.stream(rec):
            h, _ = chunk_fwd_h(k=k, v=v, g=None, g_gamma=gg, h0=S_in, output_final_state=False,
                               chunk_size=_CHUNK, states_in_fp32=True)
        if not zero_grad:
            main.wait_stream(side)
        dh, _ = chunk_bwd_dh(q=q, k=k, v=v, do=do, h0=None,
                             dht=None if zero_grad else G.contiguous(), scale=scale, g=None,
                             g_gamma=gg, chunk_size=_CHUNK, states_in_fp32=True)
        dv = chunk_bwd_dv(q=q, k=k, do=do, dh=dh, g=None, g_gamma=gg, scale=scale,
                          chunk_size=_CHUNK)
        if concurrent:
            main.wait_stream(rec)
        dq, dk, _, _ = chunk_bwd_dqkwg(q=q, k=k, v=v, do=do, h=h, dh=dh, g=None, g_gamma=gg,
                                       scale=scale, chunk_size=_CHUNK)
        main.wait_stream(side)          # joined (a no-op unless zero_grad)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

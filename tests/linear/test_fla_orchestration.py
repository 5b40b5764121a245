"""The fla path's orchestration on CPU, in fp64: ``leaves_output`` / ``leaves_backward`` and a
whole CP step (``lightning_attention_with_kernels``) with a :class:`FlaKernels` set of
pure-torch stand-ins that have fla 0.6's signatures (passed in explicitly, nothing in the
library is patched; the public ``lightning_attention`` takes backend names only), and
``torch.cuda``'s stream calls by recorders.

The fla path only runs on a GPU, and GPU time is scarce; these tests prove on every CI run what
does not need one: which tensors flow into which kernel call (a wrong argument, keyword or
state gives a wrong fp64 result here), which stream each step runs on, and that every stream
the step forks is joined before it returns. The kernels themselves (fla's and ours) are
checked on the GPU by the tests marked ``gpu``/``multigpu``.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from sp_attention import LinearTuning
from sp_attention.linear.kernel_set import FlaKernels
from sp_attention.linear.leaf import decayed_sum, torch_leaf_backward
from sp_attention.linear.leaves import leaves_backward, leaves_output
from sp_attention.linear.naive import (chunk_start_states, decayed_state_sum_ref,
                                       output_from_states_ref)
from sp_attention.linear.torch_ops import chunked_core
from sp_attention.testing import assert_close, run_distributed

TOL = 1e-10
_CURRENT: list = []       # the recorder stream that is "current"
LOG: list = []            # (what, stream name[, other stream]) in call order


class _Stream:
    def __init__(self, name: str):
        self.name = name

    def wait_stream(self, other: "_Stream") -> None:
        LOG.append(("wait", self.name, other.name))


def _fake_cuda(monkeypatch_setattr) -> None:
    """Replace the torch.cuda calls the fla path makes with recorders (CPU tensors stay)."""
    main = _Stream("main")
    _CURRENT[:] = [main]
    made = {}

    def new_stream(device=None, priority=0):
        name = "side" if priority < 0 else "rec"
        assert name not in made, f"a second {name} stream was made (streams are cached)"
        made[name] = _Stream(name)
        return made[name]

    @contextlib.contextmanager
    def use(stream):
        _CURRENT.append(stream)
        try:
            yield
        finally:
            _CURRENT.pop()
    for name, value in (("current_stream", lambda device=None: _CURRENT[-1]),
                        ("Stream", new_stream), ("stream", use),
                        ("device", lambda device=None: contextlib.nullcontext()),
                        ("current_device", lambda: 0)):
        monkeypatch_setattr(torch.cuda, name, value)


def _fake_fla(slopes: torch.Tensor) -> FlaKernels:
    """fla 0.6's internal kernels (the keyword signatures the fla path calls) in pure torch,
    fp64, plus our output and state-sum kernels. ``dh`` is passed on opaquely as ("dh", dht):
    only the stand-ins read it. Each call logs the stream it runs on."""
    def log(name):
        LOG.append((name, _CURRENT[-1].name))

    def chunk_fwd_h(k, v, g=None, g_gamma=None, gk=None, gv=None, h0=None,
                    output_final_state=False, state_v_first=False, cu_seqlens=None,
                    chunk_size=64, split_size=None, states_in_fp32=False, split_offsets=None,
                    num_splits=None):
        log("chunk_fwd_h")
        assert cu_seqlens is None and split_offsets is None and num_splits is None
        assert g is None and g_gamma is not None
        h = chunk_start_states(k, v, slopes, chunk_size, h0)
        ht = chunked_core(k, k, v, slopes, 1.0, h0, chunk_size)[1] if output_final_state else None
        return h, ht

    def chunk_fwd_o(q, k, v, h, g=None, g_gamma=None, scale=None, state_v_first=False,
                    cu_seqlens=None, chunk_size=64, chunk_indices=None):
        log("chunk_fwd_o")
        zero = torch.zeros_like(h[:, 0])
        return output_from_states_ref(q, k, v, h, zero, slopes, scale, chunk_size).to(v.dtype)

    def chunk_bwd_dh(q, k, v, do, h0, dht, scale, g=None, g_gamma=None, gk=None, gv=None,
                     state_v_first=False, cu_seqlens=None, chunk_size=64, split_size=None,
                     states_in_fp32=False, split_offsets=None, num_splits=None):
        log("chunk_bwd_dh")
        assert cu_seqlens is None and split_offsets is None and num_splits is None
        if h0 is None:
            return ("dh", dht, scale), None
        # dh0 only from a zero end gradient (LateGradient.send): the contribution d
        assert dht is None, "dh0 is asked for only from a zero end gradient"
        return ("dh", None, scale), scale * decayed_sum(q, do, slopes, 1, 1)

    def _grads(q, k, v, do, S_in, dh):
        _, dht, scale = dh
        return torch_leaf_backward(q, k, v, slopes, scale, S_in, do, dht)

    def chunk_bwd_dv(q, k, do, dh, g=None, g_gamma=None, scale=None, state_v_first=False,
                     cu_seqlens=None, chunk_size=64, chunk_indices=None):
        log("chunk_bwd_dv")
        assert scale == dh[2]
        # dv depends on neither v nor the entering state
        return _grads(q, k, torch.zeros_like(do), do, None, dh)[2]

    def chunk_bwd_dqkwg(q, k, v, do, h, dh, w=None, g=None, g_gamma=None, dv=None, scale=None,
                        state_v_first=False, cu_seqlens=None, chunk_size=64,
                        chunk_indices=None):
        log("chunk_bwd_dqkwg")
        assert scale == dh[2]
        dq, dk = _grads(q, k, v, do, h[:, 0], dh)[:2]      # h[:, 0] is the entering state
        return dq, dk, None, None

    def chunk_dv(q, k, do, dh, scale, chunk_size=64, *, g_gamma=None, gc=None, G=None,
                 suffix=None, config=None):
        log("chunk_dv")
        assert dh[1] is None and scale == dh[2] and g_gamma is not None and gc is None
        return _grads(q, k, torch.zeros_like(do), do, None, ("dh", G, scale))[2]

    def chunk_dqkdg(q, k, v, do, h, dh, gc, scale, chunk_size=64, config=None, block_k=None,
                    cu_seqlens=None, chunk_indices=None, *, g_gamma=None, G=None, suffix=None):
        log("chunk_dqkdg")
        assert dh[1] is None and scale == dh[2] and gc is None and g_gamma is not None
        dq, dk = _grads(q, k, v, do, h[:, 0], ("dh", G, scale))[:2]
        return dq, dk, None

    def output_from_states(q, k, v, h, S_in, g_gamma, scale, chunk_size=64, config=None,
                           gates=None):
        log("output_from_states")
        return output_from_states_ref(q, k, v, h, S_in, slopes, scale, chunk_size).to(v.dtype)

    def entering_state(o, q, S_in, g_gamma, scale, chunk_size=64, gates=None):
        # o_t += scale · λ^(t+1) q_t S_in
        log("entering_state")
        assert gates is None and g_gamma is not None
        t = torch.arange(1, q.shape[1] + 1, dtype=q.dtype)
        w = torch.exp(-slopes[None, :] * t[:, None])          # [C, H]
        o += scale * torch.einsum("nthk,nhkv->nthv", q * w[None, :, :, None], S_in)
        return o

    def state_sum(x, y, slopes_, base, step, scale=1.0, gates=None):
        # the one-pass state kernel: a leaf's end state (base C-1, step -1) or its
        # state-gradient contribution (base 1, step 1)
        log("leaf_state" if step < 0 else "state_grad_local")
        return decayed_sum(x, y, slopes_, base, step, scale)

    return FlaKernels(chunk_fwd_h, chunk_fwd_o, chunk_bwd_dh, chunk_bwd_dqkwg, chunk_bwd_dv,
                      output_from_states, state_sum, chunk_dqkdg=chunk_dqkdg, chunk_dv=chunk_dv,
                      entering_state=entering_state)


def _install(setattr_, slopes: torch.Tensor) -> FlaKernels:
    """Recorder streams in ``torch.cuda`` (``setattr_``: monkeypatch.setattr or a plain setattr
    in a spawned worker) and the stand-in kernel set to pass in."""
    _fake_cuda(setattr_)
    LOG.clear()
    return _fake_fla(slopes)


def _data(N, T, H=3, K=4, V=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(N, T, H, K, generator=g, dtype=torch.float64) for _ in range(2))
    v, do = (torch.randn(N, T, H, V, generator=g, dtype=torch.float64) for _ in range(2))
    S, G = (torch.randn(N, H, K, V, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v, do, S, G


SLOPES = torch.tensor([0.0, 0.05, 50.0], dtype=torch.float64)   # none, slow, λ^64 underflows


def _scan_returning(result: torch.Tensor, seen: dict):
    """A scan callback that records its input (``seen["x"]``) and stream, returns ``result``."""
    def scan(x, A):
        LOG.append(("scan", _CURRENT[-1].name))
        seen["x"] = x
        return result
    return scan


def _stream_of(what: str) -> list:
    return [e[1] for e in LOG if e[0] == what]


def _joined(streams=("side", "rec")) -> None:
    """Every stream forked in the call was waited on by main after its last use."""
    for s in streams:
        used = [i for i, e in enumerate(LOG) if e[0] != "wait" and e[1] == s]
        waits = [i for i, e in enumerate(LOG) if e == ("wait", "main", s)]
        if used:
            assert waits and waits[-1] > used[-1], f"main never joins {s}: {LOG}"


@pytest.mark.parametrize("T", [128, 100])      # whole chunks (end state from the recurrence)
@pytest.mark.parametrize("zero_in", [False, True])   # and a partial last one (state kernel)
@pytest.mark.parametrize("early", [False, True])     # LinearTuning.early_end_states
@pytest.mark.parametrize("order", ["states_first", "output_first"])   # .forward_schedule
def test_leaves_output_fla_path(T, zero_in, early, order, monkeypatch):
    fake = _install(monkeypatch.setattr, SLOPES)
    q, k, v, _, S, _ = _data(2, T)
    S = torch.zeros_like(S) if zero_in else S
    seen = {}
    scan = _scan_returning(S, seen)
    o, S_got = leaves_output(q, k, v, SLOPES, 0.3, scan, fake, zero_in=zero_in,
                             tuning=LinearTuning(early_end_states=early, forward_schedule=order))
    assert_close(seen["x"], chunked_core(k, k, v, SLOPES, 1.0, None, 64)[1], TOL, "end state")
    assert_close(o, chunked_core(q, k, v, SLOPES, 0.3, S, 64)[0], TOL, "o")
    assert S_got is S or torch.equal(S_got, S)
    assert _stream_of("scan") == ["side"] and _stream_of("chunk_fwd_h") == ["main"]
    # b: the recurrence's final state for whole chunks, else (or early) the state kernel
    # beside it, on the side stream with the scan
    assert _stream_of("leaf_state") == ([] if T % 64 == 0 and not early else ["side"])
    first = zero_in or order == "output_first"
    out = "chunk_fwd_o" if first else "output_from_states"
    assert _stream_of(out) == ["main"]
    wait = LOG.index(("wait", "main", "side"))
    if not first:        # the output waits for the scan
        assert wait < LOG.index((out, "main"))
    else:                # the zero-start output is queued before the wait, ...
        assert LOG.index((out, "main")) < wait
        # ... and S_in's part after it (the shortcut has none: nothing enters)
        assert _stream_of("entering_state") == ([] if zero_in else ["main"])
        if not zero_in:
            assert wait < LOG.index(("entering_state", "main"))
    _joined()


def test_output_first_without_its_kernel_raises_before_the_scan(monkeypatch):
    """A kernel set without ``entering_state`` cannot run ``forward_schedule="output_first"``:
    it says so before the scan sends anything (no peer is left waiting)."""
    import dataclasses
    fake = dataclasses.replace(_install(monkeypatch.setattr, SLOPES), entering_state=None)
    q, k, v, _, S, _ = _data(2, 128)
    seen = {}
    with pytest.raises(ValueError, match="entering_state; pass forward_schedule='states_first'"):
        leaves_output(q, k, v, SLOPES, 0.3, _scan_returning(S, seen), fake,
                      tuning=LinearTuning(forward_schedule="output_first"))
    assert not seen and not _stream_of("scan")


def _backward_case(monkeypatch, seed: int, zero_grad: bool, needed, tuning: LinearTuning):
    """``leaves_backward`` on two leaves per batch row (zigzag-like rows) through the stand-in
    kernels, checked: the contributions ``d`` handed to the scan (the leaves someone reads)
    and dq, dk, dv against the torch backward. Returns ``(dg, d, keep)``."""
    fake = _install(monkeypatch.setattr, SLOPES)
    B, n, C = 2, 2, 100
    q, k, v, do, S, G = _data(B * n, C, seed=seed)
    G = torch.zeros_like(G) if zero_grad else G
    seen = {}
    scan = _scan_returning(G, seen)
    dq, dk, dv, dg = leaves_backward(q, k, v, SLOPES, 0.7, S, do, scan, fake, needed,
                                     zero_grad, tuning=tuning)
    want_d = 0.7 * decayed_state_sum_ref(q, do, SLOPES, 1, 1)
    keep = torch.tensor(needed or (True,) * n).repeat(B)   # rows are batch-major
    assert_close(seen["x"][keep], want_d[keep], TOL, "d")
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv),
                              torch_leaf_backward(q, k, v, SLOPES, 0.7, S, do, G)):
        assert_close(got, ref, TOL, name)
    return dg, seen["x"], keep


@pytest.mark.parametrize("concurrent", [True, False])
@pytest.mark.parametrize("zero_grad", [False, True])
@pytest.mark.parametrize("needed", [None, (False, True), (True, False)])
def test_leaves_backward_fla_path(concurrent, zero_grad, needed, monkeypatch):
    """Two leaves per batch row (zigzag-like rows), every combination of the stream layout,
    the last-leaf shortcut and the skipped first-leaf contribution."""
    _, d, keep = _backward_case(monkeypatch, 1, zero_grad, needed, LinearTuning(
        concurrent_recurrences=concurrent, backward_schedule="scan_first"))
    if not keep.all():                  # leaves nobody reads: zeros, not computed
        assert float(d[~keep].abs().max()) == 0.0
    # streams: d and the scan on the high-priority side stream, the chunk states from S_in on
    # the recurrence stream (or main), the gradient recurrence and dq/dk/dv on main
    assert _stream_of("scan") == ["side"]
    assert set(_stream_of("state_grad_local")) == {"side"}     # d beside the recurrences
    assert _stream_of("chunk_fwd_h") == ["rec" if concurrent else "main"]
    for what in ("chunk_bwd_dh", "chunk_bwd_dv", "chunk_bwd_dqkwg"):
        assert _stream_of(what) == ["main"], what
    dh_at = LOG.index(("chunk_bwd_dh", "main"))
    waits_side = [i for i, e in enumerate(LOG) if e == ("wait", "main", "side")]
    # the gradient recurrence waits for G, unless none can arrive (then it starts at once)
    assert (min(waits_side) < dh_at) == (not zero_grad)
    if concurrent:
        assert ("wait", "rec", "main") in LOG
        assert LOG.index(("wait", "main", "rec")) < LOG.index(("chunk_bwd_dqkwg", "main"))
        assert LOG.index(("wait", "main", "rec")) > dh_at    # dh ran beside the chunk states
    _joined()


@pytest.mark.parametrize("schedule", ["recurrence_first", "auto"])
@pytest.mark.parametrize("zero_grad", [False, True])
@pytest.mark.parametrize("needed", [None, (False, True)])
@pytest.mark.parametrize("concurrent", [True, False])
def test_leaves_backward_late_gradient(schedule, zero_grad, needed, concurrent, monkeypatch):
    """``LinearTuning.backward_schedule="recurrence_first"`` (``auto``'s pick for fixed rates):
    the gradient recurrence from zero never waits for the scan; d is its start gradient, sent
    to the scan once it is queued (no state kernel); main waits for the scan only before dv;
    dq, dk, dv equal the torch backward."""
    dg, _, _ = _backward_case(monkeypatch, 2, zero_grad, needed, LinearTuning(
        backward_schedule=schedule, concurrent_recurrences=concurrent))
    assert dg is None
    assert _stream_of("scan") == ["side"]
    for what in ("chunk_bwd_dh", "chunk_dv", "chunk_dqkdg"):
        assert _stream_of(what) == ["main"], what
    assert _stream_of("chunk_bwd_dv") == [] and _stream_of("chunk_bwd_dqkwg") == []
    assert _stream_of("chunk_fwd_h") == ["rec" if concurrent else "main"]
    dh_at = LOG.index(("chunk_bwd_dh", "main"))
    scan_at = LOG.index(("scan", "side"))
    assert _stream_of("state_grad_local") == [] and scan_at > dh_at
    waits_side = [i for i, e in enumerate(LOG) if e == ("wait", "main", "side")]
    assert min(waits_side) > dh_at          # the recurrence never waits for G
    if not zero_grad:
        assert min(waits_side) < LOG.index(("chunk_dv", "main"))
    if not concurrent:                      # one stream: the chunk states while the scan runs
        states_at = LOG.index(("chunk_fwd_h", "main"))
        assert dh_at < scan_at < states_at < LOG.index(("chunk_dv", "main"))
        if not zero_grad:
            assert states_at < min(waits_side)
    _joined()


def _cp_steps(rank, world, leaf_tokens, seed, tunings):
    """Whole CP steps through the fla path (stand-in kernels, recorder streams) at every rank,
    every scan and both layouts, one per tuning, vs the single-device recurrence in fp64."""
    import torch.distributed as dist

    from sp_attention import build_sp_context, shard_sequence
    from sp_attention.linear.attention import lightning_attention_with_kernels
    from sp_attention.linear.naive import recurrent_linear_attention

    def setattr_(obj, name, value):
        setattr(obj, name, value)
    fake = _install(setattr_, SLOPES)
    group = dist.new_group(list(range(world)))
    g = torch.Generator().manual_seed(seed)
    T = 2 * world * leaf_tokens              # zigzag leaves of leaf_tokens
    q, k, v, w = (torch.randn(1, T, 3, 4, generator=g, dtype=torch.float64) for _ in range(4))
    ins = [t.clone().requires_grad_(True) for t in (q, k, v)]
    o, _ = recurrent_linear_attention(*ins, SLOPES, scale=0.5)
    (o * w).sum().backward()
    expected = [o.detach()] + [t.grad for t in ins]
    for layout in ("contiguous", "zigzag"):
        ctx = build_sp_context(group, layout=layout)
        want = [shard_sequence(t, ctx, 1) for t in expected]
        for impl in ("blelloch", "allgather", "ring"):
            for tuning in tunings:
                loc = [shard_sequence(t, ctx, 1).clone().requires_grad_(True) for t in (q, k, v)]
                out = lightning_attention_with_kernels(*loc, SLOPES, fake, ctx=ctx, impl=impl,
                                                       scale=0.5, tuning=tuning)
                (out * shard_sequence(w, ctx, 1)).sum().backward()
                for got, exp, what in zip((out, *(t.grad for t in loc)), want, ("o", "dq", "dk",
                                                                                 "dv")):
                    assert_close(got, exp, TOL, f"{layout} {impl} {tuning} rank{rank} {what}")
    return True


def _cp_world(rank, world):
    """Every schedule variant; leaves of 40 tokens: partial chunks."""
    return _cp_steps(rank, world, 40, 5, [
        LinearTuning(concurrent_recurrences=c, early_end_states=e, backward_schedule=b)
        for c, e, b in ((True, False, "scan_first"), (False, False, "scan_first"),
                        (True, True, "scan_first"), (True, False, "recurrence_first"),
                        (False, False, "auto"))] + [
        LinearTuning(forward_schedule="output_first"),
        LinearTuning(forward_schedule="output_first", early_end_states=True)])


@pytest.mark.parametrize("world", [3])
def test_cp_step_through_fla_path(world):
    assert all(run_distributed(_cp_world, world, timeout=300))


def _cp_world_rows(rank, world):
    """``LinearTuning.row_splits``: each leaf as 2 and 3 rows (zigzag leaves of 6 chunks), both
    backward schedules."""
    return _cp_steps(rank, world, 384, 6, [
        LinearTuning(row_splits=r, backward_schedule=b, forward_schedule=f)
        for r, b, f in ((2, "recurrence_first", "auto"), (3, "scan_first", "output_first"),
                        (3, "auto", "auto"))])


def test_cp_step_through_fla_path_with_row_splits():
    assert all(run_distributed(_cp_world_rows, 3, timeout=300))


@pytest.mark.parametrize("T", [128, 100])
def test_one_leaf_through_the_kernel_sequence(T, monkeypatch):
    """The whole sequence on one rank (P = 1): the fla path's one kernel sequence
    (:mod:`sp_attention.linear.local`) with the stand-ins = the torch backend, o and grads."""
    from sp_attention.linear.attention import lightning_attention_with_kernels
    fake = _install(monkeypatch.setattr, SLOPES)
    q, k, v, do, _, _ = _data(1, T)
    ins = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
    o = lightning_attention_with_kernels(*ins, SLOPES, fake, scale=0.5)
    (o * do).sum().backward()
    from sp_attention.linear import lightning_attention
    r = lightning_attention(*ref, SLOPES, scale=0.5, backend="torch")
    (r * do).sum().backward()
    for name, got, want in zip(("o", "dq", "dk", "dv"), (o, *(t.grad for t in ins)),
                               (r, *(t.grad for t in ref))):
        assert_close(got, want, TOL, name)
    assert [e[0] for e in LOG if e[0] != "wait"] == [
        "chunk_fwd_h", "chunk_fwd_o", "chunk_fwd_h", "chunk_bwd_dh", "chunk_bwd_dv",
        "chunk_bwd_dqkwg"]


"""The fla path with per-token gates and with packed documents, on CPU in fp64: fla's kernels
replaced by pure-torch stand-ins with fla 0.6's keyword signatures (varlen included: they run
each sequence of ``cu_seqlens`` alone), our kernels by their references, so which tensor
reaches which call (gate sums, incoming states scattered to the varlen sequences, arriving
gradients, our dq/dk/dg kernel in place of fla's) is checked to 1e-10 on every CI run. The
kernels themselves are checked on the GPU (``benchmarks/gated_check.py``,
``benchmarks/packed_linear.py``). Streams are the fixed-slope path's
(``test_fla_orchestration.py``); here they run as plain calls on the CPU."""
from __future__ import annotations

import contextlib
import math

import pytest
import torch

from sp_attention import LinearTuning
from sp_attention.linear import gated_naive as gn

from sp_attention.linear.torch_ops import chunked_gated_core
from sp_attention.linear.kernel_set import FlaKernels
from sp_attention.linear.leaf import decayed_sum, torch_leaf_backward
from sp_attention.linear.leaves import forward_schedule, leaves_backward, leaves_output
from sp_attention.testing import assert_close

from packed_cases import check_shard, make_inputs, per_document_reference

TOL = 1e-10


SLOPES = torch.tensor([0.02, 0.7, 40.0], dtype=torch.float64)


def _natural(g, g_gamma, B, T, chunk):
    """The per-token natural-log gate the stand-ins compute with. fla's ``g_gamma`` is fp32
    (``−s / ln 2``): checked against the fp64 slopes, which are then used exactly."""
    if g is not None:
        return gn.gate_from_chunk_sums(g, chunk)
    assert torch.allclose(g_gamma.double(), -SLOPES / math.log(2.0), rtol=1e-6), g_gamma
    return (-SLOPES).expand(B, T, -1)


def _varlen(dense_fn, token_args, cu, per_seq=None, chunked=None, chunk=64):
    """Run ``dense_fn`` on each sequence of ``cu`` alone: token tensors sliced, per-sequence
    tensors (``per_seq``: name -> [N, …]) indexed, chunk tensors (``chunked``: name ->
    [1, NT, …]) sliced by the sequence's chunks; returns the per-sequence results."""
    outs, c0 = [], 0
    for n, (a, b) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        nc = -(-(b - a) // chunk)
        kw = {name: t[:, a:b] for name, t in token_args.items()}
        kw.update({name: (None if t is None else t[n:n + 1])
                   for name, t in (per_seq or {}).items()})
        kw.update({name: t[:, c0:c0 + nc] for name, t in (chunked or {}).items()})
        outs.append(dense_fn(**kw))
        c0 += nc
    return outs


def _tok_cat(parts, like):
    """Concatenate per-sequence token outputs; tokens past the last sequence are zero."""
    out = torch.cat(parts, 1)
    pad = like.shape[1] - out.shape[1]
    return torch.cat([out, out.new_zeros(out.shape[0], pad, *out.shape[2:])], 1) if pad else out


def _check_splits(cu_seqlens, chunk_size, split_offsets, num_splits) -> None:
    """The host-known chunk offsets the path passes to the chunk-state launchers
    (:mod:`sp_attention.linear.fla_states`) are fla's: each sequence's first chunk, int64,
    and their total."""
    if cu_seqlens is None:
        assert split_offsets is None and num_splits is None
        return
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    want = torch.nn.functional.pad((lens + chunk_size - 1) // chunk_size, (1, 0)).cumsum(0)
    assert split_offsets is not None and split_offsets.dtype == torch.int64
    assert torch.equal(split_offsets.cpu(), want) and num_splits == int(want[-1])


def fake_kernels() -> FlaKernels:
    """fla 0.6's gated / fixed chunk kernels (varlen too) and ours, in pure torch, fp64."""
    def chunk_fwd_h(k, v, g=None, g_gamma=None, gk=None, gv=None, h0=None,
                    output_final_state=False, state_v_first=False, cu_seqlens=None,
                    chunk_size=64, split_size=None, states_in_fp32=False, split_offsets=None,
                    num_splits=None):
        _check_splits(cu_seqlens, chunk_size, split_offsets, num_splits)
        def dense(k, v, g=None, h0=None):
            nat = _natural(g, g_gamma, k.shape[0], k.shape[1], chunk_size)
            h = gn.gated_chunk_states(k, v, nat, chunk_size, h0)
            ht = chunked_gated_core(k, k, v, nat, 1.0, h0, chunk_size)[1]
            return h, ht
        if cu_seqlens is None:
            h, ht = dense(k, v, g, h0)
            return h, (ht if output_final_state else None)
        parts = _varlen(dense, {"k": k, "v": v, **({"g": g} if g is not None else {})},
                        cu_seqlens, {"h0": h0}, chunk=chunk_size)
        return torch.cat([p[0] for p in parts], 1), (torch.cat([p[1] for p in parts], 0)
                                                     if output_final_state else None)

    def chunk_fwd_o(q, k, v, h, g=None, g_gamma=None, scale=None, state_v_first=False,
                    cu_seqlens=None, chunk_size=64, chunk_indices=None):
        def dense(q, k, v, h, g=None):
            nat = _natural(g, g_gamma, q.shape[0], q.shape[1], chunk_size)
            zero = h.new_zeros(h.shape[0], *h.shape[2:])
            return gn.gated_output_from_states_ref(q, k, v, h, zero, nat, scale, chunk_size)
        if cu_seqlens is None:
            return dense(q, k, v, h, g).to(v.dtype)
        parts = _varlen(dense, {"q": q, "k": k, "v": v, **({"g": g} if g is not None else {})},
                        cu_seqlens, chunked={"h": h}, chunk=chunk_size)
        return _tok_cat(parts, v).to(v.dtype)

    def chunk_bwd_dh(q, k, v, do, h0, dht, scale, g=None, g_gamma=None, gk=None, gv=None,
                     state_v_first=False, cu_seqlens=None, chunk_size=64, split_size=None,
                     states_in_fp32=False, split_offsets=None, num_splits=None):
        _check_splits(cu_seqlens, chunk_size, split_offsets, num_splits)

        def dense(q, do, dht=None, g=None):
            nat = _natural(g, g_gamma, q.shape[0], q.shape[1], chunk_size)
            return gn.chunk_end_grads(q, do, nat, dht, scale, chunk_size)[0]
        if h0 is not None:      # the late-gradient path: from a zero end, with the start's
            assert dht is None and cu_seqlens is None, "dh0 only from a zero end, unpacked"
            nat = _natural(g, g_gamma, q.shape[0], q.shape[1], chunk_size)
            return gn.chunk_end_grads(q, do, nat, None, scale, chunk_size)
        if cu_seqlens is None:
            return dense(q, do, dht, g), None
        parts = _varlen(dense, {"q": q, "do": do, **({"g": g} if g is not None else {})},
                        cu_seqlens, {"dht": dht}, chunk=chunk_size)
        return torch.cat(parts, 1), None

    def _dqkdg(q, k, v, do, h, dh, g, g_gamma, scale, cu_seqlens, chunk_size):
        def dense(q, k, v, do, h, dh, g=None):
            nat = _natural(g, g_gamma, q.shape[0], q.shape[1], chunk_size)
            return gn.dqkdg_ref(q, k, v, do, h, dh, nat, scale, chunk_size)
        if cu_seqlens is None:
            return dense(q, k, v, do, h, dh, g)
        parts = _varlen(dense, {"q": q, "k": k, "v": v, "do": do,
                                **({"g": g} if g is not None else {})},
                        cu_seqlens, chunked={"h": h, "dh": dh}, chunk=chunk_size)
        return tuple(_tok_cat([p[i] for p in parts], q if i < 2 else v if i == 2 else q[..., 0])
                     for i in range(4))

    def chunk_bwd_dv(q, k, do, dh, g=None, g_gamma=None, scale=None, state_v_first=False,
                     cu_seqlens=None, chunk_size=64, chunk_indices=None):
        zero = torch.zeros_like(dh)          # dv depends on neither v nor the chunk states
        return _dqkdg(q, k, torch.zeros_like(do), do, zero, dh, g, g_gamma, scale, cu_seqlens,
                      chunk_size)[2].to(do.dtype)

    def chunk_bwd_dqkwg(q, k, v, do, h, dh, w=None, g=None, g_gamma=None, dv=None, scale=None,
                        state_v_first=False, cu_seqlens=None, chunk_size=64,
                        chunk_indices=None):
        assert g is None, "fla's gated chunk_bwd_dqkwg is never called (fla #640)"
        dq, dk, _, _ = _dqkdg(q, k, v, do, h, dh, None, g_gamma, scale, cu_seqlens, chunk_size)
        return dq, dk, None, None

    def _with_late(q, do, dh, gc, g_gamma, G, suffix, scale, chunk_size):
        """``dh`` from a zero end plus the gradient ``G`` arriving at the row's end, carried
        back to every chunk's end (what our dv and dq/dk/dg kernels add in-kernel); gates
        come with their suffix sums, fixed rates without."""
        if G is None:
            return dh
        assert (suffix is not None) == (gc is not None), "gates take G with suffix sums"
        nat = _natural(gc, g_gamma, q.shape[0], q.shape[1], chunk_size)
        return dh + gn.chunk_end_grads(q, do, nat, G, scale, chunk_size)[0] \
            - gn.chunk_end_grads(q, do, nat, None, scale, chunk_size)[0]

    def chunk_dqkdg(q, k, v, do, h, dh, gc, scale, chunk_size=64, config=None, block_k=None,
                    cu_seqlens=None, chunk_indices=None, *, g_gamma=None, G=None, suffix=None):
        dh = _with_late(q, do, dh, gc, g_gamma, G, suffix, scale, chunk_size)
        dq, dk, _, dg = _dqkdg(q, k, v, do, h, dh, gc, g_gamma, scale, cu_seqlens, chunk_size)
        return dq, dk, dg

    def chunk_dv(q, k, do, dh, scale, chunk_size=64, *, g_gamma=None, gc=None, G=None,
                 suffix=None, config=None):
        dh = _with_late(q, do, dh, gc, g_gamma, G, suffix, scale, chunk_size)
        zero = torch.zeros_like(dh)
        return _dqkdg(q, k, torch.zeros_like(do), do, zero, dh, gc, g_gamma, scale, None,
                      chunk_size)[2].to(do.dtype)

    def output_from_states(q, k, v, h, S_in, g_gamma, scale, chunk_size=64, config=None,
                           gates=None):
        nat = _natural(None if gates is None else gates.gc, g_gamma, q.shape[0], q.shape[1],
                       chunk_size)
        return gn.gated_output_from_states_ref(q, k, v, h, S_in, nat, scale,
                                               chunk_size).to(v.dtype)

    def entering_state(o, q, S_in, g_gamma, scale, chunk_size=64, gates=None):
        # o_t += scale · exp(Σ_{s<=t} g_s) q_t S_in, the row's inclusive natural-log gate sum
        nat = _natural(None if gates is None else gates.gc, g_gamma, q.shape[0], q.shape[1],
                       chunk_size)
        w = nat.double().cumsum(1).exp()
        o += (scale * torch.einsum("nthk,nhkv->nthv", q.double() * w[..., None],
                                   S_in.double())).to(o.dtype)
        return o

    return FlaKernels(chunk_fwd_h, chunk_fwd_o, chunk_bwd_dh, chunk_bwd_dqkwg, chunk_bwd_dv,
                      output_from_states, decayed_sum, chunk_dqkdg, chunk_dv=chunk_dv,
                      entering_state=entering_state)


def _no_streams(setattr_) -> None:
    """torch.cuda's stream calls as no-ops (the CPU tensors stay where they are)."""
    class S:
        def wait_stream(self, other):
            pass
    for name, value in (("current_stream", lambda device=None: S()),
                        ("Stream", lambda device=None, priority=0: S()),
                        ("stream", lambda s: contextlib.nullcontext()),
                        ("device", lambda device=None: contextlib.nullcontext()),
                        ("current_device", lambda: 0)):
        setattr_(torch.cuda, name, value)


@pytest.mark.parametrize("T", [128, 100])
@pytest.mark.parametrize("needed", [None, (False, True)])
@pytest.mark.parametrize("schedule", ["auto", "scan_first"])
def test_gated_leaves_fla_path(T, needed, schedule, monkeypatch):
    """Two leaves per batch row with gates (one underflowing head, single gates of −1e2 …
    −1e30 among the others: the kernels take clamped sums) through the fla path's
    leaves_output / leaves_backward = the torch path, fp64: o, S_in, the end states and
    contributions the scans receive, dq, dk, dv, dg; both backward orders (``auto`` is
    ``recurrence_first``: the gradient arriving at the rows' ends taken in-kernel), each with
    one forward order (``auto`` with ``output_first``: the zero-start output, then the
    entering state's part; ``scan_first`` with ``auto``, i.e. ``states_first``)."""
    _no_streams(monkeypatch.setattr)
    from sp_attention.linear.decay import Decay
    kern = fake_kernels()
    B, n = 2, 2
    q, k, v, do, g = make_inputs(B * n, T, 3, 4, 5, "big", 3)
    gen = torch.Generator().manual_seed(4)
    S, G = (torch.randn(B * n, 3, 4, 5, generator=gen, dtype=torch.float64) for _ in range(2))
    decay, seen = Decay(g=g), {}

    def scan(x, A):
        seen.setdefault("x", []).append(x)
        seen.setdefault("A", []).append(A)
        return S if len(seen["x"]) == 1 else G
    order = "output_first" if schedule == "auto" else "auto"
    assert forward_schedule(LinearTuning(forward_schedule=order)) == (
        "output_first" if schedule == "auto" else "states_first")
    o, S_got = leaves_output(q, k, v, decay, 0.3, scan, kern,
                             tuning=LinearTuning(forward_schedule=order))
    ref_b = chunked_gated_core(k, k, v, g, 1.0, None, 64)[1]
    assert_close(seen["x"][0], ref_b, TOL, "b")
    assert_close(seen["A"][0], g.sum(1).exp(), TOL, "A")
    assert_close(o, chunked_gated_core(q, k, v, g, 0.3, S, 64)[0], TOL, "o")
    grads = leaves_backward(q, k, v, decay, 0.3, S, do, scan, kern, needed,
                            tuning=LinearTuning(backward_schedule=schedule))
    d = gn.gated_state_grad_ref(q, do, g, 0.3)
    keep = torch.tensor(needed or (True,) * n).repeat(B)
    assert_close(seen["x"][1][keep], d[keep], TOL, "d")
    refs = torch_leaf_backward(q, k, v, decay, 0.3, S, do, G)
    for name, got, ref in zip(("dq", "dk", "dv", "dg"), grads, refs):
        assert_close(got, ref, TOL, name)


def cp_step_through_fla_path(rank, world):
    """A whole CP step through the fla path's stand-ins at every rank: gates unpacked (both
    layouts, every schedule) and packed documents (gates and fixed slopes, both layouts); the
    gates include single gates of −1e2 … −1e30 (``packed_cases.BIG_GATES``).
    Runs in the P = 3 spawn of ``test_linear_cp.py`` (one spawn per world size); it replaces
    torch.cuda's stream calls by no-ops in that worker process."""
    import torch.distributed as dist

    from sp_attention import build_sp_context, plan_packing, shard_sequence
    from sp_attention.linear.attention import lightning_attention_with_kernels

    def setattr_(obj, name, value):
        setattr(obj, name, value)
    _no_streams(setattr_)
    kern = fake_kernels()
    group = dist.new_group(list(range(world)))
    T = 2 * world * 40
    q, k, v, do, g = make_inputs(1, T, 3, 4, 5, "big", 5)
    ref = per_document_reference(q, k, v, do, g, [0, T], 0.5)
    for layout in ("contiguous", "zigzag"):
        ctx = build_sp_context(group, layout=layout)
        sh = lambda t: shard_sequence(t, ctx, 1)        # noqa: E731
        for impl in ("blelloch", "allgather", "ring"):
            xs = [sh(t).clone().requires_grad_(True) for t in (q, k, v, g)]
            o = lightning_attention_with_kernels(*xs[:3], None, kern, g=xs[3], ctx=ctx,
                                                 impl=impl, scale=0.5)
            (o * sh(do)).sum().backward()
            check_shard((o,) + tuple(x.grad for x in xs), [sh(t) for t in ref],
                        xs[0].detach(), f"fla gated {layout} {impl} rank{rank}")
    slopes = SLOPES
    for cu, row in (([0, 70, 71, 150, 200, 240], 245), ([0, 9, 10, 12, 120], 120)):
        q, k, v, do, g = make_inputs(2, row, 3, 4, 5, "big", 6)
        refs = {"g": per_document_reference(q, k, v, do, g, cu, 0.5),
                "slopes": per_document_reference(q, k, v, do, -slopes.expand_as(g), cu, 0.5)}
        for layout in ("contiguous", "zigzag"):
            ctx = build_sp_context(group, layout=layout)
            plan = plan_packing(cu, ctx, row_len=row)
            sh = lambda t: plan.shard(t, ctx.rank, 1)       # noqa: E731
            for kind, ref in refs.items():
                xs = [sh(t).clone().requires_grad_(True) for t in (q, k, v, g)]
                dec = {"g": xs[3]} if kind == "g" else {}
                o = lightning_attention_with_kernels(
                    *xs[:3], slopes if kind == "slopes" else None, kern, **dec, cu_seqlens=plan,
                    ctx=ctx, scale=0.5)
                (o * sh(do)).sum().backward()
                got = (o,) + tuple(x.grad for x in xs[:3]) + ((xs[3].grad,) if kind == "g"
                                                             else ())
                check_shard(got, [sh(t) for t in ref], xs[0].detach(),
                            f"fla packed {kind} {layout} rank{rank}")
    return True


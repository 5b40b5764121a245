"""Several leaves at once (``sp_attention/linear/leaves.py``): GPU (``-m gpu``) the overlapped
fla path vs the torch backend (states handed to the scans, first/last-leaf shortcuts, two
leaves on one GPU); on CPU, the stream cache's bound. The fla path's orchestration on CPU,
with stand-in kernels: ``test_fla_orchestration.py``."""

from __future__ import annotations

import pytest
import torch

from local_cases import apply, gpu, inputs
from sp_attention import LinearTuning
from sp_attention.linear.leaf import leaf_backward, leaf_output, leaf_state, state_grad_local
from sp_attention.linear.leaves import leaves_backward, leaves_output
from sp_attention.testing import assert_close


@apply(gpu)
@pytest.mark.parametrize("concurrent", [True, False])
@pytest.mark.parametrize("T", [256, 300])
def test_fla_leaves_overlapped_match_torch_bf16(T, concurrent):
    """leaves_output / leaves_backward (fla; the scan callback runs on the side stream) vs the
    torch backend in fp32, with states entering and gradients arriving; the states handed to
    the scans are the leaves' end states and state-gradient contributions (T = 256: the end
    state comes from fla's recurrence; T = 300: from the one-pass kernel). The backward runs
    with its two chunk recurrences on two streams and on one (``concurrent``)."""
    tuning = LinearTuning(concurrent_recurrences=concurrent)
    q, k, v, S0, do, G = inputs(B=2, T=T, H=4, K=64, V=64, dtype=torch.bfloat16, device="cuda")
    slopes = torch.tensor([0.0, 0.01, 0.3, 50.0], device="cuda")
    S0, G, do = S0.float(), G.float(), do.bfloat16()
    q32, k32, v32 = q.float(), k.float(), v.float()
    seen = {}

    def scan_f(b, A):
        seen["b"] = b.clone()
        return S0 * 1.0

    def scan_b(d, A):
        seen["d"] = d.clone()
        return G * 1.0
    o, S = leaves_output(q, k, v, slopes, 0.125, scan_f, "fla", tuning=tuning)
    assert_close(S, S0, 0.0)
    assert_close(seen["b"], leaf_state(k32, v32, slopes), 3e-3, "end state")
    assert_close(o.float(), leaf_output(q32, k32, v32, slopes, 0.125, S0, "torch"), 3e-3)
    grads = leaves_backward(q, k, v, slopes, 0.125, S0, do, scan_b, "fla", tuning=tuning)
    assert_close(seen["d"], state_grad_local(q32, do.float(), slopes, 0.125), 3e-3, "d")
    refs = leaf_backward(q32, k32, v32, slopes, 0.125, S0, do.float(), G, "torch")
    for name, got, ref in zip(("dq", "dk", "dv"), grads, refs):
        assert got.dtype == torch.bfloat16
        assert_close(got.float(), ref, 3e-3, name)


@apply(gpu)
def test_fla_two_leaves_on_one_gpu_match_one_leaf():
    """World size 1 with the zigzag layout: two leaves on one GPU, scanned locally through the
    overlapped path, equal the plain one-leaf fla call (bf16, relative RMS)."""
    from sp_attention import SPContext
    from sp_attention.linear import lightning_attention
    from sp_attention.testing import rel_rms

    q, k, v, _, do, _ = inputs(B=1, T=2000, H=4, K=64, V=64, dtype=torch.bfloat16, device="cuda")
    slopes = torch.tensor([0.0, 0.01, 0.3, 50.0], device="cuda")
    one = [t.clone().requires_grad_(True) for t in (q, k, v)]
    two = [t.clone().requires_grad_(True) for t in (q, k, v)]
    o1 = lightning_attention(*one, slopes)
    o1.backward(do.bfloat16())
    zz = SPContext(None, 0, 1, (0,), "zigzag")
    for impl in ("blelloch", "allgather", "ring"):
        for t in two:
            t.grad = None
        o2 = lightning_attention(*two, slopes, ctx=zz, impl=impl)
        o2.backward(do.bfloat16())
        for name, a, b in zip(("o", "dq", "dk", "dv"), (o2, *(t.grad for t in two)),
                              (o1, *(t.grad for t in one))):
            assert torch.isfinite(a).all(), (impl, name)
            assert rel_rms(a, b) < 5e-3, (impl, name, rel_rms(a, b))


@apply(gpu)
@pytest.mark.parametrize("concurrent", [True, False])
@pytest.mark.parametrize("T", [256, 300])
def test_fla_first_and_last_leaf_paths_match_torch_bf16(T, concurrent):
    """The paths of a rank holding only the sequence's first leaf (``zero_in``: fla's own output
    kernel, the scan joined afterwards) and only its last leaf (``zero_grad``: the gradient
    recurrence starts without waiting for the scan) vs the torch backend in fp32; the states
    handed to the scans are checked too."""
    tuning = LinearTuning(concurrent_recurrences=concurrent)
    q, k, v, S0, do, _ = inputs(B=2, T=T, H=4, K=64, V=64, dtype=torch.bfloat16, device="cuda")
    slopes = torch.tensor([0.0, 0.01, 0.3, 50.0], device="cuda")
    S0, do = S0.float(), do.bfloat16()
    q32, k32, v32 = q.float(), k.float(), v.float()
    seen = {}

    def scan_first(b, A):          # what any scan returns to the first leaf: zeros
        seen["b"] = b.clone()
        return torch.zeros_like(b)

    def scan_last(d, A):           # ... and to the last leaf in reverse
        seen["d"] = d.clone()
        return torch.zeros_like(d)
    o, S = leaves_output(q, k, v, slopes, 0.125, scan_first, "fla", zero_in=True,
                         tuning=tuning)
    assert_close(seen["b"], leaf_state(k32, v32, slopes), 3e-3, "end state")
    assert float(S.abs().max()) == 0.0
    assert_close(o.float(), leaf_output(q32, k32, v32, slopes, 0.125, None, "torch"), 3e-3)
    grads = leaves_backward(q, k, v, slopes, 0.125, S0, do, scan_last, "fla",
                            zero_grad=True, tuning=tuning)
    assert_close(seen["d"], state_grad_local(q32, do.float(), slopes, 0.125), 3e-3, "d")
    refs = leaf_backward(q32, k32, v32, slopes, 0.125, S0, do.float(), None, "torch")
    for name, got, ref in zip(("dq", "dk", "dv"), grads, refs):
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
        assert_close(got.float(), ref, 3e-3, name)


def test_stream_cache_made_once_and_bounded(monkeypatch):
    """The fla path's streams are made once per (factory, device, role, priority), not per
    call, and stand-in factories (the CPU tests make a new one per test) cannot grow the cache
    past its bound."""
    from sp_attention.linear import leaves

    made = []

    def factory(device=None, priority=0):
        made.append((device, priority))
        return object()
    monkeypatch.setattr(torch.cuda, "Stream", factory)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    dev = torch.device("cuda", 0)
    side = leaves._stream(dev, "side", -1)
    assert leaves._stream(dev, "side", -1) is side and made == [(0, -1)]
    assert leaves._stream(torch.device("cuda"), "side", -1) is side      # index from the device
    assert leaves._stream(dev, "recurrence") is not side and len(made) == 2
    for _ in range(3 * leaves._STREAMS.maxsize):     # a new stand-in factory each time
        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None, priority=0: object())
        leaves._stream(dev, "side", -1)
    assert len(leaves._STREAMS) <= leaves._STREAMS.maxsize == 64

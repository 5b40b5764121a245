"""Bad input to lightning_attention raises a clear error before any communication.

The context holds a fake group object: any collective on it would crash with an unrelated
error, so a matching ValueError/TypeError proves the check ran first.
"""
import pytest
import torch

from sp_attention import SPContext
from sp_attention.linear import lightning_attention
from sp_attention.linear.kernel_set import FlaKernels
from sp_attention.linear.slope_constants import cached_constants, num_cached_slopes

FAKE = SPContext(object(), 0, 2, (0, 1), "zigzag")


def _qkv(B=1, T=8, H=2, K=4, V=3, dtype=torch.float64):
    return (torch.randn(B, T, H, K, dtype=dtype), torch.randn(B, T, H, K, dtype=dtype),
            torch.randn(B, T, H, V, dtype=dtype))


@pytest.mark.parametrize("change,match,exc", [
    (dict(k=torch.randn(1, 8, 2, 5, dtype=torch.float64)), "same shape", ValueError),
    (dict(v=torch.randn(1, 6, 2, 3, dtype=torch.float64)), "must match q", ValueError),
    (dict(v=torch.randn(1, 8, 2, 3, dtype=torch.float32)), "dtypes differ", ValueError),
    (dict(q=torch.randn(8, 2, 4, dtype=torch.float64)), r"\[B, T, H, K/V\]", ValueError),
    (dict(slopes=torch.ones(3, dtype=torch.float64)), r"slopes must be \[H\] = \[2\]", ValueError),
    (dict(slopes=torch.tensor([0.1, -0.2])), ">= 0", ValueError),
    (dict(slopes=torch.tensor([0.1, float("nan")])), "finite", ValueError),
    (dict(slopes=torch.ones(2, requires_grad=True)), "detach", ValueError),
    (dict(slopes=[0.1, 0.2]), "must be a torch.Tensor", TypeError),
    (dict(impl="tree"), "unknown linear-attention scan impl", ValueError),
    (dict(backend="cuda"), "unknown local backend", ValueError),
    (dict(backend="fla"), "backend='fla' cannot run", ValueError),
    # a kernel set is not public input (tests pass theirs to lightning_attention_with_kernels)
    (dict(backend=FlaKernels(*[print] * 7)), "backend must be a name", TypeError),
    (dict(scale=0.0), "scale must be a positive", ValueError),
    (dict(ctx="group"), "ctx must be an SPContext", TypeError),
])
def test_bad_input_raises_before_communication(change, match, exc):
    q, k, v = _qkv()
    args = dict(q=q, k=k, v=v, slopes=torch.tensor([0.1, 0.2]), ctx=FAKE, impl="blelloch",
                scale=1.0, backend="torch")
    args.update(change)
    with pytest.raises(exc, match=match):
        lightning_attention(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("slopes"), **args)


def test_local_length_the_layout_cannot_split():
    q, k, v = _qkv(T=7)
    with pytest.raises(ValueError, match="multiple of 2 for layout 'zigzag'"):
        lightning_attention(q, k, v, torch.tensor([0.1, 0.2]), ctx=FAKE, backend="torch")


def test_slope_values_checked_once_per_version_and_again_after_an_inplace_change():
    # CUDA slopes would cost a device sync per value check: a tensor is checked once per
    # version, and an in-place change (new version) is checked again.
    q, k, v = _qkv()
    slopes = torch.tensor([0.1, 0.2], dtype=torch.float64)
    single = SPContext(None, 0, 1, (0,), "contiguous")
    import gc
    gc.collect()                    # other tests' dead slopes leave the cache now, not below
    before = num_cached_slopes()
    lightning_attention(q, k, v, slopes, ctx=single, backend="torch")
    assert "check_slope_values" in cached_constants(slopes)
    assert num_cached_slopes() == before + 1
    assert not hasattr(slopes, "_sp_constants")        # nothing stored on the tensor itself
    slopes.mul_(-1.0)
    assert cached_constants(slopes) == ()              # a new version: checked again
    with pytest.raises(ValueError, match=">= 0"):
        lightning_attention(q, k, v, slopes, ctx=FAKE, backend="torch")
    del slopes
    gc.collect()
    assert num_cached_slopes() == before               # entries die with their tensors


@pytest.mark.parametrize("world,layout", [(2, "contiguous"), (2, "zigzag"), (5, "zigzag"),
                                          (16, "contiguous"), (64, "zigzag")])
def test_auto_is_the_cost_models_pick(world, layout, monkeypatch):
    """`auto` runs the CPU rule on CPU tensors, and on a GPU what sp_attention.cost predicts
    cheapest for the call's shape, P, layout and links; one rank: ring (nothing crosses); no
    tensors (a header): "auto"."""
    from sp_attention.cost import (H200_NVLINK_IB400, Choice, LinearShape, auto,
                                   choose_linear_scan, cpu_linear_scan)
    from sp_attention.linear.attention import resolve_impl
    ctx = SPContext(object(), 0, world, tuple(range(world)), layout)
    q, v = torch.zeros(1, 64, 4, 16), torch.zeros(1, 64, 4, 8)
    assert auto.machine_for(q.device) is None
    assert resolve_impl("auto", ctx, q, v) == cpu_linear_scan(world, layout)
    monkeypatch.setattr(auto, "machine_for", lambda device: H200_NVLINK_IB400)
    want = choose_linear_scan(LinearShape(1, 64, 4, 16, 8, 4), world, layout,
                              H200_NVLINK_IB400, auto.topology_for(ctx)).name
    assert resolve_impl("auto", ctx, q, v) == resolve_impl(None, ctx, q, v) == want
    assert resolve_impl("auto", ctx) == "auto"
    assert resolve_impl("blelloch", ctx, q, v) == "blelloch"
    assert resolve_impl("auto", SPContext(None, 0, 1, (0,), layout), q, v) == "ring"
    for name in ("blelloch", "allgather", "ring"):     # whatever the model says, runs
        monkeypatch.setattr(auto, "_linear_choice", lambda *a, n=name: Choice(n, {}))
        assert resolve_impl("auto", ctx, q, v) == name


def _g(B=1, T=8, H=2, value=-0.1):
    return torch.full((B, T, H), value, dtype=torch.float64)


@pytest.mark.parametrize("change,match,exc", [
    (dict(g=_g()), "exactly one of slopes", ValueError),                      # both
    (dict(slopes=None), "exactly one of slopes", ValueError),                 # neither
    (dict(slopes=None, g=_g().transpose(1, 2)), r"\[B, H, T\]: pass g.transpose", ValueError),
    (dict(slopes=None, g=_g(H=3)), r"g must be \[B, T_local, H\] = \[1, 8, 2\]", ValueError),
    (dict(slopes=None, g=torch.zeros(1, 8, 2, dtype=torch.int64)), "floating", ValueError),
    (dict(slopes=None, g=_g().to("meta")), "g is on meta but q is on cpu", ValueError),
    (dict(slopes=None, g=_g(value=0.5)), "finite and <= 0", ValueError),
    (dict(slopes=None, g=_g(value=float("-inf"))), "cu_seqlens instead of a -inf", ValueError),
    (dict(slopes=None, g=[[-0.1]]), "g must be a torch.Tensor", TypeError),
    (dict(cu_seqlens=torch.tensor([0, 5, 5, 16])), "strictly increasing", ValueError),
    (dict(cu_seqlens=torch.tensor([0, 5, 16.0])), "int32 or int64", TypeError),
    (dict(cu_seqlens=torch.tensor([0, 5, 30])), "T_local", ValueError),
])
def test_bad_gates_and_boundaries_raise_before_communication(change, match, exc):
    q, k, v = _qkv()
    args = dict(slopes=torch.tensor([0.1, 0.2]), ctx=FAKE, impl="blelloch", scale=1.0,
                backend="torch")
    args.update(change)
    with pytest.raises(exc, match=match):
        lightning_attention(q, k, v, args.pop("slopes"), **args)


def test_gate_value_check_can_be_skipped():
    """check_gate_values=False reads no gate value (no device sync): a positive gate is then
    the caller's responsibility (the math runs, the state grows)."""
    from sp_attention import LinearTuning
    q, k, v = _qkv()
    single = SPContext(None, 0, 1, (0,), "contiguous")
    out = lightning_attention(q, k, v, g=_g(value=0.05), ctx=single, backend="torch",
                              tuning=LinearTuning(check_gate_values=False))
    assert torch.isfinite(out).all()


def _one_rank_bad_gate(rank, world):
    """A positive gate on one rank only, after the same call signature passed once: every rank
    raises (the gate check's outcome is exchanged whenever gate values were read)."""
    import torch.distributed as dist

    from sp_attention import build_sp_context
    ctx = build_sp_context(dist.new_group(list(range(world))), layout="contiguous")
    q, k, v = _qkv(T=6)
    lightning_attention(q, k, v, g=_g(T=6), ctx=ctx, backend="torch")        # remembered now
    bad = _g(T=6, value=0.3 if rank == 1 else -0.1)
    try:
        lightning_attention(q, k, v, g=bad, ctx=ctx, backend="torch")
    except ValueError as e:
        return str(e)
    return "no error"


def test_bad_gate_on_one_rank_raises_on_every_rank():
    from sp_attention.testing import run_distributed
    msgs = run_distributed(_one_rank_bad_gate, 2, timeout=120)
    assert "finite and <= 0" in msgs[1]
    assert "rank(s) [1] of the CP group rejected" in msgs[0] and "<= 0" in msgs[0]

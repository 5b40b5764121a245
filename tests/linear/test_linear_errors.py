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


@pytest.mark.parametrize("world,layout,expect", [
    (1, "contiguous", "ring"), (1, "zigzag", "ring"), (2, "contiguous", "ring"),
    (2, "zigzag", "allgather"), (8, "zigzag", "allgather"), (9, "zigzag", "blelloch"),
    (16, "contiguous", "allgather"), (17, "contiguous", "blelloch")])
def test_auto_picks_the_schedule_for_the_leaf_count(world, layout, expect):
    """`auto`: ring when there are at most 2 leaves (one hop), all-gather up to 16, else the tree."""
    from sp_attention.linear.attention import resolve_impl
    ctx = SPContext(object() if world > 1 else None, 0, world, (), layout)
    assert resolve_impl("auto", ctx) == expect
    assert resolve_impl("blelloch", ctx) == "blelloch"

"""SDPA's mixed-precision rule in both public ops (the library is its one home): under
``torch.autocast`` q, k, v are cast to the autocast dtype (HF's RoPE hands over fp32 q, k with
a bf16 v), the result equals the op on inputs cast by hand, bit for bit, and each input gets
its gradient in its own dtype; outside autocast, mismatched dtypes stay an error."""
import pytest
import torch

from sp_attention import context_parallel_attention, lightning_attention

SLOPES = torch.tensor([0.05, 0.4])


def _inputs(kv_heads):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 16, 2, 8, generator=g)
    k = torch.randn(2, 16, kv_heads, 8, generator=g)
    v = torch.randn(2, 16, kv_heads, 8, generator=g)
    return q, k, v.bfloat16()          # HF under autocast: q, k fp32 (RoPE), v bf16


OPS = {
    "softmax": (lambda q, k, v: context_parallel_attention(q, k, v, backend="math"), 1),
    "softmax packed": (lambda q, k, v: context_parallel_attention(
        q, k, v, backend="math", cu_seqlens=torch.tensor([0, 5, 16], dtype=torch.int32)), 1),
    "linear": (lambda q, k, v: lightning_attention(q, k, v, SLOPES, backend="torch",
                                                   scale=0.3), 2),
    "linear packed": (lambda q, k, v: lightning_attention(
        q[:1], k[:1], v[:1], SLOPES, backend="torch", scale=0.3,
        cu_seqlens=torch.tensor([0, 5, 16], dtype=torch.int32)), 2),
}


@pytest.mark.parametrize("backward_inside", [False, True])
@pytest.mark.parametrize("name", sorted(OPS))
def test_autocast_runs_in_the_autocast_dtype(name, backward_inside):
    """Also with the backward called inside the autocast region (as a training loop that wraps
    its whole step does): the backward's merges and states keep the op's own dtypes."""
    op, kv_heads = OPS[name]
    q, k, v = (t.requires_grad_(True) for t in _inputs(kv_heads))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = op(q, k, v)
        if backward_inside:
            out.float().square().sum().backward()
    assert out.dtype == torch.bfloat16
    if not backward_inside:
        out.float().square().sum().backward()
    assert (q.grad.dtype, k.grad.dtype, v.grad.dtype) == (torch.float32, torch.float32,
                                                         torch.bfloat16)
    # the same as casting by hand outside autocast, exactly
    qb, kb, vb = (t.detach().bfloat16().requires_grad_(True) for t in (q, k, v))
    ref = op(qb, kb, vb)
    ref.float().square().sum().backward()
    assert torch.equal(out, ref)
    for got, want in ((q.grad, qb.grad), (k.grad, kb.grad), (v.grad, vb.grad)):
        assert torch.equal(got, want.to(got.dtype))


@pytest.mark.parametrize("name", sorted(OPS))
def test_mismatched_dtypes_outside_autocast_raise(name):
    op, kv_heads = OPS[name]
    with pytest.raises(ValueError, match="dtypes differ.*autocast"):
        op(*_inputs(kv_heads))

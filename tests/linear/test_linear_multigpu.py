"""2-GPU (NCCL) test of every linear-attention scan schedule against the single-GPU result."""
import pytest
import torch

from sp_attention import CPGroupOptions, build_sp_context, new_cp_group, shard_sequence
from sp_attention.linear import lightning_attention
from sp_attention.testing import rel_rms, run_distributed

pytestmark = pytest.mark.multigpu


def _check(rank, world):
    import torch.distributed as dist
    dev = torch.device("cuda", torch.cuda.current_device())
    B, T, H, K = 1, 2 * world * 1000, 4, 64          # leaves of 1000 tokens: not a multiple of 64
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do = (torch.randn(B, T, H, K, device=dev, generator=g) * 0.2 for _ in range(4))
    slopes = torch.tensor([0.0, 0.01, 0.3, 50.0], device=dev)
    ref_in = [t.to(torch.bfloat16).requires_grad_(True) for t in (q, k, v)]
    ref = lightning_attention(*ref_in, slopes)                       # single GPU, bf16 fla
    ref.backward(do.to(torch.bfloat16))
    fp32_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
    exact = lightning_attention(*fp32_in, slopes, backend="torch")   # fp32 reference
    exact.backward(do)
    out, kept = {}, {}
    ranks = list(range(world))
    # a CP group with NCCL options (high-priority stream, CTA bound): the same numbers
    hp = new_cp_group(ranks, CPGroupOptions(high_priority_stream=True, max_ctas=8))
    for layout, group in (("zigzag", dist.new_group(ranks)), ("contiguous", dist.new_group(ranks)),
                          ("contiguous-hp", hp)):
        ctx = build_sp_context(group, layout=layout.split("-")[0])
        for impl in ("blelloch", "allgather", "ring"):
            loc = [shard_sequence(t.detach(), ctx, 1).clone().requires_grad_(True) for t in ref_in]
            o = lightning_attention(*loc, slopes, ctx=ctx, impl=impl)
            o.backward(shard_sequence(do.to(torch.bfloat16), ctx, 1))
            got = [o.detach()] + [t.grad for t in loc]
            if layout == "contiguous-hp":
                assert all(rel_rms(a, b) < 1e-6 for a, b in zip(got, kept[impl])), impl
                continue
            kept[impl] = got
            for name, got, single, fp32 in zip(
                    ("o", "dq", "dk", "dv"), (o, *(t.grad for t in loc)),
                    (ref, *(t.grad for t in ref_in)), (exact, *(t.grad for t in fp32_in))):
                e_single = rel_rms(got, shard_sequence(single, ctx, 1))
                e_fp32 = rel_rms(got, shard_sequence(fp32, ctx, 1))
                out[f"{layout} {impl} {name}"] = (e_single, e_fp32)
                assert torch.isfinite(got).all(), (layout, impl, name)
                assert e_fp32 < 5e-3, (layout, impl, name, e_fp32)
                assert e_single < 5e-3, (layout, impl, name, e_single)
    return out


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (device machine)")
def test_schedules_on_two_gpus_match_single_gpu():
    res = run_distributed(_check, 2, timeout=600, backend="nccl")
    for key, (e1, e2) in sorted(res[0].items()):
        print(f"{key:<28} vs single-GPU bf16 {e1:.2e}  vs fp32 {e2:.2e}")

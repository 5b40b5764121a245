"""The first errors a user meets, on gloo: every rank raises a clear error, nothing hangs.

One spawn of two ranks runs every case in order (the group stays usable after each error,
because the check's one all-gather completes and the op's own collectives never start):
a rank outside the group, a process group passed as ``ctx``, ``[B, H, T, D]`` tensors, ranks
whose calls differ (local length, impl, softmax scale, tuning), a local input error only one
rank sees, and that a checked signature is not checked again (a rank repeating it alone
returns at once instead of waiting for a peer).
"""
import pytest
import torch

from sp_attention import (LinearTuning, SoftmaxTuning, SPContext, build_sp_context,
                          context_parallel_attention, lightning_attention)
from sp_attention.testing import run_distributed

SLOPES = torch.tensor([0.1, 0.2], dtype=torch.float64)


def _outcome(fn):
    try:
        fn()
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


def _lin(T, **kw):
    q = torch.randn(1, T, 2, 4, dtype=torch.float64)
    return lambda: lightning_attention(q, q, q[..., :3], SLOPES, backend="torch", **kw)


def _soft(T, **kw):
    q, k = torch.randn(1, T, 4, 4, dtype=torch.float64), torch.randn(1, T, 2, 4, dtype=torch.float64)
    return lambda: context_parallel_attention(q, k, k, backend="math", **kw)


def _cases(rank, world):
    import torch.distributed as dist

    from sp_attention.call_check import agree_across_ranks
    out = {}
    torch.manual_seed(0)
    solo = dist.new_group([0])          # every rank calls new_group; rank 1 is outside it
    out["non_member"] = _outcome(lambda: build_sp_context(solo))
    group = dist.new_group(list(range(world)))
    out["group_as_ctx"] = _outcome(lambda: lightning_attention(*(torch.zeros(1, 4, 2, 4),) * 3,
                                                               SLOPES, ctx=group))
    ctx = build_sp_context(group, layout="zigzag")
    out["agree"] = _outcome(_lin(8, ctx=ctx))
    out["agree_again"] = _outcome(_lin(8, ctx=ctx))
    # Each mismatch below is a call signature new to *both* ranks (its own scale): a rank
    # repeating an already-checked call while the other changes it is the documented limit.
    # A different local length on rank 1 only:
    out["t_local"] = _outcome(_lin(8 if rank == 0 else 12, ctx=ctx, scale=0.9))
    out["impl"] = _outcome(_lin(8, ctx=ctx, scale=0.8, impl="ring" if rank else "blelloch"))
    out["tuning"] = _outcome(_lin(8, ctx=ctx, scale=0.7,
                                  tuning=LinearTuning(concurrent_recurrences=rank == 0)))
    # a local input error on rank 1 only (7 tokens cannot split into zigzag's 2 chunks)
    out["local_error"] = _outcome(_lin(8 if rank == 0 else 7, ctx=ctx, scale=0.6))
    # [B, H, T, D] passed on both ranks: each names the layout mistake
    q = torch.randn(1, 2, 8, 4, dtype=torch.float64)
    out["bhtd_linear"] = _outcome(lambda: lightning_attention(q, q, q, SLOPES, ctx=ctx,
                                                              backend="torch"))
    qs, ks = torch.randn(1, 4, 8, 4, dtype=torch.float64), torch.randn(1, 2, 8, 4, dtype=torch.float64)
    out["bhtd_softmax"] = _outcome(lambda: context_parallel_attention(qs, ks, ks, ctx=ctx))
    out["softmax_agree"] = _outcome(_soft(8, ctx=ctx))
    out["softmax_scale"] = _outcome(_soft(8, ctx=ctx, softmax_scale=0.5 if rank else 0.4))
    out["softmax_local_error"] = _outcome(_soft(8, ctx=ctx, softmax_scale=0.3, preset="ring_ag",
                                                heads_k_stride=2 if rank else 3))
    out["softmax_every_call"] = _outcome(lambda: [_soft(8, ctx=ctx, tuning=SoftmaxTuning(
        check_every_call=True))() for _ in range(2)])
    # a checked signature costs nothing: rank 1 repeats it alone and returns at once (any
    # collective here would wait for rank 0 until the harness times out)
    sig = (("probe", 1),)
    agree_across_ranks(ctx, "probe", sig, None)
    if rank == 1:
        agree_across_ranks(ctx, "probe", sig, None)
    out["still_usable"] = _outcome(_lin(8, ctx=ctx))
    return out


def test_every_rank_raises_and_nothing_hangs():
    res = run_distributed(_cases, 2, timeout=240)
    r0, r1 = res
    assert r0["non_member"] == "ok"
    assert "not a member" in r1["non_member"] and "NON_GROUP_MEMBER" in r1["non_member"]
    for r in res:
        assert "build_sp_context(group" in r["group_as_ctx"]
        for key in ("agree", "agree_again", "softmax_agree", "softmax_every_call",
                    "still_usable"):
            assert r[key] == "ok", (key, r[key])
        for key, what in (("t_local", "(1, 12, 2, 4)"), ("impl", "impl=ring"),
                          ("tuning", "LinearTuning(concurrent_recurrences=True)"),
                          ("softmax_scale", "softmax_scale=0.5")):
            assert r[key].startswith("ValueError") and "different shapes or options" in r[key], \
                (key, r[key])
            assert what in r[key], (key, r[key])
        assert "[B, H, T, D]" in r["bhtd_linear"] and "transpose(1, 2)" in r["bhtd_linear"]
        assert "[B, H, T, D]" in r["bhtd_softmax"]
    # the rank with the bad input raises its own error; the other one quotes it
    assert "multiple of 2 for layout 'zigzag'" in r1["local_error"]
    assert "rank(s) [1]" in r0["local_error"] and "multiple of 2" in r0["local_error"]
    assert "heads_k_stride=3" in r0["softmax_local_error"]
    assert "rank(s) [0]" in r1["softmax_local_error"]


def test_sdpa_layout_hints_and_padding_helper_single_device():
    single = SPContext(None, 0, 1, (0,), "zigzag")
    q = torch.randn(1, 2, 8, 4, dtype=torch.float64)            # [B, H, T, D] with H = 2
    with pytest.raises(ValueError, match=r"looks like \[B, H, T, D\]"):
        lightning_attention(q, q, q, SLOPES, ctx=single, backend="torch")
    q = torch.randn(1, 3, 8, 4, dtype=torch.float64)            # MHA, T = 3 cannot split
    with pytest.raises(ValueError, match=r"sp_attention.pad_for_layout.*\[B, H, T, D\]"):
        context_parallel_attention(q, q, q, ctx=single)
    with pytest.raises(ValueError, match="sp_attention.pad_for_layout"):
        from sp_attention.planning.layout import chunk_size
        chunk_size(7, 2, "zigzag")
    with pytest.raises(TypeError, match="not a member"):
        lightning_attention(q, q, q, SLOPES, ctx=-100)


def test_tuning_is_validated():
    with pytest.raises(ValueError, match="side_stream_priority"):
        LinearTuning(side_stream_priority=1)
    with pytest.raises(TypeError, match="static_zero_paths"):
        LinearTuning(static_zero_paths=1)
    with pytest.raises(ValueError, match=r"backward_schedule must be one of \('auto', "):
        LinearTuning(backward_schedule="sum_beside")
    with pytest.raises(ValueError, match=r"forward_schedule must be one of \('auto', "):
        LinearTuning(forward_schedule="scan_first")
    with pytest.raises(ValueError, match="min_query_heads_per_call"):
        SoftmaxTuning(min_query_heads_per_call=0)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="a2a_head_chunks must be a positive int"):
            SoftmaxTuning(a2a_head_chunks=bad)
    with pytest.raises(ValueError, match=r"ring_backward_order must be one of \('auto', "):
        SoftmaxTuning(ring_backward_order="last")
    q = torch.zeros(1, 4, 2, 4, dtype=torch.float64)
    with pytest.raises(TypeError, match="LinearTuning"):
        lightning_attention(q, q, q, SLOPES, tuning=SoftmaxTuning())

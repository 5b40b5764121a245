"""``SoftmaxSchedule``: the one home of the softmax schedule knobs and their rules."""
import pytest
import torch

from sp_attention import SoftmaxSchedule, context_parallel_attention
from sp_attention.softmax import DEFAULT_PRESET, PRESETS


def test_presets_resolve_and_default_comes_from_one_constant():
    assert (SoftmaxSchedule().fwd, SoftmaxSchedule().bwd) == PRESETS[DEFAULT_PRESET]
    for name, (f, b) in PRESETS.items():
        s = SoftmaxSchedule(preset=name)
        assert (s.fwd, s.bwd) == (f, b)
        assert s.kwargs()["fwd"] == f and "preset" not in s.kwargs()
    assert SoftmaxSchedule(fwd="allgather").bwd == PRESETS[DEFAULT_PRESET][1]


@pytest.mark.parametrize("kwargs,match", [
    (dict(preset="fast"), "unknown preset"),
    (dict(preset="ring", bwd="allgather"), "drop one of the two"),
    (dict(fwd="tree"), "unknown forward schedule"),
    (dict(heads_k_stride=2), "only applies to the all-gather schedules"),
    (dict(preset="ring_ag", heads_k_stride=0), "positive divisor"),
    (dict(preset="ring_ag", heads_k_stride=True), "positive divisor"),
    (dict(preset="ag_ring", heads_k_stride=2, bwd_head_first_stride=1), "only applies to"),
    (dict(backend="cuda"), "unknown kernel backend"),
])
def test_bad_schedules_raise_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SoftmaxSchedule(**kwargs)


def test_head_rules_need_the_local_kv_heads():
    s = SoftmaxSchedule(preset="ring_ag", heads_k_stride=4, bwd_head_first_stride=3,
                        bwd_head_last_stride=2)
    with pytest.raises(ValueError, match="must be <= 4"):
        s.local_stride(4, default=1)
    with pytest.raises(ValueError, match="positive divisor of the 6"):
        s.local_stride(6, default=1)
    assert SoftmaxSchedule(preset="allgather").local_stride(8, default=2) == 2


def test_kwargs_drive_the_op():
    q, k = torch.randn(1, 8, 4, 4, dtype=torch.float64), torch.randn(1, 8, 2, 4,
                                                                   dtype=torch.float64)
    s = SoftmaxSchedule(preset="allgather", heads_k_stride=1, backend="math")
    ref = context_parallel_attention(q, k, k, fwd="allgather", bwd="allgather",
                                     heads_k_stride=1, backend="math")
    assert torch.equal(context_parallel_attention(q, k, k, **s.kwargs()), ref)


def test_auto_preset_resolves_to_the_cost_models_pair():
    """preset="auto": fwd/bwd stay open until the op sees its tensors; kwargs pass "auto" on;
    resolve() keeps the head strides only where the pick runs the all-gather they describe;
    naming fwd or bwd beside it raises."""
    s = SoftmaxSchedule(preset="auto", heads_k_stride=2, bwd_head_first_stride=1)
    assert s.is_auto and (s.fwd, s.bwd) == (None, None)
    assert s.kwargs()["preset"] == "auto" and "fwd" not in s.kwargs()
    assert s.resolve("ring") == SoftmaxSchedule(preset="ring")
    assert s.resolve("ring_ag") == SoftmaxSchedule(preset="ring_ag", heads_k_stride=2,
                                                   bwd_head_first_stride=1)
    assert s.resolve("ag_ring") == SoftmaxSchedule(preset="ag_ring", heads_k_stride=2)
    assert SoftmaxSchedule(preset="ring").resolve("allgather") == SoftmaxSchedule(preset="ring")
    with pytest.raises(ValueError, match="cost model choose fwd"):
        SoftmaxSchedule(preset="auto", fwd="ring")
    with pytest.raises(ValueError, match="positive divisor"):
        SoftmaxSchedule(preset="auto", heads_k_stride=0)


def test_auto_preset_runs_the_cost_models_pick(monkeypatch):
    """context_parallel_attention(preset="auto") runs the pair sp_attention.cost.auto returns
    (a fake two-rank context: the config is built before any collective): on CPU tensors the
    CPU rule's preset, on a GPU the cost model's pick."""
    from sp_attention import SPContext
    from sp_attention.cost import H200_NVLINK_IB400, Choice, auto, cpu_softmax_preset
    from sp_attention.softmax.attention import _config
    from sp_attention.tuning import SoftmaxTuning
    ctx = SPContext(object(), 0, 2, (0, 1), "zigzag")
    q, k = torch.zeros(1, 8, 4, 8, dtype=torch.float64), torch.zeros(1, 8, 2, 8,
                                                                     dtype=torch.float64)
    opts = dict(fwd=None, bwd=None, heads_k_stride=None, bwd_head_first_stride=None,
                bwd_head_last_stride=None, causal=True, softmax_scale=None, backend="math",
                return_lse=False, a2a_size=2)      # a2a_ring's groups of 2 (= P here)
    cfg = _config(q, k, k, ctx, SoftmaxTuning(), preset="auto", **opts)
    assert (cfg.fwd, cfg.bwd) == PRESETS[cpu_softmax_preset()] == PRESETS[DEFAULT_PRESET]
    monkeypatch.setattr(auto, "machine_for", lambda device: H200_NVLINK_IB400)
    for name, pair in PRESETS.items():
        monkeypatch.setattr(auto, "_softmax_choice", lambda *a, n=name, **kw: Choice(n, {}))
        cfg = _config(q, k, k, ctx, SoftmaxTuning(), preset="auto", **opts)
        assert (cfg.fwd, cfg.bwd) == pair
    one = SPContext(None, 0, 1, (0,), "zigzag")
    cfg = _config(q, k, k, one, SoftmaxTuning(), preset="auto", **opts)
    assert (cfg.fwd, cfg.bwd) == PRESETS[DEFAULT_PRESET]

"""Each default lives in one constant, read when it is needed: changing the default layout,
linear scan or softmax preset is a one-line change that every route follows. (The adapters'
routes are checked in their own tests against the same constants.)"""
import sp_attention.context as context
import sp_attention.linear.attention as linear
import sp_attention.softmax.schedule as schedule
from sp_attention import SoftmaxSchedule, SPContext, build_sp_context


def test_library_defaults_follow_their_constants(monkeypatch):
    assert build_sp_context(None).layout == context.DEFAULT_LAYOUT == "zigzag"
    monkeypatch.setattr(context, "DEFAULT_LAYOUT", "contiguous")
    assert build_sp_context(None).layout == "contiguous"
    assert SPContext(None, 0, 1).layout == "contiguous"

    ctx = build_sp_context(None)
    assert linear.resolve_impl(None, ctx) == linear.resolve_impl(linear.DEFAULT_IMPL, ctx)
    monkeypatch.setattr(linear, "DEFAULT_IMPL", "blelloch")
    assert linear.resolve_impl(None, ctx) == "blelloch"

    monkeypatch.setattr(schedule, "DEFAULT_PRESET", "ag_ring")
    s = SoftmaxSchedule()
    assert (s.fwd, s.bwd) == ("allgather", "ring")

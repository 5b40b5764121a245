"""The all-to-all presets in the cost model (sp_attention/cost/softmax_a2a.py), no processes: the
exchanges' bytes and the inner schedule add up as the module says, which presets ``auto`` may
consider, and the picks of the recorded 4 × H100 runs (ring at P = 2, all-to-all at P = 4,
8K per GPU: Ulysses 0.856 vs ring 0.807, issue 35)."""
import dataclasses

import pytest

from sp_attention.cost import SoftmaxShape, Topology, choose_softmax_preset, softmax_step
from sp_attention.cost.softmax_a2a import a2a_candidates, a2a_memory, a2a_step
from sp_attention.cost.machine import H200_NVLINK_IB400 as H200, Link

LLAMA = SoftmaxShape(1, 8192, 32, 8, 128)


def _bare(alpha=20.0, gbps=100.0) -> object:
    link = Link(alpha_p2p_us=alpha, p2p_gbps=gbps, alpha_coll_us=alpha, coll_gbps=gbps,
                step_us=0.0)
    k = dataclasses.replace(H200.kernels, op_us=0.0, mem_gbps=1e12)
    return dataclasses.replace(H200, kernels=k, intra=link, inter=link)


def test_candidates():
    assert a2a_candidates(LLAMA, 4) == ("a2a",)
    assert a2a_candidates(LLAMA, 4, 2) == ("a2a", "a2a_ring")
    assert a2a_candidates(LLAMA, 3, 3) == ()                 # 32 heads do not split over 3
    assert a2a_candidates(LLAMA, 1) == ()
    assert a2a_candidates(LLAMA, 8, 8) == ("a2a",)           # U = P is a2a itself


@pytest.mark.parametrize("P,U", [(2, None), (4, None), (8, None), (8, 2), (8, 4)])
def test_exchanges_plus_inner_schedule(P, U):
    m = _bare()
    U_ = P if U is None else U
    t = a2a_step(LLAMA, P, "zigzag", m, size=U, chunks=1)
    s = LLAMA
    inner = SoftmaxShape(1, U_ * s.T_local, s.H // U_, max(1, s.Hkv // U_), s.D)
    ring = softmax_step(inner, P // U_, "zigzag", "ring", "ring", m)
    rows = s.B * s.T_local * s.D * s.itemsize
    q, kv = rows * s.H, rows * 2 * max(U_, s.Hkv)     # K/V: Hkv heads, or one per position

    def x(nbytes):
        return 20e-3 + (U_ - 1) / U_ * nbytes / 100e9 * 1e3
    assert t.fwd_ms == pytest.approx(ring.fwd_ms + x(kv) + 2 * x(q))
    assert t.bwd_ms == pytest.approx(ring.bwd_ms + x(kv) + 2 * x(q))
    assert t.compute_ms == pytest.approx(ring.compute_ms)
    assert a2a_memory(LLAMA, P, "zigzag", m, U)["peak"] > 0


@pytest.mark.parametrize("P,C", [(2, 2), (4, 2), (4, 4), (8, 1)])
def test_head_chunks_hide_the_middle_exchanges(P, C):
    """C chunks: the first chunk's inputs and the last one's output in the open, the middle
    ones only where they outlast the kernel (module doc), C · alpha per exchange."""
    s = LLAMA
    rows = s.B * s.T_local * s.D * s.itemsize
    q, kv = rows * s.H, rows * 2 * max(P, s.Hkv)
    ring = softmax_step(SoftmaxShape(1, P * s.T_local, s.H // P, max(1, s.Hkv // P), s.D), 1,
                        "zigzag", "ring", "ring", _bare())
    for gbps in (100.0, 1.0):      # NVLink-like: hidden; a slow link: the wire shows
        m = _bare(gbps=gbps)
        t = a2a_step(s, P, "zigzag", m, chunks=C)
        w = C * (3 * 20e-3) + (P - 1) / P * (kv + 2 * q) / (gbps * 1e9) * 1e3
        assert t.fwd_ms == pytest.approx(w / C + max(ring.fwd_ms, w * (C - 1) / C))
    assert a2a_step(s, 4, "zigzag", _bare()) == a2a_step(s, 4, "zigzag", _bare(), chunks=1)
    assert a2a_step(s, 8, "zigzag", _bare(), size=4) == a2a_step(     # the default: one chunk
        s, 8, "zigzag", _bare(), size=4, chunks=1)
    with pytest.raises(ValueError, match="a2a_head_chunks=3"):
        a2a_step(s, 4, "zigzag", _bare(), chunks=3)


def test_auto_picks_as_measured_on_four_h100():
    assert choose_softmax_preset(LLAMA, 2, "zigzag", H200).name == "ring"
    four = choose_softmax_preset(LLAMA, 4, "zigzag", H200, a2a_size=2)
    assert four.name == "a2a" and {"a2a", "a2a_ring"} <= set(four.predicted)
    # across two nodes of 4 the all-to-all stays inside a node in a2a_ring
    eight = choose_softmax_preset(LLAMA, 8, "zigzag", H200, Topology.packed(8, 4), a2a_size=4)
    assert eight.predicted["a2a_ring"].total_ms < eight.predicted["a2a"].total_ms

"""The cost model (pure functions, no process group): monotonic in P and bytes, crossovers where
the formulas put them, the decision functions and the CPU rule, the calibration file, the
probe's fits and their refusal of implausible figures, and the report on synthetic rows."""
import dataclasses
import json
import logging
import math

import pytest

from sp_attention import calibrate, cost
from sp_attention.context import SPContext
from sp_attention.cost import (H200_NVLINK_IB400, Kernels, Link, LinearShape, Machine,
                               SoftmaxShape, Topology, auto, choose_linear_scan,
                               choose_softmax_preset, linear_memory, linear_scan_ms, linear_step,
                               load_machine, machine_from_dict, save_machine, softmax_memory,
                               softmax_step)
from sp_attention.cost import fit, machine, plausible
from sp_attention.cost.softmax_a2a import A2A_PRESETS, a2a_step
from sp_attention.cost.common import softmax_kernel_ms
from sp_attention.planning.schedules import DEFAULT_PRESET, LINEAR_SCANS, PRESETS

H200 = H200_NVLINK_IB400
H100 = "NVIDIA H100 80GB HBM3"
LIN = LinearShape(1, 8192, 16, 128, 128)
SOFT = SoftmaxShape(1, 8192, 32, 8, 128)


def _bare(alpha_p2p=50.0, alpha_coll=20.0, step=0.0, gbps=100.0, overlap=0.0) -> Machine:
    """Links only: no combine, fold or call costs, so scan times are the formulas' own."""
    link = Link(alpha_p2p_us=alpha_p2p, p2p_gbps=gbps, alpha_coll_us=alpha_coll,
                coll_gbps=gbps, step_us=step)
    k = dataclasses.replace(H200.kernels, op_us=0.0, mem_gbps=1e12, linear_call_ms=0.0,
                            softmax_call_ms=0.0, softmax_ag_call_fwd_ms=0.0,
                            softmax_ag_call_bwd_ms=0.0, softmax_ag_rate=1.0)
    return dataclasses.replace(H200, kernels=k, intra=link, inter=link, overlap_cost=overlap)


def test_public_api_pinned():
    assert cost.__all__ == [
        "LinearShape", "SoftmaxShape", "Topology", "StepTime", "Choice", "linear_flops",
        "softmax_flops", "linear_scan_ms", "linear_step", "softmax_step",
        "choose_linear_scan", "choose_softmax_preset", "cpu_linear_scan",
        "cpu_softmax_preset", "log_choice", "cp_efficiency", "linear_memory",
        "softmax_memory", "rank_memory", "Link", "Kernels", "Machine", "H200_NVLINK_IB400",
        "H200_NVLINK_4GPU", "H100_NVLINK_2GPU",
        "default_machine", "calibration_path", "load_machine", "save_machine",
        "machine_from_dict", "implausible"]
    assert machine.__all__ == ["Link", "Kernels", "Machine", "H200_NVLINK_IB400",
                               "H200_NVLINK_4GPU", "H100_NVLINK_2GPU",
                               "default_machine", "calibration_path", "load_machine",
                               "save_machine", "machine_from_dict"]
    assert auto.__all__ == ["machine_for", "topology_for", "auto_linear_scan",
                            "auto_softmax_preset", "softmax_preset_for_shape"]


def test_softmax_preset_from_sizes_is_the_calls_pick():
    """``softmax_preset_for_shape`` (a launcher planning before any tensor exists) picks what
    ``auto_softmax_preset`` picks for the call's tensors."""
    import torch
    from sp_attention.cost import H200_NVLINK_4GPU, SoftmaxShape

    class Ctx:
        world_size, layout, global_ranks = 4, "zigzag", (0, 1, 2, 3)
    for t in (8192, 32768):
        q, k = torch.zeros(1, t, 32, 128, dtype=torch.bfloat16), torch.zeros(1, t, 8, 128)
        from_call = auto.auto_softmax_preset(Ctx, q, k, machine=H200_NVLINK_4GPU)
        planned = auto.softmax_preset_for_shape(
            torch.device("cpu"), SoftmaxShape(1, t, 32, 8, 128, 2, True), 4, "zigzag",
            machine=H200_NVLINK_4GPU)
        assert planned.name == from_call.name


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("schedule", LINEAR_SCANS)
def test_linear_monotonic_in_world_and_bytes(schedule, layout):
    # one node: every P (the zigzag tree over ranks: every even P — an odd P's clipped tree
    # puts a rank in more pairs of a round than the next even P's, ~1 % more); across nodes
    # of 8 (a clipped tree's rounds cross node edges differently for different P, so only
    # whole nodes compare): powers of two
    every = range(2, 41, 2) if (schedule, layout) == ("blelloch", "zigzag") else range(2, 41)
    for m, topo, Ps in ((H200, lambda P: None, every),
                        (H200, lambda P: Topology.packed(P, 8), [2 ** i for i in range(1, 11)])):
        prev = 0.0
        for P in Ps:
            t = linear_step(LIN, P, layout, schedule, m, topo(P)).total_ms
            assert t >= prev - 1e-12, (schedule, layout, P)
            prev = t
    prev = 0.0
    for kv in (16, 32, 64, 128, 256):          # state bytes grow with K·V
        t = linear_scan_ms(schedule, LinearShape(1, 8192, 16, kv, kv), 8, layout, H200)
        assert t > prev
        prev = t


@pytest.mark.parametrize("preset", [p for p in PRESETS if p not in A2A_PRESETS])
def test_softmax_monotonic_in_world_and_bytes(preset):
    f, b = PRESETS[preset]
    for topo in (lambda P: None, lambda P: Topology.packed(P, 8)):
        prev = 0.0
        for P in (2, 3, 4, 6, 8, 12, 16, 32):
            t = softmax_step(SOFT, P, "zigzag", f, b, H200, topo(P)).total_ms
            assert t > prev, (preset, P)
            prev = t
    prev = 0.0
    for T in (1024, 2048, 4096, 8192, 16384):
        t = softmax_step(SoftmaxShape(1, T, 32, 8, 128), 4, "zigzag", f, b, H200).total_ms
        assert t > prev
        prev = t


def test_linear_scan_formulas_exact():
    """With free combines: ring = hops·(α + S/β), tree = rounds·(α + S/β) (contiguous: every
    round crosses ranks; 2⌈log2 P⌉ − 1 rounds: the exclusive scan's dead top up-sweep round
    left out), all-gather = α + (P−2)·step + (P−1)·S/β."""
    m = _bare(alpha_p2p=50.0, alpha_coll=20.0, step=3.0, gbps=100.0)
    S = LIN.state_bytes
    hop = 50e-3 + S / 100e9 * 1e3
    for P in (2, 3, 5, 8, 13, 64):
        depth = math.ceil(math.log2(P))
        assert linear_scan_ms("ring", LIN, P, "contiguous", m) == pytest.approx((P - 1) * hop)
        assert linear_scan_ms("ring", LIN, P, "zigzag", m) == pytest.approx(2 * (P - 1) * hop)
        assert linear_scan_ms("blelloch", LIN, P, "contiguous", m) == pytest.approx(
            (2 * depth - 1) * hop)
        coll = 20e-3 + (P - 2) * 3e-3 + (P - 1) * S / 100e9 * 1e3
        assert linear_scan_ms("allgather", LIN, P, "contiguous", m) == pytest.approx(coll)


def test_linear_crossovers_where_the_formulas_put_them():
    """ring vs tree: P − 1 hops against 2⌈log2 P⌉ − 1 rounds: the tree wins from P = 7 on
    (tie at 6); ring vs all-gather: the P* solving
    (P−1)(α_p + S/β) = α_c + (P−2)·s + (P−1)·S/β."""
    m = _bare(alpha_p2p=50.0, alpha_coll=1000.0, step=0.0, gbps=1e6)
    for P in range(2, 40):
        ring = linear_scan_ms("ring", LIN, P, "contiguous", m)
        tree = linear_scan_ms("blelloch", LIN, P, "contiguous", m)
        d = math.ceil(math.log2(P))
        assert (tree < ring) == (2 * d - 1 < P - 1), P
    # all-gather: α_c = 1000 µs vs (P − 1)·50 µs hops: crossover at P − 1 = 20
    for P in range(2, 40):
        choice = choose_linear_scan(LIN, P, "contiguous", m, candidates=("ring", "allgather"))
        assert choice.name == ("ring" if P - 1 < 20 else "allgather"), P


def test_softmax_ring_hides_hops_until_transfer_exceeds_compute():
    """No overlap cost: the ring forward costs its kernels while a K/V hop is shorter than a
    step's compute, and P − 1 hops when the hop is longer (the overlap rule)."""
    shape = SoftmaxShape(1, 4096, 32, 8, 128)
    kernels = softmax_step(shape, 4, "zigzag", "ring", "ring", _bare(0.0, gbps=1e12)).fwd_ms
    per_step = kernels / 4                         # zigzag: every step the same work
    for gbps, hidden in ((1000.0, True), (0.5, False)):
        m = _bare(alpha_p2p=10.0, gbps=gbps)
        t = softmax_step(shape, 4, "zigzag", "ring", "ring", m)
        hop = m.intra.p2p_ms(shape.kv_bytes)
        assert (hop < per_step) == hidden
        want = kernels if hidden else per_step + 3 * hop
        assert t.fwd_ms == pytest.approx(want, rel=1e-6)


def test_overlap_cost_charges_bytes_not_latency():
    m0, m3 = _bare(alpha_p2p=10.0, gbps=350.0), _bare(alpha_p2p=10.0, gbps=350.0, overlap=3.0)
    a = softmax_step(SOFT, 2, "zigzag", "ring", "ring", m0)
    b = softmax_step(SOFT, 2, "zigzag", "ring", "ring", m3)
    wire = SOFT.kv_bytes / 350e9 * 1e3
    assert b.fwd_ms - a.fwd_ms == pytest.approx(3.0 * wire, rel=1e-6)
    # an inter-node hop's bytes cost the kernels what they cost at the node's own rate
    slow = dataclasses.replace(m3, inter=dataclasses.replace(m3.inter, p2p_gbps=40.0))
    c = softmax_step(SOFT, 16, "zigzag", "ring", "ring", slow, Topology.packed(16, 8))
    d = softmax_step(SOFT, 16, "zigzag", "ring", "ring", m3, Topology.packed(16, 8))
    assert c.compute_ms == pytest.approx(d.compute_ms)


def test_topology_and_inter_node_links():
    topo = Topology.of_ranks([0, 2, 4, 6, 8, 10, 12, 14], 8)     # TP 2: 4 CP ranks per node
    assert topo.nodes == (0, 0, 0, 0, 1, 1, 1, 1) and topo.spans_nodes
    one = linear_step(LIN, 8, "zigzag", "allgather", H200)
    two = linear_step(LIN, 8, "zigzag", "allgather", H200, topo)
    assert two.total_ms > one.total_ms
    with pytest.raises(ValueError, match="topology has 4 ranks"):
        linear_step(LIN, 8, "zigzag", "ring", H200, Topology.single_node(4))


def test_choices_are_the_cheapest_and_deterministic():
    for P in (2, 4, 8, 16, 64):
        c = choose_linear_scan(LIN, P, "zigzag", H200, Topology.packed(P, 8))
        assert c.name == min(c.predicted, key=lambda n: c.predicted[n].total_ms)
        assert set(c.predicted) == set(LINEAR_SCANS)
        s = choose_softmax_preset(SOFT, P, "zigzag", H200, Topology.packed(P, 8))
        assert s.name == min(s.predicted, key=lambda n: s.predicted[n].total_ms)
    m = _bare()    # world 1: no scan at all, every schedule ties -> the fixed tie order
    assert choose_linear_scan(LIN, 1, "contiguous", m).name == "allgather"
    # the picks measured fastest on 2 x H200
    assert choose_softmax_preset(SOFT, 2, "zigzag", H200).name == "ring"
    assert choose_linear_scan(LinearShape(1, 32768, 16, 128, 128), 2, "contiguous",
                              H200).name == "allgather"


def test_softmax_choice_respects_memory_limit():
    big = SoftmaxShape(1, 32768, 32, 8, 128)
    need = {n: softmax_memory(big, 64, "zigzag", *PRESETS[n], H200)["peak"]
            for n in PRESETS if n not in A2A_PRESETS}
    limit = (need["ring"] + max(need.values())) / 2
    c = choose_softmax_preset(big, 64, "zigzag", H200, memory_limit_bytes=limit,
                              candidates=tuple(need))
    assert all(need[n] <= limit for n in c.predicted)
    assert set(c.excluded) == {n for n in need if need[n] > limit} and c.excluded
    assert "excluded" in c.describe()
    with pytest.raises(ValueError, match="no softmax preset fits"):
        choose_softmax_preset(big, 64, "zigzag", H200, memory_limit_bytes=1.0)


def test_log_choice_once_per_shape(caplog):
    m = H200
    c = choose_linear_scan(LIN, 4, "zigzag", m)
    key = ("test", object())
    with caplog.at_level(logging.INFO, logger="sp_attention.cost"):
        assert cost.log_choice("linear scan", key, c, m)
        assert not cost.log_choice("linear scan", key, c, m)
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and c.name in msgs[0] and "blelloch" in msgs[0]


def test_memory_model_matches_the_recorded_h200_peaks():
    """fla's fwd + bwd at 32K, H 16, K = V 128, bf16 measured 1536 MiB (o, fp32 h and dh,
    dq/dk/dv); a zigzag P = 2 ring rank's softmax fwd + bwd at 8K measured 401 MiB."""
    mem = linear_memory(LinearShape(1, 32768, 16, 128, 128), 1, "contiguous", "ring")
    assert mem["o"] + mem["h"] + mem["dh"] + mem["dq_dk_dv"] == 1536 * 2 ** 20
    sm = softmax_memory(SOFT, 2, "zigzag", "ring", "ring", H200)
    assert sm["peak"] == pytest.approx(401 * 2 ** 20, rel=0.02)
    # the all-gather buffers grow with P, the ring's do not
    ag = [softmax_memory(SOFT, P, "zigzag", "allgather", "allgather", H200)["peak"]
          for P in (2, 8, 64)]
    ring = [softmax_memory(SOFT, P, "zigzag", "ring", "ring", H200)["peak"] for P in (4, 8, 64)]
    assert ag[0] < ag[1] < ag[2] and ring[0] == ring[1] == ring[2]
    assert cost.rank_memory(sm["peak"], 10.0)["total"] == sm["peak"] + 10.0
    # a transient like the model's largest workspace: the peak takes the larger of the two
    assert cost.rank_memory(sm["peak"], {"total": 1e10, "workspace": 1.0})["total"] == (
        1e10 - 1.0 + sm["peak"])
    from sp_train.memory import ModelShape, StepShape, estimate_memory
    est = estimate_memory(ModelShape(4, 4096, 14336, 32, 8, 128256, "SSSS"),
                          StepShape(cp=2, seq_length=16384))
    r = cost.rank_memory(sm["peak"], est)
    assert r["total"] == est.total - est.workspace + max(est.workspace, sm["peak"])
    assert r["model"] == est.total




def test_softmax_calls_cost_per_schedule():
    """Ring: one call per step (zigzag), each at the call's fixed cost in each direction;
    all-gather: its own calls (one per local chunk and stride unit), not the ring's."""
    s = SoftmaxShape(1, 128, 8, 4, 32, 4)
    m = _bare(alpha_p2p=0.0, alpha_coll=0.0, gbps=1e9)
    m = dataclasses.replace(m, kernels=dataclasses.replace(
        m.kernels, softmax_call_ms=1.0, softmax_fwd_tflops=1e12, softmax_bwd_tflops=1e12))
    for P in (2, 4, 8):
        ring = softmax_step(s, P, "zigzag", "ring", "ring", m)
        assert ring.fwd_ms == pytest.approx(P * 1.0, rel=1e-6)
        assert ring.bwd_ms == pytest.approx(P * 1.0, rel=1e-6)
        ag = softmax_step(s, P, "zigzag", "allgather", "allgather", m, heads_k_stride=4)
        assert ag.fwd_ms == pytest.approx(2 * 1.0, rel=1e-6)
    with pytest.raises(ValueError, match="no formula"):
        softmax_step(s, 2, "zigzag", "a2a", "ring", m)


def test_allgather_attention_costs_its_own_calls():
    """The all-gather schedules make one call per local chunk against its prefix of keys
    (``gather_plan``): zigzag P = 2, rank 0 holds pieces 0 and 3 of 64 tokens, so its calls
    are 64 × 64 (causal) and 64 × 256 keys with the diagonal last (causal): the pairs kept."""
    m = _bare(alpha_p2p=0.0, alpha_coll=0.0, gbps=1e9)
    m = dataclasses.replace(m, kernels=dataclasses.replace(
        m.kernels, softmax_fwd_tflops=1.0, softmax_bwd_tflops=2.0))
    s = SoftmaxShape(1, 128, 8, 4, 32, 4)
    t = softmax_step(s, 2, "zigzag", "allgather", "allgather", m, heads_k_stride=4)
    work = cost.softmax_flops(1, 8, 64, 64, 32, True) + cost.softmax_flops(1, 8, 64, 256, 32,
                                                                           True)
    assert t.fwd_ms == pytest.approx(work / 1e9, rel=1e-6)
    f, b = softmax_kernel_ms(m, 1, 8, 64, 64, 32, True)
    keep = cost.softmax_flops(1, 8, 64, 64, 32, True)
    assert f == pytest.approx(keep / 1e9) and b == pytest.approx(2.5 * keep / 2e9)


# ----------------------------------------------------------------------------- CPU rule
@pytest.mark.parametrize("world,layout,want", [
    (2, "contiguous", "ring"), (3, "contiguous", "allgather"), (2, "zigzag", "allgather"),
    (8, "zigzag", "allgather"), (16, "contiguous", "allgather"), (9, "zigzag", "blelloch"),
    (17, "contiguous", "blelloch"), (64, "zigzag", "blelloch")])
def test_cpu_rule(world, layout, want, monkeypatch, caplog):
    """On CPU tensors `auto` runs the fixed rule (leaves: ≤ 2 ring, ≤ 16 allgather, beyond
    blelloch; softmax: the default preset), whatever the cost model would say, and logs it."""
    import torch
    assert cost.cpu_linear_scan(world, layout) == want
    ctx = SPContext(object(), 0, world, tuple(range(world)), layout)
    q = torch.zeros(1, 64, 2, 16)
    assert auto.machine_for(q.device) is None
    with caplog.at_level(logging.INFO, logger="sp_attention.cost"):
        assert auto.auto_linear_scan(ctx, q, q).name == want
        assert auto.auto_softmax_preset(ctx, q, q[:, :, :1]).name == DEFAULT_PRESET
    assert any("CPU rule" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr("sp_attention.planning.schedules.DEFAULT_PRESET", "ag_ring")
    assert cost.cpu_softmax_preset() == "ag_ring"          # read when asked
    with pytest.raises(ValueError, match="GPU model"):
        cost.default_machine("cpu")


def test_auto_helpers_on_a_gpu_machine(monkeypatch, caplog):
    """With a machine (a GPU's), `auto` is the cost model's pick for the call's shape."""
    import torch
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    ctx = SPContext(object(), 0, 4, (0, 1, 2, 3), "zigzag")
    q = torch.zeros(1, 4096, 16, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, 4096, 4, 128, dtype=torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="sp_attention.cost"):
        c = auto.auto_linear_scan(ctx, q, q, machine=H200)
        s = auto.auto_softmax_preset(ctx, q, k, machine=H200)
    topo = Topology((0, 0, 1, 1))                                   # LOCAL_WORLD_SIZE=2
    assert auto.topology_for(ctx) == topo
    assert c.name == choose_linear_scan(LinearShape(1, 4096, 16, 128, 128), 4, "zigzag", H200,
                                        topo).name
    assert s.name == choose_softmax_preset(SoftmaxShape(1, 4096, 16, 4, 128), 4, "zigzag",
                                           H200, topo).name
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert not auto.topology_for(ctx).spans_nodes
    assert any("auto linear scan" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------- calibration
def test_calibration_json_round_trip(tmp_path, monkeypatch):
    path = str(tmp_path / "sub" / "cal.json")
    m = dataclasses.replace(H200, name="x", device=H100,
                            kernels=dataclasses.replace(H200.kernels, linear_tflops=81.5))
    assert save_machine(m, path) == path
    assert load_machine(H100, path) == m
    # measured elsewhere: the built-in figures of that GPU, calibrated on this project's machines
    assert load_machine("NVIDIA H200", path) is cost.H200_NVLINK_4GPU
    assert cost.default_machine("NVIDIA H100 80GB HBM3") is cost.H100_NVLINK_2GPU
    assert not cost.implausible(cost.H200_NVLINK_4GPU)
    assert not cost.implausible(cost.H100_NVLINK_2GPU)
    with pytest.raises(ValueError, match="GPU model"):
        load_machine("cpu", path)
    monkeypatch.setenv("SP_ATTENTION_CALIBRATION", path)
    assert cost.calibration_path() == path and load_machine(H100) == m
    monkeypatch.delenv("SP_ATTENTION_CALIBRATION")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cost.calibration_path() == str(tmp_path / "sp_attention" / "calibration.json")
    # a calibration written before the CPU terms were dropped: read without them
    d = m.to_dict()
    d["kernels"].update(cores=None, msg_us=0.0, resume_us=0.0, softmax_mask=None)
    d.update(scan_hidden=True, links_world=2)
    assert machine_from_dict(d) == m
    d["kernels"]["bogus"] = 1
    with pytest.raises(ValueError, match="re-run"):
        machine_from_dict(d)
    # a file with figures no GPU can have is refused, naming them
    bad = dataclasses.replace(m, kernels=dataclasses.replace(m.kernels,
                                                             softmax_bwd_tflops=1e21))
    save_machine(bad, path)
    with pytest.raises(ValueError, match="softmax_bwd_tflops = 1e\\+21"):
        load_machine(H100, path)
    with open(path, "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="not a usable sp_attention calibration"):
        load_machine(H100, path)
    with pytest.raises(ValueError, match="gbps"):
        Link(1.0, 0.0, 1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="linear_fwd_share"):
        dataclasses.replace(H200.kernels, linear_fwd_share=1.5)


def test_plausibility_names_what_is_wrong():
    assert cost.implausible(H200) == []
    assert plausible.device_peak(H100).tflops == 989.0
    assert plausible.device_peak("NVIDIA GH200 480GB").mem_gbps == 4900.0
    assert plausible.device_peak("Some Future GPU") is plausible.UNKNOWN_PEAK
    k, links = dataclasses.asdict(H200.kernels), {"intra": dataclasses.asdict(H200.intra)}
    cases = [(dict(softmax_bwd_tflops=1e21), {}, "softmax_bwd_tflops = 1e+21 TFLOP/s is above "
                                                 "the NVIDIA H100 80GB HBM3's peak"),
             (dict(linear_tflops=1200.0), {}, "linear_tflops"),
             (dict(mem_gbps=9000.0), {}, "mem_gbps"),
             (dict(linear_call_ms=-0.5), {}, "linear_call_ms = -0.5 ms is negative"),
             (dict(linear_fwd_share=1.2), {}, "linear_fwd_share"),
             (dict(softmax_call_ms=math.nan), {}, "softmax_call_ms = nan is not a finite"),
             ({}, dict(alpha_p2p_us=-21.5), "alpha_p2p_us = -21.5 µs is negative"),
             ({}, dict(alpha_coll_us=5e4), "alpha_coll_us = 5e+04 µs is above any link"),
             ({}, dict(p2p_gbps=800.0), "p2p_gbps = 800 GB/s is above"),
             ({}, dict(coll_gbps=0.0), "coll_gbps = 0 GB/s is not positive")]
    for kern, link, want in cases:
        got = plausible.check_figures({**k, **kern}, {"intra": {**links["intra"], **link}},
                                      3.0, H100)
        assert len(got) == 1 and want in got[0], (kern, link, got)
    assert "overlap_cost" in plausible.check_figures(k, links, 25.0, H100)[0]
    assert plausible.check_figures({**k, "linear_tflops": 3000.0}, links, 3.0,
                                   "Some Future GPU") == []


def _kernel_rows(k: Kernels) -> list[dict]:
    """The kernel probe rows a GPU with kernels ``k`` would measure."""
    rows = []
    for T in (8192, 16384, 32768):
        flops = cost.linear_flops(LinearShape(1, T, 16, 128, 128))
        fb = k.linear_call_ms + flops / (k.linear_tflops * 1e9)
        rows.append(dict(what="linear", T=T, flops_fwd_bwd=flops, ms_fwd_bwd=fb,
                         ms_fwd=k.linear_fwd_share * fb))
    for T in (4096, 8192, 16384):
        f = cost.softmax_flops(1, 32, T, T, 128, True)
        ms_f = k.softmax_call_ms + f / (k.softmax_fwd_tflops * 1e9)
        rows.append(dict(what="softmax", B=1, T=T, H=32, Hkv=8, D=128, dtype="bfloat16",
                         flops_fwd=f, ms_fwd=ms_f,
                         ms_fwd_bwd=ms_f + k.softmax_call_ms + 2.5 * f / (k.softmax_bwd_tflops
                                                                          * 1e9)))
    rows.append(dict(what="memory", bytes_moved=3e9, ms=3e9 / (k.mem_gbps * 1e6),
                     op_ms=k.op_us * 1e-3))
    return rows


def _link_rows(link: Link, worlds=(2, 4)) -> list[dict]:
    rows = []
    for P in worlds:
        for n in (2 ** 20, 2 ** 23, 2 ** 25, 2 ** 27):
            rows.append(dict(what="p2p", world=P, bytes=n, bytes_moved=n, ms=link.p2p_ms(n)))
            rows.append(dict(what="all_gather", world=P, bytes=n, bytes_moved=(P - 1) * n,
                             ms=link.collective_ms(P, (P - 1) * n)))
    return rows


TRUTH = dataclasses.replace(
    H200, device=H100, overlap_cost=2.5,
    kernels=dataclasses.replace(H200.kernels, linear_tflops=60.0, linear_call_ms=0.08,
                                linear_fwd_share=0.25, softmax_fwd_tflops=500.0,
                                softmax_bwd_tflops=420.0, softmax_call_ms=0.03,
                                mem_gbps=2000.0, op_us=5.0, linear_rank_contiguous=1.1,
                                linear_rank_zigzag=1.05),
    intra=Link(alpha_p2p_us=40.0, p2p_gbps=300.0, alpha_coll_us=25.0, coll_gbps=200.0,
               step_us=4.0))


def _ring_row(m: Machine, P: int = 4) -> dict:
    shape = SoftmaxShape(1, 8192, 32, 8, 128)
    t = softmax_step(shape, P, "zigzag", "ring", "ring", m).total_ms
    return dict(what="softmax_ring", world=P, B=1, T_local=8192, H=32, Hkv=8, D=128,
                itemsize=2, ms_fwd_bwd=t)


def _step_rows(m: Machine, P: int = 4) -> list[dict]:
    """The CP steps the probe times: one softmax ring, one linear step per layout."""
    shape = LinearShape(1, 16384, 16, 128, 128)
    return [_ring_row(m, P)] + [
        dict(what="linear_step", world=P, layout=lay, scan="allgather", B=1, T_local=16384,
             H=16, K=128, V=128, itemsize=2, row_splits=rows,
             ms_fwd_bwd=linear_step(shape, P, lay, "allgather", m, row_splits=rows).total_ms)
        for lay, rows in (("contiguous", 1), ("zigzag", None))]


def test_rank_factor_follows_the_rows_a_rank_runs():
    """One row per rank reads the contiguous factor; zigzag's two leaves or a contiguous leaf
    split by the op's rule (B 1, H 16, K = V 128, ≥ 8K tokens: 2 rows) the other."""
    from sp_attention.cost.linear import rank_factor
    shape = LinearShape(1, 32768, 16, 128, 128)
    assert rank_factor(shape, 4, "contiguous") == "linear_rank_zigzag"
    assert rank_factor(shape, 4, "contiguous", requested=1) == "linear_rank_contiguous"
    assert rank_factor(shape, 4, "zigzag") == "linear_rank_zigzag"
    assert rank_factor(LinearShape(1, 4096, 16, 128, 128), 4, "contiguous") == \
        "linear_rank_contiguous"
    assert rank_factor(LinearShape(8, 32768, 16, 128, 128), 4, "contiguous") == \
        "linear_rank_contiguous"                    # B 8: the SMs are full with one row


def test_fits_recover_the_machine():
    """Rows a machine would measure give that machine back: α/β and the collective's step
    from P = 2 and 4, the kernels, the overlap cost from one ring step, a CP rank's kernel
    factors from one linear step per layout."""
    a, b = fit.fit_latency_rate([(x, 0.05 + x * 2e-9) for x in (2 ** 16, 2 ** 20, 2 ** 24)])
    assert a == pytest.approx(0.05) and b == pytest.approx(2e-9)
    link = fit.fit_link(_link_rows(TRUTH.intra), H200.intra)
    for f in ("alpha_p2p_us", "p2p_gbps", "alpha_coll_us", "coll_gbps", "step_us"):
        assert link[f] == pytest.approx(getattr(TRUTH.intra, f), rel=1e-6), f
    assert fit.fit_link(_link_rows(TRUTH.intra, (2,)), H200.intra)["step_us"] == 2.0
    m, problems = fit.fit_machine(H200, H100, _link_rows(TRUTH.intra),
                                  _kernel_rows(TRUTH.kernels), _step_rows(TRUTH))
    assert problems == [] and m.device == H100
    for f in ("linear_tflops", "linear_call_ms", "linear_fwd_share", "softmax_fwd_tflops",
              "softmax_bwd_tflops", "softmax_call_ms", "mem_gbps", "op_us",
              "linear_rank_contiguous", "linear_rank_zigzag"):
        assert getattr(m.kernels, f) == pytest.approx(getattr(TRUTH.kernels, f), rel=1e-6), f
    assert m.overlap_cost == pytest.approx(2.5, rel=1e-6)
    # a tiny negative intercept is noise (taken as 0); a large one is refused
    assert fit.fit_latency_rate([(1.0, 1.0 - 1e-4), (2.0, 2.0 - 1e-4)])[0] == 0.0
    assert fit.fit_latency_rate([(1.0, 0.5), (2.0, 1.5)])[0] == pytest.approx(-0.5)


def _refused(link_rows, kernel_rows, overlap_rows=()) -> list[str]:
    m, problems = fit.fit_machine(H200, H100, link_rows, kernel_rows, overlap_rows)
    assert (m is None) == bool(problems)
    return problems


def test_fit_refuses_implausible_figures():
    """A rate above the device's peak, a negative latency, a fwd + bwd no slower than its
    forward, a non-finite time: refused with a message naming each."""
    good_k, good_l = _kernel_rows(TRUTH.kernels), _link_rows(TRUTH.intra)
    assert _refused(good_l, good_k) == []
    fast = dataclasses.replace(TRUTH.kernels, softmax_bwd_tflops=5000.0)
    assert any("softmax_bwd_tflops" in p and "peak" in p
               for p in _refused(good_l, _kernel_rows(fast)))
    rows = [r for r in good_l if r["what"] != "p2p"]      # a hop's latency far below zero
    rows += [dict(what="p2p", world=2, bytes=n, bytes_moved=n, ms=-0.0215 + n / 300e6)
             for n in (2 ** 25, 2 ** 26, 2 ** 27)]
    assert any("alpha_p2p_us = -21.5 µs is negative" in p for p in _refused(rows, good_k))
    swapped = [dict(r, ms_fwd=r["ms_fwd_bwd"] * 1.1) if r["what"] == "linear" else r
               for r in good_k]
    assert any("no slower than its forward" in p for p in _refused(good_l, swapped))
    nan = [dict(r, ms=math.nan) if r["what"] == "memory" else r for r in good_k]
    assert any("not a positive time" in p for p in _refused(good_l, nan))
    huge = _ring_row(dataclasses.replace(TRUTH, overlap_cost=0.0))
    huge["ms_fwd_bwd"] *= 100
    assert any("overlap_cost" in p for p in _refused(good_l, good_k, [huge]))
    fast_step = _step_rows(TRUTH)
    fast_step[2]["ms_fwd_bwd"] = 0.01          # faster than any kernel work: factor 0
    assert any("linear_rank_zigzag = 0 is not positive" in p
               for p in _refused(good_l, good_k, fast_step))


def test_calibrate_writes_only_a_plausible_gpu_fit(tmp_path, capsys):
    """The probe's last step: an implausible fit exits 1 and writes nothing (neither the
    calibration nor the raw rows); a plausible one writes both. Without a GPU the probe
    explains that calibration is for GPUs and exits 2, writing nothing."""
    import argparse
    out, raw = tmp_path / "cal.json", tmp_path / "raw.jsonl"
    a = argparse.Namespace(out=str(out), jsonl=str(raw))
    bad = [dict(r, ms_fwd=r["ms_fwd_bwd"] * 2) if r["what"] == "softmax" else r
           for r in _kernel_rows(TRUTH.kernels)]
    with pytest.raises(SystemExit) as e:
        calibrate._finish(0, 4, (_link_rows(TRUTH.intra), bad, []), a, H100)
    assert e.value.code == 1 and not out.exists() and not raw.exists()
    assert "refused, nothing written" in capsys.readouterr().err
    m = calibrate._finish(0, 4, (_link_rows(TRUTH.intra), _kernel_rows(TRUTH.kernels),
                                 _step_rows(TRUTH)), a, H100)
    assert load_machine(H100, str(out)) == m and m.overlap_cost == pytest.approx(2.5)
    assert len(raw.read_text().splitlines()) == len(_kernel_rows(TRUTH.kernels)) + 16 + 3
    assert "links among [2, 4] ranks" in m.source
    out.unlink()
    with pytest.raises(SystemExit) as e:
        calibrate.main(["--out", str(out)])
    assert e.value.code == 2 and not out.exists()
    assert "calibration is for GPUs" in capsys.readouterr().err


_TINY = dict(sizes=(1024, 4096), ring=dict(T_local=32, H=4, Hkv=2, D=8),
             linear=dict(T_local=64, H=2, K=8, V=8),
             kernels={"linear": dict(B=1, H=2, K=8, T=(64, 128)),
                      "softmax": dict(B=1, H=4, Hkv=2, D=8, T=(32, 64)), "memory_elems": 4096})


def _dry_probe(rank: int, world: int):
    """The probe's every step on gloo at tiny shapes, each timing a call or two."""
    calibrate._DEV = "cpu"

    def fake_time(fn, iters=5, repeats=5, warmup=2, barrier=None):
        if barrier:
            barrier()
        fn()
        return 1.0 + rank
    calibrate.time_ms = fake_time
    return calibrate._probe_group(rank, world, _TINY)


def test_probe_dry_run_on_gloo():
    """What `torchrun -m sp_attention.calibrate` runs on the GPUs, run on CPU processes (the
    tensors on CPU, the timer faked): every rank enters the same groups and collectives, rank 0
    holds rows of every kind with the fields the fits read, and the fits run on them."""
    from sp_attention.testing import run_distributed
    rows = run_distributed(_dry_probe, 3, timeout=300)
    assert rows[1] == rows[2] == ([], [], [])
    links, kernels, steps = rows[0]
    assert calibrate.link_worlds(3) == [2, 3] and calibrate.link_worlds(4) == [2, 4]
    assert sorted((r["what"], r["world"], r["bytes"]) for r in links) == sorted(
        (w, P, n) for w in ("p2p", "all_gather") for P in (2, 3) for n in (1024, 4096))
    assert all(r["ms"] == 2.0 or r["world"] == 3 and r["ms"] == 3.0 for r in links)
    assert [r["what"] for r in kernels] == ["linear"] * 2 + ["softmax"] * 2 + ["memory"]
    assert [(r["what"], r.get("layout")) for r in steps] == [
        ("softmax_ring", None), ("linear_step", "contiguous"), ("linear_step", "zigzag")]
    assert all(r["world"] == 3 and r["ms_fwd_bwd"] == 3.0 for r in steps)
    fit.fit_machine(H200, H100, links, kernels, steps)        # runs (the fake times are no fit)


# ----------------------------------------------------------------------------- report
def _bench_rows(m: Machine, device: str = H100) -> list[dict]:
    """linear_cp / softmax_cp rows at P = 1, 2, 4 whose times are the model's own."""
    rows = []
    for P in (1, 2, 4):
        for layout in ("contiguous", "zigzag"):
            for scan in LINEAR_SCANS:
                t = linear_step(LinearShape(1, 8192, 16, 128, 128), P, layout, scan, m)
                rows.append(dict(bench="linear_cp", world=P, B=1, T_local=8192, H=16, K=128,
                                 V=128, dtype="bfloat16", impl=scan, layout=layout,
                                 timing="queued", ms_fwd_bwd=t.total_ms, device=device,
                                 grads="autograd.grad"))
        shape = SoftmaxShape(1, 8192, 32, 8, 128)
        for name, (f, b) in PRESETS.items():
            if name in A2A_PRESETS:       # the benchmark's names: "a2a", "a2a_ring U=2"
                if P == 1 or (name == "a2a_ring" and P < 4):
                    continue
                size = P if name == "a2a" else 2
                t = a2a_step(shape, P, "zigzag", m, None, size)
                impl = "a2a" if name == "a2a" else "a2a_ring U=2"
            else:
                t = softmax_step(shape, P, "zigzag", f, b, m)
                impl = f"{f}/{b}"
            extra = dict(a2a_chunks=1) if impl == "a2a" else {}     # the default, recorded
            rows.append(dict(bench="softmax_cp", world=P, B=1, T_local=8192, H=32, Hkv=8,
                             K=128, dtype="bfloat16", impl=impl, stride="default",
                             layout="zigzag", timing="queued", ms_fwd_bwd=t.total_ms,
                             device=device, **extra))
    rows.append(dict(rows[0], timing="eager", ms_fwd_bwd=1e3))       # another timing mode
    rows.append(dict(rows[1], device="cpu"))                         # no CPU model
    return rows


def test_report_on_synthetic_rows(tmp_path, capsys):
    """The report reads linear_cp / softmax_cp rows at P = 1, 2, 4 and a calibration: rows
    that are the calibration's own predictions give 0 error and `auto` at the best; a
    schedule made 20 % faster than predicted shows as the error and as auto's miss."""
    from benchmarks import report
    cal = tmp_path / "cal.json"
    save_machine(TRUTH, str(cal))
    rows = _bench_rows(TRUTH)
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = report.main([str(src), "--calibration", str(cal), "--out-dir", str(tmp_path),
                       "--no-projection"])
    assert len(out["points"]) == 3 * 6 + 4 + 5 + 6     # a2a from P = 2, a2a_ring U=2 at 4
    assert all(abs(p["error"]) < 1e-9 for p in out["points"])
    assert len(out["checks"]) == 3 * 3 and all(c["ok"] for c in out["checks"])
    assert out["summary"][-1] == "acceptance: PASS"
    text = capsys.readouterr().out
    assert "acceptance: PASS" in text and (tmp_path / "cost_report.md").exists()
    # the schedule auto does not pick at P = 4 linear zigzag, measured 20 % faster than best
    c = next(c for c in out["checks"] if (c["kind"], c["world"], c["layout"])
             == ("linear", 4, "zigzag"))
    best = min(r["ms_fwd_bwd"] for r in rows if r["bench"] == "linear_cp" and r["world"] == 4
               and r["layout"] == "zigzag" and r["timing"] == "queued")
    other = next(s for s in LINEAR_SCANS if s != c["pick"])
    for r in rows:
        if (r["bench"], r["world"], r["layout"], r["impl"]) == ("linear_cp", 4, "zigzag", other):
            r["ms_fwd_bwd"] = 0.8 * best
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = report.main([str(src), "--calibration", str(cal), "--out-dir", str(tmp_path)])
    c = next(c for c in out["checks"] if (c["kind"], c["world"], c["layout"])
             == ("linear", 4, "zigzag"))
    assert c["best"] == other and not c["ok"] and c["slower"] == pytest.approx(0.25)
    assert out["summary"][-1] == "acceptance: FAIL"
    assert "Projection" in (tmp_path / "cost_report.md").read_text()
    with pytest.raises(SystemExit):
        report.main([str(src), "--calibration", str(cal), "--out-dir", str(tmp_path),
                     "--no-projection", "--strict"])


def test_report_adds_the_gradient_accumulation_of_older_linear_rows():
    """linear_cp rows without ``grads: autograd.grad`` timed ``o.backward(do)`` on leaf q, k,
    v: three ``.grad`` additions (read two, write one) on top of the op. The report predicts
    them from the machine's memory rate, so such a row that measured op + additions has no
    error; a row of the current benchmark (``autograd.grad``) gets none added."""
    from benchmarks import report
    rows = [r for r in _bench_rows(TRUTH) if r["bench"] == "linear_cp"][:3]
    extra = 3 * (1 * 8192 * 16 * (2 * 128 + 128)) * 2 / (TRUTH.kernels.mem_gbps * 1e9) * 1e3
    old = [dict({k: v for k, v in r.items() if k != "grads"}, ms_fwd_bwd=r["ms_fwd_bwd"] + extra)
           for r in rows]
    for p in report.points(rows + old, TRUTH):
        assert abs(p["error"]) < 1e-9, p
    shape = LinearShape(1, 8192, 16, 128, 128)
    assert report.accumulated_grads_ms(old[0], "linear", shape, TRUTH) == pytest.approx(extra)
    assert report.accumulated_grads_ms(rows[0], "linear", shape, TRUTH) == 0.0


def test_auto_with_packed_documents_runs_the_default_preset(monkeypatch, caplog):
    """Packed documents: the softmax ``auto`` is the default preset on every device, not the
    time model's pick (it prices one dense sequence: its pick ran 2.3 x slower with documents
    on 4 x H100), logged with the reason; the op and train.py's planner pass the flag."""
    import torch
    from sp_attention.softmax import attention as att
    ctx = SPContext(object(), 0, 4, (0, 1, 2, 3), "zigzag")
    q = torch.zeros(1, 32768, 32, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, 32768, 8, 128, dtype=torch.bfloat16)
    dense = auto.auto_softmax_preset(ctx, q, k, machine=H200)
    assert dense.name != DEFAULT_PRESET             # the model picks another preset here
    with caplog.at_level(logging.INFO, logger="sp_attention.cost"):
        packed = auto.auto_softmax_preset(ctx, q, k, machine=H200, packed=True)
    assert packed.name == DEFAULT_PRESET and not packed.predicted
    assert any("packed documents" in r.getMessage() for r in caplog.records)
    shape = SoftmaxShape(1, 32768, 32, 8, 128, 2, True)
    assert auto.softmax_preset_for_shape(torch.device("cpu"), shape, 4, "zigzag", machine=H200,
                                         packed=True).name == DEFAULT_PRESET
    seen = []

    def fake(*a, **kw):
        seen.append(kw["packed"])
        return dense
    monkeypatch.setattr(att, "auto_softmax_preset", fake)
    small = [torch.zeros(1, 8, 4, 8), torch.zeros(1, 8, 2, 8)]
    for flag in (True, False):
        att._config(small[0], small[1], small[1], ctx, att.SoftmaxTuning(), fwd=None, bwd=None,
                    preset="auto", heads_k_stride=None, bwd_head_first_stride=None,
                    bwd_head_last_stride=None, causal=True, softmax_scale=None, backend=None,
                    return_lse=False, packed=flag)
    assert seen == [True, False]

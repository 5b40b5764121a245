"""The cost model (pure functions, no process group): monotonic in P and bytes, crossovers where
the formulas put them, the decision functions, calibration JSON, the probe's fits, and the
report on a tiny synthetic input."""
import dataclasses
import json
import logging
import math
import os

import pytest

from sp_attention import auto, calibrate, cost, machine
from sp_attention.context import SPContext
from sp_attention.cost.common import softmax_kernel_ms
from sp_attention.cost import (LINEAR_SCANS, SOFTMAX_PRESETS, LinearShape, SoftmaxShape,
                               Topology, choose_linear_scan, choose_softmax_preset,
                               linear_memory, linear_scan_ms, linear_step, softmax_memory,
                               softmax_step)
from sp_attention.machine import (CPU_GLOO, H200_NVLINK_IB400, Link, Machine, load_machine,
                                  machine_from_dict, save_machine)

H200 = H200_NVLINK_IB400
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
        "LinearShape", "SoftmaxShape", "Topology", "StepTime", "Choice", "LINEAR_SCANS",
        "SOFTMAX_PRESETS", "linear_flops", "softmax_flops", "linear_scan_ms", "linear_step",
        "softmax_step", "choose_linear_scan", "choose_softmax_preset", "log_choice",
        "cp_efficiency", "linear_memory", "softmax_memory", "rank_memory"]
    assert machine.__all__ == ["Link", "Kernels", "Machine", "H200_NVLINK_IB400", "CPU_GLOO",
                               "default_machine", "calibration_path", "load_machine",
                               "save_machine", "machine_from_dict"]
    assert auto.__all__ == ["machine_for", "topology_for", "auto_linear_scan",
                            "auto_softmax_preset"]
    # the model's names are the library's names
    from sp_attention.linear.attention import SCANS
    from sp_attention.softmax.attention import PRESETS
    from sp_attention.cost.softmax_a2a import A2A_PRESETS
    assert set(LINEAR_SCANS) == set(SCANS) and {**SOFTMAX_PRESETS, **A2A_PRESETS} == PRESETS


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("schedule", LINEAR_SCANS)
def test_linear_monotonic_in_world_and_bytes(schedule, layout):
    # one node: every P; across nodes of 8 (a clipped tree's rounds cross node edges
    # differently for different P, so only whole nodes compare): powers of two
    for m, topo, Ps in ((H200, lambda P: None, range(2, 41)), (CPU_GLOO, lambda P: None,
                                                               range(2, 41)),
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


@pytest.mark.parametrize("preset", list(SOFTMAX_PRESETS))
def test_softmax_monotonic_in_world_and_bytes(preset):
    f, b = SOFTMAX_PRESETS[preset]
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
    round crosses ranks), all-gather = α + (P−2)·step + (P−1)·S/β."""
    m = _bare(alpha_p2p=50.0, alpha_coll=20.0, step=3.0, gbps=100.0)
    S = LIN.state_bytes
    hop = 50e-3 + S / 100e9 * 1e3
    for P in (2, 3, 5, 8, 13, 64):
        depth = math.ceil(math.log2(P))
        assert linear_scan_ms("ring", LIN, P, "contiguous", m) == pytest.approx((P - 1) * hop)
        assert linear_scan_ms("ring", LIN, P, "zigzag", m) == pytest.approx(2 * (P - 1) * hop)
        assert linear_scan_ms("blelloch", LIN, P, "contiguous", m) == pytest.approx(
            2 * depth * hop)
        coll = 20e-3 + (P - 2) * 3e-3 + (P - 1) * S / 100e9 * 1e3
        assert linear_scan_ms("allgather", LIN, P, "contiguous", m) == pytest.approx(coll)


def test_linear_crossovers_where_the_formulas_put_them():
    """ring vs tree: P − 1 hops against 2⌈log2 P⌉ rounds: the tree wins from P = 8 on (tie
    at 7); ring vs all-gather: the P* solving
    (P−1)(α_p + S/β) = α_c + (P−2)·s + (P−1)·S/β."""
    m = _bare(alpha_p2p=50.0, alpha_coll=1000.0, step=0.0, gbps=1e6)
    for P in range(2, 40):
        ring = linear_scan_ms("ring", LIN, P, "contiguous", m)
        tree = linear_scan_ms("blelloch", LIN, P, "contiguous", m)
        d = math.ceil(math.log2(P))
        assert (tree < ring) == (2 * d < P - 1), P
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
    # the measured 2 x H200 picks (benchmarks/results/cost_report.md)
    assert choose_softmax_preset(SOFT, 2, "zigzag", H200).name == "ring"
    assert choose_linear_scan(LinearShape(1, 32768, 16, 128, 128), 2, "contiguous",
                              H200).name == "allgather"


def test_softmax_choice_respects_memory_limit():
    big = SoftmaxShape(1, 32768, 32, 8, 128)
    need = {n: softmax_memory(big, 64, "zigzag", *SOFTMAX_PRESETS[n], H200)["peak"]
            for n in SOFTMAX_PRESETS}
    limit = (need["ring"] + max(need.values())) / 2
    c = choose_softmax_preset(big, 64, "zigzag", H200, memory_limit_bytes=limit)
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


def test_auto_helpers_from_tensors(monkeypatch, tmp_path, caplog):
    import torch
    monkeypatch.setenv("SP_ATTENTION_CALIBRATION", str(tmp_path / "none.json"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    auto._machine.cache_clear()
    ctx = SPContext(None, 0, 1, (0,), "zigzag")
    q = torch.zeros(1, 64, 2, 16)
    with caplog.at_level(logging.INFO, logger="sp_attention.cost"):
        c = auto.auto_linear_scan(ctx, q, q)
        s = auto.auto_softmax_preset(ctx, q, q[:, :, :1])
    assert c.name in LINEAR_SCANS and s.name in SOFTMAX_PRESETS
    assert auto.machine_for(q.device) is CPU_GLOO
    from types import SimpleNamespace
    four = SimpleNamespace(world_size=4, global_ranks=(0, 1, 2, 3))
    assert auto.topology_for(four, CPU_GLOO).nodes == (0, 0, 1, 1)   # LOCAL_WORLD_SIZE=2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert not auto.topology_for(four, CPU_GLOO).spans_nodes
    assert any("auto linear scan" in r.getMessage() for r in caplog.records)


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
    from sp_attention.memory import ModelShape, StepShape, estimate_memory
    est = estimate_memory(ModelShape(4, 4096, 14336, 32, 8, 128256, "SSSS"),
                          StepShape(cp=2, seq_length=16384))
    r = cost.rank_memory(sm["peak"], est)
    assert r["total"] == est.total - est.workspace + max(est.workspace, sm["peak"])
    assert r["model"] == est.total


def test_calibration_json_round_trip(tmp_path, monkeypatch):
    path = str(tmp_path / "sub" / "cal.json")
    m = dataclasses.replace(CPU_GLOO, name="x", device="cpu",
                            kernels=dataclasses.replace(CPU_GLOO.kernels, linear_tflops=1.5))
    assert save_machine(m, path) == path
    assert load_machine("cpu", path) == m
    assert load_machine("NVIDIA H200", path) is H200     # measured elsewhere: defaults
    monkeypatch.setenv("SP_ATTENTION_CALIBRATION", path)
    assert machine.calibration_path() == path and load_machine("cpu") == m
    monkeypatch.delenv("SP_ATTENTION_CALIBRATION")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert machine.calibration_path() == str(tmp_path / "sp_attention" / "calibration.json")
    with open(path, "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="not a usable sp_attention calibration"):
        load_machine("cpu", path)
    d = m.to_dict()
    d["kernels"]["bogus"] = 1
    with pytest.raises(ValueError, match="re-run"):
        machine_from_dict(d)
    with pytest.raises(ValueError, match="gbps"):
        Link(1.0, 0.0, 1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="linear_fwd_share"):
        dataclasses.replace(CPU_GLOO.kernels, linear_fwd_share=1.5)


def test_probe_fits_recover_alpha_beta_and_rates():
    pts = [(x, 0.05 + x * 2e-9) for x in (2 ** 16, 2 ** 20, 2 ** 24)]
    a, b = calibrate.fit_latency_rate(pts)
    assert a == pytest.approx(0.05) and b == pytest.approx(2e-9)
    rows = [dict(what="p2p", bytes_moved=x, ms=0.05 + x / 300e9 * 1e3) for x in (1e6, 8e6, 3e7)]
    rows += [dict(what="all_gather", bytes_moved=x, ms=0.02 + x / 250e9 * 1e3)
             for x in (1e6, 8e6, 3e7)]
    link = calibrate.fit_link(rows, 2, H200.intra)
    assert link.alpha_p2p_us == pytest.approx(50) and link.p2p_gbps == pytest.approx(300)
    assert link.alpha_coll_us == pytest.approx(20) and link.coll_gbps == pytest.approx(250)
    kr = [dict(what="linear", flops_fwd_bwd=f, ms_fwd_bwd=0.1 + f / 5e10, ms_fwd=0.3 * (
        0.1 + f / 5e10)) for f in (1e9, 4e9)]
    k = calibrate.fit_kernels(kr, CPU_GLOO.kernels)
    assert k.linear_tflops == pytest.approx(50.0) and k.linear_call_ms == pytest.approx(0.1)
    assert k.linear_fwd_share == pytest.approx(0.3)


def test_report_renders_from_a_tiny_input(tmp_path):
    from benchmarks import report
    rows = [
        dict(bench="linear_cp", impl="fla_chunk_simple_gla", world=1, T_local=4096, B=1, H=16,
             K=128, V=128, timing="queued", ms_fwd_bwd=0.3, date="2026-11-23"),
        dict(bench="linear_cp", impl="ring", layout="zigzag", world=2, T_local=4096, B=1,
             H=16, K=128, V=128, timing="queued", ms_fwd_bwd=0.45, date="2026-11-23"),
        dict(bench="linear_cp", impl="allgather", layout="zigzag", world=2, T_local=4096, B=1,
             H=16, K=128, V=128, timing="queued", ms_fwd_bwd=0.40, date="2026-11-23"),
        dict(bench="softmax_cp", impl="ring/ring", stride="default", world=2, T_local=4096,
             B=1, H=32, Hkv=8, K=128, ms_fwd_bwd=2.6, tflops_per_gpu=400.0,
             ratio_vs_t_local=0.9, date="2026-11-23")]
    src = tmp_path / "tiny.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = report.main([str(src), "--out-dir", str(tmp_path), "--name", "r",
                       "--projection-p", "2", "16", "--projection-t", "4096"])
    assert len(out["points"]) == 3 and out["checks"][0]["best"] == "allgather"
    md = (tmp_path / "r.md").read_text()
    assert "Which schedule when" in md and "r_projection.png" in md
    for name in ("pred_vs_meas", "throughput", "ratio", "projection"):
        png = tmp_path / f"r_{name}.png"
        assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_probe_runs_on_cpu_and_saves(tmp_path):
    """The probe's kernel part at tiny shapes (the GPU run uses the same code at its shapes)."""
    shapes = {"linear": dict(B=1, H=2, K=8, T=(32, 64)),
              "softmax": dict(B=1, H=2, Hkv=1, D=8, T=(16, 32))}
    rows = calibrate.probe_kernels("cpu", shapes)
    assert [r["what"] for r in rows] == ["linear", "linear", "softmax", "softmax", "memory"]
    assert all(r["ms_fwd_bwd"] > r["ms_fwd"] > 0 for r in rows if r["what"] != "memory")
    m = calibrate.calibrate("cpu", [], rows, 1)
    assert m.device == "cpu" and m.kernels.cores >= 1 and m.intra == CPU_GLOO.intra
    assert "links: defaults" in m.source
    path = save_machine(m, str(tmp_path / "c.json"))
    assert load_machine("cpu", path) == m


def _cpu_bare(**kernels) -> Machine:
    """CPU ranks on 2 cores with free kernels and links except the host terms given."""
    m = _bare(alpha_p2p=0.0, alpha_coll=0.0, gbps=1e9)
    k = dataclasses.replace(m.kernels, cores=2, softmax_fwd_tflops=1e12,
                            softmax_bwd_tflops=1e12, linear_tflops=1e12, **kernels)
    return dataclasses.replace(m, kernels=k, links_world=2)


def test_host_terms_add_what_their_counts_say():
    """Per message a rank posts: ``msg_us`` (+ ``scan_msg_us`` in a linear scan), CPU time at
    the share of the ranks taking part; the all-gather scan's fold ``fold_us``; none of it on
    a GPU machine (defaults 0)."""
    m = _cpu_bare(msg_us=10.0, scan_msg_us=5.0, fold_us=100.0)
    for P in (2, 3, 4, 8):
        share = min(1.0, 2 / P)
        # ring chain: the two ends of each of the P − 1 hops post one message each, sharing
        # the cores with the ranks the chain has passed (hop p: ranks 0 … p − 2 go on with
        # their step), so with p + 1 ranks busy on 2 cores it takes max(1, (p + 1) / 2) as long
        assert linear_scan_ms("ring", LIN, P, "contiguous", m) == pytest.approx(
            sum(2 * 15e-3 * max(1.0, (p + 1) / 2) for p in range(1, P)))
        assert linear_scan_ms("allgather", LIN, P, "zigzag", m) == pytest.approx(
            (100e-3 + 2 * 10e-3) / share)
    # contiguous P = 4 tree: up (0,1)(2,3) then (1,3); down (1,3) then (0,1)(2,3): one message
    # per rank up, two (both ways) down; 4, 2, 2, 4 ranks take part
    want = 15e-3 * (1 / 0.5 + 1 / 1.0 + 2 / 1.0 + 2 / 0.5)
    assert linear_scan_ms("blelloch", LIN, 4, "contiguous", m) == pytest.approx(want)
    assert H200.kernels.msg_us == H200.kernels.scan_msg_us == H200.kernels.fold_us == 0.0


def test_corun_slows_compute_not_links():
    m = _cpu_bare(corun=1.25)
    assert m.compute_share(1) == 1.0 and m.compute_share(2) == pytest.approx(0.8)
    assert m.compute_share(8) == pytest.approx(0.25 / 1.25)
    assert m.comm_share(2) == 1.0 and m.comm_share(8) == pytest.approx(0.25)
    assert H200.compute_share(8) == 1.0


def test_softmax_call_costs_per_direction_and_schedule():
    """Ring: one call per step (zigzag), each direction at its own fixed cost; all-gather: its
    own calls (one per local chunk and stride unit), not the ring's."""
    s = SoftmaxShape(1, 128, 8, 4, 32, 4)
    for P in (2, 4, 8):
        base = _cpu_bare()
        m = dataclasses.replace(base, kernels=dataclasses.replace(
            base.kernels, softmax_call_ms=1.0, softmax_bwd_call_ms=3.0, mem_gbps=1e12))
        share = min(1.0, 2 / P)
        ring = softmax_step(s, P, "zigzag", "ring", "ring", m)
        assert ring.fwd_ms == pytest.approx(P * 1.0 / share, rel=1e-6)
        assert ring.bwd_ms == pytest.approx(P * 3.0 / share, rel=1e-6)
        ag = softmax_step(s, P, "zigzag", "allgather", "allgather", m, heads_k_stride=4)
        assert ag.fwd_ms == pytest.approx(2 * 1.0 / share, rel=1e-6)
        assert ag.bwd_ms == pytest.approx(2 * 3.0 / share, rel=1e-6)
    assert H200.kernels.bwd_call_ms == H200.kernels.softmax_call_ms


def test_probe_host_fits_recover_the_terms():
    """``fit_host``: the slope per posted message and together ÷ alone; ``fit_scan_host``
    inverts the model's scan times."""
    rows = [dict(what="msgs", msgs=2 * n, ms=0.1 + 2 * n * 0.03) for n in (1, 2, 4, 8)]
    rows.append(dict(what="corun", ms=2.2, ms_alone=2.0))
    k = calibrate.fit_host(rows, CPU_GLOO.kernels)
    assert k.msg_us == pytest.approx(30.0) and k.corun == pytest.approx(1.1)
    assert calibrate.fit_host([dict(what="corun", ms=1.0, ms_alone=2.0)], k).corun == 1.0
    truth = dataclasses.replace(CPU_GLOO, kernels=dataclasses.replace(
        CPU_GLOO.kernels, scan_msg_us=70.0, fold_us=250.0))
    shape = LinearShape(1, 64, 8, 32, 32, 4)
    scan_rows = [dict(what=f"scan_{s}", world=2, layout="zigzag", B=1, H=8, K=32, V=32,
                      ms=linear_scan_ms(s, shape, 2, "zigzag", truth))
                 for s in ("blelloch", "allgather")]
    got = calibrate.fit_scan_host(scan_rows, CPU_GLOO).kernels
    assert got.scan_msg_us == pytest.approx(70.0) and got.fold_us == pytest.approx(250.0)


def test_old_calibration_gets_later_fields_from_the_default():
    d = CPU_GLOO.to_dict()
    for f in ("msg_us", "scan_msg_us", "fold_us", "corun", "softmax_bwd_call_ms",
              "softmax_mask"):
        del d["kernels"][f]
    d["kernels"]["linear_tflops"] = 9.0
    m = machine_from_dict(d)
    assert m.kernels.linear_tflops == 9.0 and m.kernels.msg_us == CPU_GLOO.kernels.msg_us
    assert m.kernels.corun == CPU_GLOO.kernels.corun
    # its attention rates were fitted to causal FLOPs at half the square: read them so
    assert m.kernels.softmax_mask is None and CPU_GLOO.kernels.softmax_mask is not None


def test_work_bound_takes_over_when_ranks_outnumber_cores():
    """Σ CPU work ÷ cores bounds a CPU step from below: a softmax ring's K/V bytes (gloo
    copies them on the cores) hide behind the kernels while every rank has a core (they cost
    the overlap charge, once per hop), but once P > cores every rank's copying takes core time
    from the others: each hop then costs its bytes × P / cores. Inert on a GPU."""
    s = SoftmaxShape(1, 128, 8, 4, 32, 4)
    fast = dataclasses.replace(_cpu_bare(softmax_call_ms=1.0, corun=1.0), overlap_cost=1.0)
    wire = 0.05                                                  # ms per K/V hop
    link = dataclasses.replace(fast.intra, p2p_gbps=s.kv_bytes / wire * 1e-6)
    slow = dataclasses.replace(fast, intra=link, inter=link)
    for P in (1, 2, 3, 4, 8):
        t0, t = (softmax_step(s, P, "zigzag", "ring", "ring", m) for m in (fast, slow))
        assert t.fwd_ms - t0.fwd_ms == pytest.approx((P - 1) * wire * max(1.0, P / 2), rel=1e-3)
        assert t.work_ms <= t.total_ms * (1 + 1e-9)
        if P > 2:                 # the bound is the step: it exceeds the critical path
            assert t.total_ms == pytest.approx(t.work_ms)
    assert softmax_step(SOFT, 8, "zigzag", "ring", "ring", H200).work_ms == 0.0
    assert linear_step(LIN, 8, "zigzag", "ring", H200).work_ms == 0.0


def test_message_cpu_counts_in_the_work_bound_only():
    """``Kernels.msg_cpu_us``: a message's whole CPU cost (both ends) shares the cores, so
    once P > cores a softmax ring's work bound grows by its message ends × msg_cpu_us / 2
    × P / cores (fwd: 4 ends per hop, K and V sent and received); with a core per rank
    nothing changes (the bound does not bind)."""
    s = SoftmaxShape(1, 128, 8, 4, 32, 4)
    base = _cpu_bare(softmax_call_ms=1.0, corun=1.0)
    cost = dataclasses.replace(base, kernels=dataclasses.replace(base.kernels,
                                                                 msg_cpu_us=400.0))
    for P in (3, 4, 8):
        t0, t = (softmax_step(s, P, "zigzag", "ring", "ring", m) for m in (base, cost))
        assert t.fwd_ms - t0.fwd_ms == pytest.approx((P - 1) * 4 * 0.2 * P / 2, rel=1e-6)
    wide = dataclasses.replace(cost, kernels=dataclasses.replace(cost.kernels, cores=64))
    wide0 = dataclasses.replace(base, kernels=dataclasses.replace(base.kernels, cores=64))
    for kind in ("ring", "allgather"):
        assert softmax_step(s, 8, "zigzag", kind, kind, wide).total_ms == pytest.approx(
            softmax_step(s, 8, "zigzag", kind, kind, wide0).total_ms)
    rows = [dict(what="msg_cpu", us=300.0), dict(what="msg_cpu", us=200.0),
            dict(what="msg_cpu", us=250.0)]
    assert calibrate.fit_host(rows, CPU_GLOO.kernels).msg_cpu_us == 250.0


def test_resume_counts_per_receive_only_where_ranks_outnumber_cores():
    """``Kernels.resume_us``: each message a rank receives costs it that much more CPU once
    the ranks outnumber the cores (P > 2 here): a softmax ring's forward bound grows by
    (P − 1) hops × 2 receives × resume × P / cores; at P = cores and with a core per rank
    nothing changes; linear scans pay it per receive too. The fit takes the median of the
    ``resume`` rows, at least 0."""
    s = SoftmaxShape(1, 128, 8, 4, 32, 4)
    base = _cpu_bare(softmax_call_ms=1.0, corun=1.0, msg_cpu_us=400.0)
    cost = dataclasses.replace(base, kernels=dataclasses.replace(base.kernels, resume_us=100.0))
    for P in (3, 4, 8):
        t0, t = (softmax_step(s, P, "zigzag", "ring", "ring", m) for m in (base, cost))
        assert t.fwd_ms - t0.fwd_ms == pytest.approx((P - 1) * 2 * 0.1 * P / 2, rel=1e-6)
    for kind in ("ring", "allgather"):
        assert softmax_step(s, 2, "zigzag", kind, kind, cost).total_ms == pytest.approx(
            softmax_step(s, 2, "zigzag", kind, kind, base).total_ms)
    lin = LinearShape(1, 128, 4, 32, 32, 4)
    for sched in ("ring", "blelloch", "allgather"):
        w0, w = (linear_step(lin, 6, "zigzag", sched, m).work_ms for m in (base, cost))
        assert w > w0
        assert linear_step(lin, 2, "zigzag", sched, cost).total_ms == pytest.approx(
            linear_step(lin, 2, "zigzag", sched, base).total_ms)
    rows = [dict(what="resume", us=u) for u in (40.0, 120.0, 70.0)]
    assert calibrate.fit_host(rows, CPU_GLOO.kernels).resume_us == 70.0
    assert calibrate.fit_host([dict(what="resume", us=-5.0)], CPU_GLOO.kernels).resume_us == 0
    assert H200.kernels.resume_us == 0.0


def test_corun_fit_takes_the_median_of_its_probes():
    """One probe's bad spell (a rank slowed by something else) does not set the factor."""
    rows = [dict(what="corun", ms=m, ms_alone=2.0) for m in (2.1, 3.3, 2.2)]
    assert calibrate.fit_host(rows, CPU_GLOO.kernels).corun == pytest.approx(1.1)


@pytest.mark.parametrize("kind", ["linear", "softmax"])
def test_work_bound_monotonic_in_world_and_bytes(kind):
    def work(P, n):
        if kind == "linear":
            return linear_step(LinearShape(1, 128, 4, n, n, 4), P, "zigzag", "blelloch",
                               CPU_GLOO).work_ms
        return softmax_step(SoftmaxShape(1, 128, 8, 4, n, 4), P, "zigzag", "ring", "ring",
                            CPU_GLOO).work_ms
    for n in (16, 32, 64):
        ws = [work(P, n) for P in range(1, 17)]
        assert all(b > a for a, b in zip(ws, ws[1:])), (n, ws)
    assert work(8, 16) < work(8, 32) < work(8, 64)


def _dense(mask=0.5, **kernels) -> Machine:
    """Free links and host terms; attention calls that compute their whole block."""
    m = _cpu_bare(**kernels)
    return dataclasses.replace(m, kernels=dataclasses.replace(
        m.kernels, cores=None, corun=1.0, softmax_fwd_tflops=1.0, softmax_bwd_tflops=2.0,
        softmax_call_ms=0.0, softmax_bwd_call_ms=0.0, mem_gbps=1e12, op_us=0.0,
        softmax_mask=mask))


def test_softmax_mask_costs_a_causal_call_as_its_full_block_and_more():
    """``softmax_mask`` None: a causal call does the pairs it keeps; m: the full block, plus
    m × the block's forward time in each direction."""
    full = cost.softmax_flops(1, 8, 64, 64, 32, False)
    keep = cost.softmax_flops(1, 8, 64, 64, 32, True)
    skip = dataclasses.replace(_dense(), kernels=dataclasses.replace(
        _dense().kernels, softmax_mask=None))
    f, b = softmax_kernel_ms(skip, 1, 8, 64, 64, 32, True)
    assert f == pytest.approx(keep / 1e9) and b == pytest.approx(2.5 * keep / 2e9)
    f, b = softmax_kernel_ms(_dense(0.5), 1, 8, 64, 64, 32, True)
    assert f == pytest.approx(1.5 * full / 1e9)
    assert b == pytest.approx(2.5 * full / 2e9 + 0.5 * full / 1e9)
    assert softmax_kernel_ms(_dense(0.5), 1, 8, 64, 64, 32, False) == pytest.approx(
        (full / 1e9, 2.5 * full / 2e9))
    with pytest.raises(ValueError, match="softmax_mask"):
        dataclasses.replace(CPU_GLOO.kernels, softmax_mask=-1.0)


def test_allgather_attention_costs_its_own_calls():
    """The all-gather schedules make one call per local chunk against its prefix of keys
    (``gather_plan``): zigzag P = 2, rank 0 holds pieces 0 and 3 of 64 tokens, so its calls
    are 64 × 64 and 64 × 256 keys, both causal (the diagonal last). A math-like kernel pays
    each call's whole block and the mask."""
    m = _dense(0.5)
    s = SoftmaxShape(1, 128, 8, 4, 32, 4)
    t = softmax_step(s, 2, "zigzag", "allgather", "allgather", m, heads_k_stride=4)
    work = cost.softmax_flops(1, 8, 64, 64 + 256, 32, False)
    assert t.fwd_ms == pytest.approx(1.5 * work / 1e9, rel=1e-6)
    ring = softmax_step(s, 2, "zigzag", "ring", "ring", m)
    # the ring: its own block (128 × 128, causal), then piece 3 against rank 1's pieces 1, 2
    own, other = (cost.softmax_flops(1, 8, 128, 128, 32, False),
                  cost.softmax_flops(1, 8, 64, 128, 32, False))
    assert ring.fwd_ms == pytest.approx((1.5 * own + other) / 1e9, rel=1e-6)


def _probe_rows(k, Ts=(32, 64, 128, 256), causal=(True, False)) -> list[dict]:
    """The softmax probe rows a machine with kernels ``k`` would measure."""
    m = dataclasses.replace(CPU_GLOO, kernels=k)
    rows = []
    for T in Ts:
        for c in causal:
            f, b = softmax_kernel_ms(m, 1, 8, T, T, 32, c)
            f, b = f + k.softmax_call_ms, b + k.bwd_call_ms
            rows.append(dict(what="softmax", B=1, T=T, H=8, Hkv=4, D=32, causal=c, ms_fwd=f,
                             ms_fwd_bwd=f + b, flops_fwd=cost.softmax_flops(1, 8, T, T, 32, c)))
    return rows


def test_probe_fit_recovers_the_attention_figures_and_the_mask():
    truth = dataclasses.replace(CPU_GLOO.kernels, softmax_call_ms=0.2, softmax_bwd_call_ms=0.3,
                                softmax_fwd_tflops=0.03, softmax_bwd_tflops=0.05,
                                softmax_mask=0.7)
    names = ("softmax_call_ms", "softmax_bwd_call_ms", "softmax_fwd_tflops",
             "softmax_bwd_tflops", "softmax_mask")
    got = calibrate.fit_kernels(_probe_rows(truth), CPU_GLOO.kernels)
    for n in names:
        assert getattr(got, n) == pytest.approx(getattr(truth, n)), n
    # causal rows alone (a probe recorded before the non-causal rows): the mask is taken as
    # known, and the rest still comes out
    got = calibrate.fit_kernels(_probe_rows(truth, causal=(True,)),
                                dataclasses.replace(CPU_GLOO.kernels, softmax_mask=0.7))
    for n in names:
        assert getattr(got, n) == pytest.approx(getattr(truth, n)), n
    # a kernel that skips the masked triangle (GPU): FLOPs as counted, no mask
    gpu = dataclasses.replace(truth, softmax_mask=None)
    got = calibrate.fit_kernels(_probe_rows(gpu, causal=(True,)), gpu)
    assert got.softmax_mask is None
    assert got.softmax_fwd_tflops == pytest.approx(0.03)
    assert got.softmax_bwd_call_ms == pytest.approx(0.3)


def test_cpu_calibration_end_to_end(tmp_path):
    """``python -m sp_attention.calibrate`` on CPU (2 gloo processes): the kernels (attention
    calls causal and not), the links and the host terms, the message's CPU among them."""
    out, raw = tmp_path / "cal.json", tmp_path / "raw.jsonl"
    m = calibrate.main(["--device", "cpu", "--out", str(out), "--jsonl", str(raw)])
    rows = [json.loads(line) for line in raw.read_text().splitlines()]
    whats = {r["what"] for r in rows}
    assert {"p2p", "all_gather", "msgs", "corun", "msg_cpu", "scan_blelloch", "linear",
            "softmax", "memory"} <= whats
    if len(os.sched_getaffinity(0)) > 1:            # the resume probe pins to two CPUs
        assert "resume" in whats
    assert {r["causal"] for r in rows if r["what"] == "softmax"} == {True, False}
    k = m.kernels
    assert k.msg_cpu_us > 0 and k.msg_us > 0 and k.softmax_mask is not None
    assert load_machine("cpu", str(out)) == m

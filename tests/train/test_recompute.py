"""Activation recompute (Megatron's machinery, sp_train/recompute.py) on CPU.

One gloo spawn at CP = 3 (softmax, linear, hybrid): the loss and every parameter gradient with
selective (core_attn, mlp, both) and full recompute (uniform 1 and 2, block 2) are
*bit-identical* (torch.equal) to the run without recompute, at every rank — a replayed layer
repeats its CP communication in the same order on every rank. In the same spawn the chunked
linear + cross entropy on the hidden states of ``build_gpt_model(return_hidden_states=True)``
matches the model's own loss (and gradients) and is itself bit-identical under recompute.

Megatron's checkpoint saves the CUDA RNG state, which a CPU-only torch cannot read: the workers
(only they) replace those two calls by no-ops — dropout is 0, so no random number is drawn.
The flag checks are pure functions (no process).
"""
import warnings

import pytest
import torch

from sp_attention.testing import run_distributed

pytest.importorskip("megatron.core")

SEQ, BATCH, VOCAB, LAYERS = 36, 2, 64, 4
SETTINGS = {
    "selective_core_attn": dict(granularity="selective", modules=("core_attn",)),
    "selective_mlp": dict(granularity="selective", modules=("mlp",)),
    "selective_both": dict(granularity="selective", modules=("core_attn", "mlp")),
    "full_uniform_1": dict(granularity="full"),
    "full_uniform_2": dict(granularity="full", method="uniform", num_layers=2),
    "full_block_2": dict(granularity="full", method="block", num_layers=2),
}


def _cpu_rng_shim():
    """Test-only: Megatron's checkpoint reads/sets the CUDA RNG state; on a CPU-only torch
    those calls fail, and with dropout 0 nothing random is drawn, so they become no-ops."""
    from megatron.core.tensor_parallel import random as mrandom
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.zeros(1)
    mrandom._set_cuda_rng_state = lambda *a, **k: None


def _build(kind, recompute, hidden_states=False):
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron_patches.model import build_gpt_model
    from sp_train.recompute import Recompute
    rc = Recompute(**recompute, model_layers=LAYERS) if recompute else Recompute()
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=32, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=48, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        normalization="RMSNorm", add_bias_linear=False, attention_dropout=0.0,
        hidden_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float32,
        context_parallel_size=3, **rc.config_kwargs())
    torch.manual_seed(1234)
    model = build_gpt_model(config, kind=kind, vocab_size=VOCAB, max_sequence_length=SEQ,
                            hybrid_pattern="LLLS", return_hidden_states=hidden_states)
    model.train()
    return model


def _step(model, batch, chunked):
    from sp_train.loss import micro_batch_loss
    from megatron.core import parallel_state as ps
    tok, pos, lab, msk = batch
    loss = micro_batch_loss(model, tok, pos, lab, msk, impl="chunked" if chunked else "megatron",
                            tp_group=ps.get_tensor_model_parallel_group(),
                            dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
                            chunk_tokens=5)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _worker(rank, world):
    warnings.filterwarnings("ignore")
    _cpu_rng_shim()
    from megatron.core import parallel_state as ps
    from sp_attention import shard_position_ids, shard_sequence, shift_labels
    from megatron_patches.model import cp_context
    ps.initialize_model_parallel(1, 1, context_parallel_size=world)
    ctx = cp_context()
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = shift_labels(tokens)           # the last label is -100: left out by both losses
    mask = (torch.rand(BATCH, SEQ, generator=g) > 0.2).float()
    batch = (shard_sequence(tokens, ctx, dim=1),
             shard_position_ids(SEQ, ctx).unsqueeze(0).expand(BATCH, -1),
             shard_sequence(labels, ctx, dim=1), shard_sequence(mask, ctx, dim=1))
    out = {"unequal": [], "loss_vs_megatron": {}}
    for kind in ("softmax", "linear", "hybrid"):
        for chunked in (False, True):
            ref_loss, ref_grads = _step(_build(kind, None, chunked), batch, chunked)
            if chunked:      # the chunked loss against the model's own loss, same weights
                meg_loss, meg_grads = _step(_build(kind, None, False), batch, False)
                out["loss_vs_megatron"][kind] = max(
                    [float((ref_loss - meg_loss).abs() / meg_loss.abs())]
                    + [float((ref_grads[n] - meg_grads[n]).norm() / meg_grads[n].norm())
                       for n in meg_grads])
            for name, setting in SETTINGS.items():
                loss, grads = _step(_build(kind, setting, chunked), batch, chunked)
                same = torch.equal(loss, ref_loss) and grads.keys() == ref_grads.keys() and \
                    all(torch.equal(grads[n], ref_grads[n]) for n in grads)
                if not same:
                    out["unequal"].append((kind, chunked, name))
    return out


def test_recompute_bit_identical_cp3_and_chunked_loss_matches_megatron():
    results = run_distributed(_worker, 3, timeout=400)
    for rank, res in enumerate(results):
        assert res["unequal"] == [], (rank, res["unequal"])
        for kind, err in res["loss_vs_megatron"].items():
            assert err < 1e-5, (rank, kind, err)


def test_recompute_flags_checked_with_the_fix():
    from sp_train.recompute import Recompute
    r = Recompute.from_flags("full", None, None, None, 16)
    assert (r.method, r.num_layers) == ("uniform", 1) and r.recomputed_layers() == 16
    assert Recompute.from_flags("full", "block", None, None, 16).num_layers == 16
    assert Recompute.from_flags("selective", None, None, None, 16).modules == ("core_attn",)
    assert Recompute.from_flags("full", "block", 3, None, 16).config_kwargs() == {
        "recompute_granularity": "full", "recompute_method": "block",
        "recompute_num_layers": 3}
    for flags, needle in ((("full", "uniform", 3, None), "must divide --num-layers 16"),
                          (("full", "block", 17, None), "must be in 1..16"),
                          (("selective", "uniform", None, None), "full only"),
                          (("full", None, None, ("mlp",)), "selective only"),
                          (("selective", None, None, ("moe",)), "use some of"),
                          (("selective", None, None, ("layernorm",)), "TransformerEngine"),
                          (("partial", None, None, None), "use one of")):
        with pytest.raises(ValueError, match=needle):
            Recompute.from_flags(*flags, 16)
    with pytest.raises(ValueError, match="needs a GPU"):
        Recompute.from_flags("full", None, None, None, 16).check_device(on_gpu=False)
    Recompute.from_flags(None, None, None, None, 16).check_device(on_gpu=False)


def _auto_args(*extra):
    from sp_train.args import parse_args
    return parse_args(["--preset", "1b", "--sp-model-kind", "hybrid", "--seq-length", "524288",
                       "--context-parallel-size", "4", "--global-batch-size", "1",
                       "--use-distributed-optimizer", "--recompute-granularity", "auto", *extra])


def test_auto_recompute_replays_the_fewest_flops_that_fit():
    """``--recompute-granularity auto`` (pure arithmetic on sizes): the 1B hybrid at 512K over
    CP 4 keeps its attention on an H200 (selective MLP fits), takes full recompute of the first
    layers only on an H100, and the least memory when nothing fits; none on CPU."""
    from sp_train.args import UsageError
    from sp_train.memory import GIB
    from sp_train.setup import (GPU_HEADROOM, memory_estimate, recompute_candidates,
                                resolve_auto_recompute)
    vocab = 128256

    def pick(capacity, on_gpu=True):
        args = _auto_args()
        with pytest.raises(UsageError, match="resolved against the device's memory"):
            args.recompute()
        layout = args.layout(4)
        line = resolve_auto_recompute(args, layout, vocab, bf16=True, capacity=capacity,
                                      on_gpu=on_gpu)
        est = memory_estimate(args, layout, vocab, bf16=True)[2].total
        return args, args.recompute(), est, line, layout

    args, rc, est, line, _ = pick(139.8 * GIB)                     # H200
    assert (rc.granularity, rc.modules) == ("selective", ("mlp",)), line
    assert est <= 139.8 * GIB - GPU_HEADROOM and "selective recompute (mlp)" in line
    args, rc, est, line, layout = pick(79.6 * GIB)                 # H100
    assert (rc.granularity, rc.method) == ("full", "block"), line
    assert est <= 79.6 * GIB - GPU_HEADROOM
    # one layer fewer does not fit (the first layers are the ones replayed)
    args.recompute_num_layers = rc.num_layers - 1
    assert memory_estimate(args, layout, vocab, bf16=True)[2].total > 79.6 * GIB - GPU_HEADROOM
    args, rc, est, line, _ = pick(20 * GIB)                        # nothing fits
    assert (rc.granularity, rc.method, rc.num_layers) == ("full", "uniform", 1)
    assert "the least of every setting" in line
    args, rc, _, line, _ = pick(139.8 * GIB, on_gpu=False)
    assert rc.granularity is None and "on CPU" in line
    assert recompute_candidates(4)[0] == (None, None, None, None)
    assert ("full", "block", 3, None) in recompute_candidates(4)


def test_auto_recompute_refuses_what_it_would_choose():
    from sp_train.args import UsageError
    with pytest.raises(UsageError, match="auto chooses --recompute-num-layers itself"):
        _auto_args("--recompute-num-layers", "2")
    with pytest.raises(UsageError, match="auto may choose"):
        _auto_args("--cuda-graphs")


def test_the_estimate_follows_the_softmax_preset():
    """The softmax preset the run will take is planned before the estimate
    (``planned_softmax_preset``: a named preset as given, ``auto`` by the CPU rule here, none
    without softmax layers or CP), and an all-to-all preset's exchanged copies replace the QKV
    output it keeps: 10 GiB less for the 1B softmax model at 512K over CP 4 with selective
    ``mlp`` recompute (the measured peak on 4 × H200 was 80.6 GiB)."""
    import torch
    from sp_train.args import parse_args
    from sp_train.memory import GIB
    from sp_train.setup import memory_estimate, planned_softmax_preset

    def args_of(*extra):
        return parse_args(["--preset", "1b", "--sp-model-kind", "softmax", "--seq-length",
                           "524288", "--context-parallel-size", "4", "--global-batch-size",
                           "1", "--use-distributed-optimizer", "--recompute-granularity",
                           "selective", "--recompute-modules", "mlp", *extra])
    cpu = torch.device("cpu")
    args = args_of()
    layout = args.layout(4)
    assert planned_softmax_preset(args, layout, cpu, bf16=True) == "ring"   # auto on CPU
    a2a = args_of("--softmax-cp-preset", "a2a")
    assert planned_softmax_preset(a2a, layout, cpu, bf16=True) == "a2a"
    ring = memory_estimate(args, layout, 128256, bf16=True)[2].total
    exch = memory_estimate(a2a, layout, 128256, bf16=True, softmax_preset="a2a")[2].total
    assert (ring - exch) / GIB == pytest.approx(16 * 131072 * 5120 / GIB, rel=1e-6)
    assert exch / GIB == pytest.approx(80.8, abs=0.1)
    hybrid = parse_args(["--preset", "1b", "--sp-model-kind", "linear",
                         "--context-parallel-size", "4", "--global-batch-size", "1"])
    assert planned_softmax_preset(hybrid, hybrid.layout(4), cpu, bf16=True) is None
    one = args_of("--context-parallel-size", "1")
    assert planned_softmax_preset(one, one.layout(1), cpu, bf16=True) is None


def test_planned_softmax_preset_knows_packed_documents(monkeypatch):
    """With ``--packing documents`` the planner asks for the packed rule (``auto`` runs the
    default preset with documents, as the op does), without it the dense time model."""
    import torch
    import sp_train.setup as setup
    from sp_attention.cost.common import Choice
    from sp_train.args import parse_args
    seen = []

    def fake(*a, **kw):
        seen.append(kw["packed"])
        return Choice("ring", {})
    monkeypatch.setattr(setup, "softmax_preset_for_shape", fake)
    for packing in ("documents", "none"):
        args = parse_args(["--preset", "1b", "--sp-model-kind", "softmax", "--seq-length",
                           "32768", "--context-parallel-size", "4", "--global-batch-size", "1",
                           "--packing", packing])
        assert setup.planned_softmax_preset(args, args.layout(4), torch.device("cpu"),
                                            bf16=True) == "ring"
    assert seen == [True, False]

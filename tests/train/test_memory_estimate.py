"""sp_train/memory.py: the activation tally against the tensors a real Megatron-Core model
saves for its backward, and the estimate's arithmetic.

One process (gloo world 1): for softmax, linear (GQA and not) and gated layers, bf16 parameters,
every recompute setting (none; selective core_attn, mlp, both; full uniform 1 and 2, block 1),
the bytes of the distinct storages handed to autograd's saved-tensor hooks during the forward
equal ``layer_saved_bytes`` (+ the shared per-sequence tensors) — except the RMSNorms', which
CPU torch decomposes in fp32 while CUDA's fused kernel saves the 16-bit input and fp32 inverse
RMS (the tally's ``norm*_in`` terms; checked on the GPU against measured peaks).
"""
import warnings

import pytest
import torch

from sp_train.memory import (ModelShape, StepShape, estimate_memory, layer_saved_bytes,
                                 param_count)
from sp_attention import SoftmaxSchedule
from sp_attention.testing import run_distributed

pytest.importorskip("megatron.core")

SEQ, HID, FFN, HEADS = 128, 64, 176, 4
CASES = [("S", 2), ("L", 2), ("L", 4), ("G", 2)]        # (kind, KV groups)
RECOMPUTE = {
    "none": None,
    "sel_core": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
    "sel_mlp": dict(recompute_granularity="selective", recompute_modules=["mlp"]),
    "sel_both": dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]),
    "full_u1": dict(recompute_granularity="full", recompute_method="uniform",
                    recompute_num_layers=1),
    "full_u2": dict(recompute_granularity="full", recompute_method="uniform",
                    recompute_num_layers=2),
    "full_b1": dict(recompute_granularity="full", recompute_method="block",
                    recompute_num_layers=1),
}
LAYERS = 2


def _measure(kind, groups, recompute, cp=1, preset=None):
    """Saved bytes per token of a 2-layer model's forward (hidden states out), outside norms
    (per local token over ``cp`` ranks, softmax ``preset`` with groups of 2 for ``a2a_ring``)."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron_patches.model import build_gpt_model
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HID, num_attention_heads=HEADS, num_query_groups=groups,
        ffn_hidden_size=FFN, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        normalization="RMSNorm", add_bias_linear=False, attention_dropout=0.0,
        hidden_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.bfloat16,
        bf16=True, bias_activation_fusion=True, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, context_parallel_size=cp, **(recompute or {}))
    torch.manual_seed(0)
    schedule = None if preset is None else SoftmaxSchedule(
        preset, a2a_size=2 if preset == "a2a_ring" else None)
    model = build_gpt_model(config, kind={"S": "softmax", "L": "linear", "G": "gated"}[kind],
                            vocab_size=64, softmax_schedule=schedule,
                            max_sequence_length=SEQ, return_hidden_states=True).bfloat16()
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    in_norm = [0]
    for mod in model.modules():
        if type(mod).__name__ in ("RMSNorm", "WrappedTorchNorm") or "Norm" in type(mod).__name__:
            mod.register_forward_pre_hook(lambda *a: in_norm.__setitem__(0, in_norm[0] + 1))
            mod.register_forward_hook(lambda *a: in_norm.__setitem__(0, in_norm[0] - 1))
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if not in_norm[0] and st.data_ptr() not in params:
            seen.setdefault(st.data_ptr(), st.nbytes())
        return t

    n = SEQ // cp
    tokens = torch.randint(0, 64, (1, n))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, torch.arange(n)[None], None)
    return sum(seen.values()) / n


def _shim_rng():
    from megatron.core.tensor_parallel import random as mrandom
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.zeros(1)     # test-only, see
    mrandom._set_cuda_rng_state = lambda *a, **k: None                 # test_recompute.py


def _worker(rank, world):
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps
    _shim_rng()
    ps.initialize_model_parallel(1, 1)
    return {(kind, g, name): _measure(kind, g, rc) for kind, g in CASES
            for name, rc in RECOMPUTE.items()}


def _a2a_worker(rank, world):
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps
    _shim_rng()
    ps.initialize_model_parallel(1, 1, context_parallel_size=world)
    return {(preset, name): _measure("S", 2, RECOMPUTE[name], world, preset)
            for preset in ("ring", "a2a", "a2a_ring") for name in ("none", "sel_mlp")}


def _expected(kind, groups, name):
    m = ModelShape(LAYERS, HID, FFN, HEADS, groups, 64, kind * LAYERS)
    norms = ("norm1_in", "norm2_in")

    def layer(drop=()):
        return sum(v for k, v in layer_saved_bytes(m, kind, 1, 2, drop).items()
                   if k not in norms)
    d = m.head_dim
    shared = 8                              # token ids (int64)
    if kind in "LG":    # fp32 leaf states (2 leaves x heads x [d, d]), norm weight, slopes
        per_head = d + (2 if kind == "G" else 1)    # gated: exp(A_log) and its negative
        shared += LAYERS * (2 * HEADS * d * d * 4 + 4 * HEADS * per_head) / SEQ
    drop = {"sel_core": ("core_attn",), "sel_mlp": ("mlp",),
            "sel_both": ("core_attn", "mlp")}.get(name)
    if name == "none":
        return LAYERS * layer() + shared
    if drop:      # a replayed core attention saves only its q, k, v inputs (+ an int64 id)
        return LAYERS * layer(drop) + (8 + 8 / SEQ if "core_attn" in drop else shared)
    ckpt = 2 * HID                           # one [N, h] input per checkpointed group
    if name == "full_b1":                    # layer 2 keeps everything
        return ckpt + (shared - 8) / LAYERS + layer() + 8 + 4 * d
    return {"full_u1": LAYERS * ckpt, "full_u2": ckpt}[name] + 8 + 4 * d    # + RoPE freqs


def test_activation_tally_matches_a_real_model():
    measured = run_distributed(_worker, 1, timeout=300)[0]
    bad = {}
    for (kind, g, name), got in measured.items():
        want = _expected(kind, g, name)
        if abs(got - want) > 1e-9 * want:
            bad[kind, g, name] = (got, want)
    assert not bad, bad


def test_all_to_all_presets_save_exchanged_copies():
    """CP 4, softmax with 2 KV heads: ``a2a`` (groups of 4: a KV head replicated per rank)
    and ``a2a_ring`` (groups of 2) save their exchanged q, k, v instead of the QKV output —
    the tally's difference from the ring schedule, with and without selective ``mlp``
    recompute, is exactly what the model saves less."""
    measured = run_distributed(_a2a_worker, 4, timeout=300)[0]
    m = ModelShape(LAYERS, HID, FFN, HEADS, 2, 64, "S" * LAYERS)
    for name, drop in (("none", ()), ("sel_mlp", ("mlp",))):
        ring = sum(layer_saved_bytes(m, "S", 1, 2, drop).values())
        assert measured["ring", name] == pytest.approx(_expected("S", 2, name), rel=1e-9)
        for preset, group in (("a2a", 4), ("a2a_ring", 2)):
            tally = sum(layer_saved_bytes(m, "S", 1, 2, drop, a2a=group).values())
            assert tally < ring
            assert measured[preset, name] - measured["ring", name] == pytest.approx(
                LAYERS * (tally - ring), rel=1e-9), (preset, name)


def test_estimate_arithmetic():
    """Terms add up; recompute and CP shrink activations; 1B numbers in the expected range."""
    m = ModelShape(16, 2048, 8192, 32, 8, 128256, "S" * 16)
    assert sum(param_count(m).values()) == pytest.approx(1.4985e9, rel=1e-3)
    base = dict(seq_length=32768, num_micro_batches=4, loss_chunk_tokens=8192)
    none = estimate_memory(m, StepShape(**base))
    full = estimate_memory(m, StepShape(**base, recompute="full"))
    sel = estimate_memory(m, StepShape(**base, recompute="selective", recompute_modules=("mlp",)))
    cp2 = estimate_memory(m, StepShape(**base, cp=2))
    assert full.activations < sel.activations < none.activations
    assert cp2.activations == pytest.approx(none.activations / 2, rel=0.01)
    assert none.phase in ("forward", "backward") and none.total == pytest.approx(
        none.weights + none.grads + none.optimizer + none.activations + none.loss
        + none.workspace)
    # one softmax layer of the 1B shape saves ~84 KiB per token in bf16
    assert sum(layer_saved_bytes(m, "S").values()) == pytest.approx(85640, rel=1e-6)
    meg = estimate_memory(m, StepShape(**base, loss="megatron"))
    assert meg.total - none.total > 20 * 2**30           # the full logits: tens of GiB
    assert none.summary(141e9).startswith(f"{none.total / 2**30:.1f} GiB of 131.3 GiB")
    tiny = estimate_memory(ModelShape(2, 64, 128, 4, 4, 128, "SS"), StepShape(
        seq_length=256, micro_batch_size=8, cp=2))
    assert tiny.total < 2**30 and tiny.summary().startswith(f"{tiny.total / 2**20:.1f} MiB at")
    with pytest.raises(ValueError, match="layer_kinds"):
        ModelShape(2, 64, 128, 4, 4, 64, "SX")
    with pytest.raises(ValueError, match="recompute="):
        StepShape(recompute="partial")


def test_estimate_counts_the_gradient_sum():
    """Summed over DP × CP, the step holds the fp32 sums the masters step from (not the 16-bit
    gradients and the optimizer's copies of them). An overlapped sum adds to the backward's
    peak (the first layer the backward reaches) the bucket already travelling: the untied
    output weight's, in fp32, in place of its 16-bit gradient (and its received slice under
    the distributed optimizer); a small or tied model counts one bucket and replaces
    nothing."""
    from sp_train.memory import _reduce_bytes
    from sp_train.reduce import BUCKET_ELEMENTS
    m = ModelShape(16, 2048, 8192, 32, 8, 128256, "S" * 16)
    p = float(sum(param_count(m).values()))
    base = dict(seq_length=8192)
    one = estimate_memory(m, StepShape(**base))
    cp2 = estimate_memory(m, StepShape(**base, cp=2))
    after = estimate_memory(m, StepShape(**base, cp=2, grad_reduce_overlap=False))
    emb = 128256 * 2048
    assert _reduce_bytes(m, StepShape(**base, cp=2), p) == (4 * emb, 2 * emb)
    assert _reduce_bytes(m, StepShape(**base, cp=2, dp=2, distributed_optimizer=True), p) \
        == (4 * emb + emb, 2 * emb)
    tied = ModelShape(16, 2048, 8192, 32, 8, 128256, "S" * 16, tied_embeddings=True)
    assert _reduce_bytes(tied, StepShape(**base, cp=2), p) == (4 * BUCKET_ELEMENTS, 0)
    small = ModelShape(2, 64, 128, 4, 4, 64, "SS")
    assert _reduce_bytes(small, StepShape(**base, cp=2), 1000.0) == (4000.0, 0)
    # the step: the 16-bit gradients and the optimizer's fp32 copies give way to the fp32 sums
    assert one.parts["optimizer"] - cp2.parts["optimizer"] == pytest.approx(2 * p)
    assert cp2.parts["backward"] - after.parts["backward"] == pytest.approx(4 * emb - 2 * emb)
    # the distributed optimizer over CP 2 · DP 2: masters, moments and fp32 sums in quarters
    rep = estimate_memory(m, StepShape(**base, cp=2, dp=2))
    zero = estimate_memory(m, StepShape(**base, cp=2, dp=2, distributed_optimizer=True))
    assert zero.optimizer == pytest.approx(rep.optimizer / 4) == pytest.approx(3 * p)
    assert zero.parts["optimizer"] == pytest.approx(
        2 * p + 3 * p + p + 2 * min(p, BUCKET_ELEMENTS))
    assert rep.parts["backward"] - zero.parts["backward"] == pytest.approx(9 * p - emb)
    # --overlap-param-gather: every bucket's 16-bit gather buffer alive after the step
    over = estimate_memory(m, StepShape(**base, cp=2, dp=2, distributed_optimizer=True,
                                        overlap_param_gather=True))
    assert over.parts["optimizer"] - zero.parts["optimizer"] == pytest.approx(
        2 * (p - BUCKET_ELEMENTS))


def test_train_memory_check_refuses_with_the_fixes():
    """train.py's check: 1B softmax at 256K tokens without recompute cannot fit an H200; the
    refusal names CP, full recompute and their estimates; full recompute fits."""
    from sp_train.args import parse_args
    from sp_train.loss import check_loss_impl
    from sp_train.setup import check_memory
    h200 = 150e9
    argv = ["--preset", "1b", "--seq-length", "262144", "--global-batch-size", "1",
            "--vocab-size", "128256"]
    args = parse_args(argv)
    with pytest.raises(ValueError, match="more than the device holds") as e:
        check_memory(args, args.layout(1), 128256, bf16=True, capacity=h200)
    for fix in ("--context-parallel-size 4 (4x the GPUs)", "--recompute-granularity full",
                "--no-memory-check"):
        assert fix in str(e.value), str(e.value)
    full = parse_args(argv + ["--recompute-granularity", "full"])
    assert check_memory(full, full.layout(1), 128256, bf16=True, capacity=h200).total < h200
    assert check_memory(args, args.layout(1), 128256, bf16=True, capacity=None).total > h200
    forced = parse_args(argv + ["--no-memory-check"])
    check_memory(forced, forced.layout(1), 128256, bf16=True, capacity=h200)
    with pytest.raises(ValueError, match="no tensor parallelism"):
        check_loss_impl("liger", 2, torch.device("cuda"))
    with pytest.raises(ValueError, match="invalid choice"):   # argparse's choices
        parse_args(["--loss-impl", "plain"])


def test_train_warns_when_a_gpu_run_leaves_too_little_headroom():
    """The 1B hybrid at 32K on one 80 GB H100: the estimate (69.2 GiB, equal to the measured
    tensor peak) fits, but the run ran out of memory at its third step (8.9 GiB outside
    PyTorch, 2.2 GiB fragmented): a warning names the margin and the fixes; the softmax model
    (62.7 GB measured, ran) gets none."""
    from sp_train.args import parse_args
    from sp_train.setup import GPU_HEADROOM, check_memory, memory_margin_warning
    h100 = 79.18 * 2**30
    argv = ["--preset", "1b", "--seq-length", "32768", "--global-batch-size", "1",
            "--vocab-size", "128256"]
    hyb = parse_args(argv + ["--sp-model-kind", "hybrid"])
    est = check_memory(hyb, hyb.layout(1), 128256, bf16=True, capacity=h100)
    assert 60 * 2**30 < est.total < h100 - 0.5 * GPU_HEADROOM
    msg = memory_margin_warning(hyb, hyb.layout(1), 128256, est, bf16=True, capacity=h100)
    assert msg and "may run out of memory" in msg and "--recompute-granularity" in msg, msg
    soft = parse_args(argv)
    est = check_memory(soft, soft.layout(1), 128256, bf16=True, capacity=h100)
    assert memory_margin_warning(soft, soft.layout(1), 128256, est, bf16=True,
                                 capacity=h100) is None
    assert memory_margin_warning(hyb, hyb.layout(1), 128256, est, bf16=True,
                                 capacity=None) is None

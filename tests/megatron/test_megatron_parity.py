"""Megatron-Core GPT models (softmax, linear, hybrid) at TP×CP×DP vs the 1×1×1 model, on gloo.

One spawn per world size; inside it every model kind is built at 1×1×1 (the reference, full
global batch) and at the tested layout (Megatron's parallel_state groups, zigzag CP shards,
global position ids, DP batch split). The reference loss is independent of Megatron's loss:
``F.cross_entropy(ignore_index=-100)`` on the 1×1×1 model's full logits. The tested side is
the README's recipe (``global_loss_share`` over the DP×CP group, ``all_reduce_gradients``);
the per-token loss at real targets (1e-6 relative), the global mean loss (1e-6) and every
parameter gradient (1e-5 relative) are compared at every rank. The same spawns check packed
documents (THD batches, ``packed_parity.py``) against an independent plain-torch model run
on each document alone and against the 1×1×1 model. The softmax model also runs with the
all-to-all presets where its heads split (``a2a`` at CP 2 and 4 and at TP 2 × CP 2,
``a2a_ring`` with groups of 2 at CP 4).
"""
import warnings

import pytest
import torch

import torch.distributed as dist
import torch.nn.functional as F

from sp_attention import shard_position_ids, shard_sequence, shift_labels
from sp_train.reduce import all_reduce_gradients
from sp_attention.testing import rel_rms, run_distributed

pytest.importorskip("megatron.core")

SEQ, BATCH, VOCAB, HEADS, GROUPS = 24, 2, 64, 4, 2
CASES = [("softmax", "rope"), ("linear", "rope"), ("gated", "rope"), ("hybrid", "rope")]
HYBRID = "LGLS"             # linear, gated and softmax layers in one model
PACKED_KINDS = ("softmax", "linear", "gated", "hybrid")


def _config(tp: int, cp: int, num_layers: int = 4):
    from megatron.core.transformer.transformer_config import TransformerConfig
    return TransformerConfig(
        num_layers=num_layers, hidden_size=32, num_attention_heads=HEADS, num_query_groups=GROUPS,
        ffn_hidden_size=48, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        normalization="RMSNorm", add_bias_linear=False, attention_dropout=0.0, hidden_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32,
        tensor_model_parallel_size=tp, context_parallel_size=cp)


def _build(tp, cp, kind, pos, seed=1234, schedule=None):
    from megatron_patches.model import build_gpt_model
    torch.manual_seed(seed)
    scan = None if kind == "softmax" else "blelloch" if cp != 3 else "auto"
    return build_gpt_model(_config(tp, cp), kind=kind, vocab_size=VOCAB,
                           max_sequence_length=SEQ, context_parallel_impl=scan,
                           position_embedding_type=pos,
                           hybrid_pattern=HYBRID if kind == "hybrid" else None,
                           softmax_schedule=schedule)


def _a2a_cases(tp, cp):
    """The softmax model with the all-to-all presets where the heads per TP rank split:
    ``a2a`` (KV heads replicated when GROUPS / TP < CP), ``a2a_ring`` with groups of 2."""
    from sp_attention import SoftmaxSchedule
    heads = HEADS // tp
    out = [("softmax", "rope", SoftmaxSchedule("a2a"))] if heads % cp == 0 else []
    if cp == 4:
        out.append(("softmax", "rope", SoftmaxSchedule("a2a_ring", a2a_size=2)))
    return out


def _reference(kind, pos, tokens):
    """1×1×1 model on the full global batch, loss by torch's cross entropy on its logits:
    (state dict, per-token loss (0 at ignored targets), mean loss, grads by name)."""
    model = _build(1, 1, kind, pos)
    labels = shift_labels(tokens)                             # -100 at each sequence's end
    positions = torch.arange(SEQ)[None].expand(BATCH, -1)
    logits = model(tokens, positions, None)                   # [b, s, vocab]
    flat = dict(input=logits.reshape(-1, VOCAB).double(), target=labels.reshape(-1),
                ignore_index=-100)
    token_loss = F.cross_entropy(**flat, reduction="none").view(BATCH, SEQ)
    mean = F.cross_entropy(**flat)
    mean.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return model.state_dict(), token_loss.detach(), mean.item(), grads


def _check_plain(kind, tokens, ref):
    """The 1×1×1 Megatron model (fp32) equals the independent plain-torch model (fp64,
    ``plain_gpt.py``): per-token loss and every gradient."""
    from packed_parity import linear_slopes
    from plain_gpt import packed_reference
    sd, ref_loss, ref_mean, ref_grads = ref
    pattern = _build(1, 1, kind, "rope").sp_layer_pattern
    loss, mean, grads = packed_reference(sd, tokens, [[0, SEQ]] * BATCH, pattern, HEADS,
                                         GROUPS, linear_slopes(pattern, HEADS))
    assert rel_rms(loss.view(BATCH, SEQ), ref_loss) <= 1e-6, kind
    assert abs(mean - ref_mean) / ref_mean <= 1e-6, kind
    for name, g in ref_grads.items():
        assert rel_rms(g.double(), grads[name]) <= 1e-5, (kind, name)


def _check_slopes(model, tp_rank, tp):
    """Each linear layer's slopes are its TP rank's heads' slice of the global schedule."""
    from megatron_patches.core_attention import LinearCoreAttention
    from megatron_patches.gated_attention import GatedCoreAttention
    from sp_attention.linear.slopes import decay_slopes
    n = 0
    for layer in model.decoder.layers:
        ca = layer.self_attention.core_attention
        if isinstance(ca, LinearCoreAttention) and not isinstance(ca, GatedCoreAttention):
            full = decay_slopes(HEADS, "long_range", layer_number=ca.layer_number,
                                num_layers=len(model.decoder.layers))
            per = HEADS // tp
            assert torch.equal(ca.slopes, full[tp_rank * per:(tp_rank + 1) * per]), (
                tp_rank, ca.slopes, full)
            n += 1
    return n


def _worker(rank, world, tp, cp):
    warnings.filterwarnings("ignore")
    import packed_parity
    from megatron.core import parallel_state as ps
    from megatron_patches.model import (cp_context, global_loss_share, grad_reduce_group,
                                        tp_shard_state_dict)
    from megatron_patches.model import _tp_slice
    dp = world // (tp * cp)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    cases = CASES + ([("hybrid", "learned_absolute")] if world == 2 else [])
    refs = {}
    ps.initialize_model_parallel(1, 1, context_parallel_size=1)
    for kind, pos in cases:
        refs[kind, pos] = _reference(kind, pos, tokens)
        if pos == "rope" and world == 2:            # the 1x1x1 model is the plain-torch one
            _check_plain(kind, tokens, refs[kind, pos])
    packed_refs = {kind: packed_parity.references(_build(1, 1, kind, "rope"), HEADS, GROUPS)
                   for kind in PACKED_KINDS}
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, 1, context_parallel_size=cp)
    tp_rank, dp_rank = ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()
    ctx = cp_context()
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    report = {}
    for kind, pos, *sched in cases + _a2a_cases(tp, cp):
        ref_sd, ref_loss, ref_mean, ref_grads = refs[kind, pos]
        model = _build(tp, cp, kind, pos, schedule=sched[0] if sched else None)
        cut = tp_shard_state_dict(ref_sd, model, tp_rank, tp)
        # equal seeds + use_cpu_initialization give the same weights at every layout
        for name, val in model.state_dict().items():
            if name in cut:
                assert torch.equal(val, cut[name]), f"{kind}: {name} differs from the TP cut"
        model.load_state_dict(cut, strict=False)
        ids = shard_sequence(tokens[rows], ctx)
        labels = shard_sequence(shift_labels(tokens)[rows], ctx)
        positions = shard_position_ids(SEQ, ctx)[None].expand(ids.shape[0], -1)
        loss = model(ids, positions, None, labels=labels)
        real = labels != -100
        err_loss = rel_rms(loss * real, shard_sequence(ref_loss[rows], ctx))
        assert err_loss <= 1e-6, (kind, pos, "loss", err_loss)
        # the README's recipe, word for word
        share = global_loss_share(loss, labels, grad_reduce_group())
        share.backward()
        all_reduce_gradients(model.parameters(), grad_reduce_group())
        total = share.detach().double().clone()
        dist.all_reduce(total, group=grad_reduce_group())
        err_mean = abs(total.item() - ref_mean) / ref_mean
        assert err_mean <= 1e-6, (kind, pos, "mean loss", total.item(), ref_mean)
        params = dict(model.named_parameters())
        worst = 0.0
        for name, p in params.items():
            ref = ref_grads[name]
            if getattr(p, "tensor_model_parallel", False) and tp > 1:
                ref = _tp_slice(ref, p.partition_dim, getattr(p, "partition_stride", 1),
                                tp_rank, tp)
            err = rel_rms(p.grad, ref)
            assert err <= 1e-5, (kind, pos, name, err)
            worst = max(worst, err)
        if tp > 1 and kind in ("linear", "hybrid"):
            assert _check_slopes(model, tp_rank, tp) > 0
        if sched:
            report[kind, f"{sched[0].preset} {sched[0].a2a_size}"] = (err_loss, err_mean, worst)
            continue
        report[kind, pos] = (err_loss, err_mean, worst)
        if kind in PACKED_KINDS and pos == "rope":
            model.zero_grad(set_to_none=True)
            report[kind, "packed"] = packed_parity.check(
                model, packed_refs[kind], tp_rank, tp, dp_rank, dp,
                f"packed {kind} TP{tp} CP{cp} DP{dp}")
    ps.destroy_model_parallel()
    return report


@pytest.mark.parametrize("tp,cp,dp", [(1, 2, 1), (1, 3, 1), (1, 4, 1), (2, 2, 2)],
                         ids=lambda v: str(v))
def test_parity_with_single_process(tp, cp, dp):
    reports = run_distributed(_worker, tp * cp * dp, tp, cp, timeout=300)
    assert len(reports) == tp * cp * dp
    for r in reports:
        assert set(k for k, _ in r) == {k for k, _ in CASES}
        assert {k for k, p in r if p == "packed"} == set(PACKED_KINDS)
        assert {p for _, p in r if p.startswith("a2a")} == {
            f"{s.preset} {s.a2a_size}" for *_, s in _a2a_cases(tp, cp)}

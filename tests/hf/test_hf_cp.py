"""HF transformers integration on CPU/gloo: a tiny random GQA+RoPE LlamaForCausalLM (fp32)
prepared for CP equals the unpatched SDPA model (loss 1e-6, every gradient 1e-5 relative, at
every rank) for every softmax preset at CP 1-4, with a padding mask and with lengths that need
layout padding (the all-to-all presets where the 4 heads split: a2a at CP 1, 2 and 4,
a2a_ring with groups of 2 at CP 4); the linear, hybrid and gated variants at CP 1-3 equal CP 1; two models with
different CP groups in one process; bad input raises on every rank before any collective; the
gated variant (a gated layer and a softmax layer) at CP 1-3 equals CP 1;
packed batches of ``DataCollatorWithFlattening`` (with and without its flash kwargs) at CP 3
and CP 1 equal the unpatched model run on each document alone (loss and every gradient).
One spawn per world size, every check inside it."""
from __future__ import annotations

import copy

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import (DataCollatorWithFlattening, LlamaConfig,  # noqa: E402
                          LlamaForCausalLM)

from models.hf import (CPSchedule, LinearLlamaConfig, LinearLlamaForCausalLM,  # noqa: E402
                       causal_lm_loss, global_loss_value, hybrid_layer_kinds,
                       prepare_cp_batch, prepare_model_for_cp)
from sp_train.reduce import all_reduce_gradients  # noqa: E402
from sp_attention.softmax import PRESETS  # noqa: E402
from sp_attention.testing import rel_rms, run_distributed  # noqa: E402

LOSS_RTOL, GRAD_RTOL = 1e-6, 1e-5
VOCAB, BATCH = 64, 2
LINEAR_IMPLS = ("auto", "blelloch", "allgather", "ring")


def _tiny(cls_config=LlamaConfig, **extra):
    # GQA (4 query heads on 2 KV heads), RoPE, 2 layers, fp32
    return cls_config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, rms_norm_eps=1e-6, **extra)


def _models():
    torch.manual_seed(0)
    return {"llama": LlamaForCausalLM(_tiny()).float(),
            "linear": LinearLlamaForCausalLM(_tiny(LinearLlamaConfig)).float(),
            "hybrid": LinearLlamaForCausalLM(_tiny(
                LinearLlamaConfig, layer_kinds=hybrid_layer_kinds(2, 2))).float(),
            "gated": LinearLlamaForCausalLM(_tiny(
                LinearLlamaConfig, layer_kinds=["gated", "softmax"])).float()}


def _cases():
    """(input_ids, attention_mask) global batches: plain (T = 24 splits for P <= 4), a length
    needing layout padding, and right padding inside a batch."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, 24), generator=g)
    mask = torch.ones(BATCH, 24, dtype=torch.long)
    mask[1, 17:] = 0
    return {"plain": (ids, None), "needs_pad": (ids[:, :21], None), "pad_mask": (ids, mask)}


def _reference(model, ids, mask):
    """Unpatched model: HF's own loss (mean over non-ignored shifted labels) and gradients."""
    model = copy.deepcopy(model)
    labels = ids.clone() if mask is None else ids.masked_fill(mask == 0, -100)
    loss = model(ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _cp_step(model, handle, ids, mask, group):
    batch = prepare_cp_batch(ids, handle.ctx, attention_mask=mask)
    logits = model(**batch.model_inputs()).logits
    share = causal_lm_loss(logits, batch.labels, group)
    share.backward()
    all_reduce_gradients(model.parameters(), group)
    return global_loss_value(share, group), {n: p.grad for n, p in model.named_parameters()}


def _compare(tag, got, ref):
    loss, grads = got
    ref_loss, ref_grads = ref
    err = abs(loss - ref_loss) / abs(ref_loss)
    assert err <= LOSS_RTOL, f"{tag}: loss {loss} vs {ref_loss} (rel {err:.2e})"
    for name, g in ref_grads.items():
        e = rel_rms(grads[name], g)
        assert e <= GRAD_RTOL, f"{tag}: grad {name} rel RMS {e:.2e}"


def _check(model, ref, ids, mask, group, schedule, tag, scan=None):
    m = copy.deepcopy(model)
    handle = prepare_model_for_cp(m, group, schedule=schedule, context_parallel_impl=scan)
    _compare(tag, _cp_step(m, handle, ids, mask, group), ref)


def _schedules(world):
    """Every softmax preset that the tiny model's 4 query heads allow at ``world`` ranks:
    ``a2a`` where they split over the group, ``a2a_ring`` with groups of 2 at P = 4."""
    out = {p: CPSchedule(preset=p) for p in PRESETS if p not in ("a2a", "a2a_ring")}
    if 4 % world == 0:
        out["a2a"] = CPSchedule(preset="a2a")
    if world == 4:
        out["a2a_ring"] = CPSchedule(preset="a2a_ring", a2a_size=2)
    return out


def check_equivalence(rank, world, max_linear_world=3):
    """Every softmax preset on Llama; linear scans and presets on linear/hybrid (P <= 3)."""
    group = dist.new_group(list(range(world))) if world > 1 else None
    models = _models()
    for case, (ids, mask) in _cases().items():
        ref = _reference(models["llama"], ids, mask)
        for preset, schedule in _schedules(world).items():
            _check(models["llama"], ref, ids, mask, group, schedule,
                   f"P={world} llama {preset} {case}")
        if world > max_linear_world:
            continue
        ref = _reference(models["linear"], ids, mask)
        for impl in (LINEAR_IMPLS if case == "plain" else ("auto",)):
            _check(models["linear"], ref, ids, mask, group, None,
                   f"P={world} linear {impl} {case}", scan=impl)
        ref = _reference(models["hybrid"], ids, mask)
        for preset, schedule in _schedules(world).items():
            if case != "plain" and preset != "ring":
                continue
            _check(models["hybrid"], ref, ids, mask, group, schedule,
                   f"P={world} hybrid {preset} {case}", scan="blelloch")
        ref = _reference(models["gated"], ids, mask)      # gated + softmax layers
        for impl in (LINEAR_IMPLS if case == "plain" else ("auto",)):
            _check(models["gated"], ref, ids, mask, group, None,
                   f"P={world} gated {impl} {case}", scan=impl)
    return True


def check_two_groups(rank, world):
    """Two models in one process: one on the whole group, one on a pair, used interleaved."""
    everyone = dist.new_group(list(range(world)))
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    pair = pairs[rank // 2]
    models = _models()
    ids, mask = _cases()["pad_mask"]
    a, b = copy.deepcopy(models["llama"]), copy.deepcopy(models["hybrid"])
    ha = prepare_model_for_cp(a, everyone, schedule=CPSchedule(preset="ring_ag"))
    hb = prepare_model_for_cp(b, pair, schedule=CPSchedule(preset="allgather"))
    assert ha.name != hb.name and ha.ctx.world_size == world and hb.ctx.world_size == 2
    batch_a = prepare_cp_batch(ids, ha.ctx, attention_mask=mask)
    batch_b = prepare_cp_batch(ids, hb.ctx, attention_mask=mask)
    share_a = causal_lm_loss(a(**batch_a.model_inputs()).logits, batch_a.labels, everyone)
    share_b = causal_lm_loss(b(**batch_b.model_inputs()).logits, batch_b.labels, pair)
    share_b.backward()
    share_a.backward()
    all_reduce_gradients(a.parameters(), everyone)
    all_reduce_gradients(b.parameters(), pair)
    got_a = (global_loss_value(share_a, everyone), {n: p.grad for n, p in a.named_parameters()})
    got_b = (global_loss_value(share_b, pair), {n: p.grad for n, p in b.named_parameters()})
    _compare("two groups: llama P=4", got_a, _reference(models["llama"], ids, mask))
    _compare("two groups: hybrid P=2", got_b, _reference(models["hybrid"], ids, mask))
    return True


def check_bad_input(rank, world):
    """Each misuse raises on every rank, before any collective: afterwards a normal step still
    runs (a rank stuck in a collective would hang it; the harness times out)."""
    group = dist.new_group(list(range(world)))
    model = _models()["llama"]
    handle = prepare_model_for_cp(model, group, name="sp_test_bad_input")
    ctx = handle.ctx
    ids, mask = _cases()["pad_mask"]
    left = mask.flip(1)
    packed = torch.cat([torch.arange(12), torch.arange(12)]).expand(BATCH, -1)
    with pytest.raises(ValueError, match="right padding"):
        prepare_cp_batch(ids, ctx, attention_mask=left)
    with pytest.raises(ValueError, match="packed documents go in ONE row"):
        prepare_cp_batch(ids, ctx, position_ids=packed)
    with pytest.raises(ValueError, match="pass no attention_mask"):
        prepare_cp_batch(ids[:1], ctx, position_ids=packed[:1], attention_mask=mask[:1])
    with pytest.raises(ValueError, match="disagree"):
        prepare_cp_batch(ids[:1], ctx, position_ids=packed[:1],
                         cu_seq_lens_q=torch.tensor([0, 10, 24]))
    with pytest.raises(ValueError, match="must equal cu_seq_lens_q"):
        prepare_cp_batch(ids[:1], ctx, cu_seq_lens_q=torch.tensor([0, 12, 24]),
                         cu_seq_lens_k=torch.tensor([0, 10, 24]))
    with pytest.raises(ValueError, match="2-D"):
        prepare_cp_batch(ids, ctx, attention_mask=mask[:, None, None, :])
    batch = prepare_cp_batch(ids, ctx, attention_mask=mask)
    inputs = batch.model_inputs()
    local_mask = torch.ones_like(batch.input_ids)
    misuse = {
        "attention_mask=None": dict(inputs, attention_mask=local_mask),
        "cannot be honoured": dict(inputs, attention_mask=local_mask[:, None, None, :].bool()),
        "global position_ids": {"input_ids": batch.input_ids},
        "labels": dict(inputs, labels=batch.labels),
        "ONE packed row": dict(inputs, cu_seq_lens_q=torch.tensor([0, 12, 24])),
        "KV cache": dict(inputs, use_cache=True),
    }
    for message, kwargs in misuse.items():
        with pytest.raises(ValueError, match=message):
            model(**kwargs)
    with pytest.raises(ValueError, match="already registered"):
        prepare_model_for_cp(_models()["hybrid"], group, name="sp_test_bad_input")
    with pytest.raises(ValueError, match="already prepared"):
        prepare_model_for_cp(model, group)
    with pytest.raises(ValueError, match="preset"):
        CPSchedule(preset="nope")
    with pytest.raises(ValueError, match="--context-parallel-impl tree: use one of"):
        prepare_model_for_cp(_models()["linear"], group, context_parallel_impl="tree")
    share = causal_lm_loss(model(**inputs).logits, batch.labels, group)
    share.backward()
    return global_loss_value(share, group)


# documents of a packed row: a 1-token one, long ones the plan cuts over 3 ranks, short ones
PACKED_DOCS = (5, 13, 1, 7, 15)
PACKED_KINDS = ("llama", "linear", "hybrid", "gated")


def _documents():
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PACKED_DOCS]


def _per_document_reference(model, docs):
    """The unpatched model on each document alone: mean cross entropy over every document's
    next-token targets, and its gradients."""
    model = copy.deepcopy(model)
    total, count = 0.0, sum(len(d) - 1 for d in docs)
    for d in docs:
        logits = model(torch.tensor([d])).logits[0, :-1]
        total = total + torch.nn.functional.cross_entropy(
            logits.float(), torch.tensor(d[1:], dtype=torch.long), reduction="sum")
    loss = total / count
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def check_packed(rank, world):
    """DataCollatorWithFlattening batches, with and without return_flash_attn_kwargs, through
    prepare_cp_batch; at CP 1 also fed to the prepared model as they come (HF Trainer's way:
    the model's own loss)."""
    group = dist.new_group(list(range(world))) if world > 1 else None
    models, docs = _models(), _documents()
    for kind in PACKED_KINDS:
        ref = _per_document_reference(models[kind], docs)
        for flash in (True, False):
            collated = DataCollatorWithFlattening(return_flash_attn_kwargs=flash)(
                [{"input_ids": d} for d in docs])
            m = copy.deepcopy(models[kind])
            handle = prepare_model_for_cp(m, group)
            batch = prepare_cp_batch(ctx=handle.ctx, **collated)
            assert batch.plan is not None and batch.input_ids.shape[0] == 1
            if world > 1:
                assert batch.plan.crossing_docs, batch.plan.describe()
            logits = m(**batch.model_inputs()).logits
            share = causal_lm_loss(logits, batch.labels, group)
            share.backward()
            all_reduce_gradients(m.parameters(), group)
            got = (global_loss_value(share, group), {n: p.grad for n, p in m.named_parameters()})
            _compare(f"P={world} packed {kind} flash_kwargs={flash}", got, ref)
            if world == 1:      # as the collator made it, the model's own (HF) loss
                m.zero_grad()
                out = m(**collated)
                out.loss.backward()
                _compare(f"P=1 packed {kind} raw collator flash_kwargs={flash}",
                         (out.loss.item(), {n: p.grad for n, p in m.named_parameters()}), ref)
    return True


def check_world(rank, world):
    check_equivalence(rank, world)
    if world == 3:
        check_packed(rank, world)
    if world == 4:
        check_two_groups(rank, world)
    if world == 2:
        check_bad_input(rank, world)
    return True


@pytest.mark.parametrize("world", [2, 3, 4])
def test_cp_equals_unsharded(world):
    assert run_distributed(check_world, world, timeout=300) == [True] * world


def test_cp1_equals_unsharded():
    check_equivalence(0, 1)
    check_packed(0, 1)

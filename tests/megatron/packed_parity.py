"""Packed documents (THD) in Megatron-Core models at TP×CP×DP, run inside the parity spawns
of test_megatron_parity.py (no spawn of its own).

The global batch is two rows of ``SEQ`` tokens as Megatron's GPT dataset gives them with
``--reset-attention-mask --reset-position-ids --eod-mask-loss`` (labels shifted over the
sample, the loss masked at EOD tokens), each row holding several documents that end in EOD
(lengths 1 to ``SEQ``; documents crossing CP ranks and documents whole on one rank). The
launcher's ``get_batch(..., eod=EOD)`` turns a DP rank's rows into one THD row cut by the
packing plan. Compared at every rank: the per-token loss at counted targets and the global mean
loss (1e-6 relative) and every parameter gradient (1e-5) against (a) the independent plain-torch
model of ``plain_gpt.py`` run on each document alone (fp64) and (b) the same Megatron model at
1×1×1 on the whole global batch as one THD row. The positions the plan gives equal Megatron's
own ``--reset-position-ids`` positions (its dataset's function).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from sp_attention.linear.slopes import decay_slopes
from sp_train.reduce import all_reduce_gradients
from sp_attention.testing import rel_rms

from plain_gpt import packed_reference

SEQ, VOCAB = 24, 64
EOD = VOCAB - 1
# document boundaries of each row: 1-token documents, long ones crossing CP ranks, short ones
# whole on one rank, at every layout tested (P = 2, 3, 4; DP 1 and 2)
ROW_CU = [[0, 1, 7, 8, 19, 24], [0, 21, 22, 24]]
LOSS_RTOL, GRAD_RTOL = 1e-6, 1e-5


def megatron_batch(rows: slice) -> dict:
    """``rows`` of the global batch as Megatron's GPT dataset gives them (``tokens``,
    ``labels``, ``loss_mask``, ``position_ids``: ``[b, SEQ]``; every document ends in EOD)."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids
    g = torch.Generator().manual_seed(3)
    sample = torch.randint(0, EOD, (len(ROW_CU), SEQ + 1), generator=g)
    for r, cu in enumerate(ROW_CU):
        sample[r, [b - 1 for b in cu[1:]]] = EOD
    tokens, labels = sample[:, :-1], sample[:, 1:]
    out = {"tokens": tokens, "labels": labels, "loss_mask": [], "position_ids": []}
    for row in tokens:
        _, mask, pos = _get_ltor_masks_and_position_ids(row, EOD, True, True, True, False)
        out["loss_mask"].append(mask)
        out["position_ids"].append(pos)
    out["loss_mask"] = torch.stack(out["loss_mask"])
    out["position_ids"] = torch.stack(out["position_ids"])
    return {k: v[rows] for k, v in out.items()}


def run(model, rows: slice):
    """The launcher's path: ``get_batch`` with the EOD id, then the model. Returns (per-token
    loss ``[1, L]``, loss mask, the plan, the batch)."""
    from megatron_patches.packing import eod_cu_seqlens, plan_of
    from megatron_patches.pretrain_gpt import get_batch
    batch = megatron_batch(rows)
    b = get_batch(iter([batch]), model.sp_context, eod=EOD, device="cpu")
    params = b["packed_seq_params"]
    assert torch.equal(params.cu_seqlens_q, micro_batch_cu(range(rows.start, rows.stop)))
    assert torch.equal(eod_cu_seqlens(batch["tokens"], EOD), params.cu_seqlens_q)
    plan = plan_of(params, model.sp_context, b["tokens"].shape[1])
    rank = model.sp_context.rank
    # our positions are Megatron's --reset-position-ids positions, cut by the plan
    want = plan.shard(batch["position_ids"].reshape(1, -1), rank, dim=1)
    assert torch.equal(b["position_ids"], want), (b["position_ids"], want)
    loss = model(b["tokens"], b["position_ids"], None, labels=b["labels"],
                 packed_seq_params=params)
    return loss, b["loss_mask"], plan


def micro_batch_cu(rows: range) -> torch.Tensor:
    """Boundaries of ``rows`` laid end to end."""
    from megatron_patches.packing import rows_cu_seqlens
    return rows_cu_seqlens([ROW_CU[r] for r in rows], SEQ)


def linear_slopes(pattern: str, heads: int) -> dict:
    return {i: decay_slopes(heads, "long_range", layer_number=i + 1, num_layers=len(pattern))
            for i, c in enumerate(pattern) if c == "L"}


def references(model, heads: int, groups: int) -> dict:
    """On a 1×1×1 ``model`` (its initial state): the plain-torch reference and the model's own
    THD run on the whole global batch (per-token loss row, mean, gradients)."""
    from sp_train.reduce import global_token_mean
    tokens = megatron_batch(slice(0, len(ROW_CU)))["tokens"]
    pattern = model.sp_layer_pattern
    sd = {n: t.detach().clone() for n, t in model.state_dict().items()
          if isinstance(t, torch.Tensor)}
    plain = packed_reference(sd, tokens, ROW_CU, pattern, heads, groups,
                             linear_slopes(pattern, heads))
    loss, mask, plan = run(model, slice(0, len(ROW_CU)))
    share = global_token_mean(loss, mask, None)
    share.backward()
    own = (plan.unshard([(loss * mask).detach()]).view(-1), share.item(),
           {n: p.grad.detach().clone() for n, p in model.named_parameters()})
    model.zero_grad(set_to_none=True)
    return {"plain": plain, "cp1": own}


def check_unlinked_refused(model, rows: slice) -> None:
    """A core attention build_gpt_model did not link (a prebuilt spec under Megatron-LM's own
    RoPE and THD split) refuses a THD batch at CP > 1, on every rank, before communicating."""
    import pytest
    from megatron_patches.core_attention import _UNLINKED
    from megatron_patches.pretrain_gpt import get_batch
    ca = model.decoder.layers[0].self_attention.core_attention
    linked, ca.packed_rope = ca.packed_rope, _UNLINKED
    b = get_batch(iter([megatron_batch(rows)]), model.sp_context, eod=EOD, device="cpu")
    try:
        with pytest.raises(ValueError, match="build_gpt_model"):
            model(b["tokens"], b["position_ids"], None, packed_seq_params=b["packed_seq_params"])
    finally:
        ca.packed_rope = linked


def check(model, refs: dict, tp_rank: int, tp: int, dp_rank: int, dp: int, tag: str) -> float:
    """The model at its layout (TP×CP×DP groups initialised) against both references; returns
    the worst gradient error."""
    from megatron_patches.model import _tp_slice, grad_reduce_group
    from sp_train.reduce import global_token_mean
    per = len(ROW_CU) // dp
    rows = slice(dp_rank * per, (dp_rank + 1) * per)
    loss, mask, plan = run(model, rows)
    rank = model.sp_context.rank
    if model.sp_context.world_size > 1:
        check_unlinked_refused(model, rows)
    share = global_token_mean(loss, mask, grad_reduce_group())
    share.backward()
    all_reduce_gradients(model.parameters(), grad_reduce_group())
    total = share.detach().double().clone()
    dist.all_reduce(total, group=grad_reduce_group())
    worst = 0.0
    for name, ref in refs.items():
        ref_loss, ref_mean, ref_grads = ref
        span = slice(rows.start * SEQ, rows.stop * SEQ)
        want = plan.shard(ref_loss.view(1, -1)[:, span].to(loss.dtype), rank, dim=1)
        err = rel_rms(loss * mask, want)
        assert err <= LOSS_RTOL, (tag, name, "token loss", err)
        err = abs(total.item() - ref_mean) / ref_mean
        assert err <= LOSS_RTOL, (tag, name, "mean loss", total.item(), ref_mean)
        for pname, p in model.named_parameters():
            want = ref_grads[pname]
            if getattr(p, "tensor_model_parallel", False) and tp > 1:
                want = _tp_slice(want, p.partition_dim, getattr(p, "partition_stride", 1),
                                 tp_rank, tp)
            err = rel_rms(p.grad, want.to(p.grad.dtype))
            assert err <= GRAD_RTOL, (tag, name, pname, err)
            worst = max(worst, err)
    return worst

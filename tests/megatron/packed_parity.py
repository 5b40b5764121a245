"""Packed documents (THD) in Megatron-Core models at TP×CP×DP, run inside the parity spawns
of test_megatron_parity.py (no spawn of its own).

The global batch is two rows of ``SEQ`` tokens, each holding several documents (lengths 1 to
``SEQ``, documents crossing CP ranks and documents whole on one rank). A DP rank's micro-batch
is its rows laid end to end as one THD row (``megatron_patches.packing.pack_batch``). Compared
at every rank: the per-token loss at real targets and the global mean loss (1e-6 relative) and
every parameter gradient (1e-5) against (a) the independent plain-torch model of
``plain_gpt.py`` run on each document alone (fp64) and (b) the same Megatron model at 1×1×1
on the whole global batch as one THD row.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from sp_attention.linear.slopes import decay_slopes
from sp_attention.reduce import all_reduce_gradients
from sp_attention.testing import rel_rms

from plain_gpt import packed_reference

SEQ, VOCAB = 24, 64
# document boundaries of each row: 1-token documents, long ones crossing CP ranks, short ones
# whole on one rank, at every layout tested (P = 2, 3, 4; DP 1 and 2)
ROW_CU = [[0, 1, 7, 8, 19, 24], [0, 21, 22, 24]]
LOSS_RTOL, GRAD_RTOL = 1e-6, 1e-5


def rows_and_labels():
    """``(tokens [2, SEQ], labels [2, SEQ])``: labels are the next token inside the document,
    -100 at each document's last token."""
    tokens = torch.randint(0, VOCAB, (len(ROW_CU), SEQ), generator=torch.Generator().manual_seed(3))
    labels = torch.full_like(tokens, -100)
    for r, cu in enumerate(ROW_CU):
        for a, b in zip(cu[:-1], cu[1:]):
            labels[r, a:b - 1] = tokens[r, a + 1:b]
    return tokens, labels


def micro_batch_cu(rows: range) -> torch.Tensor:
    """Boundaries of ``rows`` laid end to end."""
    out = [0]
    for i, r in enumerate(rows):
        out += [i * SEQ + c for c in ROW_CU[r][1:]]
    return torch.tensor(out, dtype=torch.int32)


def linear_slopes(pattern: str, heads: int) -> dict:
    return {i: decay_slopes(heads, "long_range", layer_number=i + 1, num_layers=len(pattern))
            for i, c in enumerate(pattern) if c == "L"}


def references(model, heads: int, groups: int) -> dict:
    """On a 1×1×1 ``model`` (its initial state): the plain-torch reference and the model's own
    THD run on the whole global batch (per-token loss row, mean, gradients)."""
    from megatron_patches.model import global_loss_share
    from megatron_patches.packing import pack_batch
    tokens, labels = rows_and_labels()
    pattern = model.sp_layer_pattern
    sd = {n: t.detach().clone() for n, t in model.state_dict().items()
          if isinstance(t, torch.Tensor)}
    plain = packed_reference(sd, tokens, ROW_CU, pattern, heads, groups,
                             linear_slopes(pattern, heads))
    local, params, plan = pack_batch({"tokens": tokens, "labels": labels},
                                     micro_batch_cu(range(len(ROW_CU))), model.sp_context,
                                     pad_values={"labels": -100})
    loss = model(local["tokens"], local["position_ids"], None, labels=local["labels"],
                 packed_seq_params=params)
    share = global_loss_share(loss, local["labels"], None)
    share.backward()
    real = local["labels"] != -100
    own = (plan.unshard([(loss * real).detach()]), share.item(),
           {n: p.grad.detach().clone() for n, p in model.named_parameters()})
    model.zero_grad(set_to_none=True)
    return {"plain": plain, "cp1": own}


def check(model, refs: dict, tp_rank: int, tp: int, dp_rank: int, dp: int, tag: str) -> float:
    """The model at its layout (TP×CP×DP groups initialised) against both references; returns
    the worst gradient error."""
    from megatron_patches.model import _tp_slice, global_loss_share, grad_reduce_group
    from megatron_patches.packing import pack_batch
    tokens, labels = rows_and_labels()
    per = len(ROW_CU) // dp
    rows = range(dp_rank * per, (dp_rank + 1) * per)
    local, params, plan = pack_batch({"tokens": tokens[rows.start:rows.stop],
                                      "labels": labels[rows.start:rows.stop]},
                                     micro_batch_cu(rows), model.sp_context,
                                     pad_values={"labels": -100})
    loss = model(local["tokens"], local["position_ids"], None, labels=local["labels"],
                 packed_seq_params=params)
    real = local["labels"] != -100
    rank = model.sp_context.rank
    share = global_loss_share(loss, local["labels"], grad_reduce_group())
    share.backward()
    all_reduce_gradients(model.parameters(), grad_reduce_group())
    total = share.detach().double().clone()
    dist.all_reduce(total, group=grad_reduce_group())
    worst = 0.0
    for name, ref in refs.items():
        ref_loss, ref_mean, ref_grads = ref
        span = slice(rows.start * SEQ, rows.stop * SEQ)
        want = plan.shard(ref_loss.view(1, -1)[:, span].to(loss.dtype), rank, dim=1)
        err = rel_rms(loss * real, want)
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

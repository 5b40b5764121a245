"""Batches and loss for a causal LM whose sequence is split over a CP group.

Every CP rank holds the same *global* batch (as a Megatron-style data loader gives it) and keeps
its own shard. Done in this order, the shards reproduce the unsharded model exactly:

1. refuse what causal CP attention cannot honour (left padding, holes) — checked on the global
   batch, which every rank holds, so every rank raises alike;
2. mask padded tokens out of the labels, then shift the labels on the *global* sequence (the
   target of a shard's last token lives on the next shard);
3. right-pad to the layout's multiple (2P for zigzag, P for contiguous) with ignored labels;
4. shard ``input_ids`` and labels, and give each rank the *global* positions of its tokens.

Packed batches, as ``transformers.DataCollatorWithFlattening`` makes them (one row of several
documents; ``position_ids`` restarting per document, and with ``return_flash_attn_kwargs=True``
``cu_seq_lens_q/k`` and ``max_length_q/k``): the row's boundaries give the batch's
:class:`~sp_attention.PackingPlan` (in :func:`sp_attention.planning.packing.packing_context` of the
model's context), labels are shifted inside each document, the row is cut by the plan, and
the plan travels with the batch to the attention function (``model_inputs()``: the forward
kwarg ``sp_packing_plan``, beside the boundaries as HF's flash kwargs ``cu_seq_lens_q/k``):
attention stays inside each document on every rank.

The loss of the global batch is ``Σ token losses / global count of real tokens``; each rank
computes its share with :func:`sp_attention.tokens.global_token_mean`, and summing gradients
over DP × CP (:func:`sp_train.reduce.all_reduce_gradients`) gives the unsharded gradient.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from sp_attention import (SPContext, pad_for_layout, shard_position_ids, shard_sequence,
                          shift_labels)
from sp_attention.planning.packing import PackingPlan, packing_context, plan_packing
from sp_attention.tokens import global_token_mean

from .attention import PLAN_KWARG

__all__ = ["CPBatch", "prepare_cp_batch", "causal_lm_loss", "global_loss_value"]


@dataclass
class CPBatch:
    """This rank's shard of a global causal-LM batch.

    Attributes:
        input_ids: ``[B, T_local]`` token ids (padded tokens carry ``pad_token_id``).
        position_ids: ``[B, T_local]`` int64 *global* positions of those tokens (for RoPE).
        labels: ``[B, T_local]`` next-token targets, already shifted on the global sequence;
            ``ignore_index`` at padding, at ignored labels and at each sequence's last token.
        seq_len: global length after padding to the layout's multiple.
        ignore_index: the label value that carries no loss.
        plan: packed batches: the row's :class:`~sp_attention.PackingPlan` (None: unpacked).
        cu_seqlens: packed batches: the row's boundaries (int32, CPU), what
            :meth:`model_inputs` hands the attention function as ``cu_seq_lens_q/k``.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    seq_len: int
    ignore_index: int = -100
    plan: Optional[PackingPlan] = None
    cu_seqlens: Optional[torch.Tensor] = None

    @property
    def loss_mask(self) -> torch.Tensor:
        """``[B, T_local]`` bool, True where a label counts in the loss."""
        return self.labels != self.ignore_index

    def model_inputs(self) -> dict:
        """Keyword arguments for the prepared model: ``model(**batch.model_inputs())`` (packed:
        also the global row's boundaries as HF's ``cu_seq_lens_q/k``, ``max_length_q/k``, and
        the batch's plan, ``sp_packing_plan``, which reaches every attention call: the plan is
        built once per batch, here)."""
        out = {"input_ids": self.input_ids, "position_ids": self.position_ids}
        if self.plan is not None:
            cu = self.plan.cu_seqlens
            longest = max(b - a for a, b in zip(cu, cu[1:]))
            out.update(cu_seq_lens_q=self.cu_seqlens, cu_seq_lens_k=self.cu_seqlens,
                       max_length_q=longest, max_length_k=longest)
            out[PLAN_KWARG] = self.plan
        return out


def _check_mask(attention_mask: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    if attention_mask.shape != shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must be the 2-D [B, T] "
                         f"padding mask of input_ids {tuple(shape)}; 4-D or custom masks cannot "
                         "be honoured by causal context-parallel attention")
    if attention_mask.dtype != torch.bool and not bool(((attention_mask == 0) |
                                                        (attention_mask == 1)).all()):
        raise ValueError("attention_mask must hold only 0 and 1")
    m = attention_mask.to(torch.int64)
    if m.shape[1] > 1 and bool((m[:, 1:] > m[:, :-1]).any()):
        raise ValueError("attention_mask has padding before real tokens (left padding, or holes "
                         "from packing); causal context-parallel attention honours only right "
                         "padding — right-pad the batch (tokenizer padding_side='right')")
    return m.bool()


def _check_positions(position_ids: torch.Tensor, shape: torch.Size) -> None:
    expected = torch.arange(shape[1], device=position_ids.device)
    if position_ids.shape[-1] != shape[1] or not bool((position_ids == expected).all()):
        raise ValueError("position_ids of an unpacked batch must be arange(T) in every row "
                         "(the CP layout gives each rank its tokens' global positions); "
                         "positions that restart per document mean a packed row")


def _starts(position_ids: torch.Tensor) -> list[int]:
    """Where a new document starts in one row of positions (HF's rule: a step other than +1)."""
    jumps = torch.nonzero(position_ids[1:] - position_ids[:-1] != 1).squeeze(1) + 1
    return [0] + jumps.tolist()


def _packed_boundaries(input_ids, position_ids, cu_seq_lens_q, cu_seq_lens_k,
                       attention_mask) -> Optional[tuple[int, ...]]:
    """The packed row's boundaries (None: not packed), from ``cu_seq_lens_q/k`` or from
    ``position_ids`` that restart; both given must agree."""
    if cu_seq_lens_k is not None and (cu_seq_lens_q is None or
                                      not torch.equal(cu_seq_lens_k.cpu(), cu_seq_lens_q.cpu())):
        raise ValueError("cu_seq_lens_k must equal cu_seq_lens_q: causal self-attention over "
                         "packed documents has one set of boundaries")
    from_pos = None
    if position_ids is not None:
        if position_ids.shape != input_ids.shape:
            raise ValueError(f"position_ids {tuple(position_ids.shape)} must match input_ids "
                             f"{tuple(input_ids.shape)}")
        rows = [_starts(r) for r in position_ids]
        if any(len(r) > 1 for r in rows):
            if len(rows) != 1:
                raise ValueError("position_ids restart inside rows of a batch of "
                                 f"{len(rows)} rows: packed documents go in ONE row "
                                 "(transformers.DataCollatorWithFlattening), or give each "
                                 "sequence its own padded row with positions arange(T)")
            from_pos = tuple(rows[0]) + (input_ids.shape[1],)
    if cu_seq_lens_q is None and from_pos is None:
        return None
    if input_ids.shape[0] != 1:
        raise ValueError(f"cu_seq_lens_q describes one packed row; input_ids has "
                         f"{input_ids.shape[0]} rows: flatten them into one "
                         "(transformers.DataCollatorWithFlattening)")
    if attention_mask is not None:
        raise ValueError("a packed row carries its boundaries; pass no attention_mask with "
                         "cu_seq_lens_q / restarting position_ids")
    cu = from_pos if cu_seq_lens_q is None else tuple(int(x) for x in cu_seq_lens_q.tolist())
    if from_pos is not None and cu != from_pos:
        raise ValueError(f"cu_seq_lens_q {list(cu)} and the documents position_ids restart at "
                         f"{list(from_pos)} disagree; pass one of them")
    return cu


def _prepare_packed(input_ids, ctx, labels, position_ids, cu, pad_token_id,
                    ignore_index) -> CPBatch:
    pctx = packing_context(ctx)
    ids, _ = pad_for_layout(input_ids, pctx, dim=1, value=pad_token_id)
    plan = plan_packing(cu, pctx, row_len=ids.shape[1])
    labels, _ = pad_for_layout(labels, pctx, dim=1, value=ignore_index)
    targets = plan.shift_labels(labels, ignore_index=ignore_index)
    if position_ids is None:
        positions = plan.position_ids(pctx.rank, input_ids.device).unsqueeze(0)
    else:
        positions = plan.shard(pad_for_layout(position_ids, pctx, dim=1)[0], pctx.rank, dim=1)
    return CPBatch(plan.shard(ids, pctx.rank, dim=1), positions,
                   plan.shard(targets, pctx.rank, dim=1), ids.shape[1], ignore_index, plan,
                   torch.tensor(cu, dtype=torch.int32))


def prepare_cp_batch(input_ids: torch.Tensor, ctx: SPContext, *,
                     labels: Optional[torch.Tensor] = None,
                     attention_mask: Optional[torch.Tensor] = None,
                     position_ids: Optional[torch.Tensor] = None, pad_token_id: int = 0,
                     ignore_index: int = -100, cu_seq_lens_q: Optional[torch.Tensor] = None,
                     cu_seq_lens_k: Optional[torch.Tensor] = None,
                     max_length_q: Optional[int] = None, max_length_k: Optional[int] = None,
                     seq_idx: Optional[torch.Tensor] = None) -> CPBatch:
    """Shard a *global* causal-LM batch for this CP rank (see the module docstring).

    Args:
        input_ids: ``[B, T]`` the global batch, identical on every rank of the CP group.
        ctx: the model's SPContext (``prepare_model_for_cp(...).ctx``).
        labels: ``[B, T]`` unshifted targets in HF's convention (``ignore_index`` where no loss);
            default ``input_ids``.
        attention_mask: ``[B, T]`` 1 at real tokens; only right padding is allowed.
        position_ids: optional; ``arange(T)`` per row, or positions restarting per document
            in one packed row (``DataCollatorWithFlattening``; then a packed batch).
        pad_token_id: filler id for the layout padding.
        ignore_index: label value that carries no loss.
        cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, seq_idx: the
            ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` outputs: the packed
            row's document boundaries (``prepare_cp_batch(ctx=ctx, **collated)`` works).

    Packed batches (one row, ``B = 1``): labels are shifted inside each document (a document's
    last token has no target), the row is cut by its packing plan, ``position_ids`` are the
    given ones cut alike (or restart per document), and :meth:`CPBatch.model_inputs` passes
    the boundaries on as ``cu_seq_lens_q/k``.

    Raises ValueError for shapes other than ``[B, T]``, left padding, holes, packed rows with a
    padding mask or in a batch of several rows, boundaries that disagree with the positions,
    before any collective (the checks see only the global batch, identical on every rank).
    """
    if not isinstance(ctx, SPContext):
        raise TypeError(f"ctx must be an SPContext (prepare_model_for_cp(...).ctx), got "
                        f"{type(ctx).__name__}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("input_ids must be a [B, T] tensor of the global batch")
    labels = input_ids if labels is None else labels
    if labels.shape != input_ids.shape:
        raise ValueError(f"labels {tuple(labels.shape)} must match input_ids "
                         f"{tuple(input_ids.shape)}")
    del max_length_q, max_length_k, seq_idx       # implied by the boundaries
    cu = _packed_boundaries(input_ids, position_ids, cu_seq_lens_q, cu_seq_lens_k,
                            attention_mask)
    if cu is not None:
        return _prepare_packed(input_ids, ctx, labels, position_ids, cu, pad_token_id,
                               ignore_index)
    if position_ids is not None:
        _check_positions(position_ids, input_ids.shape)
    labels = labels.clone()
    if attention_mask is not None:
        real = _check_mask(attention_mask, input_ids.shape)
        labels[~real] = ignore_index           # a pad is never a target ...
    targets = shift_labels(labels, ignore_index=ignore_index)   # ... before the global shift
    ids, _ = pad_for_layout(input_ids, ctx, dim=1, value=pad_token_id)
    targets, _ = pad_for_layout(targets, ctx, dim=1, value=ignore_index)
    seq_len = ids.shape[1]
    positions = shard_position_ids(seq_len, ctx, device=input_ids.device)
    local_ids = shard_sequence(ids, ctx, dim=1)
    return CPBatch(local_ids, positions.unsqueeze(0).expand(ids.shape[0], -1).contiguous(),
                   shard_sequence(targets, ctx, dim=1), seq_len, ignore_index)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor,
                   group: Optional[dist.ProcessGroup], *, ignore_index: int = -100
                   ) -> torch.Tensor:
    """This rank's share of the global token-mean cross entropy.

    ``logits [B, T_local, V]`` (any float dtype; the loss is computed in fp32),
    ``labels [B, T_local]`` from :class:`CPBatch` (already shifted). ``group``: the ranks whose
    tokens make up one global batch — the CP group, or DP × CP when data parallelism is used too
    (None: this process only). Returns ``Σ local token losses / global count of real tokens``;
    backpropagate it, then sum gradients over DP × CP with
    ``sp_train.reduce.all_reduce_gradients(model.parameters(), dp_cp_group)``. Log
    :func:`global_loss_value`.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} must "
                         "agree on [B, T_local]")
    token_loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                 ignore_index=ignore_index, reduction="none")
    return global_token_mean(token_loss, labels.reshape(-1) != ignore_index, group)


def global_loss_value(loss_share: torch.Tensor, group: Optional[dist.ProcessGroup]) -> float:
    """The global mean loss (for logging): the sum of every rank's share. A collective: call it
    on every rank of ``group``."""
    value = loss_share.detach().to(torch.float64).clone()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(value, group=group)
    return float(value.item())

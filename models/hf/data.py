"""Batches and loss for a causal LM whose sequence is split over a CP group.

Every CP rank holds the same *global* batch (as a Megatron-style data loader gives it) and keeps
its own shard. Done in this order, the shards reproduce the unsharded model exactly:

1. refuse what causal CP attention cannot honour (left padding, holes, packed sequences) —
   checked on the global batch, which every rank holds, so every rank raises alike;
2. mask padded tokens out of the labels, then shift the labels on the *global* sequence (the
   target of a shard's last token lives on the next shard);
3. right-pad to the layout's multiple (2P for zigzag, P for contiguous) with ignored labels;
4. shard ``input_ids`` and labels, and give each rank the *global* positions of its tokens.

The loss of the global batch is ``Σ token losses / global count of real tokens``; each rank
computes its share with :func:`sp_attention.reduce.global_token_mean`, and summing gradients
over DP × CP (:func:`sp_attention.reduce.all_reduce_gradients`) gives the unsharded gradient.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from sp_attention import (SPContext, pad_for_layout, shard_position_ids, shard_sequence,
                          shift_labels)
from sp_attention.reduce import global_token_mean

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
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    seq_len: int
    ignore_index: int = -100

    @property
    def loss_mask(self) -> torch.Tensor:
        """``[B, T_local]`` bool, True where a label counts in the loss."""
        return self.labels != self.ignore_index

    def model_inputs(self) -> dict:
        """Keyword arguments for the prepared model: ``model(**batch.model_inputs())``."""
        return {"input_ids": self.input_ids, "position_ids": self.position_ids}


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
        raise ValueError("position_ids must be arange(T) in every row; restarting positions mean "
                         "packed sequences, which context-parallel attention does not support "
                         "(it would let tokens attend across sequence boundaries) — put each "
                         "sequence in its own padded row")


def prepare_cp_batch(input_ids: torch.Tensor, ctx: SPContext, *,
                     labels: Optional[torch.Tensor] = None,
                     attention_mask: Optional[torch.Tensor] = None,
                     position_ids: Optional[torch.Tensor] = None, pad_token_id: int = 0,
                     ignore_index: int = -100) -> CPBatch:
    """Shard a *global* causal-LM batch for this CP rank (see the module docstring).

    Args:
        input_ids: ``[B, T]`` the global batch, identical on every rank of the CP group.
        ctx: the model's SPContext (``prepare_model_for_cp(...).ctx``).
        labels: ``[B, T]`` unshifted targets in HF's convention (``ignore_index`` where no loss);
            default ``input_ids``.
        attention_mask: ``[B, T]`` 1 at real tokens; only right padding is allowed.
        position_ids: optional; must be ``arange(T)`` per row (anything else is packing).
        pad_token_id: filler id for the layout padding.
        ignore_index: label value that carries no loss.

    Raises ValueError for shapes other than ``[B, T]``, left padding, holes or packed positions,
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
    labels = labels.clone()
    if attention_mask is not None:
        real = _check_mask(attention_mask, input_ids.shape)
        labels[~real] = ignore_index           # a pad is never a target ...
    if position_ids is not None:
        _check_positions(position_ids, input_ids.shape)
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
    ``sp_attention.reduce.all_reduce_gradients(model.parameters(), dp_cp_group)``. Log
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

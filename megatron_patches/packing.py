"""Packed documents in Megatron-Core models: THD ``PackedSeqParams`` and the library's plan.

Megatron's packed path hands core attention ``packed_seq_params`` with ``qkv_format="thd"``
(the micro-batch flattened into one row, query ``[t, np, hn]``) and the boundaries of that
row's documents, ``cu_seqlens_q/kv`` (and their ``_padded`` forms, TransformerEngine's), the same
on every CP rank. A batch cut by :func:`pack_batch` (our launcher's, train.py's) carries
its :class:`~sp_attention.PackingPlan` on that object (``params.packing_plan``, set where the
batch is built: :func:`packed_seq_params`), and every layer uses it (:func:`plan_of`: no
lookup, no planning). A batch built outside the project has only its boundaries: its plan is
found from them through ``sp_attention.planning.packing``'s tensor-keyed cache (every layer of a batch
shares one plan, a CUDA tensor costs one copy per batch). Data, attention and RoPE agree on
where every token lies.

How this differs from Megatron's ``get_batch_on_this_cp_rank``: Megatron (with
TransformerEngine) cuts *every* document into ``2·CP`` pieces, each padded to a multiple of
``2·CP``, and gives rank r pieces r and ``2·CP−1−r`` of each; our plan keeps short documents
whole on one rank, cuts only the long ones the balance needs, and pads only the row's end
(``sp_attention/packing.py``). The shards therefore differ, and a batch for our attention
must be cut by :func:`pack_batch` (our launcher and train.py do), never by Megatron's THD
split. On one rank the plan keeps the row's order (:func:`sp_attention.planning.packing.
packing_context`), so Megatron's own packed batches work unchanged at CP = 1.

Boundaries: ``cu_seqlens_q_padded`` when given (then each document's padding is its own tail:
its real tokens never see it, mask it out of the loss as Megatron's packed datasets do), else
``cu_seqlens_q``; tokens past the last boundary are padding. The row is ``CP × t`` tokens.
"""
from __future__ import annotations

from typing import Optional

import torch

from sp_attention import SPContext
from sp_attention.planning.layout import num_chunks
from sp_attention.planning.packing import PackingPlan, packing_context, plan_packing, resolve_plan

__all__ = ["THD", "PLAN_ATTRIBUTE", "plan_of", "check_packed_seq_params", "packed_seq_params", "eod_cu_seqlens",
           "rows_cu_seqlens", "pack_batch"]

THD = "thd"
# The attribute of Megatron's PackedSeqParams a batch's PackingPlan travels under.
PLAN_ATTRIBUTE = "packing_plan"


def _boundaries(params, which: str) -> Optional[torch.Tensor]:
    padded = getattr(params, f"cu_seqlens_{which}_padded", None)
    return padded if padded is not None else getattr(params, f"cu_seqlens_{which}", None)


def check_packed_seq_params(params) -> torch.Tensor:
    """The boundaries tensor of Megatron ``PackedSeqParams`` our attention honours (raises,
    naming the fix, for what it cannot)."""
    fmt = getattr(params, "qkv_format", None)
    if fmt != THD:
        raise ValueError(f"packed_seq_params.qkv_format={fmt!r}: the CP attention takes packed "
                         "documents as Megatron's THD batches (qkv_format='thd', cu_seqlens of "
                         "the whole packed row); pass qkv_format='thd' or no packed_seq_params")
    if getattr(params, "local_cp_size", None) not in (None, 0):
        raise ValueError("packed_seq_params.local_cp_size (Megatron's dynamic CP) is not "
                         "supported: the CP attention spans the model's CP group; leave it None")
    cu = _boundaries(params, "q")
    if cu is None:
        raise ValueError("packed_seq_params has neither cu_seqlens_q nor cu_seqlens_q_padded: "
                         "give the document boundaries of the packed row")
    return cu


def plan_of(params, ctx: SPContext, local_len: int, device=None) -> PackingPlan:
    """The :class:`~sp_attention.PackingPlan` of a THD batch whose rank shards hold
    ``local_len`` tokens each (the row: ``CP × local_len`` tokens), in
    :func:`~sp_attention.planning.packing.packing_context` of ``ctx``: the plan the batch carries
    (``params.packing_plan``, :func:`pack_batch`'s; checked against ``ctx`` and the length
    only), else the plan of its boundaries (a batch built outside the project: cached by the
    boundaries tensor, so the layers of one batch share it; new values cost one host copy)."""
    cu = check_packed_seq_params(params)
    pctx = packing_context(ctx)
    row = pctx.world_size * local_len
    carried = getattr(params, PLAN_ATTRIBUTE, None)
    try:
        plan = resolve_plan(cu if carried is None else carried, pctx, local_len, device=device,
                            row_len=row)
    except ValueError as e:
        raise ValueError(f"packed_seq_params: {e} (the THD row is CP × t = {pctx.world_size} × "
                         f"{local_len} tokens; cut batches with "
                         "megatron_patches.packing.pack_batch)") from None
    cu_kv = _boundaries(params, "kv")
    if cu_kv is not None and cu_kv is not cu and \
            resolve_plan(cu_kv, pctx, local_len, device=device, row_len=row) is not plan:
        raise ValueError("packed_seq_params: cu_seqlens_kv differs from cu_seqlens_q; self-"
                         "attention over packed documents needs the same boundaries for both")
    return plan


def packed_seq_params(cu_seqlens: torch.Tensor, device=None,
                      plan: Optional[PackingPlan] = None):
    """Megatron ``PackedSeqParams`` (THD) for a packed row with document boundaries
    ``cu_seqlens`` (``[N+1]``, the same on every rank), as int32 on ``device`` (None: the CPU,
    where our attention reads them without a device sync). ``plan``: the row's packing plan
    (of these boundaries), carried to every core attention as ``params.packing_plan``."""
    from megatron.core.packed_seq_params import PackedSeqParams
    cu = cu_seqlens.to(device=device, dtype=torch.int32)
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    params = PackedSeqParams(qkv_format=THD, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    if plan is not None:
        if tuple(plan.cu_seqlens) != tuple(int(c) for c in cu_seqlens.tolist()):
            raise ValueError(f"the plan's boundaries {plan.cu_seqlens} are not cu_seqlens "
                             f"{cu_seqlens.tolist()}: pass the plan of these boundaries")
        setattr(params, PLAN_ATTRIBUTE, plan)
    return params


def eod_cu_seqlens(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """Document boundaries (int32, CPU) of the rows of ``tokens [b, s]`` laid end to end: every
    row ends a document, and so does every end-of-document token (the EOD belongs to the
    document it ends: Megatron's ``--reset-attention-mask`` rule)."""
    ends = tokens.detach().cpu() == eod
    ends[:, -1] = True
    stops = (torch.nonzero(ends.reshape(-1)).squeeze(1) + 1).tolist()
    return torch.tensor([0] + stops, dtype=torch.int32)


def rows_cu_seqlens(rows_cu, row_len: int) -> torch.Tensor:
    """Boundaries (int32, CPU) of rows of ``row_len`` tokens laid end to end, from each row's
    own boundaries ``rows_cu[i]`` (``0 … row_len``)."""
    out = [0]
    for i, cu in enumerate(rows_cu):
        if cu[0] != 0 or cu[-1] != row_len:
            raise ValueError(f"row {i}'s boundaries {list(cu)} must run from 0 to {row_len}")
        out += [i * row_len + int(c) for c in cu[1:]]
    return torch.tensor(out, dtype=torch.int32)


def pack_batch(tensors: dict, cu_seqlens, ctx: SPContext, *, pad_values: Optional[dict] = None,
               device=None) -> tuple[dict, object, PackingPlan]:
    """Cut a packed micro-batch for this rank: the rows of each ``tensors[name] [b, s]`` are
    laid end to end into one row of ``b·s`` tokens whose documents are ``cu_seqlens``, padded
    to the layout's multiple, and sharded by the plan. Returns ``(local, params, plan)``:
    ``local[name] [1, L]`` on ``device`` (plus ``position_ids``: each token's position inside
    its document), Megatron ``PackedSeqParams`` (THD; boundaries on the CPU) and the plan.
    ``pad_values[name]`` fills plan padding (default 0; give labels ``-100`` or a zero loss
    mask). The params carry the plan (``params.packing_plan``) to every core attention."""
    pctx = packing_context(ctx)
    pad_values = pad_values or {}
    n = num_chunks(pctx.world_size, pctx.layout)
    local, rows = {}, None
    for name, x in tensors.items():
        if x.dim() != 2 or (rows is not None and x.shape != rows):
            raise ValueError(f"{name} {tuple(x.shape)}: pack_batch takes [b, s] tensors of one "
                             "shape")
        rows = x.shape
    total = rows[0] * rows[1]
    plan = plan_packing(cu_seqlens, pctx, row_len=-(-total // n) * n)
    for name, x in tensors.items():
        local[name] = plan.shard(x.reshape(1, total), pctx.rank, dim=1,
                                 pad_value=pad_values.get(name, 0)).to(device)
    local["position_ids"] = plan.position_ids(pctx.rank, device).unsqueeze(0)
    cu = cu_seqlens if isinstance(cu_seqlens, torch.Tensor) else torch.tensor(cu_seqlens)
    return local, packed_seq_params(cu, plan=plan), plan

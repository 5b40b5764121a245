"""A language-model loss that never holds the full-vocabulary logits: chunked linear + cross
entropy, vocabulary-parallel under TP.

Why: the output layer's logits are ``[T, V]``; at 32K tokens × 128256 (Llama-3's vocabulary)
the plain path (bf16 logits, fp32 copy, softmax, gradient) peaks at 62.6 GiB on one H200 and is
the allocation that fails first at 48K (measured on one H200). Here the tokens are walked in chunks of
``chunk_tokens``: per chunk the logits ``h_c Wᵀ`` are formed, reduced to the per-token loss,
turned into the logits' gradient ``(softmax − onehot)`` and consumed at once by the two GEMMs
of the backward (``dh_c = g Wᵀ``, ``dW += gᵀ h_c``), so the only ``[·, V]`` tensor ever alive is
one chunk's. Gradients are computed in the forward (as Liger-Kernel's fused linear cross
entropy does): the loss is the **sum** over the kept tokens, so the backward only scales ``dh``
and ``dW`` by the incoming scalar — three GEMMs in all, as many as the plain path.

Under TP the weight is the TP rank's vocabulary shard ``[V/TP, h]`` (Megatron's
``ColumnParallelLinear`` output layer; rank r holds ids ``[r·V/TP, (r+1)·V/TP)``), as
Megatron's ``vocab_parallel_cross_entropy`` does: per chunk one all-reduce (max) of the row
maxima and one (sum) of the rescaled exp-sums and target logits over the TP group; ``dh`` is
summed over TP once at the end (what ``ColumnParallelLinear``'s input all-reduce does in its
backward). Every TP rank holds the same labels and hidden states (no sequence parallelism).

Math per token t with label y (ignored tokens: loss 0, no gradient)::

    m = max_v z_v        s = Σ_v exp(z_v − m)       loss_t = m + log s − z_y
    ∂loss_t/∂z_v = exp(z_v − m) / s − [v = y]

Layers: the chunk routines (``_chunk_torch``; on CUDA the Triton kernels of
:mod:`.loss_kernels`) → :class:`_LinearCrossEntropy` → :func:`linear_cross_entropy`.
Reference: :func:`linear_cross_entropy_ref` (full logits, ``F.cross_entropy``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from sp_attention.precision import acc_dtype
from sp_attention.tokens import global_token_count

__all__ = ["linear_cross_entropy", "linear_cross_entropy_ref", "default_chunk_tokens",
           "LOSS_IMPLS", "CHUNK_ELEMENTS", "check_loss_impl", "micro_batch_loss",
           "step_token_count", "local_token_count", "kept_tokens"]

# Budget of one chunk's logits: 2^30 elements (at V = 128256: 8192 tokens, 2 GiB in bf16 on
# the Triton path; 4 GiB fp32 + 2 GiB bf16 on the torch path). Each chunk adds its dW into
# the fp32 [V, h] accumulator (a read and a write of 1 GiB at V = 128256, h = 2048), so fewer,
# larger chunks cost less traffic; benchmarks/loss_bench.py times others (--chunks).
CHUNK_ELEMENTS = 1 << 30

# train.py's --loss-impl values (one home): ours, Liger-Kernel's, Megatron's full-logits loss.
LOSS_IMPLS = ("chunked", "liger", "megatron")


def default_chunk_tokens(vocab_per_rank: int, elements: int = CHUNK_ELEMENTS) -> int:
    """Tokens per chunk so that one chunk's logits hold at most ``elements`` values (a
    multiple of 256 when that many fit, at least 1)."""
    n = max(1, elements // max(1, vocab_per_rank))
    return n - n % 256 if n >= 256 else n


@dataclass(frozen=True)
class _Config:
    tp_group: Optional[dist.ProcessGroup]
    tp_size: int
    vocab_start: int
    ignore_index: int
    chunk_tokens: int
    use_triton: bool
    grad_enabled: bool         # autograd records this call (needs_input_grad ignores no_grad)


def _tp_all_reduce(x: torch.Tensor, cfg: _Config, op=dist.ReduceOp.SUM) -> None:
    if cfg.tp_size > 1:
        dist.all_reduce(x, op=op, group=cfg.tp_group)


def _logits(hc: torch.Tensor, weight: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``hc Wᵀ`` in ``acc`` (fp32/fp64); 16-bit CUDA GEMMs write fp32 directly (no rounding
    to bf16 and no second buffer)."""
    if hc.is_cuda and hc.dtype in (torch.bfloat16, torch.float16) and acc == torch.float32:
        return torch.mm(hc, weight.t(), out_dtype=torch.float32)
    return torch.mm(hc, weight.t()).to(acc)


def _target_logit(z: torch.Tensor, yc: torch.Tensor, cfg: _Config):
    """(``z[t, y_t − start]`` where this rank holds ``y_t`` else 0, that mask, the column)."""
    col = yc - cfg.vocab_start
    here = (col >= 0) & (col < z.shape[1])
    col = torch.where(here, col, torch.zeros_like(col))
    tgt = z.gather(1, col[:, None]).squeeze(1) * here
    return tgt, here, col


def _chunk_torch(hc, weight, yc, cfg: _Config, want_grad: bool):
    """One chunk in torch: (per-token loss [c] in acc dtype, logits' gradient [c, V/TP] in the
    weight's dtype or None). Ignored tokens get loss 0 and a zero gradient row."""
    acc = acc_dtype(hc, weight)
    z = _logits(hc, weight, acc)                                         # [c, Vl]
    tgt, here, col = _target_logit(z, yc, cfg)
    m = z.max(dim=1).values                                              # [c]
    _tp_all_reduce(m, cfg, dist.ReduceOp.MAX)
    z.sub_(m[:, None]).exp_()                                            # z <- exp(z - m)
    st = torch.stack([z.sum(dim=1), tgt])                                # [2, c]
    _tp_all_reduce(st, cfg)
    s, tgt = st[0], st[1]
    valid = yc != cfg.ignore_index
    loss = torch.where(valid, m + s.log() - tgt, torch.zeros_like(s))
    if not want_grad:
        return loss, None
    z.mul_((valid.to(acc) / s)[:, None])                                 # softmax, 0 if ignored
    rows = torch.nonzero(valid & here).squeeze(1)
    z[rows, col[rows]] -= 1.0
    return loss, z.to(weight.dtype)


def _chunk(hc, weight, yc, cfg: _Config, want_grad: bool):
    if cfg.use_triton:
        from .loss_kernels import chunk_triton
        return chunk_triton(hc, weight, yc, cfg, want_grad)
    return _chunk_torch(hc, weight, yc, cfg, want_grad)


def _add_weight_grad(dW: torch.Tensor, g: torch.Tensor, hc: torch.Tensor) -> None:
    """``dW += gᵀ hc`` accumulated in ``dW``'s dtype (fp32 for 16-bit inputs: on CUDA one
    GEMM reads and writes the fp32 accumulator, no parameter-sized temporary)."""
    if g.is_cuda and g.dtype != dW.dtype and dW.dtype == torch.float32:
        torch.addmm(dW, g.t(), hc, out_dtype=torch.float32, out=dW)
    else:
        dW.add_(torch.mm(g.t(), hc).to(dW.dtype))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(fctx, hidden, weight, labels, cfg: _Config):
        need_h = cfg.grad_enabled and fctx.needs_input_grad[0]
        need_w = cfg.grad_enabled and fctx.needs_input_grad[1]
        want = need_h or need_w
        n = hidden.shape[0]
        acc = acc_dtype(hidden, weight)
        losses = torch.empty(n, dtype=acc, device=hidden.device)
        dh = torch.empty_like(hidden) if need_h else None
        dW = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        for a in range(0, n, cfg.chunk_tokens):
            b = min(n, a + cfg.chunk_tokens)
            hc = hidden[a:b]
            losses[a:b], g = _chunk(hc, weight, labels[a:b], cfg, want)
            if need_h:
                torch.mm(g, weight, out=dh[a:b])       # this rank's vocabulary share
            if need_w:
                _add_weight_grad(dW, g, hc)
            del g
        if need_h:
            _tp_all_reduce(dh, cfg)                    # sum of the vocabulary shares
        fctx.save_for_backward(dh, None if dW is None else dW.to(weight.dtype))
        fctx.use_triton = cfg.use_triton
        fctx.mark_non_differentiable(losses)
        return losses.sum(), losses

    @staticmethod
    def backward(fctx, grad_sum, _grad_losses):
        dh, dW = fctx.saved_tensors
        # the scale in fp32 (a 16-bit copy of it would put a ~0.3 % error on every gradient):
        # on CUDA read on the device (no host sync between the forward and the backward);
        # elsewhere a Python float
        if fctx.use_triton:
            from .loss_kernels import scaled
            return (None if dh is None else scaled(dh, grad_sum),
                    None if dW is None else scaled(dW, grad_sum), None, None)
        scale = float(grad_sum)
        return (None if dh is None else dh * scale, None if dW is None else dW * scale,
                None, None)


def _check(hidden, weight, labels, ignore_index, chunk_tokens, tp_size,
           check_labels: bool = True) -> None:
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"hidden must be [T, h] and weight [V/TP, h]; got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)} (flatten the "
                         "sequence and batch dimensions first)")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden size {hidden.shape[1]} != weight's {weight.shape[1]}")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels {tuple(labels.shape)} must be [T] = "
                         f"[{hidden.shape[0]}] (one label per hidden row)")
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"labels must be int64/int32 token ids, got {labels.dtype}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) dtypes differ; "
                         "cast one (the output layer runs in the model's dtype)")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1 (or None: by memory)")
    if check_labels:
        check_label_ids(labels, weight.shape[0] * tp_size, ignore_index)


def check_label_ids(labels: torch.Tensor, vocab: int, ignore_index: int = -100) -> None:
    """Raise for label ids outside ``[0, vocab)`` that are not ``ignore_index`` (one read of the
    result on the host: a device sync for CUDA labels)."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        raise ValueError(f"labels outside [0, {vocab}) that are not ignore_index "
                         f"({ignore_index}): e.g. {int(labels[bad][0])}; check the tokenizer's "
                         "vocabulary against the model's --vocab-size")


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                         ignore_index: int = -100, tp_group: Optional[dist.ProcessGroup] = None,
                         chunk_tokens: Optional[int] = None,
                         use_triton: Optional[bool] = None,
                         check_labels: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of token cross entropies of ``hidden @ weight.T`` against ``labels``, chunked.

    Args:
        hidden: ``[T, h]`` final hidden states (after the final norm), any float dtype.
        weight: ``[V/TP, h]`` output-layer weight of this TP rank (same dtype as ``hidden``);
            rank r of ``tp_group`` holds vocabulary ids ``[r·V/TP, (r+1)·V/TP)``.
        labels: ``[T]`` int token ids in ``[0, V)``, or ``ignore_index`` (no loss, no
            gradient). Identical on every TP rank.
        tp_group: the TP group the vocabulary is split over (None: one rank holds it all).
        chunk_tokens: tokens per chunk; None: :func:`default_chunk_tokens` (one chunk's logits
            ≤ 2^30 values).
        use_triton: the fused row kernels of :mod:`.loss_kernels` (CUDA, 16-bit/fp32);
            None: on CUDA tensors. The torch path computes in fp32 (fp64 for fp64 inputs).
        check_labels: raise for labels outside ``[0, V)`` (not ``ignore_index``); reading that
            on the host syncs with a CUDA device in the middle of the step — pass False when
            the labels were checked before they were copied there (train.py checks its
            batches on the host: :func:`sp_train.data.check_labels`).

    Returns:
        ``(loss_sum, token_losses)``: the differentiable 0-d sum over kept tokens (fp32; fp64
        for fp64 inputs), and the per-token losses ``[T]`` (detached; 0 where ignored). Divide
        the sum by the token count you average over. Gradients reach ``hidden`` and
        ``weight`` (computed in the forward, scaled by the incoming gradient in backward);
        under TP ``hidden``'s gradient is already summed over the group.
    """
    tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
    _check(hidden, weight, labels, ignore_index, chunk_tokens, tp_size, check_labels)
    tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
    if use_triton is None:
        use_triton = hidden.is_cuda and hidden.dtype != torch.float64
    cfg = _Config(tp_group=tp_group, tp_size=tp_size, vocab_start=tp_rank * weight.shape[0],
                  ignore_index=ignore_index,
                  chunk_tokens=chunk_tokens or default_chunk_tokens(weight.shape[0]),
                  use_triton=bool(use_triton), grad_enabled=torch.is_grad_enabled())
    return _LinearCrossEntropy.apply(hidden, weight, labels, cfg)


def linear_cross_entropy_ref(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             ignore_index: int = -100) -> torch.Tensor:
    """Reference (one rank, full logits): ``F.cross_entropy(hidden @ weight.T, labels,
    reduction="sum")`` computed in fp32 (fp64 for fp64 inputs)."""
    acc = acc_dtype(hidden, weight)
    logits = (hidden @ weight.t()).to(acc)
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")


# --- train.py's loss per micro-batch ----------------------------------------------------------
IGNORE_INDEX = -100


def check_loss_impl(impl: str, tp: int, device: torch.device) -> None:
    """Refuse a ``--loss-impl`` this run cannot use (on every rank, before any collective)."""
    if impl not in LOSS_IMPLS:
        raise ValueError(f"--loss-impl {impl!r}: use one of {LOSS_IMPLS}")
    if impl != "liger":
        return
    if tp > 1:
        raise ValueError("--loss-impl liger has no tensor parallelism (its fused linear cross "
                         "entropy needs the whole vocabulary on one rank); use --loss-impl "
                         "chunked (vocabulary-parallel) or --tensor-model-parallel-size 1")
    if device.type != "cuda":
        raise ValueError("--loss-impl liger runs Triton kernels on CUDA only; use --loss-impl "
                         "chunked on CPU")
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        raise ValueError("--loss-impl liger needs Liger-Kernel (pip install liger-kernel); or "
                         "use --loss-impl chunked") from None


def kept_tokens(labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The tokens the mean counts: masked in, and not an ignored target (Megatron's cross
    entropy has no ignore index, see megatron_patches.model.global_loss_share)."""
    return mask * (labels != IGNORE_INDEX).to(mask.dtype)


def local_token_count(micro_batches) -> torch.Tensor:
    """This rank's loss tokens over a step's micro-batches, a 0-d fp64 tensor where they are
    (nothing read back): summed over DP × CP it is :func:`step_token_count`."""
    return torch.stack([kept_tokens(mb[2], mb[3]).sum() for mb in micro_batches]).double().sum()


def step_token_count(micro_batches, dp_cp_group) -> float:
    """The step's loss tokens over all its micro-batches and the DP × CP ranks (one
    all-reduce): what every micro-batch's loss sum is divided by, so the shares add up to the
    step's global token mean however many loss tokens each micro-batch holds (packed rows
    differ)."""
    return global_token_count(local_token_count(micro_batches).view(1), dp_cp_group)


def micro_batch_loss(model, tokens, positions, labels, mask, *, impl: str, tp_group,
                     dp_cp_group, token_count: Optional[float] = None,
                     chunk_tokens: Optional[int] = None, packed_seq_params=None,
                     check_labels: bool = True) -> torch.Tensor:
    """This rank's share of the step's global mean loss from one micro-batch
    (``[b, s/cp]`` tensors): ``Σ masked token losses / token_count``, ``token_count`` the
    step's loss tokens over all micro-batches and DP × CP ranks (:func:`step_token_count`;
    None: this micro-batch's, over DP × CP — a step of one micro-batch). The shares of a step
    add up to its global mean; sum gradients over DP × CP.

    ``impl``: ``megatron`` — the model's own output layer and (on GPUs fused) vocabulary-parallel
    cross entropy over the full logits (the model returns per-token losses); ``chunked`` /
    ``liger`` — the model returns hidden states (``build_gpt_model(return_hidden_states=True)``)
    and :func:`linear_cross_entropy` / Liger-Kernel's fused linear cross entropy applies the
    output layer chunk by chunk. ``packed_seq_params``: Megatron's THD parameters of a packed
    micro-batch (``[1, L]`` tensors; ``megatron_patches.packing.pack_batch``), or None.
    ``check_labels``: :func:`linear_cross_entropy`'s (False: checked on the host already).
    """
    keep = kept_tokens(labels, mask)
    if token_count is None:
        token_count = global_token_count(keep, dp_cp_group)
    if impl == "megatron":
        token_loss = model(tokens, positions, attention_mask=None, labels=labels,
                           packed_seq_params=packed_seq_params)                   # [b, s]
        return (token_loss.float() * keep).sum() / token_count
    from megatron_patches.model import output_weight
    hidden = model(tokens, positions, attention_mask=None,
                   packed_seq_params=packed_seq_params)                          # [s, b, h]
    # labels in the hidden states' [s, b] order; tokens left out get ignore_index
    target = torch.where(keep.bool(), labels, torch.full_like(labels, IGNORE_INDEX))
    target = target.t().reshape(-1)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    weight = output_weight(model)
    if impl == "liger":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
        loss_sum = liger_fused_linear_cross_entropy(hidden, weight, target,
                                                    ignore_index=IGNORE_INDEX, reduction="sum")
    else:
        loss_sum, _ = linear_cross_entropy(hidden, weight, target, ignore_index=IGNORE_INDEX,
                                           tp_group=tp_group, chunk_tokens=chunk_tokens,
                                           check_labels=check_labels)
    return loss_sum.float() / token_count

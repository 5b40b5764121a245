"""Per-rank memory of one training step, predicted from sizes alone (no framework import).

What a rank of a TP × CP × DP layout holds at its peak, for the Llama-style layers of
``train.py`` (Megatron-Core local spec: RMSNorm, SwiGLU MLP, GQA attention with our CP core
attention) — so a launcher can print the estimate *before* allocating anything and refuse a
layout that cannot fit, naming the fix (more CP, recompute, a smaller micro-batch), and a cost
model can rank layouts by it (issue 27).

Terms (bytes; ``N = micro_batch × seq_length / CP`` tokens per rank, ``t`` = TP):

- **weights**, **grads**, **optimizer**: parameters in their dtype, gradients (same dtype),
  fp32 master copies (16-bit runs) and Adam's two fp32 moments — ``train.py``'s
  ``MasterAdamW``. Gradients count in full when several micro-batches accumulate (the first
  micro-batch's gradients are alive during the next one's backward); with one micro-batch
  only the output layer's exists at the peak.
- **activations**: tensors the forward saves for the backward, per layer kind, tallied from
  what Megatron-Core's modules and our attention functions save (``_layer_saved_bytes``; the
  CPU test checks the tally against the tensors a real model saves), reduced by recompute:
  ``selective`` drops the listed modules' internals (the checkpoint keeps their inputs),
  ``full`` keeps one ``[N, h]`` input per checkpointed group and replays one group at a time.
- **loss**: the output layer + cross entropy: the chunked loss holds ``dh [N, h]``, the output
  weight's gradient and one chunk of logits; Megatron's loss holds ``[N, V/t]`` logits in
  16-bit and two fp32 buffers at the end of its forward.
- **workspace**: the largest transient of one layer's backward (the MLP's ``[N, 2·ffn/t]``
  input gradient beside the incoming ``[N, h]`` one; attention kernels' fp32 accumulators and,
  at CP > 1, the ring's in-flight K/V and dK/dV).

The peak is the larger of the forward/backward peak (static + saved activations + the larger
of the loss's forward buffers and its held gradients plus one layer's backward) and the
optimizer step (parameters, gradients, their fp32 copies, masters, moments; + a flat fp32
bucket when gradients are all-reduced over DP × CP). Allocator fragmentation and the CUDA
context are not counted (``torch.cuda.max_memory_allocated`` does not count them either).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .reduce import BUCKET_ELEMENTS

__all__ = ["ModelShape", "StepShape", "MemoryEstimate", "estimate_memory", "layer_saved_bytes",
           "param_count", "GIB"]

GIB = float(1 << 30)
_KINDS = ("S", "L", "G")


@dataclass(frozen=True)
class ModelShape:
    """A Llama-style GPT.

    Attributes:
        num_layers, hidden_size, ffn_hidden_size, num_attention_heads, num_query_groups: the
            usual sizes (``num_query_groups``: KV heads).
        vocab_size: the padded vocabulary (embedding and output layer rows, over all TP ranks).
        layer_kinds: one letter per layer: ``S`` softmax attention, ``L`` linear attention,
            ``G`` gated linear attention (a decay gate per head and token).
        tied_embeddings: input and output embeddings share one weight.
    """

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    layer_kinds: str
    tied_embeddings: bool = False

    def __post_init__(self) -> None:
        if len(self.layer_kinds) != self.num_layers or set(self.layer_kinds) - set(_KINDS):
            raise ValueError(f"layer_kinds {self.layer_kinds!r} must hold one of {_KINDS} per "
                             f"layer ({self.num_layers} layers)")
        if self.hidden_size % self.num_attention_heads or \
                self.num_attention_heads % self.num_query_groups:
            raise ValueError("hidden_size must be a multiple of num_attention_heads and that of "
                             "num_query_groups")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class StepShape:
    """One rank's share of a training step.

    Attributes:
        tp, cp, dp: parallel sizes.
        micro_batch_size, num_micro_batches: sequences per micro-batch and micro-batches per
            step (per DP rank).
        seq_length: tokens per sequence (over all CP ranks).
        param_bytes: 2 (bf16 parameters, fp32 masters in the optimizer) or 4 (fp32).
        recompute: None, ``"selective"`` or ``"full"``.
        recompute_method, recompute_num_layers: for ``full`` (``uniform``/``block``, N).
        recompute_modules: for ``selective`` (``core_attn``, ``mlp``).
        loss: ``"chunked"`` (ours), ``"liger"`` or ``"megatron"`` (full logits).
        loss_chunk_tokens: the chunked loss's tokens per chunk (train.py passes its
            loss's default; None: the whole micro-batch in one chunk).
        grad_reduce_overlap: the gradient sum over DP × CP travels during the backward
            (train.py's default) rather than after it.
        distributed_optimizer: the optimizer's masters and moments and the fp32 gradient sum
            are sharded over DP × CP (``--use-distributed-optimizer``): each rank holds 1 /
            (DP · CP) of them.
        overlap_param_gather: with ``distributed_optimizer``, the step launches every bucket's
            parameter all-gather at once (``--overlap-param-gather``): their 16-bit buffers
            are alive together until the next forward has taken them in.
        softmax_a2a_group: the ranks per all-to-all group of the softmax layers (``a2a``: CP;
            ``a2a_ring``: its ``a2a_size``; 1: a ring or all-gather preset): their core
            attention saves exchanged copies (:func:`layer_saved_bytes`).
    """

    tp: int = 1
    cp: int = 1
    dp: int = 1
    micro_batch_size: int = 1
    num_micro_batches: int = 1
    seq_length: int = 4096
    param_bytes: int = 2
    recompute: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    recompute_modules: tuple = ("core_attn",)
    loss: str = "chunked"
    loss_chunk_tokens: Optional[int] = None
    grad_reduce_overlap: bool = True
    distributed_optimizer: bool = False
    overlap_param_gather: bool = False
    softmax_a2a_group: int = 1

    def __post_init__(self) -> None:
        if self.param_bytes not in (2, 4):
            raise ValueError(f"param_bytes={self.param_bytes}: 2 (bf16) or 4 (fp32)")
        if self.recompute not in (None, "selective", "full"):
            raise ValueError(f"recompute={self.recompute!r}: None, 'selective' or 'full'")
        if self.loss not in ("chunked", "liger", "megatron"):
            raise ValueError(f"loss={self.loss!r}: 'chunked', 'liger' or 'megatron'")
        if self.seq_length % self.cp:
            raise ValueError(f"seq_length {self.seq_length} is not divisible by CP {self.cp}")

    @property
    def tokens(self) -> int:
        """Tokens per rank in one micro-batch."""
        return self.micro_batch_size * self.seq_length // self.cp


@dataclass
class MemoryEstimate:
    """Predicted peak bytes of one rank, by term (see the module docstring)."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    loss: float
    workspace: float
    total: float
    phase: str                       # where the peak falls: "backward", "forward", "optimizer"
    parts: dict = field(default_factory=dict)

    def summary(self, capacity: Optional[float] = None) -> str:
        """One line, e.g. for a launcher's start-up print: GiB, or MiB when the total is under
        1 GiB (a small model's parts would all read 0.0 GiB)."""
        unit, div = ("GiB", GIB) if self.total >= GIB else ("MiB", 2**20)
        cap = f" of {capacity / GIB:.1f} GiB" if capacity else ""
        return (f"{self.total / div:.1f} {unit}{cap} at the {self.phase} peak (weights "
                f"{self.weights / div:.1f}, grads {self.grads / div:.1f}, optimizer "
                f"{self.optimizer / div:.1f}, activations {self.activations / div:.1f}, loss "
                f"{self.loss / div:.1f}, workspace {self.workspace / div:.1f})")


def param_count(m: ModelShape, tp: int = 1) -> dict:
    """Parameters held by one TP rank: ``{"embedding", "output", "layers", "norms"}``."""
    h, f, d, t = m.hidden_size, m.ffn_hidden_size, m.head_dim, tp
    a, g = m.num_attention_heads, m.num_query_groups
    per_layer = h * (a + 2 * g) * d // t + a * d * h // t + 3 * f * h // t + 2 * h
    linear = m.layer_kinds.count("L") + m.layer_kinds.count("G")
    layers = m.num_layers * per_layer + linear * a * d // t                   # out norms
    layers += m.layer_kinds.count("G") * (a * h + 2 * a) // t    # gate projection, A_log, dt_bias
    emb = m.vocab_size * h // t
    return {"embedding": emb, "output": 0 if m.tied_embeddings else emb, "layers": layers,
            "norms": h}


def layer_saved_bytes(m: ModelShape, kind: str, tp: int = 1, act_bytes: int = 2,
                      drop: tuple = (), a2a: int = 1) -> dict:
    """Bytes per token one layer saves for its backward, by tensor (``drop``: recomputed
    submodules, ``core_attn`` / ``mlp``, whose internals are replaced by their inputs;
    ``a2a``: the ranks U of the softmax layers' all-to-all groups, ``a2a`` or ``a2a_ring``
    presets; 1: none).

    Softmax core attention saves q, k (after RoPE), v — a view of the fused QKV projection's
    output, which it keeps alive whole — the output and the fp32 LSE. Linear core attention
    saves the same q, k, v (grouped: ``lightning_attention`` expands K/V only inside its own
    calls) and its fp32 per-head output norm's input,
    normalised value and inverse RMS; a gated layer's q carries one more channel per head (the
    gate projection) and it saves the fp32 softplus input and output and the log-decay ``g``.
    RoPE makes 16-bit cos/sin per call (q and k; a packed batch's layers share one pair, so
    there the count is high by that much per layer: ~1 % of the 1B model's peak). Under an all-to-all preset the softmax core
    attention saves the exchanged copies instead — q, the output and the LSE in head shards
    (the same bytes per token), and k and v as tensors of their own, ``max(Hkv, U)`` heads'
    worth per token (a KV head is replicated when the group has more ranks than KV heads) —
    so the QKV projection's output is no longer kept (the CPU test measures the real model
    at CP 2 and 4; at 512K over 4 × H200 the count without this put the 1B softmax model
    10 GiB, 12.6 %, over its peak)."""
    h, f, d, t, e = m.hidden_size, m.ffn_hidden_size, m.head_dim, tp, act_bytes
    ad, gd, heads = m.num_attention_heads * d // t, m.num_query_groups * d // t, \
        m.num_attention_heads // t
    out = {"norm1_in": e * h + 4, "qkv_in": e * h, "rope_cos_sin": 4 * e * d,
           "proj_in": e * ad, "norm2_in": e * h + 4, "fc1_in": e * h}
    # the checkpoint of core attention keeps its inputs q, k, v (v: the QKV output); a gated
    # layer's q holds the gate channel too
    q = ad + heads if kind == "G" else ad
    qkv_inputs = {"q": e * q, "k": e * gd, "qkv_out(v)": e * (ad + 2 * gd)}
    if "core_attn" in drop:
        out.update(qkv_inputs)
    elif kind == "S" and a2a > 1:
        kv = e * d * max(m.num_query_groups // t, a2a)
        out.update(q=e * ad, k=kv, v=kv, attn_out=e * ad, lse=4 * heads)
    elif kind == "S":
        out.update(qkv_inputs, attn_out=e * ad, lse=4 * heads)
    else:
        out.update(qkv_inputs)
        out.update(out_fp32=4 * ad, out_normed_fp32=4 * ad, inv_rms=4 * heads)
        if kind == "G":
            out.update(gate_in_fp32=4 * heads, gate_fp32=4 * heads, log_decay_fp32=4 * heads)
    if "mlp" not in drop:
        out.update(swiglu_in=2 * e * f // t, fc2_in=e * f // t)
    return out


def _layer_bytes(m, kind, tp, e, drop=(), a2a=1) -> float:
    return float(sum(layer_saved_bytes(m, kind, tp, e, drop, a2a).values()))


def _workspace_per_token(m: ModelShape, kind: str, s: StepShape, e: int) -> float:
    """The largest transient of one layer's backward, bytes per token."""
    h, f, d, t = m.hidden_size, m.ffn_hidden_size, m.head_dim, s.tp
    ad, gd = m.num_attention_heads * d // t, m.num_query_groups * d // t
    mlp = e * h + 2 * e * f // t                     # dY beside d(SwiGLU input) [N, 2f/t]
    if kind == "S":
        # dY, d(proj input) and its [b, s, h, d] copy, dq/dk/dv, the kernel's fp32 dq
        attn = e * h + 3 * e * ad + 2 * e * gd + 4 * ad
        if s.cp > 1:       # ring: K/V hops in flight (2) and fp32 dK/dV accumulators (2)
            attn += 2 * 2 * e * gd + 2 * 2 * 4 * gd
    else:
        # dY, d(proj input), the fp32 output norm's gradients, dq/dk/dv (expanded) and the
        # kernels' fp32 chunk states (one [d, d] per 64 tokens and head)
        attn = e * h + e * ad + 2 * 4 * ad + 3 * e * ad + 4 * (ad // d) * d * d // 64
    return float(max(mlp, attn))


def _recompute_unit_bytes(m: ModelShape, s: StepShape, e: int) -> tuple:
    """(saved bytes per token of all layers, bytes per token re-materialised at the worst
    moment of the backward) under the step's recompute setting."""
    kinds, L, h = m.layer_kinds, m.num_layers, m.hidden_size
    a2a = s.softmax_a2a_group if s.cp > 1 else 1
    per = [_layer_bytes(m, k, s.tp, e, (), a2a) for k in kinds]
    if s.recompute is None:
        return sum(per), 0.0
    if s.recompute == "selective":
        drop = tuple(s.recompute_modules)
        saved = sum(_layer_bytes(m, k, s.tp, e, drop, a2a) for k in kinds)
        # the worst replay: one layer's dropped internals come back during its backward
        back = max(a - _layer_bytes(m, k, s.tp, e, drop, a2a) for a, k in zip(per, kinds))
        return saved, back
    method = s.recompute_method or "uniform"
    n = s.recompute_num_layers or (1 if method == "uniform" else L)
    # the replay's first norm reads the checkpoint's input, already counted in ``saved``
    if method == "uniform":
        groups = [range(i, min(L, i + n)) for i in range(0, L, n)]
        saved = len(groups) * e * h
        back = max(sum(per[j] for j in grp) for grp in groups) - e * h
        return float(saved), float(back)
    # block: the first n layers are checkpointed one by one, the rest keep everything
    saved = n * e * h + sum(per[n:])
    back = max(per[:n]) - e * h if n else 0.0
    return float(saved), float(back)


def _linear_state_bytes(m: ModelShape, s: StepShape, kind: str = "L") -> float:
    """What a linear layer's core attention saves besides per-token tensors: the fp32 leaf
    states (2 leaves of the zigzag split × heads × [d, d] per sequence), its fp32 output-norm
    weight and slopes (gated: ``exp(A_log)`` and its negative)."""
    heads, d = m.num_attention_heads // s.tp, m.head_dim
    per_head = d + (2 if kind == "G" else 1)
    return float(s.micro_batch_size * 2 * heads * d * d * 4 + 4 * heads * per_head)


def _layers_keeping_linear_state(m: ModelShape, s: StepShape) -> str:
    """The letters of the linear layers whose core attention keeps its saved state."""
    kinds = "".join(k for k in m.layer_kinds if k in "LG")
    if s.recompute == "selective":
        return "" if "core_attn" in s.recompute_modules else kinds
    if s.recompute == "full":
        method = s.recompute_method or "uniform"
        n = s.recompute_num_layers or (1 if method == "uniform" else m.num_layers)
        return "" if method == "uniform" else "".join(k for k in m.layer_kinds[n:] if k in "LG")
    return kinds


def _loss_bytes(m: ModelShape, s: StepShape, n: int, e: int) -> tuple:
    """(bytes alive at the end of the loss's forward, bytes it holds into the backward)."""
    h, vt = m.hidden_size, m.vocab_size // s.tp
    if s.loss == "megatron":
        # forward: the [N, V/t] logits, their fp32 copy and its exp (saved for the backward);
        # backward: the saved exp beside the 16-bit gradient. Calibrated on an H200 (1B, V
        # 128256, fused CE: 62.0 / 65.2 GiB measured at 4K x 4 for softmax / hybrid in
        # benchmarks/results/2026-11-23_h200_s5_train_1b.jsonl; 101.6 / 108.0 at 32K, issue 26)
        fwd = n * vt * (e + 8) + n * h * e
        return float(fwd), float(n * vt * (4 + e) + n * h * e)
    held = n * h * e + vt * h * s.param_bytes              # dh, the output weight's grad
    if s.loss == "liger":
        chunk = n * h * e + n * 4                          # Liger sizes chunks to ~[N, h]
        return float(held + chunk + n * h * e), float(held)
    chunk = min(n, s.loss_chunk_tokens or n) * vt * e      # one chunk's logits
    acc = vt * h * 4 if s.param_bytes == 2 else 0         # the fp32 dW accumulator
    # forward: the hidden states, dh, the fp32 dW accumulator beside one chunk's logits or,
    # at the end, beside its 16-bit copy
    fwd = 2 * n * h * e + acc + max(chunk, vt * h * s.param_bytes)
    return float(fwd), float(held)


def _reduce_bytes(m: ModelShape, s: StepShape, p: float) -> tuple:
    """The overlapped gradient sum at the backward's peak (the first layer the backward
    reaches: every checkpoint input still alive): ``(fp32 bytes in flight, 16-bit gradient
    bytes they replace)``. The reducer's buckets run in reverse parameter order, so the first
    is the untied output layer's weight, a bucket of its own when it has ``BUCKET_ELEMENTS``
    or more: launched as the backward starts, its 16-bit gradient dropped into the fp32 bucket
    (``write_back=False``), with its received slice beside it under the distributed
    optimizer. Otherwise one bucket is counted (``p`` at most) and nothing replaced.
    Measured on 4 × H200 (2026-11-27, ``benchmarks/results/2026-11-27_h200x4_long_context.jsonl``):
    the old count — the largest bucket plus ``IN_FLIGHT`` more and every slice — was 2.9 GiB
    over the peak of the 1B model at CP 4."""
    vt_h = m.vocab_size * m.hidden_size // s.tp
    shards = s.dp * s.cp if s.distributed_optimizer else 1
    if not m.tied_embeddings and vt_h >= BUCKET_ELEMENTS:
        first, replaced = vt_h, vt_h * s.param_bytes
    else:
        first, replaced = min(p, BUCKET_ELEMENTS), 0
    slice_ = 4 * first / shards if shards > 1 else 0.0
    return float(4 * first + slice_), float(replaced)


def estimate_memory(m: ModelShape, s: StepShape) -> MemoryEstimate:
    """Peak bytes of one rank for model ``m`` and step ``s`` (see the module docstring)."""
    e = s.param_bytes                       # activations travel in the parameters' dtype
    n = s.tokens
    pc = param_count(m, s.tp)
    p = float(sum(pc.values()))
    weights = p * s.param_bytes
    masters = p * 4 if s.param_bytes == 2 else 0.0
    # the distributed optimizer: masters, moments and the fp32 sums in DP × CP slices
    shards = s.dp * s.cp if s.distributed_optimizer else 1
    optimizer = (masters + 2 * p * 4) / shards
    grads = p * s.param_bytes if s.num_micro_batches > 1 else 0.0
    saved, replay = _recompute_unit_bytes(m, s, e)
    # shared per micro-batch: token ids and positions (int64), RoPE frequencies (fp32), the
    # final norm's input; the linear layers' fp32 leaf states ([d, d] per head, 2 leaves)
    shared = n * (16 + 4 * m.head_dim + e * m.hidden_size + 4)
    shared += sum(_linear_state_bytes(m, s, k) for k in _layers_keeping_linear_state(m, s))
    activations = n * saved + shared
    workspace = n * (replay + max(_workspace_per_token(m, k, s, e) for k in set(m.layer_kinds)))
    loss_fwd, loss_held = _loss_bytes(m, s, n, e)
    static = weights + optimizer + grads
    if s.loss != "megatron":
        # at the layers' backward the loss's dh is the last layer's incoming gradient (the
        # workspace's dY); only the output weight's gradient is still the loss's
        loss_held -= n * m.hidden_size * e
    backward = static + activations + loss_held + workspace
    if s.grad_reduce_overlap and s.dp * s.cp > 1:
        # the gradient sum over DP × CP (sp_train.reduce) already travelling
        in_flight, replaced = _reduce_bytes(m, s, p)
        backward += in_flight - (replaced if s.loss != "megatron" else 0.0)
    forward = static + activations + loss_fwd
    # after the backward: every gradient and the optimizer's fp32 copies of 16-bit ones, or,
    # summed over DP × CP, the fp32 sums the masters step from (the 16-bit gradients are gone)
    copies = 4 * p if s.param_bytes == 2 else 0.0
    if shards > 1:          # + the 16-bit all-gather of the updated parameters: one bucket
        gathering = p if s.overlap_param_gather else min(p, BUCKET_ELEMENTS)   # or all
        step = weights + optimizer + 4 * p / shards + s.param_bytes * gathering
    elif s.dp * s.cp > 1:
        step = weights + optimizer + 4 * p
    else:
        step = weights + p * s.param_bytes + optimizer + copies
    total = max(backward, forward, step)
    phase = "backward" if total == backward else "forward" if total == forward else "optimizer"
    return MemoryEstimate(weights=weights, grads=grads, optimizer=optimizer,
                          activations=activations,
                          loss=loss_fwd if phase == "forward" else loss_held,
                          workspace=workspace if phase == "backward" else 0.0,
                          total=total, phase=phase,
                          parts={"params": p, "tokens": n, "saved_per_token": saved,
                                 "backward": backward, "forward": forward, "optimizer": step})

"""One linear-attention layer core for both frameworks: the Megatron core attentions
(:mod:`megatron_patches.core_attention`, :mod:`megatron_patches.gated_attention`) and the HF
layer (:mod:`models.hf.linear_llama`) are thin shells around these functions and hold the same
weights, so a checkpoint moves between them by renaming keys (and cutting heads under TP).

A layer (after its q/k/v projections and RoPE on q and k)::

    o_h = lightning_attention(q, k, v, decay, scale = head_dim ** -0.5)      per head h
    y_h = o_h / sqrt(mean(o_h²) + eps) · w_h                                  per-head RMS norm
    out = o_proj(concat_h y_h)

**The decay** is either fixed slopes, one rate per head from the layer's slope schedule
(:func:`layer_slopes`; not a weight: a function of the schedule, the head and the layer), or a
Mamba2-style gate per head and token, ``g = −exp(A_log) · softplus(x·W + dt_bias)``
(:mod:`sp_attention.linear.gate_param`): weights ``gate_proj.weight [H, hidden]``,
``A_log [H]``, ``dt_bias [H]``.

**The output norm** normalises each head's output over its ``head_dim`` channels and scales
it by a weight of one value per head and channel, ``w [H · head_dim]`` (head-major). Why this
form: the field normalises per head — fla's layers (``simple_gla``, ``gla``: ``g_norm``),
Qwen3-Next's and Megatron-Core's GatedDeltaNet (``out_norm``) with one ``[head_dim]`` weight
shared by the heads; Mamba2 (``RMSNormGated``, group size = the heads' channels) and
MiniMax-01's lightning layers with one weight per channel of every head ``[H · head_dim]``.
The per-head weight holds the shared one exactly (every head the same row), the other way
round loses information; it splits over TP with the heads (a shared weight would be
replicated while each TP rank's gradient comes from other heads, so it would need a TP
all-reduce); and the Megatron layers always had it, so every train.py checkpoint loads as it
is. HF checkpoints saved before this release hold the shared ``[head_dim]`` form: it is
broadcast to ``[H · head_dim]`` exactly (:func:`out_norm_weight_from`; an HF config without
``out_norm_per_head`` builds that form, see :mod:`models.hf.linear_llama`).

Torch and the attention library only (no Megatron, no transformers): both adapters import it.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from sp_attention import LinearTuning
from sp_attention.linear.gate_param import gate_log_decay, mamba2_gate_init
from sp_attention.linear.slopes import decay_slopes

__all__ = ["layer_slopes", "gate_params", "gate_log_decay", "decay_kwargs", "out_norm",
           "out_norm_weight_from", "HeadRMSNorm", "GATED_TUNING"]

# A gate is non-positive by construction (−exp · softplus), so the op need not read it back (a
# device sync per layer) to check its sign.
GATED_TUNING = LinearTuning(check_gate_values=False)


def layer_slopes(num_heads: int, schedule: str, layer_number: int, num_layers: int,
                 first: int = 0, count: Optional[int] = None) -> torch.Tensor:
    """``[count]`` fp32 decay rates of heads ``first … first + count − 1`` (a TP rank's heads;
    default all) of layer ``layer_number`` (1-based) of ``num_layers``
    (:func:`sp_attention.linear.slopes.decay_slopes`)."""
    count = num_heads - first if count is None else count
    return decay_slopes(num_heads, schedule, layer_number=layer_number,
                        num_layers=max(num_layers, layer_number))[first:first + count].contiguous()


def gate_params(num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fresh gated layer's ``(A_log [H], dt_bias [H])``, fp32 (Mamba2's initialisation)."""
    return mamba2_gate_init(num_heads)


def decay_kwargs(*, slopes: Optional[torch.Tensor] = None, g: Optional[torch.Tensor] = None,
                 tuning: Optional[LinearTuning] = None) -> dict:
    """``lightning_attention``'s decay and tuning keywords: fixed ``slopes [H]`` or gates
    ``g [B, T, H]`` (then the gate-value check is skipped: they are ≤ 0 by construction),
    run with ``tuning`` (None: the defaults)."""
    if (slopes is None) == (g is None):
        raise ValueError("give exactly one of slopes= and g=")
    if g is None:
        return {"slopes": slopes, "tuning": tuning}
    return {"g": g, "tuning": GATED_TUNING if tuning is None else
            dataclasses.replace(tuning, check_gate_values=False)}


def out_norm(o: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The per-head RMS norm of ``o [..., H, D]`` with ``weight [H·D]`` (or the shared
    ``[D]``), in fp32 (fp64 for fp64 input), returned in ``o``'s dtype."""
    dt = torch.float64 if o.dtype == torch.float64 else torch.float32
    of = o.to(dt)
    of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)
    return (of * weight.to(dt).view(-1, o.shape[-1])).to(o.dtype)


def out_norm_weight_from(weight: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """``weight`` as the per-head form ``[num_heads · head_dim]``: returned as it is, or the
    shared ``[head_dim]`` (HF checkpoints before this release, fla-style layers) repeated for
    every head — exact. Any other shape raises."""
    if tuple(weight.shape) == (num_heads * head_dim,):
        return weight
    if tuple(weight.shape) == (head_dim,):
        return weight.repeat(num_heads)
    raise ValueError(f"an output-norm weight of shape {tuple(weight.shape)} fits neither "
                     f"[heads·head_dim] = [{num_heads * head_dim}] nor the shared [head_dim] = "
                     f"[{head_dim}]")


class HeadRMSNorm(nn.Module):
    """:func:`out_norm` as a module (the HF layer's ``o_norm``): ``weight [H·D]`` — or, with
    ``shared=True``, the ``[D]`` weight of HF checkpoints saved before this release."""

    def __init__(self, num_heads: int, head_dim: int, eps: float = 1e-6, shared: bool = False):
        super().__init__()
        self.num_heads, self.head_dim, self.eps = num_heads, head_dim, eps
        self.weight = nn.Parameter(torch.ones(head_dim if shared else num_heads * head_dim))

    def forward(self, o: torch.Tensor) -> torch.Tensor:       # [..., H, D]
        return out_norm(o, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, head_dim={self.head_dim}, eps={self.eps}, " \
               f"weight={list(self.weight.shape)}"

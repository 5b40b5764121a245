"""An independent plain-torch GPT that reads a 1×1×1 Megatron ``GPTModel`` state dict: the
reference the Megatron tests compare with (no Megatron, no sp_attention op on its path).

Llama-style as ``megatron_patches.model.build_gpt_model`` builds it: RMSNorm (eps 1e-5),
grouped qkv (Megatron's per-group ``[q … q, k, v]`` rows), RoPE (non-interleaved, positions
from 0), SwiGLU (``[gate; up]`` rows of fc1), untied output layer. Layers by letter:
``S`` causal softmax attention (scale ``hn^-0.5``); ``L`` linear attention with decay by the
recurrence ``S_t = λ S_{t−1} + k_tᵀ v_t``, ``o_t = q_t S_t · hn^-0.5`` (λ = exp(−slope)),
then a per-head RMS norm times ``out_norm_weight``; ``G`` the same recurrence with
``λ_t = exp(g_t)``, ``g_t = −exp(A_log) · softplus(x_t W + dt_bias)`` per head (``x_t``: the
layer's normed input, ``W``: ``gate_proj.weight``). A sequence is one document: call
:func:`forward` per document (positions restart, nothing is seen across documents).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

EPS = 1e-5


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _rope(x, base=10000.0):
    """``x [T, H, D]`` rotated at positions ``0 … T−1``."""
    t, _, d = x.shape
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv                # [T, D/2]
    ang = torch.cat([ang, ang], -1)[:, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, -1)
    return x * ang.cos() + torch.cat([-x2, x1], -1) * ang.sin()


def _qkv(x, w, heads, groups):
    """Megatron's fused qkv: rows ``[ng, (np/ng + 2), hn]``."""
    t = x.shape[0]
    hn = w.shape[0] // (heads + 2 * groups)
    per = heads // groups
    y = (x @ w.t()).view(t, groups, per + 2, hn)
    q = y[:, :, :per].reshape(t, heads, hn)
    return q, y[:, :, per], y[:, :, per + 1]                                  # k, v [T, ng, hn]


def _softmax(q, k, v):
    t, heads, hn = q.shape
    rep = heads // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("thd,shd->hts", q, k) * hn ** -0.5
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", s.softmax(-1), v)


def _linear(q, k, v, log_decay):
    """``log_decay [T, H]`` (≤ 0): ``S_t = exp(g_t) S_{t−1} + k_tᵀ v_t``, ``o_t = q_t S_t``."""
    t, heads, hn = q.shape
    rep = heads // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    state = torch.zeros(heads, hn, v.shape[-1], dtype=q.dtype)
    out = []
    for i in range(t):
        state = log_decay[i].exp()[:, None, None] * state + k[i, :, :, None] * v[i, :, None, :]
        out.append(torch.einsum("hd,hde->he", q[i], state))
    return torch.stack(out) * hn ** -0.5


def forward(sd: dict, tokens: torch.Tensor, pattern: str, heads: int, groups: int,
            slopes: dict = None) -> torch.Tensor:
    """Logits ``[T, V]`` of one document ``tokens [T]``. ``sd``: the 1×1×1 model's state dict
    (tensors, may require grad); ``slopes[layer] [H]`` for linear layers."""
    x = sd["embedding.word_embeddings.weight"][tokens]
    for i, kind in enumerate(pattern):
        p = f"decoder.layers.{i}."
        h = _rms(x, sd[p + "input_layernorm.weight"])
        q, k, v = _qkv(h, sd[p + "self_attention.linear_qkv.weight"], heads, groups)
        q, k = _rope(q), _rope(k)
        if kind == "S":
            o = _softmax(q, k, v)
        else:
            if kind == "G":
                c = p + "self_attention.core_attention."
                logits = h @ sd[c + "gate_proj.weight"].t()                      # [T, H]
                g = -sd[c + "A_log"].exp() * F.softplus(logits + sd[c + "dt_bias"])
            else:
                g = -slopes[i].to(q.dtype)[None].expand(q.shape[0], -1)
            o = _linear(q, k, v, g)
            hn = o.shape[-1]
            w = sd[p + "self_attention.core_attention.out_norm_weight"].view(heads, hn)
            o = _rms(o, w)
        x = x + o.reshape(o.shape[0], -1) @ sd[p + "self_attention.linear_proj.weight"].t()
        h = _rms(x, sd[p + "pre_mlp_layernorm.weight"])
        gate, up = (h @ sd[p + "mlp.linear_fc1.weight"].t()).chunk(2, -1)
        x = x + (F.silu(gate) * up) @ sd[p + "mlp.linear_fc2.weight"].t()
    x = _rms(x, sd["decoder.final_layernorm.weight"])
    return x @ sd["output_layer.weight"].t()


def packed_reference(sd: dict, rows: torch.Tensor, cu_rows: list, pattern: str, heads: int,
                     groups: int, slopes: dict = None):
    """Each document of each row alone through :func:`forward` (fp64): per-token loss of the
    rows laid end to end ``[b·s]`` (next token inside the document; a document's last token
    0), the mean over real targets, and its gradients with respect to ``sd``."""
    params = {n: t.detach().double().requires_grad_(True) for n, t in sd.items()
              if isinstance(t, torch.Tensor) and not n.endswith("_extra_state")}
    losses = []
    for row, cu in zip(rows, cu_rows):
        for a, b in zip(cu[:-1], cu[1:]):
            logits = forward(params, row[a:b], pattern, heads, groups, slopes)
            tl = F.cross_entropy(logits[:-1], row[a + 1:b], reduction="none")
            losses.append(torch.cat([tl, tl.new_zeros(1)]))
    token_loss = torch.cat(losses)
    count = sum(len(cu) - 1 for cu in cu_rows)
    mean = token_loss.sum() / (token_loss.numel() - count)
    mean.backward()
    grads = {n: p.grad for n, p in params.items()}
    assert math.isfinite(mean.item())
    return token_loss.detach(), mean.item(), grads

"""RoPE for Megatron models whose sequence is split over CP, in any layout, on any device.

Megatron's ``RotaryEmbedding`` moves its frequencies to CUDA unconditionally and cuts the
rank's zigzag slice itself (with a CUDA index tensor). :class:`CPRotaryEmbedding` takes its
slot (``model.rotary_pos_emb``) with the same call signature, and

- uses the *global* ``position_ids`` the model was called with (captured by a forward
  pre-hook on the model: GPTModel does not pass them to its rotary module), so any position
  scheme the caller uses (the layout's shards, reset positions) is honoured exactly;
- without position ids, uses the rank's positions in the model's ``SPContext``
  (``sp_attention.shard_position_ids``; for zigzag what Megatron's own slicing gives);
- runs on whatever device the model lives on (a zero-size buffer tracks it);
- for THD (packed) batches returns None, so Megatron's attention applies no RoPE (its THD
  RoPE assumes TransformerEngine's per-document split), and our core attention rotates q and
  k itself with :meth:`CPRotaryEmbedding.rotate` at the packing plan's positions (restarting
  per document): :func:`install_cp_rope` links every core attention of ours to it.

Output: ``[s_local, 1, 1, d]`` (or ``[s_local, b, 1, d]`` for per-sample position ids), the
frequencies Megatron's ``apply_rotary_pos_emb`` expects (non-interleaved ``cat(f, f)``).
"""
from __future__ import annotations

import math
import weakref
from typing import Optional

import torch

from sp_attention import SPContext, build_sp_context, shard_position_ids
from sp_attention.caches import to_device

__all__ = ["CPRotaryEmbedding", "install_cp_rope", "link_packed_rope", "rope_inv_freq",
           "check_rope_scaling"]


def check_rope_scaling(scaling: Optional[dict]) -> Optional[dict]:
    """``scaling`` checked: None, ``{"rope_type": "linear", "factor": f}`` or Llama 3's
    ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}`` (HF's names); anything else raises."""
    if scaling is None:
        return None
    kind = scaling.get("rope_type")
    need = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                              "original_max_position_embeddings")}.get(kind)
    if need is None:
        raise ValueError(f"RoPE scaling {kind!r}: use 'linear' or 'llama3' (HF's rope_type)")
    missing = [k for k in need if k not in scaling]
    if missing:
        raise ValueError(f"{kind} RoPE scaling needs {', '.join(missing)}")
    if not float(scaling["factor"]) > 0:
        raise ValueError(f"RoPE scaling factor must be > 0, got {scaling['factor']}")
    return dict(scaling)


def rope_inv_freq(dim: int, base: float, scaling: Optional[dict] = None) -> torch.Tensor:
    """``[dim/2]`` fp32 inverse frequencies of RoPE with base θ = ``base``: θ^(−2i/dim), then
    ``scaling`` (:func:`check_rope_scaling`) as HF computes it: ``linear`` divides every
    frequency by the factor; ``llama3`` divides the low frequencies (wavelength above
    ``original / low_freq_factor``) by the factor, keeps the high ones (below ``original /
    high_freq_factor``) and blends in between."""
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    scaling = check_rope_scaling(scaling)
    if scaling is None:
        return inv
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv / factor
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, blended, scaled)


class CPRotaryEmbedding(torch.nn.Module):
    """Drop-in for ``model.rotary_pos_emb`` (see the module docstring). ``sp_context``: the
    model's CP context (None: a single rank). ``rope_scaling``: HF's ``linear`` or ``llama3``
    frequency scaling (:func:`rope_inv_freq`), e.g. from a Llama 3 checkpoint's config."""

    def __init__(self, kv_channels: int, rotary_percent: float = 1.0, rotary_base: float = 10000,
                 sp_context: Optional[SPContext] = None, rotary_interleaved: bool = False,
                 seq_len_interpolation_factor: Optional[float] = None,
                 rope_scaling: Optional[dict] = None):
        super().__init__()
        if rotary_interleaved:
            raise ValueError("rotary_interleaved=True is not supported by CPRotaryEmbedding; "
                             "use the default (non-interleaved) RoPE")
        dim = int(kv_channels * rotary_percent) if rotary_percent < 1.0 else kv_channels
        # fp32 on the host (a buffer would be cast to bf16 by Float16Module); one copy per device
        self.inv_freq = rope_inv_freq(dim, rotary_base, rope_scaling)
        self._inv_freq_on: dict = {}
        self._cos_sin: Optional[tuple] = None   # rotate's last (positions, dtype) -> cos, sin
        self.interpolation = seq_len_interpolation_factor
        self.sp_ctx = build_sp_context(None) if sp_context is None else sp_context
        # tracks the model's device through .cuda()/.to(); a float tensor of size 0 is harmless
        # under Float16Module's casts
        self.register_buffer("_anchor", torch.zeros(0), persistent=False)
        self.position_ids: Optional[torch.Tensor] = None   # set per call by the model's hook

    def get_rotary_seq_len(self, inference_context, transformer, transformer_input,
                           transformer_config, packed_seq_params=None, **kwargs) -> int:
        """Global sequence length (Megatron's own rule: local length × CP [× TP with SP])."""
        if inference_context is not None:
            raise ValueError("inference contexts are not supported by ZigzagRotaryEmbedding")
        x = transformer.input_tensor if transformer is not None and \
            transformer.input_tensor is not None else transformer_input
        n = x.size(0)
        if transformer_config.sequence_parallel:
            n *= transformer_config.tensor_model_parallel_size
        return n * transformer_config.context_parallel_size

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False,
                cp_group=None) -> Optional[torch.Tensor]:
        if packed_seq:          # THD: our core attention rotates q and k (see rotate)
            return None
        device = self._anchor.device
        pos = self.position_ids
        if pos is None:
            pos = shard_position_ids(max_seq_len, self.sp_ctx, device=device)[:, None]  # [s, 1]
        else:
            if pos.dim() != 2 or pos.shape[1] * self.sp_ctx.world_size != max_seq_len:
                raise ValueError(f"position_ids {tuple(pos.shape)} must be [b, s_local] with "
                                 f"s_local x CP = {max_seq_len}: pass this rank's "
                                 "global positions, sharded like input_ids")
            pos = pos.to(device).t()                                             # [s, b]
        return self._freqs(pos, offset)[:, :, None, :]                          # [s, b, 1, d]

    def _freqs(self, pos: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """``[..., d]`` fp32 angles ``cat(f, f)`` of integer positions ``pos [...]``."""
        pos = pos.to(torch.float32) + offset
        if self.interpolation is not None:
            pos = pos / self.interpolation
        inv = self._inv_freq_on.get(pos.device)
        if inv is None:
            inv = self._inv_freq_on[pos.device] = to_device(self.inv_freq, pos.device)
        freqs = pos[..., None] * inv                                             # [..., d/2]
        return torch.cat((freqs, freqs), dim=-1)

    def cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple:
        """``cos, sin [t, 1, d]`` in ``dtype`` at ``position_ids [t]``. The last pair is kept
        and returned again for the same positions tensor (unchanged since) and dtype: every
        layer of a packed batch rotates q and k at its plan's one positions tensor."""
        # an inference tensor keeps no version counter: never kept
        version = None if position_ids.is_inference() else position_ids._version
        c = self._cos_sin
        if c is not None and version is not None and c[0]() is position_ids \
                and c[1] == version and c[2] == dtype:
            return c[3], c[4]
        freqs = self._freqs(position_ids)[:, None, :]                            # [t, 1, d]
        cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
        if version is not None:
            self._cos_sin = (weakref.ref(position_ids), version, dtype, cos, sin)
        return cos, sin

    def rotate(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """``x [b, t, h, d']`` rotated at ``position_ids [t]`` (Megatron's non-interleaved
        formula, cos/sin in ``x``'s dtype); channels past the rotary dim pass through."""
        cos, sin = self.cos_sin(position_ids, x.dtype)
        rot = cos.shape[-1]
        x_rot = x[..., :rot]
        x1, x2 = x_rot.chunk(2, dim=-1)
        out = x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin
        return out if rot == x.shape[-1] else torch.cat((out, x[..., rot:]), dim=-1)


def _capture_positions(rope: CPRotaryEmbedding):
    def hook(module, args, kwargs):
        pos = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        rope.position_ids = pos
    return hook


def install_cp_rope(model: torch.nn.Module, config, sp_context: SPContext, *,
                    rotary_percent: float = 1.0, rotary_base: float = 10000,
                    seq_len_interpolation_factor: Optional[float] = None,
                    rope_scaling: Optional[dict] = None) -> None:
    """Put a :class:`CPRotaryEmbedding` over ``sp_context`` (the model's) in
    ``model.rotary_pos_emb`` (GPTModel or HybridModel), make the model hand it the position
    ids of each call, and link our core attentions to it for THD batches."""
    if not hasattr(model, "rotary_pos_emb"):
        raise ValueError(f"{type(model).__name__} has no rotary_pos_emb slot; build it with "
                         "position_embedding_type='rope'")
    rope = CPRotaryEmbedding(config.kv_channels, rotary_percent, rotary_base, sp_context,
                             getattr(config, "rotary_interleaved", False),
                             seq_len_interpolation_factor, rope_scaling)
    anchor = next(model.parameters())
    rope.to(anchor.device)
    model.rotary_pos_emb = rope
    model.register_forward_pre_hook(_capture_positions(rope), with_kwargs=True)
    link_packed_rope(model, rope)


def link_packed_rope(model: torch.nn.Module, rope: Optional[CPRotaryEmbedding]) -> None:
    """Tell every core attention of ours in ``model`` what rotates q and k of THD batches:
    ``rope``'s :meth:`~CPRotaryEmbedding.rotate`, or nothing (None: a model without RoPE)."""
    for m in model.modules():
        if hasattr(m, "link_packed_rope"):
            m.link_packed_rope(None if rope is None else rope.rotate)

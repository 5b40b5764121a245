"""The all-to-all presets' re-sharding copies (:mod:`sp_attention.softmax.a2a`): moved in
8-byte words where both sides allow, they must equal torch's plain strided copy bit for bit,
in every dtype and for layouts that do and do not allow words (odd head dims, offsets)."""
from __future__ import annotations

import pytest
import torch

from sp_attention.softmax.a2a import _as_words, _copy_rows, _heads_into, _send_heads


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("D", [128, 6, 3])
def test_send_heads_and_heads_into_equal_plain_copies(dtype, D):
    torch.manual_seed(0)
    B, L, U, n = 2, 5, 3, 2
    q = torch.randn(B, L, U * n, D).to(dtype)
    k, v = (torch.randn(B, L, U * n, D).to(dtype) for _ in range(2))
    for xs in ((q,), (k, v)):
        buf = _send_heads(xs, U, None)
        ref = torch.stack([x.unflatten(2, (U, n)).permute(2, 0, 1, 3, 4) for x in xs], 1)
        assert torch.equal(_bits(buf), _bits(ref))
    sel = torch.tensor([[0, 1], [2, 2], [5, 4]])            # replicated / reordered heads
    buf = _send_heads((k,), U, sel)
    assert torch.equal(_bits(buf[:, 0]), _bits(k[:, :, sel].permute(2, 0, 1, 3, 4)))
    recv = torch.randn(U, 2, B, L, n, D).to(dtype)
    for slot in (0, 1):
        out = torch.empty(B, L, U * n, D, dtype=dtype)
        _heads_into(out, recv, slot)
        assert torch.equal(_bits(out), _bits(recv[:, slot].permute(1, 2, 0, 3, 4).reshape(
            B, L, U * n, D)))
    wide = torch.empty(B, L, 2 * U * n, D, dtype=dtype)      # a head chunk of a wider output
    _heads_into(wide[:, :, U * n:], recv, 1)
    assert torch.equal(_bits(wide[:, :, U * n:]), _bits(
        recv[:, 1].permute(1, 2, 0, 3, 4).reshape(B, L, U * n, D)))


def test_words_only_where_the_layout_allows():
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert _as_words(x) is not None and _as_words(x).shape == (4, 2)
    assert _as_words(x[:, 1:5]) is None                      # offset of one element
    assert _as_words(x[:, :6]) is None                       # row of 12 bytes
    assert _as_words(x.t()) is None                          # strided last dim
    assert _as_words(x.double()) is None                     # already 8 bytes
    a, b = torch.randn(3, 4), torch.empty(3, 4, dtype=torch.float64)
    _copy_rows(b, a)                                         # a conversion: the plain copy
    assert torch.equal(b, a.double())

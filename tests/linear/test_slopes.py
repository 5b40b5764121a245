import pytest
import torch

from sp_attention.linear.slopes import decay_slopes


def test_long_range_schedule():
    assert torch.equal(decay_slopes(4), torch.tensor([1 / 16, 1 / 64, 1 / 256, 0.0]))
    assert torch.equal(decay_slopes(1), torch.zeros(1))
    assert torch.equal(decay_slopes(2), torch.tensor([1 / 16, 0.0]))
    s = decay_slopes(16)
    assert s.dtype == torch.float32 and s.shape == (16,) and s[-1] == 0
    assert bool((s[:-1].diff() < 0).all()) and s[0] == 1 / 16 and s[-2] == 1 / 256


def test_lightning_schedule():
    first = decay_slopes(8, "lightning", layer_number=1, num_layers=4)
    last = decay_slopes(8, "lightning", layer_number=4, num_layers=4)
    assert torch.allclose(first, torch.tensor([2.0 ** (-(i + 1)) for i in range(8)]) * (1 + 1e-5))
    assert torch.allclose(last, first / (1 + 1e-5) * 1e-5)


def test_bad_input():
    with pytest.raises(ValueError, match="schedule"):
        decay_slopes(4, "alibi")
    with pytest.raises(ValueError, match="positive int"):
        decay_slopes(0)
    with pytest.raises(ValueError, match="layer_number"):
        decay_slopes(4, "lightning", layer_number=5, num_layers=4)

"""Constants derived from a slopes tensor (``sp_attention/linear/slope_constants.py``): made
once per tensor and version, dropped with the tensor, and bounded per tensor (a model's slopes
live for the whole run while its lengths may vary). The value check through the public op:
``test_linear_errors.py``."""
import gc

import torch

from sp_attention.linear import slope_constants as sc


def test_constants_made_once_and_bounded_per_tensor():
    slopes = torch.tensor([0.1, 0.5], dtype=torch.float64)
    cpu = torch.device("cpu")
    w = sc.decay_weights(slopes, 8, 7, -1, torch.float64, cpu)
    assert sc.decay_weights(slopes, 8, 7, -1, torch.float64, cpu) is w
    assert torch.equal(w, torch.exp(-slopes[:, None] * torch.arange(7, -1, -1.0)[None, :]))
    sc.check_slope_values(slopes)
    for n in range(1, 200):                          # many lengths, as variable batches make
        sc.leaf_transition(slopes, n, 1, torch.float64, cpu)
        sc.check_slope_values(slopes)                # used on every call: stays cached
    entry = sc._CACHE[id(slopes)][2]
    assert len(entry) <= sc._PER_SLOPES == 32
    assert "check_slope_values" in sc.cached_constants(slopes)
    before = sc.num_cached_slopes()
    del slopes, entry
    gc.collect()
    assert sc.num_cached_slopes() == before - 1

"""Which local backend runs (``sp_attention/linear/fla_ops.py``): None picks fla only where
it can run, explicit names are checked, and ``fla`` on CPU says how to get it."""

from __future__ import annotations

import pytest
import torch

from sp_attention.linear.fla_ops import resolve_backend
from sp_attention.linear.leaf import leaf_forward


def test_backend_resolution():
    q = torch.zeros(1, 4, 1, 2)
    assert resolve_backend(None, q) == "torch"
    assert resolve_backend("torch", q) == "torch"
    with pytest.raises(ValueError, match="valid"):
        resolve_backend("triton", q)
    with pytest.raises(ValueError, match="gpu"):
        resolve_backend("fla", q)
    with pytest.raises(ValueError, match="backend='torch'"):
        leaf_forward(q, q, q, torch.zeros(1), 1.0, "fla")

"""The one precision rule of the library: fp64 stays fp64, everything else accumulates in fp32.

Cross-rank states, decays, LSE merges, dq/dK/dV accumulators and gradient buckets use
:func:`acc_dtype`; outputs are cast back to the input dtype once at the public boundary. fp64
inputs keep every step in fp64 so the CPU tests can hold schedules to ~1e-10.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

__all__ = ["acc_dtype"]


def acc_dtype(*xs: Optional[Union[torch.Tensor, torch.dtype]]) -> torch.dtype:
    """``torch.float64`` if any of ``xs`` (tensors, dtypes or None) is fp64, else
    ``torch.float32`` (states, decays and accumulators are never 16-bit)."""
    for x in xs:
        dt = x.dtype if isinstance(x, torch.Tensor) else x
        if dt == torch.float64:
            return torch.float64
    return torch.float32

"""The kernels the multi-leaf fla path calls, as one :class:`FlaKernels` set.

:func:`fla_kernels` is the real set (fla's internal chunk kernels and ours).
:mod:`.leaves` takes a set explicitly, so a test runs the fla path's orchestration with
pure-torch stand-ins (``tests/linear/test_fla_orchestration.py``) without patching anything in
the library; the public ``lightning_attention`` only takes a backend name.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from . import fla_states
from .autotune_seeds import install_once
from .fla_ops import resolve_backend
from .state_sum import decayed_sum

__all__ = ["FlaKernels", "fla_kernels", "resolve_kernels"]


@dataclass(frozen=True)
class FlaKernels:
    """The kernels the multi-leaf fla path runs, with fla 0.6's keyword signatures.

    ``chunk_fwd_h`` … ``chunk_bwd_dv``: fla's internal chunk kernels (the two chunk-state
    ones also take ``split_offsets=`` and ``num_splits=`` for varlen sequences:
    :mod:`.fla_states`). ``output_from_states``:
    :func:`sp_attention.linear.kernels.output_from_states` (``gates=`` for per-token gates).
    ``state_sum(x, y, decay, base, step, scale, gates=None, pieces=None)``: ``scale · Σ_t
    λ^(base + step·t) x_tᵀ y_t`` in fp32, or its gated form, per token range with ``pieces``
    (:func:`sp_attention.linear.leaf.decayed_sum`).
    ``chunk_dqkdg``: our dq/dk/dg kernel, which the gated path runs in place of fla's
    ``chunk_bwd_dqkwg`` (:func:`sp_attention.linear.dqk_kernel.chunk_dqkdg`; None: a set
    without it runs fixed slopes only; with ``g_gamma=`` and ``G=`` it is also the fixed-rate
    dq/dk of a late gradient). ``chunk_dv``: our dv kernel that takes the gradient arriving at
    the rows' ends in-kernel (:func:`sp_attention.linear.dv_kernel.chunk_dv`; None: a set
    without it cannot run ``LinearTuning.backward_schedule`` other than ``"scan_first"``).
    ``entering_state(o, q, S_in, g_gamma, scale, chunk_size, gates=None)``: adds the entering
    state's part to a zero-start output in place
    (:func:`sp_attention.linear.kernels.add_entering_state`; None: a set without it cannot run
    ``LinearTuning.forward_schedule="output_first"``).
    :func:`fla_kernels` gives the real set;
    another set runs the fla path's orchestration with other implementations (the CPU tests
    pass pure-torch stand-ins to :mod:`.leaves` and to
    :func:`sp_attention.linear.attention.lightning_attention_with_kernels`).
    """

    chunk_fwd_h: Callable
    chunk_fwd_o: Callable
    chunk_bwd_dh: Callable
    chunk_bwd_dqkwg: Callable
    chunk_bwd_dv: Callable
    output_from_states: Callable
    state_sum: Callable
    chunk_dqkdg: Optional[Callable] = None
    chunk_dv: Optional[Callable] = None
    entering_state: Optional[Callable] = None


@functools.lru_cache(maxsize=1)
def fla_kernels() -> FlaKernels:
    """fla's internal chunk kernels without fla's backend-dispatch wrapper, and ours.

    fla 0.6 wraps its kernels in a run-time backend selector (``fla.backends.dispatch``, itself
    under ``torch.compiler.disable``): per call it walks its backend registry before falling
    back to the Triton implementation. The conventions of :mod:`.fla_ops` were checked against
    that Triton implementation, so it is the one we call, directly (``inspect.unwrap``): no
    other backend can be swapped in underneath us, and the layer's host time, which bounds a
    lone layer's step, loses the selector's per-call cost. fla, Triton and our Triton kernels
    are optional dependencies (the ``gpu`` extra): imported here, on the first fla call.
    """
    from fla.ops.common.chunk_o import chunk_bwd_dqkwg, chunk_bwd_dv, chunk_fwd_o

    from .dqk_kernel import chunk_dqkdg
    from .dv_kernel import chunk_dv
    from .kernels import add_entering_state, output_from_states
    install_once()      # shipped autotune results: a fresh machine's first step in seconds
    fwd_o, dqkwg, dv = (inspect.unwrap(f) for f in (chunk_fwd_o, chunk_bwd_dqkwg, chunk_bwd_dv))
    # the chunk-state kernels through our launchers: no device sync for varlen sequences
    return FlaKernels(fla_states.chunk_fwd_h, fwd_o, fla_states.chunk_bwd_dh, dqkwg, dv,
                      output_from_states=output_from_states, state_sum=decayed_sum,
                      chunk_dqkdg=chunk_dqkdg, chunk_dv=chunk_dv,
                      entering_state=add_entering_state)


def resolve_kernels(backend: Union[None, str, FlaKernels], q: torch.Tensor,
                    k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None
                    ) -> Optional[FlaKernels]:
    """The kernel set of the fla path, or None for the pure-torch path: a :class:`FlaKernels`
    as given, ``"fla"`` (or None where fla can run) as :func:`fla_kernels`."""
    if isinstance(backend, FlaKernels):
        return backend
    return fla_kernels() if resolve_backend(backend, q, k, v) == "fla" else None

"""``impl="auto"`` and ``preset="auto"``: the choice for a call's tensors and context, logged
once per layer shape.

On CUDA tensors the decision is the cost model's (:func:`~.choose.choose_linear_scan` /
:func:`~.choose.choose_softmax_preset`); this module only builds their inputs from a call: the
shape from the tensors, the :class:`~.machine.Machine` for the device (the calibration file if
one was measured on this device, else the built-in figures; read once per process), and the
:class:`~.common.Topology` from the group's global ranks and the ranks per node (torchrun's
``LOCAL_WORLD_SIZE``; all ranks on one node when unset). On CPU tensors it is the fixed rule
of :mod:`.choose` (:func:`~.choose.cpu_linear_scan`, :func:`~.choose.cpu_softmax_preset`).

Every rank of a group must reach the same choice: they see the same shapes, and must see the
same calibration (a shared file, or none). Callers should put the resolved schedule in the
cross-rank call check's signature, so ranks that disagree raise instead of hanging.
"""
from __future__ import annotations

import os
from functools import lru_cache
from typing import Optional

import torch

from ..context import SPContext
from .choose import (choose_linear_scan, choose_softmax_preset, cpu_linear_scan,
                     cpu_softmax_preset, log_choice, packed_softmax_preset)
from .common import Choice, LinearShape, SoftmaxShape, Topology
from .machine import Machine, calibration_path, load_machine

__all__ = ["machine_for", "topology_for", "auto_linear_scan", "auto_softmax_preset",
           "softmax_preset_for_shape"]


@lru_cache(maxsize=8)
def _machine(device: str, path: str) -> Machine:
    return load_machine(device, path)


def machine_for(device: torch.device) -> Optional[Machine]:
    """The :class:`~.machine.Machine` the cost model uses for tensors on ``device``; None off
    CUDA (no time model: ``auto`` follows the CPU rule)."""
    if device.type != "cuda":
        return None
    return _machine(torch.cuda.get_device_name(device), calibration_path())


def topology_for(ctx: SPContext, machine: Optional[Machine] = None) -> Topology:
    """Nodes of the group's ranks: ``global_rank // LOCAL_WORLD_SIZE`` (torchrun sets it;
    unset: every rank on one node)."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if per_node < 1 or not ctx.global_ranks:
        return Topology.single_node(ctx.world_size)
    return Topology.of_ranks(ctx.global_ranks, per_node)


# One decision per layer shape: a training step asks once per layer call, and the model's
# arithmetic (every candidate's forward and backward) is host time on the critical path.
_linear_choice = lru_cache(maxsize=256)(choose_linear_scan)
_softmax_choice = lru_cache(maxsize=256)(choose_softmax_preset)


def auto_linear_scan(ctx: SPContext, q: torch.Tensor, v: torch.Tensor,
                     machine: Optional[Machine] = None) -> Choice:
    """The linear scan for ``q [B, T_local, H, K]``, ``v [.., V]`` on ``ctx`` (logged once per
    shape, group size and layout); ``machine`` overrides the device's."""
    m = machine or machine_for(q.device)
    B, T, H, K = q.shape
    shape = LinearShape(B, T, H, K, v.shape[-1], q.element_size())
    if m is None:
        choice = Choice(cpu_linear_scan(ctx.world_size, ctx.layout), {})
    else:
        choice = _linear_choice(shape, ctx.world_size, ctx.layout, m, topology_for(ctx))
    log_choice("linear scan", (shape, ctx.world_size, ctx.layout), choice, m or "cpu")
    return choice


def auto_softmax_preset(ctx: SPContext, q: torch.Tensor, k: torch.Tensor, *, causal: bool = True,
                        heads_k_stride: Optional[int] = None,
                        memory_limit_bytes: Optional[float] = None,
                        machine: Optional[Machine] = None,
                        a2a_size: Optional[int] = None, packed: bool = False) -> Choice:
    """The softmax preset for ``q [B, T_local, H, D]``, ``k [.., Hkv, D]`` on ``ctx`` (logged
    once per shape, group size, layout and stride); ``machine`` overrides the device's;
    ``a2a_size``: also consider ``a2a_ring`` with that all-to-all group size; ``packed``:
    packed documents (:func:`~.choose.packed_softmax_preset`)."""
    B, T, H, D = q.shape
    shape = SoftmaxShape(B, T, H, k.shape[2], D, q.element_size(), bool(causal))
    return softmax_preset_for_shape(q.device, shape, ctx.world_size, ctx.layout,
                                    topology_for(ctx), heads_k_stride=heads_k_stride,
                                    memory_limit_bytes=memory_limit_bytes, machine=machine,
                                    a2a_size=a2a_size, packed=packed)


def softmax_preset_for_shape(device: torch.device, shape: SoftmaxShape, world: int, layout: str,
                             topology: Optional[Topology] = None, *,
                             heads_k_stride: Optional[int] = None,
                             memory_limit_bytes: Optional[float] = None,
                             machine: Optional[Machine] = None,
                             a2a_size: Optional[int] = None, packed: bool = False) -> Choice:
    """:func:`auto_softmax_preset` from sizes alone (no tensors, no group): what a launcher
    plans with before anything is allocated (train.py's memory estimate). ``topology`` None:
    the ``world`` ranks on one node."""
    m = machine or machine_for(device)
    topology = topology or Topology.single_node(world)
    if packed:
        choice = packed_softmax_preset()
    elif m is None:
        choice = Choice(cpu_softmax_preset(), {})
    else:
        choice = _softmax_choice(shape, world, layout, m, topology, heads_k_stride,
                                 memory_limit_bytes, a2a_size=a2a_size)
    log_choice("softmax preset", (shape, world, layout, heads_k_stride, a2a_size, packed),
               choice, m or "cpu")
    return choice

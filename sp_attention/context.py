"""`SPContext`: everything a context-parallel op needs to know about its process group.

Built once at the edge (from Megatron's CP group, a DeviceMesh dimension, or a plain
`dist.new_group`) and passed explicitly to every public function. No module-level group
globals: two models with different CP groups can live in one process.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional, Sequence

import torch.distributed as dist

from .planning.layout import DEFAULT_LAYOUT, LAYOUTS, leaves_of_rank


@dataclass(frozen=True)
class SPContext:
    """A context-parallel group and how the sequence is laid out over it.

    Attributes:
        group: the CP process group; None only when ``world_size == 1``.
        rank: this process's rank *inside* ``group`` (0 … world_size−1).
        world_size: number of ranks ``P`` in the group.
        global_ranks: global rank of every group rank, in group-rank order. Point-to-point ops
            on a subgroup take global ranks; this maps group-rank arithmetic onto them.
        layout: ``"zigzag"`` (the sequence is cut into 2P chunks; rank r holds chunks r and
            2P−1−r — Megatron's split, causal-balanced) or ``"contiguous"`` (rank r holds the
            r-th of P equal pieces).
    """

    group: Optional[dist.ProcessGroup]
    rank: int
    world_size: int
    global_ranks: tuple[int, ...] = field(default=())
    layout: Optional[str] = None       # None: DEFAULT_LAYOUT, read when the context is built

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"SPContext.world_size must be a positive int, got {self.world_size!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"SPContext.rank={self.rank} is outside the group of size {self.world_size}")
        if self.layout is None:
            object.__setattr__(self, "layout", DEFAULT_LAYOUT)
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; use one of {LAYOUTS}")
        if self.world_size > 1 and self.group is None:
            raise ValueError("a world_size > 1 SPContext needs a process group; pass group=...")
        if self.global_ranks and len(self.global_ranks) != self.world_size:
            raise ValueError(
                f"global_ranks has {len(self.global_ranks)} entries for world_size {self.world_size}")
        if not self.global_ranks:
            # Single-process context: the only member is "rank 0" of nothing.
            object.__setattr__(self, "global_ranks", tuple(range(self.world_size)))

    @property
    def num_leaves(self) -> int:
        """Number of contiguous sequence pieces in global order (P or 2P)."""
        return 2 * self.world_size if self.layout == "zigzag" else self.world_size

    @property
    def leaves(self) -> tuple[int, ...]:
        """Global indices of the pieces this rank holds, in the order they sit in its shard."""
        return leaves_of_rank(self.rank, self.world_size, self.layout)

    def global_rank(self, group_rank: int) -> int:
        """Global rank of ``group_rank`` (for p2p ops, which address global ranks)."""
        return self.global_ranks[group_rank % self.world_size]


def build_sp_context(group: Optional[dist.ProcessGroup] = None, layout: Optional[str] = None,
                     ) -> SPContext:
    """Build an :class:`SPContext` from a process group.

    ``group=None`` with torch.distributed uninitialised (or a group of one) gives a world-size-1
    context that runs everything locally. On a process outside the group (where
    ``dist.new_group`` returned ``GroupMember.NON_GROUP_MEMBER``) it raises ``ValueError``. ``group=None`` with an initialised default group is
    refused: the plugin never defaults to WORLD, pass the CP group explicitly.
    """
    layout = DEFAULT_LAYOUT if layout is None else layout
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; use one of {LAYOUTS}")
    if group is None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(
                "build_sp_context(group=None) with an initialised multi-process default group is "
                "ambiguous; pass the context-parallel group explicitly (e.g. "
                "parallel_state.get_context_parallel_group()).")
        return SPContext(None, 0, 1, (0,), layout)
    if isinstance(group, int) and not isinstance(group, bool) \
            and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"this process (global rank {dist.get_rank() if dist.is_initialized() else '?'}) is "
            "not a member of the group: dist.new_group (and new_cp_group) return "
            "GroupMember.NON_GROUP_MEMBER on processes outside `ranks`. Build the context and "
            "call the ops only on the group's members (e.g. `if rank in ranks:`), each with "
            "the group it belongs to")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup, got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given group; build the context from "
                         "the group this rank belongs to")
    size = dist.get_world_size(group)
    ranks = tuple(dist.get_process_group_ranks(group))
    return SPContext(group if size > 1 else None, rank, size, ranks, layout)


@dataclass(frozen=True)
class CPGroupOptions:
    """How the CP group's NCCL communicator runs. Other backends (gloo on CPU) ignore these:
    they change when communication kernels get the GPU, not what a message carries (a CTA
    bound may change the order in which a reduction over more than two ranks sums; kernels
    that are not deterministic, such as cuDNN's attention backward, differ run to run
    whatever the group: ``sp_attention/softmax/README.md``).

    Attributes:
        high_priority_stream: run the group's NCCL kernels on a high-priority CUDA stream, so
            the GPU's block scheduler starts their CTAs ahead of the queued CTAs of compute
            kernels running beside them (the ring hops and reduce-scatters that overlap
            attention kernels, the linear scans that a peer waits on). Megatron-Core users get
            the same for its CP group with ``initialize_model_parallel(...,
            high_priority_stream_groups=["cp"])``.
        max_ctas, min_ctas: bounds on the CTAs (thread blocks, hence SMs) NCCL uses per
            collective (NCCL's ``ncclConfig_t``); None keeps NCCL's default.
    """

    high_priority_stream: bool = False
    max_ctas: Optional[int] = None
    min_ctas: Optional[int] = None

    def __post_init__(self) -> None:
        if not isinstance(self.high_priority_stream, bool):
            raise TypeError("CPGroupOptions.high_priority_stream must be a bool, got "
                            f"{self.high_priority_stream!r}")
        for name in ("max_ctas", "min_ctas"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise ValueError(f"CPGroupOptions.{name} must be None or a positive int, "
                                 f"got {value!r}")
        if self.max_ctas is not None and self.min_ctas is not None \
                and self.min_ctas > self.max_ctas:
            raise ValueError(f"CPGroupOptions: min_ctas {self.min_ctas} > max_ctas "
                             f"{self.max_ctas}")


def nccl_group_options(options: CPGroupOptions, backend: str):
    """``ProcessGroupNCCL.Options`` for ``options`` when ``backend`` (a default-group backend
    string such as ``"nccl"`` or ``"cpu:gloo,cuda:nccl"``) includes NCCL and this torch has
    it; ``None`` otherwise, and for the default options (NCCL's own defaults apply)."""
    if options == CPGroupOptions() or "nccl" not in str(backend).lower() \
            or not hasattr(dist, "ProcessGroupNCCL"):
        return None
    opts = dist.ProcessGroupNCCL.Options(is_high_priority_stream=options.high_priority_stream)
    if options.max_ctas is not None:
        opts.config.max_ctas = options.max_ctas
    if options.min_ctas is not None:
        opts.config.min_ctas = options.min_ctas
    return opts


def new_cp_group(ranks: Sequence[int], options: Optional[CPGroupOptions] = None, *,
                 timeout: Optional[timedelta] = None) -> dist.ProcessGroup:
    """``dist.new_group(ranks)`` for a CP group, with ``options`` applied to its NCCL
    communicator (see :class:`CPGroupOptions`; gloo ignores them).

    As with ``dist.new_group``, every process of the default group must call this with the
    same ``ranks`` in the same order (also processes outside the group); build the context
    with :func:`build_sp_context` from the returned group on the members. ``timeout``: as for
    ``dist.new_group`` (None: torch's default). Bad ``ranks`` or options raise before any
    process-group call, so no rank is left waiting.
    """
    options = CPGroupOptions() if options is None else options
    if not isinstance(options, CPGroupOptions):
        raise TypeError(f"options must be a CPGroupOptions, got {type(options).__name__}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("new_cp_group needs torch.distributed initialised "
                           "(dist.init_process_group) first")
    world = dist.get_world_size()
    ranks = list(ranks)
    if not ranks or any(not isinstance(r, int) or isinstance(r, bool) for r in ranks):
        raise ValueError(f"ranks must be a non-empty list of global ranks (ints), got {ranks!r}")
    if len(set(ranks)) != len(ranks) or not all(0 <= r < world for r in ranks):
        raise ValueError(f"ranks {ranks} must be distinct global ranks in [0, {world})")
    pg_options = nccl_group_options(options, dist.get_backend())
    if pg_options is not None:
        # the options carry a timeout of their own: make it the group's (torch warns otherwise)
        if timeout is None:
            default = getattr(dist.distributed_c10d, "_get_default_timeout", None)
            timeout = default(dist.Backend.NCCL) if default else dist.default_pg_timeout
        pg_options._timeout = timeout
    return dist.new_group(ranks, timeout=timeout, pg_options=pg_options)

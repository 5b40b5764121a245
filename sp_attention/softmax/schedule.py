"""The softmax schedule: which forward and backward schedules run, their head strides and the
kernel backend — one validated dataclass, the one home of these knobs and their rules.

``context_parallel_attention`` builds one from its keyword arguments; the adapters (Megatron's
core attention, the launcher and train.py flags, the HF adapter) hold one and pass
``**schedule.kwargs()``. Rules that need the tensors (a stride must divide the local KV heads)
are checked by :meth:`SoftmaxSchedule.local_stride` when the op sees its inputs.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from ..planning.schedules import (A2A_SCHEDULES, AUTO_PRESET, BWD_SCHEDULES, DEFAULT_PRESET,
                                  FWD_SCHEDULES, PRESET_NAMES, PRESETS, default_heads_k_stride)
from ..validation import is_int
from ..planning.softmax_a2a import check_a2a_heads
from .backends import BACKEND_NAMES

__all__ = ["SoftmaxSchedule", "PRESETS", "PRESET_NAMES", "AUTO_PRESET", "DEFAULT_PRESET",
           "FWD_SCHEDULES", "BWD_SCHEDULES", "A2A_SCHEDULES", "STRIDE_FIELDS",
           "default_heads_k_stride"]

STRIDE_FIELDS = ("heads_k_stride", "bwd_head_first_stride", "bwd_head_last_stride")


@dataclass(frozen=True)
class SoftmaxSchedule:
    """How :func:`sp_attention.context_parallel_attention` splits a layer over the CP group.

    Attributes:
        preset: a name from :data:`PRESETS` setting ``fwd`` and ``bwd`` together (``"ring"``,
            ``"ring_ag"``, ``"allgather"``, ``"ag_ring"``; the all-to-all ``"a2a"`` and
            ``"a2a_ring"``, whose forward and backward are one schedule); None: ``fwd``/``bwd`` as given,
            each defaulting to :data:`DEFAULT_PRESET`'s. A ``fwd``/``bwd`` contradicting the
            preset raises. ``"auto"``: the cost model picks the pair per layer shape when the
            op sees its tensors (:meth:`resolve`; ``fwd``/``bwd`` stay None until then); head
            strides given with it apply if the pick runs an all-gather.
        fwd, bwd: forward / backward schedule, ``"ring"`` or ``"allgather"`` (or both the same
            all-to-all schedule); after construction both hold the resolved schedules.
        heads_k_stride: KV heads per all-gather step (only with an all-gather forward or
            backward); must divide the local KV heads. None: the library's default
            (:func:`default_heads_k_stride`).
        bwd_head_first_stride, bwd_head_last_stride: split the all-gather backward's first /
            last stride into ``[f, stride − f]`` / ``[stride − l, l]`` heads (only with
            ``bwd="allgather"``; ``0 < f, l < stride``).
        backend: kernel backend (``"cudnn"``, ``"flash"``, ``"flash_attn"``, ``"math"``) or
            None for the fastest that runs the inputs.
        a2a_size: ranks per all-to-all group of ``preset="a2a_ring"`` (U consecutive ranks of
            the CP group; must divide the CP group size P and the local query heads; required
            with ``"a2a_ring"``). With ``"auto"``: lets the cost model consider ``a2a_ring``
            with this U. ``preset="a2a"`` is U = P and takes no ``a2a_size``.
    """

    preset: Optional[str] = None
    fwd: Optional[str] = None
    bwd: Optional[str] = None
    heads_k_stride: Optional[int] = None
    bwd_head_first_stride: Optional[int] = None
    bwd_head_last_stride: Optional[int] = None
    backend: Optional[str] = None
    a2a_size: Optional[int] = None

    def __post_init__(self) -> None:
        fwd, bwd = self.fwd, self.bwd
        if self.a2a_size is not None and (not is_int(self.a2a_size) or self.a2a_size < 1):
            raise ValueError(f"a2a_size={self.a2a_size!r} must be a positive int (ranks per "
                             "all-to-all group of preset 'a2a_ring') or None")
        if self.preset == AUTO_PRESET:
            for name, given in (("fwd", fwd), ("bwd", bwd)):
                if given is not None:
                    raise ValueError(f"preset='auto' lets the cost model choose {name}; drop "
                                     f"{name}={given!r} or name a preset from {sorted(PRESETS)}")
            self._check_strides_and_backend()
            return
        if self.preset is not None:
            if self.preset not in PRESETS:
                raise ValueError(f"unknown preset {self.preset!r}; use one of "
                             f"{sorted(PRESETS) + [AUTO_PRESET]}")
            pf, pb = PRESETS[self.preset]
            for name, given, want in (("fwd", fwd, pf), ("bwd", bwd, pb)):
                if given is not None and given != want:
                    raise ValueError(f"preset={self.preset!r} means {name}={want!r} but "
                                     f"{name}={given!r} was passed; drop one of the two")
            fwd, bwd = pf, pb
        dflt_f, dflt_b = PRESETS[DEFAULT_PRESET]
        fwd = dflt_f if fwd is None else fwd
        bwd = dflt_b if bwd is None else bwd
        if fwd not in FWD_SCHEDULES:
            raise ValueError(f"unknown forward schedule fwd={fwd!r}; use one of {FWD_SCHEDULES}")
        if bwd not in BWD_SCHEDULES:
            raise ValueError(f"unknown backward schedule bwd={bwd!r}; use one of "
                             f"{BWD_SCHEDULES}")
        if (fwd in A2A_SCHEDULES or bwd in A2A_SCHEDULES) and fwd != bwd:
            a2a = fwd if fwd in A2A_SCHEDULES else bwd
            raise ValueError(f"the all-to-all schedule {a2a!r} runs forward and backward "
                             f"together (fwd={fwd!r}, bwd={bwd!r}); use preset={a2a!r}")
        if self.a2a_size is not None and fwd != "a2a_ring":
            raise ValueError(f"a2a_size={self.a2a_size} only applies to preset 'a2a_ring' (or "
                             f"'auto'); fwd={fwd!r}, bwd={bwd!r} would ignore it"
                             + (" ('a2a' is the all-to-all over the whole CP group)"
                                if fwd == "a2a" else "") + ": drop it or use "
                             "preset='a2a_ring'")
        object.__setattr__(self, "fwd", fwd)
        object.__setattr__(self, "bwd", bwd)
        self._check_strides_and_backend()
        for name in ("bwd_head_first_stride", "bwd_head_last_stride"):
            if getattr(self, name) is not None and bwd != "allgather":
                raise ValueError(f"{name} only applies to bwd='allgather' (got bwd={bwd!r}); "
                                 "use preset 'ring_ag' or 'allgather', or leave it None")
        if self.heads_k_stride is not None and "allgather" not in (fwd, bwd):
            raise ValueError(f"heads_k_stride only applies to the all-gather schedules; fwd="
                             f"{fwd!r}, bwd={bwd!r} would ignore it: use preset 'ring_ag', "
                             "'allgather' or 'ag_ring', or leave heads_k_stride None")

    def _check_strides_and_backend(self) -> None:
        for name in STRIDE_FIELDS:
            val = getattr(self, name)
            if val is not None and (not is_int(val) or val < 1):
                what = ("a positive divisor of the local KV heads" if name == "heads_k_stride"
                        else f"0 < {name} < heads_k_stride")
                raise ValueError(f"{name}={val!r} must be {what} (or None)")
        if self.backend is not None and self.backend not in BACKEND_NAMES:
            raise ValueError(f"unknown kernel backend {self.backend!r}; use one of "
                             f"{BACKEND_NAMES} or None (automatic)")

    @property
    def is_auto(self) -> bool:
        return self.preset == AUTO_PRESET

    def resolve(self, preset: str) -> "SoftmaxSchedule":
        """This schedule with ``"auto"`` replaced by ``preset`` (the cost model's pick); the
        head strides stay where the pick runs the all-gather they describe. A named schedule
        returns itself."""
        if not self.is_auto:
            return self
        f, b = PRESETS[preset]
        return SoftmaxSchedule(
            preset, heads_k_stride=self.heads_k_stride if "allgather" in (f, b) else None,
            bwd_head_first_stride=self.bwd_head_first_stride if b == "allgather" else None,
            bwd_head_last_stride=self.bwd_head_last_stride if b == "allgather" else None,
            backend=self.backend, a2a_size=self.a2a_size if f == "a2a_ring" else None)

    def kwargs(self) -> dict:
        """Keyword arguments of :func:`sp_attention.context_parallel_attention` (the resolved
        ``fwd``/``bwd``, not the preset name; ``preset="auto"`` passes on as it is)."""
        out = asdict(self)
        if self.is_auto:
            out.pop("fwd"), out.pop("bwd")
        else:
            out.pop("preset")
        if out["a2a_size"] is None:       # only a2a_ring / auto take it
            out.pop("a2a_size")
        return out

    @property
    def preset_name(self) -> str:
        """The preset that names this schedule's (fwd, bwd) pair, else ``"fwd/bwd"``."""
        return next((n for n, pair in PRESETS.items() if pair == (self.fwd, self.bwd)),
                    f"{self.fwd}/{self.bwd}")

    def auto_a2a_size(self, world: int, heads: int) -> Optional[int]:
        """The ``a2a_ring`` group size ``auto`` may consider on ``world`` ranks with ``heads``
        local query heads: this schedule's ``a2a_size`` if it splits both into more than one
        group of more than one rank; else None."""
        u = self.a2a_size
        if u is not None and 1 < u < world and world % u == 0 and heads % u == 0:
            return u
        return None

    def a2a_group_size(self, world: int, heads: int) -> Optional[int]:
        """U, the ranks per all-to-all group (``world`` for ``a2a``; 1 on one rank), or None
        for the other schedules, after the rules that need the CP size and the local query
        heads: U divides both (``ValueError`` naming the fix)."""
        if self.fwd not in A2A_SCHEDULES:
            return None
        if world == 1:              # one rank: nothing to split (any a2a_size runs locally)
            return 1
        if self.fwd == "a2a":
            check_a2a_heads(heads, world, "a2a")
            return world
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        if self.a2a_size is None:
            raise ValueError(f"preset='a2a_ring' needs a2a_size: ranks per all-to-all group, a "
                             f"divisor of the CP group size {world} (one of {divisors}) that "
                             f"divides the {heads} local query heads")
        if world % self.a2a_size:
            raise ValueError(f"a2a_size={self.a2a_size} must be a positive divisor of the CP "
                             f"group size {world}: one of {divisors}")
        check_a2a_heads(heads, self.a2a_size, "a2a_ring")
        return self.a2a_size

    def local_stride(self, kv_heads: int, default: int) -> int:
        """The KV-head stride for ``kv_heads`` local KV heads (``default`` when unset), after
        every rule that needs the head count."""
        stride = default if self.heads_k_stride is None else self.heads_k_stride
        first, last = self.bwd_head_first_stride, self.bwd_head_last_stride
        if kv_heads % stride:
            divisors = [d for d in range(1, kv_heads + 1) if kv_heads % d == 0]
            raise ValueError(f"heads_k_stride={stride!r} must be a positive divisor of the "
                             f"{kv_heads} local KV heads; use one of {divisors} (or None)")
        for name, val in (("bwd_head_first_stride", first), ("bwd_head_last_stride", last)):
            if val is None:
                continue
            if kv_heads == 1:
                raise ValueError(f"{name}={val!r}: with one local KV head the all-gather "
                                 "backward pipelines over the sequence instead of heads; leave "
                                 "it None")
            if stride == 1:
                raise ValueError(f"{name}={val!r}: heads_k_stride=1 leaves no stride to split "
                                 f"(no split is possible); use heads_k_stride >= 2 or leave "
                                 f"{name} None")
            if not 0 < val < stride:
                raise ValueError(f"{name}={val!r} must satisfy 0 < {name} < heads_k_stride "
                                 f"({stride}); pick one of 1..{stride - 1} or None")
        if kv_heads == stride and first is not None and last is not None \
                and first + last > stride:
            raise ValueError(f"with a single stride of {stride} KV heads, bwd_head_first_stride "
                             f"({first}) + bwd_head_last_stride ({last}) must be <= {stride}; "
                             "lower one of them or use a smaller heads_k_stride")
        return stride

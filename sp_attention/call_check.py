"""Every rank of a CP group must make the same call: one small all-gather per new call signature.

The ops move fixed-shape buffers between ranks, so ranks that call with different local
lengths, head counts, dtypes or options would hang, abort, or silently mix data. Each rank
cannot see the others' arguments without communicating; this check pays for that once per
*new* call signature (shapes, dtypes, device type, options, tuning) and per context:

* The first call with a signature all-gathers one ``[P, 512]`` byte buffer per rank (a
  status byte, an 8-byte digest of the signature, and its text or the local error message).
  If any rank's local input check failed, every rank raises (the failing rank its own error,
  the others a ``ValueError`` quoting it); if the digests differ, every rank raises a
  ``ValueError`` listing what each rank passed. Otherwise the signature is remembered.
* Later calls with a remembered signature do no communication: a dictionary lookup.

Limit: the cache is per rank. Ranks that make the same sequence of calls have the same cache,
so they agree on when to check. A rank that repeats an already-checked signature while another
rank passes a new one skips the exchange the other enters; that cannot be caught without a
collective on every call. ``LinearTuning(check_every_call=True)`` /
``SoftmaxTuning(check_every_call=True)`` pay that collective on every call (debugging).
The exchange reads its result on the host (a device sync on NCCL), so make one eager call of
a signature before capturing it in a CUDA graph (warm-up steps do this anyway).

Packed documents bring a new packing plan, so a new signature, with every batch. A caller that
has checked on its own that every rank of a group holds the same plans (train.py does, in the
step's one all-reduce: ``sp_train.launch.agree_step``) says so with
:func:`note_agreed_plans`; calls with such a plan record it as :data:`AGREED_PLAN` instead of
its digest (:func:`plan_identity`), share one signature, and run no exchange.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Optional

import torch
import torch.distributed as dist

from .caches import LRU, to_device
from .comm import all_gather_flat
from .context import SPContext

__all__ = ["agree_across_ranks", "clear_checked_calls", "note_agreed_plans", "plan_identity",
           "AGREED_PLAN"]

_WIDTH = 512            # bytes per rank: status, digest, text length, text
_HEAD = 1 + 8 + 2
# remembered (context, op, signature) keys, least recently used dropped
_CHECKED = LRU(1024)


# packing plans (group, digest) a caller agreed on across the group, least recently used dropped
_AGREED = LRU(4096)
AGREED_PLAN = "agreed by the caller"


def clear_checked_calls() -> None:
    """Forget every checked signature and agreed plan (the next call of each checks again; call
    it on every rank alike)."""
    _CHECKED.clear()
    _AGREED.clear()


def _group_key(ctx: SPContext) -> tuple:
    return (ctx.global_ranks, ctx.layout)


def note_agreed_plans(ctx: SPContext, digests) -> None:
    """Record that every rank of ``ctx``'s group holds the packing plans of ``digests``
    (``PackingPlan.digest``), as the caller has checked. Call it on every rank of the group
    alike — the same digests in the same order — and only after that check: ranks that record
    differently would disagree on when to exchange (one would wait in an all-gather the other
    skips)."""
    for d in digests:
        _AGREED.put((_group_key(ctx), d), True)


def plan_identity(ctx: SPContext, plan) -> Optional[str]:
    """What a call signature records of a packing plan (None: no plan): :data:`AGREED_PLAN` for
    a plan agreed on beforehand (:func:`note_agreed_plans`), else its digest."""
    digest = getattr(plan, "digest", None)
    if digest is None:
        return None
    return AGREED_PLAN if _AGREED.lookup((_group_key(ctx), digest)) else digest


def _describe(signature: tuple, short: bool = False) -> str:
    """The signature as text; ``short``: a dataclass value (the tunings) as only the fields
    that differ from their defaults, so that what a rank changed stays inside the 500 bytes
    a rank sends (the digest is of the full text)."""
    return ", ".join(f"{name}={_short(value) if short else value}" for name, value in signature)


def _short(value) -> str:
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return str(value)
    changed = []
    for f in dataclasses.fields(value):
        got = getattr(value, f.name)
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:                           # no default: always shown
            changed.append(f"{f.name}={got!r}")
            continue
        if got != default:
            changed.append(f"{f.name}={got!r}")
    return f"{type(value).__name__}({', '.join(changed)})"


def _encode(status: int, digest: bytes, text: str) -> torch.Tensor:
    raw = text.encode("utf-8")[:_WIDTH - _HEAD]
    buf = bytes([status]) + digest + len(raw).to_bytes(2, "little") + raw
    return torch.frombuffer(bytearray(buf.ljust(_WIDTH, b"\0")), dtype=torch.uint8)


def _decode(row: bytes) -> tuple[int, bytes, str]:
    n = int.from_bytes(row[9:11], "little")
    return row[0], row[1:9], row[_HEAD:_HEAD + n].decode("utf-8", errors="replace")


def _device(ctx: SPContext) -> torch.device:
    backend = str(dist.get_backend(ctx.group)).lower()
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _exchange(ctx: SPContext, status: int, digest: bytes, text: str) -> list:
    dev = _device(ctx)
    mine = to_device(_encode(status, digest, text), dev)    # the read below is the one sync
    out = torch.empty(ctx.world_size * _WIDTH, dtype=torch.uint8, device=dev)
    all_gather_flat(out, mine, ctx)
    flat = bytes(out.cpu().numpy())
    return [_decode(flat[r * _WIDTH:(r + 1) * _WIDTH]) for r in range(ctx.world_size)]


def agree_across_ranks(ctx: SPContext, op: str, signature: tuple,
                       local_error: Optional[BaseException], always: bool = False) -> None:
    """Raise on every rank unless every rank passed its local checks with the same signature.

    ``signature``: hashable ``((name, value), ...)`` of everything every rank must pass alike.
    ``local_error``: this rank's input-check failure (None if its input is good); it is raised
    here, after the other ranks were told. Without a group (world size 1), or with a
    remembered signature (and not ``always``), nothing is communicated.
    """
    if ctx.world_size == 1:
        if local_error is not None:
            raise local_error
        return
    key = (ctx, op, signature)
    if local_error is None and not always and _CHECKED.touch(key):
        return
    text = _describe(signature, short=True) if local_error is None else \
        f"{type(local_error).__name__}: {local_error}"
    digest = hashlib.blake2b(_describe(signature).encode(), digest_size=8).digest()
    try:
        rows = _exchange(ctx, int(local_error is not None), digest, text)
    except Exception:
        if local_error is not None:     # the real cause wins over a failing exchange
            raise local_error from None
        raise
    if local_error is not None:
        raise local_error
    failed = [(r, t) for r, (status, _, t) in enumerate(rows) if status]
    if failed:
        who = "; ".join(f"rank {r}: {t}" for r, t in failed)
        raise ValueError(f"{op}: rank(s) {[r for r, _ in failed]} of the CP group rejected "
                         f"their input, so every rank stops here. {who}")
    if len({d for _, d, _ in rows}) > 1:
        groups: dict = {}
        for r, (_, d, t) in enumerate(rows):
            groups.setdefault((d, t), []).append(r)
        lines = "; ".join(f"rank(s) {rs}: {t}" for (_, t), rs in groups.items())
        raise ValueError(f"{op}: the ranks of the CP group called with different shapes or "
                         "options; every rank must make the same call (the schedules move "
                         f"fixed-shape buffers between ranks). {lines}")
    _CHECKED.put(key, None)

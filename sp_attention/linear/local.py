"""The local kernel sequence of linear attention with decay on one rank, for every path.

One leaf (the whole sequence), a rank's leaves as the rows of one batch (:mod:`.leaves`) and
packed documents as varlen sequences (:mod:`.packed`) run the same fla chunk kernels in the
same order; they differ only in their data — the decay's fla keywords (``g_gamma`` for fixed
rates, the chunk-local gate sums for gates), the sequence layout (:class:`Sequences`), the
states entering the sequences and the gradients arriving at their ends — and in which stream
runs what. Those are arguments here, so the sequence is written once: fixed rates and gates
differ in one place (the dq/dk kernel: fla's ``chunk_bwd_dqkwg`` with fixed rates, ours with
gates, whose fla counterpart fla 0.6 refuses on Hopper, fla #640).

``kern`` is a :class:`~sp_attention.linear.kernel_set.FlaKernels` set: fla's own kernels on a
GPU, pure-torch stand-ins in the CPU tests.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from ..planning.schedules import CHUNK

__all__ = ["Sequences", "ROWS", "LateGradient", "chunk_states", "local_output", "local_backward"]


@dataclass(frozen=True)
class Sequences:
    """How the (flattened) rows are cut into sequences: every batch row one sequence (the
    default, :data:`ROWS`), or fla's varlen layout of one row (``cu`` the boundaries, int32 on
    the device; ``chunks`` fla's chunk index table; ``offsets`` each sequence's first chunk,
    int64 on the device, and ``num_chunks`` their total, known on the host: the chunk-state
    kernels then need no device sync, :mod:`.fla_states`)."""

    cu: Optional[torch.Tensor] = None
    chunks: Optional[torch.Tensor] = None
    offsets: Optional[torch.Tensor] = None
    num_chunks: Optional[int] = None

    def states_kw(self) -> dict:
        if self.cu is None:
            return {}
        return {"cu_seqlens": self.cu, "split_offsets": self.offsets,
                "num_splits": self.num_chunks}

    def chunk_kw(self) -> dict:
        return {} if self.cu is None else {"cu_seqlens": self.cu, "chunk_indices": self.chunks}


ROWS = Sequences()


def chunk_states(kern, k: torch.Tensor, v: torch.Tensor, fkw: dict,
                 h0: Optional[torch.Tensor] = None, final: bool = False,
                 seqs: Sequences = ROWS, fp32: bool = False) -> tuple:
    """``(h, final state or None)``: the state entering every chunk, from ``h0`` (None: zero);
    ``fp32``: h in fp32 (what the backward reads)."""
    kw = dict(states_in_fp32=True) if fp32 else {}
    return kern.chunk_fwd_h(k=k, v=v, h0=h0, output_final_state=final, chunk_size=CHUNK,
                            **kw, **seqs.states_kw(), **fkw)


def local_output(kern, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fkw: dict,
                 scale: float, h0: Optional[torch.Tensor] = None,
                 seqs: Sequences = ROWS) -> torch.Tensor:
    """Output of sequences entered with ``h0`` (None: zero): the chunk states, then fla's
    output kernel."""
    h, _ = chunk_states(kern, k, v, fkw, h0, seqs=seqs)
    return kern.chunk_fwd_o(q=q, k=k, v=v, h=h, scale=float(scale), chunk_size=CHUNK,
                            **seqs.chunk_kw(), **fkw)


@dataclass(frozen=True)
class LateGradient:
    """The gradients ``dht`` at the sequences' ends arrive late (a cross-rank scan is still
    running), so :func:`local_backward` does not wait for them: the gradient recurrence runs
    from a zero end gradient at once, and ``dht`` enters our dv and dq/dk kernels, which add
    it decayed to every chunk's end (:mod:`.dv_kernel` says why that is exact). ``send``:
    called with the recurrence's start gradient (each sequence's state-gradient contribution
    ``d``, what the scan carries) as soon as it is queued. ``suffix``: with per-token gates,
    the inclusive suffix sums of the chunk totals (:func:`.gates.suffix_sums`). Rows only
    (no varlen sequences)."""

    send: Callable[[torch.Tensor], None]
    suffix: Optional[torch.Tensor] = None


def local_backward(kern, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                   fkw: dict, scale: float, h0: Optional[torch.Tensor],
                   dht: Union[None, torch.Tensor, Callable[[], torch.Tensor]],
                   seqs: Sequences = ROWS, *, states_stream=None,
                   before_dh: Optional[Callable[[], None]] = None,
                   late: Optional[LateGradient] = None) -> tuple:
    """``(dq, dk, dv, dg)`` of sequences entered with ``h0`` and with the gradients ``dht``
    arriving at their ends (None: zero; a callable: read after ``before_dh``, e.g. once the
    stream that scans it is waited on). ``dg`` (the chunk-local gate gradient's reverse sum,
    fp32) is None for fixed rates.

    The chunk states from ``h0`` (which need no ``dht``) run on ``states_stream`` when given,
    beside the state gradients on the current stream (each of fla's two recurrences leaves
    SMs idle at small batch × heads); the current stream waits for them before dq/dk. dq and
    dk come back complete (the ``h0`` term of dq, the ``dht`` terms of dk and dv included).
    ``late``: the gradient recurrence does not wait for ``dht`` (:class:`LateGradient`);
    ``before_dh`` then runs after it, before dv; without ``states_stream`` the chunk states
    then run after the gradient recurrence (beside the scan) instead of before it.
    """
    scale = float(scale)
    if states_stream is None and late is not None:
        # one stream and a late gradient: the chunk states after the gradient recurrence, so
        # that they run while the scan carries its start gradient
        h = lambda: chunk_states(kern, k, v, fkw, h0, seqs=seqs, fp32=True)[0]  # noqa: E731
    elif states_stream is None:
        h, _ = chunk_states(kern, k, v, fkw, h0, seqs=seqs, fp32=True)
    else:
        main = torch.cuda.current_stream(q.device)
        states_stream.wait_stream(main)
        with torch.cuda.stream(states_stream):
            h, _ = chunk_states(kern, k, v, fkw, h0, seqs=seqs, fp32=True)
    if late is not None:
        return _late_backward(kern, q, k, v, do, fkw, scale, h0, h, dht, states_stream,
                              before_dh, late)
    if before_dh is not None:
        before_dh()
    if callable(dht):
        dht = dht()
    dh, _ = kern.chunk_bwd_dh(q=q, k=k, v=v, do=do, h0=None, dht=dht, scale=scale,
                              chunk_size=CHUNK, states_in_fp32=True, **seqs.states_kw(), **fkw)
    dv = kern.chunk_bwd_dv(q=q, k=k, do=do, dh=dh, scale=scale, chunk_size=CHUNK,
                           **seqs.chunk_kw(), **fkw)
    if states_stream is not None:
        main.wait_stream(states_stream)
    if fkw.get("g") is not None:
        if kern.chunk_dqkdg is None:
            raise ValueError("this kernel set has no chunk_dqkdg: it cannot run per-token gates")
        dq, dk, dg = kern.chunk_dqkdg(q, k, v, do, h, dh, fkw["g"], scale, CHUNK,
                                      **seqs.chunk_kw())
        return dq, dk, dv, dg
    dq, dk, _, _ = kern.chunk_bwd_dqkwg(q=q, k=k, v=v, do=do, h=h, dh=dh, scale=scale,
                                        chunk_size=CHUNK, **seqs.chunk_kw(), **fkw)
    return dq, dk, dv, None


def _late_backward(kern, q, k, v, do, fkw: dict, scale: float, h0, h, dht, states_stream,
                   before_dh, late: LateGradient) -> tuple:
    """:func:`local_backward` with a :class:`LateGradient` (rows; ``h`` already queued)."""
    if kern.chunk_dv is None or kern.chunk_dqkdg is None:
        raise ValueError("this kernel set has no chunk_dv / chunk_dqkdg: it cannot take a late "
                         "gradient in-kernel")
    if h0 is None:
        raise ValueError("a LateGradient needs h0 (the start gradient is shaped like it)")
    dh, d = kern.chunk_bwd_dh(q=q, k=k, v=v, do=do, h0=h0, dht=None, scale=scale,
                              chunk_size=CHUNK, states_in_fp32=True, **fkw)
    late.send(d)
    if callable(h):                     # one stream: the chunk states while the scan runs
        h = h()
    if before_dh is not None:
        before_dh()
    G = dht() if callable(dht) else dht
    G = None if G is None else G.contiguous()
    gated = fkw.get("g") is not None
    decay = {"gc": fkw["g"]} if gated else {"g_gamma": fkw["g_gamma"]}
    suffix = late.suffix if gated and G is not None else None
    dv = kern.chunk_dv(q, k, do, dh, scale, CHUNK, G=G, suffix=suffix, **decay)
    if states_stream is not None:
        torch.cuda.current_stream(q.device).wait_stream(states_stream)
    dq, dk, dg = kern.chunk_dqkdg(q, k, v, do, h, dh, decay.get("gc"), scale, CHUNK,
                                  g_gamma=decay.get("g_gamma"), G=G, suffix=suffix)
    return dq, dk, dv, dg

"""Probe: what a ring hop costs when it runs beside the attention kernels, per transport.

    torchrun --standalone --nproc-per-node 2 benchmarks/overlap_probe.py [--out FILE]

The CP schedules hide their hops behind compute, so what matters is not a hop's time alone
but (a) how much the compute slows down while the hop runs beside it and (b) when the hop
completes (a peer may be waiting on it). The 2026-11-22 trace showed an 8 MiB reduce-scatter
taking 0.5-0.85 ms beside cuDNN instead of ~0.05 ms alone: NCCL's kernels get SMs only as
the compute kernel's CTAs retire. This measures it directly, per transport:

* ``nccl``: send/recv on a plain group (NCCL's kernels on a normal-priority stream);
* ``nccl-hp``: the same on a group made with ``new_cp_group(ranks, CPGroupOptions(
  high_priority_stream=True))``;
* ``ce``: the copy engines (no SMs): the sender copies into the next rank's buffer mapped
  through torch's symmetric memory, then a barrier kernel (one small CTA) tells both sides
  it landed. A transport that cannot run here is recorded with its error.

Workloads (the compute the hop hides behind): ``attn``, our softmax kernel (cuDNN on Hopper)
fwd+bwd on one rank's ring block (Llama-3-8B attention, T = ``--attn-t``), and ``fla``, fla's
``chunk_simple_gla`` fwd+bwd (B 1, H 16, K = V = 128, T = ``--fla-t``) when fla-core is
installed. Orders: ``comm_first`` (the hop is launched before the compute, as the ring
forward posts it) and ``compute_first`` (launched while the compute already fills the GPU,
as a linear scan's hop or a backward's reduce-scatter is). Each row: the compute alone, the
hop alone, and side by side: compute time, time until the hop landed, and the slowdown.
"""
from __future__ import annotations

import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import base_parser, cp_groups, device_name, emit, init_dist  # noqa: E402
from sp_attention import build_sp_context  # noqa: E402
from sp_attention.comm import p2p_exchange  # noqa: E402

TRANSPORTS = ("nccl", "nccl-hp", "ce")
ORDERS = ("comm_first", "compute_first")


def _workloads(a, dev):
    """name -> fwd+bwd closure, on this rank's tensors."""
    from sp_attention.softmax.backends import get_backend
    out = {}
    g = torch.Generator(device=dev).manual_seed(7)
    T, bf = a.attn_t, torch.bfloat16
    q = torch.randn(1, T, 32, 128, device=dev, dtype=bf, generator=g)
    k, v = (torch.randn(1, T, 8, 128, device=dev, dtype=bf, generator=g) for _ in range(2))
    do = torch.randn_like(q)
    be = get_backend(None, dev, bf, 128)

    def attn():
        o, lse = be.forward(q, k, v, True, None)
        be.backward(do, q, k, v, o, lse, True, None)
    out["attn"] = attn
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except Exception:  # noqa: BLE001 - optional workload
        return out
    T = a.fla_t
    lq, lk, lv = (torch.randn(1, T, 16, 128, device=dev, dtype=bf, generator=g).requires_grad_(True)
                  for _ in range(3))
    ldo = torch.randn(1, T, 16, 128, device=dev, dtype=bf, generator=g)
    gamma = -torch.linspace(0.01, 0.5, 16, device=dev)

    def fla():
        o, _ = chunk_simple_gla(lq, lk, lv, g_gamma=gamma, scale=1.0)
        o.backward(ldo)
    out["fla"] = fla
    return out


class _Hop:
    """One ring hop of ``nbytes`` (send to the next rank, receive from the previous one) over a
    transport, launched on ``stream`` after ``start`` (an event on the main stream)."""

    def __init__(self, transport, nbytes, groups, dev):
        self.transport = transport
        group = groups["nccl-hp" if transport == "nccl-hp" else "default"]
        self.ctx = build_sp_context(group, layout="contiguous")
        P, r = self.ctx.world_size, self.ctx.rank
        self.nxt, self.prv = (r + 1) % P, (r - 1) % P
        self.src = torch.full((nbytes,), r + 1, dtype=torch.uint8, device=dev)
        if transport == "ce":
            import torch.distributed._symmetric_memory as symm_mem
            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                try:
                    symm_mem.enable_symm_mem_for_group(group.group_name)
                except Exception:  # noqa: BLE001 - newer torch: not needed / deprecated
                    pass
            self.dst = symm_mem.empty(nbytes, dtype=torch.uint8, device=dev)
            self.hdl = symm_mem.rendezvous(self.dst, group.group_name)
            self.peer = self.hdl.get_buffer(self.nxt, (nbytes,), torch.uint8, 0)
        else:
            self.dst = torch.empty_like(self.src)

    def launch(self, stream, start):
        with torch.cuda.stream(stream):
            stream.wait_event(start)
            if self.transport == "ce":
                self.peer.copy_(self.src)           # a copy-engine write into the next rank
                self.hdl.barrier(channel=0)         # ... and the previous rank's write landed
            else:
                for w in p2p_exchange([(self.src, self.nxt)], [(self.dst, self.prv)], self.ctx):
                    w.wait()
            done = torch.cuda.Event(enable_timing=True)
            done.record(stream)
        return done

    def received_ok(self) -> bool:
        """After a hop: this rank's buffer holds the previous rank's bytes (each rank sends
        its rank + 1), first and last byte checked."""
        want = self.prv + 1
        return int(self.dst[0]) == want and int(self.dst[-1]) == want


def _measure(work, hop, order, iters, warmup, stream):
    """Median (compute ms, hop-landed ms) from a common start, over ``iters`` runs."""
    main = torch.cuda.current_stream()
    comp, landed = [], []
    for i in range(warmup + iters):
        dist.barrier(device_ids=[torch.cuda.current_device()])
        torch.cuda.synchronize()
        start, c_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(main)
        h_end = None
        if hop is not None and order == "comm_first":
            h_end = hop.launch(stream, start)
        if work is not None:
            work()
        c_end.record(main)
        if hop is not None and order == "compute_first":
            h_end = hop.launch(stream, start)
        torch.cuda.synchronize()
        if i >= warmup:
            comp.append(start.elapsed_time(c_end) if work is not None else 0.0)
            landed.append(start.elapsed_time(h_end) if h_end is not None else 0.0)
    vals = torch.tensor([statistics.median(comp), statistics.median(landed)], device="cuda",
                        dtype=torch.float64)
    dist.all_reduce(vals, op=dist.ReduceOp.MAX)      # the slowest rank's figures
    return float(vals[0]), float(vals[1])


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--mib", type=float, nargs="+", default=[1, 32, 128],
                   help="hop sizes in MiB (1: a linear state; 32 / 128: a K/V hop at 8K / 32K)")
    p.add_argument("--transports", nargs="+", choices=TRANSPORTS, default=list(TRANSPORTS))
    p.add_argument("--attn-t", type=int, default=8192)
    p.add_argument("--fla-t", type=int, default=32768)
    a = p.parse_args()
    if a.device != "cuda":
        sys.exit("overlap_probe measures CUDA streams beside NCCL and copy engines: run it on "
                 "GPUs with torchrun --standalone --nproc-per-node N (N >= 2)")
    rank, world = init_dist(a.device)
    if world < 2:
        sys.exit("overlap_probe needs >= 2 ranks: torchrun --standalone --nproc-per-node 2 ...")
    dev = torch.device("cuda", torch.cuda.current_device())
    groups = cp_groups(["nccl-hp"], world)
    stream = torch.cuda.Stream(priority=-1)
    works = _workloads(a, dev)
    base = {"bench": "overlap_probe", "world": world, "device": device_name("cuda")}
    alone = {name: _measure(w, None, "comm_first", a.iters, a.warmup, stream)[0]
             for name, w in works.items()}
    for name, ms in alone.items():
        emit(dict(base, workload=name, transport="none", ms_compute_alone=ms), a.out, rank)
    for mib in a.mib:
        nbytes = int(mib * 2 ** 20)
        for transport in a.transports:
            try:
                hop = _Hop(transport, nbytes, groups, dev)
                hop_alone = _measure(None, hop, "comm_first", a.iters, a.warmup, stream)[1]
            except Exception as e:  # noqa: BLE001 - recorded; the other transports still run
                emit(dict(base, transport=transport, mib=mib,
                          error=f"{type(e).__name__}: {e}"[:400]), a.out, rank)
                continue
            emit(dict(base, workload="none", transport=transport, mib=mib,
                      ms_hop_alone=hop_alone, gb_s=nbytes / hop_alone / 1e6,
                      received_ok=hop.received_ok()), a.out, rank)
            for name, work in works.items():
                for order in ORDERS:
                    try:
                        comp, landed = _measure(work, hop, order, a.iters, a.warmup, stream)
                    except Exception as e:  # noqa: BLE001
                        emit(dict(base, workload=name, transport=transport, mib=mib, order=order,
                                  error=f"{type(e).__name__}: {e}"[:400]), a.out, rank)
                        continue
                    emit(dict(base, workload=name, transport=transport, mib=mib, order=order,
                              ms_compute_alone=alone[name], ms_hop_alone=hop_alone,
                              ms_compute=comp, ms_hop_landed=landed,
                              slowdown=comp / alone[name],
                              ms_step=max(comp, landed)), a.out, rank)
            del hop
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

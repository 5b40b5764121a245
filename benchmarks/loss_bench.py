"""Output layer + cross entropy, forward + backward, side by side on one GPU: time and memory.

    python benchmarks/loss_bench.py --tokens 32768 65536 --out results.jsonl

Impls (one JSON line each per token count): ``plain`` (bf16 logits → fp32 → ``F.cross_entropy``,
the full ``[T, V]`` logits), ``megatron`` (Megatron-Core's fused vocabulary-parallel cross
entropy on the full logits, what train.py's ``--loss-impl megatron`` runs on GPUs), ``liger``
(Liger-Kernel's fused linear cross entropy, ``reduction="sum"``), ``chunked`` (ours, Triton row
kernels; ``chunked@C`` with C tokens per chunk) and ``chunked_torch`` (ours, torch row math).
Fields: ``ms_fwd_bwd`` (median of repeats of ``--iters`` timed calls), ``peak_gib`` (peak
allocated above the inputs, weights and their gradients), ``loss_rel_err`` and
``grad_rel_rms`` (hidden and weight gradients) against ``plain``. Impls whose package is
missing are reported as ``{"status": "missing ..."}``. Ours is correct under TP as well; this
benchmark runs TP = 1 (Liger has no TP).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _impls(args, tp_group):
    from sp_train.loss import linear_cross_entropy

    def plain(h, w, y):
        return F.cross_entropy((h @ w.t()).float(), y, ignore_index=-100, reduction="sum")

    def megatron(h, w, y):
        from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
        logits = (h @ w.t()).view(h.shape[0], 1, -1)                 # [s, b, V]
        return fused_vocab_parallel_cross_entropy(logits, y.view(-1, 1), tp_group)[
            y.view(-1, 1) != -100].sum()

    def liger(h, w, y):
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
        return liger_fused_linear_cross_entropy(h, w, y, ignore_index=-100, reduction="sum")

    out = {"plain": plain, "megatron": megatron, "liger": liger}
    for c in args.chunks:
        name = "chunked" if c == 0 else f"chunked@{c}"
        out[name] = (lambda c: lambda h, w, y: linear_cross_entropy(
            h, w, y, chunk_tokens=c or None, use_triton=True)[0])(c)
    out["chunked_torch"] = lambda h, w, y: linear_cross_entropy(h, w, y, use_triton=False)[0]
    return out


def _available(name: str):
    try:
        if name == "liger":
            import liger_kernel  # noqa: F401
        if name == "megatron":
            import megatron.core.fusions.fused_cross_entropy  # noqa: F401
    except ImportError as e:
        return f"missing ({e})"
    return None


def _run(fn, h, w, y, iters: int, repeats: int):
    """(median ms per fwd+bwd, peak GiB above the baseline, loss, dh, dw)."""
    def once():
        h.grad = w.grad = None
        loss = fn(h, w, y)
        loss.backward()
        return loss
    for _ in range(2):
        once()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            once()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3 / iters)
    h.grad = w.grad = None
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = once()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return statistics.median(times), peak, loss.detach().float(), h.grad.clone(), w.grad.clone()


def _rel_rms(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[32768, 65536])
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--chunks", type=int, nargs="+", default=[0, 2048, 16384],
                   help="chunk sizes of ours to run (0: the default by memory)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--impls", nargs="+", default=None, help="subset to run (default: all)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    import torch.distributed as dist
    from sp_train.launch import init_distributed
    init_distributed()
    tp_group = dist.new_group([0])
    impls = _impls(args, tp_group)
    names = args.impls or list(impls)
    ok = True
    for T in args.tokens:
        g = torch.Generator(device="cuda").manual_seed(T)
        h = torch.randn(T, args.hidden, device="cuda", generator=g, dtype=torch.bfloat16)
        w = (0.02 * torch.randn(args.vocab, args.hidden, device="cuda", generator=g)
             ).to(torch.bfloat16)
        y = torch.randint(0, args.vocab, (T,), device="cuda", generator=g)
        y[::7] = -100
        h.requires_grad_(True)
        w.requires_grad_(True)
        ref = None
        for name in ["plain"] + [n for n in names if n != "plain"]:
            row = {"bench": "loss", "impl": name, "T": T, "V": args.vocab, "h": args.hidden,
                   "dtype": "bfloat16", "device": torch.cuda.get_device_name(),
                   "torch": torch.__version__}
            missing = _available(name.split("@")[0])
            if missing:
                row["status"] = missing
            else:
                try:
                    ms, peak, loss, dh, dw = _run(impls[name], h, w, y, args.iters,
                                                  args.repeats)
                    row.update(ms_fwd_bwd=ms, peak_gib=peak, loss=float(loss), status="ok")
                    if ref is None:
                        ref = (loss, dh, dw)
                    else:
                        row.update(loss_rel_err=float((loss - ref[0]).abs() / ref[0].abs()),
                                   grad_rel_rms=max(_rel_rms(dh, ref[1]), _rel_rms(dw, ref[2])))
                        ok &= row["loss_rel_err"] < 1e-3 and row["grad_rel_rms"] < 2e-2
                    del dh, dw
                except torch.OutOfMemoryError:
                    row["status"] = "out of memory"
                torch.cuda.empty_cache()
            line = json.dumps(row)
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(line + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

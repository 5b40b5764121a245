"""Which logical CPUs of this machine share a physical core, and how steady one core is.

    python benchmarks/cpu_topology.py [--reps 15] [--out FILE.json]

Prints the kernel's view (``thread_siblings_list``, steal time) and then measures it, since a
VM's reported topology need not match the host's: a fixed one-thread matmul loop pinned to CPU 0
is timed alone and then while a busy loop spins on each other CPU k in turn (a sibling hyper-
thread slows CPU 0 down, a separate core does not); then the same loop alone on every CPU (a
CPU whose sibling another tenant uses runs slower, or at two speeds). ``cost_cpu.py`` needs one
rank per physical core for its step times to mean anything.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time


def _work_ms(reps: int) -> list:
    import torch
    torch.set_num_threads(1)
    a0 = torch.randn(192, 192)
    b = torch.randn(192, 192) * 0.1
    out = []
    for _ in range(reps):
        a = a0.clone()                 # the same work every time (no drift into denormals)
        t0 = time.perf_counter()
        for _ in range(40):
            a = torch.tanh(a @ b)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _spin(cpu: int, stop) -> None:
    os.sched_setaffinity(0, {cpu})
    x = 0
    while not stop.is_set():
        x += 1


def _steal() -> dict:
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu") and line[3].isdigit():
                parts = line.split()
                out[int(parts[0][3:])] = int(parts[8])   # steal, in clock ticks
    return out


def _siblings(cpus) -> dict:
    out = {}
    for c in cpus:
        p = f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list"
        try:
            out[c] = open(p).read().strip()
        except OSError:
            out[c] = None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    res = {"cpus": cpus, "siblings": _siblings(cpus), "steal_before": _steal()}
    print("logical CPUs:", cpus)
    print("thread_siblings_list:", res["siblings"])
    os.sched_setaffinity(0, {cpus[0]})
    _work_ms(3)
    base = _work_ms(a.reps)
    res["alone_cpu0"] = base
    print(f"cpu{cpus[0]} alone: median {statistics.median(base):.2f} ms, "
          f"min {min(base):.2f}, max {max(base):.2f}")
    ctx = mp.get_context("fork")
    res["with_spinner"] = {}
    for k in cpus[1:]:
        stop = ctx.Event()
        p = ctx.Process(target=_spin, args=(k, stop))
        p.start()
        time.sleep(0.05)
        t = _work_ms(a.reps)
        stop.set()
        p.join()
        res["with_spinner"][k] = t
        print(f"cpu{cpus[0]} with cpu{k} spinning: median {statistics.median(t):.2f} ms "
              f"(x{statistics.median(t) / statistics.median(base):.2f})", flush=True)
    res["alone_each"] = {}
    for c in cpus:
        os.sched_setaffinity(0, {c})
        t = _work_ms(a.reps)
        res["alone_each"][c] = t
        print(f"cpu{c} alone: median {statistics.median(t):.2f}, min {min(t):.2f}, "
              f"max {max(t):.2f} ms", flush=True)
    res["steal_after"] = _steal()
    d = {c: res["steal_after"][c] - res["steal_before"].get(c, 0) for c in res["steal_after"]}
    print("steal ticks during the probe, per CPU:", d)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    main()

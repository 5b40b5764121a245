"""What a user watches: the layout line at start, a rank-0 progress bar (loss, tokens/s, MFU on
GPUs, memory), JSON-lines and TensorBoard logs, and the loss-curve PNG at the end."""
from __future__ import annotations

import json
import os
import resource
import socket
import sys
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

import sp_attention.linear.attention as _linear
from megatron_patches.options import UsageError
from sp_attention.linear.attention import resolve_impl

__all__ = ["flops_per_token", "peak_flops", "memory_gb", "allocator_retries", "Progress",
           "plot_losses", "read_log", "describe_attention", "log_dir_refusal", "claim_log_dir",
           "release_log_dir", "claim_logs"]

# Dense bf16 tensor-core peak (no sparsity), FLOP/s.
_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "GH200": 989e12, "B200": 2250e12,
              "A100": 312e12, "L40S": 362e12, "A10": 125e12}


def peak_flops(device: torch.device, override_tflops: Optional[float] = None) -> Optional[float]:
    """Peak FLOP/s of ``device`` for MFU (None on CPU or an unknown GPU without an override)."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, val in _PEAK_BF16.items():
        if key in name:
            return val
    return None


def layer_forward_flops(*, hidden_size: int, ffn_hidden_size: int, num_attention_heads: int,
                        num_query_groups: int, seq_length: int,
                        layer_kinds: Sequence[str]) -> list:
    """Forward FLOPs per token of each layer, ``[(projections, mlp, core attention), ...]``:
    matmuls of the QKV and output projections and of the SwiGLU MLP, and causal softmax
    attention (half the full score matrix over ``seq_length`` keys) or chunked linear attention
    (64-token chunks, state ``[d, d]`` per head; gated layers also the gate projection)."""
    h, f, d = hidden_size, ffn_hidden_size, hidden_size // num_attention_heads
    kv = num_query_groups * d
    proj = 2 * h * (h + 2 * kv) + 2 * h * h          # QKV + output projection
    mlp = 2 * 3 * h * f                              # gate, up, down
    out = []
    for kind in layer_kinds:
        if kind == "S":
            attn = 2 * 2 * seq_length * h / 2            # QK^T and PV, causal half
        else:
            attn = num_attention_heads * (4 * d * d + 2 * 64 * d)  # state in/out + intra-chunk
            if kind == "G":
                attn += 2 * h * num_attention_heads                # gate projection
        out.append((proj, mlp, attn))
    return out


def flops_per_token(*, num_layers: int, hidden_size: int, ffn_hidden_size: int,
                    num_attention_heads: int, num_query_groups: int, vocab_size: int,
                    seq_length: int, layer_kinds: Sequence[str]) -> float:
    """Training FLOPs per token (forward + backward = 3 × forward, no recomputation): each
    layer's :func:`layer_forward_flops` plus the output layer. Packed documents are counted as
    one sequence of ``seq_length`` (an upper bound for softmax layers)."""
    layers = layer_forward_flops(hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size,
                                 num_attention_heads=num_attention_heads,
                                 num_query_groups=num_query_groups, seq_length=seq_length,
                                 layer_kinds=layer_kinds)
    total = sum(sum(layer) for layer in layers) + 2 * hidden_size * vocab_size
    return 3.0 * total


def memory_gb(device: torch.device) -> float:
    """Peak memory: allocated GPU memory, or this process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform != "darwin" else rss / 2**30


def allocator_retries(device: torch.device) -> Optional[int]:
    """How often the CUDA caching allocator found no free block, released its cache and tried
    again since the process started (``num_alloc_retries``; each retry synchronises the device
    and costs the step time); None off CUDA."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


class Progress:
    """Rank-0 progress: a bar on a terminal (a log line every ``log_interval`` steps otherwise),
    JSON lines, TensorBoard. Other ranks get a Progress that does nothing."""

    def __init__(self, *, enabled: bool, total: int, start: int, tokens_per_step: int,
                 flops_per_token: float, peak: Optional[float], device: torch.device,
                 log_interval: int, log_json: Optional[str], tensorboard_dir: Optional[str],
                 bar: bool = True):
        self.enabled, self.total, self.start = enabled, total, start
        self.tokens_per_step, self.fpt, self.peak = tokens_per_step, flops_per_token, peak
        self.device, self.log_interval = device, log_interval
        self.tty = bar and sys.stdout.isatty()
        self.json = self.tb = None
        self.history: list[dict] = []
        self._retries_told = False
        self._t_last = time.perf_counter()
        if not enabled:
            return
        if log_json:
            os.makedirs(os.path.dirname(os.path.abspath(log_json)), exist_ok=True)
            self.json = open(log_json, "a")
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(tensorboard_dir)
            except ImportError:
                print("tensorboard is not installed (pip install -e '.[train]'); no TB logs",
                      flush=True)

    def step(self, step: int, loss: float, grad_norm: float, lr: float) -> Optional[dict]:
        """Record finished step ``step`` (1-based); returns the record on rank 0."""
        if not self.enabled:
            return None
        now = time.perf_counter()
        dt, self._t_last = now - self._t_last, now
        tps = self.tokens_per_step / dt
        rec = {"step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr,
               "step_time_s": dt, "tokens_per_s": tps, "mem_gb": memory_gb(self.device),
               "time": time.time()}
        retries = allocator_retries(self.device)
        if retries is not None:
            rec["alloc_retries"] = retries
        if self.peak:
            # tokens/s of the whole job over the peak of all its devices
            world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
            rec["mfu"] = tps * self.fpt / (self.peak * world)
        self.history.append(rec)
        if self.json:
            self.json.write(json.dumps(rec) + "\n")
            self.json.flush()
        if self.tb:
            for k in ("loss", "grad_norm", "lr", "tokens_per_s", "mem_gb", "mfu"):
                if k in rec:
                    self.tb.add_scalar(f"train/{k}", rec[k], step)
        self._show(rec)
        if retries and not self._retries_told:      # once; the count goes on in the JSON rows
            self._retries_told = True
            print(("\n" if self.tty else "")
                  + f"warning: by step {step} the CUDA allocator found no free block "
                  f"{retries} time(s) and retried after releasing its cache (each retry stalls "
                  f"the GPU; peak {rec['mem_gb']:.1f} GiB of tensors): memory is tight — more "
                  "recompute (--recompute-granularity full), more CP, or "
                  "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True gives it room",
                  flush=True)
        return rec

    def _show(self, rec: dict) -> None:
        step, n = rec["step"], self.total
        mfu = f" | MFU {100 * rec['mfu']:.1f}%" if "mfu" in rec else ""
        # GPU: peak allocated tensor memory; CPU: the whole process's peak resident set
        mem = "GPU mem" if self.device.type == "cuda" else "rank-0 RSS"
        text = (f"step {step}/{n} | loss {rec['loss']:.4f} | {rec['tokens_per_s']:,.0f} tok/s"
                f"{mfu} | {mem} {rec['mem_gb']:.2f} GiB | {rec['step_time_s'] * 1e3:.0f} ms/step")
        if self.tty:
            width = 24
            done = int(width * step / n)
            print(f"\r[{'#' * done}{'.' * (width - done)}] {text}\033[K", end="",
                  flush=True)
            if step == n:
                print(flush=True)
        elif step % self.log_interval == 0 or step == n or step == self.start + 1:
            print(text, flush=True)

    def summary(self) -> dict:
        """Means over the last two thirds of the steps (the first third warms up)."""
        recs = self.history[len(self.history) // 3:]
        if not recs:
            return {}
        out = {"steps_measured": len(recs), "first_step": recs[0]["step"]}
        for k in ("tokens_per_s", "mfu", "step_time_s"):
            if k in recs[0]:
                out[k] = sum(r[k] for r in recs) / len(recs)
        out["loss_last"] = recs[-1]["loss"]
        out["mem_gb"] = max(r["mem_gb"] for r in recs)
        return out

    def close(self) -> None:
        if self.tty and self.history and self.history[-1]["step"] != self.total:
            print(flush=True)
        if self.json:
            self.json.close()
        if self.tb:
            self.tb.close()


def _owner_file(log_json: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(log_json)), "run.json")


def _alive(owner: dict) -> bool:
    """Whether the rank-0 process ``owner`` names still runs (on this host; elsewhere: we
    cannot tell, so no)."""
    if owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
        return False
    try:
        os.kill(owner["pid"], 0)
    except (ProcessLookupError, PermissionError):
        return False
    return owner["pid"] != os.getpid()


def log_dir_refusal(log_json: str, identity: dict, resumed: bool) -> Optional[str]:
    """None when a run with ``identity`` (its model, data, baseline switch, ``--save``) may
    write ``log_json``; else the error, with the fix. A resumed run appends, so the folder's
    log must be its own (``run.json`` names the same run) or absent; a fresh run starts the
    log afresh, unless another run is still writing it."""
    try:
        with open(_owner_file(log_json)) as f:
            owner = json.load(f)
    except (OSError, ValueError):
        return None         # no log, or one of a train.py before run.json: as before
    if not os.path.exists(log_json):
        return None
    folder = os.path.dirname(os.path.abspath(log_json))
    if not resumed:
        if owner.get("finished", True) or not _alive(owner):
            return None
        return (f"--log-dir {folder} is being written by another run (pid {owner['pid']}); "
                "give this run its own --log-dir")
    mine = {k: owner.get(k) for k in identity}
    if mine == identity:
        return None
    differ = "; ".join(f"{k}: {mine[k]!r} there, {v!r} here" for k, v in identity.items()
                       if mine[k] != v)
    return (f"--log-dir {folder} holds the log of another run ({differ}): this resumed run "
            f"would append to it. Pass the --log-dir of the run you resume, or a new one")


def claim_log_dir(log_json: str, identity: dict, fresh: bool) -> None:
    """Record this run as the owner of ``log_json``'s folder (``run.json``: ``identity``,
    host and pid, unfinished); a fresh run (not resumed) starts its log afresh. Rank 0."""
    os.makedirs(os.path.dirname(os.path.abspath(log_json)), exist_ok=True)
    if fresh and os.path.exists(log_json):
        os.remove(log_json)
    with open(_owner_file(log_json), "w") as f:
        json.dump(dict(identity, host=socket.gethostname(), pid=os.getpid(), finished=False),
                  f, indent=1)


def claim_logs(log_json: str, identity: dict, fresh: bool) -> None:
    """Rank 0 checks that ``log_json``'s folder is this run's (``identity``; or free) and
    claims it (:func:`log_dir_refusal`, :func:`claim_log_dir`); every rank raises the same
    error if not (one broadcast)."""
    msg = [log_dir_refusal(log_json, identity, resumed=not fresh)
           if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(msg, src=0)
    if msg[0]:
        raise UsageError(msg[0])
    if dist.get_rank() == 0:
        claim_log_dir(log_json, identity, fresh)


def release_log_dir(log_json: str) -> None:
    """Mark the folder's run finished (rank 0, at the end of a run, stopped or not)."""
    try:
        with open(_owner_file(log_json)) as f:
            owner = json.load(f)
        with open(_owner_file(log_json), "w") as f:
            json.dump(dict(owner, finished=True), f, indent=1)
    except (OSError, ValueError):
        pass


def read_log(path: str) -> tuple[list, list]:
    """(steps, losses) of a JSON-lines log (the last record of a step wins: resumed runs)."""
    by_step = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                by_step[r["step"]] = r["loss"]
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def plot_losses(curves: dict, path: str, *, chance: Optional[float] = None,
                title: str = "training loss") -> Optional[str]:
    """Write a PNG of ``{label: (steps, losses)}``; returns the path, or None without
    matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[train]'); no loss PNG", flush=True)
        return None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for label, (steps, losses) in curves.items():
        ax.plot(steps, losses, label=label, lw=1.6)
    if chance is not None:
        ax.axhline(chance, color="gray", ls="--", lw=1, label=f"chance (ln V = {chance:.2f})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (copied tokens)" if chance is not None else "loss")
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def describe_attention(options, ctx, local_only: bool = False,
                       picks: Optional[dict] = None) -> str:
    """The header's attention part: each layer kind's schedule as it will run over ``ctx``
    (``options``: the run's :class:`~megatron_patches.options.SPOptions`; ``picks``: the
    schedules resolved for the run's shape, :func:`megatron_patches.model.auto_picks`, so an
    ``auto`` shows what it picked: ``linear scan auto → allgather``)."""
    if local_only:
        return "local shard only (baseline, no cross-rank attention)"
    picks = picks or {}
    pattern, parts = options.pattern, []
    if "S" in pattern:
        s = options.softmax_schedule
        name = picks.get("softmax") or s.preset_name
        parts.append(f"softmax {_auto(s.is_auto, name)}")
    for letter, name in (("L", "linear"), ("G", "gated")):
        if letter in pattern:
            scan = picks.get("linear") or resolve_impl(options.context_parallel_impl, ctx)
            asked = options.context_parallel_impl or _linear.DEFAULT_IMPL
            parts.append(f"{name} scan {_auto(asked == 'auto' and ctx.world_size > 1, scan)}")
    tuning = options.linear_tuning
    graphs = ", linear ops as CUDA graphs" if tuning is not None and tuning.op_graphs else ""
    if ctx.world_size == 1:
        return " + ".join(p.split(" ")[0] for p in parts) + " on one rank (CP 1)" + graphs
    return f"{' + '.join(parts)} across CP {ctx.world_size} ({ctx.layout}){graphs}"


def _auto(is_auto: bool, name: str) -> str:
    if not is_auto:
        return name
    return "auto (cost model)" if name == "auto" else f"auto → {name}"

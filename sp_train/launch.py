"""Process launch: torchrun, plain ``srun`` (one task per GPU) or a single process; the
process group (gloo on CPU, NCCL on GPUs); clean stops on SIGTERM/SIGINT.

``map_slurm_env`` and ``first_host`` are pure functions of an environment dict, tested with
fake SLURM variables (tests/train/test_trainer_units.py).
"""
from __future__ import annotations

import datetime
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from sp_attention.caches import to_device

__all__ = ["map_slurm_env", "first_host", "init_distributed", "StopSignals", "TrainHooks",
           "STOP_SIGNALS", "say_bad_input", "agree_step",
           "STOP_EXIT_STATUS", "BAD_INPUT_EXIT_STATUS"]

# The signals that stop a run cleanly (agreed across ranks, checkpoint saved), in the order
# one wins over the other, and the exit status of a run they stopped: 75 (EX_TEMPFAIL, "try
# again": preempted, requeue it) for SIGTERM, 130 (128 + SIGINT, a user's Ctrl-C) for SIGINT.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
STOP_EXIT_STATUS = {signal.SIGTERM: 75, signal.SIGINT: 130}
BAD_INPUT_EXIT_STATUS = 2   # flags, data or checkpoint refused, with the fix in the message


def first_host(nodelist: str) -> str:
    """First host name of a SLURM node list (``"gpu[003-005,9],cpu1"`` → ``"gpu003"``).
    Uses ``scontrol show hostnames`` when available; this parser covers the common forms."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.split()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    m = re.match(r"^([^\[,]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}; set MASTER_ADDR")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def map_slurm_env(env: Mapping[str, str]) -> dict:
    """torch.distributed variables derived from SLURM's, for ``srun python train.py`` (one task
    per GPU). Returns only the variables to *add*: anything already set (torchrun sets RANK,
    WORLD_SIZE, …) wins, and outside SLURM this returns ``{}``."""
    if "RANK" in env or "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return {}
    out = {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"],
           "LOCAL_RANK": env.get("SLURM_LOCALID", "0")}
    if "SLURM_NTASKS_PER_NODE" in env:
        out["LOCAL_WORLD_SIZE"] = env["SLURM_NTASKS_PER_NODE"].split("(")[0]
    if "MASTER_ADDR" not in env:
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if not nodes:
            raise ValueError("SLURM_PROCID is set but no SLURM_JOB_NODELIST; set MASTER_ADDR")
        out["MASTER_ADDR"] = first_host(nodes)
    if "MASTER_PORT" not in env:   # one port per job so jobs sharing a node do not collide
        out["MASTER_PORT"] = str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_minutes: int = 10) -> tuple[int, int, torch.device]:
    """Initialise the default process group (unless a caller already did) and return
    ``(rank, world_size, device)``: NCCL and ``cuda:LOCAL_RANK`` when GPUs exist, else gloo
    and CPU. A plain ``python train.py`` runs as a world of one."""
    os.environ.update(map_slurm_env(os.environ))
    if not dist.is_initialized():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if os.environ["WORLD_SIZE"] == "1":
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        kw = {}
        if backend == "nccl":
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            kw["device_id"] = torch.device("cuda", local)
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_minutes),
                                **kw)
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def agree_step(share: torch.Tensor, signum: Optional[int], tp: int, next_tokens: torch.Tensor,
               plans: Optional[Sequence[str]] = None, dp_rank: int = 0, dp: int = 1,
               data_error: Optional[Exception] = None) -> tuple[float, float, Optional[int]]:
    """After a step, one all-reduce over all ranks — the step's one wait for the GPU: the
    global mean loss (``share``: this rank's part; each DP × CP share is held by all TP
    ranks), the next step's loss tokens over DP × CP (``next_tokens``: this rank's count, the
    same on every TP rank), the signal that stops the run if any rank got one (SIGTERM before
    SIGINT) and, with packed documents, that every rank holding DP rank ``dp_rank``'s rows (of
    ``dp``) made the same packing plans for the next step (``plans``: their digests, one per
    micro-batch, the same count on every rank; checked for every DP rank on every rank, so a
    disagreement raises on all of them before the next step's first collective).
    ``data_error``: this rank could not make the next step's data (``next_tokens`` and
    ``plans`` are then anything of the right size): it raises that error and every other rank
    a ``ValueError`` saying so, instead of waiting for it. Returns ``(loss, tokens, signal or
    None)``, the same on every rank."""
    device = share.device if dist.get_backend() == "nccl" else torch.device("cpu")
    flags = [float(signum == s) for s in STOP_SIGNALS]
    pieces = _plan_pieces(plans, dp_rank, dp)
    host = torch.tensor([float(data_error is not None)] + flags + pieces, dtype=torch.float64)
    tokens = (next_tokens.detach().to(torch.float64) / tp).view(1)
    # the host's numbers queued behind the step (no wait); the read below is the one wait
    v = torch.cat([(share.to(device) / tp).view(1), to_device(tokens, device),
                   to_device(host, device)])
    dist.all_reduce(v)
    loss, tokens, failed, *got = v.tolist()  # a count of whole tokens: exact once rounded
    if data_error is not None:
        raise data_error
    if failed:
        raise ValueError(f"{round(failed)} rank(s) could not make the next step's data (the "
                         "error is in their output): every rank stops here")
    if plans is not None:
        _check_plans(got[len(STOP_SIGNALS):], len(plans), dp, dist.get_world_size() // dp)
    return loss, float(round(tokens)), next((s for s, n in zip(STOP_SIGNALS, got) if n > 0),
                                            None)


_PIECES = 4             # a plan digest's 64 bits as four 16-bit numbers


def _slot(b: int, i: int, j: int, micro_batches: int) -> int:
    """Where piece ``j`` of DP rank ``b``'s micro-batch ``i`` lies in the plan check: ``p`` at
    the index returned, ``p²`` after it."""
    return ((b * micro_batches + i) * _PIECES + j) * 2


def _plan_pieces(plans: Optional[Sequence[str]], dp_rank: int, dp: int) -> list:
    """This rank's part of the plan check: for every DP rank, micro-batch and 16-bit piece of
    the digest, ``(p, p²)`` (zero outside its own DP rank): summed over ranks, exact in fp64."""
    if plans is None:
        return []
    out = [0.0] * (dp * len(plans) * _PIECES * 2)
    for i, digest in enumerate(plans):
        value = int(digest, 16)
        for j in range(_PIECES):
            p = (value >> (16 * j)) & 0xFFFF
            at = _slot(dp_rank, i, j, len(plans))
            out[at], out[at + 1] = float(p), float(p * p)
    return out


def _check_plans(sums: list, micro_batches: int, dp: int, holders: int) -> None:
    """Raise unless every DP rank's ``holders`` ranks sent the same pieces: ``Σp² · n = (Σp)²``
    holds for n integers only when they are equal."""
    at = [(b, i, _slot(b, i, j, micro_batches)) for b in range(dp)
          for i in range(micro_batches) for j in range(_PIECES)]
    bad = sorted({(b, i) for b, i, k in at if holders * round(sums[k + 1]) != round(sums[k]) ** 2})
    if bad:
        where = ", ".join(f"DP rank {b} micro-batch {i}" for b, i in bad[:8])
        raise ValueError(f"the ranks that read the same rows made different packing plans for "
                         f"the next step ({where}): every rank of a CP and TP group must read "
                         "the same rows with the same document boundaries — make the data a "
                         "function of (seed, step, DP rank) only")


@dataclass
class TrainHooks:
    """Callbacks into a train.py run, for tests and tools (``train.main(argv, hooks=...)``);
    None: nothing is called.

    Attributes:
        after_step: ``f(step)`` on every rank after each optimizer step, before the ranks
            agree whether a signal stops the run (a signal sent here stops after this step).
        after_checkpoint_write: ``f(step, tmp_path)`` on every rank once a checkpoint's
            shards are written, before they are recorded and renamed into place (a crash
            here must leave the previous checkpoint in charge).
        on_model: ``f(model, step)`` on every rank once the weights are in place (``step``:
            the first step's predecessor, 0 for a fresh run) and after the last step (e.g.
            the model's logits on fixed tokens).
    """

    after_step: Optional[Callable[[int], None]] = None
    after_checkpoint_write: Optional[Callable[[int, str], None]] = None
    on_model: Optional[Callable[[Any, int], None]] = None


def say_bad_input(error: BaseException, same_on_every_rank: bool,
                  stop: "StopSignals") -> None:
    """``train.py: error: …`` on stderr, once per node where ``same_on_every_rank`` (a bad
    command line, or a tokenizer the machine lacks): the node's first rank says it and the
    others, under torchrun's agent, wait for its stop (:meth:`StopSignals.wait`) — exiting
    first, they could have the agent stop that rank while it is still importing, before its
    signal handler exists, with the line unsaid; without an agent (srun, a test) they exit
    at once. Other errors may differ per rank: every rank says its own."""
    local = os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
    if same_on_every_rank and local != "0":
        if "TORCHELASTIC_RUN_ID" in os.environ:     # under torchrun's agent: it stops us
            stop.wait(60)
    else:
        print(f"train.py: error: {error}", file=sys.stderr, flush=True)


class StopSignals:
    """SIGTERM/SIGINT set a flag instead of killing the process; the training loop agrees on it
    across ranks (one all-reduce it already does, which also sets ``signum`` on the ranks that
    got no signal) into ``stopped_by``, saves a checkpoint and exits with
    :attr:`exit_status`. A second SIGINT (Ctrl-C twice) interrupts at once."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None       # the signal this process received
        self.stopped_by: Optional[int] = None   # the signal all ranks agreed to stop on
        self._old = {}
        for s in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[s] = signal.signal(s, self._handle)
            except ValueError:      # not the main thread (e.g. inside a test harness)
                pass

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.stopped_by).name if self.stopped_by else "no signal"

    def wait(self, timeout: float, poll: float = 0.05) -> bool:
        """Sleep until a SIGTERM/SIGINT arrives or ``timeout`` seconds pass; True if one
        came. A worker that leaves an error for another rank to say waits here: that rank's
        exit makes the agent stop this one, so the message is out before anything is killed."""
        end = time.monotonic() + timeout
        while not self.requested and time.monotonic() < end:
            time.sleep(poll)
        return self.requested

    @property
    def exit_status(self) -> int:
        """0, or :data:`STOP_EXIT_STATUS` of the signal the run stopped on. Under torchrun a
        worker exits 0 (torchrun's agent reads any other status as a crash and reports it as
        one); the launcher ``python -m sp_train.torchrun`` returns the stop's
        status instead."""
        if self.stopped_by is None or "TORCHELASTIC_RUN_ID" in os.environ:
            return 0
        return STOP_EXIT_STATUS[self.stopped_by]

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)

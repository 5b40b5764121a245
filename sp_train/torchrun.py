"""``torchrun`` whose SIGTERM is a clean stop: for preemption, SLURM and ``kill``.

    python -m sp_train.torchrun --nproc-per-node 4 train.py [train.py flags]

It takes torchrun's arguments and *is* torchrun (``torch.distributed.run.main``) except for
SIGTERM and SIGINT. torchrun's agent answers those by raising ``SignalException``: it forwards
the signal, waits ``--shutdown-timeout`` (30 s) for the workers, kills the rest and exits 1
with a traceback, even when train.py saved its checkpoint and stopped cleanly. Here the first
SIGTERM or SIGINT is only forwarded to the workers: train.py finishes the step, saves, writes
its plot and summary, prints one line and exits 0, torchrun's agent sees a normal end, and
this launcher exits with train.py's stop status (:data:`~.launch.STOP_EXIT_STATUS`: 75 after
SIGTERM, the one a requeue script looks for; 130 after SIGINT). A second SIGINT (Ctrl-C
twice), or a signal that comes before the workers exist, is torchrun's own (forward, wait,
kill); a second SIGTERM is forwarded again. Linux (reads ``/proc`` to find the workers).

When the first worker to fail exited 2 (train.py's status for bad input: flags, data, a
damaged checkpoint, each already explained once, by rank 0) and the others did too or were
stopped by the agent, this launcher exits 2 without torchrun's failure report (and without
its log line about the worker's exit status): the user sees train.py's one line. Any other
failure is reported as torchrun reports it. ``OMP_NUM_THREADS`` defaults to 1 (torchrun's
own default, without its notice).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Optional, Sequence

from .launch import BAD_INPUT_EXIT_STATUS, STOP_EXIT_STATUS, STOP_SIGNALS

__all__ = ["main", "children"]


def children(pid: int) -> list[int]:
    """Process ids whose parent is ``pid`` (torchrun's workers are its direct children)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:         # gone meanwhile
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


class _QuietBadInput(logging.Filter):
    """Drops the agent's "failed (exitcode: 2)" line (train.py has said what was wrong) and
    its "closing signal SIGTERM" notices to the other workers (a failure's report, where one
    is printed, names them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return (f"(exitcode: {BAD_INPUT_EXIT_STATUS})" not in msg
                and "closing signal SIGTERM" not in msg)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run torchrun with ``argv``; returns 0, or the stop status after SIGTERM/SIGINT."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    got: list[int] = []
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_QuietBadInput())

    def forward(signum, frame) -> None:
        workers = children(os.getpid())
        if not workers or (got and signum == signal.SIGINT):
            # torchrun's own way: forward, wait --shutdown-timeout, kill, exit 1
            raise SignalException(f"Process {os.getpid()} got signal: {signum}",
                                  sigval=signal.Signals(signum))
        got.append(signum)
        for pid in workers:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    for s in STOP_SIGNALS:
        signal.signal(s, forward)
    # torchrun must leave SIGTERM/SIGINT to us (its default list has them); the rest it handles
    try:
        torchrun.main(["--signals-to-handle", "SIGHUP,SIGQUIT",
                       *(sys.argv[1:] if argv is None else argv)])
    except ChildFailedError as e:
        first = e.get_first_failure()[1].exitcode
        if first == BAD_INPUT_EXIT_STATUS and all(     # the workers said it already
                f.exitcode in (first, -signal.SIGTERM) for f in e.failures.values()):
            return BAD_INPUT_EXIT_STATUS
        raise
    return STOP_EXIT_STATUS[got[0]] if got else 0


if __name__ == "__main__":
    sys.exit(main())

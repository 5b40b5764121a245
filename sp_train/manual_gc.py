"""Python's garbage collector at fixed steps (``--manual-gc``), the same step on every rank.

Left to its thresholds, the collector runs whenever enough container objects were allocated:
at a different moment on every rank, each time pausing that rank's host for up to
milliseconds. A GPU step whose host runs only a little ahead of its kernels (short sequences
per rank at CP > 1) then idles, and since the ranks of a CP group meet at every attention
collective, every rank waits for each rank's pauses in turn. With ``--manual-gc`` the objects
that live for the whole run (the model, the optimizer, the data) are frozen out of every
collection, automatic collection is off while training, and one full collection runs every
``--manual-gc-interval`` steps (the same step everywhere) and at the end. Megatron-LM's flags of
the same names do the same. Measured at CP 4 (1B, 32K, 4 × H200, 2026-11-27): no gain — the
idle time of such steps is the host's steady work, not its pauses (``sp_train/README.md``).
"""
from __future__ import annotations

import gc

__all__ = ["ManualGC"]


class ManualGC:
    """``with ManualGC(enabled, interval): ... gc_ctl.after_step(step)``; restores the
    collector's state on exit (a run inside a longer-lived process leaves it as it found it)."""

    def __init__(self, enabled: bool, interval: int):
        if interval < 0:
            raise ValueError(f"interval must be >= 0, got {interval}")
        self.enabled, self.interval = bool(enabled), int(interval)
        self.collections = 0
        self._was_enabled = True

    def __enter__(self) -> "ManualGC":
        self._was_enabled = gc.isenabled()
        if self.enabled:
            gc.collect()            # what setup left behind, then the survivors out of reach
            gc.freeze()
            gc.disable()
        return self

    def after_step(self, step: int) -> None:
        """Collect after ``step`` when it is a multiple of the interval."""
        if self.enabled and self.interval and step % self.interval == 0:
            gc.collect()
            self.collections += 1

    def __exit__(self, *exc) -> None:
        if self.enabled:
            gc.unfreeze()
            if self._was_enabled:
                gc.enable()
            gc.collect()

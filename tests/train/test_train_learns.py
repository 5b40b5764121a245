"""Every model kind learns the copy task far below chance with its own defaults (shape, learning
rate: ``KIND_DEFAULTS``): a shortened default run per kind (32-token sequences, the copy 16
tokens back; 150 steps), one process (CP 1: the same losses as CP 2 within 1e-5, which
test_train_runs checks for every kind; one process halves the cost). A new model kind is covered
by adding its row to ``KIND_DEFAULTS``. Measured: softmax ends near 0.8, linear and hybrid near
0.1 (chance ln 32 = 3.47)."""
import math

from megatron_patches.trainer.args import KIND_DEFAULTS
from sp_attention.testing import run_distributed

STEPS = 150
WORLD = 1


def _learn(rank, world, tmp):
    import train
    out = {}
    for kind in KIND_DEFAULTS:
        history = train.main(["--sp-model-kind", kind, "--seq-length", "32", "--train-iters",
                              str(STEPS), "--no-progress-bar", "--log-interval", "1000",
                              "--log-dir", f"{tmp}/{kind}"])
        out[kind] = [r["loss"] for r in history]
    return out


def test_every_kind_learns_the_copy_task_with_its_defaults(tmp_path):
    losses = run_distributed(_learn, WORLD, str(tmp_path), timeout=400)[0]
    chance = math.log(32)
    for kind, curve in losses.items():
        assert len(curve) == STEPS
        end = sum(curve[-5:]) / 5
        assert end < 0.5 * chance, (kind, end, curve[::10])

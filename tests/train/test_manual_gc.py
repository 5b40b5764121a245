"""--manual-gc: the collector frozen and off while training, one collection every interval
(the same step on every rank), its state restored afterwards; the losses do not change."""
import gc

import pytest

from sp_attention.testing import run_distributed
from sp_train.args import UsageError, parse_args
from sp_train.manual_gc import ManualGC


def test_collects_at_the_interval_and_restores_the_collector():
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    with ManualGC(True, 3) as ctl:
        assert not gc.isenabled() and gc.get_freeze_count() > frozen
        for step in range(1, 8):
            ctl.after_step(step)
        assert ctl.collections == 2                       # steps 3 and 6
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with ManualGC(False, 3) as ctl:                       # off: nothing changes
        assert gc.isenabled()
        ctl.after_step(3)
        assert ctl.collections == 0
    with ManualGC(True, 0) as ctl:                        # 0: no collection while training
        ctl.after_step(100)
        assert ctl.collections == 0 and not gc.isenabled()
    assert gc.isenabled()


def test_bad_interval_is_refused_by_name():
    with pytest.raises(UsageError, match="--manual-gc-interval must be >= 0"):
        parse_args(["--manual-gc", "--manual-gc-interval", "-1"])
    with pytest.raises(ValueError, match="interval"):
        ManualGC(True, -1)


def _losses(rank, world, tmp):
    import train
    argv = ["--sp-model-kind", "hybrid", "--context-parallel-size", "2", "--seq-length", "32",
            "--global-batch-size", "2", "--train-iters", "3", "--lr-warmup-iters", "1",
            "--no-progress-bar", "--log-interval", "1"]
    plain = [r["loss"] for r in train.main(argv + ["--log-dir", f"{tmp}/plain"])]
    manual = [r["loss"] for r in train.main(argv + ["--log-dir", f"{tmp}/gc", "--manual-gc",
                                                    "--manual-gc-interval", "2"])]
    return plain, manual, gc.isenabled()


def test_train_losses_unchanged_and_collector_back_on(tmp_path):
    out = run_distributed(_losses, 2, str(tmp_path), timeout=300)
    plain, manual, _ = out[0]                             # rank 0 keeps the history
    assert plain == manual and len(plain) == 3
    assert all(enabled for _, _, enabled in out)

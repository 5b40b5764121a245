"""train.py with a crash in the middle of one save, for tests/train/test_train_runs.py: every
rank SIGKILLs itself once the shards of step K are written, before they are recorded and
renamed (train.main's ``after_checkpoint_write`` hook).

    python -m torch.distributed.run --nproc-per-node 2 tests/train/train_die_in_save.py K ARGS
"""
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import train  # noqa: E402
from sp_train.launch import TrainHooks  # noqa: E402


def _die_at(k: int):
    def hook(step: int, path: str) -> None:
        if step == k:
            os.kill(os.getpid(), signal.SIGKILL)
    return hook


if __name__ == "__main__":
    train.main(sys.argv[2:], hooks=TrainHooks(after_checkpoint_write=_die_at(int(sys.argv[1]))))

"""What a new user sees in the first hour, read as the user reads it (a subprocess: its output
lines and exit status):

- a bad command line under the launcher (``python -m sp_train.torchrun``, the Quickstart's):
  one line from rank 0 — no traceback, no torchrun failure report — and exit status 2, also
  when rank 0 starts late; a head
  dim RoPE cannot rotate (``--hidden-size 100`` over 4 heads) is refused at the flag check;
- ``--load DIR`` on a folder without a checkpoint: one line naming ``--load`` and what it
  looked for, exit 2;
- a run too large for this machine's RAM (``--preset 8b`` on CPU): one line with the estimate,
  the RAM available and the fixes, exit 2, before anything is allocated;
- ``examples/hf_llama_cp.py`` with its defaults learns the copy task far below chance for
  the two kinds that did not (gated, linear), at the default run's global batch (16 rows) in
  one process.
"""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    lines = [ln for ln in (done.stdout + done.stderr).splitlines() if ln.strip()]
    return done.returncode, lines


def test_a_bad_flag_under_the_launcher_is_one_line():
    rc, lines = _run(["-m", "sp_train.torchrun", "--nproc-per-node", "2", "train.py",
                      "--hidden-size", "100"])
    assert rc == 2, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith("train.py: error: --hidden-size 100 / --num-attention-heads 4 "
                               "gives head dim 25: RoPE"), lines


def test_the_bad_flag_line_survives_a_late_first_rank(tmp_path):
    """The rank that says the line starts 5 s late (a loaded machine): the other rank, whose
    own check fails first, waits instead of exiting, since its exit would have the agent stop
    the first rank before that one installs its signal handler (the line was lost so)."""
    late = tmp_path / "late_rank0.py"
    late.write_text("import os, runpy, sys, time\n"
                    "if os.environ.get('LOCAL_RANK') == '0':\n    time.sleep(5)\n"
                    f"sys.argv[0] = 'train.py'\nrunpy.run_path({os.path.join(ROOT, 'train.py')!r},"
                    " run_name='__main__')\n")
    rc, lines = _run(["-m", "sp_train.torchrun", "--nproc-per-node", "2", str(late),
                      "--hidden-size", "100"])
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("train.py: error: --hidden-size 100"), lines


def test_load_without_a_checkpoint_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    rc, lines = _run(["train.py", "--load", str(tmp_path), "--train-iters", "1"])
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"train.py: error: --load {tmp_path} holds no checkpoint: "
                               "looked for"), lines
    assert "notes.txt" in lines[0]


def test_a_run_larger_than_the_ram_is_refused_before_it_allocates():
    rc, lines = _run(["train.py", "--preset", "8b"])
    assert rc == 2, lines
    errors = [ln for ln in lines if ln.startswith("train.py: error:")]
    assert len(errors) == 1 and len(lines) == 1, lines
    assert "available RAM per rank" in errors[0] and "--context-parallel-size" in errors[0]
    assert "--recompute" not in errors[0]            # recompute needs a GPU: not offered


@pytest.mark.parametrize("model", ["gated", "linear"])
def test_the_hf_example_learns_with_its_defaults(model):
    rc, lines = _run(["-m", "torch.distributed.run", "--nproc-per-node", "1",
                      "examples/hf_llama_cp.py", "--cp", "1", "--batch", "16", "--model", model],
                     timeout=400)
    assert rc == 0, lines[-5:]
    last = lines[-1]
    assert last.startswith("final loss") and last.endswith("far below chance)"), lines[-5:]
    assert float(re.search(r"final loss ([\d.]+)", last).group(1)) < 0.5, last

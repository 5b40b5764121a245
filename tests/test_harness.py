"""The process harness proves its own failure modes: errors carry rank + traceback, hangs time
out; and its ranks, forked from a server that imported torch once, see the caller's
environment as it is at the call."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from sp_attention.testing import WorkerError, assert_close, run_distributed


def _returns_rank(rank, world):
    return rank * 10


def _rank1_raises(rank, world):
    if rank == 1:
        raise KeyError("planted failure on rank one")
    return rank


def _rank0_skips_collective(rank, world):
    if rank != 0:
        dist.all_reduce(torch.ones(1))
    return rank


def test_results_come_back_by_rank():
    assert run_distributed(_returns_rank, 3) == [0, 10, 20]


def _env_and_pid(rank, world):
    return os.environ.get("SP_HARNESS_PROBE"), os.getpid()


def test_ranks_take_the_callers_environment_at_each_call(monkeypatch):
    """The fork server started at some earlier call, with that moment's environment: a
    variable set (or removed) since reaches every rank all the same (e.g. Triton's interpreter
    switch, read when a rank first imports a kernel module), and each rank is its own
    process."""
    run_distributed(_returns_rank, 1)                   # the server is running now
    monkeypatch.setenv("SP_HARNESS_PROBE", "first")
    got = run_distributed(_env_and_pid, 3)
    assert [g[0] for g in got] == ["first"] * 3
    assert len({g[1] for g in got} | {os.getpid()}) == 4
    monkeypatch.delenv("SP_HARNESS_PROBE")
    assert [g[0] for g in run_distributed(_env_and_pid, 2)] == [None, None]


def test_worker_exception_carries_rank_and_traceback():
    with pytest.raises(WorkerError) as e:
        run_distributed(_rank1_raises, 2, timeout=60)
    msg = str(e.value)
    assert "rank 1" in msg and "planted failure on rank one" in msg and "_rank1_raises" in msg


def test_skipped_collective_fails_within_timeout():
    """A skipped collective fails (never hangs): the peer's closed connection, or 15 s without
    progress of the rank left waiting. The bound is a hang detector, not a load detector."""
    t0 = time.monotonic()
    with pytest.raises((TimeoutError, WorkerError)) as e:
        run_distributed(_rank0_skips_collective, 2, timeout=15)
    assert time.monotonic() - t0 < 600
    assert "rank" in str(e.value)


def _slow_then_deadlocked(rank, world, mark):
    if rank == 1:                   # 4 s of CPU while rank 0 waits for it in a collective
        end = time.process_time() + 4.0
        while time.process_time() < end:
            pass
    dist.all_reduce(torch.ones(1))
    if rank == 0:
        open(mark, "w").close()     # the slow phase passed
    dist.recv(torch.ones(1), src=1 - rank)     # then both wait for each other: a deadlock
    return rank


def test_timeout_counts_stalls_not_slowness(tmp_path):
    """``timeout`` is a hang detector: a rank computing past ``timeout`` while its peer waits in
    a collective is slow, not hung (gloo's own collective timeout is no shorter); the deadlock
    after it fails once the ranks made no progress for ``timeout`` seconds."""
    mark = str(tmp_path / "slow phase passed")
    with pytest.raises(TimeoutError, match="made no progress"):
        run_distributed(_slow_then_deadlocked, 2, mark, timeout=3)
    assert os.path.exists(mark)


def test_run_process_timeout_is_a_hang_detector():
    """``run_process``: a child that sleeps (no CPU) fails after ``timeout`` seconds without
    progress, its tree killed; one that computes past ``timeout`` finishes."""
    import subprocess
    import sys

    from sp_attention.testing import run_process
    with pytest.raises(subprocess.TimeoutExpired):
        run_process([sys.executable, "-c", "import time; time.sleep(600)"], timeout=1.5)
    busy = "import time\nend = time.process_time() + 3\nwhile time.process_time() < end: pass"
    r = run_process([sys.executable, "-c", busy + "\nprint('done')"], timeout=1.5)
    assert r.returncode == 0 and r.stdout.strip() == "done"


def test_assert_close_rejects_nan_and_large_error():
    x = torch.ones(4, dtype=torch.float64)
    assert assert_close(x, x) == 0.0
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close(torch.tensor([1.0, float("nan")]), torch.ones(2))
    with pytest.raises(AssertionError, match="relative RMS"):
        assert_close(x * 1.01, x, rtol=1e-3)
    with pytest.raises(AssertionError, match="shape"):
        assert_close(x, x[:2])

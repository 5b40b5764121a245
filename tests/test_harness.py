"""The spawn harness proves its own failure modes: errors carry rank + traceback, hangs time out."""
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


def test_worker_exception_carries_rank_and_traceback():
    with pytest.raises(WorkerError) as e:
        run_distributed(_rank1_raises, 2, timeout=60)
    msg = str(e.value)
    assert "rank 1" in msg and "planted failure on rank one" in msg and "_rank1_raises" in msg


def test_skipped_collective_fails_within_timeout():
    t0 = time.monotonic()
    with pytest.raises((TimeoutError, WorkerError)) as e:
        run_distributed(_rank0_skips_collective, 2, timeout=15)
    assert time.monotonic() - t0 < 60
    assert "rank" in str(e.value)


def test_assert_close_rejects_nan_and_large_error():
    x = torch.ones(4, dtype=torch.float64)
    assert assert_close(x, x) == 0.0
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close(torch.tensor([1.0, float("nan")]), torch.ones(2))
    with pytest.raises(AssertionError, match="relative RMS"):
        assert_close(x * 1.01, x, rtol=1e-3)
    with pytest.raises(AssertionError, match="shape"):
        assert_close(x, x[:2])

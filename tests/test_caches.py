"""The bounded cache (``sp_attention/caches.py``): made once, kept while used, least recently
used dropped first, never above its bound. The caches built on it are tested with their
modules (``test_leaves.py``, ``test_scan_allgather.py``, ``test_slope_constants.py``)."""
import pytest
import torch

from sp_attention.caches import LRU, to_device


def test_made_once_bounded_least_recently_used_dropped():
    made = []
    cache = LRU(3)

    def get(key):
        return cache.get(key, lambda: made.append(key) or f"value {key}")
    assert get(1) == "value 1" and get(1) == "value 1" and made == [1]
    get(2), get(3), get(1)              # 1 is now the most recently used
    get(4)                              # drops 2, the least recently used
    assert len(cache) == 3 and cache.keys() == [3, 1, 4] and 2 not in cache
    assert cache.touch(3) and not cache.touch(2) and cache.keys() == [1, 4, 3]
    get(2)
    assert made == [1, 2, 3, 4, 2] and cache.keys() == [4, 3, 2]
    assert cache.lookup(3) == "value 3" and cache.keys() == [4, 2, 3]   # lookup: now recent
    assert cache.lookup(99) is None and cache.keys() == [4, 2, 3]
    for key in range(100):
        cache.put(key, key)
    assert len(cache) == 3
    cache.clear()
    assert len(cache) == 0


def test_a_failing_make_leaves_nothing():
    cache = LRU(2)
    with pytest.raises(ZeroDivisionError):
        cache.get("x", lambda: 1 / 0)
    assert "x" not in cache and len(cache) == 0


@pytest.mark.parametrize("bad", [0, -1, 2.5, None])
def test_bound_must_be_positive(bad):
    with pytest.raises(ValueError, match="positive int"):
        LRU(bad)


def test_to_device_copies_the_values():
    t = torch.arange(6, dtype=torch.int32).reshape(3, 2)
    out = to_device(t, torch.device("cpu"))
    assert torch.equal(out, t) and out.dtype == torch.int32


@pytest.mark.gpu
def test_to_device_does_not_wait_for_the_gpu():
    """A cache's host tensor goes to the GPU without a stream sync (torch's sync debug mode
    raises at any synchronizing call), and arrives whole though the host tensor is gone."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):                       # a queue for a blocking copy to wait behind
        busy = busy @ busy / 64
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = to_device(torch.arange(1 << 20, dtype=torch.int64), "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out.cpu(), torch.arange(1 << 20, dtype=torch.int64))

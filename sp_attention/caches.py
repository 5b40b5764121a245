"""The one bounded process cache of the library (pure-function caches use
``functools.lru_cache`` with a ``maxsize``; nothing is cached without a bound).

Caches exist for host time, never for the numbers: an entry dropped is made again on its next
use, at the cost the cache saves (a host-to-device copy, a stream, a check).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, TypeVar

import torch

__all__ = ["LRU", "to_device"]

T = TypeVar("T")


class LRU:
    """A dict of at most ``maxsize`` entries; the least recently used is dropped first."""

    def __init__(self, maxsize: int):
        if not isinstance(maxsize, int) or maxsize < 1:
            raise ValueError(f"LRU maxsize must be a positive int, got {maxsize!r}")
        self.maxsize = maxsize
        self._data: "OrderedDict[Hashable, object]" = OrderedDict()

    def get(self, key: Hashable, make: Callable[[], T]) -> T:
        """The entry of ``key``, made by ``make()`` (and kept) if absent."""
        if key in self._data:
            self._data.move_to_end(key)
            return self._data[key]  # type: ignore[return-value]
        value = make()
        self.put(key, value)
        return value

    def put(self, key: Hashable, value: object) -> None:
        self._data[key] = value
        self._data.move_to_end(key)
        while len(self._data) > self.maxsize:
            self._data.popitem(last=False)

    def lookup(self, key: Hashable):
        """The entry of ``key`` (now the most recently used), or None."""
        value = self._data.get(key)
        if value is not None:
            try:
                self._data.move_to_end(key)
            except KeyError:        # dropped by another thread in between: still a valid entry
                pass
        return value

    def touch(self, key: Hashable) -> bool:
        """Whether ``key`` is held; if so it becomes the most recently used."""
        if key not in self._data:
            return False
        self._data.move_to_end(key)
        return True

    def __contains__(self, key: Hashable) -> bool:
        return key in self._data

    def keys(self) -> list:
        """The keys held, least recently used first."""
        return list(self._data)

    def values(self) -> list:
        """The entries held, least recently used first."""
        return list(self._data.values())

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        self._data.clear()


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` (a host tensor a cache builds: plan indices, boundaries, constants) on ``device``
    without a stream sync: a copy from pageable host memory with ``non_blocking`` is staged at
    once (the host tensor may go right after) and queued behind the stream's work, where a
    blocking copy would first wait for everything queued — the GPU's whole lead on the host."""
    return t.to(device, non_blocking=True)

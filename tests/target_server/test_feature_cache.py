"""The target's feature cache: exact round trip per sample, bounded, and only whole batches served from it."""

from __future__ import annotations

import torch

from target_server.feature_cache import FeatureCache


def captured(batch: int, seq: int, dim: int, seed: int) -> torch.Tensor:
    return torch.randn(batch, seq, dim, generator=torch.Generator().manual_seed(seed))


def test_cached_samples_come_back_exactly_in_any_batch_layout():
    cache = FeatureCache(max_bytes=1 << 20)
    first = captured(3, 10, 8, 0)
    cache.store([7, 2, 5], [10, 6, 3], first)
    assert len(cache) == 3 and cache.misses == 1
    assert cache.nbytes == (10 + 6 + 3) * 8 * 4
    assert cache.covers([5, 7]) and not cache.covers([5, 8])
    # Another epoch packs them differently: other rows, a longer bucket, stale data in the buffer.
    out = torch.full((4, 12, 8), 99.0)
    cache.fill([5, 7], out)
    assert torch.equal(out[0, :3], first[2, :3]) and torch.equal(out[1, :10], first[0, :10])
    assert out[0, 3:].abs().sum() == 0 and out[1, 10:].abs().sum() == 0 and out[2:].abs().sum() == 0
    assert cache.hits == 1


def test_budget_bounds_the_cache_and_disabled_cache_serves_nothing():
    cache = FeatureCache(max_bytes=(10 + 6) * 8 * 4)  # room for the first two samples only
    cache.store([0, 1, 2], [10, 6, 3], captured(3, 10, 8, 1))
    assert len(cache) == 2 and cache.full
    assert cache.nbytes <= cache.max_bytes
    cache.store([3], [2], captured(1, 10, 8, 2))  # once full, nothing more is kept
    assert len(cache) == 2
    off = FeatureCache(max_bytes=0)
    off.store([0], [4], captured(1, 4, 8, 3))
    assert not off.enabled and len(off) == 0 and not off.covers([0])


def test_the_memory_floor_stops_the_cache_before_the_budget_and_says_how_much_was_free():
    free = [10_000]  # bytes the device reports free
    cache = FeatureCache(max_bytes=1 << 20, keep_free_bytes=4_000, available_bytes=lambda: free[0])
    cache.store([0], [10], captured(1, 10, 8, 4))  # 320 bytes: 9,680 stay free
    assert len(cache) == 1 and not cache.full
    free[0] = 4_200  # the drafters grew: 320 more bytes would leave 3,880 < 4,000
    cache.store([1], [10], captured(1, 10, 8, 5))
    assert len(cache) == 1 and cache.full and cache.stopped_for_memory == 4_200
    free[0] = 1 << 30  # memory came back: the cache stays as it is (first come, kept)
    cache.store([2], [10], captured(1, 10, 8, 6))
    assert len(cache) == 1 and cache.covers([0])
    unknown = FeatureCache(max_bytes=1 << 20, keep_free_bytes=1 << 40, available_bytes=lambda: None)
    unknown.store([0], [10], captured(1, 10, 8, 7))  # a device that does not say: only the budget bounds it
    assert len(unknown) == 1 and unknown.stopped_for_memory is None

"""Captured features kept per training sample, so later epochs need no target forward.

The target's forward pass is the expensive part of the job; on a small data set
trained for several epochs it would recompute the same features every epoch.
With ``target.feature_cache_gb`` > 0 the capture thread keeps each sample's
features (``[length, k*H]`` in the capture dtype, on the target's device) the
first time it captures them, until the budget is spent (first come, kept: the
plan reshuffles every epoch, so any eviction order would thrash), or until
growing it would leave less than ``target.feature_cache_keep_free_gb`` of the
device's memory (``memory_headroom``): the budget is what the user allows, the
floor is what the machine can give, whichever ends first. A batch
whose samples are all cached is assembled from the cache instead of running the
model; the values are the ones the forward produced for that sample, so
drafters train on exactly what a recompute would send, up to the last bits a
different batch shape can change in the model's kernels.

Only the capture thread touches the cache; it needs no lock.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch


class FeatureCache:
    def __init__(self, max_bytes: int, keep_free_bytes: int = 0,
                 available_bytes: Callable[[], int | None] = lambda: None) -> None:
        if max_bytes < 0 or keep_free_bytes < 0:
            raise ValueError(f"max_bytes and keep_free_bytes must be >= 0, got {max_bytes}, {keep_free_bytes}")
        self.max_bytes = max_bytes
        self.keep_free_bytes = keep_free_bytes
        self._available_bytes = available_bytes  # None: the device does not say
        self.nbytes = 0
        self.full = False  # a sample did not fit: the budget or the memory is spent
        self.stopped_for_memory: int | None = None  # bytes that were free when the floor stopped it
        self._rows: dict[int, torch.Tensor] = {}
        self.hits = 0  # batches assembled from the cache
        self.misses = 0  # batches that ran the target

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def covers(self, sample_ids: Sequence[int]) -> bool:
        return self.enabled and all(i in self._rows for i in sample_ids)

    def fill(self, sample_ids: Sequence[int], features: torch.Tensor) -> None:
        """Write the cached features of ``sample_ids`` into rows of ``features`` (``[B, T, F]``);
        positions past each sample's length and rows past the samples are zeroed."""
        features.zero_()
        for row, sample_id in enumerate(sample_ids):
            cached = self._rows[sample_id]
            features[row, : cached.shape[0]].copy_(cached, non_blocking=True)
        self.hits += 1

    def store(self, sample_ids: Sequence[int], lengths: Sequence[int], features: torch.Tensor) -> None:
        """Keep rows of a freshly captured batch (``lengths[row]`` real positions each) while the budget lasts."""
        self.misses += 1
        if not self.enabled or self.full:
            return
        per_position = features.shape[-1] * features.element_size()
        new = sum(length for sample_id, length in zip(sample_ids, lengths) if sample_id not in self._rows)
        free = self._available_bytes() if new else None
        if free is not None and free - new * per_position < self.keep_free_bytes:
            self.full = True
            self.stopped_for_memory = free
            return
        for row, (sample_id, length) in enumerate(zip(sample_ids, lengths)):
            if sample_id in self._rows:
                continue
            size = length * per_position
            if self.nbytes + size > self.max_bytes:
                self.full = True
                return
            self._rows[sample_id] = features[row, :length].clone()
            self.nbytes += size

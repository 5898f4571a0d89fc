"""Length buckets and the epoch plan of the target server.

Every batch has one of a few fixed shapes ``[B_i, T_i]`` (bucket ``i`` has
sequence length ``T_i = lengths[i]`` and batch size
``B_i = max(1, tokens_per_batch // T_i)``), so the target can pre-allocate its
capture buffers once per bucket and the drafters see a bounded set of shapes.

A sample goes to the smallest bucket whose length holds it. A sample longer
than the largest bucket goes to the largest bucket and :func:`pack_batch`
truncates it to that length (the data loader already truncates to
``max_seq_len``, which the config keeps at or below the largest bucket).

The plan of an epoch depends only on (sample lengths, bucket spec, seed,
epoch), so every process that builds it from the same inputs gets the same
batches; ``plan_index`` counts batches across epochs.
"""

from __future__ import annotations

import bisect
import logging
import random
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BucketSpec:
    """Fixed batch shapes: bucket ``i`` is ``[batch_size(i), lengths[i]]``."""

    lengths: tuple[int, ...]
    tokens_per_batch: int

    def __post_init__(self) -> None:
        # Accept any sequence (a config list) and keep an immutable tuple.
        object.__setattr__(self, "lengths", tuple(int(n) for n in self.lengths))
        object.__setattr__(self, "tokens_per_batch", int(self.tokens_per_batch))
        if not self.lengths:
            raise ValueError("bucket lengths must not be empty")
        if any(n < 1 for n in self.lengths):
            raise ValueError(f"bucket lengths must be >= 1, got {list(self.lengths)}")
        if list(self.lengths) != sorted(set(self.lengths)):
            raise ValueError(f"bucket lengths must be strictly increasing, got {list(self.lengths)}")
        if self.tokens_per_batch < 1:
            raise ValueError(f"tokens_per_batch must be >= 1, got {self.tokens_per_batch}")

    @property
    def num_buckets(self) -> int:
        return len(self.lengths)

    def batch_size(self, bucket: int) -> int:
        return max(1, self.tokens_per_batch // self.lengths[bucket])

    def shape(self, bucket: int) -> tuple[int, int]:
        """``(B, T)`` of the bucket's batches."""
        return self.batch_size(bucket), self.lengths[bucket]

    def shapes(self) -> list[tuple[int, int]]:
        return [self.shape(i) for i in range(self.num_buckets)]

    def bucket_of(self, length: int) -> int:
        return assign_bucket(length, self.lengths)


def assign_bucket(length: int, lengths: Sequence[int]) -> int:
    """Index of the smallest bucket with ``lengths[i] >= length``.

    A length above the largest bucket gets the largest bucket (index
    ``len(lengths) - 1``); the caller truncates the sample to it
    (:func:`pack_batch` does).
    """
    if length < 0:
        raise ValueError(f"sample length must be >= 0, got {length}")
    return min(bisect.bisect_left(lengths, length), len(lengths) - 1)


@dataclass(frozen=True)
class PlannedBatch:
    """One batch of the plan; ``sample_ids`` holds only real samples (the
    last batch of a bucket in an epoch may have fewer than its batch size: the
    rest is padding)."""

    plan_index: int
    epoch: int
    bucket: int
    sample_ids: tuple[int, ...]

    @property
    def num_samples(self) -> int:
        return len(self.sample_ids)


class BatchPlan:
    """Deterministic batches of every epoch for the given sample lengths.

    Epoch ``e``: shuffle sample ids with ``random.Random(seed + e)``, group
    them by bucket (keeping the shuffled order), cut each bucket's list into
    batches of its batch size (the last one may be partial), then shuffle the
    batch order with the same generator. The number of batches per epoch is the
    same for every epoch.
    """

    def __init__(self, sample_lengths: Sequence[int], spec: BucketSpec, seed: int) -> None:
        if not sample_lengths:
            raise ValueError("cannot plan batches for an empty data set")
        self.spec = spec
        self.seed = int(seed)
        self.num_samples = len(sample_lengths)
        self._bucket_of = [assign_bucket(int(n), spec.lengths) for n in sample_lengths]
        counts = [0] * spec.num_buckets
        for b in self._bucket_of:
            counts[b] += 1
        self.bucket_counts: tuple[int, ...] = tuple(counts)
        self.batches_per_epoch = sum(-(-c // spec.batch_size(b)) for b, c in enumerate(counts))
        # A few recent epochs, so lookups around an epoch boundary (the
        # scheduler looks ahead while the capture thread finishes the previous
        # epoch) do not reshuffle; the lock makes the plan safe to share
        # between threads.
        self._cache: OrderedDict[int, list[tuple[int, tuple[int, ...]]]] = OrderedDict()
        self._cache_epochs = 3
        self._lock = threading.Lock()

    def bucket_of_sample(self, sample_id: int) -> int:
        return self._bucket_of[sample_id]

    def epoch_of(self, plan_index: int) -> int:
        if plan_index < 0:
            raise IndexError(f"plan_index must be >= 0, got {plan_index}")
        return plan_index // self.batches_per_epoch

    def _epoch_batches(self, epoch: int) -> list[tuple[int, tuple[int, ...]]]:
        with self._lock:
            cached = self._cache.get(epoch)
            if cached is not None:
                self._cache.move_to_end(epoch)
                return cached
        rng = random.Random(self.seed + epoch)
        order = list(range(self.num_samples))
        rng.shuffle(order)
        per_bucket: list[list[int]] = [[] for _ in range(self.spec.num_buckets)]
        for sample_id in order:
            per_bucket[self._bucket_of[sample_id]].append(sample_id)
        batches: list[tuple[int, tuple[int, ...]]] = []
        for bucket, ids in enumerate(per_bucket):
            size = self.spec.batch_size(bucket)
            for start in range(0, len(ids), size):
                batches.append((bucket, tuple(ids[start:start + size])))
        rng.shuffle(batches)
        with self._lock:
            self._cache[epoch] = batches
            while len(self._cache) > self._cache_epochs:
                self._cache.popitem(last=False)
        return batches

    def batch(self, plan_index: int) -> PlannedBatch:
        """The batch at global position ``plan_index`` (across epochs)."""
        epoch = self.epoch_of(plan_index)
        bucket, ids = self._epoch_batches(epoch)[plan_index - epoch * self.batches_per_epoch]
        return PlannedBatch(plan_index=plan_index, epoch=epoch, bucket=bucket, sample_ids=ids)

    def epoch(self, epoch: int) -> list[PlannedBatch]:
        """All batches of ``epoch`` in plan order."""
        first = epoch * self.batches_per_epoch
        return [self.batch(first + k) for k in range(self.batches_per_epoch)]


def pack_batch(
    samples: Sequence,
    B: int,
    T: int,
    pad_id: int,
    *,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pack samples into fixed-shape host tensors.

    Returns ``(input_ids Long[B, T], loss_mask Uint8[B, T], lengths Int32[B])``:
    row ``r < len(samples)`` holds sample ``r`` truncated to ``T`` and padded
    with ``pad_id`` (mask 0 on padding); rows past the samples are all padding
    with length 0. ``out`` reuses pre-allocated tensors of those shapes and
    dtypes (they are overwritten and returned).
    """
    if len(samples) > B:
        raise ValueError(f"{len(samples)} samples do not fit a batch of {B} rows")
    if out is None:
        input_ids = torch.empty((B, T), dtype=torch.long)
        loss_mask = torch.empty((B, T), dtype=torch.uint8)
        lengths = torch.empty((B,), dtype=torch.int32)
    else:
        input_ids, loss_mask, lengths = out
        if tuple(input_ids.shape) != (B, T) or tuple(loss_mask.shape) != (B, T) or tuple(lengths.shape) != (B,):
            raise ValueError(f"out tensors have shapes {tuple(input_ids.shape)}, {tuple(loss_mask.shape)}, "
                             f"{tuple(lengths.shape)}; expected ({B}, {T}), ({B}, {T}), ({B},)")
    input_ids.fill_(pad_id)
    loss_mask.zero_()
    lengths.zero_()
    for row, sample in enumerate(samples):
        ids = torch.as_tensor(sample.input_ids)[:T]
        mask = torch.as_tensor(sample.loss_mask)[:T]
        n = int(ids.shape[0])
        input_ids[row, :n] = ids
        loss_mask[row, :n] = mask
        lengths[row] = n
    return input_ids, loss_mask, lengths

"""Tests for target_server/bucketing.py: bucket shapes, the epoch plan, packing."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from target_server.bucketing import BatchPlan, BucketSpec, assign_bucket, pack_batch
from target_server.data import Sample


def make_lengths(n: int = 500, seed: int = 7) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 300) for _ in range(n)]


def test_bucket_spec_shapes_are_fixed():
    spec = BucketSpec([64, 128, 256], tokens_per_batch=1024)
    assert spec.lengths == (64, 128, 256)
    assert spec.shapes() == [(16, 64), (8, 128), (4, 256)]
    assert BucketSpec([64, 2048], tokens_per_batch=1024).shape(1) == (1, 2048)
    for bad in ([], [128, 64], [64, 64], [0, 8]):
        with pytest.raises(ValueError):
            BucketSpec(bad, tokens_per_batch=1024)


def test_assign_bucket_picks_smallest_that_fits():
    lengths = [64, 128, 256]
    assert assign_bucket(1, lengths) == 0
    assert assign_bucket(64, lengths) == 0
    assert assign_bucket(65, lengths) == 1
    assert assign_bucket(256, lengths) == 2
    # Longer than the largest bucket: largest bucket, truncated by pack_batch.
    assert assign_bucket(1000, lengths) == 2


def test_plan_covers_every_sample_once_per_epoch_in_fixed_shapes():
    lengths = make_lengths()
    spec = BucketSpec([64, 128, 256], tokens_per_batch=1024)
    plan = BatchPlan(lengths, spec, seed=3)
    expected = sum(-(-c // spec.batch_size(b)) for b, c in enumerate(plan.bucket_counts))
    assert plan.batches_per_epoch == expected
    for epoch in range(3):
        batches = plan.epoch(epoch)
        assert len(batches) == plan.batches_per_epoch
        seen = Counter(i for b in batches for i in b.sample_ids)
        assert sorted(seen) == list(range(len(lengths))) and set(seen.values()) == {1}
        partial = Counter()
        for b in batches:
            B, T = spec.shape(b.bucket)
            assert b.epoch == epoch and 1 <= b.num_samples <= B
            assert all(assign_bucket(lengths[i], spec.lengths) == b.bucket for i in b.sample_ids)
            assert all(lengths[i] <= T for i in b.sample_ids if b.bucket < spec.num_buckets - 1)
            if b.num_samples < B:
                partial[b.bucket] += 1
        assert all(v <= 1 for v in partial.values())  # at most the last batch of a bucket is partial


def test_plan_is_deterministic_and_changes_per_epoch():
    lengths = make_lengths()
    spec = BucketSpec([32, 64, 128, 256], tokens_per_batch=512)
    a = BatchPlan(lengths, spec, seed=11)
    b = BatchPlan(list(lengths), BucketSpec([32, 64, 128, 256], 512), seed=11)
    n = a.batches_per_epoch
    # Random access in any order gives the same batches (no hidden cursor).
    order = list(range(3 * n))
    random.Random(0).shuffle(order)
    assert [a.batch(i) for i in range(3 * n)] == sorted((b.batch(i) for i in order), key=lambda x: x.plan_index)
    assert [x.sample_ids for x in a.epoch(0)] != [x.sample_ids for x in a.epoch(1)]
    assert [x.sample_ids for x in BatchPlan(lengths, spec, seed=12).epoch(0)] != [x.sample_ids for x in a.epoch(0)]


def test_plan_index_maps_to_epoch():
    plan = BatchPlan([10] * 10, BucketSpec([16], tokens_per_batch=64), seed=0)  # 4 per batch -> 3 batches
    assert plan.batches_per_epoch == 3
    assert [plan.batch(i).epoch for i in range(7)] == [0, 0, 0, 1, 1, 1, 2]
    assert [plan.batch(i).plan_index for i in range(7)] == list(range(7))
    assert sorted(plan.batch(i).num_samples for i in range(3)) == [2, 4, 4]
    with pytest.raises(IndexError):
        plan.batch(-1)
    with pytest.raises(ValueError):
        BatchPlan([], BucketSpec([16], 64), seed=0)


def sample(sample_id: int, n: int, first_masked: int = 0) -> Sample:
    ids = torch.arange(100 + sample_id * 10, 100 + sample_id * 10 + n, dtype=torch.int32)
    mask = torch.zeros(n, dtype=torch.uint8)
    mask[first_masked:] = 1
    return Sample(sample_id=sample_id, input_ids=ids, loss_mask=mask)


def test_pack_batch_pads_and_truncates():
    samples = [sample(0, 5, first_masked=2), sample(1, 12, first_masked=1)]
    ids, mask, lengths = pack_batch(samples, B=3, T=8, pad_id=2)
    assert ids.dtype == torch.long and ids.shape == (3, 8)
    assert mask.dtype == torch.uint8 and mask.shape == (3, 8)
    assert lengths.dtype == torch.int32 and lengths.tolist() == [5, 8, 0]
    assert ids[0].tolist() == [100, 101, 102, 103, 104, 2, 2, 2]
    assert mask[0].tolist() == [0, 0, 1, 1, 1, 0, 0, 0]
    assert ids[1].tolist() == list(range(110, 118))  # truncated to T
    assert mask[1].tolist() == [0] + [1] * 7
    assert ids[2].tolist() == [2] * 8 and mask[2].tolist() == [0] * 8
    with pytest.raises(ValueError):
        pack_batch(samples, B=1, T=8, pad_id=0)


def test_pack_batch_reuses_preallocated_buffers():
    out = (torch.full((2, 6), 7, dtype=torch.long), torch.ones(2, 6, dtype=torch.uint8),
           torch.full((2,), 9, dtype=torch.int32))
    ids, mask, lengths = pack_batch([sample(0, 3)], B=2, T=6, pad_id=0, out=out)
    assert ids is out[0] and mask is out[1] and lengths is out[2]
    assert ids.tolist() == [[100, 101, 102, 0, 0, 0], [0] * 6]
    assert mask.tolist() == [[1, 1, 1, 0, 0, 0], [0] * 6] and lengths.tolist() == [3, 0]
    with pytest.raises(ValueError):
        pack_batch([sample(0, 3)], B=2, T=5, pad_id=0, out=out)


def test_plan_is_consistent_across_threads_and_epoch_boundaries():
    # Guards against a single-epoch cache shared by the scheduler and the
    # capture thread: lookups on both sides of an epoch boundary from two
    # threads must never see another epoch's batches.
    import threading

    plan = BatchPlan(make_lengths(300), BucketSpec([64, 128, 256], 256), seed=5)
    reference = BatchPlan(make_lengths(300), BucketSpec([64, 128, 256], 256), seed=5)
    n = plan.batches_per_epoch
    indices = [e * n + k for k in range(0, n, 3) for e in range(6)]
    expected = {i: reference.batch(i) for i in indices}
    errors = []

    def worker(order):
        for i in order:
            if plan.batch(i) != expected[i]:
                errors.append(i)

    threads = [threading.Thread(target=worker, args=(indices[::step],)) for step in (1, -1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads) and errors == []

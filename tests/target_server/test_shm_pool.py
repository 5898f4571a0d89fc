"""Tests for target_server/shm_pool.py: the zero-copy batch pool of the shm transport."""

from __future__ import annotations

import uuid

import pytest
import torch

from common import protocol as P
from common.packing import BatchLayout
from common.shm_transport import SHM_DIR, ShmRing, liveness_name, segment_name, unlink_segment
from common.transport import TransportError
from drafter_worker.data_plane import check_slot_kept
from target_server.scheduler import BatchScheduler, ReadyBatch
from target_server.shm_pool import ShmBatchPool

pytestmark = [pytest.mark.timeout(60), pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm")]

LAYOUTS = [BatchLayout(2, 8, 6, torch.float32), BatchLayout(1, 16, 6, torch.float32)]


@pytest.fixture
def pool():
    name = segment_name("test-pool", uuid.uuid4().hex[:8])
    pool = ShmBatchPool(name, LAYOUTS, 2)
    yield pool
    if pool.buffers:
        pool.close()
    unlink_segment(name)


def meta(bucket: int, slot: int, tag: int) -> P.Batch:
    layout = LAYOUTS[bucket]
    return P.Batch(batch_id=0, epoch=0, bucket=bucket, sample_ids=[0], batch_size=layout.batch_size,
                   seq_len=layout.seq_len, feature_dim=layout.feature_dim, dtype="float32", nbytes=layout.nbytes,
                   tag=tag, num_tokens=4, slot=slot)


def test_buffers_are_the_shared_slots_a_drafter_maps(pool):
    reader = ShmRing.attach(pool.name, pool.slot_bytes, pool.slots_per_bucket)
    try:
        buf = pool.buffers[1][1]
        assert pool.slot_of(buf) == 1 and pool.slot_of(pool.buffers[0][0]) == 0
        features, ids, _, _ = LAYOUTS[1].views(buf)
        features.fill_(3.5)  # what the capture hooks do: write into the buffer
        ids.fill_(11)
        tag = pool.publish(1, 1)
        reader.wait_ready(1, 1, tag, timeout_s=5)
        seen, seen_ids, _, _ = LAYOUTS[1].views(reader.payload(1, 1))
        assert bool((seen == 3.5).all()) and bool((seen_ids == 11).all())
    finally:
        reader.close()


def test_tags_are_fresh_and_a_rewrite_is_seen_by_a_reader(pool):
    reader = ShmRing.attach(pool.name, pool.slot_bytes, pool.slots_per_bucket)
    try:
        tags = [pool.publish(0, 0), pool.publish(0, 1), pool.publish(1, 0)]
        assert tags == sorted(set(tags)) and 0 not in tags
        check_slot_kept(reader, meta(0, 1, tags[1]))  # unchanged: fine
        pool.begin_write(0, 1)  # the capture thread takes the slot again
        with pytest.raises(TransportError, match="rewritten"):
            check_slot_kept(reader, meta(0, 1, tags[1]))
        pool.publish(0, 1)
        with pytest.raises(TransportError, match="rewritten"):
            check_slot_kept(reader, meta(0, 1, tags[1]))
    finally:
        reader.close()


def test_close_removes_the_segment_and_a_mapping_outlives_it(pool):
    reader = ShmRing.attach(pool.name, pool.slot_bytes, pool.slots_per_bucket)
    pool.buffers[0][0].fill_(7)
    pool.close()
    assert not (SHM_DIR / pool.name).exists()
    assert bool((reader.payload(0, 0) == 7).all())
    reader.close()


def test_a_pinned_slot_is_not_captured_into_until_released(pool):
    sched = BatchScheduler(bucket_of=lambda i: 0, layouts=LAYOUTS, slots_per_bucket=1, total_batches=None,
                           device=torch.device("cpu"), buffers=pool.buffers)
    sched.join("g", 1, 0, [])

    def capture() -> ReadyBatch | None:
        got = sched.next_to_capture(timeout_s=0.2)
        if got is None:
            return None
        index, buf = got
        ready = ReadyBatch(index, 0, 0, [index], 4, buf, LAYOUTS[0], shm_slot=pool.slot_of(buf))
        sched.publish(ready)
        return ready

    first = capture()
    sent = sched.take_for("g")  # dispatched: a drafter reads slot `first.shm_slot` in place
    assert sent is first and sent.pins == 1
    second = capture()
    assert second is not None and second.shm_slot != first.shm_slot
    assert sched.take_for("g") is second  # both slots are now held by the drafter
    assert capture() is None, "a slot a drafter still reads was handed out for capture"
    sched.release(first)  # its ACK
    third = capture()
    assert third is not None and third.shm_slot == first.shm_slot


def test_a_reader_is_alive_while_it_holds_the_pool_and_gone_once_it_closes(pool):
    # Regression: a pid check freed a live drafter's slots at once when its pid was not
    # visible (another PID namespace), and the drafter then trained on a torn batch.
    assert not pool.reader_alive("d0", 1)  # never attached: it never read a slot
    reader = ShmRing.attach(pool.name, pool.slot_bytes, pool.slots_per_bucket)
    try:
        reader.hold_liveness("d0", 1)
        assert pool.reader_alive("d0", 1)
        assert not pool.reader_alive("d0", 2) and not pool.reader_alive("d1", 1)  # per registration
        pool.forget_reader("d0", 1)  # the target dropped the registration: file gone, lock kept
        assert not (SHM_DIR / liveness_name(pool.name, "d0", 1)).exists()
        pool.forget_reader("d0", 1)  # idempotent
    finally:
        reader.close()
    assert not pool.reader_alive("d0", 1)

"""Tests for target_server/shm_link.py: the shm link thread, slot accounting, and dispatch that respects slots."""

from __future__ import annotations

import os
import queue
import uuid

import pytest
import torch

from common.packing import BatchLayout
from common.shm_transport import SHM_DIR, ShmRing, segment_name, unlink_segment
from target_server.link import LinkEvent
from target_server.scheduler import BatchScheduler, ReadyBatch
from target_server.shm_link import ShmDrafterLink, SlotTable

pytestmark = [pytest.mark.timeout(60), pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm")]

LAYOUTS = [BatchLayout(2, 8, 6, torch.float32), BatchLayout(1, 16, 6, torch.float32)]


def ready_batch(index: int, bucket: int) -> ReadyBatch:
    layout = LAYOUTS[bucket]
    buf = layout.allocate()
    features, ids, _, lengths = layout.views(buf)
    features.fill_(float(index))
    ids.fill_(index)
    lengths.fill_(index)
    return ReadyBatch(index, 0, bucket, [index], 4, buf, layout, pins=1)


def next_event(events: queue.Queue) -> LinkEvent:
    return events.get(timeout=10)


def test_slot_table_hands_out_each_slot_once_until_it_is_acknowledged():
    table = SlotTable(num_buckets=2, slots_per_bucket=2)
    assert [table.assign(10, 0), table.assign(11, 0)] == [0, 1]
    assert not table.has_free(0) and table.has_free(1)
    table.release(99)  # unknown id: ignored
    assert not table.has_free(0)
    table.release(11)
    assert table.has_free(0) and table.assign(12, 0) == 1
    assert table.held == 2


def test_link_copies_into_the_named_slot_publishes_and_unlinks_on_stop():
    name = segment_name("test", os.getpid(), "ring", uuid.uuid4().hex[:8])
    events: queue.Queue[LinkEvent] = queue.Queue()
    link = ShmDrafterLink(name="t", ring_name=name, slot_bytes=[l.nbytes for l in LAYOUTS], slots_per_bucket=2,
                          events=events)
    link.start()
    try:
        ring = ShmRing.attach(name, [l.nbytes for l in LAYOUTS], 2, timeout_s=10)
        assert not link.paired
        ring.mark_attached()
        assert link.paired
        link.enqueue(ready_batch(5, 1), tag=3, slot=1)
        link.enqueue(ready_batch(6, 0), tag=4, slot=0)
        for tag, bucket, slot, index in ((3, 1, 1, 5), (4, 0, 0, 6)):
            event = next_event(events)
            assert event.kind == "sent" and event.ready.plan_index == index and event.nbytes == LAYOUTS[bucket].nbytes
            ring.wait_ready(bucket, slot, tag, timeout_s=5)
            features, ids, _, lengths = LAYOUTS[bucket].views(ring.payload(bucket, slot))
            assert features.eq(float(index)).all() and ids.eq(index).all() and lengths.eq(index).all()
        with pytest.raises(ValueError):
            link.enqueue(ready_batch(7, 0), tag=5)  # no slot chosen
    finally:
        link.stop()
        link.join(10)
    # Guards against leaking /dev/shm: the registration's end removes the ring's name.
    assert not link.is_alive()
    assert not (SHM_DIR / name).exists()
    # The drafter's mapping outlives the name; it only goes when the drafter drops it.
    assert ring.tag(1, 1) == 3
    ring.close()


def test_stop_hands_back_batches_never_copied():
    name = segment_name("test", os.getpid(), "ring", uuid.uuid4().hex[:8])
    events: queue.Queue[LinkEvent] = queue.Queue()
    link = ShmDrafterLink(name="t", ring_name=name, slot_bytes=[l.nbytes for l in LAYOUTS], slots_per_bucket=1,
                          events=events)
    # The ring exists as soon as the link does, before WELCOME names it.
    assert (SHM_DIR / name).exists()
    # Stopped before it runs: the ring is removed again, and both queued batches come back.
    link.enqueue(ready_batch(1, 0), tag=1, slot=0)
    link.enqueue(ready_batch(2, 1), tag=2, slot=0)
    link.stop()
    link.start()
    link.join(10)
    kinds = sorted((e.kind, e.ready.plan_index) for e in (next_event(events), next_event(events)))
    assert kinds == [("failed", 1), ("failed", 2)]
    assert not (SHM_DIR / name).exists()
    unlink_segment(name)


def test_take_for_declines_a_batch_whose_bucket_the_caller_refuses():
    sched = BatchScheduler(bucket_of=lambda i: i % 2, layouts=LAYOUTS, slots_per_bucket=2, total_batches=None,
                           device=torch.device("cpu"))
    sched.join("g", 0, [])
    for _ in range(2):
        index, buf = sched.next_to_capture(timeout_s=0.1)
        sched.publish(ReadyBatch(index, 0, index % 2, [index], 4, buf, LAYOUTS[index % 2]))
    assert sched.take_for("g", accept=lambda bucket: bucket != 0) is None  # batch 0 is in bucket 0
    ready = sched.take_for("g", accept=lambda bucket: True)
    assert ready.plan_index == 0  # nothing was skipped or lost by the refusal
    assert sched.take_for("g").plan_index == 1

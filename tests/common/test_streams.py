"""Tests for common/streams.py and the stream/event hand-off of the drafter's Receiver.

The CPU tests pin down the no-op contract the CPU path relies on, and run the
real Receiver over a real shm ring. The GPU tests (``-m gpu``, skipped without
CUDA) check the ordering that replaces device-wide synchronisation: a consumer
stream that waits on a producer's event sees the producer's writes, with the
CUDA sync debug mode set to "error" so that any host synchronisation fails.
"""

from __future__ import annotations

import uuid

import pytest
import torch

from common import protocol as P
from common.packing import BatchLayout
from common.shm_transport import SHM_DIR, ShmRing, segment_name, unlink_segment
from common.streams import SideStream, record_current, wait_current
from drafter_worker.data_plane import PoolAttachment, Receiver

CUDA = torch.cuda.is_available()
LAYOUT = BatchLayout(2, 16, 8, torch.float32)


def test_cpu_side_stream_is_a_no_op():
    stream = SideStream(torch.device("cpu"))
    assert stream.stream is None
    with stream.active():
        x = torch.ones(3) * 2
    stream.wait(None)
    stream.wait_default()
    assert stream.record() is None and record_current(torch.device("cpu")) is None
    wait_current(torch.device("cpu"), None)
    assert x.tolist() == [2.0, 2.0, 2.0]


def _batch(tag: int, slot: int) -> P.Batch:
    return P.Batch(batch_id=tag, epoch=0, bucket=0, sample_ids=[tag], batch_size=LAYOUT.batch_size,
                   seq_len=LAYOUT.seq_len, feature_dim=LAYOUT.feature_dim, dtype="float32",
                   nbytes=LAYOUT.nbytes, tag=tag, num_tokens=4, slot=slot)


def _ring_receiver(device: torch.device):
    name = segment_name("test-streams", uuid.uuid4().hex[:8])
    owner = ShmRing.create(name, [LAYOUT.nbytes], 2)
    reader = ShmRing.attach(name, [LAYOUT.nbytes], 2)
    receiver = Receiver(PoolAttachment(reader, timeout_s=10.0), device=device)
    receiver.start()
    return name, owner, reader, receiver


def _fill_slot(owner: ShmRing, slot: int, tag: int) -> None:
    features, ids, _, _ = LAYOUT.views(owner.payload(0, slot))
    features.fill_(float(tag))
    ids.fill_(tag)
    owner.publish(0, slot, tag)


def _run_receiver(device: torch.device) -> None:
    """Post receives into device buffers as the worker does; every batch arrives whole, in order."""
    name, owner, reader, receiver = _ring_receiver(device)
    try:
        bufs = [LAYOUT.allocate(device) for _ in range(2)]
        free = [record_current(device), record_current(device)]
        for tag in range(1, 7):
            slot = tag % 2
            _fill_slot(owner, slot, tag)
            receiver.inbox.put((_batch(tag, slot), bufs[slot], free[slot]))
            meta, buf, ready_event = receiver.ready.get(timeout=10)
            assert meta.tag == tag and buf is bufs[slot]
            wait_current(device, ready_event)  # what the training step does before reading
            features, ids, _, _ = LAYOUT.views(buf)
            doubled = features * 2  # stands in for the training step reading the buffer
            free[slot] = record_current(device)
            assert float(doubled.sum().cpu()) == 2.0 * tag * features.numel()
            assert bool((ids == tag).all().cpu())
    finally:
        receiver.stop()
        receiver.join(10)
        reader.close()
        owner.close()
        unlink_segment(name)


@pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm")
def test_receiver_copies_ring_slots_into_posted_buffers_on_cpu():
    _run_receiver(torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not (CUDA and SHM_DIR.is_dir()), reason="needs CUDA and /dev/shm")
def test_receiver_copies_ring_slots_into_posted_buffers_on_cuda():
    _run_receiver(torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_consumer_stream_sees_producer_writes_without_host_sync():
    device = torch.device("cuda")
    producer, consumer = SideStream(device), SideStream(device)
    producer.wait_default()
    consumer.wait_default()
    src = torch.zeros(1 << 22, device=device)
    dst = torch.empty_like(src)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for value in range(1, 5):
            with producer.active():
                torch.cuda._sleep(2_000_000)  # a slow producer: the consumer must wait for it
                src.fill_(float(value))
            ready = producer.record()
            consumer.wait(ready)
            with consumer.active():
                dst.copy_(src)
            done = consumer.record()
            producer.wait(done)  # the producer overwrites src only after the copy read it
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    assert bool((dst == 4.0).all())

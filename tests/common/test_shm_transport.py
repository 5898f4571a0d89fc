"""Tests for common/shm_transport.py: two processes sharing a ring, timeouts, and who removes a segment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest
import torch

from common.shm_transport import (
    SHM_DIR, LivenessLock, ShmRing, holder_alive, liveness_name, ring_nbytes, segment_name, sweep_stale,
    unlink_segment,
)
from common.transport import TransportError
from tests.conftest import ROOT

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm"),
]

SLOTS = [1000, 4096]  # one size not a multiple of 64


@pytest.fixture
def name():
    name = segment_name("test", os.getpid(), uuid.uuid4().hex[:8])
    yield name
    unlink_segment(name)
    unlink_segment(name + ".tmp")


def child(code: str, *args: str, wait: bool = True, timeout_s: float = 30.0):
    """Run ``code`` in a fresh interpreter (a real second process, own resource tracker if any)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not wait:
        return proc
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, err
    return out


def test_layout_offsets_are_aligned_and_sizes_add_up(name):
    ring = ShmRing.create(name, SLOTS, 3)
    try:
        assert ring.nbytes == ring_nbytes(SLOTS, 3) == (SHM_DIR / name).stat().st_size
        for bucket, size in enumerate(SLOTS):
            for index in range(3):
                view = ring.payload(bucket, index)
                assert view.dtype == torch.uint8 and view.numel() == size
                assert view.data_ptr() % 64 == 0
                assert ring.tag(bucket, index) == 0
        # Slots do not overlap.
        for bucket in range(2):
            for index in range(3):
                ring.payload(bucket, index).fill_(bucket * 3 + index + 1)
        for bucket in range(2):
            for index in range(3):
                assert ring.payload(bucket, index).eq(bucket * 3 + index + 1).all()
    finally:
        ring.unlink()
        ring.close()


def test_publish_in_one_process_is_read_in_place_by_another(name):
    ring = ShmRing.create(name, SLOTS, 2)
    try:
        reader = child(
            """
            import sys
            from common.shm_transport import ShmRing
            ring = ShmRing.attach(sys.argv[1], [1000, 4096], 2, timeout_s=10)
            ring.wait_ready(1, 1, 41, timeout_s=20)
            data = ring.payload(1, 1)
            print(int(data[:4096].sum()), int(data[0]), int(data[4095]))
            # Answer through the ring: the owner sees it in its own mapping.
            ring.payload(0, 0)[:10].fill_(9)
            ring.publish(0, 0, 42)
            ring.close()
            """,
            name, wait=False,
        )
        payload = ring.payload(1, 1)
        payload.fill_(1)
        payload[0], payload[4095] = 7, 5
        ring.publish(1, 1, 41)
        ring.wait_ready(0, 0, 42, timeout_s=20)
        assert ring.payload(0, 0)[:10].eq(9).all()
        out, err = reader.communicate(timeout=20)
        assert reader.returncode == 0, err
        assert out.split() == [str(4096 - 2 + 7 + 5), "7", "5"]
    finally:
        ring.unlink()
        ring.close()


def test_wait_ready_times_out_with_a_transport_error(name):
    ring = ShmRing.create(name, SLOTS, 1)
    try:
        ring.publish(0, 0, 3)
        start = time.monotonic()
        with pytest.raises(TransportError, match="did not get tag 4 within"):
            ring.wait_ready(0, 0, 4, timeout_s=0.2)
        assert 0.15 < time.monotonic() - start < 10.0
        ring.wait_ready(0, 0, 3, timeout_s=0.0)  # already there: no wait at all
    finally:
        ring.unlink()
        ring.close()


def test_stop_event_ends_a_wait_early(name):
    ring = ShmRing.create(name, SLOTS, 1)
    stop = threading.Event()
    threading.Timer(0.1, stop.set).start()
    start = time.monotonic()
    try:
        with pytest.raises(TransportError, match="stopped"):
            ring.wait_ready(0, 0, 1, timeout_s=30, stop=stop)
        assert time.monotonic() - start < 5
    finally:
        ring.unlink()
        ring.close()


def test_attach_side_exit_never_unlinks_and_the_owner_does(name):
    # Guards against multiprocessing.shared_memory's resource tracker, which unlinks a
    # segment when any process that attached it exits.
    ring = ShmRing.create(name, SLOTS, 2)
    ring.payload(0, 1)[:3].fill_(5)
    ring.publish(0, 1, 11)
    out = child(
        """
        import sys
        from common.shm_transport import ShmRing
        ring = ShmRing.attach(sys.argv[1], [1000, 4096], 2)
        ring.wait_ready(0, 1, 11, timeout_s=5)
        print(int(ring.payload(0, 1)[:3].sum()))
        ring.close()
        """,
        name,
    )
    assert out.strip() == "15"
    assert (SHM_DIR / name).exists(), "the attaching process removed the owner's segment"
    # Attached rings cannot remove it either.
    attached = ShmRing.attach(name, SLOTS, 2)
    with pytest.raises(TransportError, match="only the creator"):
        attached.unlink()
    attached.close()
    assert (SHM_DIR / name).exists()
    # The owner's unlink removes the name; a mapping still held stays usable.
    view = ring.payload(0, 1)
    ring.unlink()
    ring.close()
    assert not (SHM_DIR / name).exists()
    assert int(view[:3].sum()) == 15
    with pytest.raises(TransportError, match="closed"):
        ring.payload(0, 0)
    ring.unlink()  # idempotent


def test_attach_waits_for_a_segment_created_later_and_times_out_when_none_comes(name):
    holder: list[ShmRing] = []
    timer = threading.Timer(0.3, lambda: holder.append(ShmRing.create(name, SLOTS, 1)))
    timer.start()
    try:
        ring = ShmRing.attach(name, SLOTS, 1, timeout_s=10)
        ring.close()
    finally:
        timer.join()
        for owned in holder:
            owned.unlink()
            owned.close()
    with pytest.raises(TransportError, match="one host sharing"):
        ShmRing.attach(name, SLOTS, 1, timeout_s=0.1)


def test_attach_refuses_a_segment_of_another_layout(name):
    ring = ShmRing.create(name, SLOTS, 2)
    try:
        with pytest.raises(TransportError, match="bytes"):
            ShmRing.attach(name, SLOTS, 3)
        with pytest.raises(TransportError, match="bytes"):
            ShmRing.attach(name, [1000, 8192], 2)
    finally:
        ring.unlink()
        ring.close()


def test_a_name_with_a_slash_is_refused():
    with pytest.raises(ValueError, match="segment name"):
        ShmRing.create("../etc/passwd", SLOTS, 1)
    assert "/" not in segment_name("pair/d0", 12, "a b")


def test_sweep_removes_segments_of_a_killed_creator_and_keeps_live_ones(name):
    live = ShmRing.create(name, SLOTS, 1)
    dead_name = name + ".dead"
    proc = child(
        """
        import sys, time
        from common.shm_transport import ShmRing
        ring = ShmRing.create(sys.argv[1], [1000, 4096], 1)
        print("ready", flush=True)
        time.sleep(60)
        """,
        dead_name, wait=False,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        # While its creator lives, the segment is locked and kept.
        assert dead_name not in sweep_stale()
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert (SHM_DIR / dead_name).exists(), "kill -9 leaves the segment behind: the sweep must find it"
        removed = sweep_stale()
        assert dead_name in removed and name not in removed
        assert not (SHM_DIR / dead_name).exists()
        assert (SHM_DIR / name).exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
        unlink_segment(dead_name)
        live.unlink()
        live.close()


# ---------------------------------------------------------------- liveness locks (who may still read a slot)


def test_liveness_names_are_built_from_known_values_and_refuse_unsafe_parts(name):
    assert liveness_name(name, "d0", 3) == f"dflash-live.{name}.d0.3"
    for ring, reader, epoch in [(name, "../x", 1), (name, "..", 1), ("a/b", "d0", 1), (name, "", 1), (name, "d0", -1),
                                (name, "d0", "1"), (name, "d0" * 200, 1)]:
        with pytest.raises(ValueError):
            liveness_name(ring, reader, epoch)


def test_a_held_liveness_lock_reads_alive_and_a_released_one_is_gone(name):
    live = liveness_name(name, "d0", 1)
    assert not holder_alive(live)  # never created: the reader never attached
    lock = LivenessLock.acquire(live)
    try:
        path = SHM_DIR / live
        assert path.stat().st_mode & 0o777 == 0o600
        assert holder_alive(live) and holder_alive(live), "the check itself must not take the lock over"
        with pytest.raises(TransportError, match="locked by another process"):
            LivenessLock.acquire(live, timeout_s=0.05)  # one registration, one reader
    finally:
        lock.release()
    assert not path.exists() and not holder_alive(live)
    lock.release()  # idempotent


def test_a_liveness_file_nobody_locks_is_gone_and_swept(name):
    live = liveness_name(name, "d0", 2)
    (SHM_DIR / live).touch(mode=0o600)
    try:
        assert not holder_alive(live)
        assert live in sweep_stale()
        assert not (SHM_DIR / live).exists()
    finally:
        unlink_segment(live)


def test_release_keeps_a_file_that_is_no_longer_its_own(name):
    live = liveness_name(name, "d0", 4)
    lock = LivenessLock.acquire(live)
    unlink_segment(live)  # the owner dropped the registration
    newer = LivenessLock.acquire(live)  # and another holder made a file of that name
    try:
        lock.release()
        assert holder_alive(live), "a reader removed a liveness file that is not its own"
    finally:
        newer.release()


def test_release_tolerates_the_owner_unlinking_the_file_first(name, monkeypatch):
    # The race seen in the shm pipeline test: the reader checks the file is its own, the
    # owner (dropping the pool) unlinks it, then the reader's unlink must not crash its shutdown.
    from common import shm_transport

    live = liveness_name(name, "d0", 5)
    lock = LivenessLock.acquire(live)
    real_same_file = shm_transport._same_file

    def owner_unlinks_in_between(path, fd):
        mine = real_same_file(path, fd)
        unlink_segment(live)
        return mine

    monkeypatch.setattr(shm_transport, "_same_file", owner_unlinks_in_between)
    lock.release()
    assert not (SHM_DIR / live).exists() and not holder_alive(live)


def test_closing_an_attached_ring_releases_its_liveness_lock(name):
    owner = ShmRing.create(name, SLOTS, 1)
    reader = ShmRing.attach(name, SLOTS, 1)
    live = liveness_name(name, "d0", 5)
    try:
        reader.hold_liveness("d0", 5)
        assert holder_alive(live)
        with pytest.raises(TransportError, match="already holds"):
            reader.hold_liveness("d0", 5)
        reader.close()
        assert not holder_alive(live) and not (SHM_DIR / live).exists()
    finally:
        reader.close()
        owner.unlink()
        owner.close()
        unlink_segment(live)

"""The target's batch buffers in shared memory (transport "shm"): no transfer between capture and training.

With the shm transport the scheduler's per-bucket buffers *are* the slots of
one :class:`common.shm_transport.ShmRing` segment per target process. The
capture hooks write a batch straight into a slot, the target publishes the
slot's tag, and every drafter that is sent the batch (one per group: a batch is
captured once for all groups) copies that same slot out (one memcpy, then a
tag check that proves the copy whole). Nothing is sent over a socket.

A slot stays pinned in the scheduler from dispatch until the drafter ACKs the
batch (one pin per drafter it was sent to), so it is never recaptured while it
is read. When a registration is dropped its pins are handed back: at once when
its drafter is gone, else after a grace period (a drafter dropped while alive,
e.g. for a missed heartbeat, may still be inside a step on the slot). "Gone" is
told by the drafter's liveness lock (:class:`common.shm_transport.LivenessLock`,
taken before its first REQUEST), not by its pid: a pid means nothing across
PID namespaces (containers) and is reused.

Slot tags work as a sequence lock: the capture thread zeroes a slot's tag
before writing into it and publishes a fresh, never reused tag after. A reader
that sees the tag of its BATCH before and after reading read a whole batch.
"""

from __future__ import annotations

import logging

import torch

from common.packing import BatchLayout
from common.shm_transport import ShmRing, holder_alive, liveness_name, unlink_segment

logger = logging.getLogger(__name__)


class ShmBatchPool:
    """``slots_per_bucket`` shared batch buffers per bucket; owned by the target (creator of the segment)."""

    def __init__(self, name: str, layouts: list[BatchLayout], slots_per_bucket: int):
        # Reserved now: a /dev/shm too small is a clear error at start-up (TransportError).
        self.ring = ShmRing.create(name, [layout.nbytes for layout in layouts], slots_per_bucket, reserve=True)
        self.name = name
        self.slot_bytes = list(self.ring.slot_bytes)
        self.slots_per_bucket = slots_per_bucket
        self.buffers = [[self.ring.payload(b, i) for i in range(slots_per_bucket)] for b in range(len(layouts))]
        self._slot_of = {buf.data_ptr(): i for per_bucket in self.buffers for i, buf in enumerate(per_bucket)}
        self._next_tag = 1

    @property
    def nbytes(self) -> int:
        return self.ring.nbytes

    def slot_of(self, buffer: torch.Tensor) -> int:
        return self._slot_of[buffer.data_ptr()]

    def begin_write(self, bucket: int, slot: int) -> None:
        """The capture thread is about to overwrite the slot: a reader still on it sees its tag change."""
        self.ring.publish(bucket, slot, 0)

    def publish(self, bucket: int, slot: int) -> int:
        """The slot holds a whole new batch: give it a fresh tag (returned; BATCH.tag for every drafter)."""
        tag = self._next_tag
        self._next_tag += 1
        self.ring.publish(bucket, slot, tag)
        return tag

    def reader_alive(self, drafter_id: str, epoch: int) -> bool:
        """Whether the drafter of this registration may still read slots: it holds its liveness lock.

        False once it died (the kernel dropped the lock) or if it never mapped the pool (it read no slot).
        """
        return holder_alive(liveness_name(self.name, drafter_id, epoch))

    def forget_reader(self, drafter_id: str, epoch: int) -> None:
        """Remove the registration's liveness file (asked :meth:`reader_alive` first). A live drafter keeps
        its lock on the unlinked file; nothing asks about this registration again."""
        try:
            unlink_segment(liveness_name(self.name, drafter_id, epoch))
        except OSError as exc:
            logger.warning("[shm] cannot remove the liveness file of drafter %s epoch %d: %s", drafter_id, epoch, exc)

    def close(self) -> None:
        """Remove the segment's name and drop the target's mapping (drafters' mappings stay valid)."""
        self.ring.unlink()
        self.buffers = []
        self.ring.close()


class PoolEndpoint:
    """A registration's :class:`target_server.data_plane.Endpoint` for shm: nothing to move, so no thread.

    A BATCH names the pool slot and its tag; the slot stays pinned until the ACK.
    ``paired`` turns true at the drafter's first REQUEST, which it sends only
    after it has mapped the pool.
    """

    pins_until_ack = True

    def __init__(self, name: str, welcome: dict):
        self.name = name
        self._welcome = welcome
        self.paired = False

    def welcome_fields(self) -> dict:
        return dict(self._welcome)

    def start(self) -> None:
        pass

    def requested(self) -> None:
        self.paired = True

    def hand_over(self, ready) -> tuple[int, int]:
        return ready.shm_tag, ready.shm_slot

    def stop(self) -> None:
        pass

    def is_alive(self) -> bool:
        return False

    def join(self, timeout: float | None = None) -> None:
        pass

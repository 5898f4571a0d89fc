"""The target's side of one registration's data plane over shared memory (transport "shm").

Same interface as :class:`target_server.link.DrafterLink` (start, enqueue,
stop, paired, prefix; :class:`LinkEvent` "sent"/"failed"), but instead of a
pair group there is a :class:`common.shm_transport.ShmRing`. The constructor
(control thread) creates it, which takes microseconds, so it exists before
WELCOME names it and a drafter that finds it missing knows its registration
is gone. The thread reserves its pages (slow for big rings, and where a full
/dev/shm is reported), then copies each queued batch into the slot the control
thread chose and publishes it. "sent" means the slot is filled, so the scheduler's buffer
can be reused; the slot itself stays the drafter's until it ACKs the batch
(:class:`SlotTable`, owned by the control thread).

The ring's name disappears when the registration ends (:meth:`stop`), and the
thread's own mapping when it exits; the drafter's mapping goes with it.
"""

from __future__ import annotations

import logging
import queue
import time

from common.shm_transport import ShmRing, unlink_segment
from common.streams import SideStream
from common.transport import TransportError
from target_server.link import LinkEvent, LinkThread
from target_server.scheduler import ReadyBatch

logger = logging.getLogger(__name__)


class SlotTable:
    """Which ring slots hold batches the drafter has not acknowledged (control thread only)."""

    def __init__(self, num_buckets: int, slots_per_bucket: int) -> None:
        self._free = [list(range(slots_per_bucket - 1, -1, -1)) for _ in range(num_buckets)]
        self._held: dict[int, tuple[int, int]] = {}  # batch id -> (bucket, slot)

    def has_free(self, bucket: int) -> bool:
        return bool(self._free[bucket])

    def assign(self, batch_id: int, bucket: int) -> int:
        slot = self._free[bucket].pop()
        self._held[batch_id] = (bucket, slot)
        return slot

    def release(self, batch_id: int) -> None:
        """The drafter acknowledged ``batch_id``: its slot may be written again. Unknown ids are ignored."""
        held = self._held.pop(batch_id, None)
        if held is not None:
            self._free[held[0]].append(held[1])

    @property
    def held(self) -> int:
        return len(self._held)


class ShmDrafterLink(LinkThread):
    def __init__(
        self,
        *,
        name: str,
        ring_name: str,
        slot_bytes: list[int],
        slots_per_bucket: int,
        events: "queue.Queue[LinkEvent]",
    ):
        super().__init__(name=name, prefix=ring_name, events=events)
        self._slot_bytes = list(slot_bytes)
        self._slots_per_bucket = slots_per_bucket
        # Raises TransportError (the caller refuses the registration).
        self._ring: ShmRing | None = ShmRing.create(ring_name, self._slot_bytes, slots_per_bucket, reserve=False)

    @property
    def paired(self) -> bool:
        """True once the drafter has mapped the ring (read by the control thread for STATUS)."""
        ring = self._ring
        return ring is not None and ring.attached_pid != 0

    def enqueue(self, ready: ReadyBatch, tag: int, slot: int = -1) -> None:
        if slot < 0:
            raise ValueError("the shm link needs the ring slot chosen at dispatch")
        self._outbox.put((ready, tag, slot))

    def run(self) -> None:
        ring = self._ring
        stream: SideStream | None = None  # a CUDA target's copies out of its buffers
        try:
            ring.reserve()
            while (item := self._next_item()) is not None:
                ready, tag, slot = item
                nbytes = ready.layout.nbytes
                start = time.perf_counter()
                try:
                    if stream is None:
                        stream = SideStream(ready.buffer.device)
                    stream.wait(ready.ready_event)
                    with stream.active():  # device-to-host copies return once the bytes are in the slot
                        ring.payload(ready.bucket, slot)[:nbytes].copy_(ready.buffer[:nbytes])
                    ring.publish(ready.bucket, slot, tag)
                except (TransportError, RuntimeError, IndexError) as exc:
                    self._events.put(LinkEvent(self, "failed", ready, f"copy into slot {ready.bucket}/{slot} failed"))
                    raise TransportError(f"shm ring {self.prefix}: {exc}") from None
                self._events.put(LinkEvent(self, "sent", ready, nbytes=nbytes, seconds=time.perf_counter() - start))
        except (TransportError, OSError) as exc:
            if not self._stopped.is_set():
                self._events.put(LinkEvent(self, "failed", error=str(exc)))
        finally:
            self._drain_unsent()
            unlink_segment(self.prefix)
            self._ring = None
            ring.close()

    def stop(self) -> None:
        """End the registration's data plane now: the ring's name goes at once, the thread exits promptly."""
        self._signal_stop()
        unlink_segment(self.prefix)

"""The drafter's side of the data plane: one interface, two transports, chosen once per registration.

:func:`attach` reads the WELCOME, joins the target's data plane and takes the
frozen embedding and LM head; the returned :class:`Attachment` then fills
posted buffers with batches (``receive``) until it is aborted and closed:

- :class:`PairAttachment` (gloo/NCCL): a two-rank process group with the
  target's link thread; each batch is one tagged receive.
- :class:`PoolAttachment` (shared memory): the target's batch pool mapped into
  this process; a batch is copied out of the slot the BATCH names once the slot
  carries the batch's tag, and the tag is checked again after the copy
  (sequence lock: a slot the target rewrote under the copy means it had
  dropped this registration).

:class:`Receiver` is the thread that waits on the attachment's receives in
order. The worker sees only :class:`Attachment` and :class:`Receiver`; no other
drafter module branches on the transport.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Protocol

import torch

from common import protocol as P
from common.devices import head_dtype
from common.packing import WeightsLayout, dtype_from_name
from common.devices import use_device
from common.streams import SideStream
from common.shm_transport import ShmRing
from common.transport import (
    DRAFTER_RANK, PairGroup, TransportError, connect_store, gpu_uuid, local_address_towards, same_gpu_refusal,
)
from drafter_worker.connection import FatalError

logger = logging.getLogger(__name__)

__all__ = ["Attachment", "PairAttachment", "PoolAttachment", "Receiver", "attach", "check_slot_kept"]


class Attachment(Protocol):
    """One registration's data plane (drafter side)."""

    def receive(self, meta: P.Batch, buf: torch.Tensor) -> torch.Tensor: ...  # buf filled (TransportError on failure)
    def abort(self) -> None: ...  # unblocks a receive in progress; any thread, idempotent
    def close(self) -> None: ...  # after the receiving thread ended


class PairAttachment:
    """gloo/NCCL: batches arrive as tagged receives over the registration's pair group."""

    def __init__(self, pair: PairGroup):
        self.pair = pair

    def receive(self, meta: P.Batch, buf: torch.Tensor) -> torch.Tensor:
        self.pair.recv(buf[: meta.nbytes], meta.tag)
        return buf

    def abort(self) -> None:
        self.pair.abort()

    def close(self) -> None:
        self.pair.abort()  # releases the process group on the caller's thread (no-op once aborted)


class PoolAttachment:
    """Shared memory: a batch is copied out of the target's pool slot, guarded by the slot's tag."""

    def __init__(self, ring: ShmRing, timeout_s: float):
        self.ring = ring
        self.timeout_s = timeout_s
        self._aborted = threading.Event()

    def receive(self, meta: P.Batch, buf: torch.Tensor) -> torch.Tensor:
        ring = self.ring
        if not (0 <= meta.bucket < len(ring.slot_bytes) and 0 <= meta.slot < ring.slots_per_bucket):
            raise TransportError(f"BATCH {meta.batch_id} names slot {meta.bucket}/{meta.slot}, which ring {ring.name} lacks")
        ring.wait_ready(meta.bucket, meta.slot, meta.tag, self.timeout_s, stop=self._aborted)
        buf[: meta.nbytes].copy_(ring.payload(meta.bucket, meta.slot)[: meta.nbytes])
        check_slot_kept(ring, meta)
        return buf

    def abort(self) -> None:
        self._aborted.set()

    def close(self) -> None:
        self.ring.close()  # the target unlinks the pool; this only drops our mapping


def check_slot_kept(ring: ShmRing, meta: P.Batch) -> None:
    """Raise when the batch's pool slot was rewritten while it was read (sequence-lock check).

    The target recaptures a slot only after every drafter it went to has ACKed it,
    or after dropping such a drafter's registration; so this fires only for a
    drafter the target had already given up on, whose read may be torn.
    """
    if ring.tag(meta.bucket, meta.slot) != meta.tag:
        raise TransportError(
            f"slot {meta.bucket}/{meta.slot} of the target's pool was rewritten while batch {meta.batch_id} was read "
            "from it: the target had dropped this registration"
        )


def gpu_for_hello(transport: str, device: torch.device) -> str:
    """HELLO.gpu_uuid: this drafter's GPU when the pair is NCCL (two ranks of one pair cannot share a GPU)."""
    return gpu_uuid(device) if transport == "nccl" else ""


def attach(transport: str, welcome: P.Welcome, *, drafter_id: str, device: torch.device, timeout_s: float,
           stop: threading.Event, weights: bool = True) -> tuple[Attachment, torch.Tensor | None, torch.Tensor | None]:
    """Join the target's data plane: (attachment, embedding, LM head), the weights in the device's head dtype
    (None when ``weights`` is False: the HELLO said they were not needed, so the target does not send them).

    Raises FatalError when the WELCOME cannot work with this drafter, TransportError when the
    data plane fails to form (the caller registers again)."""
    layout = WeightsLayout(welcome.vocab_size, welcome.hidden_size, welcome.embed_tied, dtype_from_name(welcome.dtype))
    dtype = head_dtype(device, layout.dtype)  # the wire dtype on a GPU (no fp32 copy), fp32 on the CPU
    if transport == "shm":
        return _attach_pool(welcome, layout if weights else None, dtype, drafter_id=drafter_id, device=device,
                            timeout_s=timeout_s, stop=stop)
    return _attach_pair(transport, welcome, layout if weights else None, dtype, drafter_id=drafter_id, device=device,
                        timeout_s=timeout_s)


def _attach_pair(transport: str, welcome: P.Welcome, layout: WeightsLayout | None, dtype: torch.dtype, *,
                 drafter_id: str, device: torch.device, timeout_s: float):
    # A target that predates HELLO.gpu_uuid does not check: refuse here too.
    if refusal := same_gpu_refusal(transport, welcome.gpu_uuid, gpu_uuid(device), drafter_id):
        raise FatalError(refusal)
    store = connect_store(welcome.store_host, welcome.store_port, timeout_s)
    pair = PairGroup(kind=transport, store=store, prefix=welcome.pair_prefix, rank=DRAFTER_RANK, device=device,
                     timeout_s=timeout_s, local_host=local_address_towards(welcome.store_host))
    try:
        if layout is None:
            return PairAttachment(pair), None, None
        buf = layout.allocate(device)
        pair.recv(buf, tag=0)
        embed, head = layout.views(buf)
        return PairAttachment(pair), embed.to(dtype), head.to(dtype)
    except BaseException:
        pair.abort()
        raise


def _attach_pool(welcome: P.Welcome, layout: WeightsLayout | None, dtype: torch.dtype, *, drafter_id: str,
                 device: torch.device, timeout_s: float, stop: threading.Event):
    """Map the target's batch pool and copy the frozen weights from its weights segment."""
    if not welcome.shm_name or not welcome.shm_weights_name or welcome.shm_slots_per_bucket < 1:
        raise FatalError("the target uses transport shm but its WELCOME names no shared-memory ring")
    embed = head = None
    if layout is not None:
        embed, head = _copy_pool_weights(welcome, layout, dtype, device, timeout_s, stop)
    ring = ShmRing.attach(welcome.shm_name, welcome.shm_slot_bytes, welcome.shm_slots_per_bucket)
    try:
        # Before our first REQUEST, so before we read any slot: the target frees the slots
        # we hold at once when it can take this lock (we died), else after a grace period.
        ring.hold_liveness(drafter_id, welcome.registration_epoch)
    except BaseException:
        ring.close()
        raise
    logger.info("[shm] mapped the target's batch pool /dev/shm/%s (%d buckets x %d slots, %.1f MiB)",
                ring.name, len(ring.slot_bytes), ring.slots_per_bucket, ring.nbytes / 2**20)
    return PoolAttachment(ring, timeout_s), embed, head


def _copy_pool_weights(welcome: P.Welcome, layout: WeightsLayout, dtype: torch.dtype, device: torch.device,
                       timeout_s: float, stop: threading.Event) -> tuple[torch.Tensor, torch.Tensor]:
    # Both segments exist before WELCOME is sent: one missing now means the target
    # has ended this registration (or does not share our /dev/shm), so no waiting.
    weights = ShmRing.attach(welcome.shm_weights_name, [layout.nbytes], 1)
    try:
        weights.wait_ready(0, 0, 1, timeout_s, stop=stop)
        embed, head = layout.views(weights.payload(0, 0))
        # Own copies: the segment is the target's, shared with every drafter.
        embed = embed.to(device, dtype, copy=True)
        head = embed if welcome.embed_tied else head.to(device, dtype, copy=True)
        return embed, head
    finally:
        weights.close()


class Receiver(threading.Thread):
    """Waits on posted receives in order and hands completed batches to the control thread.

    The attachment fills the posted buffer (a pair receive, or a tag-checked copy
    out of a pool slot: a batch rewritten while it was copied is never trained on).

    On a GPU the receives run on a stream of this thread's own: each waits only
    on its buffer's ``free_event`` (recorded after the last training step that
    read the buffer), so receiving batch n+1 overlaps training on batch n, and
    the batch is handed over with an event the training stream waits on.
    """

    def __init__(self, attachment: Attachment | None, device: torch.device = torch.device("cpu")):
        super().__init__(name="receiver", daemon=True)
        self.attachment = attachment
        self.device = device
        # (BATCH, buffer to fill, event after which the buffer may be written)
        self.inbox: queue.Queue[tuple[P.Batch, torch.Tensor, object] | None] = queue.Queue()
        # (BATCH, filled buffer, event after which it may be read)
        self.ready: queue.Queue[tuple[P.Batch, torch.Tensor, object] | TransportError] = queue.Queue()

    def run(self) -> None:
        # Every failure ends on ``ready`` as a TransportError (the drop/re-register path):
        # a receive thread that died silently would leave the training loop waiting forever.
        try:
            use_device(self.device)  # a new thread starts on GPU 0
            stream = SideStream(self.device)
            stream.wait_default()  # buffers allocated (zeroed) on the default stream
            while True:
                item = self.inbox.get()
                if item is None:
                    return
                meta, buf, free_event = item
                stream.wait(free_event)
                with stream.active():
                    buf = self.attachment.receive(meta, buf)
                self.ready.put((meta, buf, stream.record()))
        except TransportError as exc:
            self.ready.put(exc)
        except Exception as exc:
            logger.warning("[receive] unexpected failure of the receive thread", exc_info=True)
            self.ready.put(TransportError(f"receive thread failed: {type(exc).__name__}: {exc}"))

    def stop(self) -> None:
        """Ends the thread: a receive in progress is aborted, the rest of the inbox dropped."""
        if self.attachment is not None:
            self.attachment.abort()
        self.inbox.put(None)

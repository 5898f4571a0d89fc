"""The target's side of the data plane: one interface, two transports, chosen once at start-up.

- :class:`PairPlane` (gloo/NCCL): each registration gets a :class:`DrafterLink`
  thread that forms a two-rank process group with its drafter, sends the frozen
  weights once and then each batch buffer it is handed; the buffer is free
  again once sent.
- :class:`ShmPlane` (shared memory, CPU): the scheduler's batch buffers *are*
  the slots of a shared pool; a registration's endpoint only names the slot and
  its tag in the BATCH, and the slot stays pinned until the drafter ACKs it.

The coordinator, the capture loop and the server see only :class:`DataPlane`
and :class:`Endpoint`; no other module branches on the transport.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
from typing import Protocol

import torch

from common.packing import BatchLayout
from common.shm_transport import ShmRing, segment_name, sweep_stale
from common.transport import TransportError, local_address_towards
from target_server.link import DrafterLink, LinkEvent
from target_server.scheduler import ReadyBatch
from target_server.shm_pool import PoolEndpoint, ShmBatchPool

logger = logging.getLogger(__name__)

__all__ = ["DataPlane", "Endpoint", "LinkEvent", "PairPlane", "ShmPlane", "make_data_plane"]


class Endpoint(Protocol):
    """One registration's data plane (target side)."""

    paired: bool  # the drafter is attached and may be sent batches
    pins_until_ack: bool  # a handed-over buffer stays pinned until the drafter ACKs its batch

    def welcome_fields(self) -> dict: ...  # WELCOME fields that tell the drafter how to attach
    def start(self) -> None: ...
    def requested(self) -> None: ...  # the drafter sent REQUEST (it has attached)
    def hand_over(self, ready: ReadyBatch) -> tuple[int, int]: ...  # -> (BATCH.tag, BATCH.slot)
    def stop(self) -> None: ...  # returns at once
    def is_alive(self) -> bool: ...
    def join(self, timeout: float | None = None) -> None: ...


class DataPlane(Protocol):
    name: str
    events: "queue.Queue[LinkEvent]"  # sent/failed results of endpoint threads, drained by the control loop

    def batch_buffers(self) -> list[list[torch.Tensor]] | None: ...  # the scheduler's buffers, None = allocate
    def endpoint(self, reader: str, epoch: int, send_weights: bool = True) -> Endpoint: ...  # reader: "<id>.<rank>"
    def begin_write(self, bucket: int, buffer: torch.Tensor) -> None: ...  # the capture overwrites buffer
    def publish(self, bucket: int, buffer: torch.Tensor) -> tuple[int, int]: ...  # -> (slot, tag) of a whole batch
    def release_grace_s(self, drafter_id: str, epoch: int, heartbeat_timeout_s: float) -> float: ...
    def forget_reader(self, drafter_id: str, epoch: int) -> None: ...
    def close(self) -> None: ...


class PairPlane:
    """gloo/NCCL: a pair group per registration, batches sent by its link thread."""

    def __init__(self, *, transport: str, store_host: str, store_port: int, device: torch.device,
                 timeout_s: float, weights: torch.Tensor) -> None:
        self.name = transport
        self.events: queue.Queue[LinkEvent] = queue.Queue()
        self._transport = transport
        self._store = (store_host, store_port)
        self._device = device
        self._timeout_s = timeout_s
        self._weights = weights
        self._local_host = local_address_towards(store_host)

    def batch_buffers(self) -> None:
        return None

    def endpoint(self, reader: str, epoch: int, send_weights: bool = True) -> DrafterLink:
        # Unguessable: only the drafter told in WELCOME can join (or spoof) this pair.
        prefix = f"pair/{secrets.token_hex(16)}/{epoch}"
        return DrafterLink(
            name=f"{reader}-{epoch}", transport=self._transport, store_address=self._store, prefix=prefix,
            device=self._device, timeout_s=self._timeout_s, weights=self._weights if send_weights else None,
            events=self.events,
            local_host=self._local_host,
        )

    def begin_write(self, bucket: int, buffer: torch.Tensor) -> None:
        pass

    def publish(self, bucket: int, buffer: torch.Tensor) -> tuple[int, int]:
        return -1, 0

    def release_grace_s(self, drafter_id: str, epoch: int, heartbeat_timeout_s: float) -> float:
        return 0.0  # nothing stays pinned: a link releases each buffer once sent (or failed)

    def forget_reader(self, drafter_id: str, epoch: int) -> None:
        pass

    def close(self) -> None:
        pass


class ShmPlane:
    """Shared memory: the batch pool and one segment of frozen weights, for every registration."""

    def __init__(self, *, layouts: list[BatchLayout], slots_per_bucket: int, weights: torch.Tensor) -> None:
        self.name = "shm"
        self.events: queue.Queue[LinkEvent] = queue.Queue()  # no threads: stays empty
        sweep_stale()  # segments of targets that died without cleaning up
        self.pool = ShmBatchPool(segment_name(os.getpid(), "pool"), layouts, slots_per_bucket)
        logger.info("[startup] shm transport: batch pool /dev/shm/%s (%d buckets x %d slots, %.1f MiB)",
                    self.pool.name, len(layouts), slots_per_bucket, self.pool.nbytes / 2**20)
        try:
            self.weights = ShmRing.create(segment_name(os.getpid(), "weights"), [weights.numel()], 1)
        except TransportError:
            self.pool.close()
            raise
        self.weights.payload(0, 0).copy_(weights)
        self.weights.publish(0, 0, tag=1)
        logger.info("[startup] shm transport: weights in /dev/shm/%s (%.1f MiB)",
                    self.weights.name, self.weights.nbytes / 2**20)

    def batch_buffers(self) -> list[list[torch.Tensor]]:
        return self.pool.buffers

    def endpoint(self, reader: str, epoch: int, send_weights: bool = True) -> PoolEndpoint:
        pool = self.pool  # the weights segment is there for whoever reads it
        return PoolEndpoint(f"{reader}-{epoch}", {
            "pair_prefix": pool.name, "shm_name": pool.name, "shm_slot_bytes": pool.slot_bytes,
            "shm_slots_per_bucket": pool.slots_per_bucket, "shm_weights_name": self.weights.name,
        })

    def begin_write(self, bucket: int, buffer: torch.Tensor) -> None:
        self.pool.begin_write(bucket, self.pool.slot_of(buffer))

    def publish(self, bucket: int, buffer: torch.Tensor) -> tuple[int, int]:
        slot = self.pool.slot_of(buffer)
        return slot, self.pool.publish(bucket, slot)

    def release_grace_s(self, drafter_id: str, epoch: int, heartbeat_timeout_s: float) -> float:
        # A live drafter may still be inside a step on its slots: keep them a heartbeat timeout
        # longer unless it is gone (its liveness lock is free: the kernel dropped it).
        return heartbeat_timeout_s if self.pool.reader_alive(drafter_id, epoch) else 0.0

    def forget_reader(self, drafter_id: str, epoch: int) -> None:
        self.pool.forget_reader(drafter_id, epoch)

    def close(self) -> None:
        self.pool.close()  # a capture still running keeps its own views of the mapping
        self.weights.unlink()
        self.weights.close()


def make_data_plane(*, transport: str, device: torch.device, layouts: list[BatchLayout], ready_batches: int,
                    shm_slots_per_bucket: int, store_host: str, store_port: int, timeout_s: float,
                    weights: torch.Tensor) -> DataPlane:
    """The transport's data plane (raises TransportError with what to do when it cannot be set up)."""
    if transport == "shm":
        if device.type != "cpu":
            raise TransportError(
                f"transport shm needs the target on the CPU (its batch buffers are host shared memory), "
                f"target.device is {device}; use transport.kind = \"nccl\""
            )
        return ShmPlane(layouts=layouts, slots_per_bucket=ready_batches + shm_slots_per_bucket, weights=weights)
    return PairPlane(transport=transport, store_host=store_host, store_port=store_port, device=device,
                     timeout_s=timeout_s, weights=weights)

"""The target's side of one drafter registration's data plane, on its own thread.

The thread forms the pair group (bounded wait for the drafter to join), sends
the frozen embedding/LM head once, then sends queued batch buffers in order.
Results go back to the control thread through a queue, so the control loop
never blocks on the data plane and a dead drafter only ends its own thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from common.devices import use_device
from common.streams import SideStream
from common.transport import TARGET_RANK, PairGroup, TransportError, connect_store, gpu_uuid
from target_server.scheduler import ReadyBatch

logger = logging.getLogger(__name__)


@dataclass
class LinkEvent:
    link: "DrafterLink"
    kind: str  # "sent" | "failed"
    ready: ReadyBatch | None = None
    error: str = ""
    nbytes: int = 0
    seconds: float = 0.0
    # CUDA: recorded on the send stream after the send; a capture into the same buffer waits on it.
    done_event: object = None


class LinkThread(threading.Thread):
    """A link thread's plumbing: an ordered outbox of batches, result events, a stop flag."""

    def __init__(self, *, name: str, prefix: str, events: "queue.Queue[LinkEvent]"):
        super().__init__(name=f"link-{name}", daemon=True)
        self.prefix = prefix
        self._events = events
        self._outbox: queue.Queue[tuple | None] = queue.Queue()
        self._stopped = threading.Event()

    def _next_item(self) -> tuple | None:
        """The next queued batch, or None once the link is stopping."""
        while not self._stopped.is_set():
            try:
                item = self._outbox.get(timeout=0.2)
            except queue.Empty:
                continue
            return item
        return None

    def _drain_unsent(self) -> None:
        """Hand back buffers queued but never sent, so their pins are released."""
        while True:
            try:
                item = self._outbox.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                self._events.put(LinkEvent(self, "failed", item[0], "link closed before send"))

    def _signal_stop(self) -> None:
        self._stopped.set()
        self._outbox.put(None)


class DrafterLink(LinkThread):
    """A registration's :class:`target_server.data_plane.Endpoint` for gloo/NCCL."""

    pins_until_ack = False  # a buffer is free again once sent (LinkEvent "sent")

    def __init__(
        self,
        *,
        name: str,
        transport: str,
        store_address: tuple[str, int],
        prefix: str,
        device: torch.device,
        timeout_s: float,
        weights: torch.Tensor | None,  # None: the drafter has the frozen weights already (HELLO.need_weights)
        events: "queue.Queue[LinkEvent]",
        local_host: str,
    ):
        super().__init__(name=name, prefix=prefix, events=events)
        self._transport = transport
        self._store_address = store_address
        self._device = device
        self._timeout_s = timeout_s
        self._weights = weights
        self._local_host = local_host
        self._pair: PairGroup | None = None
        self._abort_thread: threading.Thread | None = None
        self._next_tag = 1  # tag 0 carries the weights

    @property
    def paired(self) -> bool:
        """True once the data-plane pair group has formed (read by the control thread for STATUS)."""
        return self._pair is not None

    def welcome_fields(self) -> dict:
        # Our GPU for NCCL: a drafter on the same one refuses (NCCL cannot pair two ranks on it).
        return {"pair_prefix": self.prefix, "gpu_uuid": gpu_uuid(self._device) if self._transport == "nccl" else ""}

    def requested(self) -> None:
        pass  # paired is told by the pair group itself

    def hand_over(self, ready: ReadyBatch) -> tuple[int, int]:
        """Queue the batch for sending; its BATCH names the send's tag (no slot)."""
        tag = self._next_tag
        self._next_tag = tag + 1 if tag < (1 << 30) else 1
        self.enqueue(ready, tag)
        return tag, -1

    def enqueue(self, ready: ReadyBatch, tag: int) -> None:
        self._outbox.put((ready, tag))

    def run(self) -> None:
        use_device(self._device)  # a new thread starts on GPU 0 (NCCL, streams and events use the current device)
        try:
            # A client connection of its own: a store client serializes its requests,
            # so a pair that never forms would otherwise block every other pair's rendezvous.
            host, port = self._store_address
            store = connect_store(host, port, self._timeout_s)
            # Returns once the drafter has joined (a one-element handshake), bounded.
            self._pair = PairGroup(
                kind=self._transport,
                store=store,
                prefix=self.prefix,
                rank=TARGET_RANK,
                device=self._device,
                timeout_s=self._timeout_s,
                local_host=self._local_host,
            )
            if self._stopped.is_set():
                return
            # Sends go on a stream of this thread's own (NCCL orders a send after the
            # current stream), ordered after each batch's capture by its event only.
            stream = SideStream(self._device)
            stream.wait_default()  # the weights were written on the default stream
            with stream.active():
                if self._weights is not None:
                    self._pair.send(self._weights, tag=0)
            while (item := self._next_item()) is not None:
                ready, tag = item
                start = time.perf_counter()
                try:
                    stream.wait(ready.ready_event)
                    with stream.active():
                        # Returns once the transfer is complete, so "sent" frees the buffer.
                        self._pair.send(ready.buffer[: ready.layout.nbytes], tag)
                except Exception as exc:
                    # Whatever failed, the batch goes back (released by the control thread).
                    self._events.put(LinkEvent(self, "failed", ready, f"send failed: {exc}"))
                    raise
                # Device-side end of the send: whether or not NCCL's wait blocked this thread,
                # a capture into this buffer orders itself after this event.
                self._events.put(LinkEvent(self, "sent", ready, nbytes=ready.layout.nbytes,
                                           seconds=time.perf_counter() - start, done_event=stream.record()))
        except Exception as exc:
            # Every failure, not only TransportError, drops this registration the same way:
            # a thread that died without a "failed" event would leave its drafter registered.
            if not self._stopped.is_set():
                if not isinstance(exc, TransportError):
                    logger.warning("[link] %s: unexpected data-plane failure", self.prefix, exc_info=True)
                self._events.put(LinkEvent(self, "failed", error=str(exc) or type(exc).__name__))
        finally:
            self._drain_unsent()
            if self._pair is not None:
                # Stopped or failed, the pair is done (also one that formed while stop() ran,
                # which stop() could not see). Here, a slow abort holds up only this link.
                self._pair.abort()
            if self._abort_thread is not None:
                self._abort_thread.join(self._timeout_s)

    def stop(self) -> None:
        """Abort the pair without waiting for the peer; returns at once.

        The abort runs on a helper thread (ncclCommAbort can block behind another pair's
        kernels, and this is called on the control thread, which sends every heartbeat).
        The link thread joins that helper (bounded) before it ends.
        """
        self._signal_stop()
        pair = self._pair
        if pair is not None and self._abort_thread is None:
            self._abort_thread = pair.abort_in_background()

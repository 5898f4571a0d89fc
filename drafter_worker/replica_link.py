"""One target replica as a drafter rank sees it: its socket, handshake, registration and data plane.

A rank holds one :class:`ReplicaLink` per target replica. Each goes through
``waiting`` (backoff before the next HELLO) -> ``hello`` (HELLO sent, waiting
for WELCOME without blocking the other replicas) -> ``live`` (registered,
attached to the replica's data plane, its :class:`Receiver` filling posted
buffers) and back to ``waiting`` when anything about that replica fails: a dead
replica stalls only its share of the batches. The decisions of a live
registration (credits, heartbeats, liveness, DONE) are its
:class:`~drafter_worker.connection.Connection`'s.
"""

from __future__ import annotations

import logging
import queue
import uuid

import zmq

from common import protocol as P
from common.sockets import SocketFactory
from common.transport import TransportError
from drafter_worker.connection import Connection
from drafter_worker.data_plane import Attachment, Receiver

logger = logging.getLogger(__name__)

WAITING, HELLO, LIVE = "waiting", "hello", "live"


class ReplicaLink:
    def __init__(self, replica: int, address: str, *, name: str, sockets: SocketFactory, handshake_timeout_s: float,
                 backoff_max_s: float):
        self.replica = replica
        self.address = address
        self.name = name  # for the socket identity and logs: "<drafter>.<rank>"
        self._sockets = sockets
        self._handshake_timeout_s = handshake_timeout_s
        self._backoff_max_s = backoff_max_s
        self.state = WAITING
        self.sock: zmq.Socket | None = None
        self.conn: Connection | None = None
        self.attachment: Attachment | None = None
        self.receiver: Receiver | None = None
        self.welcome: P.Welcome | None = None
        self.asked_weights = False
        self.session = 0  # grows with every registration: an ACK goes only to the session that sent the batch
        self._retry_at = 0.0
        self._hello_at = -1e9
        self._deadline = 0.0
        self._backoff = 0.5

    def __repr__(self) -> str:
        return f"replica {self.replica} ({self.address})"

    # ---------------------------------------------------------------- lifecycle
    def hello_due(self, now: float) -> bool:
        return self.state == WAITING and now >= self._retry_at

    def send_hello(self, hello: P.Hello, now: float) -> None:
        self.sock = self._sockets.connect(zmq.DEALER, self.address, LINGER=500,
                                          IDENTITY=f"{self.name}-r{self.replica}-{uuid.uuid4().hex[:8]}".encode())
        self.sock.send(hello.encode())
        self.asked_weights = hello.need_weights  # then the replica sends them, and they must be received
        self.state = HELLO
        self._hello_at = now
        self._deadline = now + self._handshake_timeout_s

    def handshake_expired(self, now: float) -> bool:
        return self.state == HELLO and now > self._deadline

    def go_live(self, welcome: P.Welcome, attachment: Attachment, receiver: Receiver, conn: Connection) -> None:
        self.welcome, self.attachment, self.receiver, self.conn = welcome, attachment, receiver, conn
        self.state = LIVE
        self.session += 1
        self._backoff = 0.5
        receiver.start()
        self.send(conn.start())

    def fail(self, why: str, now: float, join_timeout_s: float) -> list[str]:
        """Tear the registration down and retry after a backoff; returns threads that did not end."""
        logger.warning("[target] %s: %s; retrying in %.1fs", self, why, self._backoff)
        left = self._teardown(join_timeout_s, linger=0)
        self._retry_at = now + self._backoff
        self._backoff = min(self._backoff * 2, self._backoff_max_s)
        return left

    def hello_age(self, now: float) -> float:
        return now - self._hello_at

    def register_again(self, now: float) -> None:
        """Drop a registration whose WELCOME waited while the model was built, and HELLO afresh
        (no backoff): the replica times out a data plane that does not form soon after WELCOME."""
        self._teardown(0.0, linger=0)
        self._retry_at = self._hello_at + 1.05  # the target refuses a rank re-registering within a second

    def close(self, reason: str, join_timeout_s: float) -> list[str]:
        """BYE (when registered) and teardown for good."""
        said_bye = False
        if self.state == LIVE and self.sock is not None:
            try:
                self.sock.send(P.Bye(reason=reason).encode(), flags=zmq.NOBLOCK)
                said_bye = True
            except zmq.ZMQError:
                pass
        return self._teardown(join_timeout_s, linger=200 if said_bye else 0)

    def _teardown(self, join_timeout_s: float, linger: int) -> list[str]:
        left: list[str] = []
        try:
            if self.receiver is not None:
                self.receiver.stop()
                # Joined so the process group is released on this thread: a daemon thread
                # freeing it during interpreter shutdown aborts the process.
                self.receiver.join(timeout=join_timeout_s)
                if self.receiver.is_alive():
                    left.append(self.receiver.name)
            if self.attachment is not None:
                self.attachment.close()
        finally:
            # Whatever the data plane's cleanup raised: a socket left open would keep the
            # ZeroMQ context, and with it the process, from ever terminating.
            if self.sock is not None:
                self.sock.close(linger=linger)
            self.sock = self.conn = self.attachment = self.receiver = self.welcome = None
            self.state = WAITING
        return left

    # ---------------------------------------------------------------- traffic
    def send(self, messages: list[P.Message]) -> None:
        for msg in messages:
            self.sock.send(msg.encode())

    def ready(self):
        """The next received batch ``(BATCH, buffer, event)``, a TransportError, or None."""
        if self.state != LIVE:
            return None
        try:
            return self.receiver.ready.get_nowait()
        except queue.Empty:
            return None

    @property
    def exhausted(self) -> bool:
        """The replica said DONE and nothing it sent is left untrained."""
        return self.state == LIVE and self.conn.done and self.conn.inflight == 0

    def check_batch(self, msg: P.Batch) -> None:
        """A BATCH this replica may send: one of its own plan indices."""
        replicas = self.welcome.replicas
        if msg.batch_id % replicas != self.replica:
            raise TransportError(f"{self} sent batch {msg.batch_id}, which replica {msg.batch_id % replicas} owns")

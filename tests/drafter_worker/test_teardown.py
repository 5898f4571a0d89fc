"""A drafter whose shutdown fails half-way still lets its process end.

Session 10 saw a drafter crash in its data plane's cleanup and then ignore SIGTERM:
the link's socket stayed open, so the ZeroMQ context's ``term()`` waited on it forever.
"""

from __future__ import annotations

import threading

import pytest
import zmq

from common.config import load_config
from common.sockets import SocketFactory
from drafter_worker.replica_link import WAITING, ReplicaLink
from tests.ports import free_ports


class _FailingAttachment:
    """A data plane whose cleanup fails (the shm liveness race of session 10 was one such failure)."""

    def abort(self) -> None:
        pass

    def close(self) -> None:
        raise OSError("liveness file vanished")


def _pending_socket(sockets: SocketFactory) -> zmq.Socket:
    """A DEALER with a message queued for a peer that is not there and an infinite linger."""
    (port,) = free_ports(1)
    sock = sockets.connect(zmq.DEALER, f"tcp://127.0.0.1:{port}", LINGER=-1)
    sock.send(b"hello")
    return sock


def _ends(work, within_s: float = 20.0) -> bool:
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(within_s)
    return not thread.is_alive()


def test_a_failing_data_plane_cleanup_still_closes_the_link_socket():
    ctx = zmq.Context()
    sockets = SocketFactory(ctx)
    link = ReplicaLink(0, "tcp://127.0.0.1:1", name="d0.0", sockets=sockets, handshake_timeout_s=5.0,
                       backoff_max_s=1.0)
    sock = link.sock = _pending_socket(sockets)
    link.attachment = _FailingAttachment()
    with pytest.raises(OSError, match="liveness"):
        link.close("crashed", join_timeout_s=1.0)
    assert sock.closed and link.sock is None and link.attachment is None and link.state == WAITING
    assert _ends(ctx.term), "the context did not terminate: a socket was left open"


def test_worker_close_ends_with_a_socket_a_crash_left_open(tmp_path):
    from drafter_worker.worker import DrafterWorker

    worker = DrafterWorker(load_config(None, [f'run.root_dir="{tmp_path}"', 'run.name="w"', 'drafter.id="d0"']))
    left_open = _pending_socket(worker._sockets)
    assert _ends(worker.close), "DrafterWorker.close() blocked on a socket left open"
    assert left_open.closed

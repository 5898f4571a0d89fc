"""Data plane: a 2-rank process group per (target, drafter registration).

The target hosts one ``TCPStore``. Each registration gets a fresh
``PrefixStore`` (``pair/<drafter>/<epoch>``), so a restarted drafter forms a new
pair without any global ``init_process_group`` and without disturbing other
pairs. NCCL (CUDA) and Gloo (CPU) go through the same code: only the backend
constructor differs. Rank 0 is always the target, rank 1 the drafter.

Every wait is bounded by ``timeout_s``; a timed-out or failed operation raises
:class:`TransportError` and the caller aborts the pair.
"""

from __future__ import annotations

import datetime
import logging
import socket
import time

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

TARGET_RANK = 0
DRAFTER_RANK = 1


class TransportError(RuntimeError):
    pass


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _listen_on(host: str, port: int) -> socket.socket:
    """A TCP socket listening on exactly ``host``:``port`` (IPv4 or IPv6, as ``host`` resolves)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        # As torch's own server does: a restarted target rebinds despite connections in
        # TIME_WAIT (on Linux this never lets a second socket listen on the port).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen()
    except BaseException:
        sock.close()
        raise
    return sock


def host_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """The target's store server, listening on ``host`` only. Raises TransportError naming the port when it is taken.

    torch hands its store daemon only the port, which it binds on every address; so the
    listening socket is made here and handed over with ``master_listen_fd``.
    """
    cannot = f"cannot host the data-plane store on {host}:{port}"
    try:
        listener = _listen_on(host, port)
    except socket.gaierror as exc:
        raise TransportError(f"{cannot}: control.store_host does not resolve ({exc})") from None
    except OSError as exc:
        raise TransportError(f"{cannot} ({exc}); is another target running? change control.store_port") from None
    # The store owns the descriptor from here and closes it when it goes (or fails after
    # taking it); a Python socket closing it too would close whatever reuses the number.
    fd = listener.detach()
    try:
        return dist.TCPStore(host, port, None, True, _timedelta(timeout_s), wait_for_workers=False,
                             master_listen_fd=fd)
    except RuntimeError as exc:
        raise TransportError(f"{cannot} ({exc})") from None


def connect_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    try:
        return dist.TCPStore(host, port, None, False, _timedelta(timeout_s), wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        raise TransportError(f"cannot reach the data-plane store at {host}:{port}: {exc}") from None


def local_address_towards(host: str) -> str:
    """The local IP address the kernel would use to reach ``host`` (no packet is sent)."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]


class PairGroup:
    """One side of a 2-rank group. Construction blocks until the peer joins (bounded)."""

    def __init__(
        self,
        *,
        kind: str,
        store: dist.Store,
        prefix: str,
        rank: int,
        device: torch.device,
        timeout_s: float,
        local_host: str = "127.0.0.1",
    ) -> None:
        self.kind = kind
        self.rank = rank
        self.peer = 1 - rank
        self.device = device
        self.timeout_s = timeout_s
        self.prefix = prefix
        self._aborted = False
        pair_store = dist.PrefixStore(prefix, store)
        start = time.monotonic()
        try:
            if kind == "gloo":
                opts = dist.ProcessGroupGloo._Options()
                opts._timeout = _timedelta(timeout_s)
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
                self._pg = dist.ProcessGroupGloo(pair_store, rank, 2, opts)
            elif kind == "nccl":
                if device.type != "cuda":
                    raise TransportError(f"the nccl transport needs a CUDA device, got {device}")
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = _timedelta(timeout_s)
                self._pg = dist.ProcessGroupNCCL(pair_store, rank, 2, opts)
            else:
                raise TransportError(f"unknown transport {kind!r}")
        except TransportError:
            raise
        except RuntimeError as exc:
            raise TransportError(f"forming the {kind} pair {prefix} failed within {timeout_s:.0f}s: {exc}") from None
        logger.debug("pair %s formed as rank %d in %.2fs", prefix, rank, time.monotonic() - start)

    def send(self, buf: torch.Tensor, tag: int) -> None:
        """Send ``buf`` to the peer and wait (bounded) until the transfer is done."""
        self._wait(self._pg.send([buf], self.peer, tag), "send")

    def recv(self, buf: torch.Tensor, tag: int) -> None:
        """Receive into ``buf`` from the peer; returns when the data is there (bounded)."""
        self._wait(self._pg.recv([buf], self.peer, tag), "recv")

    def _wait(self, work: dist.Work, what: str) -> None:
        if self._aborted:
            raise TransportError(f"pair {self.prefix} was aborted")
        try:
            work.wait(_timedelta(self.timeout_s))
        except RuntimeError as exc:
            raise TransportError(f"{what} on pair {self.prefix} failed: {exc}") from None

    def abort(self) -> None:
        """Tear the pair down without waiting for the peer (it may be dead)."""
        if self._aborted:
            return
        self._aborted = True
        try:
            if self.kind == "nccl":
                self._pg.abort()
            else:
                self._pg.shutdown()
        except RuntimeError as exc:
            logger.debug("abort of pair %s: %s", self.prefix, exc)

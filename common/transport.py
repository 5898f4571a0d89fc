"""Data plane: a 2-rank process group per (target, drafter registration).

The target hosts one ``TCPStore``. Each registration gets a fresh
``PrefixStore`` (``pair/<128-bit random hex>/<epoch>``, told only in WELCOME), so a restarted drafter forms a new
pair without any global ``init_process_group`` and without disturbing other
pairs. NCCL (CUDA) and Gloo (CPU) go through the same code: only the backend
constructor differs. Rank 0 is always the target, rank 1 the drafter.

Every wait is bounded by ``timeout_s``; a timed-out or failed operation (including
one that fails while it is issued, as NCCL's lazily created communicator can)
raises :class:`TransportError` and the caller aborts the pair.

NCCL error handling (see :func:`configure_nccl_error_handling`): a blocking wait
that raises on the waiting thread, with no watchdog teardown, no debug dump into
the store the pairs share and no heartbeat monitor, so a failed pair costs only
its own registration and never the process.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time

import torch
import torch.distributed as dist

from common.devices import use_device

logger = logging.getLogger(__name__)

TARGET_RANK = 0
DRAFTER_RANK = 1
# The one-element exchange that proves the peer is there; batches use tags 1..2**30, weights 0.
HANDSHAKE_TAG = (1 << 31) - 1

# Read by ProcessGroupNCCL when a group is constructed (torch 2.13); set only where the
# operator has not, so any of them can still be overridden from the environment.
NCCL_ERROR_HANDLING_ENV = {
    # wait() blocks this thread and, when the op times out or fails, aborts the op's
    # communicator and raises DistBackendError here (turned into TransportError).
    "TORCH_NCCL_BLOCKING_WAIT": "1",
    # 0 = the watchdog never tears the process down (with blocking wait torch uses only
    # the blocking path anyway; stated so a stray 1 or 3 from the environment is visible).
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
    # No debug dump on timeout: it writes a flag into the store every pair shares, and
    # every other process's monitor polls that flag and may abort on it.
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    # No heartbeat monitor thread: it kills the process when the watchdog looks stuck.
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    # Non-blocking communicator init: the communicator exists (and abort() reaches it)
    # while it is still connecting, so a peer that never comes cannot hang the thread.
    "TORCH_NCCL_USE_COMM_NONBLOCKING": "1",
}


_override_warned = False


def configure_nccl_error_handling(timeout_s: float) -> dict[str, str]:
    """Set the NCCL error-handling environment (operator values win); returns what is in effect.

    Must run before the first ProcessGroupNCCL is created: torch reads these when it
    constructs a group (some once per process).
    """
    for key, value in NCCL_ERROR_HANDLING_ENV.items():
        os.environ.setdefault(key, value)
    # How long a non-blocking init or op may report "in progress" before torch raises.
    os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(max(1, int(timeout_s))))
    effective = {key: os.environ[key] for key in (*NCCL_ERROR_HANDLING_ENV, "TORCH_NCCL_NONBLOCKING_TIMEOUT")}
    unsafe = {k: v for k, v in effective.items() if k in NCCL_ERROR_HANDLING_ENV and v != NCCL_ERROR_HANDLING_ENV[k]}
    global _override_warned
    if unsafe and not _override_warned:
        _override_warned = True
        logger.warning("[transport] NCCL error handling overridden from the environment: %s "
                       "(a timed-out op may then end the process instead of one registration)", unsafe)
    return effective


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


def gpu_uuid(device: torch.device) -> str:
    """The physical GPU behind ``device`` ("GPU-<uuid>"), "" for a CPU device.

    Device indices differ between processes (CUDA_VISIBLE_DEVICES), UUIDs do not.
    """
    if device.type != "cuda":
        return ""
    return f"GPU-{torch.cuda.get_device_properties(device).uuid}"


def same_gpu_refusal(kind: str, target_uuid: str, drafter_uuid: str, drafter_id: str) -> str:
    """Why this drafter cannot pair with the target over ``kind``, or "" when it can.

    NCCL refuses two ranks of one communicator on the same physical GPU ("Duplicate GPU
    detected"): found at the first op it would only drop and re-register the drafter
    forever. No NCCL setting is relied on to allow it, so the pair is refused up front.
    """
    if kind != "nccl" or not target_uuid or target_uuid != drafter_uuid:
        return ""
    return (f"drafter {drafter_id} and the target are on the same GPU ({target_uuid}); the nccl transport "
            "needs a GPU each (NCCL refuses two ranks on one GPU): put the drafter on another GPU "
            "(drafter.device, CUDA_VISIBLE_DEVICES)")


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
                configure_nccl_error_handling(timeout_s)
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = _timedelta(timeout_s)
                self._pg = dist.ProcessGroupNCCL(pair_store, rank, 2, opts)
            else:
                raise TransportError(f"unknown transport {kind!r}")
        except TransportError:
            raise
        except Exception as exc:  # DistBackendError, DistStoreError, ... all mean "no pair"
            raise TransportError(f"forming the {kind} pair {prefix} failed within {timeout_s:.0f}s: {exc}") from None
        try:
            self._handshake()
        except BaseException:
            # Off this thread: a communicator still initialising can hold abort() up.
            self.abort_in_background()
            raise
        logger.debug("pair %s formed as rank %d in %.2fs", prefix, rank, time.monotonic() - start)

    def _handshake(self) -> None:
        """Exchange one element with the peer, so that a constructed pair means a joined peer.

        The group constructors need not contact the peer (NCCL creates its communicator
        inside the first op), so the first op is made here, on a helper thread the caller
        waits on for at most ``timeout_s``: even an op stuck where no timeout reaches it
        (a blocking communicator init) cannot hold the caller longer.
        """
        token = torch.full((1,), 1 + self.rank, dtype=torch.int32, device=self.device)
        outcome: list[BaseException | None] = []

        def exchange() -> None:
            try:
                use_device(self.device)  # a new thread starts on device 0
                if self.rank == TARGET_RANK:
                    self.send(token, HANDSHAKE_TAG)
                else:
                    self.recv(token, HANDSHAKE_TAG)
                outcome.append(None)
            except BaseException as exc:  # handed to the waiting thread below
                outcome.append(exc)

        helper = threading.Thread(target=exchange, name=f"pair-handshake-{self.prefix}", daemon=True)
        helper.start()
        helper.join(self.timeout_s)
        if not outcome:
            raise TransportError(f"the peer of pair {self.prefix} did not join within {self.timeout_s:.0f}s "
                                 "(transport.timeout_s)")
        if outcome[0] is not None:
            raise TransportError(f"forming the {self.kind} pair {self.prefix} failed: {outcome[0]}") from None
        if self.rank != TARGET_RANK:
            carried = int(token.item())  # once per pair formation, never per batch
            if carried != 1 + TARGET_RANK:
                raise TransportError(f"pair {self.prefix}: the handshake carried {carried}, expected {1 + TARGET_RANK}")

    def send(self, buf: torch.Tensor, tag: int) -> None:
        """Send ``buf`` to the peer and wait (bounded) until the transfer is done."""
        self._issue_and_wait(self._pg.send, buf, tag, "send")

    def recv(self, buf: torch.Tensor, tag: int) -> None:
        """Receive into ``buf`` from the peer; returns when the data is there (bounded)."""
        self._issue_and_wait(self._pg.recv, buf, tag, "recv")

    def _issue_and_wait(self, op, buf: torch.Tensor, tag: int, what: str) -> None:
        """Issue ``op`` and wait for it; any failure of either step raises TransportError.

        Issuing can fail too: NCCL creates its communicator inside the first op (store
        timeouts, "Duplicate GPU detected", init failures), and an op on an aborted group
        raises at once.
        """
        if self._aborted:
            raise TransportError(f"pair {self.prefix} was aborted")
        try:
            work = op([buf], self.peer, tag)
            work.wait(_timedelta(self.timeout_s))
        except Exception as exc:  # DistBackendError and friends: every one ends this pair
            raise TransportError(f"{what} on pair {self.prefix} failed: {exc}") from None

    def abort_in_background(self) -> threading.Thread:
        """Start :meth:`abort` on a daemon thread and return it (ncclCommAbort can block
        behind kernels still queued on the device; the caller must not)."""
        helper = threading.Thread(target=self.abort, name=f"pair-abort-{self.prefix}", daemon=True)
        helper.start()
        return helper

    def abort(self) -> None:
        """Tear the pair down without waiting for the peer (it may be dead). May block (NCCL)."""
        if self._aborted:
            return
        self._aborted = True
        try:
            if self.kind == "nccl":
                self._pg.abort()
            else:
                self._pg.shutdown()
        except Exception as exc:  # the pair is being thrown away; log and go on
            logger.debug("abort of pair %s: %s", self.prefix, exc)

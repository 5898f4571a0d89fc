"""Data-plane failures end the pair, never a thread or the process (real gloo pairs on loopback).

Guards against: send/recv raising while an op is issued (NCCL creates its communicator
inside the first op), which escaped the error handling: the target's link thread died
without a "failed" event and kept its batches pinned, the drafter's receive thread died
silently; a peer that never joins; stop() blocking the control thread on abort().
"""

from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from common.transport import DRAFTER_RANK, TARGET_RANK, PairGroup, TransportError, connect_store, host_store
from drafter_worker.data_plane import PairAttachment, Receiver
from target_server.link import DrafterLink
from tests.ports import free_ports

TIMEOUT_S = 3.0
CPU = torch.device("cpu")


@pytest.fixture
def store_port():
    port = free_ports(1)[0]
    store = host_store("127.0.0.1", port, TIMEOUT_S)
    yield port
    del store


def _join(port: int, prefix: str, rank: int) -> PairGroup:
    return PairGroup(kind="gloo", store=connect_store("127.0.0.1", port, TIMEOUT_S), prefix=prefix, rank=rank,
                     device=CPU, timeout_s=TIMEOUT_S)


def _pair_of_two(port: int, prefix: str = "pair/t/1") -> tuple[PairGroup, PairGroup]:
    out: dict[int, PairGroup | BaseException] = {}

    def join(rank: int) -> None:
        try:
            out[rank] = _join(port, prefix, rank)
        except BaseException as exc:
            out[rank] = exc

    threads = [threading.Thread(target=join, args=(r,), daemon=True) for r in (TARGET_RANK, DRAFTER_RANK)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * TIMEOUT_S)
    assert all(isinstance(out.get(r), PairGroup) for r in (0, 1)), out
    return out[TARGET_RANK], out[DRAFTER_RANK]


class _FailingGroup:
    """Stands in for the process group: every op raises as it is issued, as NCCL's lazy init can."""

    def __init__(self, real, exc: BaseException):
        self._real, self._exc = real, exc

    def send(self, *args):
        raise self._exc

    recv = send

    def shutdown(self):
        self._real.shutdown()

    abort = shutdown


class _BlockingAbortGroup:
    """A group whose teardown blocks until released (ncclCommAbort behind busy kernels)."""

    def __init__(self, real):
        self._real = real
        self.release = threading.Event()
        self.called = threading.Event()

    def send(self, *args):
        return self._real.send(*args)

    def recv(self, *args):
        return self._real.recv(*args)

    def shutdown(self):
        self.called.set()
        assert self.release.wait(30)
        self._real.shutdown()

    abort = shutdown


@pytest.mark.parametrize("exc", [RuntimeError("boom"), dist.DistBackendError("Duplicate GPU detected")])
def test_op_that_raises_at_issue_is_a_transport_error(store_port, exc):
    target, drafter = _pair_of_two(store_port)
    try:
        target._pg = _FailingGroup(target._pg, exc)
        with pytest.raises(TransportError, match="send on pair"):
            target.send(torch.zeros(4), tag=5)
        target.abort()
        with pytest.raises(TransportError, match="aborted"):
            target.send(torch.zeros(4), tag=6)
    finally:
        target.abort()
        drafter.abort()


def test_handshake_makes_paired_mean_paired(store_port):
    target, drafter = _pair_of_two(store_port)
    try:
        # After the handshake the data moves in order on the formed pair.
        t = threading.Thread(target=target.send, args=(torch.arange(8.0), 1), daemon=True)
        t.start()
        got = torch.zeros(8)
        drafter.recv(got, 1)
        t.join(TIMEOUT_S)
        assert torch.equal(got, torch.arange(8.0))
    finally:
        target.abort()
        drafter.abort()


@pytest.mark.parametrize("rank", [TARGET_RANK, DRAFTER_RANK])
def test_peer_that_never_joins_raises_within_timeout(store_port, rank):
    with pytest.raises(TransportError):
        _join(store_port, f"pair/lonely/{rank}", rank)


def _link(port: int, events: queue.Queue, weights: torch.Tensor, prefix: str = "pair/t/1") -> DrafterLink:
    return DrafterLink(name="t", transport="gloo", store_address=("127.0.0.1", port), prefix=prefix, device=CPU,
                       timeout_s=TIMEOUT_S, weights=weights, events=events, local_host="127.0.0.1")


def _batch(nbytes: int, fill: int) -> SimpleNamespace:
    return SimpleNamespace(buffer=torch.full((nbytes,), fill, dtype=torch.uint8), layout=SimpleNamespace(nbytes=nbytes),
                           ready_event=None)


def _wait_paired(link: DrafterLink) -> None:
    deadline = time.monotonic() + 4 * TIMEOUT_S
    while not link.paired and time.monotonic() < deadline:
        time.sleep(0.02)
    assert link.paired


@pytest.mark.parametrize("exc", [RuntimeError("boom"), dist.DistBackendError("NCCL error")])
def test_link_failure_at_issue_releases_batches_and_reports_failed(store_port, exc):
    events: queue.Queue = queue.Queue()
    weights = torch.arange(16.0)
    link = _link(store_port, events, weights)
    link.start()
    drafter = _join(store_port, "pair/t/1", DRAFTER_RANK)
    try:
        got = torch.zeros(16)
        drafter.recv(got, 0)
        assert torch.equal(got, weights)
        _wait_paired(link)
        link._pair._pg = _FailingGroup(link._pair._pg, exc)
        first, second = _batch(64, 1), _batch(64, 2)
        link.enqueue(first, 1)
        link.enqueue(second, 2)
        link.join(4 * TIMEOUT_S)
        assert not link.is_alive()
        seen = []
        while not events.empty():
            seen.append(events.get_nowait())
        assert all(e.kind == "failed" for e in seen)
        # Every batch handed to the link comes back (the control thread releases it) ...
        assert {id(e.ready) for e in seen if e.ready is not None} == {id(first), id(second)}
        # ... and one event names the failure, which drops the registration.
        assert any("boom" in e.error or "NCCL error" in e.error for e in seen)
    finally:
        link.stop()
        drafter.abort()


def test_link_unexpected_error_is_a_failed_event(store_port):
    events: queue.Queue = queue.Queue()
    link = _link(store_port, events, torch.zeros(4))
    link.start()
    drafter = _join(store_port, "pair/t/1", DRAFTER_RANK)
    try:
        drafter.recv(torch.zeros(4), 0)
        _wait_paired(link)
        broken = SimpleNamespace(buffer=torch.zeros(4), layout=None, ready_event=None)  # AttributeError in run()
        link.enqueue(broken, 1)
        link.join(4 * TIMEOUT_S)
        assert not link.is_alive()
        seen = [events.get_nowait() for _ in range(events.qsize())]
        assert [e.ready for e in seen if e.ready is not None] == [broken]
        assert all(e.kind == "failed" for e in seen) and len(seen) == 2
    finally:
        link.stop()
        drafter.abort()


def test_stop_does_not_block_on_abort(store_port):
    events: queue.Queue = queue.Queue()
    link = _link(store_port, events, torch.zeros(4))
    link.start()
    drafter = _join(store_port, "pair/t/1", DRAFTER_RANK)
    blocking = None
    try:
        drafter.recv(torch.zeros(4), 0)
        _wait_paired(link)
        blocking = _BlockingAbortGroup(link._pair._pg)
        link._pair._pg = blocking
        link.stop()  # returns although the abort blocks
        assert blocking.called.wait(TIMEOUT_S)  # the abort did start, on another thread
        assert not blocking.release.is_set()
        blocking.release.set()
        link.join(4 * TIMEOUT_S)
        assert not link.is_alive()
        assert events.empty()  # a stopped link reports nothing
    finally:
        if blocking is not None:
            blocking.release.set()
        link.stop()
        drafter.abort()


@pytest.mark.parametrize("exc", [RuntimeError("boom"), dist.DistBackendError("NCCL error")])
def test_receiver_failure_at_issue_is_put_on_ready(store_port, exc):
    target, drafter = _pair_of_two(store_port)
    drafter._pg = _FailingGroup(drafter._pg, exc)
    receiver = Receiver(PairAttachment(drafter))
    receiver.start()
    try:
        meta = SimpleNamespace(nbytes=8, tag=1)
        receiver.inbox.put((meta, torch.zeros(8, dtype=torch.uint8), None))
        item = receiver.ready.get(timeout=4 * TIMEOUT_S)
        assert isinstance(item, TransportError)
        receiver.join(TIMEOUT_S)
        assert not receiver.is_alive()
    finally:
        receiver.stop()
        target.abort()
        drafter.abort()


def test_receiver_unexpected_error_is_put_on_ready(store_port):
    target, drafter = _pair_of_two(store_port)
    receiver = Receiver(PairAttachment(drafter))
    receiver.start()
    try:
        receiver.inbox.put((SimpleNamespace(tag=1), torch.zeros(8), None))  # no nbytes: AttributeError
        item = receiver.ready.get(timeout=4 * TIMEOUT_S)
        assert isinstance(item, TransportError) and "receive thread failed" in str(item)
        receiver.join(TIMEOUT_S)
        assert not receiver.is_alive()
    finally:
        receiver.stop()
        target.abort()
        drafter.abort()


def test_same_gpu_is_refused_only_for_nccl():
    # Guards against NCCL's "Duplicate GPU detected" at the first op, which only re-registers forever.
    from common.transport import same_gpu_refusal
    uuid = "GPU-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9"
    message = same_gpu_refusal("nccl", uuid, uuid, "d1")
    assert "d1" in message and uuid in message and "same GPU" in message
    assert same_gpu_refusal("nccl", uuid, "GPU-other", "d1") == ""
    assert same_gpu_refusal("nccl", "", "", "d1") == ""  # a peer that sent none (older, or CPU)
    assert same_gpu_refusal("shm", uuid, uuid, "d1") == ""


def test_nccl_error_handling_env_is_set_but_operator_wins(monkeypatch):
    # Guards against torch's defaults: a timed-out op made the watchdog dump into the shared
    # store and end the process, and other processes' monitors could abort on that flag.
    from common.transport import NCCL_ERROR_HANDLING_ENV, configure_nccl_error_handling
    for key in (*NCCL_ERROR_HANDLING_ENV, "TORCH_NCCL_NONBLOCKING_TIMEOUT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    effective = configure_nccl_error_handling(30)
    assert effective["TORCH_NCCL_BLOCKING_WAIT"] == "1"
    assert effective["TORCH_NCCL_ENABLE_MONITORING"] == "0"
    assert effective["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
    assert effective["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "30"
    assert effective["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"  # the operator's value stays

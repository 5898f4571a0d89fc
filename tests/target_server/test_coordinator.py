"""The target's sans-I/O coordinator, driven in-process through the interleavings that
otherwise only subprocess jobs reach: restart mid-batch, duplicate HELLO, ACK after a
drop, credit exhaustion, DONE, a dead data plane, pinned buffers of a dropped reader.

Real scheduler (with the capture simulated inline, as in test_scheduler), real
messages (every message is encoded and decoded, so the protocol's checks apply),
time passed in. The data plane is an in-memory endpoint per registration: the
transports themselves are tested with real processes elsewhere.
"""

from __future__ import annotations

import queue

import pytest

from common import protocol as P
from common.auth import hello_proof, status_proof
from target_server.coordinator import Admission, Coordinator
from target_server.link import LinkEvent
from tests.messages import welcome
from tests.target_server.test_scheduler import Capturer, make_scheduler

KEY = "k" * 64
HASH = "cfg"


class MemoryEndpoint:
    def __init__(self, pins_until_ack: bool) -> None:
        self.pins_until_ack = pins_until_ack
        self.paired = False
        self.started = self.stopped = False
        self.handed: list[int] = []
        self.readies: list = []
        self.outbox: list = []  # handed over, not yet "sent"

    def welcome_fields(self) -> dict:
        return {"pair_prefix": "memory"}

    def start(self) -> None:
        self.started = True

    def requested(self) -> None:
        self.paired = True

    def hand_over(self, ready) -> tuple[int, int]:
        self.handed.append(ready.plan_index)
        self.readies.append(ready)
        self.outbox.append(ready)
        return len(self.handed), -1

    def stop(self) -> None:
        self.stopped = True

    def is_alive(self) -> bool:
        return False

    def join(self, timeout=None) -> None:
        pass


class MemoryPlane:
    def __init__(self, pins_until_ack: bool = False, reader_alive: bool = True) -> None:
        self.name = "memory"
        self.events: queue.Queue = queue.Queue()
        self.pins_until_ack = pins_until_ack
        self.reader_alive = reader_alive
        self.endpoints: list[MemoryEndpoint] = []

    def endpoint(self, reader: str, epoch: int, send_weights: bool = True) -> MemoryEndpoint:
        self.endpoints.append(MemoryEndpoint(self.pins_until_ack))
        return self.endpoints[-1]

    def release_grace_s(self, drafter_id: str, epoch: int, heartbeat_timeout_s: float) -> float:
        return heartbeat_timeout_s if self.reader_alive else 0.0

    def forget_reader(self, drafter_id: str, epoch: int) -> None:
        pass


def welcome_for(endpoint, epoch: int) -> P.Welcome:
    return welcome(registration_epoch=epoch, **endpoint.welcome_fields())


class Job:
    """A coordinator, its scheduler and capture, and helpers that speak for drafters."""

    def __init__(self, *, total: int | None = 6, pins_until_ack: bool = False, reader_alive: bool = True,
                 max_drafters: int = 4) -> None:
        self.sched = make_scheduler(slots=2, total=total)
        self.capture = Capturer(self.sched)
        self.plane = MemoryPlane(pins_until_ack, reader_alive)
        self.coord = Coordinator(
            admission=Admission(control_key=KEY, config_hash=HASH, transport="gloo", gpu_uuid="", max_drafters=max_drafters,
                                heartbeat_timeout_s=10.0, ack_timeout_s=100.0, pair_timeout_s=30.0),
            scheduler=self.sched, data_plane=self.plane, welcome=welcome_for)
        self.now = 1000.0

    def send(self, identity: bytes, msg: P.Message) -> list[tuple[bytes, P.Message]]:
        decoded = P.decode(msg.encode())  # what the server hands in: a decoded, checked message
        out = self.coord.handle(identity, decoded, self.now, status=lambda: P.Status(
            uptime_s=0.0, tokens_per_s=0.0, queue_depth=0, bucket_depths=[], drafters=self.coord.status_rows(self.now)))
        return [(who, P.decode(m.encode())) for who, m in out]

    def hello(self, identity: bytes, drafter_id: str, *, watermark: int = 0, extra=(), rank: int = 0,
              world_size: int = 1, generation: int = 1) -> P.Message:
        out = self.send(identity, hello_msg(drafter_id, watermark=watermark, extra=extra, rank=rank,
                                            world_size=world_size, generation=generation))
        assert len(out) == 1 and out[0][0] == identity
        return out[0][1]

    def dispatch(self) -> list[tuple[bytes, P.Message]]:
        """Capture what can be, dispatch, and let the data plane send what it was handed."""
        self.capture.drain()
        out = [(who, P.decode(m.encode())) for who, m in self.coord.dispatch(self.now, "float32")]
        for ep in self.plane.endpoints:
            sent, ep.outbox = ep.outbox, []
            if not ep.pins_until_ack:  # a pair transport frees the buffer once sent
                for ready in sent:
                    self.coord.on_link_event(LinkEvent(ep, "sent", ready), self.now)
        return out

    def batches_to(self, identity: bytes, out) -> list[int]:
        return [m.batch_id for who, m in out if who == identity and isinstance(m, P.Batch)]


def hello_msg(drafter_id: str, *, watermark: int = 0, extra=(), rank: int = 0, world_size: int = 1,
              generation: int = 1, config_hash: str = HASH, auth: str | None = None, replica: int = 0,
              topology_id: str = "") -> P.Hello:
    return P.Hello(drafter_id=drafter_id, config_hash=config_hash, transport="gloo", pid=1, rank=rank,
                   world_size=world_size, generation=generation, replica=replica, topology_id=topology_id,
                   covered_watermark=watermark, covered_extra=list(extra),
                   auth=hello_proof(KEY, drafter_id) if auth is None else auth)


def ack(ids, step: int = 1, checkpoint: int = 0) -> P.Ack:
    return P.Ack(batch_ids=list(ids), step=step, checkpoint_step=checkpoint)


def test_hello_then_credits_then_batches_in_plan_order():
    job = Job()
    assert isinstance(job.hello(b"a", "d0"), P.Welcome)
    assert job.dispatch() == []  # no credit yet
    job.send(b"a", P.Request(credits=2))
    out = job.dispatch()
    assert job.batches_to(b"a", out) == [0, 1]
    assert job.plane.endpoints[0].handed == [0, 1]
    job.send(b"a", ack([0, 1], step=5, checkpoint=4))
    assert job.coord.status_rows(job.now)[0].checkpoint_step == 4


def test_credits_bound_what_is_sent_and_are_capped():
    job = Job(total=None)
    job.hello(b"a", "d0")
    job.send(b"a", P.Request(credits=1))
    assert job.batches_to(b"a", job.dispatch()) == [0]
    assert job.batches_to(b"a", job.dispatch()) == []  # credit spent: nothing more, however much is ready
    for _ in range(3):
        job.send(b"a", P.Request(credits=P.MAX_CREDITS))
    assert job.coord.regs[b"a"].credits == P.MAX_CREDITS


def test_restart_mid_batch_resends_only_what_the_checkpoint_lacks():
    job = Job()
    job.hello(b"old", "d0")
    job.send(b"old", P.Request(credits=3))
    assert job.batches_to(b"old", job.dispatch()) == [0, 1]  # two buffers captured ahead
    job.send(b"old", ack([0]))
    # The drafter is killed and comes back (new socket identity) with a checkpoint covering batch 0.
    job.now += 2
    job.hello(b"new", "d0", watermark=1, generation=2)  # a restart is a new generation
    assert b"old" not in job.coord.regs and job.plane.endpoints[0].stopped
    job.send(b"new", P.Request(credits=8))
    got = []
    for _ in range(5):
        out = job.dispatch()
        got += job.batches_to(b"new", out)
        job.send(b"new", ack(job.batches_to(b"new", out)))
    assert sorted(got) == [1, 2, 3, 4, 5]  # batch 1 again (never acknowledged), never batch 0


def test_duplicate_hello_within_a_second_is_refused_then_replaces_the_registration():
    job = Job()
    first = job.hello(b"a", "d0")
    again = job.hello(b"b", "d0")
    assert isinstance(again, P.Error) and again.code == P.E_BUSY
    assert set(job.coord.regs) == {b"a"}  # the live registration is untouched
    job.now += 1.5
    second = job.hello(b"b", "d0")
    assert isinstance(second, P.Welcome) and second.registration_epoch == first.registration_epoch + 1
    assert set(job.coord.regs) == {b"b"}


def test_ack_after_drop_is_refused_and_the_batch_goes_to_the_next_registration():
    job = Job()
    job.hello(b"a", "d0")
    job.send(b"a", P.Request(credits=1))
    assert job.batches_to(b"a", job.dispatch()) == [0]
    job.send(b"a", P.Bye(reason="test"))
    late = job.send(b"a", ack([0]))
    assert isinstance(late[0][1], P.Error) and late[0][1].code == P.E_STATE
    job.now += 2
    job.hello(b"b", "d0")
    job.send(b"b", P.Request(credits=1))
    assert job.batches_to(b"b", job.dispatch()) == [0]  # the late ACK did not count as trained


def test_done_once_every_batch_is_acknowledged():
    job = Job(total=3)
    job.hello(b"a", "d0")
    job.send(b"a", P.Request(credits=8))
    seen, dones = [], 0
    for _ in range(4):
        out = job.dispatch()
        dones += sum(isinstance(m, P.Done) for _, m in out)
        ids = job.batches_to(b"a", out)
        seen += ids
        if ids:
            job.send(b"a", ack(ids))
    assert seen == [0, 1, 2] and dones == 1


def test_a_failed_data_plane_drops_its_registration_and_requeues_its_batches():
    job = Job()
    job.hello(b"a", "d0", world_size=2)
    job.send(b"a", P.Request(credits=2))
    assert job.batches_to(b"a", job.dispatch()) == [0, 1]
    job.coord.on_link_event(LinkEvent(job.plane.endpoints[0], "failed", error="peer gone"), job.now)
    assert not job.coord.regs
    job.now += 2
    job.hello(b"b", "d0", rank=1, world_size=2)  # another rank of the drafter gets the batches back
    job.send(b"b", P.Request(credits=2))
    assert job.batches_to(b"b", job.dispatch()) == [0, 1]


@pytest.mark.parametrize("reader_alive, expected_grace", [(True, 10.0), (False, 0.0)])
def test_pinned_buffers_of_a_dropped_reader_are_unpinned_only_after_its_grace(reader_alive, expected_grace):
    job = Job(total=None, pins_until_ack=True, reader_alive=reader_alive)
    job.hello(b"a", "d0")
    job.send(b"a", P.Request(credits=2))
    assert job.batches_to(b"a", job.dispatch()) == [0, 1]
    readies = job.plane.endpoints[0].readies
    job.send(b"a", ack([0]))
    assert [r.pins for r in readies] == [0, 1]  # an ACK unpins at once
    job.send(b"a", P.Bye())
    job.coord.release_due(job.now + expected_grace - 0.1)
    assert [r.pins for r in readies] == [0, 1]
    job.coord.release_due(job.now + expected_grace)
    assert [r.pins for r in readies] == [0, 0]


def test_silence_and_hoarding_are_reaped_and_others_get_heartbeats():
    job = Job(total=None)
    job.hello(b"quiet", "d0")
    job.hello(b"hoard", "d1")
    job.hello(b"fine", "d2")
    for who in (b"quiet", b"hoard", b"fine"):
        job.send(who, P.Request(credits=1))
    job.dispatch()
    job.now += 50  # quiet says nothing; the others heartbeat
    job.send(b"hoard", P.Heartbeat(step=1))
    job.send(b"fine", P.Heartbeat(step=1))
    job.send(b"fine", ack(job.plane.endpoints[2].handed))
    out = job.coord.heartbeat_and_reap(job.now, captured_batches=3, capture_stalled_s=0.0)
    assert set(job.coord.regs) == {b"hoard", b"fine"}
    job.now += 60
    job.send(b"hoard", P.Heartbeat(step=1))
    job.send(b"fine", P.Heartbeat(step=1))
    out = job.coord.heartbeat_and_reap(job.now, captured_batches=3, capture_stalled_s=0.0)
    assert set(job.coord.regs) == {b"fine"}  # held a batch 110 s without an ACK (ack timeout 100 s)
    assert [(who, type(m)) for who, m in out] == [(b"fine", P.Heartbeat)]


def test_refusals_say_why_and_register_nothing():
    job = Job(max_drafters=1)
    forged = job.send(b"x", hello_msg("d0", auth="0" * 64))
    other_cfg = job.send(b"y", hello_msg("d0", config_hash="other"))
    job.now += 2
    job.hello(b"a", "d0")
    full = job.hello(b"b", "d9")
    codes = [forged[0][1].code, other_cfg[0][1].code, full.code]
    assert codes == [P.E_AUTH, P.E_CONFIG, P.E_BUSY]
    assert set(job.coord.regs) == {b"a"}
    status = job.send(b"s", P.StatusRequest(auth=status_proof(KEY)))
    assert isinstance(status[0][1], P.Status) and status[0][1].drafters[0].id == "d0"

"""The target's control logic without I/O: registrations, credits, dispatch, ACK, drop/redo.

The server's control thread owns the sockets, the threads and the clock; it
decodes each message and hands it here with the current time, and sends what
comes back. Everything that decides something lives in this class: whether a
HELLO may register (its replica, topology and generation included), which
registrations a new one replaces (the same rank, or every rank of an older
generation of the drafter), who gets which batch against which credit, when a batch goes back to its group (drop, missed
ACKs, a dead data plane), when DONE is due, and when a dropped registration's
pinned buffers may be reused. Time is always passed in, so a test drives every
interleaving in-process (restart mid-batch, duplicate HELLO, ACK after drop,
credit exhaustion, DONE) without a socket or a sleep.

Collaborators are passed in: the :class:`BatchScheduler` (plain locked state),
the data plane (:mod:`target_server.data_plane`: one endpoint per
registration, whatever the transport) and a function that builds the WELCOME.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

from common import protocol as P
from common.auth import hello_proof, proof_ok, status_proof
from common.transport import same_gpu_refusal
from target_server.data_plane import DataPlane, Endpoint, LinkEvent
from target_server.scheduler import BatchScheduler, ReadyBatch

logger = logging.getLogger(__name__)

Outbox = list[tuple[bytes, P.Message]]  # (ZeroMQ identity, message) to send, in order


@dataclass(frozen=True)
class Admission:
    """What a HELLO must match to register (fixed for the target's life)."""

    control_key: str  # the run's secret: a HELLO carries HMAC(key, "hello:" + id)
    config_hash: str  # Config.shared_hash(): [data] and [target] of both sides agree
    transport: str
    gpu_uuid: str  # the target's GPU ("" on CPU): NCCL cannot pair two ranks on one GPU
    max_drafters: int
    heartbeat_timeout_s: float
    ack_timeout_s: float
    pair_timeout_s: float  # transport.timeout_s: how long a registration may take to form its data plane
    replica: int = 0  # this target's replica number and the job's topology (common.plan_shard)
    replicas: int = 1
    topology_id: str = ""


@dataclass
class Registration:
    identity: bytes
    drafter_id: str  # the drafter (one model) this rank trains; the scheduler's group
    rank: int
    world_size: int
    generation: int
    epoch: int
    endpoint: Endpoint
    pid: int
    registered_at: float
    last_seen: float
    last_progress: float  # last ACK, or the dispatch that ended an idle spell: bounds how long batches are held
    credits: int = 0
    inflight: set[int] = field(default_factory=set)  # dispatched, not acknowledged
    step: int = 0
    checkpoint_step: int = 0
    done_sent: bool = False
    held: dict[int, ReadyBatch] = field(default_factory=dict)  # buffers pinned until the ACK, by batch id

    @property
    def reader(self) -> str:
        """This rank's name on the data plane (the drafter's side attaches under the same name)."""
        return f"{self.drafter_id}.{self.rank}"

    @property
    def state(self) -> str:
        """One word for STATUS: where this registration is in its life."""
        if self.done_sent:
            return "done"
        if not self.endpoint.paired:
            return "forming pair"
        return "training"


class Coordinator:
    def __init__(
        self,
        *,
        admission: Admission,
        scheduler: BatchScheduler,
        data_plane: DataPlane,
        welcome: Callable[[Endpoint, int], P.Welcome],
    ) -> None:
        self.admission = admission
        self.scheduler = scheduler
        self.data_plane = data_plane
        self._welcome = welcome
        self.regs: dict[bytes, Registration] = {}
        self.stopped_endpoints: list[Endpoint] = []  # joined by the shell at close
        self._deferred_release: list[tuple[float, list[ReadyBatch]]] = []
        self._last_hello: dict[str, float] = {}
        self._offenders: set[bytes] = set()
        self._epoch_counter = 0
        self._handlers: dict[type, Callable[[Registration, P.Message, float], Outbox]] = {
            P.Request: self._on_request,
            P.Ack: self._on_ack,
            P.Heartbeat: self._on_heartbeat,
            P.Bye: self._on_bye,
        }

    # ---------------------------------------------------------------- messages
    def is_registered(self, identity: bytes) -> bool:
        return identity in self.regs

    def handle(self, identity: bytes, msg: P.Message, now: float, status: Callable[[], P.Status]) -> Outbox:
        """One decoded message from ``identity``; ``status`` builds the STATUS reply when one is due."""
        reg = self.regs.get(identity)
        if reg is not None:
            reg.last_seen = now
        if isinstance(msg, P.Hello):
            return self._on_hello(identity, msg, now)
        if isinstance(msg, P.StatusRequest):
            if proof_ok(status_proof(self.admission.control_key), msg.auth):
                return [(identity, status())]
            return self.complain(identity, P.E_AUTH, "STATUS needs the run's status key (<run_dir>/auth/status.key)")
        if reg is None:
            return self.complain(identity, P.E_STATE, f"{msg.TYPE} before HELLO: register first")
        handler = self._handlers.get(type(msg))
        if handler is None:
            return self.complain(identity, P.E_STATE, f"{msg.TYPE} is not something a drafter sends")
        return handler(reg, msg, now)

    def complain(self, identity: bytes, code: str, message: str) -> Outbox:
        """Reply ERROR; log only the first offence of each peer so a flood cannot flood the log."""
        if identity not in self._offenders:
            if len(self._offenders) >= 4096:  # bounded memory under a flood of fresh identities
                self._offenders.clear()
            self._offenders.add(identity)
            reg = self.regs.get(identity)
            who = f"drafter {reg.drafter_id}" if reg else f"peer {identity[:24]!r}"
            logger.warning("[bad-message] %s: %s (%s); later offences of this peer are not logged", who, message, code)
        return [(identity, P.Error(code, message))]

    def _on_request(self, reg: Registration, msg: P.Request, now: float) -> Outbox:
        reg.credits = min(reg.credits + msg.credits, P.MAX_CREDITS)
        reg.endpoint.requested()
        return []

    def _on_ack(self, reg: Registration, msg: P.Ack, now: float) -> Outbox:
        for batch_id in msg.batch_ids:
            if batch_id in reg.inflight:
                reg.inflight.discard(batch_id)
                reg.last_progress = now
            held = reg.held.pop(batch_id, None)
            if held is not None:
                self.scheduler.release(held)
        reg.step = msg.step
        reg.checkpoint_step = msg.checkpoint_step
        return []

    def _on_heartbeat(self, reg: Registration, msg: P.Heartbeat, now: float) -> Outbox:
        reg.step = max(reg.step, msg.step)
        return []

    def _on_bye(self, reg: Registration, msg: P.Bye, now: float) -> Outbox:
        logger.info("[bye] drafter %s (epoch %d): %s", reg.drafter_id, reg.epoch, msg.reason or "no reason")
        self.drop(reg, "said BYE", now)
        return []

    # ---------------------------------------------------------------- registration
    def _on_hello(self, identity: bytes, hello: P.Hello, now: float) -> Outbox:
        refusal = self._refusal(identity, hello, now) or self._generation_refusal(identity, hello)
        if refusal is not None:
            return refusal
        newer = hello.generation > self.scheduler.generation(hello.drafter_id)
        for old in list(self.regs.values()):
            if old.identity == identity or (old.drafter_id == hello.drafter_id and (newer or old.rank == hello.rank)):
                why = (f"replaced by generation {hello.generation}" if newer and old.identity != identity
                       else "replaced by a new registration")
                self.drop(old, why, now)  # before the join: an older generation's unACKed batches go to its state
        self._epoch_counter += 1
        epoch = self._epoch_counter
        endpoint = self.data_plane.endpoint(f"{hello.drafter_id}.{hello.rank}", epoch, send_weights=hello.need_weights)
        self.regs[identity] = Registration(identity, hello.drafter_id, hello.rank, hello.world_size, hello.generation,
                                           epoch, endpoint, hello.pid, now, now, now, step=hello.step)
        self.scheduler.join(hello.drafter_id, hello.generation, hello.covered_watermark, hello.covered_extra)
        endpoint.start()
        logger.info(
            "[hello] drafter %s rank %d/%d (generation %d, pid %d) registered as epoch %d; covers local < %d (+%d more), "
            "step %d", hello.drafter_id, hello.rank, hello.world_size, hello.generation, hello.pid, epoch,
            hello.covered_watermark, len(hello.covered_extra), hello.step,
        )
        return [(identity, self._welcome(endpoint, epoch))]

    def _generation_refusal(self, identity: bytes, hello: P.Hello) -> Outbox | None:
        """An older generation of a drafter, or a rank count its live generation does not have."""
        current = self.scheduler.generation(hello.drafter_id)
        if hello.generation < current:
            return self._refuse(identity, P.E_STALE, (
                f"drafter {hello.drafter_id} rank {hello.rank} is generation {hello.generation}, but generation "
                f"{current} of it has registered since: this process belongs to a run that was restarted"))
        if hello.generation == current:
            sizes = {r.world_size for r in self.regs.values() if r.drafter_id == hello.drafter_id}
            if sizes and sizes != {hello.world_size}:
                return self._refuse(identity, P.E_CONFIG, (
                    f"drafter {hello.drafter_id} generation {current} has {sizes.pop()} ranks, "
                    f"this HELLO says {hello.world_size}"))
        return None

    def _refusal(self, identity: bytes, hello: P.Hello, now: float) -> Outbox | None:
        """The ERROR reply when this HELLO may not register, else None."""
        adm = self.admission
        # First the proof (cheap, and nothing below is told to a stranger), then the rate limit.
        if not proof_ok(hello_proof(adm.control_key, hello.drafter_id), hello.auth):
            return self.complain(identity, P.E_AUTH,
                                 f"HELLO for drafter {hello.drafter_id} without the run's control key "
                                 f"(<run_dir>/auth/control.key, same run directory as the target)")
        rank_name = f"{hello.drafter_id}.{hello.rank}"  # the rate limit is per rank: a drafter's ranks start together
        if now - self._last_hello.get(rank_name, -1e9) < 1.0:
            return self.complain(identity, P.E_BUSY,
                                 f"drafter {hello.drafter_id} rank {hello.rank} re-registers too fast; retry in a second")
        known = {(r.drafter_id, r.rank) for r in self.regs.values()}
        if (hello.drafter_id, hello.rank) not in known and len(known) >= adm.max_drafters:
            return self.complain(identity, P.E_BUSY,
                                 f"target already serves control.max_drafters={len(known)} drafter ranks")
        self._last_hello[rank_name] = now
        if len(self._last_hello) > 4 * adm.max_drafters:
            self._last_hello = {k: v for k, v in self._last_hello.items() if now - v < 1.0}
        if hello.config_hash != adm.config_hash:
            return self._refuse(identity, P.E_CONFIG, (
                f"config hash mismatch: drafter {hello.drafter_id} has {hello.config_hash}, target has {adm.config_hash}; "
                "start both from the same config file ([data] and [target] must match)"))
        if hello.transport != adm.transport:
            return self._refuse(identity, P.E_TRANSPORT, (
                f"transport mismatch: drafter {hello.drafter_id} uses {hello.transport}, target uses {adm.transport}"))
        if message := same_gpu_refusal(adm.transport, adm.gpu_uuid, hello.gpu_uuid, hello.drafter_id):
            return self._refuse(identity, P.E_TRANSPORT, message)
        if hello.replica != adm.replica:
            return self._refuse(identity, P.E_CONFIG, (
                f"drafter {hello.drafter_id} addressed replica {hello.replica}, but this target is replica "
                f"{adm.replica} of {adm.replicas}: check control.address / control.replica_addresses"))
        if hello.topology_id and hello.topology_id != adm.topology_id:
            return self._refuse(identity, P.E_CONFIG, (
                f"drafter {hello.drafter_id}'s checkpoint was made under topology {hello.topology_id}, this target "
                f"serves topology {adm.topology_id} ({adm.replicas} replicas of its plan): its per-replica coverage "
                "would name other batches; go back to that topology or start a new run (another run.name)"))
        total = self.scheduler.local_total
        if total is not None and not (hello.covered_watermark <= total and all(i < total for i in hello.covered_extra)):
            return self.complain(identity, P.E_RANGE, f"HELLO coverage lies beyond this replica's {total} batches")
        return None

    @staticmethod
    def _refuse(identity: bytes, code: str, message: str) -> Outbox:
        """A refusal an operator must see every time (a misconfigured drafter, not a flood)."""
        logger.warning("[hello] refused %s", message)
        return [(identity, P.Error(code, message))]

    def drop(self, reg: Registration, why: str, now: float) -> None:
        """End a registration: its unacknowledged batches go back to its group."""
        if self.regs.pop(reg.identity, None) is None:
            return
        reg.endpoint.stop()
        self.stopped_endpoints = [e for e in self.stopped_endpoints if e.is_alive()] + [reg.endpoint]
        self.scheduler.leave(reg.drafter_id, sorted(reg.inflight))
        if reg.held:
            # A live drafter may still be inside a step on pinned buffers: they are reused
            # only after the data plane's grace period for this reader.
            grace = self.data_plane.release_grace_s(reg.reader, reg.epoch, self.admission.heartbeat_timeout_s)
            self._deferred_release.append((now + grace, list(reg.held.values())))
            reg.held.clear()
        self.data_plane.forget_reader(reg.reader, reg.epoch)
        logger.info(
            "[drop] drafter %s rank %d (epoch %d) %s; %d unacknowledged batches go back to the drafter's stream",
            reg.drafter_id, reg.rank, reg.epoch, why, len(reg.inflight),
        )

    def close(self, now: float) -> Outbox:
        """The target is stopping: BYE to every registration, all dropped."""
        out: Outbox = []
        for reg in list(self.regs.values()):
            out.append((reg.identity, P.Bye(reason="target shutting down")))
            self.drop(reg, "target shutting down", now)
        return out

    # ---------------------------------------------------------------- data plane events
    def on_link_event(self, event: LinkEvent, now: float) -> None:
        """A data-plane thread sent a batch (its buffer is free) or failed (its registration is dropped)."""
        if event.ready is not None:
            if event.done_event is not None:
                event.ready.reader_events.append(event.done_event)  # before the release makes it reusable
            self.scheduler.release(event.ready)
        if event.kind == "failed":
            reg = next((r for r in self.regs.values() if r.endpoint is event.link), None)
            if reg is not None:
                self.drop(reg, f"data plane failed ({event.error})", now)

    def release_due(self, now: float) -> None:
        """Hand back the pinned buffers of dropped registrations whose grace period is over."""
        due = [item for item in self._deferred_release if item[0] <= now]
        if not due:
            return
        self._deferred_release = [item for item in self._deferred_release if item[0] > now]
        for _, readies in due:
            for ready in readies:
                self.scheduler.release(ready)

    # ---------------------------------------------------------------- dispatch
    def dispatch(self, now: float, dtype: str) -> Outbox:
        """Give every registration with credits the batches its group needs; DONE when it has had all."""
        out: Outbox = []
        for reg in list(self.regs.values()):
            while reg.credits > 0:
                ready = self.scheduler.take_for(reg.drafter_id)
                if ready is None:
                    break
                tag, slot = reg.endpoint.hand_over(ready)
                if reg.endpoint.pins_until_ack:
                    reg.held[ready.plan_index] = ready
                layout = ready.layout
                out.append((reg.identity, P.Batch(
                    batch_id=ready.plan_index, epoch=ready.epoch, bucket=ready.bucket, sample_ids=ready.sample_ids,
                    batch_size=layout.batch_size, seq_len=layout.seq_len, feature_dim=layout.feature_dim,
                    dtype=dtype, nbytes=layout.nbytes, tag=tag, num_tokens=ready.num_tokens, slot=slot,
                    from_cache=ready.from_cache,
                )))
                reg.credits -= 1
                if not reg.inflight:
                    reg.last_progress = now  # the ACK clock starts with the first batch held
                reg.inflight.add(ready.plan_index)
            if not reg.done_sent and not reg.inflight and self.scheduler.finished(reg.drafter_id):
                reg.done_sent = True
                out.append((reg.identity, P.Done(batches_served=self.scheduler.local_total or 0)))
                logger.info("[done] drafter %s has been served every batch of this replica; told rank %d",
                            reg.drafter_id, reg.rank)
        return out

    def heartbeat_and_reap(self, now: float, captured_batches: int, capture_stalled_s: float) -> Outbox:
        """Drop the silent and the hoarding; a HEARTBEAT to everyone else."""
        adm = self.admission
        out: Outbox = []
        for reg in list(self.regs.values()):
            if not reg.endpoint.paired and now - reg.registered_at < adm.pair_timeout_s:
                # Still building its model / warming up / forming the pair: bounded by the
                # data-plane timeout instead (a pair that never forms fails its link).
                continue
            if now - reg.last_seen > adm.heartbeat_timeout_s:
                self.drop(reg, f"silent for {now - reg.last_seen:.1f}s (heartbeat timeout {adm.heartbeat_timeout_s:.1f}s)",
                          now)
            elif reg.inflight and now - reg.last_progress > adm.ack_timeout_s:
                self.drop(reg, f"held {len(reg.inflight)} batches for {now - reg.last_progress:.0f}s without an ACK "
                               f"(control.ack_timeout_s {adm.ack_timeout_s:.0f}s)", now)
            else:
                out.append((reg.identity, P.Heartbeat(step=captured_batches, capture_stalled_s=capture_stalled_s)))
        return out

    # ---------------------------------------------------------------- observability
    def status_rows(self, now: float) -> list[P.DrafterStatus]:
        return [
            P.DrafterStatus(
                id=r.drafter_id, rank=r.rank, generation=r.generation, epoch=r.epoch, pid=r.pid, step=r.step,
                checkpoint_step=r.checkpoint_step, inflight=len(r.inflight),
                heartbeat_age_s=round(now - r.last_seen, 2), state=r.state,
            )
            for r in self.regs.values()
        ]
